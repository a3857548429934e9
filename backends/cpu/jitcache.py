"""Numba's on-disk cache (cache=True) checks only the source file of the function it compiled: a
kernel that inlines code from another file (qir.py's block decoders, kernels.py's dot products) would
be served stale from the cache after that file changed. drop_stale(globals(), deps) at the end of a
kernel module flushes the module's cached kernels when a hash of its dependencies changed."""
from __future__ import annotations

import hashlib
import os

from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher


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
