"""`colibri plan MODEL [--memory SIZE]`: what lives where when MODEL runs in SIZE of memory, and the
decode speed the simulator predicts for it on this device.

The layout is the engine's own: the model is opened with expert_slots="auto" and the memory budget
(so the slot count, the arena and the KV cache are exactly what `colibri run --expert-slots auto
--memory-budget SIZE` would allocate), the learned hot set is what the pool pinned at open (the
model's routing heat, runtime/slots.py), the rest of the slots stream. The prediction replays a
routing trace through the pool's own decisions (simulate.replay, with the pinned hot set) and prices
it with a device profile (simulate.estimate): a trace file when given, else tokens drawn from the
model's routing heat (each layer's top-k without replacement, in proportion to heat: the hot set's
effect is then the heat's, but there is no step-to-step reuse, so the hit rate is a floor), else
uniform routing (no heat yet: the worst case).
"""
from __future__ import annotations

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from ..analysis.trace import Trace

DRAWN_TOKENS = 512


def drawn_trace(meta: dict, layers: list, heat: dict | None, tokens: int = DRAWN_TOKENS, seed: int = 0) -> Trace:
    """`tokens` decode steps of one token each, every MoE layer routed to top_k distinct experts drawn
    in proportion to heat[(layer, expert)] (uniform without heat)."""
    rng = np.random.default_rng(seed)
    E, k = int(meta["experts_per_layer"]), int(meta["top_k"])
    ids = np.zeros((tokens, len(layers), k), np.int16)
    for j, layer in enumerate(layers):
        p = np.ones(E) if heat is None else np.array([heat.get((layer, e), 0.0) for e in range(E)]) + 1e-3
        p = p / p.sum()
        for t in range(tokens):
            ids[t, j] = rng.choice(E, size=k, replace=False, p=p)
    return Trace(ids, np.full(ids.shape, 1.0 / k, np.float32), np.zeros(tokens, np.int32),
                 np.arange(tokens, dtype=np.int32), np.arange(tokens, dtype=np.int32), np.asarray(layers, np.int32),
                 np.full(ids.shape, -1, np.int16), dict(meta))


def plan(model: str, memory: int | None, device: str | None, trace_path: str | None, policy: str,
         context: int | None, backend: str = "cpu") -> dict:
    """context: the KV cache's tokens (None: the model's maximum)."""
    from ..requests.engine import Engine
    from ..runtime.slots import load_heat
    from ..analysis.simulate import estimate, load_profile, profile_path, replay
    import os
    with Engine.open(model, backend=backend, expert_slots="auto", memory_budget=memory, max_seq_len=context,
                     max_batch=1, slot_policy=policy) as eng:
        meta = eng.trace_meta()
        r = eng.runner
        context = r.max_seq_len
        pool = r.slot_pool
        layers = [m.layer for m in r.program.moe]
        out = {"model": model, "memory": memory, "slot_choice": eng.slot_choice, "policy": policy,
               "non_expert_bytes": int(meta["non_expert_bytes"]), "resident_weight_bytes": r.resident_weight_bytes(),
               "arena_bytes": int(r.arena_bytes),
               "kv_bytes": int(r.states.nbytes()), "bytes_per_expert": int(meta["bytes_per_expert"]),
               "experts": len(layers) * int(meta["experts_per_layer"]), "context": context}
        if pool is None:
            out.update(slots=None, pinned=[], streamed_slots=0, heat_file=None)
            heat = None
        else:
            st = pool.stats()
            out.update(slots=pool.cache.n, pinned=[tuple(k) for k in pool.pinned_keys],
                       streamed_slots=pool.cache.n - len(pool.pinned_keys), heat_file=pool.heat_path,
                       direct_io=st["direct_io"], direct_io_why=st["direct_io_why"], io_threads=st["io_threads"])
            heat = load_heat(pool.heat_path, eng.model)
    if trace_path:
        tr = Trace.load(trace_path)
        source = f"the trace {trace_path}"
    else:
        tr = drawn_trace(meta, layers, heat)
        source = ("tokens drawn from the model's routing heat" if heat is not None else
                  "uniform routing (no routing heat for this model yet: run it once with expert slots)")
    out["routing"] = source
    if device is None and not os.path.exists(profile_path()):
        out["prediction"] = None
        out["why_no_prediction"] = "no device profile: run `colibri probe-device` (or pass --device NAME)"
        return out
    prof = load_profile(device or "this")
    n = out["slots"] or out["experts"]
    res = replay(tr, n, policy, pinned=out["pinned"])
    res.update(estimate(res, tr, prof, context))
    out["prediction"] = {"device": prof.get("name"), "ms_per_token": res["est_ms_per_token"],
                         "tok_s": 1e3 / res["est_ms_per_token"], "hit_rate": res["hit_rate"],
                         "misses_per_token": res["misses"] / max(res["tokens"], 1), "fits": res["fits"]}
    return out


def print_plan(p: dict):
    from ..units import human
    if p["memory"] is not None and p["memory"] <= 0:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "--memory: give a positive size (e.g. 600M, 4G)")
    print(f"model {p['model']}: {p['experts']} routed experts of {human(p['bytes_per_expert'])}")
    if p["slot_choice"] is not None:
        print(f"  memory: {p['slot_choice']['why']}")
    rows = [("non-expert weights (resident)", p["resident_weight_bytes"]), ("arena", p["arena_bytes"]),
            (f"KV cache ({p['context']} tokens)", p["kv_bytes"])]
    if p["slots"] is None:
        rows.append((f"experts, all {p['experts']} resident", p["experts"] * p["bytes_per_expert"]))
    else:
        rows.append((f"pinned hot set: {len(p['pinned'])} experts", len(p["pinned"]) * p["bytes_per_expert"]))
        rows.append((f"streaming slots: {p['streamed_slots']} for the other {p['experts'] - len(p['pinned'])} "
                     "experts", p["streamed_slots"] * p["bytes_per_expert"]))
    for name, b in rows:
        print(f"  {name:<58}{human(b):>12}")
    print(f"  {'total':<58}{human(sum(b for _, b in rows)):>12}")
    if p["slots"] is not None:
        if p["pinned"]:
            print("  pinned (layer:expert): " + " ".join(f"{l}:{e}" for l, e in p["pinned"]))
        print(f"  hot set from {p['heat_file']}" if p["pinned"] else
              "  no hot set yet (it is learned from the model's routing when it runs with expert slots)")
        print(f"  reads: {p['io_threads']} I/O threads, {'direct' if p['direct_io'] else 'buffered'} "
              f"({p['direct_io_why']})")
    pr = p["prediction"]
    if pr is None:
        print(f"  prediction: none ({p['why_no_prediction']})")
    else:
        print(f"  predicted on {pr['device']}: {pr['ms_per_token']:.1f} ms/token ({pr['tok_s']:.1f} tok/s), hit rate "
              f"{pr['hit_rate']:.3f}, {pr['misses_per_token']:.2f} misses/token, policy {p['policy']}; routing: "
              f"{p['routing']}")
