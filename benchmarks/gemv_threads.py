"""Colibri's cpu matmul alone (T=1, a GEMV) over every expert matrix of a model, at 1 and 2 threads:
the weight-read GB/s the kernel reaches without the rest of the decode step. Not part of `make bench`;
a diagnostic for the kernels (bench.md's profile shows the same ops inside a real decode step).

    python benchmarks/gemv_threads.py benchmarks/cache/full/colibri-float16 [threads ...]
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np


def measure(path: str, threads: int, reps: int = 5) -> dict:
    from colibri_edge import Engine
    eng = Engine.open(path, backend="cpu", max_batch=1, max_seq_len=64, prefill_chunk=16, num_threads=threads)
    be = eng.backend
    ws = [w for moe in eng.runner.program.moe for f in moe.experts for w in (f.gate, f.up, f.down)]
    rng = np.random.default_rng(0)
    xs = {n: rng.standard_normal((1, n)).astype(np.float32) for n in {w.shape[1] for w in ws}}
    outs = {n: np.zeros((1, n), np.float32) for n in {w.shape[0] for w in ws}}
    nbytes = sum(w.data.nbytes for w in ws)
    for w in ws[:6]:
        be.matmul(outs[w.shape[0]], xs[w.shape[1]], w)
    best = 0.0
    for _ in range(reps):              # every pass streams all experts: far more than any cache
        t0 = time.perf_counter()
        for w in ws:
            be.matmul(outs[w.shape[0]], xs[w.shape[1]], w)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return {"dtype": eng.config["weight_dtype"], "threads": threads, "mb": nbytes / 1e6, "best_gbps": best}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "--one":
        r = measure(argv[1], int(argv[2]))
        print(f"{r['dtype']:9s} threads={r['threads']}  {r['mb']:.0f} MB of expert matrices  best {r['best_gbps']:.1f} GB/s")
        return
    path, threads = argv[0], [int(t) for t in argv[1:]] or [1, 2]
    for t in threads:                  # one process per thread count: Numba's pool is sized at start
        env = {**os.environ, "NUMBA_NUM_THREADS": str(max(threads))}
        subprocess.run([sys.executable, __file__, "--one", path, str(t)], env=env, check=True)


if __name__ == "__main__":
    main()
