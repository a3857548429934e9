"""The live dashboard of `colibri serve`: a static page (static/dashboard/: plain JS and canvas, no build
step, nothing fetched from the network) and the JSON API it renders, which tests read too.

    GET  /dashboard                 the page (index.html, dashboard.js, dashboard.css; config.json says
                                    whether the API wants a key, so the page asks before its first call)
    GET  /v1/dashboard/state        per model: counters, rates, latencies, pools, slots, heat map, memory
    POST /v1/dashboard/trace        a `colibri trace` .npz as the body -> the same heat-map structure

Why these sources: every counter and gauge is read from the Prometheus registry that /metrics renders
(the same Counter, Histogram and pool collector), so the two agree at any moment; rates and
percentiles are differences of those cumulative values over a window (TTFT and inter-token latency
percentiles are interpolated in the histogram's buckets, as Prometheus' histogram_quantile does). The
heat map differences Engine.expert_counts (cumulative, counted on the backend) against a kept
snapshot at least `heat_tokens` tokens older, so it costs nothing per step; its resolution is the
polling interval. The page itself holds no data and is served without the API key; the API needs it.
"""
import json
import os
import time
from collections import deque

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

STATIC = os.path.join(os.path.dirname(__file__), "static", "dashboard")
FILES = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
         "dashboard.css": "text/css; charset=utf-8"}
WINDOW_S = 30.0          # rates and latency percentiles: over about the last 30 seconds
HEAT_TOKENS = 256        # the heat map: routing counts over about the last 256 tokens
PHASES_NOTE = ("profiling is off: start colibri serve with --profile (Engine.open(profile=True)) for the "
               "step-time breakdown by phase")


def heat_from_trace(tr) -> dict:
    """A Trace's routing counts per (MoE layer, expert), in the live heat map's shape."""
    E = int(tr.meta["experts_per_layer"])
    T, L, _ = tr.expert_ids.shape
    counts = []
    for j in range(L):
        ids = tr.expert_ids[:, j, :].reshape(-1).astype(np.int64)
        counts.append(np.bincount(ids[ids >= 0], minlength=E)[:E].tolist())
    return {"layers": [int(x) for x in tr.layer_ids], "experts": E, "counts": counts, "tokens": int(T),
            "model": tr.meta.get("model")}


def _samples(registry) -> dict:
    """{(sample name, model, le or None): value} of every sample /metrics would render now."""
    out = {}
    for fam in registry.collect():
        for s in fam.samples:
            out[(s.name, s.labels.get("model"), s.labels.get("le"))] = s.value
    return out


def _quantile(q, bounds, cum):
    """histogram_quantile: q of the observations whose cumulative bucket counts are `cum` (upper
    bounds `bounds`, the last +Inf), linear within a bucket; None without observations."""
    total = cum[-1]
    if total <= 0:
        return None
    rank = q * total
    for i, c in enumerate(cum):
        if c >= rank:
            if bounds[i] == float("inf"):
                return bounds[i - 1] if i else None
            lo, below = (bounds[i - 1], cum[i - 1]) if i else (0.0, 0.0)
            inside = c - below
            return lo + (bounds[i] - lo) * ((rank - below) / inside if inside else 1.0)
    return bounds[-2]


