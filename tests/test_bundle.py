"""The pieces of the ARM64 bundle that run without emulation: the relocatable kernel cache, the
launcher's CPU pick, the opencl extra's marker. The bundle itself is built, installed into a fresh
arm64 root and run there by toolchains/aarch64/check.py (`make test` runs it as a toolchain check)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNEL_RUN = textwrap.dedent('''
    import json, numpy as np
    from colibri_edge.backends.cpu import jitcache, kernels
    a = np.ones((2, 3), np.float32); out = np.empty_like(a)
    kernels.add(out, a, a)
    assert (out == 2).all()
    print(json.dumps(jitcache.counts()))
''')


def _counts(cache, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    e.update(COLIBRI_KERNEL_CACHE=str(cache), **env)
    p = subprocess.run([sys.executable, "-c", KERNEL_RUN], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_kernel_cache_is_counted_and_moves(tmp_path):
    """COLIBRI_KERNEL_CACHE: the first process compiles (counted), the next loads; the folder moved
    elsewhere still serves (keyed by module and source hash, not by path); another CPU compiles anew."""
    first = _counts(tmp_path / "a")
    assert first["compiled"] >= 1 and first["cached"] == 0
    assert os.listdir(tmp_path / "a") == ["colibri_edge.backends.cpu"]
    assert _counts(tmp_path / "a") == {"compiled": 0, "cached": 1}
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert _counts(tmp_path / "b") == {"compiled": 0, "cached": 1}
    other = _counts(tmp_path / "b", NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="")
    assert other["compiled"] >= 1 and other["cached"] == 0          # never another CPU's code


def test_locator_keys_by_content_not_path(tmp_path):
    from colibri_edge.backends.cpu.jitcache import RelocatableLocator
    src = open(os.path.join(ROOT, "backends", "cpu", "kernels.py"), "rb").read()
    for d in ("x", "y/z"):
        os.makedirs(tmp_path / d)
        (tmp_path / d / "kernels.py").write_bytes(src)
    (tmp_path / "changed.py").write_bytes(src + b"\n# changed\n")

    def f():
        pass
    f.__module__ = "colibri_edge.backends.cpu.kernels"
    before = os.environ.get("COLIBRI_KERNEL_CACHE")      # make test sets one for the suite's kernels
    os.environ["COLIBRI_KERNEL_CACHE"] = str(tmp_path / "cache")
    try:
        a, b, c = (RelocatableLocator.from_function(f, str(p)) for p in
                   (tmp_path / "x" / "kernels.py", tmp_path / "y" / "z" / "kernels.py", tmp_path / "changed.py"))
    finally:
        if before is None:
            del os.environ["COLIBRI_KERNEL_CACHE"]
        else:
            os.environ["COLIBRI_KERNEL_CACHE"] = before
    assert a.get_cache_path() == b.get_cache_path() == str(tmp_path / "cache" / "colibri_edge.backends.cpu")
    assert a.get_source_stamp() == b.get_source_stamp() != c.get_source_stamp()
    f.__module__ = "somebody_else"
    assert RelocatableLocator.from_function(f, str(tmp_path / "x" / "kernels.py")) is None


def test_launcher_picks_the_bundles_cpu(tmp_path, monkeypatch):
    from colibri_edge.serving import launch
    import llvmlite.binding as ll
    for cpu in ("cortex-a76", "generic"):
        os.makedirs(tmp_path / "kernel-cache" / cpu)
    monkeypatch.delenv("COLIBRI_CPU", raising=False)
    host = ll.get_host_cpu_name()
    assert launch.pick_cpu(str(tmp_path))[0] == "generic" and host in launch.pick_cpu(str(tmp_path))[1]
    os.makedirs(tmp_path / "kernel-cache" / host)
    assert launch.pick_cpu(str(tmp_path))[0] == host                    # the host's own CPU when bundled
    monkeypatch.setenv("COLIBRI_CPU", "cortex-a76")
    assert launch.pick_cpu(str(tmp_path)) == ("cortex-a76", "COLIBRI_CPU")
    # setup() before Numba: in a fresh process, the environment it leaves
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "COLIBRI_"))}
    env["COLIBRI_CPU"] = "cortex-a76"
    code = ("import os, sys; from colibri_edge.serving import launch; print(launch.setup(sys.argv[1])); "
            "print(os.environ['NUMBA_CPU_NAME'], repr(os.environ['NUMBA_CPU_FEATURES']), "
            "os.environ['COLIBRI_KERNEL_CACHE'])")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, check=True)
    assert p.stdout.splitlines()[1] == f"cortex-a76 '' {tmp_path / 'kernel-cache' / 'cortex-a76'}"


def test_opencl_extra_installs_pocl_only_on_x86_64():
    """pocl-binary-distribution has x86-64 wheels only: on aarch64 the extra must not ask for it."""
    import tomllib
    from packaging.requirements import Requirement
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["opencl"]
    board = {"platform_machine": "aarch64", "sys_platform": "linux", "python_version": "3.11", "extra": ""}
    pc = {**board, "platform_machine": "x86_64"}

    def names(env):
        return sorted(Requirement(r).name for r in extra
                      if Requirement(r).marker is None or Requirement(r).marker.evaluate(env))
    assert names(board) == ["pyopencl"]
    assert names(pc) == ["pocl-binary-distribution", "pyopencl"]
