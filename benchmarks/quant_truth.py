"""llama.cpp-quantised files judged against their own truth (issue 43): for each type, llama.cpp's quantiser
(`llama_model_quantize`, its default mixing rules, no importance matrix) writes a file from the f16 GGUF of a
tiny K-quant-sized Mixtral; the file's truth is exact float math on its own weights: the same file with every
tensor dequantised by gguf-py and stored float32, run by llama.cpp with a float32 KV cache. Then, on a fixed
sequence of 64 tokens (logits at every position):

    err(position)  = max |logits - truth| / max |truth|          agree = argmax(logits) == argmax(truth)
    KL             = mean over positions of KL(softmax(f16 model) || softmax(logits))   (perplexity proxy)

for Colibri's cpu backend with float32 activations (the path the suite holds to 1e-4 on every backend), its
default int8-activation path, and llama.cpp on the quantised file itself (its default f16 KV cache). The issue's
bar: Colibri's int8 path's median err <= 1.5x llama.cpp's, argmax agreement no more than 0.05 below it.

    python benchmarks/quant_truth.py [--types Q2_K,Q3_K_M,...] [--tokens 64]   (needs the bench extra)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

TYPES = ("Q2_K", "Q3_K_M", "IQ4_XS", "IQ4_NL", "IQ3_S", "TQ2_0", "MXFP4_MOE")


def quantize(src: str, dst: str, ftype: str, threads: int) -> None:
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = threads
    if llama_cpp.llama_model_quantize(src.encode(), (dst + ".tmp").encode(), p) != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) failed")
    os.replace(dst + ".tmp", dst)


def llama_logits(path: str, ids: list, threads: int, f32_kv: bool = False) -> np.ndarray:
    from llama_cpp import Llama
    kw = dict(type_k=0, type_v=0) if f32_kv else {}
    # one token a batch: llama-cpp-python 0.3.36's batched matmul over quantised weights (n_batch > 1) dies with
    # SIGSEGV on these files on the 2026-12 AVX-512 host (f16 / f32 files run either way); per-token logits are
    # the same math
    llm = Llama(path, n_ctx=len(ids) + 8, n_batch=1, n_ubatch=1, n_threads=threads, logits_all=True, verbose=False,
                **kw)
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], np.float64)
    del llm
    return out


def colibri_logits(path: str, work: str, ids: list, **opts) -> np.ndarray:
    from colibri_edge import Engine
    from colibri_edge.model.convert import convert
    col = os.path.join(work, os.path.basename(path) + ".col")
    if not os.path.exists(os.path.join(col, "config.json")):
        convert(path, col, progress=False)
    with Engine.open(col, backend="cpu", max_seq_len=len(ids) + 8, **opts) as eng:
        return np.asarray(eng.infer(np.asarray(ids)), np.float64)


def judge(got: np.ndarray, truth: np.ndarray, f16: np.ndarray) -> dict:
    err = np.abs(got - truth).max(-1) / np.abs(truth).max()
    p = np.exp(f16 - f16.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    logq = got - got.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    kl = (p * (np.log(np.maximum(p, 1e-300)) - logq)).sum(-1).mean()
    return {"max_err": float(err.max()), "median_err": float(np.median(err)),
            "agree": float((got.argmax(-1) == truth.argmax(-1)).mean()), "kl_vs_f16": float(kl)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("COLIBRI_NUM_THREADS") or os.cpu_count()))
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "colibri_quant_truth"))
    ap.add_argument("--json", default=os.path.join(HERE, "results", "quant_truth.json"))
    a = ap.parse_args()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    import gguf_models as gm
    # llama.cpp runs in its own process: libllama's threads beside Numba's in one process crash (seen: SIGSEGV
    # after a llama.cpp run, then Colibri's first cpu kernel)
    from concurrent.futures.process import BrokenProcessPool

    def pool():
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    peer = pool()
    os.makedirs(a.dir, exist_ok=True)
    hf = os.path.join(a.dir, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        gm.build("mixtral_k", hf)
    f16 = os.path.join(a.dir, "f16.gguf")
    if not os.path.exists(f16):
        gm.to_gguf(hf, f16, "f16")
    V = len(gm.build_tokenizer(os.path.join(a.dir, "tok")))
    ids = np.random.default_rng(0).integers(0, V, a.tokens).tolist()
    base = peer.submit(llama_logits, f16, ids, a.threads, True).result()
    rows = []
    print(f"tiny Mixtral (hidden 256, 4 experts, 2 layers), {a.tokens} tokens, {a.threads} threads; err = max |Δlogit| "
          "/ max |truth logit| per position")
    print("| type | Colibri float32 act. max err | Colibri int8 act. median err | llama.cpp median err | ratio | "
          "argmax agree (int8 / llama.cpp) | KL vs f16 (int8 / llama.cpp) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t in a.types.split(","):
        q, truth_path = os.path.join(a.dir, f"{t}.gguf"), os.path.join(a.dir, f"{t}-truth.gguf")
        try:
            if not os.path.exists(q):
                peer.submit(quantize, f16, q, t, a.threads).result()
            gm.rewrite_gguf(q, truth_path, dequantize=True)
        except Exception as e:                          # llama.cpp's quantiser refuses some types without imatrix
            print(f"| {t} | refused: {str(e)[:80]} | | | | | |")
            continue
        truth = peer.submit(llama_logits, truth_path, ids, a.threads, True).result()
        res = {"type": t, "colibri_float": judge(colibri_logits(q, a.dir, ids, int8_activations=False), truth, base),
               "colibri_int8": judge(colibri_logits(q, a.dir, ids), truth, base)}
        try:
            res["llama.cpp"] = judge(peer.submit(llama_logits, q, ids, a.threads).result(), truth, base)
        except BrokenProcessPool:                   # llama.cpp died on its own file (SIGSEGV): said, not hidden
            res["llama.cpp"] = None
            peer = pool()
        ci, ll = res["colibri_int8"], res["llama.cpp"]
        rows.append(res)
        if ll is None:
            print(f"| {t} | {res['colibri_float']['max_err']:.1e} | {ci['median_err']:.2e} | llama.cpp crashed on "
                  f"its own file | | {ci['agree']:.2f} / - | {ci['kl_vs_f16']:.4f} / - |", flush=True)
            continue
        res["median_ratio"] = ci["median_err"] / max(ll["median_err"], 1e-12)
        print(f"| {t} | {res['colibri_float']['max_err']:.1e} | {ci['median_err']:.2e} | {ll['median_err']:.2e} | "
              f"{res['median_ratio']:.2f} | {ci['agree']:.2f} / {ll['agree']:.2f} | {ci['kl_vs_f16']:.4f} / "
              f"{ll['kl_vs_f16']:.4f} |", flush=True)
    peer.shutdown()
    with open(a.json, "w") as f:
        json.dump({"tokens": a.tokens, "threads": a.threads, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
