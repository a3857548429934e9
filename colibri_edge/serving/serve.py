"""`colibri serve`: an OpenAI-compatible HTTP server over one or more engines (the `serve` extra:
FastAPI on uvicorn, pydantic for the request bodies, prometheus_client for /metrics).

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
    POST /v1/embeddings                          the final hidden state, mean-pooled, L2-normalised
    POST /tokenize, /detokenize                  llama-server's shapes
    GET  /v1/models, /v1/models/{id}, /v1/requests (= /slots: running and waiting requests with
         their KV blocks), /health, /metrics

Each model has its own engine (its own KV pool, arena, request core and expert slots): requests of
one model never touch another's state. Every request goes to its engine's request core through
AsyncEngine, and tokenising runs in a worker thread, so the event loop never blocks on a step or a
long prompt; a body over `max_body` bytes is refused with a 413 before it is read. A client that
disconnects cancels its request, streamed or not (its blocks return within a step); a full queue
answers 429 with Retry-After; a request past the server's timeout is a 504 (streams: an error event,
then [DONE]); every failure a client causes is a 4xx whose body carries the ColibriError's message
and code, in the OpenAI error shape. Unknown request fields are ignored with a logged warning, as
vLLM and llama-server do. Stop strings are cut from the text as the OpenAI API does (the text ends
before the stop string); streamed text holds back the last len(longest stop) - 1 characters until
they cannot start one.
"""
import asyncio
import hmac
import logging
import time
import uuid

from ..requests.aio import AsyncEngine
from ..requests.engine import GRAMMAR_ARGS
from ..requests.scheduler import DONE, ERROR, TOKEN
from ..errors import (ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY,
                     COLIBRI_ERR_TIMEOUT, COLIBRI_ERR_UNAVAILABLE)

log = logging.getLogger("colibri.serve")


def _deps():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "colibri serve needs the serve extra: "
                           "pip install 'colibri-edge[serve]'") from None


STATUS = {COLIBRI_ERR_INVALID_ARGUMENT: 400, COLIBRI_ERR_OUT_OF_MEMORY: 400, COLIBRI_ERR_UNAVAILABLE: 429,
          COLIBRI_ERR_TIMEOUT: 504}
MAX_BODY = 8 << 20          # bytes of a request body (--max-body); a 2,048-token prompt is ~10 KiB
CACHE_DIR_BYTES = 2 << 30    # --cache-dir: the most bytes of session files kept per model (--cache-dir-size)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/embeddings": "embeddings",
             "/tokenize": "tokenize", "/detokenize": "detokenize"}


def _endpoint(path: str) -> str:
    return ENDPOINTS.get(path, "other")


class _Metrics:
    """Per-model Prometheus metrics in the app's own registry."""

    def __init__(self, hosts):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import GaugeMetricFamily
        self.registry = r = CollectorRegistry()
        self.requests = Counter("colibri_requests", "Requests answered, by model, endpoint and HTTP status "
                                "(model \"\" when it was refused before its model was known: 401, 413, a bad body)",
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
                    ("expert_slot_hit_rate", "Expert slot pool hit rate (1 when every expert is resident)"),
                    ("expert_slot_read_bytes", "Bytes the expert slot pool read from storage (0 without a pool)"),
                    ("expert_slot_pinned", "Experts of the learned hot set pinned in slots at open"),
                    ("expert_slot_prediction_recall", "Experts run that the one-layer lookahead had predicted / "
                                                      "experts run (prefetch policy only)"),
                    ("expert_slot_prediction_precision", "Experts predicted by the lookahead that then ran / "
                                                         "experts predicted (prefetch policy only)"),
                    ("expert_slot_load_hidden", "Share of the slot pool's load time the compute hid (overlap)"),
                    ("kv_blocks_cached", "KV blocks named in the prefix cache (held or idle)"),
                    ("state_snapshots_held", "Recurrent-state snapshots kept for prefix caching (hybrid models)"),
                    ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens admitted"),
                    ("draft_tokens_proposed", "Drafted tokens verified (speculative decoding; a counter)"),
                    ("draft_tokens_accepted", "Drafted tokens the model agreed with (a counter)"),
                    ("draft_acceptance", "Drafted tokens accepted / drafted tokens verified"),
                    ("decode_tokens_per_step", "Tokens emitted per decode step and request stream: 1 without drafts"))}
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
                    g["expert_slot_read_bytes"].add_metric([name], 0 if st is None else st["read_bytes"])
                    g["expert_slot_pinned"].add_metric([name], 0 if st is None else st["hot_set"])
                    for key in ("prediction_recall", "prediction_precision", "load_hidden"):
                        v = None if st is None else st.get("hidden_fraction" if key == "load_hidden" else key)
                        if v is not None:            # no number until the pool has one (never made up)
                            g["expert_slot_" + key].add_metric([name], float(v))
                    g["kv_blocks_cached"].add_metric([name], pool.cached_blocks)
                    snaps = e.runner.states.snapshots
                    g["state_snapshots_held"].add_metric([name], 0 if snaps is None else snaps.usage()["held"])
                    g["prefix_cache_hit_rate"].add_metric([name], e.stats.prefix_hit_rate)
                    g["draft_tokens_proposed"].add_metric([name], e.stats.draft_proposed)
                    g["draft_tokens_accepted"].add_metric([name], e.stats.draft_accepted)
                    g["draft_acceptance"].add_metric([name], e.stats.acceptance)
                    g["decode_tokens_per_step"].add_metric([name], e.stats.tokens_per_stream_step)
                return list(g.values())
        r.register(Pools())

    def refused(self, path, status, model=""):
        self.requests.labels(model, _endpoint(path), str(status)).inc()


