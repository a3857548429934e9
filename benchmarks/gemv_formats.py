"""Kernel GB/s per block format: the cpu backend's decode GEMV (one token) alone, on both activation
paths, each checked against the NumPy reference before it is timed (as llm.c's dev/cuda kernels).

    python benchmarks/gemv_formats.py [--rows 65536] [--cols 1024] [--threads 2] [--tokens 1] [FORMAT ...]

The matrix is larger than the last-level cache (65536 x 1024 weights: 37 MB at q4_0, 70 MB at q8_0),
so every call streams it from memory; GB/s = the matrix's stored bytes / the call's time, next to the
machine's read bandwidth (NumPy BLAS sgemv over a 512 MiB float32 matrix, as bench.py's probe).
--tokens T > 1 times the skinny GEMM instead (T tokens against each weight tile: batched decode, an
expert's few tokens); --rows 4096 keeps the matrix in the last-level cache, so the figure is the
kernel's arithmetic rate rather than the memory's. --pool P times calls over P distinct copies of the
matrix in turn (e.g. --rows 2816 --pool 160: an expert's matrix read cold, as decode reads experts
from a model far larger than the cache; a single large matrix can stay in a server's last-level
cache between calls). The header names the int8 dot instruction the
kernels were compiled with (qir.INT8_DOT: vpdpbusd where the CPU has AVX-VNNI or AVX-512 VNNI).
Not run by `make bench` (its figures come from whole models); the README quotes a run of it.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

def formats():
    from colibri_edge.model import quant
    return tuple(quant.BLOCK)


def stored(src, fmt, rng):
    """src in fmt: our quantiser, or for the lattice i-quants (no quantiser) random valid blocks with the
    f16 scale set to src's RMS (the kernels' speed does not depend on the values)."""
    from colibri_edge.model import quant
    if fmt in quant.QUANTIZERS:
        return quant.quantize(src, fmt)
    B, nb = quant.BLOCK[fmt]
    raw = rng.integers(0, 256, (src.shape[0], src.shape[1] // B, nb), dtype=np.uint8)
    d = np.frombuffer(np.float16(float(np.sqrt((src ** 2).mean())) / 16).tobytes(), np.uint16)[0]
    if fmt == "iq1_m":
        for j, at in enumerate((49, 51, 53, 55)):
            raw[..., at] = (raw[..., at] & 15) | (((int(d) >> (4 * j)) & 15) << 4)
    else:
        raw[..., 0:2] = np.frombuffer(np.uint16(d).tobytes(), np.uint8)
    return raw.reshape(src.shape[0], -1)


def best_seconds(fn, reps=5, inner=3):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def blas_probe(threads):
    from threadpoolctl import threadpool_limits
    a = np.ones((1 << 27) // 1024, np.float32).reshape(-1, 1) * np.ones((1, 1024), np.float32)   # 512 MiB
    x = np.ones(1024, np.float32)
    with threadpool_limits(threads):
        t = best_seconds(lambda: a @ x)
    return a.nbytes / t / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="*", default=None, help="block formats (default: every one)")
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1, help="activation rows (1: the decode GEMV)")
    ap.add_argument("--pool", type=int, default=1, help="distinct copies of the matrix, called in turn")
    a = ap.parse_args(argv)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(a.threads))
    from colibri_edge.model import quant
    from colibri_edge.backends.cpu import qkernels as Q
    from colibri_edge.backends.cpu.backend import KERNEL_VIEW
    from colibri_edge.backends.cpu.qir import INT8_DOT, PREFETCH
    N, K, th, T = a.rows, a.cols, a.threads, a.tokens
    rng = np.random.default_rng(0)
    src = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    none = np.zeros(0, np.float32)
    qx, dx, xs = np.zeros((T, K), np.int8), np.zeros((T, K // 32), np.float32), np.zeros((T, K // 32), np.float32)
    scratch = np.zeros((th, 6, K), np.float32)
    work = np.zeros((th, 8), np.int64)                  # the claim counters (kernels.claim), one row a thread
    out = np.zeros((T, N), np.float32)
    print(f"BLAS sgemv read bandwidth, {th} threads: {blas_probe(th):.1f} GB/s; int8 dots: {INT8_DOT}, "
          f"prefetch {PREFETCH} B; {N} x {K} weights{f' x {a.pool} copies called in turn' if a.pool > 1 else ''}, "
          f"{T} token{'s' if T > 1 else ''}")
    print("| format | bytes / weight | float32 activations GB/s (G multiply-adds/s) | int8 activations GB/s (G multiply-adds/s) |")
    print("|---|---:|---:|---:|")
    for fmt in a.formats or formats():
        raw = stored(src, fmt, rng)
        pool = np.stack([raw] * a.pool)                 # distinct memory, the same values
        ws = [pool[i].view(KERNEL_VIEW[fmt]).reshape(N, -1) for i in range(a.pool)]
        w = ws[0]
        ref = x.astype(np.float64) @ quant.dequantize(raw, fmt, K).astype(np.float64).T
        emu_q, emu_d, _ = quant.quantize_activations(x, quant.act_block(fmt))
        emu = (emu_q * np.repeat(emu_d, 32, axis=1)).astype(np.float64) @ quant.dequantize(raw, fmt, K).astype(np.float64).T
        row = []
        for name, fn, want in (("f32", lambda v: Q.qmatmul(out, x, v, none, work, scratch), ref),
                               ("i8", lambda v: Q.qmatmul_i8(out, x, v, none, work, qx, dx, xs, scratch), emu)):
            fn(w)
            err = np.abs(out - want).max() / np.abs(want).max()
            if err > 1e-4:
                raise SystemExit(f"{fmt} {name}: max rel err {err:.2e} against the reference: not timing it")

            def calls(fn=fn):
                for v in ws:
                    fn(v)
            t = best_seconds(calls) / len(ws)
            row.append(f"{raw.nbytes / t / 1e9:.1f} ({T * N * K / t / 1e9:.1f})")
        print(f"| {fmt} | {raw.nbytes / (N * K):.4f} | {row[0]} | {row[1]} |", flush=True)


if __name__ == "__main__":
    main()
