"""Qwen3.5-MoE's hybrid layers on one backend (issue 18): prefill with the chunked delta rule against
chunk size 1, decode, and the recurrent state's memory.

A random Qwen3.5-35B-A3B-shaped checkpoint (hidden 2048; gated delta-nets of 16 key / 32 value heads of
128 with a conv of 4; full attention of 16 heads of 256 over 2 KV heads with the output gate and partial
rotary; 3 of every 4 layers recurrent; few layers and small experts so it builds in seconds), converted
to float32 (or --dtype), then:
  - prefill of a P-token prompt (default 512) in one chunk (the delta rule's chunked form, chunks of 16
    inside the kernel) and with prefill_chunk 1 (every token its own step: the one-step recurrence);
  - the delta rule op alone on the same shapes: one call over P tokens against P calls of one token;
  - decode tok/s after the prompt;
  - state bytes per sequence (conv + delta-rule state, constant) beside KV bytes per token (full layers).
With --gguf and llama-cpp-python installed (the bench extra), llama.cpp runs the same checkpoint converted
by its own converter (f32) for prefill and decode tok/s in the same run.

    python benchmarks/qwen35_decode.py [--backend cpu] [--layers 4] [--prompt 512] [--steps 32] [--gguf]
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

SHAPE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
             moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=8,
             vocab_size=1024, max_position_embeddings=4096,
             rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25))


def build(d: str, layers: int, dtype: str | None, tokenizer: bool = False) -> tuple:
    import torch
    import transformers
    from hf_models import randomize
    from colibri_edge.convert import convert
    hf, col = os.path.join(d, "hf"), os.path.join(d, f"col_{dtype}")
    if not os.path.exists(os.path.join(hf, "config.json")):
        kw = dict(SHAPE, num_hidden_layers=layers)
        if tokenizer:                                   # llama.cpp's converter needs a vocabulary
            import gguf_models as gm
            kw["vocab_size"] = len(gm.build_tokenizer(hf))
        cfg = transformers.Qwen3_5MoeTextConfig(**kw)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize(model, cfg)
        model.save_pretrained(hf)
    if not os.path.exists(os.path.join(col, "config.json")):
        convert(hf, col, dtype=dtype, progress=False)
    return hf, col


def delta_rule_op(backend: str, P: int, reps: int = 3) -> tuple:
    """ms of the delta rule over P tokens of one sequence: one call (chunked) and P one-token calls."""
    from colibri_edge.backends import create
    be = create(backend)
    Hk, Hv, dk, dv = 16, 32, 128, 128
    rng = np.random.default_rng(0)

    def dev(x):
        buf = be.alloc(x.shape, x.dtype)
        be.upload_into(buf, np.ascontiguousarray(x))
        return buf
    qkv = dev(rng.standard_normal((P, 2 * Hk * dk + Hv * dv)).astype(np.float32))
    a, b = dev(rng.standard_normal((P, Hv)).astype(np.float32)), dev(rng.standard_normal((P, Hv)).astype(np.float32))
    an, dt = be.upload(-np.exp(rng.uniform(-2, 1, Hv)).astype(np.float32)), be.upload(np.zeros(Hv, np.float32))
    state, out = be.alloc((1, Hv, dk, dv)), be.alloc((P, Hv * dv))
    heads, slots = (Hk, Hv, dk, dv, Hv // Hk), dev(np.zeros(1, np.int32))
    pos = dev(np.arange(P, dtype=np.int32))
    starts = [dev(np.array([0, n], np.int32)) for n in (P, 1)]

    def whole():
        be.delta_rule(out, qkv, a, b, an, dt, state, starts[0], slots, pos, heads)

    def one_by_one():
        for t in range(P):
            be.delta_rule(out[t:t + 1], qkv[t:t + 1], a[t:t + 1], b[t:t + 1], an, dt, state, starts[1], slots,
                          pos[t:t + 1], heads)
    times = []
    for fn in (whole, one_by_one):
        fn()
        be.synchronize()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            be.synchronize()
            best = min(best, time.perf_counter() - t0)
        times.append(best * 1e3)
    return tuple(times)


def llama_cpp(hf: str, d: str, prompt: list, steps: int, threads: int):
    import gguf_models as gm
    from llama_cpp import Llama
    path = os.path.join(d, "f32.gguf")
    if not os.path.exists(path):
        gm.to_gguf(hf, path, "f32")
    llm = Llama(path, n_ctx=len(prompt) + steps + 16, n_threads=threads, n_batch=len(prompt), verbose=False)
    llm.eval(prompt)                                        # warm
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = prompt[-1]
    for _ in range(steps):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return len(prompt) / prefill, steps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default=None, help="convert --dtype (default: the checkpoint's float32)")
    ap.add_argument("--gguf", action="store_true", help="also llama.cpp on the same checkpoint (bench extra)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "colibri_qwen35_bench"))
    a = ap.parse_args()
    from colibri_edge import Engine
    from colibri_edge.modeldir import ModelDir
    from colibri_edge.planning import kv_full_bytes_per_token, state_bytes_per_sequence
    hf, col = build(a.dir, a.layers, a.dtype, tokenizer=a.gguf)
    cfg = ModelDir(col).config
    V = cfg["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, V, a.prompt).tolist()
    print(f"model: {a.layers} layers ({cfg['layer_types'].count('linear_attention')} gated delta-nets), hidden 2048, "
          f"weights {cfg['weight_dtype']}; state {state_bytes_per_sequence(cfg) / 2**20:.2f} MiB per sequence, "
          f"KV {kv_full_bytes_per_token(cfg)} bytes per token")
    rates = {}
    for chunk in (a.prompt, 1):
        with Engine.open(col, backend=a.backend, max_seq_len=a.prompt + a.steps + 1, prefill_chunk=chunk,
                         max_batch=1) as eng:
            eng.generate(prompt[:32], max_new_tokens=2, ignore_eos=True)              # warm: compiles
            t0 = time.perf_counter()
            eng.generate(prompt, max_new_tokens=1, ignore_eos=True)
            prefill = time.perf_counter() - t0
            rates[chunk] = a.prompt / prefill
            if chunk == a.prompt:
                t0 = time.perf_counter()
                eng.generate(prompt, max_new_tokens=1 + a.steps, ignore_eos=True)
                decode = a.steps / (time.perf_counter() - t0 - prefill)
        print(f"prefill {a.prompt} tokens, prefill_chunk {chunk:4d}: {rates[chunk]:8.1f} tok/s")
    from colibri_edge.planning import summary
    per_token = summary(ModelDir(col), a.prompt)["bytes_per_decoded_token"]
    print(f"{a.backend}: prefill chunked / chunk 1 = {rates[a.prompt] / rates[1]:.1f}x; decode {decode:.1f} tok/s "
          f"after {a.prompt} tokens = {per_token * decode / 1e9:.1f} GB/s of weights read "
          f"({per_token / 2**20:.1f} MiB a token)")
    whole, single = delta_rule_op(a.backend, a.prompt)
    print(f"delta rule alone (16 / 32 heads of 128, {a.prompt} tokens): one chunked call {whole:.1f} ms, "
          f"{a.prompt} one-token calls {single:.1f} ms ({single / whole:.1f}x)")
    if a.gguf:
        pre, dec = llama_cpp(hf, a.dir, prompt, a.steps, int(os.environ.get("COLIBRI_NUM_THREADS") or os.cpu_count()))
        print(f"llama.cpp (f32 GGUF of the same checkpoint): prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s; "
              f"Colibri / llama.cpp: prefill {rates[a.prompt] / pre:.2f}x, decode {decode / dec:.2f}x")


if __name__ == "__main__":
    main()