class _Host:
    adapter = None                      # a LoRA adapter's name (_AdapterHost), None for the base model

    def __init__(self, name, engine, disk=None):
        self.name, self.engine, self.aio = name, engine, AsyncEngine(engine)
        self.created = int(time.time())
        self.disk = disk                # serve --cache-dir: a diskcache.DiskCache, or None

    def card(self):
        e = self.engine
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "colibri-edge",
                "model_type": e.config["model_type"], "backend": e.backend.name, "max_model_len": e.max_seq_len}


class _AdapterHost(_Host):
    """A LoRA adapter served as a model of its own (serve --lora NAME=DIR; a request's "model": NAME, as
    vLLM does): its base model's engine, every request carrying adapter=NAME."""

    def __init__(self, name, base: _Host):
        self.name, self.engine, self.aio, self.base = name, base.engine, base.aio, base
        self.created, self.disk, self.adapter = int(time.time()), None, name

    def card(self):
        info = self.engine.adapters().get(self.name, {})
        return {**self.base.card(), "id": self.name, "created": self.created, "parent": self.base.name,
                "root": info.get("path"), "lora": {"rank": info.get("rank"), "bytes": info.get("bytes")}}


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413 before it is read (by its Content-Length),
    or as soon as a chunked body passes the limit; nothing of it reaches JSON parsing or the tokenizer."""

    def __init__(self, app, limit, on_refuse):
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    async def _refuse(self, scope, send, message):
        import json
        self.on_refuse(scope["path"])
        body = json.dumps({"error": {"message": message, "type": "request_too_large",
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit
        what = (f"the request body is larger than this server's limit of {limit} bytes (--max-body); send a "
                "shorter prompt")
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if n > limit:
                    return await self._refuse(scope, send, what)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:   # FastAPI passes an HTTPException on (any other error would be a 400)
                    from starlette.exceptions import HTTPException
                    raise HTTPException(413, what)
            return msg

        await self.app(scope, limited, send)


class _Auth:
    """ASGI middleware: every path but /health (and CORS preflights) needs 'Authorization: Bearer
    KEY'. The scheme is case-insensitive (RFC 7235); the key is compared in constant time."""

    def __init__(self, app, key, on_refuse):
        self.app, self.want, self.on_refuse = app, key.encode(), on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        value = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                value = v
        scheme, _, key = value.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.want):
            return await self.app(scope, receive, send)
        import json
        self.on_refuse(scope["path"])
        body = json.dumps({"error": {"message": "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                     "type": "unauthorized", "code": "unauthorized"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(models: dict, api_key: str | None = None, cors=None, request_timeout: float | None = None,
               max_body: int = MAX_BODY, max_tokens: int | None = None, cache_dir: str | None = None,
               cache_dir_bytes: int = CACHE_DIR_BYTES, adapters: dict | None = None):
    """The FastAPI app serving `models` ({name: Engine}); the engines stay the caller's to close
    (serve() closes those it opened). cors: an origin or a list of them; max_tokens: the most
    tokens a request may generate (a request asking more, or not saying, gets this many);
    cache_dir: conversations' KV prefixes kept there across restarts (diskcache.py), at most
    cache_dir_bytes per model. adapters: {adapter name: model name} of the LoRA adapters loaded into
    those engines (Engine.load_adapter), each served as a model of its own."""
    _deps()
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .diskcache import DiskCache
    hosts = {n: _Host(n, e, DiskCache(cache_dir, n, e, cache_dir_bytes) if cache_dir else None)
             for n, e in models.items()}
    metrics = _Metrics(hosts)
    for a, base in (adapters or {}).items():
        if a in hosts or base not in hosts or a not in hosts[base].engine.adapters():
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {a!r}: its name is a model's, or {base!r} is "
                               "not served, or its engine has no such adapter loaded")
    views = {**hosts, **{a: _AdapterHost(a, hosts[base]) for a, base in (adapters or {}).items()}}
    app = FastAPI(title="Colibri Edge", version=_version())
    origins = [] if not cors else [cors] if isinstance(cors, str) else list(cors)

    def error(status, message, code="invalid_request_error", headers=None):
        return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status,
                            headers=headers)

    def colibri_error(e: ColibriError):
        status = STATUS.get(e.code, 400)
        return error(status, e.message, e.name, headers={"Retry-After": "1"} if status == 429 else None)

    def model_of_body(body):
        m = body.get("model") if isinstance(body, dict) else None
        return views[m].base.name if isinstance(m, str) and m in views and m not in hosts else \
            m if isinstance(m, str) and m in hosts else ""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        parts = []
        for d in exc.errors():
            where = ".".join(str(x) for x in d.get("loc", ())[1:]) or "body"
            if d.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON ({d.get('ctx', {}).get('error', d.get('msg'))}); "
                             "send one JSON object")
            else:
                parts.append(f"{where}: {d.get('msg')}")
        metrics.refused(request.url.path, 400, model_of_body(getattr(exc, "body", None)))
        return error(400, "; ".join(parts)[:2000])

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        """FastAPI's own refusals, in the OpenAI error shape: unknown paths, wrong methods, bodies
        that are not UTF-8 or cannot be parsed."""
        if exc.status_code == 404:
            msg = (f"no such endpoint: {request.method} {request.url.path}; this server answers /v1/completions, "
                   "/v1/chat/completions, /v1/embeddings, /v1/models, /tokenize, /detokenize, /v1/requests, "
                   "/health and /metrics")
        elif exc.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and "parsing the body" in str(exc.detail):
            msg = "the request body could not be read as JSON (is it UTF-8?); send one JSON object"
        else:
            msg = str(exc.detail)
        metrics.refused(request.url.path, exc.status_code)
        code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code, "invalid_request_error")
        return error(exc.status_code, msg, code,
                     headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        """A failure no client caused: a 500 for this request alone, in the OpenAI error shape."""
        return error(500, f"internal error ({type(exc).__name__}: {str(exc)[:500]}); this request failed, "
                     "the server goes on serving: retry, or report it with the server's log", "internal_error")

    if api_key:
        app.add_middleware(_Auth, key=api_key, on_refuse=lambda path: metrics.refused(path, 401))
    app.add_middleware(_BodyLimit, limit=int(max_body), on_refuse=lambda path: metrics.refused(path, 413))
    if origins:                  # outermost, so that a 401 or 413 carries the CORS headers too
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])

    class Body(BaseModel):
        model_config = ConfigDict(extra="allow")

    class Common(Body):
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
        return_tokens: bool = False      # llama-server's: each choice / chunk also carries its token ids
        grammar: str | None = None       # llama-server's: a GBNF grammar the output follows
        json_schema: dict | None = None  # llama-server's: a JSON schema the output follows
        response_format: dict | None = None
        # chat only (a completion that names them is a 400)
        tools: list | None = None
        tool_choice: str | dict | None = None
        functions: list | None = None    # the OpenAI API's older names of tools / tool_choice
        function_call: str | dict | None = None
        parallel_tool_calls: bool | None = None
        chat_template_kwargs: dict | None = None     # vLLM's: extra chat template variables
        reasoning_effort: str | None = None          # gpt-oss's template variable

    class Completion(Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        logprobs: int | None = Field(default=None, ge=0, le=20)
        echo: bool = False

    class Part(Body):
        type: str
        text: str | None = None

    class Message(Body):
        role: str
        content: str | list[Part] | None = None
        tool_calls: list[dict] | None = None
        tool_call_id: str | None = None
        name: str | None = None
        reasoning_content: str | None = None

    class Chat(Common):
        messages: list[Message]
        logprobs: bool = False
        top_logprobs: int = Field(default=0, ge=0, le=20)

    class Embeddings(Body):
        model: str
        input: str | list[str] | list[int] | list[list[int]]
        encoding_format: str = "float"
        dimensions: int | None = None
        user: str | None = None

    class Tokenize(Body):
        content: str
        model: str | None = None
        add_special: bool = False
        with_pieces: bool = False

    class Detokenize(Body):
        tokens: list[int]
        model: str | None = None

    def warn_unknown(b: BaseModel, path: str):
        extra = sorted(b.model_extra or {})
        for m in b.messages if isinstance(b, Chat) else []:
            extra += [f"messages[].{k}" for k in sorted(m.model_extra or {})]
        if extra:
            log.warning("%s: ignoring unknown request fields %s", path, ", ".join(extra))

    def host_of(name):
        if name is None:
            return next(iter(hosts.values()))
        if name not in views:
            raise LookupError(name)
        return views[name]

    def not_served(name):
        return error(404, f"model {name!r} is not served here; GET /v1/models lists "
                     f"{', '.join(sorted(views))}", "model_not_found")

    def gen_args(b: Common, e, logprobs: bool, top: int):
        n = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
        if n is None:
            n = 16 if isinstance(b, Completion) else e.max_seq_len
        n = min(n, e.max_seq_len)
        if max_tokens is not None:
            n = min(n, max_tokens)
        return dict(max_new_tokens=n, temperature=b.temperature, top_p=b.top_p,
                    top_k=b.top_k, min_p=b.min_p, presence_penalty=b.presence_penalty,
                    frequency_penalty=b.frequency_penalty, repetition_penalty=b.repetition_penalty,
                    logit_bias=b.logit_bias, seed=b.seed, ignore_eos=b.ignore_eos, logprobs=logprobs,
                    top_logprobs=top, stop=b.stop, response_format=b.response_format, grammar=b.grammar,
                    json_schema=b.json_schema)

    async def merged(h: _Host, subs, deadline):
        """(choice, Event) from every choice's event stream as they come, until each is DONE or
        ERROR; past the deadline a COLIBRI_ERR_TIMEOUT. Leaving early cancels every request."""
        pending = {}
        try:
            for i, (_, it) in enumerate(subs):
                pending[asyncio.ensure_future(it.__anext__())] = i
            last = {}
            while pending:
                timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
                done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise ColibriError(COLIBRI_ERR_TIMEOUT, f"the request ran past the server's request timeout "
                                       f"({request_timeout} s); ask for fewer tokens, or a server with a longer "
                                       "--request-timeout")
                for t in sorted(done, key=lambda t: pending[t]):
                    i = pending.pop(t)
                    try:
                        ev = t.result()
                    except StopAsyncIteration:
                        continue
                    if ev.kind == TOKEN:
                        metrics.tokens_out.labels(h.name).inc()
                        if i not in last:
                            metrics.ttft.labels(h.name).observe(ev.t - subs[i][0].submitted_at)
                        else:
                            metrics.itl.labels(h.name).observe(ev.t - last[i])
                        last[i] = ev.t
                    yield i, ev
                    if ev.kind not in (DONE, ERROR):
                        pending[asyncio.ensure_future(subs[i][1].__anext__())] = i
        finally:
            for t in pending:
                t.cancel()
            for req, _ in subs:
                req.cancel()

    async def until_disconnect(http: HTTPRequest):
        """Returns when the client has gone (the body is read by then, so the next ASGI message is
        the disconnect)."""
        while True:
            msg = await http.receive()
            if msg["type"] == "http.disconnect":
                return

    async def run(h: _Host, http: HTTPRequest, prompts: list, b: Common, chat: bool, logprobs: bool, top: int,
                  plan=None):
        """One generation over one or more prompts (n choices each): a JSON body or an SSE stream. plan:
        a chat request's chat.ChatPlan (its prompt ids are prompts[0]) when its reply is read for tool
        calls or reasoning."""
        import json
        from ..requests.textio import StopCutter, StreamDecoder, cut_at_stop
        e = h.engine
        endpoint = "chat" if chat else "completions"
        gen = gen_args(b, e, logprobs, top)
        if h.adapter is not None:
            gen["adapter"] = h.adapter
        if plan is not None:
            for k in GRAMMAR_ARGS:
                gen.pop(k, None)
            gen.update(plan.grammar)
        # tokenising (and rendering the template) in a worker thread: a long prompt never holds the loop
        ids_list = await asyncio.to_thread(lambda: [e._prompt_ids(p) for p in prompts])
        if h.disk is not None:                # --cache-dir: a saved prefix the cache lacks, loaded first
            for ids in ids_list:
                await asyncio.to_thread(h.disk.restore, [int(t) for t in ids])

        async def keep(replies):
            """--cache-dir: each prompt's first reply's whole blocks saved (before the answer ends)."""
            if h.disk is not None:
                for k, ids in enumerate(ids_list):
                    await asyncio.to_thread(h.disk.store, [int(t) for t in ids] + list(replies[k * b.n]), len(ids))
        subs = []
        try:
            for ids in ids_list:              # all or nothing; n > 1 shares each prompt's prefill
                subs += h.aio.submit_n(ids, b.n, b.priority, **gen)
        except BaseException:
            for req, _ in subs:
                req.cancel()
            raise
        t_sub = time.perf_counter()
        for req, _ in subs:
            req.submitted_at = t_sub
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        deadline = None if request_timeout is None else t_sub + request_timeout
        n_prompt = sum(len(ids) for ids in ids_list)
        metrics.tokens_in.labels(h.name).inc(n_prompt)
        codec = e.codec
        stops = [] if b.stop is None else [b.stop] if isinstance(b.stop, str) else list(b.stop)
        echo = [(p if isinstance(p, str) else codec.decode(ids)) if not chat and b.echo else ""
                for p, ids in zip(prompts, ids_list) for _ in range(b.n)]

        def piece_of(t):
            return codec.decode([t], skip_special_tokens=False)

        def lp_chat(ev):
            return {"token": piece_of(ev.token), "logprob": ev.logprob,
                    "top_logprobs": [{"token": piece_of(t), "logprob": v} for t, v in (ev.top_logprobs or [])]}

        def lp_legacy(entries):
            return {"tokens": [x["token"] for x in entries], "token_logprobs": [x["logprob"] for x in entries],
                    "top_logprobs": [{y["token"]: y["logprob"] for y in x["top_logprobs"]} for x in entries]}

        def finish(reason, text):
            return "stop" if reason == "stop" or any(s in text for s in stops) else "length"

        eos = set(e.eos_token_ids)

        def cut(text):
            return cut_at_stop(text, stops)

        def usage_of(n_out):
            # prompt tokens found in the prefix cache (the OpenAI field): each prompt's first sample
            # (its other samples share that sample's prefill)
            cached = sum(subs[k * b.n][0].cached_tokens for k in range(len(ids_list)))
            return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                    "prompt_tokens_details": {"cached_tokens": cached}}

        if not b.stream:
            toks = [[] for _ in subs]
            lps = [[] for _ in subs]
            reasons = ["length"] * len(subs)

            async def collect():
                async for i, ev in merged(h, subs, deadline):
                    if ev.kind == ERROR:
                        raise ev.error
                    if ev.kind == TOKEN:
                        toks[i].append(ev.token)
                        if logprobs:
                            lps[i].append(lp_chat(ev))
                    elif ev.kind == DONE:
                        reasons[i] = ev.reason
            work = asyncio.ensure_future(collect())
            gone = asyncio.ensure_future(until_disconnect(http))
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not work.done():
                    work.cancel()
                gone.cancel()
                for req, _ in subs:
                    req.cancel()
            if not work.done() or work.cancelled():
                await asyncio.gather(work, return_exceptions=True)
                metrics.requests.labels(h.name, endpoint, "499").inc()
                return Response(status_code=499)         # nobody reads it: the client has gone
            work.result()                                # its ColibriError, if any
            choices = []
            for i in range(len(subs)):
                full = codec.decode(toks[i])
                text = cut(full)
                fr = finish(reasons[i], full)
                if chat and plan is not None:
                    msg = plan.reader().message(e._reply_text(toks[i]))
                    if msg["content"]:
                        msg["content"] = cut(msg["content"])
                    if msg.get("tool_calls"):
                        fr = "tool_calls"
                elif chat:
                    msg = {"role": "assistant", "content": text}
                if chat:
                    c = {"index": i, "message": msg, "finish_reason": fr,
                         "logprobs": {"content": lps[i]} if logprobs else None}
                else:
                    c = {"index": i, "text": echo[i] + text, "finish_reason": fr,
                         "logprobs": lp_legacy(lps[i]) if logprobs else None}
                if b.return_tokens:
                    c["tokens"] = toks[i]
                choices.append(c)
            await keep(toks)
            metrics.requests.labels(h.name, endpoint, "200").inc()
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": h.name, "choices": choices,
                                 "usage": usage_of(sum(map(len, toks)))})

        include_usage = bool((b.stream_options or {}).get("include_usage"))

        def chunk(i=0, text=None, fr=None, lp=None, usage=None, role=False, tokens=None, delta=None):
            if usage is not None:
                ch = []
            elif chat:
                if delta is None:
                    delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                ch = [{"index": i, "delta": delta, "finish_reason": fr, "logprobs": lp}]
            else:
                ch = [{"index": i, "text": text or "", "finish_reason": fr, "logprobs": lp}]
            if tokens is not None:
                ch[0]["tokens"] = tokens
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": h.name, "choices": ch}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async def sse():
            decs = [StreamDecoder(codec, skip_special_tokens=plan is None) for _ in subs]
            full, reasons = [""] * len(subs), ["length"] * len(subs)
            cutters = [StopCutter(stops) for _ in subs]      # the shown text: up to the first stop string
            readers = [plan.reader() for _ in subs] if plan is not None else None
            called = [False] * len(subs)

            def deltas(i, final=False):
                """A chat reply read for tool calls and reasoning: the chunks its text so far adds (the
                content through the stop cutter)."""
                for d in readers[i].push(full[i], final):
                    if "content" in d:
                        d = {"content": cutters[i].push(d["content"])}
                        if not d["content"]:
                            continue
                    called[i] = called[i] or "tool_calls" in d
                    yield chunk(i, delta=d)
            n_out, status = 0, "200"
            try:
                for i in range(len(subs)):
                    if chat:
                        yield chunk(i, role=True)
                    elif echo[i]:
                        yield chunk(i, text=echo[i])
                try:
                    async for i, ev in merged(h, subs, deadline):
                        if ev.kind == ERROR:
                            raise ev.error
                        if ev.kind == DONE:
                            reasons[i] = ev.reason
                            tail = decs[i].flush()
                            full[i] += tail
                            if readers is not None:
                                for c in deltas(i, final=True):
                                    yield c
                                text = cutters[i].finish()
                            else:
                                text = cutters[i].push(tail) + cutters[i].finish()
                            if text:
                                yield chunk(i, text=text)
                            fr = "tool_calls" if called[i] else finish(reasons[i], full[i])
                            yield chunk(i, text=None if chat else "", fr=fr)
                            continue
                        n_out += 1
                        if readers is not None:
                            if ev.token not in eos:
                                full[i] += decs[i].push(ev.token)
                            lp = {"content": [lp_chat(ev)]} if logprobs else None
                            for c in deltas(i):
                                yield c
                            if lp or b.return_tokens:
                                yield chunk(i, delta={}, lp=lp, tokens=[ev.token] if b.return_tokens else None)
                            continue
                        new = decs[i].push(ev.token)
                        full[i] += new
                        lp = None
                        if logprobs:
                            entry = lp_chat(ev)
                            lp = {"content": [entry]} if chat else lp_legacy([entry])
                        piece = cutters[i].push(new)
                        if piece or lp or b.return_tokens:
                            yield chunk(i, text=piece, lp=lp, tokens=[ev.token] if b.return_tokens else None)
                except ColibriError as err:
                    status = str(STATUS.get(err.code, 400))
                    yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.name, 'code': err.name}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if include_usage:
                    yield chunk(usage=usage_of(n_out))
                await keep([d.ids for d in decs])
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:           # the client went away: the request is cancelled
                status = "499"
                raise
            finally:
                for req, _ in subs:
                    req.cancel()
                metrics.requests.labels(h.name, endpoint, status).inc()
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def unsupported(b: Common):
        """The message refusing what only a chat takes (tools on /v1/completions), or None."""
        if isinstance(b, Completion) and (b.tools or b.functions or b.tool_choice not in (None, "none")
                                          or b.function_call not in (None, "none")):
            return ("tools and tool_choice are for /v1/chat/completions: send the conversation as messages there")
        return None

    def chat_plan(e, body: Chat):
        """The chat request's ChatPlan (prompt and grammar), or None when its reply is plain text."""
        from ..requests.chat import ChatPlan
        tools, choice = body.tools, body.tool_choice
        if body.functions is not None:          # the older names: functions / function_call
            if tools is not None:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "give tools or functions, not both")
            tools = [{"type": "function", "function": f} for f in body.functions]
            fc = body.function_call
            choice = {"type": "function", "function": fc} if isinstance(fc, dict) else fc
        kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:
            kwargs["reasoning_effort"] = body.reasoning_effort
        grammar = {k: getattr(body, k) for k in GRAMMAR_ARGS if getattr(body, k, None) is not None}
        plan = ChatPlan(e.codec, chat_messages(body), tools, choice, body.parallel_tool_calls, grammar, kwargs)
        return plan if (plan.calls or plan.reasoning or plan.grammar != grammar or kwargs) else None

    def chat_messages(body: Chat) -> list:
        if not body.messages:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "messages: give at least one message")
        out = []
        for j, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):            # content parts: text only
                bad = [p.type for p in content if p.type != "text" or p.text is None]
                if bad:
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"messages[{j}].content: a part of type "
                                       f"{bad[0]!r}; this server takes text parts only "
                                       "({'type': 'text', 'text': ...})")
                content = "\n".join(p.text for p in content)
            msg = {"role": m.role, "content": content if content is not None or m.tool_calls else ""}
            for k in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
                if getattr(m, k) is not None:
                    msg[k] = getattr(m, k)
            out.append(msg)
        return out

    async def generation(http, body, chat):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            h = host_of(body.model)
        except LookupError:
            metrics.refused(path, 404)
            return not_served(body.model)
        warn_unknown(body, path)
        why = unsupported(body)
        endpoint = _endpoint(path)
        if why:
            metrics.requests.labels(h.name, endpoint, "400").inc()
            return error(400, why, "unsupported")
        try:
            if chat:
                plan = await asyncio.to_thread(chat_plan, h.engine, body)
                return await run(h, http, [plan.ids if plan is not None else chat_messages(body)], body, True,
                                 body.logprobs or body.top_logprobs > 0, body.top_logprobs, plan)
            p = body.prompt
            prompts = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
            return await run(h, http, prompts, body, False, body.logprobs is not None, body.logprobs or 0)
        except ColibriError as e:
            metrics.requests.labels(h.name, endpoint, str(STATUS.get(e.code, 400))).inc()
            return colibri_error(e)

    @app.post("/v1/completions")
    async def completions(body: Completion, http: HTTPRequest):
        return await generation(http, body, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Chat, http: HTTPRequest):
        return await generation(http, body, True)

    @app.post("/v1/embeddings")
    async def embeddings(body: Embeddings):
        """The final (normed) hidden state of every input token, mean-pooled and L2-normalised: a
        decoder's sentence vector (as llama-server's --pooling mean). Deterministic for a backend."""
        try:
            h = host_of(body.model)
        except LookupError:
            metrics.refused("/v1/embeddings", 404)
            return not_served(body.model)
        warn_unknown(body, "/v1/embeddings")
        try:
            if body.encoding_format not in ("float", "base64"):
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"encoding_format {body.encoding_format!r}: "
                                   "use 'float' or 'base64'")
            x = body.input
            inputs = x if isinstance(x, list) and x and not isinstance(x[0], int) else [x]
            e = h.engine
            vecs, n = await asyncio.to_thread(lambda: _embed(e, inputs, h.adapter))
            if body.dimensions is not None and not 1 <= body.dimensions <= vecs.shape[1]:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"dimensions={body.dimensions}: this model's "
                                   f"embeddings have {vecs.shape[1]}; ask for 1 to {vecs.shape[1]}")
            if body.dimensions is not None:
                import numpy as np
                vecs = vecs[:, :body.dimensions]
                vecs = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
            if body.encoding_format == "base64":
                import base64
                data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vecs]
            else:
                data = [v.tolist() for v in vecs]
        except ColibriError as err:
            metrics.requests.labels(h.name, "embeddings", str(STATUS.get(err.code, 400))).inc()
            return colibri_error(err)
        metrics.tokens_in.labels(h.name).inc(n)
        metrics.requests.labels(h.name, "embeddings", "200").inc()
        return {"object": "list", "model": h.name, "usage": {"prompt_tokens": n, "total_tokens": n},
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(data)]}

    @app.post("/tokenize")
    async def tokenize(body: Tokenize):
        try:
            h = host_of(body.model)
        except LookupError:
            return not_served(body.model)
        try:
            codec = h.engine.codec
            ids = await asyncio.to_thread(codec.encode, body.content, body.add_special)
        except ColibriError as err:
            return colibri_error(err)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": codec.decode([t], skip_special_tokens=False)} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: Detokenize):
        try:
            h = host_of(body.model)
        except LookupError:
            return not_served(body.model)
        V = h.engine.config["vocab_size"]
        bad = [t for t in body.tokens if not 0 <= t < V]
        if bad:
            return error(400, f"tokens: {bad[0]} is out of range for a vocabulary of {V}")
        try:
            return {"content": await asyncio.to_thread(h.engine.codec.decode, body.tokens)}
        except ColibriError as err:
            return colibri_error(err)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [h.card() for h in views.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in views:
            return not_served(model_id)
        return views[model_id].card()

    def requests_view():
        """Per model: the pool and each running or waiting request with the KV blocks it holds."""
        out = {}
        for n, h in hosts.items():
            e = h.engine
            c = e._core
            rows = [("running", r) for r in list(c.running)] + [("waiting", r) for r in list(c.waiting)]
            reqs = []
            for s, r in rows:
                seq = r.seq
                if r.score == "settle":
                    s = "settling"          # a finished reply re-prefilled for its snapshot (hybrid models)
                reqs.append({"id": r.id, "state": s, "priority": r.priority, "prompt_tokens": int(len(r.prompt)),
                             "prefilled": int(r.pos), "generated": len(r.produced),
                             "kv_blocks": 0 if seq is None else sum(len(t) for t in seq.tables),
                             "kv_tokens": 0 if seq is None else int(seq.cached)})
            pool = e.runner.pool
            out[n] = {"n_ctx": e.max_seq_len, "kv_blocks_total": pool.num_blocks,
                      "kv_blocks_free": pool.free_blocks, "kv_block_tokens": pool.block_size,
                      "max_batch": e.max_batch, "requests": reqs}
        return out

    @app.get("/v1/requests")
    async def requests_endpoint():
        return requests_view()

    @app.get("/slots")
    async def slots():
        """llama-server's /slots, as this server has it: the running requests of every model."""
        return requests_view()

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": sorted(hosts)}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    from .dashboard import add_dashboard      # last: its page is answered outside the key check
    add_dashboard(app, hosts, metrics, auth=bool(api_key))
    app.state.hosts = hosts
    return app


def _embed(e, inputs, adapter=None):
    """[inputs] -> (float32 [n, hidden] unit vectors, prompt tokens): Engine.embed's pooled states."""
    import numpy as np
    ids = [e._prompt_ids(x) for x in inputs]
    states = e.embed(ids, adapter=adapter)
    vecs = np.stack([s.mean(axis=0) for s in states]).astype(np.float32)
    vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
    return vecs, sum(len(x) for x in ids)


def _version():
    try:
        from importlib.metadata import version
        return version("colibri-edge")
    except Exception:                  # noqa: BLE001 -- a source checkout that was never installed
        from .. import __version__
        return __version__


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


def bind(host: str, port: int):
    """The listening socket, bound before any engine loads (a busy port is found at once)."""
    import socket
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--port {port}: a port is 0 to 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--host {host!r}: {e.strerror}; give an address "
                           "such as 127.0.0.1 or 0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"cannot listen on {host}:{port} ({e.strerror}): "
                           "another program holds the port; choose another with --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def describe(name, e) -> str:
    """The startup line of one model: its engine, context, KV pool and memory."""
    from ..units import human
    pool = e.runner.pool
    kv = e.runner.state_bytes
    return (f"model {name!r} ({e.path}): {e.config['model_type']} on {e.backend.name}, context {e.max_seq_len}, "
            f"max batch {e.max_batch}, KV cache {pool.num_blocks * pool.block_size} tokens ({human(kv)}, "
            f"{e.kv_dtype}), "
            f"memory {e.runner.need_text}")


def serve(models: dict, host="127.0.0.1", port=8000, api_key=None, cors=None, request_timeout=None,
          budgets: dict | None = None, options: dict | None = None, max_body=MAX_BODY, max_tokens=None,
          cache_dir=None, cache_dir_bytes=None, loras: dict | None = None, **engine_kw):
    """Open an engine per model directory ({name: dir}) and serve them until SIGINT / SIGTERM
    (uvicorn stops accepting, lets running responses finish, then the engines are closed).
    The port is bound first: a busy port is an error before any model loads.
    budgets: {name: bytes} the engine of that model may allocate (arena, KV pool, expert slots,
    device copies of weights); checked together against the memory available, then each engine
    against its own at open: the server refuses to start, with the numbers, when they do not fit.
    options: {name: {Engine.open keyword: value}} for one model, over engine_kw (every model's).
    A server re-prefills hybrid models' replies for the next turn (settle_replies) unless told not to.
    loras: {adapter name: adapter directory} (serve --lora NAME=DIR), loaded into the first model's engine
    and served as models of their own (their cards name it as "parent")."""
    _deps()
    import uvicorn
    engine_kw.setdefault("settle_replies", True)
    from ..requests.engine import Engine
    budgets = dict(budgets or {})
    options = dict(options or {})
    for what, d in (("memory budget", budgets), ("options", options)):
        unknown = sorted(set(d) - set(models))
        if unknown:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{what} for {', '.join(unknown)}: no such model "
                               f"(models: {', '.join(models)})")
    check_budgets(budgets)
    sock = bind(host, port)
    engines = {}
    try:
        for name, path in models.items():
            kw = {**engine_kw, **options.get(name, {})}
            try:
                engines[name] = Engine.open(path, memory_budget=budgets.get(name), **kw)
            except ColibriError as e:
                raise ColibriError(e.code, f"model {name!r} ({path}): {e.message}") from None
            log.warning("%s", describe(name, engines[name]))
        base = next(iter(models))
        for a, where in (loras or {}).items():
            if a in models:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--lora {a}={where}: {a!r} names a model; give the "
                                   "adapter another name")
            try:
                info = engines[base].load_adapter(a, where)
            except ColibriError as e:
                raise ColibriError(e.code, f"--lora {a}={where}: {e.message}") from None
            log.warning("adapter %s (%s) on %s: rank %d, %d matrices, %.1f MiB", a, where, base, info["rank"],
                        info["matrices"], info["bytes"] / 2**20)
        app = create_app(engines, api_key=api_key, cors=cors, request_timeout=request_timeout,
                         max_body=max_body, max_tokens=max_tokens, cache_dir=cache_dir,
                         cache_dir_bytes=cache_dir_bytes or CACHE_DIR_BYTES,
                         adapters={a: base for a in (loras or {})})
        config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=30)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        for e in engines.values():
            e.close()
