"""Decode GEMV per weight format on the CUDA backend (run by gpu-check.sh; llm.c's dev/cuda pattern):
each format's skinny kernel (one token, the decode path) is first checked against the NumPy
reference backend on the same bytes, then timed; GB/s = the matrix's stored bytes / kernel time,
and the ratio to float16's GB/s and to float16's time per weight.

    python toolchains/cuda/gemv_formats.py [--out gemv.json] [--k 4096] [--mib 256] [--reps 50]

A matrix of K = 4096 columns and as many rows as make --mib MiB in that format (past the L2 cache
of any GPU we target, 50 MiB on an H100/H200), built by tiling one quantised 64-row block (our own
quantisers, colibri_edge.model.quant; the lattice i-quants, which have none: random valid blocks, the f16
scale set to the source's RMS): valid blocks, no minutes spent quantising. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--formats", help="comma-separated (default: every weight type the backend runs)")
    a = ap.parse_args(argv)
    from colibri_edge.model import quant
    from colibri_edge.backends import create
    from colibri_edge.model.dtypes import narrow, QUANTIZED
    be, ref = create("cuda"), create("reference")
    K = a.k
    rng = np.random.default_rng(0)
    src = rng.standard_normal((64, K), dtype=np.float32) / np.float32(np.sqrt(K))
    fmts = a.formats.split(",") if a.formats else list(be.weight_dtypes)
    x = rng.standard_normal((1, K), dtype=np.float32)
    xd = be.to_device(x, "float32")
    res = {"k": K, "mib": a.mib, "device": be.describe(), "formats": {}}
    for fmt in fmts:
        scales = None
        if fmt in quant.QUANTIZERS:
            block = quant.quantize(src, fmt)
        elif fmt in quant.BLOCK:                     # a lattice i-quant: random valid blocks (d at 0; iq1_m: nibbles)
            B, nb = quant.BLOCK[fmt]
            raw = rng.integers(0, 256, (64, K // B, nb), dtype=np.uint8)
            d = int(np.float16(float(np.sqrt((src ** 2).mean())) / 16).view(np.uint16))
            if fmt == "iq1_m":
                for j, at in enumerate((49, 51, 53, 55)):
                    raw[..., at] = (raw[..., at] & 15) | (((d >> (4 * j)) & 15) << 4)
            else:
                raw[..., 0], raw[..., 1] = d & 255, d >> 8
            block = raw.reshape(64, -1)
        elif fmt in QUANTIZED:                       # int8: per-row scales
            s = np.abs(src).max(axis=1) / 127
            block = np.clip(np.rint(src / s[:, None]), -127, 127).astype(np.int8)
            scales = s.astype(np.float32)
        else:
            block = narrow(src, fmt)
        row_bytes = block.nbytes // 64
        N = max(64, int(a.mib * 2 ** 20 / row_bytes) // 64 * 64)
        host = np.tile(block, (N // 64, 1))
        w = be.upload(host, fmt, scales=None if scales is None else np.tile(scales, N // 64), shape=(N, K))
        out = be.alloc((1, N))
        be.matmul(out, xd, w)                        # compiled, warm, and checked before it is timed
        want = np.zeros((1, 64), np.float32)
        ref.matmul(want, x, ref.upload(block, fmt, scales=scales, shape=(64, K)))
        got = be.download(out)
        err = float(np.abs(got[:, :64] - want).max() / max(1e-6, np.abs(want).max()))
        same = bool(np.array_equal(got[:, 64:128], got[:, :64])) if N >= 128 else True
        if not err < 1e-4 or not same:
            res["formats"][fmt] = {"error": f"checked against the reference: rel. error {err:.2g}, tiles equal {same}"}
            print(f"{fmt}: FAILED the check ({res['formats'][fmt]['error']})", flush=True)
            continue
        be.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            be.matmul(out, xd, w)
        be.synchronize()
        dt = (time.perf_counter() - t0) / a.reps
        nbytes = host.nbytes + (0 if scales is None else 4 * N)
        res["formats"][fmt] = {"rows": N, "bytes": nbytes, "us": round(dt * 1e6, 2),
                               "gb_s": round(nbytes / dt / 1e9, 3), "ns_per_kweights": round(dt / (N * K) * 1e12, 4),
                               "rel_err": err}
        del w, host
    f16 = res["formats"].get("float16", {})
    for fmt, r in res["formats"].items():
        if "gb_s" in r and "gb_s" in f16:
            r["gb_s_vs_f16"] = round(r["gb_s"] / max(f16["gb_s"], 1e-9), 2)
            r["speed_per_weight_vs_f16"] = round(f16["ns_per_kweights"] / r["ns_per_kweights"], 2)
        print(f"{fmt:9s} " + (r.get("error") or f"{r['gb_s']:8.1f} GB/s ({r.get('gb_s_vs_f16', '-')}x float16's), "
                                                f"{r.get('speed_per_weight_vs_f16', '-')}x float16's weights/s, "
                                                f"{r['rows']} x {K}, {r['us']} us"), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all("gb_s" in r for r in res["formats"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
