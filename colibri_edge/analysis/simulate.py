"""`colibri simulate`: replay a routing trace through the engine's own slot-pool decisions
(slots.SlotCache.access_layer), in the engine's order: step by step, MoE layers in order, within a
layer the union of the step's experts in ascending id. lru and lfu give exactly the counters the
engine reports for the same trace and slot count; belady (offline optimum for demand loading) bounds
them; prefetch uses the trace's predicted_ids (layer L+1's router on layer L's hidden state).

With a device profile it estimates the time per token and whether the model fits:
    ms/token = bytes read per token / (bandwidth x efficiency)
               + (cold misses / miss bandwidth + other misses / re-read bandwidth) x blob bytes / tokens
               + layer_overhead_ms x layers (a profile from `colibri probe-device` has it)
a cold miss is the first load of an expert; a later miss re-reads a blob the pool dropped, which a
cache under the page cache may still hold (probe-device measures that rate: reread_bandwidth_gbs;
a profile without it re-reads at miss_bandwidth_gbs). Under thrash nearly every miss is a re-read:
the 2026-12-02 pressure run at 8 slots was predicted 222 ms/token at the cold rate, measured 60.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT
from ..runtime.slots import POLICIES, PREFETCH_MIN_P, SlotCache, likely_experts
from .trace import Trace

PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "profiles")


def profile_path() -> str:
    from ..knobs import device_profile_path
    return device_profile_path()


def _layer_accesses(tr: Trace, min_p: float = PREFETCH_MIN_P):
    """Yields (step tokens, j, layer, experts ascending, prefetch or None) in engine order; prefetch as
    the engine chooses it (slots.likely_experts)."""
    L = len(tr.layer_ids)
    pw = tr.predicted_weights
    for _, idx in tr.steps():
        for j in range(L):
            experts = np.unique(tr.expert_ids[idx, j].astype(np.int64))
            prefetch = None
            if j + 1 < L:
                pred = tr.predicted_ids[idx, j + 1].astype(np.int64)
                if (pred >= 0).all():
                    prefetch = (int(tr.layer_ids[j + 1]),
                                likely_experts(pred, None if pw is None else pw[idx, j + 1], min_p), np.unique(pred))
            yield j, int(tr.layer_ids[j]), experts, prefetch


def replay(tr: Trace, slots: int, policy: str, min_p: float = PREFETCH_MIN_P, pinned=()) -> dict:
    """pinned: the learned hot set, (layer, expert) keys hottest first, pinned as the engine's pool pins
    them at open (SlotCache.pin)."""
    if policy not in POLICIES:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--policy {policy!r}: use one of {', '.join(POLICIES)}")
    blob = int(tr.meta["bytes_per_expert"])
    cache = SlotCache(slots, policy, blob)
    cache.pin(pinned)
    if policy == "belady":
        cache.set_future([(layer, int(e)) for _, layer, experts, _ in _layer_accesses(tr) for e in experts])
    events: dict = {}
    for _, layer, experts, prefetch in _layer_accesses(tr, min_p):
        waves, _ = cache.access_layer(layer, experts, prefetch if policy == "prefetch" else None)
        for w in waves:                          # a wave's misses are issued together, waves one after another
            h = sum(hit for _, _, hit in w)
            events[(h, len(w) - h)] = events.get((h, len(w) - h), 0) + 1
    c = cache.c.as_dict()
    return {"policy": policy, "slots": slots, "hits": c["hits"], "misses": c["misses"],
            "cold_misses": c["cold_misses"], "hit_rate": c["hit_rate"],
            "prefetch_hits": c["prefetch_hits"], "prefetches": c["prefetches"], "evictions": c["evictions"],
            "bytes_moved": c["bytes_loaded"], "stall_misses": c["misses"], "tokens": int(tr.expert_ids.shape[0]),
            "pinned": c["pinned"], "prediction_recall": c["prediction_recall"], "wave_events": [[h, k, n] for (h, k), n in sorted(events.items())],
            "prediction_precision": c["prediction_precision"]}


def load_profile(name_or_path: str) -> dict:
    """A shipped profile by name, "this" (the machine as `colibri probe-device` measured it), or a file."""
    if name_or_path == "this":
        path = profile_path()
        if not os.path.exists(path):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--device this: {path} does not exist; run "
                               "`colibri probe-device` first (it measures this machine)")
        name_or_path = path
    path = name_or_path if os.path.exists(name_or_path) else os.path.join(PROFILE_DIR, name_or_path + ".json")
    if not os.path.exists(path):
        names = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"device profile {name_or_path!r} not found; shipped: "
                           f"{', '.join(names)}, or pass a JSON file with memory_bytes, memory_bandwidth_gbs, "
                           "miss_bandwidth_gbs")
    try:
        prof = json.load(open(path))
        for f in ("memory_bytes", "memory_bandwidth_gbs", "miss_bandwidth_gbs"):
            float(prof[f])
        for f in ("reread_bandwidth_gbs", "layer_overhead_ms", "bandwidth_efficiency"):   # optional
            if f in prof:
                float(prof[f])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{path}: bad device profile ({e})") from None
    return prof


def wave_stall_s(hits: int, misses: int, compute_s: float, load_s: float) -> float:
    """The time a wave of one layer's experts (all of them, unless the slots cannot hold them at once)
    waits for its misses beyond its experts' own compute, as the pool runs it (slots.SlotPool.run_layer): every miss issued at once on the I/O threads, landing one every
    load_s (the drive's rate with the reads in flight), the resident experts computed first, each landed
    one as soon as the compute before it is done:
        t = hits * compute_s;  for i in 1..misses: t = max(t, i * load_s) + compute_s
        stall = t - (hits + misses) * compute_s"""
    t = hits * compute_s
    for i in range(1, misses + 1):
        t = max(t, i * load_s) + compute_s
    return t - (hits + misses) * compute_s


def estimate(result: dict, tr: Trace, prof: dict, context: int) -> dict:
    """ms per token on `prof` for a replay result (module docstring). With result["wave_events"]
    ([hits, misses, count] of the layers' waves -- a layer is one wave unless it needs more slots than
    it can have at once, what replay and the pressure benchmark record)
    the misses are priced as the pool spends them, overlapped with the resident experts' compute
    (wave_stall_s), at the drive's rate with several reads in flight: the profile's direct_io
    verdict's direct rate when it chose direct reads (no page cache: cold = re-read), else its
    parallel buffered rate. Without events, or with a profile that has no such rates (the shipped
    ones), every miss stalls for its whole read at the cold / re-read rates."""
    m = tr.meta
    eff = float(prof.get("bandwidth_efficiency", 1.0))
    tokens = max(result["tokens"], 1)
    read_s = m["bytes_per_decoded_token"] / (prof["memory_bandwidth_gbs"] * 1e9 * eff)
    cold = result.get("cold_misses", result["misses"])
    reread_bw = float(prof.get("reread_bandwidth_gbs", prof["miss_bandwidth_gbs"]))
    d = prof.get("direct_io") or {}
    io_gbs = d.get("direct_gbs") if d.get("use") else prof.get("parallel_miss_bandwidth_gbs")
    if result.get("wave_events") and io_gbs:
        blob = m["bytes_per_expert"]
        c, ld = blob / (prof["memory_bandwidth_gbs"] * 1e9 * eff), blob / (float(io_gbs) * 1e9)
        miss_s = sum(n * wave_stall_s(h, k, c, ld) for h, k, n in result["wave_events"]) / tokens
    else:
        miss_s = m["bytes_per_expert"] / tokens * (cold / (prof["miss_bandwidth_gbs"] * 1e9) +
                                                   (result["misses"] - cold) / (reread_bw * 1e9))
    need = m["non_expert_bytes"] + result["slots"] * m["bytes_per_expert"] + context * m["kv_bytes_per_token"] \
        + m.get("kv_window_bytes_per_sequence", 0) + m.get("state_bytes_per_sequence", 0) + m.get("scratch_bytes", 0)
    # per-layer overhead, measured by probe-device (0 when the profile has none) x the model's layers
    step_s = float(prof.get("layer_overhead_ms", 0.0)) * int(m.get("num_hidden_layers", 0)) / 1e3
    return {"device": prof.get("name", "custom"), "est_ms_per_token": 1e3 * (read_s + miss_s + step_s),
            "est_read_ms": 1e3 * read_s, "est_miss_ms": 1e3 * miss_s, "memory_needed_bytes": int(need),
            "device_memory_bytes": int(prof["memory_bytes"]), "fits": bool(need <= prof["memory_bytes"]),
            "context": context}


def recommend(tr: Trace, prof: dict, policy: str, target_ms: float, context: int) -> dict:
    """The smallest slot count whose estimated ms per token on `prof` is <= target_ms and whose memory
    fits the device: the sweep's points, then bisection between the last point over the target and
    the first under it (the estimate falls as slots grow, up to replay noise, which the bisection
    accepts). -> {"slots", "est_ms_per_token", "memory_needed_bytes", "fits", "met"}; met False: no
    count meets the target within the device's memory (the fastest one that fits is returned)."""
    def at(n):
        r = replay(tr, n, policy)
        r.update(estimate(r, tr, prof, context))
        return r
    pts = [at(n) for n in sweep_points(tr)]
    fits = [r for r in pts if r["fits"]]
    if not fits:
        return {**pts[0], "met": False}
    ok = [r for r in fits if r["est_ms_per_token"] <= target_ms]
    if not ok:
        return {**min(fits, key=lambda r: r["est_ms_per_token"]), "met": False}
    hi = ok[0]
    below = [r for r in pts if r["slots"] < hi["slots"]]
    lo = below[-1]["slots"] if below else hi["slots"]
    while hi["slots"] - lo > 1:                      # est(lo) > target (or lo is the first point), est(hi) <= target
        mid = at((lo + hi["slots"]) // 2)
        if mid["fits"] and mid["est_ms_per_token"] <= target_ms:
            hi = mid
        else:
            lo = mid["slots"]
    return {**hi, "met": True}


def sweep_points(tr: Trace):
    total = len(tr.layer_ids) * int(tr.meta["experts_per_layer"])
    k = int(tr.meta["top_k"])
    pts = sorted({max(1, k), *np.linspace(max(1, k), total, 12).astype(int).tolist(), total})
    return pts


def plot_sweep(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for pol in sorted({r["policy"] for r in rows}):
        pts = [r for r in rows if r["policy"] == pol]
        ax.plot([r["slots"] for r in pts], [r["hit_rate"] for r in pts], marker="o", label=pol)
    ax.set_xlabel("expert slots")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
