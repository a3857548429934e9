"""`colibri serve`: an OpenAI-compatible HTTP server over one or more engines (the `serve` extra:
FastAPI on uvicorn, pydantic for the request bodies, prometheus_client for /metrics).

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
    GET  /v1/models, /v1/requests (running and waiting requests), /health, /metrics

Each model has its own engine (its own KV pool, arena, request core and expert slots): requests of
one model never touch another's state. Every request goes to its engine's request core (core.py)
through AsyncEngine, so the event loop never blocks on a step. A client that disconnects mid-stream
cancels its request (its blocks return within a step); a full queue answers 429 with Retry-After;
every failure a client causes is a 4xx whose body carries the ColibriError's message and code.
Stop strings are cut from the text as the OpenAI API does (the text ends before the stop string);
streamed text holds back the last len(longest stop) - 1 characters until they cannot start one.
"""
import asyncio
import time
import uuid

from ..requests.aio import AsyncEngine
from ..requests.scheduler import DONE, ERROR, TOKEN
from ..errors import (ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY,
                     COLIBRI_ERR_UNAVAILABLE)


def _deps():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "colibri serve needs the serve extra: "
                           "pip install 'colibri-edge[serve]'") from None


STATUS = {COLIBRI_ERR_INVALID_ARGUMENT: 400, COLIBRI_ERR_OUT_OF_MEMORY: 400, COLIBRI_ERR_UNAVAILABLE: 429}


class _Metrics:
    """Per-model Prometheus metrics in the app's own registry."""

    def __init__(self, hosts):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import GaugeMetricFamily
        self.registry = r = CollectorRegistry()
        self.requests = Counter("colibri_requests", "Requests answered, by model, endpoint and HTTP status",
                                ["model", "endpoint", "status"], registry=r)
        self.tokens_in = Counter("colibri_prompt_tokens", "Prompt tokens", ["model"], registry=r)
        self.tokens_out = Counter("colibri_completion_tokens", "Generated tokens", ["model"], registry=r)
        self.ttft = Histogram("colibri_time_to_first_token_seconds", "Submission to the first token", ["model"],
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.itl = Histogram("colibri_inter_token_seconds", "Time between a request's tokens", ["model"],
                             buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2, 5), registry=r)

        class Pools:
            def collect(self_inner):
                g = {n: GaugeMetricFamily(f"colibri_{n}", h, labels=["model"]) for n, h in (
                    ("queue_depth", "Requests waiting for admission"),
                    ("running_requests", "Requests in the running batch"),
                    ("kv_blocks_used", "KV cache blocks held by sequences"),
                    ("kv_blocks_total", "KV cache blocks of the pool"),
                    ("state_slots_used", "Recurrent-state slots held by sequences (hybrid models; 0 without)"),
                    ("state_slots_total", "Recurrent-state slots of the pool (hybrid models; 0 without)"),
                    ("expert_slot_hit_rate", "Expert slot pool hit rate (1 when every expert is resident)"))}
                for name, h in hosts.items():
                    e = h.engine
                    if e.closed:
                        continue
                    g["queue_depth"].add_metric([name], len(e._core.waiting))
                    g["running_requests"].add_metric([name], len(e._core.running))
                    pool = e.runner.pool
                    g["kv_blocks_used"].add_metric([name], pool.num_blocks - pool.free_blocks)
                    g["kv_blocks_total"].add_metric([name], pool.num_blocks)
                    fixed = e.runner.states.fixed
                    g["state_slots_used"].add_metric([name], sum(p.num_slots - p.free_slots for p in fixed))
                    g["state_slots_total"].add_metric([name], sum(p.num_slots for p in fixed))
                    st = e.slot_stats
                    g["expert_slot_hit_rate"].add_metric([name], 1.0 if st is None else float(st["hit_rate"]))
                return list(g.values())
        r.register(Pools())


class _Host:
    def __init__(self, name, engine):
        self.name, self.engine, self.aio = name, engine, AsyncEngine(engine)
        self.created = int(time.time())


