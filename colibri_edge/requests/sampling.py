"""Choosing the next token from logits: greedy at temperature 0, else temperature / top-k / top-p;
and the checks of every sampling and generation argument (type and range, before anything runs)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

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
    """Greedy at temperature 0 (ties to the lower id, like torch.argmax), else temperature, top-k, top-p."""
    if temperature == 0:
        return int(np.argmax(logits))
    return _sample_z(logits, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), rng)


# ----------------------------------------------------------------------------------------------
# per-request sampling (the request core)

MAX_LOGIT_BIAS = 1 << 16
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation parameters, checked (SamplingParams.make). The order of the logit
    processors is transformers' (and the OpenAI API's, for the penalties):
        z = logits + logit_bias
        z[t] = z[t] / r if z[t] > 0 else z[t] * r        every t in prompt + generated (repetition_penalty r)
        z[t] -= presence * (c[t] > 0) + frequency * c[t]  c: counts of the generated tokens
        temperature 0: argmax z (ties to the lower id); else z / temperature, then top-k, top-p,
        min-p (drop p < min_p * max p), sample
    logprobs: the chosen token's log-probability and the top_logprobs best, under the model's own
    distribution (log_softmax of the raw logits), as vLLM reports them."""
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()              # ((token, bias), ...)
    seed: int | None = None
    stops: tuple = ()
    eos: frozenset = frozenset()
    logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def make(cls, vocab: int, eos_ids, max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None,
             ignore_eos=False, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
             logit_bias=None, logprobs=False, top_logprobs=0) -> "SamplingParams":
        temperature, top_p, top_k = check_params(temperature, top_p, top_k)
        max_new_tokens, seed, stops, ignore_eos = check_generation(max_new_tokens, seed, stop, ignore_eos)
        bias = []
        if logit_bias is not None:
            if not isinstance(logit_bias, dict) or len(logit_bias) > MAX_LOGIT_BIAS:
                raise _bad("logit_bias", logit_bias, f"expected a dict of at most {MAX_LOGIT_BIAS} "
                           "{token id: bias in [-100, 100]}")
            for t, b in logit_bias.items():
                t = int(t) if isinstance(t, str) and t.lstrip("-").isdigit() else t     # JSON keys are strings
                bias.append((integer("logit_bias token", t, 0, vocab - 1), real("logit_bias value", b, -100.0, 100.0)))
        return cls(max_new_tokens, temperature, top_p, top_k, real("min_p", min_p, 0.0, 1.0),
                   real("repetition_penalty", repetition_penalty, 0.0, 100.0, lo_open=True),
                   real("presence_penalty", presence_penalty, -2.0, 2.0),
                   real("frequency_penalty", frequency_penalty, -2.0, 2.0), tuple(sorted(bias)), seed, tuple(stops),
                   frozenset() if ignore_eos else frozenset(int(e) for e in eos_ids), flag("logprobs", logprobs),
                   integer("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS))

    @property
    def plain(self) -> bool:
        """No processor changes the logits (the greedy fast path allocates nothing)."""
        return not self.logit_bias and self.repetition_penalty == 1.0 and not self.presence_penalty \
            and not self.frequency_penalty


def processed_logits(logits: np.ndarray, p: SamplingParams, prompt, produced, counts: dict) -> np.ndarray:
    """The logits after logit_bias and the penalties (SamplingParams' docstring), float64."""
    z = logits.astype(np.float64)
    for t, b in p.logit_bias:
        z[t] += b
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([np.asarray(prompt, np.int64), np.asarray(produced, np.int64)]))
        v = z[seen]
        z[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and counts:
        ids = np.fromiter(counts.keys(), np.int64, len(counts))
        c = np.fromiter(counts.values(), np.float64, len(counts))
        z[ids] -= p.presence_penalty * (c > 0) + p.frequency_penalty * c
    return z


def sample_request(logits: np.ndarray, p: SamplingParams, prompt, produced, counts: dict, rng):
    """-> (token, its logprob or None, [(token, logprob)] of the top_logprobs best or None)."""
    z = logits if p.plain else processed_logits(logits, p, prompt, produced, counts)
    if p.temperature == 0:
        tok = int(np.argmax(z))
    else:
        tok = _sample_z(z, p, rng)
    if not (p.logprobs or p.top_logprobs):
        return tok, None, None
    x = logits.astype(np.float64)
    lse = x.max() + math.log(np.exp(x - x.max()).sum())
    lp = x - lse
    top = None
    if p.top_logprobs:
        order = np.argsort(-lp, kind="stable")[:p.top_logprobs]
        top = [(int(t), float(lp[t])) for t in order]
    return tok, float(lp[tok]), top


def _sample_z(z: np.ndarray, p: SamplingParams, rng) -> int:
    z = np.asarray(z, np.float64) / p.temperature
    if p.top_k and p.top_k < z.size:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    q = np.exp(z - z.max())
    q /= q.sum()
    if p.top_p < 1.0:
        order = np.argsort(-q, kind="stable")
        csum = np.cumsum(q[order])
        keep = order[: int(np.searchsorted(csum, p.top_p)) + 1]
        mask = np.zeros_like(q)
        mask[keep] = q[keep]
        q = mask / mask.sum()
    if p.min_p > 0.0:
        q = np.where(q < p.min_p * q.max(), 0.0, q)
        q /= q.sum()
    return int(rng.choice(q.size, p=q))
