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
    from hf_models import add_mtp_weights, randomize
    from colibri_edge.model.convert import convert
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
        add_mtp_weights(hf, cfg)        # as Qwen3.5's checkpoints ship (llama.cpp's converter expects them)
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


class LlamaCpp:
    """llama.cpp on the checkpoint's GGUF (its own converter, f32 unless `path` names another file), its
    logits of the prompt's first tokens checked against Colibri's (`err`) before anything is timed."""

    def __init__(self, hf: str, d: str, prompt: list, steps: int, threads: int, want: np.ndarray, path=None):
        import gguf_models as gm
        from llama_cpp import Llama
        path = path or os.path.join(d, "f32.gguf")
        if not os.path.exists(path):
            gm.to_gguf(hf, path, "f32")
        chk = Llama(path, n_ctx=64, n_threads=threads, logits_all=True, verbose=False)
        chk.eval(prompt[:len(want)])
        self.err = float(np.abs(np.asarray(chk.scores[:len(want)]) - want).max() / np.abs(want).max())
        del chk
        self.llm = Llama(path, n_ctx=len(prompt) + steps + 16, n_threads=threads, n_batch=len(prompt), verbose=False)
        self.prompt, self.steps = prompt, steps
        self.round()                                        # warm

    def round(self) -> tuple:
        """-> (prefill tok/s, decode tok/s) of one prompt and `steps` decode tokens."""
        llm, prompt = self.llm, self.prompt
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(self.steps):                         # one token a step (their values do not matter)
            llm.eval([prompt[i % len(prompt)]])
        return len(prompt) / prefill, self.steps / (time.perf_counter() - t0)


def gemv_probe(threads: int) -> float:
    """The machine's read bandwidth in this run: the best of benchmarks/workers.py's BLAS GEMV over a
    512 MiB matrix (a subprocess, OpenBLAS with its own CPU detection), GB/s."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    code = (f"import json, sys; sys.path.insert(0, {HERE!r}); import workers; "
            f"print(json.dumps(workers.bandwidth({{'threads': {threads}}})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["best_gbps"]


def colibri_round(eng, prompt: list, steps: int) -> tuple:
    """-> (prefill tok/s, decode tok/s): the prompt then `steps` decode tokens, decode time from the
    engine's own step timer (no prefill subtracted from a total)."""
    st = eng.stats
    t0 = time.perf_counter()
    eng.generate(prompt, max_new_tokens=1, ignore_eos=True)
    prefill = time.perf_counter() - t0
    if not steps:
        return len(prompt) / prefill, 0.0
    n0, s0 = st.decode_tokens, st.decode_seconds
    eng.generate(prompt, max_new_tokens=1 + steps, ignore_eos=True)
    return len(prompt) / prefill, (st.decode_tokens - n0) / (st.decode_seconds - s0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each engine's best is reported")
    ap.add_argument("--dtype", default=None, help="convert --dtype (default: the checkpoint's float32)")
    ap.add_argument("--gguf", action="store_true", help="also llama.cpp on the same checkpoint (bench extra)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "colibri_qwen35_bench"))
    a = ap.parse_args()
    from colibri_edge import Engine
    from colibri_edge.model.modeldir import ModelDir
    from colibri_edge.analysis.sizing import kv_full_bytes_per_token, state_bytes_per_sequence, summary
    hf, col = build(a.dir, a.layers, a.dtype, tokenizer=a.gguf)
    cfg = ModelDir(col).config
    V = cfg["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, V, a.prompt).tolist()
    per_token = summary(ModelDir(col), a.prompt)["bytes_per_decoded_token"]
    print(f"model: {a.layers} layers ({cfg['layer_types'].count('linear_attention')} gated delta-nets), hidden 2048, "
          f"weights {cfg['weight_dtype']}; state {state_bytes_per_sequence(cfg) / 2**20:.2f} MiB per sequence, "
          f"KV {kv_full_bytes_per_token(cfg)} bytes per token, {per_token / 2**20:.1f} MiB of weights a decoded token")
    opts = dict(backend=a.backend, max_seq_len=a.prompt + a.steps + 1, max_batch=1)
    with Engine.open(col, prefill_chunk=1, **opts) as eng:           # every token its own step
        eng.generate(prompt[:32], max_new_tokens=2, ignore_eos=True)
        one = max(colibri_round(eng, prompt, 0)[0] for _ in range(a.rounds))
    best = {}
    with Engine.open(col, prefill_chunk=a.prompt, **opts) as eng:
        eng.generate(prompt[:32], max_new_tokens=2, ignore_eos=True)  # warm: compiles
        first = eng.infer(prompt[:24])[0]                            # llama.cpp's logits are checked against these
        peer = LlamaCpp(hf, a.dir, prompt, a.steps, int(os.environ.get("COLIBRI_NUM_THREADS") or os.cpu_count()),
                        first) if a.gguf else None
        for _ in range(a.rounds):
            for name, run in (("colibri", lambda: colibri_round(eng, prompt, a.steps)),
                              ("llama.cpp", peer.round if peer else None)):
                if run is not None:
                    r = run()
                    b = best.setdefault(name, [0.0, 0.0])
                    best[name] = [max(b[0], r[0]), max(b[1], r[1])]
    pre, dec = best["colibri"]
    print(f"prefill {a.prompt} tokens: {pre:.1f} tok/s in one chunk, {one:.1f} tok/s with prefill_chunk 1 "
          f"({pre / one:.1f}x)")
    threads = int(os.environ.get("COLIBRI_NUM_THREADS") or os.cpu_count())
    bw = gemv_probe(threads)
    print(f"{a.backend}: decode {dec:.1f} tok/s after {a.prompt} tokens = {per_token * dec / 1e9:.1f} GB/s of weights "
          f"read (best of {a.rounds} rounds), {per_token * dec / 1e9 / bw:.0%} of a BLAS GEMV's {bw:.1f} GB/s "
          f"({threads} threads) in the same run")
    whole, single = delta_rule_op(a.backend, a.prompt)
    print(f"delta rule alone (16 / 32 heads of 128, {a.prompt} tokens): one chunked call {whole:.1f} ms, "
          f"{a.prompt} one-token calls {single:.1f} ms ({single / whole:.1f}x)")
    if peer:
        lp, ld = best["llama.cpp"]
        print(f"llama.cpp (f32 GGUF of the same checkpoint; its logits of 24 tokens within {peer.err:.1e} of max "
              f"|logit| of Colibri's): prefill {lp:.1f} tok/s, decode {ld:.1f} tok/s ({per_token * ld / 1e9:.1f} GB/s, "
              f"{per_token * ld / 1e9 / bw:.0%}); "
              f"Colibri / llama.cpp: prefill {pre / lp:.2f}x, decode {dec / ld:.2f}x")


if __name__ == "__main__":
    main()