def create_app(models: dict, api_key: str | None = None, cors: str | None = None,
               request_timeout: float | None = None):
    """The FastAPI app serving `models` ({name: Engine}); the engines stay the caller's to close
    (serve() closes those it opened)."""
    _deps()
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    hosts = {n: _Host(n, e) for n, e in models.items()}
    metrics = _Metrics(hosts)
    app = FastAPI(title="Colibri Edge", version="0.1.0")
    if cors:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=[cors], allow_methods=["*"], allow_headers=["*"])

    def error(status, message, code="invalid_request_error", headers=None):
        return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status,
                            headers=headers)

    def colibri_error(e: ColibriError):
        status = STATUS.get(e.code, 400)
        return error(status, e.message, e.name, headers={"Retry-After": "1"} if status == 429 else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        parts = [f"{'.'.join(str(x) for x in d.get('loc', ())[1:]) or 'body'}: {d.get('msg')}" for d in exc.errors()]
        return error(400, "; ".join(parts)[:2000])

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        """A failure no client caused: a 500 for this request alone, in the OpenAI error shape."""
        return error(500, f"internal error ({type(exc).__name__}: {str(exc)[:500]}); this request failed, "
                     "the server goes on serving: retry, or report it with the server's log", "internal_error")

    @app.middleware("http")
    async def _auth(request, call_next):
        if api_key and request.url.path != "/health" and request.method != "OPTIONS":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "unauthorized")
        return await call_next(request)

    class Common(BaseModel):
        model_config = ConfigDict(extra="forbid")
        model: str
        max_tokens: int | None = Field(default=None, ge=0)
        max_completion_tokens: int | None = Field(default=None, ge=0)
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        min_p: float = 0.0
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        repetition_penalty: float = 1.0
        logit_bias: dict[str, float] | None = None
        seed: int | None = None
        stop: str | list[str] | None = None
        stream: bool = False
        stream_options: dict | None = None
        n: int = Field(default=1, ge=1, le=16)
        ignore_eos: bool = False
        user: str | None = None
        priority: int = 0
        # accepted so that their refusal can say why (400), not "extra inputs are not permitted"
        tools: list | None = None
        tool_choice: str | dict | None = None
        functions: list | None = None
        function_call: str | dict | None = None
        parallel_tool_calls: bool | None = None
        response_format: dict | None = None

    class Completion(Common):
        prompt: str | list[int]
        logprobs: int | None = Field(default=None, ge=0, le=20)
        echo: bool = False

    class Message(BaseModel):
        role: str
        content: str

    class Chat(Common):
        messages: list[Message]
        logprobs: bool = False
        top_logprobs: int = Field(default=0, ge=0, le=20)

    def host_of(name):
        if name not in hosts:
            raise LookupError(name)
        return hosts[name]

    def gen_args(b: Common, e, logprobs: bool, top: int):
        n = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
        return dict(max_new_tokens=16 if n is None and isinstance(b, Completion) else
                    (n if n is not None else e.max_seq_len), temperature=b.temperature, top_p=b.top_p,
                    top_k=b.top_k, min_p=b.min_p, presence_penalty=b.presence_penalty,
                    frequency_penalty=b.frequency_penalty, repetition_penalty=b.repetition_penalty,
                    logit_bias=b.logit_bias, seed=b.seed, ignore_eos=b.ignore_eos, logprobs=logprobs,
                    top_logprobs=top, stop=b.stop)

    async def run(h: _Host, http: HTTPRequest, prompt, b: Common, chat: bool, logprobs: bool, top: int):
        """One generation: a JSON body or an SSE stream."""
        e = h.engine
        endpoint = "chat" if chat else "completions"
        gen = gen_args(b, e, logprobs, top)
        if b.stream and b.n > 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "n > 1 with stream is not supported; ask for n "
                               "streams, or n > 1 without streaming")
        if gen["max_new_tokens"] > e.max_seq_len:
            gen["max_new_tokens"] = e.max_seq_len
        stops = [] if b.stop is None else [b.stop] if isinstance(b.stop, str) else list(b.stop)
        subs = h.aio.submit_n(prompt, b.n, b.priority, **gen)     # all or nothing; n > 1 shares the prefill
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        t0 = time.perf_counter()
        deadline = None if request_timeout is None else t0 + request_timeout
        metrics.tokens_in.labels(h.name).inc(len(subs[0][0].prompt) * b.n)
        codec = e.codec

        async def events(it):
            last = None
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
                try:
                    ev = await asyncio.wait_for(it.__anext__(), timeout)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    await it.aclose()
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the request ran past the server's "
                                       f"request timeout ({request_timeout} s); ask for fewer tokens") from None
                if ev.kind == TOKEN:
                    metrics.tokens_out.labels(h.name).inc()
                    if last is None:
                        metrics.ttft.labels(h.name).observe(ev.t - t0)
                    else:
                        metrics.itl.labels(h.name).observe(ev.t - last)
                    last = ev.t
                yield ev

        def lp_entry(ev):
            top = [{"token": codec.decode([t], skip_special_tokens=False), "logprob": v} for t, v in (ev.top or [])]
            return {"token": codec.decode([ev.token], skip_special_tokens=False), "logprob": ev.logprob,
                    "top_logprobs": top}

        def finish(reason, text):
            return "stop" if reason == "stop" or any(s in text for s in stops) else "length"

        def cut(text):
            idx = [text.find(s) for s in stops if s in text]
            return text[:min(idx)] if idx else text

        usage_of = lambda n_out: {"prompt_tokens": len(subs[0][0].prompt) * b.n, "completion_tokens": n_out,  # noqa
                                  "total_tokens": len(subs[0][0].prompt) * b.n + n_out}

        if not b.stream:
            choices, n_out = [], 0
            for i, (req, it) in enumerate(subs):
                toks, lps, reason = [], [], "length"
                async for ev in events(it):
                    if ev.kind == ERROR:
                        raise ev.error
                    if ev.kind == TOKEN:
                        toks.append(ev.token)
                        if logprobs:
                            lps.append(lp_entry(ev))
                    elif ev.kind == DONE:
                        reason = ev.reason
                n_out += len(toks)
                full = codec.decode(toks)
                text = cut(full)
                fr = finish(reason, full)
                if chat:
                    content, reasoning = codec.reply(toks)
                    msg = {"role": "assistant", "content": text}
                    if reasoning is not None or content != full:       # a harmony reply (gpt-oss), as vLLM
                        msg = {"role": "assistant", "content": cut(content), "reasoning_content": reasoning}
                    c = {"index": i, "message": msg, "finish_reason": fr,
                         "logprobs": {"content": lps} if logprobs else None}
                else:
                    c = {"index": i, "text": (prompt if b.echo and isinstance(prompt, str) else "") + text,
                         "finish_reason": fr, "logprobs": None if not logprobs else {
                             "tokens": [x["token"] for x in lps], "token_logprobs": [x["logprob"] for x in lps],
                             "top_logprobs": [{y["token"]: y["logprob"] for y in x["top_logprobs"]} for x in lps]}}
                choices.append(c)
            metrics.requests.labels(h.name, endpoint, "200").inc()
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": h.name, "choices": choices, "usage": usage_of(n_out)})

        import json
        from ..requests.textio import StreamDecoder
        req, it = subs[0]
        include_usage = bool((b.stream_options or {}).get("include_usage"))
        hold = max((len(s) for s in stops), default=1) - 1

        def chunk(delta=None, text=None, fr=None, lp=None, usage=None):
            if chat:
                ch = [] if delta is None and fr is None else [{"index": 0, "delta": delta or {}, "finish_reason": fr,
                                                               "logprobs": lp}]
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": h.name,
                        "choices": ch}
            else:
                ch = [] if text is None and fr is None else [{"index": 0, "text": text or "", "finish_reason": fr,
                                                              "logprobs": lp}]
                body = {"id": rid, "object": "text_completion", "created": created, "model": h.name, "choices": ch}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async def sse():
            dec = StreamDecoder(codec)
            full, sent, n_out, status = "", 0, 0, "200"
            try:
                if chat:
                    yield chunk(delta={"role": "assistant", "content": ""})
                reason = "length"
                async for ev in events(it):
                    if ev.kind == ERROR:
                        status = str(STATUS.get(ev.error.code, 400))
                        yield f"data: {json.dumps({'error': {'message': ev.error.message, 'code': ev.error.name}})}\n\n"
                        return
                    if ev.kind == DONE:
                        reason = ev.reason
                        break
                    n_out += 1
                    full += dec.push(ev.token)
                    lp = {"content": [lp_entry(ev)]} if logprobs else None
                    upto = len(cut(full)) if any(s in full for s in stops) else max(sent, len(full) - hold)
                    piece = full[sent:upto]
                    sent = upto
                    if piece or lp:
                        yield chunk(delta={"content": piece}, text=piece, lp=lp)
                full += dec.flush()
                text = cut(full)
                if len(text) > sent:
                    yield chunk(delta={"content": text[sent:]}, text=text[sent:])
                yield chunk(delta={}, text="", fr=finish(reason, full))
                if include_usage:
                    yield chunk(usage=usage_of(n_out))
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:           # the client went away: the request is cancelled
                status = "499"
                raise
            finally:
                await it.aclose()
                metrics.requests.labels(h.name, endpoint, status).inc()
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def unsupported(b: Common):
        """The message refusing what the server does not do yet (tool calls, structured output), or None."""
        if b.tools or b.functions or b.tool_choice not in (None, "none") or b.function_call not in (None, "none"):
            return ("tool calls are not supported by colibri serve yet: send the request without 'tools' / "
                    "'tool_choice' (or 'functions' / 'function_call') and describe the tools in the prompt")
        if b.response_format is not None and b.response_format.get("type", "text") != "text":
            return (f"response_format {b.response_format.get('type')!r} is not supported by colibri serve yet; "
                    "only {'type': 'text'}: ask for the format in the prompt")
        return None

    async def generation(http, body, chat):
        try:
            h = host_of(body.model)
        except LookupError:
            return error(404, f"model {body.model!r} is not served here; GET /v1/models lists "
                         f"{', '.join(sorted(hosts))}", "model_not_found")
        why = unsupported(body)
        if why:
            metrics.requests.labels(h.name, "chat" if chat else "completions", "400").inc()
            return error(400, why, "unsupported")
        try:
            if chat:
                prompt = [m.model_dump() for m in body.messages]
                if not prompt:
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "messages: give at least one message")
                return await run(h, http, prompt, body, True, body.logprobs or body.top_logprobs > 0, body.top_logprobs)
            return await run(h, http, body.prompt, body, False, body.logprobs is not None, body.logprobs or 0)
        except ColibriError as e:
            metrics.requests.labels(h.name, "chat" if chat else "completions", str(STATUS.get(e.code, 400))).inc()
            return colibri_error(e)

    @app.post("/v1/completions")
    async def completions(body: Completion, http: HTTPRequest):
        return await generation(http, body, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Chat, http: HTTPRequest):
        return await generation(http, body, True)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": h.created, "owned_by": "colibri-edge",
             "model_type": h.engine.config["model_type"], "backend": h.engine.backend.name,
             "max_model_len": h.engine.max_seq_len} for n, h in hosts.items()]}

    @app.get("/v1/requests")
    async def requests_view():
        out = {}
        for n, h in hosts.items():
            c = h.engine._core
            rows = [("running", r) for r in list(c.running)] + [("waiting", r) for r in list(c.waiting)]
            out[n] = [{"id": r.id, "state": s, "priority": r.priority, "prompt_tokens": int(len(r.prompt)),
                       "generated": len(r.produced)} for s, r in rows]
        return out

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": sorted(hosts)}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    app.state.hosts = hosts
    return app


