"""Where a step's time goes, by phase: timers around the backend's operations while the engine runs
(`Engine.open(profile=True)`, `colibri serve --profile`; the dashboard shows it).

Each operation the runner calls on the backend is wrapped on the backend instance, and its time is
charged to a phase:

    attention   the mixer: rope, kv_write, paged / latent attention, causal_conv, delta_rule, gate_mul,
                head_matmul, and matmuls of the mixers' weights (q, k, v, o; the delta-nets' projections)
    experts     route, align, grouped_ffn, combine, slot_ffn, load_slot, and matmuls of the routers'
                and FFN weights
    lm_head     the final projection to the vocabulary
    other       embed, rmsnorm, add, scale, uploads, downloads and copies
    host        the step's wall time minus the operations': the runner's and scheduler's Python

    step_ms[phase] = median over the last `window` steps of that phase's seconds in the step

On a backend with a queue (opencl, cuda) an operation returns before the device has run it, so in
profile mode each timed operation is followed by synchronize(): the phases are then device time, and
the steps are slower by the lost overlap (profile mode is for looking, not for serving at full
speed). A timer costs about 1 us a call on the host.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from ..backends.base import Backend, Weight

PHASES = ("attention", "experts", "lm_head", "other", "host")
OPS = {"rope": "attention", "kv_write": "attention", "paged_attention": "attention",
       "latent_attention": "attention", "causal_conv": "attention", "delta_rule": "attention",
       "gate_mul": "attention", "head_matmul": "attention",
       "route": "experts", "align": "experts", "grouped_ffn": "experts", "combine": "experts",
       "slot_ffn": "experts", "load_slot": "experts",
       "embed": "other", "rmsnorm": "other", "add": "other", "scale": "other", "upload_into": "other",
       "download": "other", "copy_into": "other",
       "matmul": None, "matmuls": None}          # by the weight they multiply


def _weights(obj) -> list:
    return [v for v in vars(obj).values() if isinstance(v, Weight)] if hasattr(obj, "__dict__") else []


class StepProfiler:
    """Installed on a runner's backend; summary() gives the recent steps' phase medians."""

    def __init__(self, runner, window: int = 256):
        self.runner, self.be = runner, runner.be
        prog = runner.program
        self.owner = {id(prog.lm_head): "lm_head"}
        for layer in prog.layers:
            for w in _weights(layer.mixer):
                self.owner[id(w)] = "attention"
        for moe in prog.moe:
            self.owner[id(moe.router)] = "experts"
        self.sync = type(self.be).synchronize is not Backend.synchronize     # a backend with a queue
        self.cur = dict.fromkeys(PHASES, 0.0)
        self.depth = [0]                       # timed operations in progress (nested ones are not re-timed)
        self.ring = deque(maxlen=int(window))
        self.lock = threading.Lock()
        self.saved = {}
        for op, phase in OPS.items():
            fn = getattr(self.be, op, None)
            if fn is not None:
                self.saved[op] = fn
                setattr(self.be, op, self._wrap(op, phase, fn))
        self._step = runner.step
        runner.step = self._timed_step

    def _wrap(self, op, phase, fn):
        cur, owner, be, sync, depth = self.cur, self.owner, self.be, self.sync, self.depth

        def timed(*args, **kw):
            if depth[0]:                       # called by another timed operation: charged to that one
                return fn(*args, **kw)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                r = fn(*args, **kw)
                if sync:
                    be.synchronize()
            finally:
                depth[0] -= 1
            p = phase
            if p is None:                      # matmul(out, x, w) / matmuls(outs, x, ws): by the weight
                w = args[2] if len(args) > 2 else kw.get("w", kw.get("ws"))
                w = w[0] if isinstance(w, (list, tuple)) and w else w
                p = owner.get(id(w), "experts")
            cur[p] += time.perf_counter() - t0
            return r
        return timed

    def _timed_step(self, entries, all_logits=False, stepwise=False):
        for p in PHASES:
            self.cur[p] = 0.0
        t0 = time.perf_counter()
        r = self._step(entries, all_logits=all_logits, stepwise=stepwise)
        if self.sync:
            self.be.synchronize()
        total = time.perf_counter() - t0
        ops = sum(self.cur[p] for p in PHASES[:-1])
        row = dict(self.cur, host=max(total - ops, 0.0), step=total, tokens=sum(len(t) for _, t in entries),
                   decode=all(len(t) == 1 for _, t in entries))
        with self.lock:
            self.ring.append(row)
        return r

    def summary(self) -> dict:
        """{"steps": n, "decode_steps": n, "step_ms": median, "phases_ms": {phase: median ms}} over the
        window's decode steps (all steps when there are none)."""
        with self.lock:
            rows = list(self.ring)
        dec = [r for r in rows if r["decode"]] or rows
        if not dec:
            return {"steps": 0, "decode_steps": 0, "step_ms": None, "phases_ms": None}
        return {"steps": len(rows), "decode_steps": sum(r["decode"] for r in rows),
                "step_ms": float(np.median([r["step"] for r in dec])) * 1e3,
                "phases_ms": {p: float(np.median([r[p] for r in dec])) * 1e3 for p in PHASES}}

    def close(self):
        for op, fn in self.saved.items():
            setattr(self.be, op, fn)
        self.runner.step = self._step

