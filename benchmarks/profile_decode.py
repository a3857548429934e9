"""Where Colibri's decode time goes: every backend operation wrapped with a timer (monkeypatched on
the engine's backend instance), over a few batch-1 decode steps of a warm engine.

Weight-reading operations also count the weight bytes they read, so each gets its own GB/s:
matmul by the weight it multiplies (attention q/k/v/o, router, lm_head), grouped_ffn by the
experts it ran. What the wrapped operations do not cover is the scheduler's Python (step set-up,
arena slicing, routing bookkeeping) and sampling: reported as `python/other`.
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

OPS = ("embed", "matmul", "rmsnorm", "rope", "add", "kv_write", "paged_attention", "route", "align",
       "grouped_ffn", "combine", "upload_into", "download")


def _weight_nbytes(w):
    d = getattr(w, "data", None)
    return int(d.nbytes) if d is not None else 0


def profile(engine, prompt, steps: int) -> dict:
    be, runner = engine.backend, engine.runner
    names = {}
    for li, lw in enumerate(runner.layers):
        for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "router"):
            if lw.get(n) is not None:
                names[id(lw[n])] = n
    names[id(runner.lm_head)] = "lm_head"
    acc = defaultdict(lambda: [0.0, 0, 0])          # key -> seconds, calls, weight bytes
    on = {"v": False}
    saved = {}

    def wrap(op, fn):
        def timed(*args, **kw):
            if not on["v"]:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            r = fn(*args, **kw)
            dt = time.perf_counter() - t0
            key, nbytes = op, 0
            if op == "matmul":
                w = args[2]
                key = "matmul " + names.get(id(w), "other")
                nbytes = _weight_nbytes(w)
            elif op == "grouped_ffn":
                experts, plan = args[2], args[3]
                run = plan.active if getattr(plan, "active", None) is not None else np.flatnonzero(plan.counts)
                nbytes = sum(_weight_nbytes(experts[e].gate) * 3 for e in np.asarray(run).tolist())
            a = acc[key]
            a[0] += dt
            a[1] += 1
            a[2] += nbytes
            return r
        return timed

    for op in OPS:
        if hasattr(be, op):
            saved[op] = getattr(be, op)
            setattr(be, op, wrap(op, saved[op]))
    step_times = []
    inner = runner.step

    def timed_step(entries, all_logits=False):
        t0 = time.perf_counter()
        r = inner(entries, all_logits=all_logits)
        if on["v"]:
            step_times.append(time.perf_counter() - t0)
        return r

    runner.step = timed_step
    # decode steps of one sequence: turn the timers on only for the decode steps
    orig = engine._prefill

    def prefill(*a, **kw):
        on["v"] = False
        r = orig(*a, **kw)
        on["v"] = True
        return r

    engine._prefill = prefill
    t0 = time.perf_counter()
    try:
        engine.generate(prompt, max_new_tokens=steps + 1, ignore_eos=True)
    finally:
        wall = time.perf_counter() - t0
        on["v"] = False
        for op, fn in saved.items():
            setattr(be, op, fn)
        del engine._prefill
        runner.step = inner
    total = float(np.sum(step_times))
    ops_total = sum(v[0] for v in acc.values())
    rows = []
    for key, (sec, calls, nbytes) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        rows.append({"op": key, "ms_per_step": sec / steps * 1e3, "share": sec / total, "calls_per_step": calls / steps,
                     "weight_mb_per_step": nbytes / steps / 1e6, "gbps": nbytes / sec / 1e9 if nbytes else None})
    rows.append({"op": "python/other (step minus ops)", "ms_per_step": (total - ops_total) / steps * 1e3,
                 "share": (total - ops_total) / total, "calls_per_step": None, "weight_mb_per_step": 0, "gbps": None})
    return {"steps": steps, "step_ms": total / steps * 1e3, "rows": rows,
            "note": "timers add ~1 us a call; steps with timers run slightly slower than untimed ones"}