def check_budgets(budgets: dict, available: int | None = None):
    """The models' memory budgets ({name: bytes}) against the memory this process may take (host
    memory: colibri_edge.memory): ColibriError(COLIBRI_ERR_OUT_OF_MEMORY) with the numbers when they
    add up to more, before any engine is opened."""
    from ..memory import host_available
    from ..units import human
    total = sum(budgets.values())
    if available is None:
        available, what = host_available()
    else:
        what = "the given limit"
    if total > available:
        parts = ", ".join(f"{n} {human(b)}" for n, b in budgets.items())
        raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, f"the models' memory budgets add up to {human(total)} "
                           f"({parts}), but {what} leaves {human(available)}; give them smaller budgets or "
                           "serve fewer models")


def serve(models: dict, host="127.0.0.1", port=8000, api_key=None, cors=None, request_timeout=None,
          budgets: dict | None = None, **engine_kw):
    """Open an engine per model directory ({name: dir}) and serve them until SIGINT / SIGTERM
    (uvicorn stops accepting, lets running responses finish, then the engines are closed).
    budgets: {name: bytes} the engine of that model may allocate (arena, KV pool, expert slots,
    device copies of weights); checked together against the memory available, then each engine
    against its own at open: the server refuses to start, with the numbers, when they do not fit."""
    _deps()
    import uvicorn
    from ..requests.engine import Engine
    budgets = dict(budgets or {})
    unknown = sorted(set(budgets) - set(models))
    if unknown:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"memory budget for {', '.join(unknown)}: no such model "
                           f"(models: {', '.join(models)})")
    check_budgets(budgets)
    engines = {}
    try:
        for name, path in models.items():
            engines[name] = Engine.open(path, memory_budget=budgets.get(name), **engine_kw)
        app = create_app(engines, api_key=api_key, cors=cors, request_timeout=request_timeout)
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
    finally:
        for e in engines.values():
            e.close()

