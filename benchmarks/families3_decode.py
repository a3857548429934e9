"""Issue 49's recurrent families against llama.cpp on the same f16 GGUF: decode (and prefill) tok/s of a
Granite-4.0-H-Tiny-shaped and an LFM2-8B-A1B-shaped model with random weights, the fraction of the host's
read bandwidth each reaches, and the recurrent state per sequence.

Each model keeps its real config's widths (hidden size, heads, Mamba-2 heads and state, conv taps, expert
count, expert and shared widths, top-k) with few layers and a small vocabulary, so that it builds in a
minute; the layer mix keeps both mixers:
  * Granite-4.0-H-Tiny (7B-A1B): hidden 1536, Mamba-2 48 heads of 64, d_state 128, 4 taps; attention 12 heads
    over 4 KV heads without rope; 64 experts of 512, top-6, a shared MLP of 1024 -- 3 Mamba-2 layers, 1 attention;
  * LFM2-8B-A1B: hidden 2048, gated short convs of 3 taps; attention 32 heads over 8 KV heads; 32 experts of
    1792, top-4, two dense first layers of 7168 -- 3 conv layers, 1 attention.
llama.cpp's converter writes the f16 GGUF (its granitehybrid / lfm2moe arch); `colibri convert` imports that
same file (float16 kept), and llama.cpp (llama-cpp-python, the bench extra) runs it; llama.cpp's logits of the
prompt's first tokens are checked against Colibri's before anything is timed. Rounds alternate; each engine's
best is reported.

    python benchmarks/families3_decode.py [--model granite|lfm2|all] [--prompt 128] [--steps 64] [--rounds 5]
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
sys.path.insert(0, HERE)

from lora_bench import isa  # noqa: E402
from qwen35_decode import LlamaCpp, colibri_round, gemv_probe  # noqa: E402

# model -> (transformers config class name, the real config's widths, the benchmark's layers, the config.json
# edit that writes the released spelling llama.cpp's converter reads)
MODELS = {
    "granite": ("GraniteMoeHybridConfig", dict(
        hidden_size=1536, num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_n_groups=1, mamba_chunk_size=256,
        num_local_experts=64, num_experts_per_tok=6, intermediate_size=512, shared_intermediate_size=1024,
        position_embedding_type=None, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
        attention_multiplier=0.0078125, max_position_embeddings=4096, tie_word_embeddings=True,
        num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"]),
        lambda c: c.update(layer_types=["mamba", "mamba", "attention", "mamba"])),
    "lfm2": ("Lfm2MoeConfig", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=1792, intermediate_size=7168, num_dense_layers=2,
        routed_scaling_factor=1.0, max_position_embeddings=4096, num_hidden_layers=4,
        layer_types=["conv", "conv", "full_attention", "conv"]), None),
}


def build(d: str, name: str) -> tuple:
    """-> (checkpoint dir, f16 GGUF, Colibri's import of it)."""
    import torch
    import transformers
    import gguf_models as gm
    from hf_models import randomize
    from colibri_edge.model.convert import convert
    cls, kw, edit = MODELS[name]
    hf, path, col = os.path.join(d, name), os.path.join(d, f"{name}-f16.gguf"), os.path.join(d, f"{name}-col")
    if not os.path.exists(os.path.join(hf, "config.json")):
        kw = dict(kw, vocab_size=len(gm.build_tokenizer(hf)))
        if name == "granite":                           # transformers 5 spells the layer types its own way
            kw["layer_types"] = [{"mamba": "linear_attention"}.get(t, "full_attention") for t in kw["layer_types"]]
        cfg = getattr(transformers, cls)(**kw)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize(model, cfg)
        model.save_pretrained(hf)
        del model
        if edit:
            with open(os.path.join(hf, "config.json")) as f:
                c = json.load(f)
            edit(c)
            with open(os.path.join(hf, "config.json"), "w") as f:
                json.dump(c, f)
    if not os.path.exists(path):
        gm.to_gguf(hf, path, "f16")
    if not os.path.exists(os.path.join(col, "config.json")):
        convert(path, col, progress=False)
    return hf, path, col


def run(name: str, a, threads: int, bw: float) -> dict:
    from colibri_edge import Engine
    from colibri_edge.analysis.sizing import state_bytes_per_sequence, summary
    from colibri_edge.model.modeldir import ModelDir
    hf, path, col = build(a.dir, name)
    cfg = ModelDir(col).config
    prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], a.prompt).tolist()
    per_token = summary(ModelDir(col), a.prompt)["bytes_per_decoded_token"]
    best = {}
    opts = dict(backend=a.backend, max_seq_len=a.prompt + a.steps + 1, max_batch=1)
    with Engine.open(col, **opts) as eng:
        eng.generate(prompt[:32], max_new_tokens=2, ignore_eos=True)     # warm: compiles
        first = eng.infer(prompt[:24])[0]
        peer = LlamaCpp(hf, a.dir, prompt, a.steps, threads, first, path=path)
        for _ in range(a.rounds):
            for who, fn in (("colibri", lambda: colibri_round(eng, prompt, a.steps)), ("llama.cpp", peer.round)):
                r = fn()
                b = best.setdefault(who, [0.0, 0.0])
                best[who] = [max(b[0], r[0]), max(b[1], r[1])]
    (cp, cd), (lp, ld) = best["colibri"], best["llama.cpp"]
    out = {"model": name, "layer_types": cfg["layer_types"], "weights": cfg["weight_dtype"],
           "state_bytes_per_sequence": state_bytes_per_sequence(cfg), "bytes_per_decoded_token": per_token,
           "logit_err_vs_llama_cpp": peer.err, "colibri": {"prefill": cp, "decode": cd},
           "llama.cpp": {"prefill": lp, "decode": ld}, "decode_ratio": cd / ld, "prefill_ratio": cp / lp,
           "colibri_bw_fraction": per_token * cd / 1e9 / bw, "llama_cpp_bw_fraction": per_token * ld / 1e9 / bw}
    print(f"{name}: {cfg['layer_types']}, {per_token / 2**20:.1f} MiB of weights a decoded token, state "
          f"{out['state_bytes_per_sequence']:,} bytes per sequence; llama.cpp's logits within {peer.err:.1e} of "
          f"max |logit| of Colibri's")
    print(f"  decode  colibri {cd:7.1f} tok/s ({out['colibri_bw_fraction']:.0%} of {bw:.1f} GB/s)  llama.cpp "
          f"{ld:7.1f} tok/s ({out['llama_cpp_bw_fraction']:.0%})  ratio {cd / ld:.2f}x")
    print(f"  prefill colibri {cp:7.1f} tok/s  llama.cpp {lp:7.1f} tok/s  ratio {cp / lp:.2f}x  ({a.prompt} tokens)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all", choices=["all", *MODELS])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "colibri_families3_bench"))
    ap.add_argument("--json", default=os.path.join(HERE, "results", "families3.json"))
    a = ap.parse_args()
    import platform
    os.makedirs(a.dir, exist_ok=True)
    threads = int(os.environ.get("COLIBRI_NUM_THREADS") or os.cpu_count())
    bw = gemv_probe(threads)
    print(f"host: {platform.machine()}, {isa()}, {threads} threads; BLAS GEMV read {bw:.1f} GB/s")
    res = [run(m, a, threads, bw) for m in (MODELS if a.model == "all" else [a.model])]
    with open(a.json, "w") as f:
        json.dump({"threads": threads, "gemv_gbps": bw, "isa": isa(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
