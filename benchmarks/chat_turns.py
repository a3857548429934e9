"""A multi-turn chat with and without prefix caching: time to first token of each turn.

Each turn sends the whole conversation so far (as a chat app and the OpenAI API do) through
Engine.submit and times submission to the first token; the same conversation runs on an engine with
prefix_cache=True and one with prefix_cache=False, interleaved turn by turn, and the replies must be
equal. Prints a table per turn (prompt tokens, cached tokens, TTFT on / off) and the turn-N ratio.

Usage: python benchmarks/chat_turns.py [--model DIR] [--turns 10] [--backend cpu] [--reply 48]
(default: the embedded demo model, greedy replies of 48 tokens, cpu backend)
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from colibri_edge import Engine  # noqa: E402
from colibri_edge.requests.scheduler import DONE, TOKEN  # noqa: E402

QUESTIONS = ["Tell me a fortune.", "What does json.dumps do?", "Another one, please.", "Explain the with statement.",
             "What is a list in Python?", "Tell me something funny.", "How do I use os.path.join?",
             "Say something wise.", "What does str.split do?", "Cheer me up.", "Explain generators in Python.",
             "Quote of the day?"]


def turn(eng, msgs, reply):
    t0 = time.perf_counter()
    req = eng.submit(msgs, max_new_tokens=reply, temperature=0)
    ttft, toks = None, []
    for ev in req.iter_events(timeout=600):
        if ev.kind == TOKEN:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            toks.append(ev.token)
        elif ev.kind == DONE:
            break
    n_prompt = len(eng._prompt_ids(msgs))
    return ttft, toks, req.cached_tokens, n_prompt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply", type=int, default=48)
    ap.add_argument("--backend", default="cpu")
    a = ap.parse_args(argv)
    if a.model is None:
        from colibri_edge.model.demo import ensure_default_model
        a.model = ensure_default_model()[0]
    opts = dict(backend=a.backend, max_seq_len=None, max_batch=2)
    on, off = Engine.open(a.model, prefix_cache=True, **opts), Engine.open(a.model, prefix_cache=False, **opts)
    turn(on, [{"role": "user", "content": "warm up"}], 4)          # kernels compiled, caches warm
    turn(off, [{"role": "user", "content": "warm up"}], 4)
    msgs, rows = [], []
    for i in range(a.turns):
        msgs.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        t_on, toks_on, cached, n = turn(on, msgs, a.reply)
        t_off, toks_off, _, _ = turn(off, msgs, a.reply)
        if toks_on != toks_off:
            raise SystemExit(f"turn {i + 1}: the cached engine's reply differs from the uncached one's")
        rows.append((i + 1, n, cached, t_on, t_off))
        msgs.append({"role": "assistant", "content": on.codec.reply(toks_on)[0]})
    print(f"# chat turns: {os.path.basename(os.path.normpath(a.model))}, {a.backend}, greedy replies of {a.reply} "
          f"tokens; host {platform.machine()} {os.cpu_count()} cpus")
    print("| turn | prompt tokens | cached | TTFT cached ms | TTFT uncached ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, n, c, t_on, t_off in rows:
        print(f"| {i} | {n} | {c} | {1e3 * t_on:.1f} | {1e3 * t_off:.1f} | {t_on / t_off:.2f} |")
    print(f"turn {rows[-1][0]}: TTFT {rows[-1][3] / rows[-1][4]:.2f}x of the same prompt uncached; "
          f"hit rate {on.stats.prefix_hit_rate:.2f}")
    on.close()
    off.close()


if __name__ == "__main__":
    main()
