"""The public Engine: open a model directory on a backend, then infer / generate / stream / chat.

Thread safety: an Engine is shared by any number of threads: generate / stream / generate_batch /
chat submit requests to its request core (core.py), whose one thread batches every live request
into each step (continuous batching); infer and trace run on that thread between steps. Engines opened on
the same model directory in one process share the read-only mapped weights (one memmap); each has
its own KV pool, arena and counters.
"""
from __future__ import annotations

import numbers
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from .. import knobs
from . import sampling
from .scheduler import DONE, ERROR, TOKEN, Core, Event, Request, text_piece
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, nonfinite, COLIBRI_ERR_UNAVAILABLE
from ..model.modeldir import ModelDir
from ..runtime.runner import Runner

_MODEL_CACHE: "weakref.WeakValueDictionary[str, ModelDir]" = weakref.WeakValueDictionary()


_MODEL_LOCK = threading.Lock()


def _identity(path: str):
    """What makes two opens of a directory the same model: its files' inode, size and mtime (a model
    converted again into the same directory is a new model, never the old mapping)."""
    out = [os.path.realpath(path)]
    for name in ("config.json", "tensors.json", "experts.json", "colibri_weights.bin"):
        try:
            st = os.stat(os.path.join(path, name))
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class ConfiguredModel:
    """A shared ModelDir (its memmap and tensors) seen with this engine's own config: the top_k
    override changes the config only, never the model every other engine on the directory shares."""

    def __init__(self, model: ModelDir, config: dict):
        self._model, self.config = model, config

    def __getattr__(self, name):
        return getattr(self._model, name)


def with_top_k(model: ModelDir, top_k: int):
    """The model routed to top_k experts per token instead of its own (fewer experts read per token,
    as transformers with num_experts_per_tok = top_k): the router's mode, its normalisation and its
    choice bias unchanged. 0: the model as it is."""
    cfg = model.config
    if not top_k or top_k == cfg["top_k"]:
        return model
    E = cfg["experts_per_layer"]
    if not E or cfg["router_mode"] == "gated":
        why = "no routed experts" if not E else "a gated mixture runs every expert"
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"top_k={top_k} (Engine.open(top_k=...), COLIBRI_TOP_K): "
                           f"{model.path} has no top-k router ({why}); leave it unset")
    if not 1 <= top_k <= E:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"top_k={top_k} (Engine.open(top_k=...), COLIBRI_TOP_K): "
                           f"the model has {E} experts per layer; give 1..{E} (its own is {cfg['top_k']})")
    return ConfiguredModel(model, {**cfg, "top_k": int(top_k)})


def open_model_dir(path: str) -> ModelDir:
    """One ModelDir (and so one memmap) per model directory per process."""
    key = _identity(path)
    with _MODEL_LOCK:
        m = _MODEL_CACHE.get(key)
        if m is None:
            m = ModelDir(path)
            _MODEL_CACHE[key] = m
        return m


