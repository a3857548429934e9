"""LoRA adapters' cost at run time (part of `make bench`; results/lora.md): the benchmark model
(benchmarks/models.py FULL, Mixtral-shaped) with rank-16 PEFT adapters of two kinds, against the base
model, cpu backend, 2 threads, in one process, rounds interleaved (best of each):

  experts             on every expert (gate_up and down: PEFT's target_parameters), the issue's case
  experts+attention   the same and attention's q/k/v/o (target_modules)

  * prefill tok/s (one 128-token prompt's logits) and decode tok/s at batch 1 (64 greedy tokens after
    a 16-token prompt), base against one adapter;
  * decode at batch 8: eight requests, four adapters mixed two each, against eight base requests;
  * the memory each adapter takes (its factors, float32).

    python benchmarks/lora_bench.py [--rounds 3] [--dtypes int8,float16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

RANK, ALPHA, STD = 16, 32, 0.02
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


KINDS = {"experts": [], "experts+attention": TARGETS}


def adapters(hf: str, n: int, kind: str) -> list:
    """n rank-16 adapters of the benchmark checkpoint (random non-zero factors) of a kind, built once."""
    import models
    out = []
    for k in range(n):
        d = os.path.join(os.path.dirname(hf), f"lora-r{RANK}-{k}" + ("-experts" if kind == "experts" else ""))
        stamp = models._stamp({"hf": json.load(open(os.path.join(hf, ".bench-stamp.json")))["stamp"], "k": k,
                               "r": RANK, "std": STD, "kind": kind})
        if not models._fresh(d, stamp):
            import torch
            from peft import LoraConfig, get_peft_model
            from transformers import MixtralForCausalLM
            print(f"building adapter {d} ...", flush=True)
            m = MixtralForCausalLM.from_pretrained(hf, dtype=torch.float32)
            pm = get_peft_model(m, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=KINDS[kind] or None,
                                              target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                                              init_lora_weights=False))
            torch.manual_seed(100 + k)
            with torch.no_grad():
                for name, p in pm.named_parameters():
                    if "lora_" in name:
                        p.normal_(0.0, STD)
            pm.save_pretrained(d)
            del pm, m
            models._mark(d, stamp)
        out.append(d)
    return out


def decode(eng, prompts, names, n):
    """Aggregate decode tok/s of prompts submitted together (adapter names[i] each)."""
    st = eng.stats
    t0, s0 = st.decode_tokens, st.decode_seconds
    reqs = [eng.submit(p, adapter=a, max_new_tokens=n, ignore_eos=True) for p, a in zip(prompts, names)]
    for r in reqs:
        for _ in r.iter_events():
            pass
    return (st.decode_tokens - t0) / (st.decode_seconds - s0)


def prefill(eng, ids, adapter):
    t = time.perf_counter()
    eng.infer(ids, adapter=adapter)
    return len(ids) / (time.perf_counter() - t)


def measure(col: str, ads: list, rounds: int, V: int) -> dict:
    from colibri_edge import Engine
    rng = np.random.default_rng(0)
    long = rng.integers(3, V, 128).astype(np.int32)
    short = [rng.integers(3, V, 16).astype(np.int32).tolist() for _ in range(8)]
    names = {f"a{k}": d for k, d in enumerate(ads)}
    mix = [f"a{k // 2}" for k in range(8)]
    best = {k: 0.0 for k in ("prefill_base", "prefill_lora", "b1_base", "b1_lora", "b8_base", "b8_mixed")}
    with Engine.open(col, backend="cpu", num_threads=2, max_batch=8, max_seq_len=512, prefix_cache=False,
                     adapters=names) as eng:
        mem = {n: v["bytes"] for n, v in eng.adapters().items()}
        decode(eng, short[:1], [None], 4)                      # warm: every kernel compiled
        decode(eng, short[:1], ["a0"], 4)
        decode(eng, short, mix, 4)
        prefill(eng, long, None)
        prefill(eng, long, "a0")
        for _ in range(rounds):
            best["prefill_base"] = max(best["prefill_base"], prefill(eng, long, None))
            best["prefill_lora"] = max(best["prefill_lora"], prefill(eng, long, "a0"))
            best["b1_base"] = max(best["b1_base"], decode(eng, short[:1], [None], 64))
            best["b1_lora"] = max(best["b1_lora"], decode(eng, short[:1], ["a0"], 64))
            best["b8_base"] = max(best["b8_base"], decode(eng, short, [None] * 8, 32))
            best["b8_mixed"] = max(best["b8_mixed"], decode(eng, short, mix, 32))
    return {"rates": best, "adapter_bytes": mem["a0"]}


def isa() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    have = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c") if f in flags]
    return ", ".join(have) or "baseline x86-64"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="int8,float16")
    ap.add_argument("--build-adapters", action="store_true", help="only build the adapters (a subprocess of "
                    "the run: torch's OpenMP threads in the measuring process would slow every engine's core "
                    "thread, see docs/backends.md)")
    a = ap.parse_args(argv)
    import models
    s = models.spec(False)
    if not a.build_adapters:                # the checkpoint and the adapters (torch) in a process of their own
        import subprocess
        subprocess.run([sys.executable, os.path.abspath(__file__), "--build-adapters"], check=True)
    hf = models.build_hf(os.path.join(models.cache_dir(False), "hf"), s)
    if a.build_adapters:
        for kind in KINDS:
            adapters(hf, 4, kind)
        return
    ads = {kind: adapters(hf, 4, kind) for kind in KINDS}
    out = {"isa": isa(), "rank": RANK, "kinds": {k: v + ["experts (gate_up, down)"] for k, v in KINDS.items()},
           "runs": []}
    for dt in a.dtypes.split(","):
        col = models.build_colibri(hf, os.path.join(models.cache_dir(False), f"colibri-{dt}"), dt)
        for kind in KINDS:
            r = measure(col, ads[kind], a.rounds, s["vocab_size"])
            out["runs"].append({"dtype": dt, "kind": kind, **r})
            print(dt, kind, json.dumps(r), flush=True)
    res = os.path.join(HERE, "results")
    with open(os.path.join(res, "lora.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# LoRA adapters at run time: their cost", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M')}, `benchmarks/lora_bench.py --rounds {a.rounds}`. Host ISA: "
             f"{out['isa']}; cpu backend, 2 threads, one process, rounds interleaved, best of each.", "",
             f"Model: the benchmark model (Mixtral-shaped, hidden {s['hidden_size']}, {s['num_hidden_layers']} "
             f"layers, {s['num_local_experts']} experts top-{s['num_experts_per_tok']}, expert width "
             f"{s['intermediate_size']}). Adapters: PEFT LoRA, rank {RANK}, random non-zero factors; `experts`: on "
             "every expert's gate_up and down (target_parameters); `experts+attention`: and on q/k/v/o.", "",
             "| weights | adapter | prefill 128 tok/s base | with adapter | ratio | decode b1 tok/s base | with adapter "
             "| ratio | decode b8 tok/s base | 4 adapters mixed | ratio | adapter memory |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["runs"]:
        b = r["rates"]
        lines.append(f"| {r['dtype']} | {r['kind']} | {b['prefill_base']:.1f} | {b['prefill_lora']:.1f} | "
                     f"{b['prefill_lora'] / b['prefill_base']:.3f} | {b['b1_base']:.1f} | {b['b1_lora']:.1f} | "
                     f"{b['b1_lora'] / b['b1_base']:.3f} | {b['b8_base']:.1f} | {b['b8_mixed']:.1f} | "
                     f"{b['b8_mixed'] / b['b8_base']:.3f} | {r['adapter_bytes'] / 2**20:.1f} MiB |")
    lines += ["", "Decode b1: one request, 64 tokens after a 16-token prompt. Decode b8: eight requests of 32 tokens "
              "submitted together, the base model's against four adapters two requests each (every step mixes "
              "them). Prefill: one 128-token prompt scored (every position's logits), prefix cache off.", ""]
    with open(os.path.join(res, "lora.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
