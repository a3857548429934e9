"""Constrained decoding: a request's output held to a grammar -- a JSON schema, any JSON object, a
regular expression, a Lark or a GBNF grammar -- by a token mask at the sampler.

The grammar engine is llguidance (the `grammar` extra: `pip install colibri-edge[grammar]`), chosen
over xgrammar 0.2.8 by measurement: mask + apply per token along the same compact JSON, a 4-field
schema, 2-core Xeon -- llguidance (with the Numba apply below) 0.029 ms at the demo's 4,098-token
vocabulary and 0.27 ms at a 151,646-token byte-level one, xgrammar (its own torch apply) 0.059 and
1.97 ms; xgrammar sets up faster (26 ms / 1.5 s against 132 ms / 3.9 s, once per engine). And
llguidance builds its tokenizer view from the model's own tokenizer.json (xgrammar wants a
transformers tokenizer and torch for its masks: neither belongs on an edge install), and reads every
grammar form the OpenAI API and llama-server take (JSON schema, regex, Lark, GBNF).
benchmarks/grammar_bench.py measures the mask and the decode rate with it.

Per request (Core._sample), before each token is chosen:

    mask   = the tokens the grammar allows after the output so far     [ceil(V / 32)] int32 bits
    z[t]   = -inf where bit t of mask is 0                             (a copy of the logits row)
    token  = the sampler's choice over z (greedy, temperature, top-k/p, min-p as asked)
    matcher.consume_token(token); done when the grammar is complete and allows nothing more

Overlapped: the mask for the next token depends only on the tokens so far, so it is computed on a
worker thread (llguidance drops the GIL while it computes) from the moment the previous token is
consumed -- or the request is submitted -- while the step that makes the logits runs; _sample waits
for it only if it is not done yet. Applying it reads the logits the step already brought to the host
(every backend's sampling reads them there): no host sync is added.

The end-of-sequence token is allowed exactly when the grammar accepts the output so far. Both
buffers are allocated when the request is submitted: a constrained decode step allocates nothing.
A grammar that does not compile is COLIBRI_ERR_INVALID_ARGUMENT naming the problem, at submission.
"""
from __future__ import annotations

import json
import time

import numpy as np

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "constrained output (response_format, grammar, regex) needs "
                           "the grammar engine: pip install 'colibri-edge[grammar]' (llguidance)") from None
    return llguidance


def _bad(what):
    return ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, what)


def grammar_spec(response_format=None, grammar=None, regex=None, json_schema=None, lark=None):
    """The one grammar a request asked for, as (kind, source) -- kind one of GRAMMAR_KINDS -- or None.
    response_format: the OpenAI field ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}); grammar: GBNF (llama-server's field); regex; json_schema: a schema
    (llama-server's field); lark: a Lark grammar. Asking for two is an error."""
    asked = []
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise _bad(f"response_format={response_format!r:.80}: give a dict such as {{'type': 'json_object'}}")
        kind = response_format.get("type", "text")
        if kind == "json_object":
            asked.append(("json_object", {"type": "object"}))
        elif kind == "json_schema":
            js = response_format.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                raise _bad("response_format json_schema: give {'type': 'json_schema', 'json_schema': {'name': ..., "
                           "'schema': {...}}}")
            asked.append(("json_schema", js.get("schema", {})))
        elif kind != "text":
            raise _bad(f"response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'")
    for kind, value in (("gbnf", grammar), ("regex", regex), ("json_schema", json_schema), ("lark", lark)):
        if value is not None:
            if kind == "json_schema" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise _bad(f"json_schema is not JSON ({e})") from None
            if kind != "json_schema" and not isinstance(value, str):
                raise _bad(f"{'grammar' if kind == 'gbnf' else kind}: give the grammar as a string")
            asked.append((kind, value))
    if len(asked) > 1:
        raise _bad("give one of response_format, grammar, regex, json_schema and lark, not several")
    return asked[0] if asked else None


