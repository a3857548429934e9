"""`colibri probe-device`: measure this machine into a device profile for `colibri simulate --device this`.

What the simulator's estimate needs (simulate.estimate), measured the way the engine spends it:
  memory_bandwidth_gbs  the cpu backend's own decode GEMV (kernels.matmul, one token, float16 rows, the
                        engine's threads) over a matrix larger than the caches: the rate at which a
                        decode step reads resident weights (bandwidth_efficiency is then 1: it is
                        already the kernel's rate, not the bus's)
  miss_bandwidth_gbs    positioned reads of expert-blob size at random offsets of a file in --dir whose
                        pages were dropped from the page cache first (posix_fadvise DONTNEED after
                        fsync): what a slot miss costs when its expert was never read
  reread_bandwidth_gbs  the same offsets read again after their pages were dropped once more, as the slot
                        pool drops what it reads: what a miss costs for an expert that was in a slot
                        before. Equal to miss_bandwidth_gbs on a device whose storage keeps no cache of
                        its own; on a VM the host's cache often serves these (2026-12-02 host: 1.3 GB/s
                        cold, several GB/s re-read)
  page_cache_gbs        the same reads again, now from the page cache (a miss whose pages are cached)
  parallel_miss_bandwidth_gbs  cold buffered reads with io_threads of them in flight (the slot pool's I/O
                        threads: a layer's misses are issued together)
  direct_io             O_DIRECT against buffered cold reads, io_threads in flight, on the same offsets:
                        {"device": st_dev of the file, "use": direct at least DIRECT_GAIN x buffered,
                        "direct_gbs", "buffered_gbs", "why"}; the slot pool reads the verdict for a model
                        on that device (COLIBRI_DIRECT_IO=auto). Direct reads skip the kernel's copy out of
                        the page cache (CPU time on the cores that also compute) and any readahead
  layer_overhead_ms     a decode step of the demo model less its weight reads at memory_bandwidth_gbs, per
                        layer: the cost that does not scale with a layer's size (Python, launches)
  memory_bytes          what this process may allocate (colibri_edge.memory.host_available)
Nothing here is timed against a threshold; the numbers are what they are on this machine.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time

import numpy as np

from ..analysis.simulate import profile_path
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT


def _best(fn, reps=5):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memory_bandwidth(mib: int) -> float:
    """GB/s of the cpu backend's one-token float16 GEMV over `mib` MiB of weights (best of 5)."""
    from colibri_edge.backends import create
    be = create("cpu")
    K = 4096
    N = max(64, (mib << 20) // (2 * K))
    host = np.random.default_rng(0).standard_normal((N, K)).astype(np.float16)
    w = be.upload(host, "float16")
    x, out = be.alloc((1, K)), be.alloc((1, N))
    be.upload_into(x, np.ones((1, K), np.float32))
    be.matmul(out, x, w)                                               # compiled and warm
    try:
        return host.nbytes / _best(lambda: be.matmul(out, x, w)) / 1e9
    finally:
        be.close()


def storage_bandwidth(directory: str, file_mib: int, blob: int, reads: int = 64,
                      existing: str | None = None) -> tuple[float, float, float]:
    """(cold, reread, cached) GB/s of `reads` positioned reads of `blob` bytes at random blob-aligned
    offsets of a `file_mib` MiB file in `directory` (or of the file `existing`, read only: a model's
    weights, as the slot pool reads them): first with its pages dropped from the page cache, then the
    same offsets with their pages dropped again (a re-miss), then again cached."""
    if existing is not None:
        fd, path = os.open(existing, os.O_RDONLY), None
        size = os.path.getsize(existing)
    else:
        size = max(file_mib << 20, blob * 4)
        fd, path = tempfile.mkstemp(prefix="colibri-probe-", dir=directory)
    try:
        if path is not None:
            chunk = np.random.default_rng(1).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()
            for _ in range(-(-size // len(chunk))):
                os.write(fd, chunk)
            os.fsync(fd)
        n = size // blob
        offsets = np.random.default_rng(2).choice(n, size=min(reads, n), replace=False) * blob

        def read_all():
            for o in offsets:
                os.pread(fd, blob, int(o))
        def dropped_read():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            read_all()
            return len(offsets) * blob / (time.perf_counter() - t) / 1e9
        cold = dropped_read()
        reread = dropped_read()
        cached = len(offsets) * blob / _best(read_all, 3) / 1e9
        return cold, reread, cached
    finally:
        os.close(fd)
        if path is not None:
            os.unlink(path)


DIRECT_GAIN = 1.05     # direct I/O is chosen when its cold reads are at least this much faster


def read_modes(path: str, blob: int, reads: int = 32, threads: int = 4) -> dict:
    """GB/s of cold reads of `blob` bytes (rounded up to pages) at random page-aligned offsets of the file
    `path`, `threads` reads in flight: buffered (page cache dropped before) and O_DIRECT (None where the
    filesystem refuses it: tmpfs, some overlays). -> {"buffered_gbs", "direct_gbs", "direct_error"}."""
    from concurrent.futures import ThreadPoolExecutor
    from ..runtime.slots import PAGE, aligned_host
    size = os.path.getsize(path)
    blob = -(-blob // PAGE) * PAGE
    n = max(size // blob, 1)
    offsets = [int(o) * blob for o in np.random.default_rng(3).choice(n, size=min(reads, n), replace=False)]
    bufs = aligned_host(threads, blob)

    def timed(fd):
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        free = list(range(threads))
        def one(o):
            i = free.pop()
            try:
                os.preadv(fd, [memoryview(bufs[i])], o)
            finally:
                free.append(i)
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, offsets))
        return len(offsets) * blob / (time.perf_counter() - t) / 1e9

    out = {"direct_gbs": None, "direct_error": None}
    fd = os.open(path, os.O_RDONLY)
    try:
        out["buffered_gbs"] = timed(fd)
    finally:
        os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError as err:
        out["direct_error"] = err.strerror
        return out
    try:
        out["direct_gbs"] = timed(fd)
    except OSError as err:
        out["direct_error"] = err.strerror
    finally:
        os.close(fd)
    return out


def direct_io_verdict(path: str, blob: int, threads: int = 4) -> dict:
    m = read_modes(path, blob, threads=threads)
    buf, d = m["buffered_gbs"], m["direct_gbs"]
    if d is None:
        use, why = False, f"O_DIRECT refused on this filesystem ({m['direct_error']}); buffered {buf:.2f} GB/s"
    else:
        use = d >= DIRECT_GAIN * buf
        why = (f"cold reads, {threads} in flight: direct {d:.2f} GB/s, buffered {buf:.2f} GB/s -> "
               f"{'direct' if use else 'buffered'}")
    return {"device": os.stat(path).st_dev, "use": bool(use), "direct_gbs": None if d is None else round(d, 3),
            "buffered_gbs": round(buf, 3), "threads": threads, "why": why}


def layer_overhead_ms(bandwidth_gbs: float) -> float:
    """The demo model's decode step time less its weight reads at bandwidth_gbs, per layer (ms, median
    of 32 steps): the cost of a layer's kernel launches and Python that does not scale with its size."""
    from ..model.demo import ensure_default_model
    from ..requests.engine import Engine, Stats
    from ..analysis.sizing import summary
    with Engine.open(ensure_default_model()[0], backend="cpu") as eng:
        eng.generate([1, 2, 3], max_new_tokens=8, ignore_eos=True)
        eng.stats = Stats()                                            # the timed steps only
        eng.generate([4, 5, 6], max_new_tokens=33, ignore_eos=True)
        ms = eng.stats.step_ms()["p50"]
        read_ms = summary(eng.model, 1)["bytes_per_decoded_token"] / (bandwidth_gbs * 1e9) * 1e3
        layers = eng.config["num_hidden_layers"]
    return max(ms - read_ms, 0.0) / layers


def probe(directory: str | None = None, mem_mib: int = 512, file_mib: int = 256, blob: int = 6 << 20,
          weights_file: str | None = None) -> dict:
    """The profile (module docstring). weights_file: measure storage on that file (read only) instead of
    a file of our own in `directory`."""
    from ..memory import host_available
    directory = directory or tempfile.gettempdir()
    if not os.path.isdir(directory):
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--dir {directory}: not a directory; give the one the "
                           "model files live on (storage speed is per device)")
    for name, v, lo in (("--mem-mib", mem_mib, 8), ("--file-mib", file_mib, 1), ("--blob", blob, 4096)):
        if v < lo:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={v}: at least {lo}")
    bw = memory_bandwidth(mem_mib)
    cold, reread, cached = storage_bandwidth(directory, file_mib, blob, existing=weights_file)
    if weights_file is not None:
        direct = direct_io_verdict(weights_file, blob)
    else:
        fd, path = tempfile.mkstemp(prefix="colibri-probe-", dir=directory)
        try:
            chunk = np.random.default_rng(1).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()
            for _ in range(max(file_mib, -(-blob * 8 >> 20))):
                os.write(fd, chunk)
            os.fsync(fd)
            direct = direct_io_verdict(path, blob)
        finally:
            os.close(fd)
            os.unlink(path)
    avail, what = host_available()
    return {"name": f"this machine ({platform.machine()}, {os.cpu_count()} CPUs; {platform.node()})",
            "memory_bytes": int(avail), "memory_limit": what, "memory_bandwidth_gbs": round(bw, 2),
            "bandwidth_efficiency": 1.0, "unified_memory": True,
            "miss_source": f"{weights_file or 'storage under ' + directory} (page cache dropped)",
            "miss_bandwidth_gbs": round(cold, 3), "reread_bandwidth_gbs": round(reread, 3),
            "page_cache_gbs": round(cached, 2), "blob_bytes": int(blob),
            "parallel_miss_bandwidth_gbs": direct["buffered_gbs"], "direct_io": direct,
            "layer_overhead_ms": round(layer_overhead_ms(bw), 4),
            "probed": time.strftime("%Y-%m-%d %H:%M:%S")}


def save(prof: dict, path: str | None = None) -> str:
    path = path or profile_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)
    return path
