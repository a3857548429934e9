"""Constrained output's cost: decode tok/s with a JSON schema against the same requests unconstrained,
and the grammar engine's mask time per token (part of `make bench`; results/grammar.md).

  * the demo model (cpu, 2 threads): 8 chat replies of up to 96 tokens held to a JSON schema, against
    8 unconstrained replies of the same lengths (ignore_eos), interleaved rounds, best of each;
  * the same on the benchmark model's shape (benchmarks/models.py FULL, float16) with a 151,646-token
    vocabulary and a byte-level tokenizer of that size (Qwen-sized; built once under
    benchmarks/cache/full-v151k/): the mask costs most there;
  * the mask time a decode step waited for (the mask is computed on a worker thread while the step
    runs: constrain.py), per token, in those runs;
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
    """-> (tokens, seconds, lengths, seconds waited for masks) of 8 sequential replies."""
    from colibri_edge.requests.scheduler import TOKEN
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    n, t0, out, waited = 0, time.perf_counter(), [], 0.0
    for i in range(8):
        kw = dict(max_new_tokens=96, response_format=fmt) if constrained else \
            dict(max_new_tokens=lengths[i], ignore_eos=True)
        req = eng.submit(ASK, temperature=0.7, seed=i, **kw)
        k = sum(ev.kind == TOKEN for ev in req.iter_events())
        waited += req.constraint.mask_seconds if constrained else 0.0
        n += k
        out.append(k)
    return n, time.perf_counter() - t0, out, waited


def rates(eng, rounds: int) -> dict:
    """Best tok/s of each kind over interleaved rounds, and the mask wait per constrained token."""
    n, _, lengths, _ = decode_rate(eng, True)              # warm, and the replies' lengths
    best = {"schema": 0.0, "free": 0.0, "wait": 0.0}
    waits = []
    for _ in range(rounds):
        n, s, _, w = decode_rate(eng, True)
        best["schema"] = max(best["schema"], n / s)
        waits.append(w / n)
        n, s, _, _ = decode_rate(eng, False, lengths)
        best["free"] = max(best["free"], n / s)
    best["wait"] = float(np.median(waits))
    return best


V_BIG = 151_646
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def big_vocab_model(base_json: str) -> str:
    """The benchmark model's shape with a V_BIG vocabulary, float16, with big_tokenizer's tokenizer.json
    (its last two tokens <|im_start|>, <|im_end|>; <|im_end|> ends a reply) and a ChatML template."""
    sys.path.insert(0, HERE)
    import models
    root = os.path.join(models.CACHE, "full-v151k")
    hf = models.build_hf(os.path.join(root, "hf"), {**models.spec(False), "vocab_size": V_BIG})
    col = models.build_colibri(hf, os.path.join(root, "colibri-float16"), "float16")
    with open(os.path.join(col, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(big_tokenizer(base_json, V_BIG))
    with open(os.path.join(col, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>"}, f)
    with open(os.path.join(col, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_ids"] = [V_BIG - 1]
    with open(os.path.join(col, "config.json"), "w") as f:
        json.dump(cfg, f)
    return col


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
        c.m.consume_token(t)                                # not c.consume: no prefetch on a thread here
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
    with Engine.open(path, backend="cpu", max_seq_len=512, max_batch=1) as eng:
        demo = rates(eng, a.rounds)
        text = json.dumps({"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["math", "poet"]},
                          separators=(",", ":"))
        ids = eng.codec.encode(text, add_special_tokens=False)
        base = open(os.path.join(path, "tokenizer.json"), encoding="utf-8").read()
        V_demo = eng.config["vocab_size"]
    with Engine.open(big_vocab_model(base), backend="cpu", max_seq_len=512, max_batch=1) as eng:
        big = rates(eng, a.rounds)
    t_demo = mask_time(base, V_demo, ids)
    t_big = mask_time(big_tokenizer(base, V_BIG), V_BIG, ids)
    lines = [f"# Constrained output ({time.strftime('%Y-%m-%d')})", "",
             "cpu backend, 2 threads; 8 chat replies held to a JSON schema (temperature 0.7) against 8 "
             f"unconstrained replies of the same lengths, best of {a.rounds} interleaved rounds. Mask waited: "
             "the time a step waited for its mask (computed on a worker thread while the step runs), per "
             "token. Mask alone: llguidance's matcher + Colibri's in-place apply, per token along the same "
             "JSON text, not overlapped.", "",
             "| model | vocabulary | unconstrained tok/s | JSON schema tok/s | ratio | mask waited / token |",
             "|---|---:|---:|---:|---:|---:|",
             f"| demo | {V_demo:,} | {demo['free']:.1f} | {demo['schema']:.1f} | "
             f"{demo['schema'] / demo['free']:.2f} | {demo['wait'] * 1e3:.3f} ms |",
             f"| benchmark shape (float16) | {V_BIG:,} | {big['free']:.1f} | {big['schema']:.1f} | "
             f"{big['schema'] / big['free']:.2f} | {big['wait'] * 1e3:.3f} ms |", "",
             "| vocabulary | mask alone per token |", "|---:|---:|",
             f"| {V_demo:,} (demo) | {t_demo * 1e3:.3f} ms |",
             f"| {V_BIG:,} (Qwen-sized, byte-level) | {t_big * 1e3:.3f} ms |"]
    from report import write_lines
    write_lines(a.out, "grammar.md", lines)


if __name__ == "__main__":
    main()