class Grammars:
    """An engine's grammar engine: its tokenizer view (built once, from tokenizer.json) and compiled
    grammars by source (a request's matcher starts from a copy)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids):
        ll = _llguidance()
        self.ll = ll
        self.vocab = int(vocab_size)
        try:
            self.tok = ll.LLTokenizer(tokenizer_json, n_vocab=self.vocab, eos_token=list(eos_ids))
        except Exception as e:                   # noqa: BLE001  the Rust side raises plain errors
            raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"the grammar engine cannot read this model's "
                               f"tokenizer.json ({e}); constrained output is not available for it") from None
        self._compiled = {}

    def _source(self, kind, value) -> str:
        M = self.ll.LLMatcher
        try:
            if kind in ("json_schema", "json_object"):
                schema = value if isinstance(value, (dict, bool)) else json.loads(value)
                if isinstance(schema, dict) and "x-guidance" not in schema:
                    # JSON without free whitespace between tokens (as json.dumps writes it): a grammar that
                    # lets a small model emit whitespace forever is the common way such output never ends
                    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
                return M.grammar_from_json_schema(schema)
            if kind == "regex":
                return M.grammar_from_regex(value)
            if kind == "gbnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark
                try:
                    lark = gbnf_to_lark(value)
                except Exception as e:           # noqa: BLE001  the converter raises plain Exception too
                    raise ValueError(e) from None
                return M.grammar_from_lark(lark)
            return M.grammar_from_lark(value)
        except (ValueError, TypeError, RuntimeError) as e:
            raise _bad(f"the {kind} grammar does not compile: {e}") from None

    def matcher(self, spec):
        """A fresh matcher of spec ((kind, source) from grammar_spec)."""
        kind, value = spec
        key = (kind, json.dumps(value, sort_keys=True) if not isinstance(value, str) else value)
        src = self._compiled.get(key)
        if src is None:
            src = self._source(kind, value)
            msg = self.ll.LLMatcher.validate_grammar(src, self.tok)         # "" when it compiles
            if msg:
                raise _bad(f"the {kind} grammar does not compile: {msg.strip()}")
            if len(self._compiled) > 256:
                self._compiled.clear()
            self._compiled[key] = src
        m = self.ll.LLMatcher(self.tok, src)
        if m.is_error():
            raise _bad(f"the {kind} grammar does not compile: {m.get_error()}")
        return Constraint(m, self.vocab)


def _mask_kernel():
    import numba

    @numba.njit(cache=True, nogil=True)
    def apply(z, bits):
        """z[t] = -inf where bit t of bits is 0 (bit t: word t >> 5, bit t & 31)."""
        for t in range(z.shape[0]):
            if not (bits[t >> 5] >> (t & 31)) & 1:
                z[t] = -np.inf
    return apply


_APPLY = None
_WORKERS = None         # the mask threads (one pool per process, made on first use)


def _workers():
    global _WORKERS
    if _WORKERS is None:
        from concurrent.futures import ThreadPoolExecutor
        _WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="colibri-mask")
    return _WORKERS


class Constraint:
    """One request's matcher, its mask buffer and a copy of the logits it masks."""

    def __init__(self, matcher, vocab: int):
        global _APPLY
        if _APPLY is None:
            _APPLY = _mask_kernel()
        self.m = matcher
        self.bits = np.zeros((1, -(-vocab // 32)), np.int32)
        self.z = np.empty(vocab, np.float32)
        self.pending = None             # the next token's mask, being computed (a Future)
        self.mask_seconds = 0.0         # time _sample waited for masks (not hidden behind a step)

    def copy(self) -> "Constraint":
        self.wait()
        c = Constraint.__new__(Constraint)
        c.m, c.bits, c.z = self.m.deep_copy(), np.zeros_like(self.bits), np.empty_like(self.z)
        c.pending, c.mask_seconds = None, 0.0
        return c

    def _compute(self):
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)

    def prefetch(self):
        """Start computing the next token's mask on a mask thread."""
        self.wait()
        self.pending = _workers().submit(self._compute)

    def wait(self):
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar forbids at -inf (a copy: the arena's row stays)."""
        t0 = time.perf_counter()
        if self.pending is None:
            self._compute()
        else:
            self.wait()
        np.copyto(self.z, logits)
        _APPLY(self.z, self.bits[0])
        self.mask_seconds += time.perf_counter() - t0
        return self.z

    def consume(self, token: int) -> bool:
        """Advance past the chosen token; True when the grammar is complete (nothing more may follow)."""
        if not self.m.consume_token(int(token)):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"the grammar refused token {token}: "
                               f"{self.m.get_error() or 'not allowed here'}")
        if self.m.is_stopped():
            return True
        self.prefetch()
        return False