class _Model:
    """One model's rings: samples of the cumulative values (rates, percentiles) and snapshots of its
    routing counts (heat map)."""

    def __init__(self, host, window_s, heat_tokens):
        self.host, self.window_s, self.heat_tokens = host, window_s, heat_tokens
        self.samples = deque()          # (t, {value name: cumulative value or bucket tuple})
        self.heat = deque()             # (tokens routed, counts [MoE layers, E])
        e = host.engine
        self.moe_layers = [m.layer for m in e.runner.program.moe]
        self.top_k = max(int(e.runner.top_k), 1)

    def routed(self):
        """(tokens routed so far, counts [MoE layers, E]) from Engine.expert_counts."""
        c = self.host.engine.expert_counts[self.moe_layers] if self.moe_layers else np.zeros((0, 1), np.int64)
        return (int(c[0].sum()) // self.top_k if len(c) else 0), c

    def sample(self, now, values):
        self.samples.append((now, values))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()       # keep one sample at or before the window's start
        return self.samples[0]

    def heat_map(self):
        tokens, counts = self.routed()
        if not self.heat or self.heat[-1][0] != tokens:
            self.heat.append((tokens, counts))
        while len(self.heat) > 1 and self.heat[1][0] <= tokens - self.heat_tokens:
            self.heat.popleft()          # keep the newest snapshot at least heat_tokens old
        base_tokens, base = self.heat[0]
        E = counts.shape[1] if len(counts) else 0
        return {"layers": self.moe_layers, "experts": int(self.host.engine.config["experts_per_layer"]) if E else 0,
                "counts": (counts - base).tolist(), "tokens": tokens - base_tokens, "window_tokens": self.heat_tokens}


def _memory(e) -> dict:
    """Bytes the engine holds, by part, and what the backend says is still free."""
    r = e.runner
    pool = r.slot_pool
    experts = sum(x.weight_size for x in e.model.experts)
    weights = sum(t["nbytes"] for t in e.model.tensors.values()) + (0 if pool is not None else experts)
    slots = 0 if pool is None else pool.cache.n * max(x.weight_size for x in e.model.experts)
    avail, what = e.backend.memory_available()
    return {"weights": int(weights), "weights_where": "device copy" if e.backend.copies_weights else
            "memory-mapped from the model directory", "slots": int(slots), "kv": int(r.state_bytes),
            "arena": int(r.arena_bytes), "engine_total": int(r.memory_need), "available": int(avail),
            "available_limit": what, "budget": e.memory_budget}


def add_dashboard(app, hosts, metrics, auth=False, window_s=WINDOW_S, heat_tokens=HEAT_TOKENS):
    """Serve the page and its API on `app` (serve.create_app's FastAPI app; hosts: {name: _Host};
    metrics: its _Metrics). auth: whether the API needs the server's key (the page then asks for it).
    Call it after the app's other middleware: the page's files are answered outside the key check."""
    from fastapi import Request
    models = {n: _Model(h, window_s, heat_tokens) for n, h in hosts.items()}
    config = json.dumps({"auth": bool(auth), "window_s": window_s, "heat_tokens": heat_tokens}).encode()

    def state() -> dict:
        now = time.monotonic()
        s = _samples(metrics.registry)
        bounds = {}
        for (name, _, le) in s:
            if le is not None:
                bounds.setdefault(name, set()).add(float(le))
        bounds = {k: sorted(v) for k, v in bounds.items()}
        out = {"time": time.time(), "window_s": window_s, "models": []}
        for name, m in models.items():
            e = m.host.engine
            if e.closed:
                continue
            g = lambda metric, default=0.0: s.get((metric, name, None), default)  # noqa: E731
            hist = {k: tuple(s.get((f"colibri_{k}_bucket", name, _le(b)), 0.0) for b in bounds.get(
                f"colibri_{k}_bucket", ())) for k in ("time_to_first_token_seconds", "inter_token_seconds")}
            st = e.slot_stats
            values = {"in": g("colibri_prompt_tokens_total"), "out": g("colibri_completion_tokens_total"),
                      "misses": 0 if st is None else st["misses"], **hist}
            t0, base = m.sample(now, values)
            dt = now - t0
            rate = (lambda k: (values[k] - base[k]) / dt if dt > 0 else 0.0)   # noqa: E731

            def lat(k):
                b = bounds.get(f"colibri_{k}_bucket", [])
                before = base[k] if len(base[k]) == len(values[k]) else (0.0,) * len(values[k])  # no child yet
                cum = [x - y for x, y in zip(values[k], before)]
                return {q: _quantile(v, b, cum) if cum else None for q, v in (("p50", .5), ("p99", .99))} | {
                    "count": g(f"colibri_{k}_count"), "sum": g(f"colibri_{k}_sum")}
            out["models"].append({
                "name": name, "model_type": e.config["model_type"], "backend": e.backend.name,
                "tokens_in": values["in"], "tokens_out": values["out"],
                "tokens_in_per_s": rate("in"), "tokens_out_per_s": rate("out"), "rate_window_s": dt,
                "ttft_s": lat("time_to_first_token_seconds"), "itl_s": lat("inter_token_seconds"),
                "queue_depth": g("colibri_queue_depth"), "running_requests": g("colibri_running_requests"),
                "kv_blocks_used": g("colibri_kv_blocks_used"), "kv_blocks_total": g("colibri_kv_blocks_total"),
                "state_slots_used": g("colibri_state_slots_used"), "state_slots_total": g("colibri_state_slots_total"),
                "prefix_cache_hit_rate": g("colibri_prefix_cache_hit_rate"),
                "expert_slots": None if st is None else {
                    "slots": st["slots"], "hit_rate": g("colibri_expert_slot_hit_rate"), "misses": st["misses"],
                    "misses_per_s": rate("misses"), "policy": st["policy"]},
                "read_bytes": None if st is None else st["read_bytes"],
                "heat": m.heat_map(),
                "step": {"decode_ms": e.stats.step_ms(),
                         "phases": None if e.profiler is None else e.profiler.summary(),
                         "phases_note": None if e.profiler is not None else PHASES_NOTE},
                "memory": _memory(e)})
        return out

    state()                              # the rates' and percentiles' first base: the values at start

    @app.get("/v1/dashboard/state")
    async def dashboard_state():
        return state()

    @app.post("/v1/dashboard/trace")
    async def dashboard_trace(http: Request):
        import asyncio
        import io
        from ..analysis.trace import Trace
        from fastapi.responses import JSONResponse
        body = await http.body()
        try:
            if not body:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "the body is empty: send a `colibri trace` .npz "
                                   "file as the request body")
            tr = await asyncio.to_thread(Trace.load, io.BytesIO(body))
            return heat_from_trace(tr)
        except ColibriError as err:
            msg = "the uploaded file: " + err.message.split(": ", 1)[-1]      # Trace.load names a path
            return JSONResponse({"error": {"message": msg, "type": err.name, "code": err.name}}, status_code=400)

    app.add_middleware(_Static, config=config)


def _le(bound: float) -> str:
    from prometheus_client.utils import floatToGoString
    return floatToGoString(bound)


class _Static:
    """ASGI middleware answering GET /dashboard and /dashboard/{index.html, dashboard.js, dashboard.css,
    config.json} from the package's files; every other request goes on to the app."""

    def __init__(self, app, config: bytes):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == "/dashboard" or path.startswith("/dashboard/")) or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        name = path[len("/dashboard/"):] or "index.html"
        if name == "config.json":
            body, kind = self.config, "application/json"
        elif name in FILES:
            with open(os.path.join(STATIC, name), "rb") as f:
                body, kind = f.read(), FILES[name]
        else:
            body, kind = json.dumps({"error": {"message": f"no such dashboard file: {name}; open /dashboard",
                                               "type": "not_found", "code": "not_found"}}).encode(), "application/json"
        status = 200 if kind != "application/json" or name == "config.json" else 404
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode()),
                                (b"cache-control", b"no-cache")]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