GEN_ARGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
SAMPLING_EXTRAS = {"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                   "top_logprobs"}
GRAMMAR_ARGS = ("response_format", "grammar", "regex", "json_schema", "lark")     # constrain.grammar_spec
DRAFT_ARGS = ("draft", "draft_tokens")          # speculative decoding per request (draft.py)
STEP_WINDOW = 4096     # decode steps whose times the step percentiles cover (the latest ones)


class Generation(list):
    """What generate() returns: the generated token ids (a list), and why generation ended,
    finish_reason, as the OpenAI API and colibri serve report it: "stop" (an end-of-sequence id, the
    last id, or a stop string) or "length" (max_new_tokens ids, or fewer when the context reached the
    engine's max_seq_len first: len(ids) < max_new_tokens with "length" says the context is full)."""

    def __init__(self, ids=(), finish_reason: str = "length"):
        super().__init__(ids)
        self.finish_reason = finish_reason

    def __repr__(self):
        return f"Generation({list.__repr__(self)}, finish_reason={self.finish_reason!r})"


@dataclass
class Stats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    settle_tokens: int = 0          # replies re-prefilled for their recurrent-state snapshot (hybrid models)
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    first_token_seconds: float = 0.0
    prompt_tokens: int = 0          # prompt tokens of the generation requests admitted
    cached_tokens: int = 0          # ... of which found in the prefix cache (not prefilled)
    draft_proposed: int = 0         # drafted tokens verified (speculative decoding)
    draft_accepted: int = 0         # ... of which the model agreed with (each a token gained)
    draft_steps: int = 0            # verifications (a request's drafts in a step)
    step_seconds: np.ndarray = field(default_factory=lambda: np.zeros(STEP_WINDOW), repr=False)

    def add_decode_step(self, seconds: float, tokens: int, rows: int | None = None):
        """One decode step of `rows` requests emitting `tokens` (more than rows when drafts were
        accepted): its time goes into a fixed ring (the latest STEP_WINDOW steps; nothing is allocated
        per step)."""
        self.step_seconds[self.decode_steps % STEP_WINDOW] = seconds
        self.decode_seconds += seconds
        self.decode_tokens += tokens
        self.decode_rows += tokens if rows is None else rows
        self.decode_steps += 1

    decode_rows: int = 0            # decode entries over all decode steps (request-steps)

    @property
    def tokens_per_stream_step(self) -> float:
        """Tokens a request gets per decode step it takes part in: 1 without drafts, 1 + accepted drafts
        per verification with them (0 before any)."""
        return self.decode_tokens / self.decode_rows if self.decode_rows else 0.0

    @property
    def acceptance(self) -> float:
        """Drafted tokens accepted / drafted tokens verified (0 before any)."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens admitted (0 before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def step_ms(self) -> dict:
        """p50 / p99 / max of the latest decode steps' times in milliseconds (None before any)."""
        n = min(self.decode_steps, STEP_WINDOW)
        if not n:
            return {"steps": 0, "p50": None, "p99": None, "max": None}
        s = self.step_seconds[:n] * 1e3
        return {"steps": n, "p50": float(np.percentile(s, 50)), "p99": float(np.percentile(s, 99)),
                "max": float(s.max())}


class Engine:
    def __init__(self, path, backend=None, max_seq_len=None, max_batch=8, kv_cache_tokens=None,
                 prefill_chunk=256, kv_block_size=None, num_streams=None, router_warmup=None,
                 disable_fp16=None, num_threads=None, expert_slots=None, slot_policy=None, cuda_graphs=None,
                 int8_activations=None,
                 device=None, max_queue=1024, interleave=2.0, core_thread=None, memory_budget=None, top_k=None,
                 chat_template=None, prefix_cache=True, kv_dtype=None, state_snapshots=None, snapshot_every=1024,
                 settle_replies=False, profile=False, adapters=None, adapter_dtype="auto", draft="off",
                 draft_tokens=5):
        # chat_template: a Jinja file's path or the template text, over the model's own (textio.load_chat_template);
        # a model with neither renders chats as ChatML, with a warning (textio.FALLBACK_CHAT_TEMPLATE)
        from .textio import load_chat_template
        self._chat_template = None if chat_template is None else load_chat_template(chat_template)
        # top_k (COLIBRI_TOP_K): experts per token at run time instead of the model's (with_top_k); not
        # the sampling top_k that generate() takes
        from ..model.gguf_cache import model_source
        path = model_source(path)              # a GGUF file: its converted copy in the cache (made once)
        self.model = with_top_k(open_model_dir(path), knobs.resolve("COLIBRI_TOP_K", top_k))
        cfg = self.config = self.model.config
        self.path = self.model.path
        from ..backends import backend_class, require_kv_dtype, resolve
        backend_name = resolve(knobs.resolve("COLIBRI_BACKEND", backend))
        block = knobs.resolve("COLIBRI_KV_BLOCK_SIZE", kv_block_size)
        warmup = knobs.resolve("COLIBRI_ROUTER_WARMUP", router_warmup)
        cls = backend_class(backend_name)
        # kv_dtype (COLIBRI_KV_DTYPE): the paged KV cache's storage type, float32, float16 or q8_0
        # (backends.base.kv_parts), on the backends whose kv_dtypes list it
        self.kv_dtype = knobs.resolve("COLIBRI_KV_DTYPE", kv_dtype)
        require_kv_dtype(cls, self.kv_dtype)            # before the backend starts its device
        self.options, not_applicable = knobs.backend_options(cls, {
            "num_streams": num_streams, "disable_fp16": disable_fp16, "num_threads": num_threads,
            "cuda_graphs": cuda_graphs, "int8_activations": int8_activations, "device": device})
        max_pos = cfg["max_position_embeddings"]
        max_seq_len = max_pos if max_seq_len is None else max_seq_len
        if isinstance(max_seq_len, numbers.Integral) and not isinstance(max_seq_len, bool) and max_seq_len > max_pos:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"max_seq_len={max_seq_len} exceeds the model's "
                               f"max_position_embeddings={max_pos}")
        max_seq_len = sampling.integer("max_seq_len", max_seq_len, 1, max_pos)
        max_batch = sampling.integer("max_batch", max_batch, 1, 1 << 16)
        prefill_chunk = sampling.integer("prefill_chunk", prefill_chunk, 1, 1 << 20)
        if kv_cache_tokens is None:
            kv_cache_tokens = min(max_seq_len * max_batch, max(4096, max_seq_len))
        kv_cache_tokens = sampling.integer("kv_cache_tokens", kv_cache_tokens, 1, 1 << 40)
        missing = sorted(self.model.formats - set(cls.weight_dtypes))
        if missing:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"backend {backend_name!r} does not run {', '.join(missing)} "
                               f"weights (it runs {', '.join(cls.weight_dtypes)}); re-convert with "
                               f"`colibri convert --dtype ...` or pick another backend")
        splits = [] if cls.mixed_gate_up else self.model.gate_up_splits
        if splits:
            where, g, u = splits[0]
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"backend {backend_name!r} runs an FFN's gate and up "
                               f"projections in one format, and {where} stores gate as {g} and up as {u} "
                               f"({len(splits)} such FFN(s)); run it on the cpu backend, or re-quantise the file "
                               "with gate and up in one type")
        self.backend = cls(**self.options)
        self.backend.not_applicable = not_applicable
        self.max_seq_len, self.max_batch = int(max_seq_len), int(max_batch)
        # a step never holds more prompt tokens than the KV cache's sequences can: the arena is not sized
        # for rows that cannot occur (an 88-token context at the default 256-token chunk: two thirds of
        # the arena, the logits [rows, vocab] most of it -- two expert slots of the pressure benchmark)
        self.prefill_chunk = min(int(prefill_chunk), self.max_seq_len * self.max_batch)
        rows = max(self.prefill_chunk, self.max_batch)
        slots = knobs.resolve("COLIBRI_EXPERT_SLOTS", expert_slots)
        policy = knobs.resolve("COLIBRI_SLOT_POLICY", slot_policy)
        if slots != "auto" and slots > len(self.model.experts):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"expert_slots={slots}: the model has only "
                               f"{len(self.model.experts)} experts; leave it unset to keep every expert resident")
        # recurrent layers (Qwen3.5): prefix caching resumes from snapshots of their state, taken at
        # prompts' last whole blocks and every snapshot_every prefilled tokens (state.SnapshotPool);
        # state_snapshots of them (default max_batch: the recurrent state's memory doubles); snapshot_every
        # is rounded up to a multiple of lcm(kv_block_size, 16)
        use_prefix = sampling.flag("prefix_cache", prefix_cache)
        snapshots = sampling.integer("state_snapshots", self.max_batch if state_snapshots is None else
                                     state_snapshots, 0, 1 << 20) if use_prefix else 0
        snapshot_every = sampling.integer("snapshot_every", snapshot_every, 0, 1 << 30)
        # memory_budget: bytes the engine may allocate (arena, KV pool, expert slots); kept for the dashboard
        self.memory_budget = None if memory_budget is None else sampling.integer("memory_budget", memory_budget, 1,
                                                                                 1 << 60)
        # speculative decoding (draft.py): every request's default (a request may choose its own); on a
        # model with recurrent layers, drafting needs a copy of each state to roll back to (allocated here)
        from .draft import check_draft
        has_mtp = bool(cfg.get("mtp"))
        self.draft, self.draft_tokens = check_draft(draft, draft_tokens, has_mtp)
        # the model's MTP head runs when drafting may use it ("mtp"; "auto" on a model with one): its layer's
        # KV beside the model's, written at every position the engine computes
        mtp = has_mtp and self.draft in ("mtp", "auto")
        if mtp and slots:
            if self.draft == "mtp":
                raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "draft='mtp' with expert_slots: the MTP head's experts "
                                   "would need slots of their own; open the engine without expert_slots, or draft "
                                   "with 'ngram' (or 'auto', which then uses it)")
            mtp = False
        self.runner = Runner(self.model, self.backend, rows, self.max_batch, self.max_seq_len,
                             -(-int(kv_cache_tokens) // block), block, snapshots=snapshots,
                             snapshot_every=snapshot_every,
                             expert_slots=slots or None, slot_policy=policy,
                             memory_budget=self.memory_budget, kv_dtype=self.kv_dtype,
                             draft_states=self.draft != "off", mtp=mtp)
        # prefix caching (runtime/state.py States.adopt_prefix): a request starts from the longest
        # prefix of whole KV blocks an earlier one left in the pool, prefilling only the rest
        if not use_prefix:
            self.runner.states.prefix_block = 0
        # hybrid models: re-prefill each finished reply in the background for a snapshot after it
        # (scheduler.Core._settle), so the next turn resumes after the reply; serve turns it on
        self.settle_replies = sampling.flag("settle_replies", settle_replies)
        self.stats = Stats()
        # end-of-sequence ids (generation_config.json); the engine's own copy, so it may be changed
        self.eos_token_ids = list(cfg["eos_token_ids"])
        self._core = Core(self, sampling.integer("max_queue", max_queue, 1, 1 << 20),
                          inline=not knobs.resolve("COLIBRI_CORE_THREAD", core_thread))
        # a step that carries prefill beside decodes takes at most `interleave` x a decode step (core.py)
        self.interleave = sampling.real("interleave", interleave, 0.0, 1e6)
        if 0 < self.interleave <= 1:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"interleave={interleave}: use 0 (no cap) or a "
                               "number above 1 (a step with prefill may take that many decode steps' time)")
        self._next_seq = 0
        self._memory = None
        self._codec = None
        self._grammar_engine = None
        self.closed = False
        for _ in range(warmup):
            self.infer(np.zeros(min(8, self.max_seq_len), dtype=np.int32))
        # profile: every step's time by phase (runtime/profiler.py; the dashboard shows it), at the cost
        # of a device sync after each operation on queued backends
        self.profiler = None
        if sampling.flag("profile", profile):
            from ..runtime.profiler import StepProfiler
            self.profiler = StepProfiler(self.runner)
        # adapters: {name: PEFT adapter directory (or llama.cpp LoRA .gguf)}, loaded now (load_adapter);
        # adapter_dtype: the precision their factors are held at (load_adapter's dtype)
        self.adapter_dtype = adapter_dtype
        if adapters is not None:
            if not isinstance(adapters, dict):
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapters={adapters!r:.80}: expected a dict of "
                                   "name -> adapter directory")
            for name, where in adapters.items():
                self.load_adapter(name, where)

    # -- LoRA adapters (runtime/lora.py, docs/lora.md) ----------------------------------------
    def load_adapter(self, name: str, path, scale: float = 1.0, dtype: str | None = None) -> dict:
        """Load a LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors, or llama.cpp's LoRA
        .gguf) under `name`, while the engine runs; requests then name it (adapter=name). Its factors
        count against the engine's memory_budget. dtype (default: the engine's adapter_dtype, "auto"):
        "float32", "float16", or "auto" = float32 where the matrix updated is float32, else float16
        where it holds the factors to 1e-3 (runtime/lora.py hold). Returns adapters()[name]."""
        self._check_open()
        if not isinstance(name, str) or not name or len(name) > 256 or name.strip() != name:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter name {name!r:.80}: expected a non-empty "
                               "string without surrounding spaces")
        if not isinstance(path, (str, os.PathLike)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r}: path {path!r:.80} is not a path")
        from ..model import families
        from ..model.lora import check_scale, read_adapter
        scale = check_scale(scale)
        adapter = read_adapter(os.fspath(path))
        family = families.for_model_type(self.config["model_type"], os.path.join(self.path, "config.json"))

        def load():
            from ..runtime.lora import Adapters
            r = self.runner
            if r.adapters is None:
                r.adapters = Adapters(r)
            if name in r.adapters.loaded:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"an adapter named {name!r} is loaded already; "
                                   "unload_adapter it first, or pick another name")
            lo = r.adapters.load(name, adapter, family, scale, self.adapter_dtype if dtype is None else dtype)
            if self.memory_budget is not None and r.memory_need + r.adapters.nbytes > self.memory_budget:
                r.adapters.unload(name)
                from ..errors import COLIBRI_ERR_OUT_OF_MEMORY
                from ..units import human
                raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, f"adapter {name!r} takes {human(lo.nbytes)}; with the "
                                   f"engine's {human(r.memory_need)} and the adapters loaded it is over the memory "
                                   f"budget of {human(self.memory_budget)}; unload an adapter or give a larger budget")
            return lo
        self._core.call(load)
        return self.adapters()[name]

    def unload_adapter(self, name: str):
        """Unload an adapter; refused while a request queued or running uses it."""
        self._check_open()
        lo = self._adapter(name)

        def unload():
            core = self._core
            users = [r for r in list(core.running) + list(core.waiting) if r.adapter is lo and not r.finished]
            if users:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r} is in use by {len(users)} "
                                   "request(s); unload it when they finish (or cancel them)")
            self.runner.adapters.unload(name)
        self._core.call(unload)

    def adapters(self) -> dict:
        """name -> {"path", "rank", "bytes", "matrices", "dtype"} of every loaded adapter."""
        ad = self.runner.adapters if self.runner is not None else None
        return {} if ad is None else {n: {"path": a.path, "rank": a.rank, "bytes": a.nbytes, "matrices": len(a.names),
                                          "dtype": a.dtype} for n, a in ad.loaded.items()}

    def _adapter(self, name):
        """The loaded adapter a request names (None: the base model); unknown names refused."""
        if name is None:
            return None
        ad = self.runner.adapters
        if not isinstance(name, str) or ad is None or name not in ad.loaded:
            known = ", ".join(sorted(ad.loaded)) if ad is not None and ad.loaded else "none"
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"adapter {name!r:.80} is not loaded (loaded: {known}); "
                               "load it with Engine.load_adapter(name, path) or serve --lora NAME=DIR")
        return ad.loaded[name]

    @classmethod
    def open(cls, path, backend=None, **kw) -> "Engine":
        return cls(path, backend=backend, **kw)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if not self.closed:
            self.closed = True
            self._core.close()
            if self.profiler is not None:
                self.profiler.close()
            if self.runner.slot_pool is not None:
                try:
                    self.runner.slot_pool.save_heat(self.runner.expert_counts())   # the learned hot set
                except OSError:
                    pass                                # a read-only cache: the next run starts cold
                self.runner.slot_pool.close()
            self.backend.close()
            self.runner = None

    # -- helpers ----------------------------------------------------------------------------
    def _check_open(self):
        if self.closed:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "engine is closed; open a new one")

    @property
    def codec(self):
        if self._codec is None:
            if not os.path.exists(os.path.join(self.path, "tokenizer.json")):
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{self.path} has no tokenizer.json: pass "
                                   "token ids instead of text")
            from .textio import TextCodec
            self._codec = TextCodec(self.path, self.model.tokenizer_config, self._chat_template)
        return self._codec


    def _check_ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "empty input: give at least one token id")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"token ids must be integers, got {arr.dtype}")
        V = self.config["vocab_size"]
        if arr.min() < 0 or arr.max() >= V:
            bad = int(arr[(arr < 0) | (arr >= V)][0])
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"token id {bad} is out of range [0, {V})")
        if arr.size > self.max_seq_len:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"input of {arr.size} tokens is longer than "
                               f"max_seq_len={self.max_seq_len}")
        return arr.astype(np.int32)

    def _new_seq(self):
        self._next_seq += 1
        return self.runner.new_sequence(self._next_seq)

    # -- public API -------------------------------------------------------------------------
    def infer(self, input_ids, adapter=None):
        """int token ids [seq] or [batch, seq] (an array or nested lists, e.g. [[1, 2, 3, 4]]) -> float32
        logits, an array [batch, seq, vocab] ([1, seq, vocab] for 1-D). Sequences of different lengths
        (a list of them) -> a list of float32 [len, vocab] arrays, one per sequence (nothing is padded:
        a pad position's logits would mean nothing). adapter: a loaded LoRA adapter's name."""
        self._check_open()
        lora = self._adapter(adapter)
        as_list = isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and \
            not np.isscalar(input_ids[0])
        if as_list:
            seqs = [self._check_ids(x) for x in input_ids]
            as_list = len({len(x) for x in seqs}) > 1           # ragged: one array each
        else:
            arr = np.asarray(input_ids)
            if arr.ndim == 1:
                arr = arr[None]
            if arr.ndim != 2 or arr.size == 0:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                                   f"input_ids must be [seq] or [batch, seq] token ids, got shape {arr.shape}")
            seqs = [self._check_ids(x) for x in arr]
        results = self._score(seqs, lora=lora)
        for j, r in enumerate(results):
            if not np.isfinite(r.max()):
                raise nonfinite(f"input {j}")
        results = [r.astype(np.float32, copy=False) for r in results]
        return results if as_list else np.stack(results)

    def embed(self, input_ids, adapter=None) -> list:
        """Token ids ([seq], or a list of sequences of any lengths) -> a list of float32 [len, hidden]
        arrays: every token's final hidden state after the final norm (the rows the lm_head reads), as
        transformers' output.hidden_states[-1] after model.norm. serve's /v1/embeddings mean-pools them.
        adapter: a loaded LoRA adapter's name."""
        self._check_open()
        lora = self._adapter(adapter)
        one = len(input_ids) > 0 and np.isscalar(input_ids[0]) if isinstance(input_ids, (list, tuple)) \
            else np.asarray(input_ids).ndim == 1
        seqs = [self._check_ids(input_ids)] if one else [self._check_ids(x) for x in input_ids]
        out = self._score(seqs, kind="hidden", lora=lora)
        for j, r in enumerate(out):
            if not np.isfinite(r).all():
                raise nonfinite(f"input {j}'s hidden states")
        return out

    def save_session(self, prompt, path: str) -> int:
        """Save the KV blocks of `prompt`'s cached prefix (token ids, text or chat messages: what a
        request with it, or a longer one, ran) to a file; -> the positions saved (whole blocks). A
        later engine of the same model loads it (load_session) and answers the conversation's next
        turn without prefilling them. The file format: requests/session.py."""
        from . import session
        self._check_open()
        return session.save(self, [int(t) for t in self._prompt_ids(prompt)], path)

    def load_session(self, path: str) -> int:
        """Load a save_session file into the prefix cache; -> the positions it holds. A file of another
        model, weights, block size or cache type, or a damaged one, is COLIBRI_ERR_INVALID_ARGUMENT."""
        from . import session
        self._check_open()
        return session.load(self, path)

    def _score(self, seqs, kind=True, made=None, lora=None) -> list:
        """Every token's logits of each sequence, through the request core: scoring requests (no
        generation) prefilled in chunks beside whatever else is running, max_batch at a time (made: a
        list the requests are appended to)."""
        out = []
        params = self._params(max_new_tokens=1)
        for g in range(0, len(seqs), self.max_batch):
            reqs = [Request(ids, params) for ids in seqs[g:g + self.max_batch]]
            if made is not None:
                made += reqs
            for r in reqs:
                r.score, r.adapter = kind, lora
            self._core.submit(reqs)
            for r in reqs:
                for ev in r.iter_events():
                    if ev.kind == ERROR:
                        raise ev.error
                    if ev.kind == DONE:
                        out.append(ev.logits)
        return out

    def _prompt_ids(self, prompt):
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            for j, m in enumerate(prompt):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                        not isinstance(m.get("content"), str):
                    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"chat message {j}: expected "
                                       "{'role': str, 'content': str}, got " + f"{m!r:.80}")
            ids = self.codec.encode(self.codec.render_chat(list(prompt)), add_special_tokens=False)
        else:
            ids = prompt
        return self._check_ids(ids)

    @staticmethod
    def _check_prompts(prompts):
        if not isinstance(prompts, (list, tuple)) or not prompts or len(prompts) > 1 << 16:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"prompts={prompts!r:.80}: expected a non-empty list "
                               "of prompts (strings, token id lists or chat message lists)")
        return list(prompts)

    def _params(self, max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None,
                ignore_eos=False, **extra) -> sampling.SamplingParams:
        unknown = sorted(set(extra) - SAMPLING_EXTRAS)
        if unknown:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"unknown generation argument {unknown[0]!r}; "
                               f"known: {', '.join(sorted(SAMPLING_EXTRAS | set(GEN_ARGS) | set(GRAMMAR_ARGS) | set(DRAFT_ARGS)))}")
        p = sampling.SamplingParams.make(self.config["vocab_size"], self.eos_token_ids, max_new_tokens, temperature,
                                         top_p, top_k, seed, stop, ignore_eos, **extra)
        if p.stops:
            self.codec  # stop strings need the tokenizer
        return p

    def submit(self, prompt, priority=0, index=0, notify=None, **gen) -> Request:
        """Queue one request (prompt: token ids, a string or chat messages; gen: generate()'s
        arguments and the extras min_p, repetition_penalty, presence_penalty, frequency_penalty,
        logit_bias, logprobs, top_logprobs); read its events with request.iter_events(), cancel it
        with request.cancel(). Raises COLIBRI_ERR_UNAVAILABLE when the queue is full."""
        return self._submit([prompt], priority, notify, **gen)[0]

    def submit_batch(self, prompts, priorities=None, **gen) -> list:
        """Queue several requests at once (one step can take all of them); prompt i samples with the
        RNG seeded [seed, i]; priorities: one int per prompt (higher first; default 0)."""
        prompts = self._check_prompts(prompts)
        if priorities is not None and (not isinstance(priorities, (list, tuple)) or len(priorities) != len(prompts)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"priorities={priorities!r:.80}: expected one integer "
                               f"per prompt ({len(prompts)})")
        return self._submit(prompts, priorities or 0, **gen)

    def submit_n(self, prompt, n, priority=0, notify=None, **gen) -> list:
        """n samples of one prompt (the OpenAI API's n): request i samples with the RNG seeded
        [seed, i]; the prompt is prefilled once, by request 0, and the others share its KV blocks
        (all but the block holding the last prompt token, which each computes for its own first
        logits)."""
        n = sampling.integer("n", n, 1, 1 << 10)
        reqs = self._submit([prompt] * n, priority, notify, _share=True, **gen)
        return reqs

    def _ngram_memory(self):
        """The engine's n-gram memory of finished sequences (draft.NgramMemory), made at the first drafting
        request."""
        if self._memory is None:
            from .draft import NgramMemory
            self._memory = NgramMemory()
        return self._memory

    def _draft_mode(self, mode, k) -> tuple:
        from .draft import check_draft
        mode, k = check_draft(mode, k, bool(self.config.get("mtp")))
        if mode == "mtp" and not self.runner.mtp:
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "draft='mtp': the engine was opened without the model's MTP "
                               "head (it runs its layer, and keeps that layer's KV, from the start); open it with "
                               "draft='mtp' or draft='auto'")
        if mode != "off" and self.runner.states.fixed and self.runner.kept is None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"draft={mode!r}: this model has recurrent layers, and "
                               "drafting on them keeps a copy of each sequence's state to roll back to; open the "
                               "engine with draft='ngram' or draft='auto' (it allocates the copies)")
        return mode, k

    def _grammars(self):
        """The engine's grammar engine (constrain.Grammars), built on first use from tokenizer.json."""
        if self._grammar_engine is None:
            from .constrain import Grammars
            self.codec                                   # a model without a tokenizer: the coded error
            with open(os.path.join(self.path, "tokenizer.json"), encoding="utf-8") as f:
                self._grammar_engine = Grammars(f.read(), self.config["vocab_size"], self.eos_token_ids)
        return self._grammar_engine

    def _submit(self, prompts, priority=0, notify=None, _share=False, **gen) -> list:
        self._check_open()
        lora = self._adapter(gen.pop("adapter", None))
        from .constrain import grammar_spec
        spec = grammar_spec(**{k: gen.pop(k) for k in GRAMMAR_ARGS if k in gen})
        mode, k = self._draft_mode(gen.pop("draft", self.draft), gen.pop("draft_tokens", self.draft_tokens))
        params = self._params(**gen)
        pri = priority if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        pri = [sampling.integer("priority", x, -(1 << 20), 1 << 20) for x in pri]
        reqs = [Request(self._prompt_ids(p), params, pri[i], i, notify) for i, p in enumerate(prompts)]
        for r in reqs:
            r.adapter = lora
            if mode != "off":
                from .draft import DraftState
                r.draft = DraftState(mode, k, r.prompt, self._ngram_memory(), mtp=self.runner.mtp)
        if spec is not None:
            first = self._grammars().matcher(spec)        # a grammar that does not compile: raised here
            for i, r in enumerate(reqs):
                r.constraint = first if i == 0 else first.copy()
            for r in reqs:
                r.constraint.prefetch()                   # the first mask, while the prompt prefills
        if _share:
            for r in reqs[1:]:
                r.prompt = r.ctx = reqs[0].prompt
                r.parent = reqs[0]
        if params.max_new_tokens == 0:
            for r in reqs:
                r.finished = True
                r._emit(Event(DONE, reason="length"))
            return reqs
        self._core.submit(reqs)
        return reqs

    def generate(self, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None,
                 ignore_eos=False, **extra):
        """prompt: token ids, a string (with a tokenizer) or chat messages [{"role","content"}].
        Returns a Generation: the generated token ids (a list, including a final end-of-sequence id,
        as transformers does, and the token that completed a stop string) and its finish_reason,
        "stop" or "length". ignore_eos (as vLLM's) generates max_new_tokens ids, unless the context
        (prompt + ids) reaches max_seq_len first: then it ends there with finish_reason "length" and
        fewer ids, as colibri serve does (open the engine with a larger max_seq_len, up to the model's
        max_position_embeddings, or ask for fewer tokens). extra: min_p, repetition_penalty,
        presence_penalty, frequency_penalty, logit_bias, priority (sampling.SamplingParams); a grammar
        the output must follow (constrain.py; the `grammar` extra): response_format (the OpenAI field:
        {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}),
        json_schema, regex, lark or grammar (GBNF), one of them."""
        return self.generate_batch([prompt], max_new_tokens, temperature, top_p, top_k, seed, stop,
                                   ignore_eos=ignore_eos, **extra)[0]

    def chat(self, messages, **kw):
        """Messages rendered with the model's chat template; returns the reply's text (of a harmony
        reply, gpt-oss's, the final channel's message: TextCodec.reply), up to, not including, the
        first stop string (the OpenAI API's stop, as colibri serve cuts it); kw: generate()'s."""
        if not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[0], dict):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"messages={messages!r:.80}: expected a list of "
                               "{'role': str, 'content': str} (use generate() for a plain prompt)")
        ids = self.generate(messages, **kw)
        from .textio import cut_at_stop
        return cut_at_stop(self.codec.reply(ids)[0], kw.get("stop"))

    def chat_message(self, messages, tools=None, tool_choice=None, parallel_tool_calls=None,
                     chat_template_kwargs=None, **kw) -> dict:
        """One chat turn as the OpenAI API answers it: {"role": "assistant", "content": str | None,
        "reasoning_content": str (a reasoning model's thinking, when it wrote any), "tool_calls":
        [{"id", "type": "function", "function": {"name", "arguments": JSON text}}] (when it called
        any)}, and "finish_reason" ("tool_calls", "stop" or "length"). tools / tool_choice ("auto",
        "none", "required", {"type": "function", "function": {"name": ...}}) / parallel_tool_calls as
        the OpenAI API takes them: the tools go into the model's chat template, a forced choice is held
        to the functions' parameter schemas by the grammar engine, the reply's calls are read in the
        template's own format (chat.py, toolcalls.py). messages may hold assistant tool_calls and
        {"role": "tool", "tool_call_id", "content"} results. chat_template_kwargs: extra template
        variables ({"enable_thinking": False}, {"reasoning_effort": "low"}); kw: generate()'s, with a
        response_format that constrains the content (never the reasoning)."""
        plan = self._chat_plan(messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs, kw)
        gen = self.generate(plan.ids, **kw)
        msg = plan.reader().message(self._reply_text(gen))
        from .textio import cut_at_stop
        if msg.get("content"):
            msg["content"] = cut_at_stop(msg["content"], kw.get("stop"))
        msg["finish_reason"] = "tool_calls" if msg.get("tool_calls") else gen.finish_reason
        return msg

    def _chat_plan(self, messages, tools, tool_choice, parallel_tool_calls, template_kwargs, kw):
        """chat.ChatPlan of a chat request; kw loses the grammar arguments the plan took over."""
        from .chat import ChatPlan
        if not isinstance(messages, (list, tuple)) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"messages={messages!r:.80}: expected a list of "
                               "{'role': str, 'content': str} dicts")
        grammar = {k: kw.pop(k) for k in GRAMMAR_ARGS if k in kw}
        plan = ChatPlan(self.codec, list(messages), tools, tool_choice, parallel_tool_calls, grammar, template_kwargs)
        kw.update(plan.grammar)
        return plan

    def _reply_text(self, ids) -> str:
        """A reply's text with its special tokens (the markers of tool calls and channels), without the
        end-of-sequence token that closed it."""
        ids = list(ids)
        while ids and ids[-1] in self.eos_token_ids:
            ids.pop()
        return self.codec.decode(ids, skip_special_tokens=False)

    def stream(self, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None,
               ignore_eos=False, **extra):
        """Yields text pieces as they are generated; a piece never splits a UTF-8 character. The text
        ends before the first stop string (as chat() and colibri serve cut it): the last len(longest
        stop) - 1 characters are held back until they cannot start one. Closing the generator early
        (break, del) cancels the request: its blocks return within one step."""
        from .textio import StopCutter, StreamDecoder
        dec = StreamDecoder(self.codec)
        priority = extra.pop("priority", 0)
        req = self._submit([prompt], priority, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos, **extra)[0]
        cutter = StopCutter(stop)
        try:
            for ev in req.iter_events():
                piece = cutter.push(text_piece(dec, ev))
                if piece:
                    yield piece
            tail = cutter.push(dec.flush()) + cutter.finish()
            if tail:
                yield tail
        finally:
            req.cancel()

    def generate_batch(self, prompts, max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                       stop=None, return_errors=False, ignore_eos=False, **extra):
        """Decode several sequences together (submitted at once: one step can prefill all of them);
        prompt i samples with its own RNG, seeded [seed, i]. A request that can never fit (larger
        than the whole KV pool) fails alone: with return_errors its entry is the ColibriError,
        otherwise the first such error is raised after the others finish; the others wait for room.
        Each entry is a Generation (generate()'s: the ids and their finish_reason)."""
        prompts = self._check_prompts(prompts)
        return_errors = sampling.flag("return_errors", return_errors)
        priority = extra.pop("priority", 0)
        reqs = self._submit(prompts, priority, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos, **extra)
        outs, errors = [Generation() for _ in reqs], [None] * len(reqs)
        try:
            for i, r in enumerate(reqs):
                for ev in r.iter_events():
                    if ev.kind == TOKEN:
                        outs[i].append(ev.token)
                    elif ev.kind == DONE:
                        outs[i].finish_reason = ev.reason
                    elif ev.kind == ERROR:
                        errors[i] = ev.error
        finally:
            for r in reqs:
                r.cancel()
        if not return_errors:
            for e in errors:
                if e is not None:
                    raise e
            return outs
        return [e if e is not None else o for o, e in zip(outs, errors)]

    # -- introspection ----------------------------------------------------------------------
    @property
    def expert_counts(self) -> np.ndarray:
        """Tokens routed to each expert so far: [num_layers, experts_per_layer] (counted on the backend,
        graph replays included)."""
        return self.runner.expert_counts()

    @property
    def slot_choice(self) -> dict | None:
        """What expert_slots="auto" chose and why ({"slots": N or None (all resident), "why": the
        numbers}); None when the slot count was given."""
        return self.runner.slot_choice

    @property
    def slot_stats(self) -> dict | None:
        """Expert slot pool counters (hits, misses, prefetch_hits, bytes_loaded, evictions, hit_rate),
        or None when every expert is resident."""
        pool = self.runner.slot_pool
        return None if pool is None else pool.stats()

    def trace_meta(self) -> dict:
        from ..analysis.sizing import kv_window_bytes, state_bytes_per_sequence, summary
        c, s = self.config, summary(self.model, 1, kv_dtype=self.kv_dtype)
        return {"model": self.path, "model_type": c["model_type"], "backend": self.backend.name,
                "top_k": self.runner.top_k, "experts_per_layer": c["experts_per_layer"],
                "bytes_per_expert": s["bytes_per_expert"], "num_hidden_layers": c["num_hidden_layers"],
                "non_expert_bytes": s["non_expert_bytes"], "expert_bytes": s["expert_bytes"],
                "bytes_per_decoded_token": s["bytes_per_decoded_token"], "kv_bytes_per_token": s["kv_bytes_per_token"],
                "kv_window_bytes_per_sequence": kv_window_bytes(c, self.runner.states.paged[0].block_size,
                                                                self.kv_dtype),
                "state_bytes_per_sequence": state_bytes_per_sequence(c),
                "scratch_bytes": self.runner.arena_bytes}

    def trace(self, prompts, max_new_tokens=0, **gen):
        """Run prompts (token id lists or strings) and return the routing Trace of every step
        (prefill, and decode when max_new_tokens > 0). The trace's seq_ids are the prompts' indices
        (other requests running meanwhile are traced too, as len(prompts) + their sequence id)."""
        from ..analysis.trace import TraceRecorder
        self._check_open()
        prompts = self._check_prompts(prompts)
        rec = TraceRecorder(self.runner, self.trace_meta())
        self._core.call(lambda: self.runner.hooks.append(rec))      # steps of concurrent requests are traced too
        reqs = []
        try:
            if max_new_tokens > 0:
                priority = gen.pop("priority", 0)
                reqs = self._submit(prompts, priority, max_new_tokens=max_new_tokens, **gen)
                try:
                    for r in reqs:
                        for ev in r.iter_events():
                            if ev.kind == ERROR:
                                raise ev.error
                finally:
                    for r in reqs:
                        r.cancel()
            else:
                self._score([self._prompt_ids(p) for p in prompts], made=reqs)
        finally:
            self._core.call(lambda: self.runner.hooks.remove(rec))
        return rec.trace({r: i for i, r in enumerate(reqs)})

    @property
    def kv_free_blocks(self) -> int:
        return self.runner.pool.free_blocks
