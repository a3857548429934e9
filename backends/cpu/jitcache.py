"""Numba's on-disk cache of the cpu kernels: staleness, relocation, and a count of what compiled.

- Numba's cache (cache=True) checks only the source file of the function it compiled: a kernel that
  inlines code from another file (qir.py's block decoders, kernels.py's dot products) would be served
  stale after that file changed. drop_stale(globals(), deps) at the end of a kernel module flushes the
  module's cached kernels when a hash of its dependencies changed.
- COLIBRI_KERNEL_CACHE=DIR (set by an ARM64 bundle's launcher, toolchains/aarch64): the kernels' cache
  lives in DIR, keyed by module name and a hash of the source file instead of Numba's default (a folder
  named after the file's absolute path, stamped with its mtime), so a cache built under emulation in
  one place is valid on the board in another. Numba keys each entry by signature and target CPU
  (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES) as usual, so a cache built for another CPU is never used.
- counts(): kernels compiled and loaded from the cache in this process (Numba's "numba:compile" event
  fires only on a real compile, after the cache missed), so "the first run compiled nothing" is counted.

Import this module before any cache=True kernel is defined (kernels.py does): Numba picks the cache
locator when the decorator runs."""
from __future__ import annotations

import hashlib
import os
import threading

from numba.core import caching, event
from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher

CACHE_ENV = "COLIBRI_KERNEL_CACHE"
PACKAGE = "colibri_edge."


class RelocatableLocator(caching._CacheLocator):
    """DIR/<package of the module>/, source stamped by content: valid wherever the package is installed."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(os.environ[CACHE_ENV], py_func.__module__.rpartition(".")[0])
        self._stamp = None

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        if self._stamp is None:
            with open(self._py_file, "rb") as f:
                self._stamp = hashlib.sha256(f.read()).hexdigest()
        return self._stamp

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.environ.get(CACHE_ENV) or not py_func.__module__.startswith(PACKAGE):
            return None
        self = cls(py_func, py_file)
        try:
            self.ensure_cache_path()
        except OSError:             # read-only: Numba's own locators (or an in-memory compile) take over
            return None
        return self


_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl     # renamed public in Numba 0.61
if RelocatableLocator not in _IMPL._locator_classes:
    _IMPL._locator_classes.insert(0, RelocatableLocator)


class _CompileCounter(event.Listener):
    """Counts real compiles ("numba:compile" fires after the disk cache missed), nested ones included."""

    def __init__(self):
        self.compiled = 0
        self._lock = threading.Lock()

    def on_start(self, ev):
        with self._lock:
            self.compiled += 1

    def on_end(self, ev):
        pass


_COUNTER = _CompileCounter()
event.register("numba:compile", _COUNTER)


def counts() -> dict:
    """{'compiled': kernels (signatures) Numba compiled in this process, 'cached': loaded from the
    disk cache} -- over this package's kernels (the compiled count over every Numba function)."""
    import sys
    cached = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith(PACKAGE + "backends.cpu") and mod is not None:
            for v in vars(mod).values():
                if isinstance(v, Dispatcher) and v.py_func.__module__ == name:
                    cached += sum(v.stats.cache_hits.values())
    return {"compiled": _COUNTER.compiled, "cached": cached}


def drop_stale(namespace: dict, *deps: str) -> None:
    """namespace: the kernel module's globals(); deps: the files (paths) its kernels inline."""
    h = hashlib.sha256()
    for d in deps:
        with open(d, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()
    mine = [v for v in namespace.values() if isinstance(v, Dispatcher) and not isinstance(v._cache, NullCache)
            and v.py_func.__module__ == namespace["__name__"]]
    if not mine:
        return
    marker = os.path.join(mine[0]._cache.cache_path, os.path.basename(namespace["__file__"]) + ".deps")
    try:
        with open(marker) as f:
            if f.read() == digest:
                return
    except OSError:
        pass
    try:
        for d in mine:
            d._cache.flush()
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as f:
            f.write(digest)
    except OSError:         # a read-only cache folder: Numba then compiles in memory anyway
        pass
