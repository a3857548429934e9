"""Constrained output's cost: decode tok/s with a JSON schema against the same requests unconstrained,
and the grammar engine's mask time per token (part of `make bench`; results/grammar.md).

  * the demo model (cpu, 2 threads): 8 greedy chat replies of up to 96 tokens held to a JSON schema,
    against 8 unconstrained replies of the same lengths (ignore_eos), interleaved rounds, best of each;
  * the mask alone (llguidance's matcher + Colibri's in-place apply) per token, at the demo model's
    4,098-token vocabulary and at a 151,646-token byte-level vocabulary (Qwen-sized: the demo's tokens
    plus byte strings, a tokenizer.json written here), walking the same JSON text.

    python benchmarks/grammar_bench.py [--rounds 3]
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

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def decode_rate(eng, constrained: bool, lengths=None):
    """-> (tokens, seconds, lengths) of 8 sequential replies."""
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    n, t0, out = 0, time.perf_counter(), []
    for i in range(8):
        if constrained:
            gen = eng.generate(ASK, max_new_tokens=96, temperature=0.7, seed=i, response_format=fmt)
        else:
            gen = eng.generate(ASK, max_new_tokens=lengths[i], temperature=0.7, seed=i, ignore_eos=True)
        n += len(gen)
        out.append(len(gen))
    return n, time.perf_counter() - t0, out


def big_tokenizer(base_json: str, V: int) -> str:
    """The demo tokenizer's vocabulary grown to V entries with byte-level strings (a Qwen-sized vocab)."""
    tj = json.loads(base_json)
    vocab = tj["model"]["vocab"]
    extra = [t for t in tj.get("added_tokens", []) if t["id"] >= len(vocab)]   # special tokens past the vocab
    rng = np.random.default_rng(0)
    alphabet = [chr(c) for c in range(0x21, 0x7f)] + [chr(c) for c in range(0xa1, 0x17f)]
    while len(vocab) < V - len(extra):
        s = "".join(rng.choice(alphabet, rng.integers(2, 9)))
        if s not in vocab:
            vocab[s] = len(vocab)
    for k, t in enumerate(extra):                    # moved to the end, as a Qwen vocabulary has them
        t["id"] = len(vocab) + k
    return json.dumps(tj)


def mask_time(tokenizer_json: str, V: int, text_ids) -> float:
    """Mean seconds per token of computing and applying the mask along text_ids."""
    from colibri_edge.requests.constrain import Grammars
    g = Grammars(tokenizer_json, V, [0])
    c = g.matcher(("json_schema", SCHEMA))
    logits = np.random.default_rng(1).standard_normal(V).astype(np.float32)
    c.masked(logits)                                        # warm (the apply kernel's JIT)
    c = g.matcher(("json_schema", SCHEMA))
    t0 = time.perf_counter()
    for t in text_ids:
        c.masked(logits)
        c.consume(t)
    return (time.perf_counter() - t0) / len(text_ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    os.environ.setdefault("COLIBRI_NUM_THREADS", "2")
    from colibri_edge import Engine
    from colibri_edge.model.demo import ensure_default_model
    path = ensure_default_model()[0]
    best = {"schema": 0.0, "free": 0.0}
    with Engine.open(path, backend="cpu", max_seq_len=512, max_batch=1) as eng:
        n, _, lengths = decode_rate(eng, True)              # warm, and the replies' lengths
        for _ in range(a.rounds):
            n, s, _ = decode_rate(eng, True)
            best["schema"] = max(best["schema"], n / s)
            n, s, _ = decode_rate(eng, False, lengths)
            best["free"] = max(best["free"], n / s)
        text = json.dumps({"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["math", "poet"]},
                          separators=(",", ":"))
        ids = eng.codec.encode(text, add_special_tokens=False)
        base = open(os.path.join(path, "tokenizer.json"), encoding="utf-8").read()
        V_demo = eng.config["vocab_size"]
    t_demo = mask_time(base, V_demo, ids)
    V_big = 151_646
    t_big = mask_time(big_tokenizer(base, V_big), V_big, ids)
    lines = [f"# Constrained output ({time.strftime('%Y-%m-%d')})", "",
             "Demo model, cpu backend, 2 threads; 8 chat replies held to a JSON schema (temperature 0.7) against "
             "8 unconstrained replies of the same lengths, best of "
             f"{a.rounds} interleaved rounds; mask = llguidance's matcher + Colibri's in-place apply, per token "
             "along the same JSON text.", "",
             "| | tok/s | ratio |", "|---|---:|---:|",
             f"| unconstrained | {best['free']:.1f} | 1.00 |",
             f"| JSON schema | {best['schema']:.1f} | {best['schema'] / best['free']:.2f} |", "",
             "| vocabulary | mask per token |", "|---:|---:|",
             f"| {V_demo:,} (demo) | {t_demo * 1e3:.3f} ms |",
             f"| {V_big:,} (Qwen-sized, byte-level) | {t_big * 1e3:.3f} ms |"]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "grammar.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
