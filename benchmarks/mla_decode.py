"""Latent attention's decode step at a long context against a short one (issue 17).

A random DeepSeek-V2-Lite-shaped checkpoint (hidden 2048, 16 heads, kv_lora_rank 512, rope key 64,
nope 128, values 128, a plain q projection; few layers and small experts so it builds in seconds),
converted to float32, then on one backend: a prompt of C tokens, then decode steps timed. The latent
cache is what a step reads per cached position ((512 + 64) x 4 bytes per layer, every head at once);
the step time's growth from C = 64 to C = 2048 is that read plus the softmax. Prints ms per decode
step at each context, the ratio, the cache bytes read per step and the bandwidth they reach.

    python benchmarks/mla_decode.py [--backend cpu] [--layers 2] [--contexts 64,2048] [--steps 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))


def build(d: str, layers: int) -> str:
    import torch
    import transformers
    from hf_models import randomize
    from colibri_edge.model.convert import convert
    hf, col = os.path.join(d, "hf"), os.path.join(d, "col")
    if os.path.exists(os.path.join(col, "config.json")):
        return col
    cfg = transformers.DeepseekV2Config(
        vocab_size=1024, hidden_size=2048, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0,
        max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, cfg)
    model.save_pretrained(hf)
    convert(hf, col, progress=False)
    return col


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--contexts", default="64,2048")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "colibri_mla_bench"))
    a = ap.parse_args()
    from colibri_edge import Engine
    col = build(a.dir, a.layers)
    contexts = [int(c) for c in a.contexts.split(",")]
    rng = np.random.default_rng(0)
    per_pos = a.layers * (512 + 64) * 4
    out = {}
    with Engine.open(col, backend=a.backend, max_seq_len=max(contexts) + a.steps + 1,
                     kv_cache_tokens=max(contexts) + a.steps + 16) as eng:
        for C in contexts:
            prompt = rng.integers(0, 1024, C).tolist()
            eng.generate(prompt, max_new_tokens=2, ignore_eos=True)          # warm: compiles, caches
            t0 = time.perf_counter()
            eng.generate(prompt, max_new_tokens=1, ignore_eos=True)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            eng.generate(prompt, max_new_tokens=1 + a.steps, ignore_eos=True)
            decode = (time.perf_counter() - t0 - prefill) / a.steps
            out[C] = decode
            read = per_pos * (C + a.steps // 2)
            print(f"context {C:5d}: prefill {prefill * 1e3:8.1f} ms, decode {decode * 1e3:7.2f} ms/step; latent cache "
                  f"read per step {read / 2**20:.2f} MiB ({read / decode / 1e9:.2f} GB/s of it)")
    lo, hi = min(contexts), max(contexts)
    print(f"{a.backend}: decode step at {hi} / at {lo} = {out[hi] / out[lo]:.2f}x")


if __name__ == "__main__":
    main()
