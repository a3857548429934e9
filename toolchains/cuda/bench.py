"""The CUDA backend's short benchmark (run by gpu-check.sh): decode tokens/s in stream mode
(cuda_graphs=False: every op launched from the host) and graph mode (captured decode steps
replayed), the device time of one decode step, the bandwidth that step achieves, and prefill
tokens/s, on a synthetic Mixtral-shaped model written straight into a model directory (random
weights, no transformers, no network).

    python toolchains/cuda/bench.py [--out bench.json] [--layers 8 --hidden 2048 ...]

Bandwidth = bytes a batch-1 decode step must read (attention and router weights, the top_k experts
of every MoE layer, the lm_head row block, the KV cache so far) / the step's device time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np



def write_model(path, a):
    from colibri_edge.model import modeldir
    from colibri_edge.model.dtypes import narrow
    E, L = a.experts, a.layers
    cfg = {"format_version": 1, "model_type": "mixtral", "num_hidden_layers": L, "hidden_size": a.hidden,
           "intermediate_size": a.inter, "moe_intermediate_size": a.inter, "num_attention_heads": a.heads,
           "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim, "vocab_size": a.vocab,
           "max_position_embeddings": 4096, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "experts_per_layer": E, "top_k": a.top_k, "router_dtype": "float32", "router_mode": "topk",
           "norm_topk_prob": True, "shared_expert_intermediate_size": 0, "shared_expert_gate": False,
           "attention_bias": False, "attention_out_bias": False, "qk_norm": "none", "eos_token_ids": [],
           "weight_dtype": a.dtype,
           "layers": [{"layer_id": i, "type": "moe", "moe_expert_start": i * E, "moe_num_experts": E}
                      for i in range(L)]}
    rng = np.random.default_rng(0)

    def rand(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        return x * np.float32(1.0 / np.sqrt(shape[-1])) if len(shape) > 1 else 1.0 + 0.1 * x

    w = modeldir.ModelWriter(path, cfg)
    for name, (shape, dtype) in modeldir.expected_tensors(cfg).items():
        w.add_tensor(name, rand(shape), dtype)
    H, I = a.hidden, a.inter
    for layer in range(L):          # one random expert per layer, written E times (the bytes are what count)
        mats = [narrow(rand(s), a.dtype) for s in ((I, H), (I, H), (H, I))]
        for j in range(E):
            w.add_expert(layer, j, *mats, a.dtype)
    w.finish()
    return cfg


def step_bytes(cfg, context):
    """Bytes one batch-1 decode step reads."""
    from colibri_edge.model.dtypes import itemsize
    s = itemsize(cfg["weight_dtype"])
    H, hd, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    I, E, k = cfg["moe_intermediate_size"], cfg["experts_per_layer"], cfg["top_k"]
    per_layer = (2 * H * 4 + (nq * H + 2 * nkv * H + H * nq) * s + E * H * 4 + k * 3 * H * I * s
                 + 2 * context * nkv * 4)
    return H * s + cfg["num_hidden_layers"] * per_layer + H * 4 + V * H * s


def device_step_ms(engine, graph, reps):
    """Device time of one decode step: replays of the captured graph, or the step's ops re-run."""
    be, r = engine.backend, engine.runner
    be.synchronize()
    if graph:
        g = be._graphs.get(("decode", 1, 1))
        if g is None:
            return None
        run = lambda: g[0].launch(stream=be._s)            # noqa: E731
    else:
        views = r.views(1, 1)
        run = lambda: r._forward(views)                     # noqa: E731 (same inputs: same KV slot rewritten)
    run()
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    be.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--dir", help="model directory to write (default: a temporary one, removed after)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill", type=int, default=512)
    a = ap.parse_args(argv)

    from colibri_edge import Engine

    res = {"model": {k: getattr(a, k) for k in ("layers", "hidden", "inter", "experts", "top_k", "heads", "kv_heads",
                                                "head_dim", "vocab", "dtype")}}
    tmp = a.dir or tempfile.mkdtemp(prefix="colibri-bench-")
    try:
        t0 = time.perf_counter()
        cfg = write_model(tmp, a)
        res["model"]["file_gib"] = round(os.path.getsize(os.path.join(tmp, "colibri_weights.bin")) / 2 ** 30, 3)
        res["write_s"] = round(time.perf_counter() - t0, 1)
        rng = np.random.default_rng(1)
        batches = [int(b) for b in a.batches.split(",")]
        ctx = a.prompt + a.tokens // 2
        res["bytes_per_step_b1"] = step_bytes(cfg, ctx)
        for mode in ("stream", "graph"):
            t0 = time.perf_counter()
            with Engine.open(tmp, backend="cuda", max_batch=max(batches), max_seq_len=a.prefill + a.tokens + 16,
                             prefill_chunk=a.prefill, cuda_graphs=mode == "graph") as eng:
                res.setdefault("open_s", {})[mode] = round(time.perf_counter() - t0, 1)
                eng.generate(list(rng.integers(0, a.vocab, 16)), max_new_tokens=4)        # warm up
                for B in batches:
                    prompts = [list(rng.integers(0, a.vocab, a.prompt)) for _ in range(B)]
                    eng.stats.decode_tokens = eng.stats.decode_steps = 0
                    eng.stats.decode_seconds = 0.0
                    outs = eng.generate_batch(prompts, max_new_tokens=a.tokens)
                    assert all(len(o) == a.tokens for o in outs)
                    st = eng.stats
                    res.setdefault("decode_tok_s", {})[f"{mode}_b{B}"] = round(st.decode_tokens / st.decode_seconds, 1)
                    if B == 1:
                        ms = device_step_ms(eng, mode == "graph", 50)
                        if ms:
                            res.setdefault("step_ms_b1", {})[mode] = round(ms, 4)
                            res.setdefault("gb_s_b1", {})[mode] = round(res["bytes_per_step_b1"] / ms / 1e6, 1)
                if mode == "stream":
                    ids = rng.integers(0, a.vocab, a.prefill)
                    eng.infer(ids)
                    eng.backend.synchronize()
                    t0 = time.perf_counter()
                    eng.infer(ids)
                    res["prefill_tok_s"] = round(a.prefill / (time.perf_counter() - t0), 1)
                res.setdefault("describe", {})[mode] = eng.backend.describe()
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
