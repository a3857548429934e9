"""The request core: continuous batching behind the Engine (DESIGN.md, "Requests").

One thread (the core's) owns the runner and runs every step; callers submit Requests and read each
one's events from its own queue, so a caller that stops reading blocks nobody. Each step packs, in
this order (vLLM's engine core, reduced to what an edge device needs):

    1. every running request that has a sampled token waiting: one decode token each;
    2. prefill chunks of running requests not yet prefilled, oldest first, under the token budget:
       prefill_chunk tokens (and the arena's rows less the decode tokens), and, while requests
       decode, no more than keeps the step within a multiple of a decode step:
           cost(D + P) <= cost(D) * (1 + 0.9 * max(interleave - 1, prefilling / D))
       (D decode tokens, P prefill tokens, cost: StepCost, the step time measured by token count;
       prefilling: requests whose prompt is not yet prefilled), so a long prompt is prefilled a chunk
       per step while the live streams keep their pace, and when more requests wait for their
       prompts than stream, the prefill part gets their share of the step (interleave=0: no cap);
    3. waiting requests are admitted first (highest priority, then submission order; strictly in
       that order: a later small request never overtakes an earlier large one) while there is a
       batch slot and their whole context can be reserved; otherwise they wait.

Running out of KV blocks during decode preempts the most recently admitted running request: its
blocks are freed and it waits again at the head of its priority, its context (prompt + tokens
generated so far) to be recomputed by prefill when it is readmitted (vLLM's recompute policy). Only a
request that can never fit (a context larger than the whole pool, or the pool exhausted while it runs
alone) fails, alone, with COLIBRI_ERR_OUT_OF_MEMORY. Cancelled requests leave at the next step, their
blocks back in the pool. Between steps the core runs jobs (Engine.infer, trace hooks) on its thread.

core_thread=False (COLIBRI_CORE_THREAD=0): no core thread; whichever caller waits for a result runs
the next step under the core's step lock (leader and followers), so the steps run on the callers'
threads: for tools that cannot run on another thread (Oclgrind's uninitialised-value checker crashes
off the main thread), and single-threaded programs. Not for AsyncEngine (it would block the loop).

Every request carries its own SamplingParams and its own RNG (np.random.default_rng([seed, index]):
index 0 for generate(), the prompt's position for generate_batch(seed=s)), so a seeded request's
tokens do not depend on its neighbours.
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from . import sampling
from ..runtime.state import DELTA_CHUNK, block_hashes
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE, nonfinite

STALE_STEPS = 32       # a StepCost bucket unmeasured for this many steps is replaced by its next measurement


class StepCost:
    """A step's wall time as a function of the tokens it carries, learnt from the steps run.

    Per bucket of the token count n (powers of two) an exponential average of (n, seconds); between
    the buckets' points, linear interpolation; below the smallest, its time; beyond the largest point
    n_L, its time up to 2 n_L (so the frontier doubles as steps measure it) and proportional to n past
    that. Why a curve and not `seconds per token`: in an MoE step a few extra tokens cost nearly a whole
    step (each wakes experts whose weights must be read) while at 16 tokens every expert is awake and
    a token costs little, so a per-token cost measured on any one size is wrong at every other (the
    linear model shrank chunks to 1-2 tokens, 4 clients: TTFT 4 s); and every step, mixed or not,
    updates the curve, so it never goes stale as the batch grows (a decode-step time measured at 1
    stream held 16 arrivals at 4 prefill tokens a step, TTFT 7 s)."""

    def __init__(self, max_rows: int):
        k = max(int(max_rows), 1).bit_length() + 1
        self.n = np.zeros(k)
        self.t = np.zeros(k)
        self.seen = np.zeros(k, bool)
        self.age = np.zeros(k, np.int64)        # steps since each bucket was last measured

    def bucket(self, n: int) -> int:
        return min(int(n).bit_length() - 1, len(self.n) - 1)

    def add(self, n: int, seconds: float):
        k = self.bucket(n)
        stale = self.age[k] >= STALE_STEPS
        self.age += 1
        self.age[k] = 0
        if not self.seen[k] or stale:           # a point not measured for a while: replaced, not averaged
            self.n[k], self.t[k], self.seen[k] = n, seconds, True
        else:
            self.n[k] = 0.8 * self.n[k] + 0.2 * n
            self.t[k] = 0.8 * self.t[k] + 0.2 * seconds

    def __call__(self, n):
        """Predicted seconds of steps of n tokens (n: an int or an array); None before any step."""
        if not self.seen.any():
            return None
        xs, ts = self.n[self.seen], self.t[self.seen]
        n = np.asarray(n, np.float64)
        beyond = np.where(n <= 2 * xs[-1], ts[-1], ts[-1] * n / (2 * xs[-1]))
        return np.where(n > xs[-1], beyond, np.interp(n, xs, ts))


DONE = "done"
TOKEN = "token"
ERROR = "error"
RETRY = object()           # a job's answer: run me again after the next step
SETTLE = "settle"          # Request.score of a finished reply's re-prefill (Core._settle)
SETTLE_PRIORITY = -(1 << 62)
CORE_STACK_BYTES = 64 << 20


@dataclass
class Event:
    kind: str               # TOKEN, ERROR or DONE
    token: int = -1
    error: ColibriError | None = None
    logprob: float | None = None    # of the chosen token (when the request asked for logprobs)
    top_logprobs: list | None = None  # [(token, logprob)] * top_logprobs, best first (when asked for)
    reason: str = ""                # DONE: "stop" (eos / stop string), "length", "cancelled"
    logits: np.ndarray | None = None  # DONE of a scoring request: float32 [len(prompt), V]
    t: float = 0.0                  # time.perf_counter() when the core emitted it

    @property
    def top(self) -> list | None:
        """The old name of top_logprobs (serving/serve.py still reads it); new code: top_logprobs."""
        return self.top_logprobs


def text_piece(dec, ev: Event) -> str:
    """The text a stream shows for one event: the StreamDecoder's piece of a TOKEN ("" when it
    completes no character), the error of an ERROR raised, "" otherwise."""
    if ev.kind == ERROR:
        raise ev.error
    return dec.push(ev.token) if ev.kind == TOKEN else ""


class Request:
    """A prompt, its sampling parameters and RNG, and the queue its events go to."""
    _ids = itertools.count(1)

    def __init__(self, prompt: np.ndarray, params: "sampling.SamplingParams", priority: int = 0, index: int = 0,
                 notify=None):
        self.id = next(Request._ids)
        self.prompt = prompt
        self.params = params
        self.priority = int(priority)
        self.rng = np.random.default_rng(None if params.seed is None else [params.seed, index])
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.core = None                # set by Core.submit (inline cores step from iter_events)
        self.notify = notify            # called (from the core thread) after each event: asyncio bridges
        self.cancelled = False
        self.finished = False
        self.finish_no = -1             # the order the core finished requests in
        # core-side state
        self.ctx = prompt               # tokens to hold in the cache: the prompt, or prompt + produced
        self.pos = 0                    # ctx tokens prefilled so far
        self.pending = None             # a sampled token not yet fed
        self.produced: list = []
        self.counts: dict = {}          # generated token -> times (presence / frequency penalties)
        self.seq = None
        self.parent = None              # n > 1: the request whose prefilled prompt this one shares
        self.shared = 0                 # positions it took from the parent (not prefilled itself)
        self.cached_tokens = 0          # prompt positions found in the prefix cache (not prefilled)
        self.constraint = None          # constrain.Constraint: the grammar its output follows
        self.hashes: list = []          # prefix hashes of its sequence's whole blocks (published)
        self.order = 0                  # submission order (the core's)
        self.admitted = 0.0
        self.first_token_at = None
        # "hidden" (Engine.embed): every prompt token's final-normed hidden state instead of its logits
        self.adapter = None             # its LoRA adapter (runtime/lora.Loaded), or None: the base model
        self.score = False              # a scoring request (Engine.infer / trace): every prompt token's
        self.chunks: list = []          # logits, gathered chunk by chunk; it finishes when the prompt is in
        self.draft = None               # draft.DraftState: speculative decoding (None: off)
        self.refeed: list = []          # produced tokens a rejected draft rolled out of a recurrent state:
                                        # fed again, before the pending one, by the next step

    @property
    def hash_seed(self) -> bytes:
        """Its prefix-cache blocks' key: the base model's, or its adapter's (never shared across them)."""
        return b"colibri-kv" if self.adapter is None else self.adapter.hash_seed

    def cancel(self):
        """Leave at the next step (blocks back in the pool); the request's stream ends."""
        self.cancelled = True

    def _emit(self, ev: Event):
        ev.t = time.perf_counter()
        self.events.put(ev)
        if self.notify is not None:
            try:
                self.notify()
            except Exception:           # noqa: BLE001  a caller's callback never stops the core
                self.notify = None

    def iter_events(self, timeout=None):
        """Events until DONE or ERROR (inclusive)."""
        while True:
            if self.core is not None and self.core.inline:
                while self.events.empty():
                    self.core.run_once()
            ev = self.events.get(timeout=timeout)
            yield ev
            if ev.kind in (DONE, ERROR):
                return


