"""Choosing the next token from logits: greedy at temperature 0, else temperature / top-k / top-p;
and the checks of every sampling and generation argument (type and range, before anything runs)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from .errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

MAX_STOPS, MAX_STOP_CHARS = 64, 4096


def _bad(name, value, want):
    return ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={value!r:.80}: {want}")


def real(name, value, lo, hi, lo_open=False):
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise _bad(name, value, f"expected a number in {'(' if lo_open else '['}{lo}, {hi}]")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, value, f"expected a finite number in {'(' if lo_open else '['}{lo}, {hi}]")
    return v


def integer(name, value, lo, hi):
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise _bad(name, value, f"expected an integer in [{lo}, {hi}]")
    if not lo <= int(value) <= hi:
        raise _bad(name, value, f"expected an integer in [{lo}, {hi}]")
    return int(value)


def flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise _bad(name, value, "expected True or False")
    return bool(value)


def check_params(temperature, top_p, top_k):
    """-> (temperature, top_p, top_k) as float, float, int: temperature >= 0 (0 is greedy),
    top_p in (0, 1], top_k >= 0 (0 disables it)."""
    return (real("temperature", temperature, 0.0, 1e6), real("top_p", top_p, 0.0, 1.0, lo_open=True),
            integer("top_k", top_k, 0, 1 << 31))


def check_generation(max_new_tokens, seed, stop, ignore_eos) -> tuple:
    """-> (max_new_tokens, seed, stop strings, ignore_eos), each checked."""
    n = integer("max_new_tokens", max_new_tokens, 0, 1 << 24)
    if seed is not None:
        seed = integer("seed", seed, 0, (1 << 63) - 1)
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
    else:
        raise _bad("stop", stop, "expected a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", stop, f"at most {MAX_STOPS} stop strings")
    for s in stops:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise _bad("stop", stop, f"every stop string must be a non-empty string of at most {MAX_STOP_CHARS} "
                       "characters")
    return n, seed, stops, flag("ignore_eos", ignore_eos)


def sample(logits: np.ndarray, temperature: float, top_p: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))         # ties to the lower id, like torch.argmax
    z = logits.astype(np.float64) / temperature
    if top_k and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(csum, top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.size, p=p))
