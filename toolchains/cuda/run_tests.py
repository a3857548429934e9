"""Run test files with pytest, or -- where pytest is not installed (the GPU check machine may lack
it) -- with a small stand-in that runs the same test functions: parametrize (stacked), fixtures
from conftest.py (params, session scope, yield), tmp_path, tmp_path_factory, request, skip, fail,
raises, importorskip. Only what tests/ uses; anything else is an error, not a silent pass.

    python toolchains/cuda/run_tests.py [--no-pytest] [-k SUBSTRING ...] [--junit FILE] tests/test_cuda.py ...

(COLIBRI_NO_PYTEST=1 forces the stand-in too: how gpu-check.sh's fallback is exercised here.)

-k keeps the tests whose id contains every given substring (a leading "not " excludes).
Exit status 0 when nothing failed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import itertools
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path


# -- the stand-in pytest module --------------------------------------------------------------------
class Skipped(Exception):
    pass


class Failed(AssertionError):
    pass


class _Mark:
    def __init__(self, name, args, kwargs):
        self.name, self.args, self.kwargs = name, args, kwargs


def _add_mark(fn, mark):
    fn.__dict__.setdefault("_mini_marks", []).insert(0, mark)
    return fn


class _MarkGen:
    def __getattr__(self, name):
        def make(*args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs and name not in ("parametrize", "skipif"):
                return _add_mark(args[0], _Mark(name, (), {}))
            return lambda fn: _add_mark(fn, _Mark(name, args, kwargs))
        return make


FIXTURES = {}


class _Fixture:
    def __init__(self, fn, params, scope):
        self.fn, self.params, self.scope, self.name = fn, params, scope, fn.__name__


def fixture(fn=None, *, params=None, scope="function", autouse=False, name=None):
    if autouse:
        raise NotImplementedError("mini runner: autouse fixtures are not supported")

    def reg(f):
        FIXTURES[name or f.__name__] = _Fixture(f, list(params) if params is not None else None, scope)
        return f
    return reg(fn) if fn is not None else reg


def skip(reason=""):
    raise Skipped(reason)


def fail(msg=""):
    raise Failed(msg)


def importorskip(modname, minversion=None, reason=None):
    try:
        return __import__(modname, fromlist=["_"])
    except ImportError as e:
        raise Skipped(reason or f"could not import {modname!r}: {e}")


class _Raises:
    def __init__(self, exc, match):
        self.exc, self.match, self.value = exc, match, None

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            raise Failed(f"DID NOT RAISE {self.exc}")
        if not issubclass(et, self.exc):
            return False
        if self.match and not re.search(self.match, str(ev)):
            raise Failed(f"{ev!r} does not match {self.match!r}")
        self.value = ev
        return True


def raises(exc, *args, match=None, **kw):
    if args:
        with _Raises(exc, match) as r:
            args[0](*args[1:], **kw)
        return r
    return _Raises(exc, match)


def make_stub():
    m = types.ModuleType("pytest")
    m.__dict__.update(mark=_MarkGen(), fixture=fixture, skip=skip, fail=fail, importorskip=importorskip,
                      raises=raises, Skipped=Skipped, Failed=Failed, __version__="0-mini")
    m.skip.Exception = Skipped
    return m


# -- collection and running --------------------------------------------------------------------------
class _Request:
    def __init__(self, param=None):
        self.param = param


class _TmpFactory:
    def __init__(self, root):
        self.root = root

    def mktemp(self, name, numbered=True):
        return Path(tempfile.mkdtemp(prefix=name + "-", dir=self.root))


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _param_sets(fn):
    """[(id, {argname: value})] from stacked parametrize marks."""
    marks = [m for m in fn.__dict__.get("_mini_marks", []) if m.name == "parametrize"]
    unknown = [m.name for m in fn.__dict__.get("_mini_marks", []) if m.name not in ("parametrize", "skipif", "slow",
                                                                                    "cuda", "opencl", "cpu")]
    if unknown:
        raise NotImplementedError(f"mini runner: marks {unknown} are not supported")
    axes = []
    for m in marks:
        names = [n.strip() for n in (m.args[0].split(",") if isinstance(m.args[0], str) else m.args[0])]
        vals = []
        for v in m.args[1]:
            v = v if len(names) > 1 else (v,)
            vals.append(("-".join(str(x) for x in v), dict(zip(names, v))))
        axes.append(vals)
    out = []
    for combo in itertools.product(*axes) if axes else [()]:
        ids, args = [], {}
        for i, a in combo:
            ids.append(i)
            args.update(a)
        out.append(("-".join(ids), args))
    return out


def _expand_fixture_params(fn, given):
    """Test arguments served by parametrized fixtures multiply the instances (as pytest does)."""
    names = [p for p in inspect.signature(fn).parameters if p not in given]
    axes = []
    seen = set()

    def walk(n):
        if n in seen or n not in FIXTURES:
            return
        seen.add(n)
        fx = FIXTURES[n]
        for dep in inspect.signature(fx.fn).parameters:
            walk(dep)
        if fx.params is not None:
            axes.append((n, fx.params))
    for n in names:
        walk(n)
    if not axes:
        return [("", {})]
    return [("-".join(str(v) for v in combo), dict(zip([a[0] for a in axes], combo)))
            for combo in itertools.product(*[a[1] for a in axes])]


class Runner:
    def __init__(self, tmp_root):
        self.tmp_root = tmp_root
        self.session = {"tmp_path_factory": _TmpFactory(tmp_root)}

    def resolve(self, name, fparams, cache, teardown):
        if name in cache:
            return cache[name]
        if name == "tmp_path":
            v = Path(tempfile.mkdtemp(prefix="t-", dir=self.tmp_root))
        elif name == "tmp_path_factory":
            v = self.session[name]
        elif name == "request":
            v = _Request()
        elif name in FIXTURES:
            fx = FIXTURES[name]
            key = (name, repr(fparams.get(name)))
            if fx.scope == "session" and key in self.session:
                return self.session[key]
            kw = {}
            for dep in inspect.signature(fx.fn).parameters:
                kw[dep] = _Request(fparams.get(name)) if dep == "request" else \
                    self.resolve(dep, fparams, cache, teardown)
            v = fx.fn(**kw)
            if inspect.isgenerator(v):
                gen, v = v, next(v)
                teardown.append(gen)
            if fx.scope == "session":
                self.session[key] = v
        else:
            raise NotImplementedError(f"mini runner: unknown fixture {name!r}")
        cache[name] = v
        return v

    def run_one(self, fn, args, fparams):
        cache, teardown = {}, []
        try:
            for m in fn.__dict__.get("_mini_marks", []):
                if m.name == "skipif" and m.args and m.args[0]:
                    raise Skipped(m.kwargs.get("reason", "skipif"))
            kw = dict(args)
            for p in inspect.signature(fn).parameters:
                if p not in kw:
                    kw[p] = self.resolve(p, fparams, cache, teardown)
            fn(**kw)
            return "passed", ""
        except Skipped as e:
            return "skipped", str(e)
        except BaseException as e:   # noqa: BLE001 (a test failure of any kind)
            if isinstance(e, KeyboardInterrupt):
                raise
            return "failed", "".join(traceback.format_exception(type(e), e, e.__traceback__)[-12:])
        finally:
            for g in reversed(teardown):
                with contextlib.suppress(StopIteration):
                    next(g)


def select(test_id, ks):
    for k in ks:
        k = k.strip()
        if k.startswith("not "):
            if k[4:].strip() in test_id:
                return False
        elif k not in test_id:
            return False
    return True


def run_mini(files, ks, junit=None):
    sys.modules["pytest"] = make_stub()
    tests_dir = os.path.dirname(os.path.abspath(files[0]))
    sys.path.insert(0, tests_dir)
    conf = os.path.join(tests_dir, "conftest.py")
    if os.path.exists(conf):
        _load(conf, "conftest")
    tmp_root = tempfile.mkdtemp(prefix="colibri-mini-pytest-")
    runner = Runner(tmp_root)
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    rows = []
    try:
        for f in files:
            mod = _load(os.path.abspath(f), "test_mod_" + re.sub(r"\W", "_", os.path.basename(f)[:-3]))
            for name, fn in list(vars(mod).items()):
                if not name.startswith("test_") or not callable(fn):
                    continue
                for pid, pargs in _param_sets(fn):
                    for fid, fparams in _expand_fixture_params(fn, pargs):
                        tid = f"{os.path.basename(f)}::{name}" + (f"[{'-'.join(x for x in (fid, pid) if x)}]"
                                                                if (fid or pid) else "")
                        if not select(tid, ks):
                            continue
                        t0 = time.perf_counter()
                        status, info = runner.run_one(fn, pargs, fparams)
                        dt = time.perf_counter() - t0
                        counts[status] += 1
                        rows.append((tid, status, dt, info))
                        line = f"{status.upper():7s} {tid} ({dt:.1f}s)"
                        if status == "skipped":
                            line += f": {info}"
                        print(line, flush=True)
                        if status == "failed":
                            print(info, flush=True)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    print(f"mini runner: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if junit:
        _write_junit(junit, rows)
    return 1 if counts["failed"] else 0


def _write_junit(path, rows):
    from xml.sax.saxutils import escape, quoteattr
    lines = ['<?xml version="1.0" encoding="utf-8"?>',
             f'<testsuite name="colibri-cuda" tests="{len(rows)}" '
             f'failures="{sum(r[1] == "failed" for r in rows)}" skipped="{sum(r[1] == "skipped" for r in rows)}">']
    for tid, status, dt, info in rows:
        lines.append(f'  <testcase name={quoteattr(tid)} time="{dt:.3f}">')
        if status == "failed":
            lines.append(f'    <failure>{escape(info)}</failure>')
        elif status == "skipped":
            lines.append(f'    <skipped message={quoteattr(info)}/>')
        lines.append('  </testcase>')
    lines.append('</testsuite>')
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("-k", action="append", default=[], help="keep ids containing this ('not X' excludes)")
    ap.add_argument("--no-pytest", action="store_true", help="use the stand-in even if pytest is installed")
    ap.add_argument("--junit", help="write a JUnit XML report here")
    a = ap.parse_args(argv)
    if os.environ.get("COLIBRI_NO_PYTEST") == "1":
        a.no_pytest = True
    if not a.no_pytest and importlib.util.find_spec("pytest") is not None:
        import pytest
        args = ["-q", "-ra", "-p", "no:cacheprovider", *a.files]
        if a.k:
            args += ["-k", " and ".join(f"({k})" for k in a.k)]
        if a.junit:
            args += [f"--junitxml={a.junit}"]
        print("pytest", " ".join(args), flush=True)
        return int(pytest.main(args))
    print("pytest is not installed here: running the tests with the stand-in runner", flush=True)
    return run_mini(a.files, a.k, a.junit)


if __name__ == "__main__":
    sys.exit(main())
