"""A long prompt arriving while requests stream (part of `make bench`): the streams' inter-token
time while it is prefilled, against the same streams undisturbed, on the cpu backend.

    python benchmarks/interference.py [--model DIR] [--streams 4] [--prompt-tokens 1024] [--chunk 256] [--interleave 0,2,4]

Each run opens the engine with prefill_chunk and one `interleave` (0: prefill chunks of up to
prefill_chunk beside the decodes; x: a step with prefill takes at most x decode steps), starts `streams` requests (temperature 0,
ignore_eos) and waits until they all decode; the undisturbed inter-token times are those of their
next 24 tokens; then a prompt of `prompt-tokens` tokens is submitted and the streams' inter-token
times are taken from its submission to its first token (its prefill, a chunk per step beside the
decodes). The core stamps every event (Event.t), so the times are the core's, not the readers'.
Output: results/interference.md and .json. Target (issue 19): during the prefill, the streams'
median inter-token time at most 2x the undisturbed one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def run(model, streams, prompt_tokens, chunk, backend, interleave):
    from colibri_edge import Engine
    from colibri_edge.requests.scheduler import TOKEN
    with Engine.open(model, backend=backend, max_batch=streams + 1, max_seq_len=prompt_tokens + 512,
                     prefill_chunk=chunk, kv_cache_tokens=(streams + 1) * (prompt_tokens + 512),
                     interleave=interleave) as eng:
        V = eng.config["vocab_size"]
        rng = np.random.default_rng(0)
        eng.generate(rng.integers(0, V, 32).tolist(), max_new_tokens=4, ignore_eos=True)     # warm
        times = [[] for _ in range(streams)]
        reqs = [eng.submit(rng.integers(0, V, 16).tolist(), max_new_tokens=400, ignore_eos=True)
                for _ in range(streams)]

        def read(i):
            for ev in reqs[i].iter_events(timeout=600):
                if ev.kind == TOKEN:
                    times[i].append(ev.t)
        readers = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
        for t in readers:
            t.start()
        while min(len(t) for t in times) < 8:          # all decoding
            time.sleep(0.005)
        n0 = min(len(t) for t in times)
        while min(len(t) for t in times) < n0 + 24:     # undisturbed window
            time.sleep(0.005)
        quiet_end = time.perf_counter()
        t_submit = time.perf_counter()
        long = eng.submit(rng.integers(0, V, prompt_tokens).tolist(), max_new_tokens=1, ignore_eos=True)
        first = next(ev for ev in long.iter_events(timeout=600) if ev.kind == TOKEN).t
        for r in reqs:
            r.cancel()
        for t in readers:
            t.join()

    def itl(lo, hi):
        d = []
        for ts in times:
            ts = np.asarray(ts)
            sel = ts[(ts >= lo) & (ts <= hi)]
            d += np.diff(sel).tolist()
        return np.asarray(d) * 1e3
    quiet = itl(0, quiet_end)
    during = itl(t_submit, first)
    return {"prefill_chunk": chunk, "interleave": interleave, "streams": streams, "prompt_tokens": prompt_tokens,
            "prefill_seconds": first - t_submit, "itl_quiet_ms_p50": float(np.median(quiet)),
            "itl_during_ms_p50": float(np.median(during)) if during.size else None,
            "itl_during_ms_max": float(during.max()) if during.size else None,
            "ratio_p50": float(np.median(during) / np.median(quiet)) if during.size else None,
            "tokens_during": int(during.size)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(HERE, "cache", "full", "colibri-int8"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--interleave", default="0,2,4", help="Engine.open(interleave=...) values (0: no cap)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "interference"))
    a = ap.parse_args()
    rows = [run(a.model, a.streams, a.prompt_tokens, a.chunk, a.backend, float(x)) for x in a.interleave.split(",")]
    with open(a.out + ".json", "w") as f:
        json.dump({"model": a.model, "backend": a.backend, "rows": rows}, f, indent=1)
    lines = [f"# Interference: a {a.prompt_tokens}-token prompt arriving while {a.streams} requests stream",
             "", f"model `{os.path.basename(a.model)}`, backend {a.backend}; inter-token times of the streams (ms)", "",
             "| prefill_chunk | interleave | undisturbed p50 | during its prefill p50 | max | ratio p50 | prefill s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prefill_chunk']} | {r['interleave']:g} | {r['itl_quiet_ms_p50']:.1f} | {r['itl_during_ms_p50']:.1f} | "
                     f"{r['itl_during_ms_max']:.1f} | {r['ratio_p50']:.2f}x | {r['prefill_seconds']:.2f} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
