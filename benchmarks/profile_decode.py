"""Where Colibri's decode time goes: every backend operation wrapped with a timer (monkeypatched on
the engine's backend instance), over a few decode steps of a warm engine: one sequence, or
(`batch=`) several decoded together.

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


def profile(engine, prompt, steps: int, batch: list | None = None) -> dict:
    """prompt: one sequence's ids (batch-1 decode steps); batch: prompts decoded together instead
    (engine.generate_batch), timed on the steps that only decode (the request core staggers the
    prompts' prefill, so their batch grows and shrinks: batch_p50 is its median)."""
    be, runner = engine.backend, engine.runner
    names = {}
    prog = runner.program
    for layer in prog.layers:
        for n in ("wq", "wk", "wv", "wo"):
            names[id(getattr(layer.mixer, n))] = "attn." + n
    for moe in prog.moe:
        names[id(moe.router)] = "router"
    names[id(prog.lm_head)] = "lm_head"
    acc = defaultdict(lambda: [0.0, 0, 0])          # key -> seconds, calls, weight bytes (all steps)
    per_step = []                                    # per decode step: key -> seconds
    cur = defaultdict(float)
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
            cur[key] += dt
            a = acc[key]
            a[0] += dt
            a[1] += 1
            a[2] += nbytes
            return r
        return timed

    for op in OPS:
        saved[op] = getattr(be, op)
        setattr(be, op, wrap(op, saved[op]))
    step_times, sizes = [], []
    inner = runner.step

    def timed_step(entries, all_logits=False, stepwise=False):
        on["v"] = all(len(t) == 1 for _, t in entries)   # timers on for the steps that only decode
        if on["v"] and batch is not None:
            sizes.append(len(entries))
        cur.clear()
        t0 = time.perf_counter()
        r = inner(entries, all_logits=all_logits, stepwise=stepwise)
        if on["v"]:
            step_times.append(time.perf_counter() - t0)
            per_step.append(dict(cur))
        return r

    runner.step = timed_step
    try:
        if batch is None:
            engine.generate(prompt, max_new_tokens=steps + 1, ignore_eos=True)
        else:
            engine.generate_batch(batch, max_new_tokens=steps + 1, ignore_eos=True)
    finally:
        on["v"] = False
        for op, fn in saved.items():
            setattr(be, op, fn)
        runner.step = inner
    # medians over steps (the CPU may be shared: a step disturbed by another process does not skew them)
    steps_done = len(step_times)
    med_step = float(np.median(step_times))
    rows = []
    for key, (sec, calls, nbytes) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        med = float(np.median([d.get(key, 0.0) for d in per_step]))
        rows.append({"op": key, "ms_per_step": med * 1e3, "mean_ms_per_step": sec / steps_done * 1e3,
                     "share": med / med_step, "calls_per_step": calls / steps_done,
                     "weight_mb_per_step": nbytes / steps_done / 1e6,
                     "gbps": nbytes / steps_done / med / 1e9 if nbytes and med > 0 else None})
    rows.sort(key=lambda x: -x["ms_per_step"])
    other = float(np.median([t - sum(d.values()) for t, d in zip(step_times, per_step)]))
    rows.append({"op": "python/other (step minus ops)", "ms_per_step": other * 1e3, "mean_ms_per_step": None,
                 "share": other / med_step, "calls_per_step": None, "weight_mb_per_step": 0, "gbps": None})
    return {"steps": steps_done, "batch_p50": float(np.median(sizes)) if sizes else 1.0, "step_ms": med_step * 1e3, "step_mean_ms": float(np.mean(step_times)) * 1e3,
            "rows": rows, "note": "medians over the steps; timers add ~1 us a call"}