class Core:
    """The step thread and its queues (see the module docstring)."""

    def __init__(self, engine, max_queue: int = 1024, inline: bool = False):
        self.e = engine
        self.inline = bool(inline)
        self.step_lock = threading.RLock()
        self.max_queue = int(max_queue)
        self.cond = threading.Condition()
        self.waiting: list = []            # sorted by (-priority, order)
        self.running: list = []            # admission order
        self.jobs: collections.deque = collections.deque()
        self._order = itertools.count()
        self._finished = itertools.count()
        self._closing = False
        self.thread = None
        self.preemptions = 0
        self.settles = 0                   # replies re-prefilled for their snapshot (_settle)
        self.cost = StepCost(engine.runner.max_rows)     # seconds per step by its token count
        from .draft import Realized
        self.realized = Realized()                          # drafting's tokens/s against plain decode's
        self.head_cost = None                               # seconds of one run of the MTP head (decode rows)

    # -- callers' side ------------------------------------------------------------------------
    def _start(self):
        if self.thread is None and not self.inline:
            # the steps run on this thread: give it the stack a main thread has (a kernel interpreter
            # such as Oclgrind, or a deep native call, would overflow a default thread stack)
            old = threading.stack_size()
            try:
                threading.stack_size(CORE_STACK_BYTES)
                self.thread = threading.Thread(target=self._loop, name="colibri-core", daemon=True)
                self.thread.start()
            finally:
                threading.stack_size(old)

    def submit(self, reqs):
        """Queue requests together (one step can take all of them); refuses them all when the queue
        cannot take them."""
        with self.cond:
            if self._closing:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "engine is closed; open a new one")
            if len(self.waiting) + len(reqs) > self.max_queue:
                raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the request queue is full ({len(self.waiting)} waiting, "
                                   f"max_queue={self.max_queue}); retry when requests finish, or open the engine "
                                   "with a larger max_queue")
            for r in reqs:
                r.order = next(self._order)
                r.core = self
                self.waiting.append(r)
            self.waiting.sort(key=lambda r: (-r.priority, r.order))
            self._start()
            self.cond.notify_all()

    def call(self, fn):
        """Run fn() on the core thread between steps; returns its result (or raises its error). fn may
        return RETRY: it runs again after the next step (it waits for room)."""
        if threading.current_thread() is self.thread or self.inline:
            with self.step_lock:
                self._reap()
                while True:
                    out = fn()
                    if out is not RETRY:
                        return out
                    if not (self.running or self.waiting):
                        raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, "the KV pool cannot hold the input even "
                                           "when idle; open the engine with a larger kv_cache_tokens")
                    self._guarded_step()
        box = {}
        done = threading.Event()
        with self.cond:
            if self._closing:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "engine is closed; open a new one")
            self.jobs.append((fn, box, done))
            self._start()
            self.cond.notify_all()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self):
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        if self.inline:
            with self.step_lock:
                self._fail_all()

    def run_once(self):
        """(inline cores) one step, by whichever caller gets the step lock first; the others find
        their events when they get it."""
        with self.step_lock:
            if self._closing:
                self._fail_all()
            elif self.waiting or self.running:
                self._guarded_step()

    def _guarded_step(self):
        try:
            self._step()
        except BaseException as e:          # noqa: BLE001  a backend failure ends the requests in the step
            err = e if isinstance(e, ColibriError) else ColibriError(
                COLIBRI_ERR_INVALID_ARGUMENT, f"step failed: {type(e).__name__}: {e}")
            for r in list(self.running):
                self._finish(r, error=err)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the core thread ----------------------------------------------------------------------
    def _loop(self):
        while True:
            with self.cond:
                while not (self.jobs or self.waiting or self.running or self._closing):
                    self.cond.wait()
                if self._closing:
                    break
                jobs = list(self.jobs)
                self.jobs.clear()
            retry = []
            for fn, box, done in jobs:
                try:
                    out = fn()
                except BaseException as e:          # handed to the caller, who raises it
                    box["error"] = e
                    done.set()
                    continue
                if out is RETRY and (self.running or self.waiting):
                    retry.append((fn, box, done))
                elif out is RETRY:                  # nothing will free room: the job must fail itself
                    box["error"] = ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, "the KV pool cannot hold the input "
                                                "even when idle; open the engine with a larger kv_cache_tokens")
                    done.set()
                else:
                    box["value"] = out
                    done.set()
            if self.waiting or self.running:
                self._guarded_step()
            with self.cond:
                self.jobs.extendleft(reversed(retry))
        self._fail_all()

    def _fail_all(self):
        closed = ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "the engine was closed while the request ran")
        for r in list(self.running) + list(self.waiting):
            self._finish(r, error=closed)
        for fn, box, done in list(self.jobs):
            box["error"] = closed
            done.set()
        self.jobs.clear()

    def _finish(self, r: Request, error=None, reason="stop", logits=None):
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            with self.cond:
                self.waiting.remove(r)
        if r.seq is not None:
            self.e.runner.free(r.seq)
            r.seq = None
        r.finished = True
        r.finish_no = next(self._finished)
        if r.draft is not None and r.draft.memory is not None and error is None and r.produced:
            r.draft.memory.add(r.draft.seq + r.produced[len(r.draft.seq) - len(r.prompt):])
        r.chunks = []
        if error is None and reason in ("stop", "length") and not r.score and len(r.produced) > 1 \
                and self.e.settle_replies:
            self._settle(r)                              # queued before the caller hears of the end
        r._emit(Event(ERROR, error=error) if error is not None else Event(DONE, reason=reason, logits=logits))

    def _settle(self, r: Request):
        """(Engine.open(settle_replies=True); serve's default) A finished request of a model with
        recurrent layers: its reply's state was built token by token (decode), which a later prefill
        would not reproduce bit for bit, so no snapshot covers it. Queue, at the lowest priority, a
        prefill of the tokens the sequence held (prompt + reply but the last token, never fed) that
        resumes from the prompt's snapshot and leaves one at the reply's last multiple of the snapshot
        alignment, its KV blocks replacing decode's: the conversation's next turn then resumes after
        the reply, and answers as a fresh engine does. It runs after the request's end (the engine is
        busy meanwhile), when nothing of higher priority waits; a next turn that comes first resumes
        from the prompt's snapshot."""
        states = self.e.runner.states
        snap = states.snapshots
        if snap is None or not states.fixed or not states.prefix_block or self._closing or self.e.runner.hooks:
            return
        fed = np.concatenate([np.asarray(r.prompt, np.int32), np.asarray(r.produced[:-1], np.int32)])
        A = snap.align
        if (len(fed) - 1) // A <= (len(r.prompt) - 1) // A:
            return                                       # no snapshot point inside the reply
        w = Request(fed, r.params, priority=SETTLE_PRIORITY)
        w.score, w.adapter = SETTLE, r.adapter
        with self.cond:
            w.order, w.core = next(self._order), self
            self.waiting.append(w)
            self.waiting.sort(key=lambda q: (-q.priority, q.order))
        self.settles += 1

    def _fits_ever(self, r: Request, tokens: int) -> str | None:
        """Why `tokens` positions can never be held (the whole pool, or max_seq_len), or None."""
        e = self.e
        if tokens > e.max_seq_len:
            return (f"a context of {tokens} tokens is longer than max_seq_len={e.max_seq_len}; open the engine "
                    "with a larger max_seq_len or shorten the input")
        for p in e.runner.states.paged:
            need = -(-tokens // p.block_size)
            if need > p.num_blocks:
                return (f"a context of {tokens} tokens needs {need} blocks of {p.block_size}, more than the whole "
                        f"{p.name} pool ({p.num_blocks} blocks); open the engine with a larger kv_cache_tokens")
        return None

    def _admit(self):
        e = self.e
        while self.waiting and len(self.running) < e.max_batch:
            r = self.waiting[0]
            if r.cancelled:
                self._finish(r, reason="cancelled")
                continue
            why = self._fits_ever(r, len(r.ctx))
            if why is not None:
                self._finish(r, error=ColibriError(COLIBRI_ERR_OUT_OF_MEMORY if "pool" in why
                                                   else COLIBRI_ERR_INVALID_ARGUMENT, why))
                continue
            p = r.parent
            if p is not None and not p.finished and (p in self.waiting or (p.seq is not None and p.pos < len(p.ctx))):
                break                                   # its parent's prompt is not prefilled yet: wait for it
            seq = e._new_seq()
            seq.owner = r
            seq.adapter = None if r.adapter is None else r.adapter.name
            start = 0
            if p is not None and p.seq is not None and r.ctx is r.prompt and p.pos >= len(p.ctx) >= len(r.ctx):
                # share the parent's whole blocks below the last prompt token (which this one computes
                # itself, for its own first logits): n samples of one prompt, one prefill
                start = e.runner.states.share_prefix(p.seq, seq, len(r.ctx) - 1)
            shared, states = start, e.runner.states
            if not start and states.prefix_block and r.score in (False, SETTLE) and not e.runner.hooks:
                # the longest cached prefix of whole blocks, short of the last token (whose logits
                # this request computes itself); not while hooks watch every token (traces, tests)
                B = states.prefix_block
                hashes = block_hashes(r.ctx, B, upto=(len(r.ctx) - 1) // B, seed=r.hash_seed)
                start = states.adopt_prefix(seq, hashes)
                r.hashes = hashes[:start // B]
                if not r.produced:
                    r.cached_tokens = start
            try:
                e.runner.reserve(seq, len(r.ctx) - start)
            except ColibriError as err:
                e.runner.free(seq)
                if err.code != COLIBRI_ERR_OUT_OF_MEMORY:
                    self._finish(r, error=err)
                    continue
                break                                   # waits (strictly in order) until blocks free
            e.runner.restore(seq)                       # a recurrent state resumes from its snapshot
            if not r.produced and not r.score and p is None:
                e.stats.prompt_tokens += len(r.ctx)
                e.stats.cached_tokens += r.cached_tokens
            with self.cond:
                self.waiting.pop(0)
            r.seq, r.pos, r.shared, r.admitted = seq, start, shared, time.perf_counter()
            self.running.append(r)

    def _preempt(self, need: Request) -> bool:
        """Free the newest running request's blocks for `need`; it waits to be recomputed. False when
        `need` runs alone (nothing to take from)."""
        victims = [r for r in self.running if r is not need]
        if not victims:
            return False
        v = victims[-1]
        self.running.remove(v)
        self.e.runner.free(v.seq)
        v.seq = None
        if v.pending is not None:                  # emitted, not yet fed: it becomes part of the context
            v.produced.append(v.pending)
            v.counts[v.pending] = v.counts.get(v.pending, 0) + 1
        v.ctx = np.concatenate([v.prompt, np.asarray(v.produced, np.int32)]) if v.produced else v.prompt
        v.pos, v.pending, v.refeed = 0, None, []
        v.hashes = []
        v.chunks.clear()
        with self.cond:
            self.waiting.append(v)
            self.waiting.sort(key=lambda r: (-r.priority, r.order))
        self.preemptions += 1
        return True

    def _reap(self):
        """Cancelled requests leave (their blocks back in the pool)."""
        for r in [r for r in self.running + self.waiting if r.cancelled]:
            self._finish(r, reason="cancelled")

    def _step(self):
        e = self.e
        runner = e.runner
        self._reap()
        self._admit()
        if not self.running:
            return
        # 1. decode tokens: each one needs room for one more position (or preempts)
        decode = []
        for r in list(self.running):
            if r.pending is None or r not in self.running:
                continue
            while True:
                try:
                    runner.reserve(r.seq, 1 + len(r.refeed))
                    decode.append(r)
                    break
                except ColibriError as err:
                    if err.code != COLIBRI_ERR_OUT_OF_MEMORY:
                        self._finish(r, error=err)
                        break
                    if not self._preempt(r):
                        self._finish(r, error=ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, f"{err.message} (the request "
                                     "runs alone: the pool cannot hold its context)"))
                        break
        decode = [r for r in decode if r in self.running]
        recurrent = bool(runner.states.fixed)
        feeds = {id(r): r.refeed + [r.pending] for r in decode}
        drafts = self._drafts(decode, feeds, recurrent) if decode else {}
        for r in decode:
            feeds[id(r)] += drafts.get(id(r), [])
        ndec_tok = sum(len(f) for f in feeds.values())
        # a recurrent layer verifies token by token (its decode arithmetic, so drafting changes no token);
        # such a step carries no prefill chunk (those run the chunked form)
        stepwise = recurrent and ndec_tok > len(decode)
        # 2. prefill chunks under the token budget
        budget = 0 if stepwise else min(runner.max_rows - ndec_tok, e.prefill_chunk)
        t_dec = self.cost(len(decode)) if decode and e.interleave > 0 and budget > 1 else None
        if t_dec is not None:
            # the prefill part may take (interleave - 1) decode steps, or, when more requests wait for
            # their prompts than stream, their share: prefill time : decode time = prefilling : decoding
            # (16 clients arriving together, bench model: 3.6 -> 15 decode tokens a step, 74 -> 140 tok/s)
            prefilling = sum(1 for r in self.running if r.pending is None and r.pos < len(r.ctx))
            share = max(e.interleave - 1, prefilling / len(decode))
            fits = self.cost(np.arange(len(decode) + 1, len(decode) + budget + 1)) <= t_dec * (1 + 0.9 * share)
            budget = max(1, int(np.argmin(fits)) if not fits.all() else budget)   # 0.9: a margin for noise
        entries = [(r.seq, feeds[id(r)]) for r in decode]
        owners = [(r, True) for r in decode]
        for r in sorted(self.running, key=lambda q: q.score == SETTLE):     # re-prefills of replies last
            if r.pending is not None or r.pos >= len(r.ctx) or budget <= 0 or len(entries) >= e.max_batch:
                continue
            n = min(budget, len(r.ctx) - r.pos)
            if recurrent and DELTA_CHUNK <= n < len(r.ctx) - r.pos:
                # a recurrent layer's prefill runs the delta rule in chunks of 16 from where the step
                # starts: chunks that end on multiples of 16 keep a prompt's state independent of how
                # steps are packed (bit for bit as a fresh engine's, and as its snapshots assume)
                n -= (r.pos + n) % DELTA_CHUNK
            # (a scoring request is not cut: its chunks are what the caller's hooks see)
            cut = runner.states.snapshot_point(r.pos, len(r.ctx)) if r.score in (False, SETTLE) else 0
            if cut and cut < r.pos + n:
                n = cut - r.pos                          # the chunk ends where a snapshot is taken
            entries.append((r.seq, r.ctx[r.pos:r.pos + n]))
            owners.append((r, False))
            r.pos += n
            budget -= n
        if not entries:
            return
        # a scoring request's chunk wants the logits of every token it feeds, and so does a decode entry
        # verifying drafts (or feeding tokens again); every other entry its last
        scoring = [r.score in (True, "hidden") or (d and len(t) > 1) for (r, d), (_, t) in zip(owners, entries)]
        scoring = scoring if any(scoring) else False
        bases = [r.seq.cached for r in decode]
        firsts = [seq.cached for seq, _ in entries]      # each entry's first position (the MTP head's rows)
        if stepwise:
            for r in decode:
                if len(feeds[id(r)]) > 1 + len(r.refeed):
                    runner.keep_state(r.seq)             # the state to roll back to when a draft is rejected
        t0 = time.perf_counter()
        logits = e.backend.host_view(runner.step(entries, all_logits=scoring, stepwise=stepwise))
        hidden = e.backend.host_view(runner.hidden) if scoring and any(r.score == "hidden" for r, _ in owners) \
            else None
        dt = time.perf_counter() - t0
        ndec = len(decode)
        npre = sum(len(t) for _, t in entries[ndec:])
        self.cost.add(ndec_tok + npre, dt)
        settled = sum(len(t) for (r, _), (_, t) in zip(owners, entries) if r.score == SETTLE)
        e.stats.settle_tokens += settled
        npre -= settled
        if npre:
            e.stats.prefill_tokens += npre
            e.stats.prefill_seconds += dt if not ndec else dt * npre / (npre + ndec)
        # 3. sample: decode rows, and prefill chunks that completed their context
        row = 0
        B = runner.states.prefix_block
        emitted = 0
        for i, ((r, was_decode), (_, toks)) in enumerate(zip(owners, entries)):
            if was_decode and len(toks) > 1:             # drafts to verify, or tokens fed again
                emitted += self._verify(r, logits[row:row + len(toks)], toks, bases[i], recurrent)
                row += len(toks)
                continue
            emitted += was_decode
            if B and r.seq.cached // B > len(r.hashes):
                self._publish(r, was_decode)
                if not was_decode and runner.states.snapshots is not None:
                    self._snapshot(r)
            if r.score == SETTLE:                        # only its state matters: done once it is in
                row += 1
                if r.pos >= len(r.ctx):
                    self._finish(r, reason="stop")
                continue
            if r.score:                                  # keep the chunk's rows; done once the prompt is in
                r.chunks.append(np.array((hidden if r.score == "hidden" else logits)[row:row + len(toks)]))
                row += len(toks)
                if r.pos >= len(r.ctx):
                    self._finish(r, logits=np.concatenate(r.chunks))
                continue
            row += 1
            if was_decode:
                r.produced.append(r.pending)
                r.counts[r.pending] = r.counts.get(r.pending, 0) + 1
                r.pending = None
            elif r.pos < len(r.ctx):
                continue                                 # more of the prompt next step
            self._sample(r, logits[row - 1])
        if runner.mtp:
            dt += self._mtp(owners, entries, firsts)
        if ndec:
            e.stats.add_decode_step(dt, emitted, ndec)
            if not npre:
                self.realized.add(ndec_tok > ndec, emitted, dt)

    def _mtp(self, owners, entries, firsts) -> float:
        """The MTP head after a step (draft.MtpDrafter): for each request drafting with it, the head runs
        over the positions the step computed and kept whose next token is known (its KV at those
        positions; the model's hidden rows of this step are its input), and from the last of them chains
        the drafts of the tokens after the pending one: d1 from that row, then d_j+1 from (d_j, the
        head's own h') one position on. The chain's positions need KV blocks (reserved here; a sequence
        that cannot get them drafts fewer). -> seconds spent."""
        from .draft import MTP_PROBE, MtpDrafter
        runner = self.e.runner
        t0 = time.perf_counter()
        work, chains = [], []
        for (r, _), (seq, toks), p0 in zip(owners, entries, firsts):
            st = r.draft
            if st is None or not isinstance(st.drafter, MtpDrafter) or r.seq is not seq or r.finished or \
                    r.constraint is not None:           # (a request with a grammar never drafts)
                continue
            dr = st.drafter
            if dr.seq is not seq:                          # a new sequence (first step, or after preemption)
                dr.seq, dr.mtp_at = seq, 0
            if dr.chain == 0 and r.pending is not None:   # auto is not drafting: the head rests, and probes
                dr.idle += 1
                if dr.idle < MTP_PROBE:
                    continue
                dr.idle = 0
            known = self._known(r)
            end = min(p0 + len(toks), seq.cached + len(r.refeed), len(known) - 1)
            start = max(p0, dr.mtp_at)
            if start >= end:
                continue
            dr.mtp_at = end
            work.append((seq, start, known[start + 1:end + 1], runner.row_of[id(seq)] + np.arange(start - p0, end - p0)))
            chains.append((r, dr, end, len(known)))
        if not work:
            return 0.0
        host = self.e.backend.host_view
        first = host(runner.mtp_step(work)).argmax(axis=1)
        calls = 1
        live = []
        for (r, dr, end, n), d in zip(chains, first):
            dr.proposal, dr.at = [int(d)], n
            if r.pending is not None and r.constraint is None:        # decoding: it may draft next step
                want = r.draft.k if r.draft.mode == "mtp" else min(r.draft.k, max(dr.chain, 1))
                live.append((r, dr, end, want))
        for j in range(1, max((w for *_, w in live), default=1)):
            live = [c for c in live if c[3] > j and self._room(c[0].seq, c[2] + j)]
            if not live:
                break
            logits = host(runner.mtp_step([(c[0].seq, c[2] - 1 + j, [c[1].proposal[-1]], [i])
                                           for i, c in enumerate(live)]))
            calls += 1
            for c, d in zip(live, logits.argmax(axis=1)):
                c[1].proposal.append(int(d))
        dt = time.perf_counter() - t0
        if all(r.pending is not None for r, *_ in chains):      # decode rows only: a run's cost, for auto
            self.head_cost = dt / calls if self.head_cost is None else 0.8 * self.head_cost + 0.2 * dt / calls
        return dt

    def _room(self, seq, upto: int) -> bool:
        """seq holds KV blocks for positions < upto (reserved now when it can; False when it cannot)."""
        need = upto - seq.cached
        if need <= 0:
            return True
        try:
            self.e.runner.reserve(seq, need)
            return True
        except ColibriError:
            return False

    @staticmethod
    def _known(r: Request) -> np.ndarray:
        """r's tokens so far, by position: its context, the tokens produced past it, the pending one."""
        tail = r.produced[len(r.ctx) - len(r.prompt):] + ([r.pending] if r.pending is not None else [])
        return np.concatenate([r.ctx, np.asarray(tail, np.int32)]) if tail else np.asarray(r.ctx)

    def _drafts(self, decode: list, feeds: dict, recurrent: bool) -> dict:
        """The drafted tokens each decoding request verifies this step (draft.py): id(request) -> list.
        A request drafts when it asked to (draft != "off"), follows no grammar, has room for them (tokens
        left to generate, max_seq_len, KV blocks: a draft never preempts anyone) and, on a model with
        recurrent layers, no request waits for prefill (a verifying step carries no prefill chunk).
        "auto" sizes each draft by the step-cost curve and the request's acceptance (draft.choose_drafts)."""
        from .draft import MtpDrafter, choose_drafts
        e = self.e
        wants = []
        if recurrent and any(r.pending is None and r.seq is not None and r.pos < len(r.ctx) for r in self.running):
            return {}
        room = e.runner.max_rows - sum(len(f) for f in feeds.values())
        for r in decode:
            st = r.draft
            if st is None or r.constraint is not None:
                continue
            m = len(st.seq) - len(r.prompt)              # it has seen prompt + produced[:m]
            st.extend(r.produced[m:] + [r.pending])
            st.check_shadow()
            k = min(st.k, r.params.max_new_tokens - len(r.produced) - 2,
                    e.max_seq_len - r.seq.cached - len(feeds[id(r)]) - 1)
            prop = st.propose(k) if k > 0 else []
            if prop:
                wants.append((r, st, prop))
        if not wants:
            return {}
        if any(st.mode == "auto" for _, st, _ in wants):
            ks = choose_drafts(self.cost, sum(len(f) for f in feeds.values()), [(st, p) for _, st, p in wants],
                               self.realized, self.head_cost or 0.0)
        else:
            ks = [len(p) for _, _, p in wants]
        out = {}
        for (r, st, prop), k in zip(wants, ks):
            if isinstance(st.drafter, MtpDrafter) and st.mode == "auto":
                st.drafter.chain = min(st.k, k + 1) if k else 0    # one more than auto took; 0: the head rests
            if st.mode == "auto" and k == 0:
                st.shadow, st.shadow_at = list(prop), len(st.seq)   # checked once the tokens exist
                continue
            k = min(k, room)
            if k <= 0:
                continue
            try:
                e.runner.reserve(r.seq, len(feeds[id(r)]) + k)
            except ColibriError:
                continue                                 # no room for the drafts: this step decodes plainly
            out[id(r)] = prop[:k]
            room -= k
        return out

    def _verify(self, r: Request, rows, toks, base: int, recurrent: bool) -> int:
        """A decode entry of several tokens: r.refeed (fed again, logits unused), the pending token, then
        drafts. Row j of the pending token and drafts is sampled as a decode step would sample it (the
        same RNG draw, penalties, stops, logprobs); draft j is accepted when the model's token equals
        it, which for a proposal without a distribution (prompt lookup) is the speculative-sampling rule
        itself: accepted with probability p(d), else a token from p with d removed, renormalised. The
        first miss ends the run: its token becomes the pending one and the positions past it are rolled
        back (KV: the sequence's length; a recurrent state: restored from before the step, and the kept
        tokens fed again, token by token, by the next step). -> tokens emitted."""
        e, states = self.e, self.e.runner.states
        nref = len(r.refeed)
        drafts = list(toks[nref + 1:])
        k = len(drafts)
        r.refeed = []
        r.produced.append(r.pending)
        r.counts[r.pending] = r.counts.get(r.pending, 0) + 1
        r.pending = None
        B = states.prefix_block
        accepted, emitted = 0, 0
        for j in range(k + 1):
            r.seq.cached = base + nref + 1 + j
            if B and not recurrent and r.seq.cached // B > len(r.hashes):
                self._publish(r, False)
            d = drafts[j] if j < k else None
            self._sample(r, rows[nref + j])
            emitted += 1
            if r.finished or d is None or r.pending != d:
                break
            accepted += 1
            r.produced.append(d)
            r.counts[d] = r.counts.get(d, 0) + 1
            r.pending = None
        if k:
            e.stats.draft_proposed += k
            e.stats.draft_accepted += accepted
            e.stats.draft_steps += 1
            if r.draft is not None:
                r.draft.observe(k, accepted)
        if r.finished or r.seq is None:
            return emitted
        if recurrent and accepted < k:
            kept = list(toks[:nref + 1 + accepted])
            e.runner.restore_kept(r.seq)
            r.seq.cached = base
            r.refeed = kept
        else:
            r.seq.cached = base + nref + 1 + accepted
            if B and r.seq.cached // B > len(r.hashes):
                self._publish(r, False)
        return emitted

    def _publish(self, r: Request, was_decode: bool):
        """Name r's newly whole blocks by their prefix hashes (prefix caching). The sequence holds
        ctx[:pos] and then, once prefilled, the tokens decoded since (produced past those in ctx; the
        token this step fed is still `pending` when it was a decode step)."""
        fed = r.ctx[:r.pos]
        if r.pos >= len(r.ctx):
            tail = r.produced[len(r.ctx) - len(r.prompt):] + ([r.pending] if was_decode else [])
            if tail:
                fed = np.concatenate([r.ctx, np.asarray(tail, np.int32)])
        states = self.e.runner.states
        old = len(r.hashes)
        r.hashes = block_hashes(fed, states.prefix_block, r.hashes, upto=r.seq.cached // states.prefix_block,
                                seed=r.hash_seed)
        states.publish(r.seq, r.hashes, old, replace=r.score == SETTLE)

    def _snapshot(self, r: Request):
        """After a prefill chunk: r's recurrent state is kept when the chunk ended at a snapshot point
        (States.snapshot_point cut it there)."""
        states, n = self.e.runner.states, r.seq.cached
        if n % states.prefix_block == 0 and states.snapshot_point(n - 1, len(r.ctx)) == n:
            self.e.runner.snapshot(r.seq, r.hashes[n // states.prefix_block - 1])

    def _sample(self, r: Request, logits: np.ndarray):
        e = self.e
        p = r.params
        if not np.isfinite(logits.max()):
            self._finish(r, error=nonfinite(f"request {r.id} at position {r.seq.cached}"))
            return
        if r.constraint is not None:
            logits = r.constraint.masked(logits)         # what the grammar forbids at -inf
        tok, lp, top = sampling.sample_request(logits, p, r.prompt, r.produced, r.counts, r.rng)
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
            e.stats.first_token_seconds = r.first_token_at - r.admitted
        r._emit(Event(TOKEN, token=tok, logprob=lp, top_logprobs=top))
        n = len(r.produced) + 1
        # a stop string completed by the last token allowed is a "stop", as the OpenAI API reports it;
        # "length": max_new_tokens, or the context reached max_seq_len first (then fewer tokens)
        done = False
        if r.constraint is not None:
            try:
                done = r.constraint.consume(tok)         # the grammar complete: nothing more may follow
            except ColibriError as err:
                self._finish(r, error=err)
                return
        if tok in p.eos or done:
            r.produced.append(tok)
            self._finish(r, reason="stop")
        elif p.stops and any(s in e.codec.decode(r.produced[-63:] + [tok]) for s in p.stops):
            r.produced.append(tok)
            self._finish(r, reason="stop")
        elif n >= p.max_new_tokens or r.seq.cached + 1 > e.max_seq_len:
            r.produced.append(tok)
            self._finish(r, reason="length")
        else:
            r.pending = tok

