"""The C interface's Python half: what libcolibri.so's exported functions do (toolchains/capi).

libcolibri.so is built with cffi's embedding mode (toolchains/capi/build_capi.py): the library starts
an interpreter on its first call, imports this module and forwards each C call here, after turning
pointers into NumPy views. Everything a caller can get wrong is decided here, so it is tested from
Python and from C alike (tests/test_capi.py).

Handles. A C caller holds `colibri_engine_t *`, an opaque pointer; here it is a small integer (the
pointer's value) looked up in a table, never dereferenced, so a destroyed, forged or NULL handle is
COLIBRI_ERR_INVALID_ARGUMENT, never a crash. Handles are not reused within a process.

Errors. Every function returns DESIGN.md's codes (COLIBRI_OK = 0, negative on failure) and records
the calling thread's last failure (code and message: `colibri_last_error`). A failure inside the
engine that is not a ColibriError is reported as COLIBRI_ERR_BACKEND with its type and message.

Threads. cffi takes the GIL for each call; an Engine is shared by any number of threads (its request
core runs the steps), so two threads may call one engine, and two engines run side by side.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from ..errors import (ColibriError, COLIBRI_OK, COLIBRI_ERR_BACKEND, COLIBRI_ERR_INVALID_ARGUMENT)

_engines: dict = {}                    # handle -> Engine
_lock = threading.Lock()
_next = itertools.count(0x1000)        # handles start well above NULL and small integers
_tls = threading.local()               # the calling thread's last failure


def last_error() -> tuple:
    """(code, message) of the calling thread's last failure; (0, "") when none."""
    return getattr(_tls, "code", COLIBRI_OK), getattr(_tls, "message", "")


def _fail(code: int, message: str) -> int:
    _tls.code, _tls.message = int(code), str(message)
    return int(code)


def guarded(fn):
    """Run fn() -> return code; a ColibriError (or anything else) becomes a code and a message."""
    try:
        out = fn()
        return COLIBRI_OK if out is None else out
    except ColibriError as e:
        return _fail(e.code, e.message)
    except Exception as e:                          # noqa: BLE001  an internal failure, reported not raised
        return _fail(COLIBRI_ERR_BACKEND, f"internal failure: {type(e).__name__}: {e}")


def _engine(handle: int):
    with _lock:
        eng = _engines.get(int(handle))
    if eng is None:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"engine handle {int(handle):#x} is not open (NULL, "
                           "destroyed, or never returned by colibri_init): pass a handle from colibri_init")
    return eng


def _positive(name: str, v: int, what: str):
    if v < 1:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={v}: {what} must be at least 1")


def init(model_path: str | None, backend: str | None, max_seq_len: int, max_batch: int, num_experts: int,
         top_k: int) -> int:
    """-> a handle (> 0), or a negative code. 0 in max_seq_len / max_batch / top_k: the defaults (the
    model's context, 8, the model's experts per token); top_k otherwise routes each token to that many
    experts (Engine.open(top_k=...)); num_experts other than 0 is a check against the model, refused
    with both numbers when they differ."""
    from ..requests.engine import Engine

    def run():
        if not model_path:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "config->model_path is NULL or empty: give the "
                               "model directory (colibri convert writes one)")
        for name, v in (("max_seq_len", max_seq_len), ("max_batch", max_batch), ("num_experts", num_experts),
                        ("top_k", top_k)):
            if v < 0:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"config->{name}={v}: use 0 for the default "
                                   "or a positive value")
        kw = {}
        if max_seq_len:
            kw["max_seq_len"] = int(max_seq_len)
        if max_batch:
            kw["max_batch"] = int(max_batch)
        if top_k:
            kw["top_k"] = int(top_k)
        eng = Engine.open(model_path, backend=backend or None, **kw)
        try:
            have = eng.config["experts_per_layer"]
            if num_experts and num_experts != have:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"config->num_experts={num_experts}, but {model_path} "
                                   f"has num_experts={have}: set 0 to take the model's, or open the model you meant")
        except BaseException:
            eng.close()
            raise
        with _lock:
            h = next(_next)
            _engines[h] = eng
        return h
    return guarded(run)


def destroy(handle: int) -> int:
    def run():
        with _lock:
            eng = _engines.pop(int(handle), None)
        if eng is None:
            _engine(handle)                         # raises the not-open error
        eng.close()
    return guarded(run)


def vocab_size(handle: int) -> int:
    return guarded(lambda: int(_engine(handle).config["vocab_size"]))


def infer(handle: int, ids, logits, batch: int, seq: int) -> int:
    """ids: int32 [batch * seq] (a view of the caller's memory), logits: float32 [batch * seq * vocab],
    written. None stands for a NULL pointer. Either may be a function of its element count returning
    the view (the library makes its views once the handle and the sizes have been checked)."""
    def run():
        nonlocal ids, logits
        eng = _engine(handle)
        _positive("batch", batch, "the batch")
        _positive("seq", seq, "the sequence length")
        if callable(ids):
            ids = ids(batch * seq)
        if callable(logits):
            logits = logits(batch * seq * int(eng.config["vocab_size"]))
        if ids is None or logits is None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{'input_ids' if ids is None else 'logits'} is NULL: "
                               "pass buffers of batch * seq int32 ids and batch * seq * vocab floats")
        out = eng.infer(ids.reshape(batch, seq))
        logits.reshape(out.shape)[...] = out
    return guarded(run)


def generate(handle: int, prompt: np.ndarray | None, prompt_len: int, max_new_tokens: int, temperature: float,
             top_p: float, top_k: int, seed: int, ignore_eos: int, out: np.ndarray | None, capacity: int,
             count: list) -> int:
    """prompt: int32 [prompt_len]; out: int32 [capacity], written with the generated ids (an end-of-
    sequence id included, as Engine.generate); count[0] set to how many. seed < 0: unseeded."""
    def run():
        eng = _engine(handle)
        _positive("prompt_len", prompt_len, "the prompt")
        if prompt is None or out is None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{'prompt' if prompt is None else 'out_ids'} is NULL")
        if capacity < max_new_tokens:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"out_capacity={capacity} is less than "
                               f"max_new_tokens={max_new_tokens}: give room for every token it may make")
        got = eng.generate(prompt.tolist(), max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, seed=None if seed < 0 else int(seed), ignore_eos=bool(ignore_eos))
        out[:len(got)] = got
        count[0] = len(got)
    return guarded(run)
