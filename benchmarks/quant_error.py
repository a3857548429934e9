"""Our quantisers (colibri_edge/model/quant.py) against llama.cpp's, on the same float32 weights.

For each block format, llama.cpp quantises the benchmark model's float32 GGUF with every tensor in that
format (`llama_model_quantize`, `pure`, no importance matrix); the same float32 tensors go through our
quantiser; both are dequantised by gguf-py, and each is compared with the float32 original:

    rms(fmt) = sqrt(mean((deq(q(w)) - w)^2))      ratio = rms_ours / rms_llama.cpp   (target <= 1.05)

and our decode of llama.cpp's bytes against gguf-py's dequantisation of them (decode_rms_vs_gguf: 0).

Sampled tensors: one layer's three stacked expert matrices, its attention q and output projections,
and the lm_head -- every kind of row the model has. Run by bench.py (results in bench.json/.md), or
alone: `python benchmarks/quant_error.py MODEL-f32.gguf OUT.json`.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

# format -> llama.cpp's file type that, with `pure`, writes every matrix in that format
FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
          "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1", "q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
          "q5_k": "LLAMA_FTYPE_MOSTLY_Q5_K_S", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
          "q3_k": "LLAMA_FTYPE_MOSTLY_Q3_K_S", "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
          "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS", "tq2_0": "LLAMA_FTYPE_MOSTLY_TQ2_0"}
SAMPLE = ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
          "blk.0.attn_q.weight", "blk.0.attn_output.weight", "output.weight")


def llama_quantize(src: str, dst: str, fmt: str, threads: int = 2) -> float:
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, FTYPES[fmt])
    p.nthread = threads
    p.pure = True
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(src.encode(), (dst + ".tmp").encode(), p)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({fmt}) returned {rc}")
    os.replace(dst + ".tmp", dst)
    return time.perf_counter() - t0


def rows(t) -> np.ndarray:
    """A GGUF tensor's data as 2-D rows (stacked experts [E, N, K] -> [E*N, K])."""
    a = np.asarray(t.data)
    return a.reshape(-1, a.shape[-1])


def measure(f32_path: str, work: str, formats=tuple(FTYPES), threads: int = 2, log=print) -> dict:
    import gguf
    from colibri_edge.model import quant
    src = gguf.GGUFReader(f32_path)
    ref = {t.name: t for t in src.tensors if t.name in SAMPLE}
    missing = set(SAMPLE) - set(ref)
    if missing:
        raise SystemExit(f"{f32_path} has no {sorted(missing)}")
    out = {"tensors": list(SAMPLE), "formats": {}}
    for fmt in formats:
        dst = os.path.join(work, f"model-pure-{fmt}.gguf")
        secs = llama_quantize(f32_path, dst, fmt, threads)
        got = {t.name: t for t in gguf.GGUFReader(dst).tensors if t.name in SAMPLE}
        se_l = se_o = n = 0.0
        per = {}
        for name in SAMPLE:
            w = rows(ref[name]).astype(np.float32)
            t = got[name]
            if t.tensor_type.name.lower() != fmt:
                per[name] = {"skipped": f"llama.cpp wrote {t.tensor_type.name}"}
                continue
            K = w.shape[1]
            ll = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, K)
            decode = quant.dequantize(np.asarray(t.data).reshape(ll.shape[0], -1), fmt, K)   # our decode, same bytes
            ours = quant.dequantize(quant.quantize(w, fmt), fmt, K)
            el, eo = float(((ll - w) ** 2).sum()), float(((ours - w) ** 2).sum())
            per[name] = {"rms_llama": (el / w.size) ** 0.5, "rms_ours": (eo / w.size) ** 0.5,
                         "ratio": (eo / el) ** 0.5 if el else None,
                         "decode_rms_vs_gguf": float(np.sqrt(((decode - ll) ** 2).mean()))}     # must be 0
            se_l, se_o, n = se_l + el, se_o + eo, n + w.size
        os.remove(dst)
        res = {"llama_quantize_s": secs, "per_tensor": per}
        if n:
            res.update(rms_llama=(se_l / n) ** 0.5, rms_ours=(se_o / n) ** 0.5, ratio=(se_o / se_l) ** 0.5)
        out["formats"][fmt] = res
        log(f"quantiser RMS {fmt}: ours {res.get('rms_ours', float('nan')):.5f}, llama.cpp "
            f"{res.get('rms_llama', float('nan')):.5f}, ratio {res.get('ratio', float('nan')):.3f}")
    return out


if __name__ == "__main__":
    r = measure(sys.argv[1], os.path.dirname(os.path.abspath(sys.argv[2])))
    with open(sys.argv[2], "w") as f:
        json.dump(r, f, indent=1)
