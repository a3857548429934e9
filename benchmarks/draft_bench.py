"""Speculative decoding's speed (part of `make bench`; results/draft.md): the benchmark model
(benchmarks/models.py FULL, Mixtral-shaped, random weights, float16: the very weights of model-f16.gguf),
cpu backend, 2 threads, batch 1, greedy, NEW tokens after each prompt, best of --rounds (interleaved).

Prompts (token ids):
  copy   input-grounded: a 60-token passage, a separator, the passage again, a separator and the
         passage's first 4 tokens, so that a model that copies continues with the passage (what
         editing or summarising a given text does, and what prompt lookup drafts);
  free   40 random tokens: nothing in the context predicts the output (drafts fail).

Rows:
  * Colibri draft=off / ngram (draft_tokens 8) / auto, with the tokens checked equal to off's;
  * replay at acceptance a: a drafter that proposes off's own output with each position wrong with
    probability 1 - a (seeded), draft_tokens 4 and auto: what verification buys on this model and host
    when drafts are right that often (a random-weight model copies nothing, so no real drafter
    reaches these rates here; the rows bound what one would gain);
  * the same under memory pressure: expert_slots 24 of the 64 experts (LRU), where a verification's
    extra tokens wake experts that must be read from storage;
  * llama-server on model-f16.gguf, --spec-type none and ngram-simple / ngram-mod, the same prompts
    (its decode tok/s and drafts accepted from its /completion timings);
  * "fresh": the first request of an engine / server (best over --rounds of them); "repeat": the same
    prompt again in the same engine / server (Colibri's n-gram memory and llama.cpp's ngram-mod table
    hold the earlier runs' output).

The demo model with its MTP head (colibri_edge/default_model, trained by toolchains/demo-model/
mtp_train.py), on English text: DEMO_PROMPTS (none of them in its training text), 2 NEW tokens greedy
after each, draft=off / mtp with 1, 2, 3 drafts / auto / ngram, summed over the prompts, best of
--rounds. (llama.cpp runs no MTP head for this architecture: no peer row.)

    python benchmarks/draft_bench.py [--rounds 3] [--no-llama] [--only demo]
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

NEW = 96
THREADS = 2


def log(msg):
    print(f"[draft] {msg}", file=sys.stderr, flush=True)


def prompts(V: int) -> dict:
    rng = np.random.default_rng(7)
    passage = [int(t) for t in rng.integers(3, V, 60)]
    return {"copy": passage + [13] + passage + [13] + passage[:4],
            "free": [int(t) for t in rng.integers(3, V, 40)]}


class Replay:
    """A drafter proposing a known output (set `target` per prompt) with each position wrong with
    probability 1 - rate (seeded per position, so every run drafts the same)."""
    target: dict = {}
    rate = 1.0

    def __init__(self):
        self.seq = []

    def extend(self, tokens):
        self.seq.extend(int(t) for t in tokens)

    def propose(self, k):
        for prompt, want in self.target.items():
            if tuple(self.seq[:len(prompt)]) == prompt and self.seq == want[:len(self.seq)]:
                out = list(want[len(self.seq):len(self.seq) + k])
                for j in range(len(out)):
                    if np.random.default_rng([len(self.seq) + j, 99]).random() >= self.rate:
                        out[j] = (out[j] + 1) % 30000 + 3
                return out
        return []


DEMO_PROMPTS = ["The best thing about working from home is", "Once upon a time, a programmer",
                "A list in Python is", "If you want to be happy,", "The dictionary's get method",
                "My cat thinks that"]


def demo(rounds):
    """The demo model's MTP head on English text -> rows (label, result summed over DEMO_PROMPTS), each the
    best of `rounds`, the modes interleaved round by round (a decode step here is under a millisecond:
    the host's noise moves a single run by 10%)."""
    from colibri_edge.requests.engine import Engine
    from colibri_edge.model.demo import SHIPPED
    modes = (("Colibri off", "off", 1), ("mtp, 1 draft", "mtp", 1), ("mtp, 2 drafts", "mtp", 2),
             ("mtp, 3 drafts", "mtp", 3), ("auto (up to 3)", "auto", 3), ("ngram (up to 8)", "ngram", 8))
    best = {}
    for _ in range(rounds):
        for label, mode, k in modes:
            with Engine.open(SHIPPED, backend="cpu", num_threads=THREADS, max_batch=1, max_seq_len=512, draft=mode,
                             draft_tokens=k) as eng:
                eng.generate("Hello", max_new_tokens=4)                # compile, warm
                eng.stats.__init__()
                ids = [eng.generate(p, max_new_tokens=2 * NEW, ignore_eos=True) for p in DEMO_PROMPTS]
                s = eng.stats
                r = {"tok_s": s.decode_tokens / s.decode_seconds, "proposed": s.draft_proposed,
                     "accepted": s.draft_accepted, "per_step": s.tokens_per_stream_step, "ids": ids}
            if label not in best or r["tok_s"] > best[label]["tok_s"]:
                best[label] = r
    out = [(label, best[label]) for label, _, _ in modes]
    for label, r in out:
        log(f"demo {label}: {r['tok_s']:.1f} tok/s, {r['accepted']}/{r['proposed']}")
        r["same"] = r["ids"] == out[0][1]["ids"]
    return out


def colibri(col, prompt, mode, k=8, slots=None, runs=1):
    """The prompt `runs` times on one engine (the first: a fresh engine; later ones: its n-gram memory
    holds the earlier runs) -> a result per run."""
    from colibri_edge.requests.engine import Engine
    out = []
    with Engine.open(col, backend="cpu", num_threads=THREADS, max_batch=1, max_seq_len=1024, draft=mode,
                     draft_tokens=k, expert_slots=slots) as eng:
        eng.generate(prompt[:8], max_new_tokens=4)                  # compile, warm
        for _ in range(runs):
            eng.stats.__init__()
            ids = eng.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
            s = eng.stats
            out.append({"tok_s": s.decode_tokens / s.decode_seconds, "proposed": s.draft_proposed,
                        "accepted": s.draft_accepted, "per_step": s.tokens_per_stream_step, "ids": list(ids)})
    return out


def llama(exe, gguf, prompts_, spec, rounds):
    import httpx
    from chat_serve import Served
    cmd = [exe, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", str(THREADS), "-tb", str(THREADS),
           "-c", "2048", "--parallel", "1", "--spec-type", spec]
    out = {}
    with Served(cmd, dict(os.environ)) as srv:
        for name, p in prompts_.items():
            runs = []
            for _ in range(rounds):
                r = httpx.post(srv.url + "/completion", json={"prompt": p, "n_predict": NEW, "temperature": 0,
                                                              "ignore_eos": True, "cache_prompt": False},
                               timeout=600).json()
                t = r["timings"]
                runs.append({"tok_s": t["predicted_per_second"], "proposed": t.get("draft_n", 0),
                             "accepted": t.get("draft_n_accepted", 0)})
            # the first request of the server, and the best of the same prompt again (ngram-mod's table
            # keeps every earlier generation of the server)
            out[name] = (runs[0], max(runs[1:], key=lambda r: r["tok_s"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "draft.md"))
    ap.add_argument("--only", choices=["demo"], default=None, help="run only the demo model's MTP rows (written "
                    "to results/draft-demo.md)")
    a = ap.parse_args(argv)
    if a.only == "demo":
        write_demo(a, demo(a.rounds), a.out.replace(".md", "-demo.md"))
        return
    import models
    from colibri_edge.requests import draft
    spec = models.spec(False)
    root = models.cache_dir(False)
    hf = models.build_hf(os.path.join(root, "hf"), spec, log)
    col = models.build_colibri(hf, os.path.join(root, "colibri-float16"), "float16", log)
    V = spec["vocab_size"]
    P = prompts(V)
    draft.DRAFTERS["replay"] = Replay
    rows = []                                   # (prompt, label, result)

    def best_of(fn):
        runs = [fn()[0] for _ in range(a.rounds)]
        return max(runs, key=lambda r: r["tok_s"])

    off, repeat = {}, []
    for name, p in P.items():
        log(f"{name}: off / ngram / auto, fresh and repeated")
        res = {m: [colibri(col, p, m, runs=3) for _ in range(a.rounds)] for m in ("off", "ngram", "auto")}
        off[name] = max((r[0] for r in res["off"]), key=lambda r: r["tok_s"])
        for m in ("off", "ngram", "auto"):
            first = max((r[0] for r in res[m]), key=lambda r: r["tok_s"])
            again = max((x for r in res[m] for x in r[1:]), key=lambda r: r["tok_s"])
            for r in (first, again):
                r["same"] = r["ids"] == off[name]["ids"]
            label = "Colibri off" if m == "off" else f"Colibri {m} (up to 8)"
            rows.append((name, label, first))
            repeat.append((name, label, again))
    Replay.target = {tuple(p): list(p) + off[n]["ids"] for n, p in P.items()}
    p = P["copy"]
    for slots in (None, 24):
        tag = "" if slots is None else ", expert_slots 24/64"
        base = off["copy"] if slots is None else best_of(lambda: colibri(col, p, "off", slots=slots))
        if slots is not None:
            rows.append(("copy", f"Colibri off{tag}", base))
        for rate in (1.0, 0.8, 0.5, 0.2):
            Replay.rate = rate
            for mode, k in (("replay", 4), ("auto", 8)):
                draft.AUTO_DRAFTER = "replay"
                try:
                    r = best_of(lambda: colibri(col, p, mode, k=k, slots=slots))
                finally:
                    draft.AUTO_DRAFTER = "ngram"
                r["same"] = r["ids"] == base["ids"]
                label = f"replay a={rate:.1f}, " + ("4 drafts" if mode == "replay" else "auto (up to 8)")
                rows.append(("copy", label + tag, r))
    ll = {}
    if not a.no_llama:
        import llama_server
        exe = llama_server.binary(log)
        gguf = os.path.join(root, "model-f16.gguf")
        models.build_gguf(hf, gguf, "f16", spec, log)
        for spec in ("none", "ngram-simple", "ngram-mod"):
            log(f"llama-server --spec-type {spec}")
            ll[spec] = llama(exe, gguf, P, spec, a.rounds)
    write(a, rows, ll, repeat)
    write_demo(a, demo(a.rounds), a.out.replace(".md", "-demo.md"))


def write_demo(a, rows, out):
    from chat_serve import isa
    metrics = os.path.join(HERE, "..", "toolchains", "demo-model", "mtp_metrics.json")
    agree = json.load(open(metrics))["validation_agreement"]["after"] if os.path.exists(metrics) else None
    base = rows[0][1]["tok_s"]
    lines = [f"# Speculative decoding: the demo model's MTP head ({time.strftime('%Y-%m-%d')})", "",
             f"Host {os.uname().nodename}, ISA {isa()}, cpu backend, {THREADS} threads, the demo model "
             f"(float16), greedy, {2 * NEW} new tokens after each of {len(DEMO_PROMPTS)} English prompts, summed, best of "
             f"{a.rounds} (interleaved). The head's agreement with the model's greedy token on held-out text: "
             f"{agree if agree is not None else 'n/a'} (mtp_metrics.json). `same`: the tokens equal draft=off's.", "",
             "| drafting | decode tok/s | x off | drafted | accepted | acceptance | tokens/step | same |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for label, r in rows:
        acc = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        lines.append(f"| {label} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f} | {r['proposed']} | {r['accepted']} | "
                     f"{acc:.2f} | {r['per_step']:.2f} | {'yes' if r['same'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out, "w") as f:
        f.write(text)
    with open(out.replace(".md", ".json"), "w") as f:
        json.dump([(lab, {k: v for k, v in r.items() if k != "ids"}) for lab, r in rows], f, indent=1)


def write(a, rows, ll, repeat):
    host = os.uname().nodename
    from chat_serve import isa
    head = ["| prompt | engine / drafting | decode tok/s | x off | drafted | accepted | tokens/step | same |",
            "|---|---|---:|---:|---:|---:|---:|---|"]

    def colibri_rows(table):
        out = []
        for name, label, r in table:
            ref = next(x["tok_s"] for n, lab, x in table if n == name and lab == "Colibri off")
            if "slots" in label and not label.startswith("Colibri off"):
                ref = next(x["tok_s"] for n, lab, x in table if n == name and lab.startswith("Colibri off,"))
            out.append(f"| {name} | {label} | {r['tok_s']:.1f} | {r['tok_s'] / ref:.2f} | {r['proposed']} | "
                       f"{r['accepted']} | {r['per_step']:.2f} | {'yes' if r.get('same', True) else 'NO'} |")
        return out

    def llama_rows(which):
        return [f"| {name} | llama-server {spec} | {pair[which]['tok_s']:.1f} | "
                f"{pair[which]['tok_s'] / ll['none'][name][which]['tok_s']:.2f} | {pair[which]['proposed']} | "
                f"{pair[which]['accepted']} | | |" for spec, res in ll.items() for name, pair in res.items()]

    lines = [f"# Speculative decoding: the benchmark model, batch 1 ({time.strftime('%Y-%m-%d')})", "",
             f"Host {host}, ISA {isa()}, cpu backend, {THREADS} threads, float16 weights (model-f16.gguf's), greedy, "
             f"{NEW} new tokens, best of {a.rounds}. `same`: the tokens equal draft=off's.", "", *head,
             *colibri_rows(rows), *llama_rows(0),
             "", "The same prompt again, in the same engine / server (best of the later runs): Colibri's n-gram "
             "memory and llama.cpp's ngram-mod table hold the earlier runs' output.", "", *head,
             *colibri_rows(repeat), *llama_rows(1)]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    with open(a.out.replace(".md", ".json"), "w") as f:
        json.dump({"rows": [(n, lab, {k: v for k, v in r.items() if k != "ids"}) for n, lab, r in rows],
                   "repeat": [(n, lab, {k: v for k, v in r.items() if k != "ids"}) for n, lab, r in repeat],
                   "llama": ll}, f, indent=1)


if __name__ == "__main__":
    main()
