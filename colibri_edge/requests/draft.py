"""Speculative decoding: drafters propose the next tokens, one step verifies them (scheduler.Core).

A decode step at batch 1 is bound by the weight bytes it reads; feeding the pending token and k
drafted ones as one short prefill reads the weights once for k + 1 positions, and every drafted token
the model agrees with is a token gained. The request core verifies: row i's logits decide token i + 1
(greedy: the argmax; sampled: the speculative-sampling rule, sampling.speculative_choice), the first
disagreement ends the run (its token is the model's own choice there), and the positions past it are
rolled back (scheduler.Core._verify). Greedy output is the undrafted output token for token on the
batch-invariant backends (reference, cpu: a row's logits do not depend on the rows beside it).

Drafters:
    NgramDrafter   prompt lookup (vLLM's "ngram", transformers' prompt_lookup_num_tokens, llama.cpp's
                   ngram drafts): the longest suffix of n_max .. n_min tokens that occurred before in
                   the prompt or the output, and the tokens that followed it then. No model, no memory
                   beyond an index of the sequence's n-grams; pays where the output copies the input
                   (editing, summarising, code, structured extraction).

Cost model ("auto"): with a per-token acceptance a and k drafts, a verification yields
    E(a, k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
tokens for one step of D + k tokens instead of D (D: the step's other tokens). The step-cost curve
(scheduler.StepCost: measured seconds by token count, so a verification's extra experts and slot
misses are in it) prices that step; a request drafts the k that maximises the batch's tokens per
second, and none when no k beats not drafting by DRAFT_MARGIN. Acceptance is an exponential average
per request, and it keeps learning while drafting is off: the drafter's proposal is compared, after
the fact, with the tokens the model then produced (shadow proposals), so a request whose output
starts copying the input turns drafting back on.
"""
from __future__ import annotations

from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE

MAX_DRAFT_TOKENS = 16
NGRAM_MAX, NGRAM_MIN = 4, 2         # the suffix lengths matched, longest first (vLLM's prompt lookup defaults)
ACCEPT_PRIOR = 0.5                  # a request's acceptance before it has any (auto's first guess)
ACCEPT_DECAY = 0.8                  # weight of the old acceptance per verification (exponential average)
DRAFT_MARGIN = 1.05                 # auto drafts only when the predicted tokens/s beats not drafting by 5%


def check_draft(mode, tokens, has_mtp: bool = False) -> tuple:
    """-> (mode, draft_tokens) checked: mode "off", "auto", "mtp" or a drafter's name (DRAFTERS), tokens
    an int in [1, MAX_DRAFT_TOKENS]. "mtp" on a model without a multi-token-prediction head is
    COLIBRI_ERR_UNAVAILABLE."""
    modes = ("off", "auto", "mtp", *DRAFTERS)
    if not isinstance(mode, str) or mode not in modes:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"draft={mode!r:.80}: expected one of {', '.join(modes)}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_DRAFT_TOKENS:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"draft_tokens={tokens!r:.80}: expected an integer in "
                           f"[1, {MAX_DRAFT_TOKENS}]")
    if mode == "mtp" and not has_mtp:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "draft='mtp': this model has no multi-token-prediction head "
                           "(Colibri converts none yet); use draft='ngram' or draft='auto'")
    return mode, tokens


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification of k drafts yields at per-token acceptance a: 1 + a + ... + a^k."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class NgramDrafter:
    """Prompt lookup over one request's sequence (prompt, then every token it produces).

    A drafter (this one, and any other registered in DRAFTERS) has two methods: extend(tokens), the
    sequence's next tokens as they become known (the prompt first; never a rejected draft), and
    propose(k), at most k tokens it expects to follow (fewer, or [] when it has no guess).

    index[n] maps each n-gram of the sequence to the position of the token that followed its latest
    occurrence; propose() looks the sequence's last n tokens up (n = n_max down to n_min) and returns
    up to k tokens from that position on. Appending a token indexes the n-grams that now have a
    follower: O(n_max) per token, so proposing never scans the sequence."""

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.n_max, self.n_min = int(n_max), int(n_min)
        self.seq: list = []
        self.index = {n: {} for n in range(self.n_min, self.n_max + 1)}

    def extend(self, tokens):
        seq = self.seq
        for t in tokens:
            j = len(seq)                          # t's position: the follower of the n-grams ending at j - 1
            for n, idx in self.index.items():
                if j >= n:
                    idx[tuple(seq[j - n:j])] = j
            seq.append(int(t))

    def propose(self, k: int) -> list:
        seq = self.seq
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(seq) < n:
                continue
            j = self.index[n].get(tuple(seq[-n:]))
            if j is not None:
                return seq[j:j + k]
        return []


# drafter name -> class (adding a drafter is one class with extend and propose); "auto" uses "ngram"
DRAFTERS = {"ngram": NgramDrafter}


class DraftState:
    """One request's drafting: its mode, the drafter, the sequence it has seen (seq: prompt, produced
    tokens, the pending one), acceptance, and the shadow proposal auto checks while it is not drafting."""

    def __init__(self, mode: str, k: int, prompt):
        self.mode, self.k = mode, int(k)
        self.drafter = DRAFTERS["ngram" if mode == "auto" else mode]()
        self.seq = [int(t) for t in prompt]
        self.drafter.extend(self.seq)
        self.accept = ACCEPT_PRIOR
        self.shadow: list = []                    # auto, not drafting: what it would have proposed
        self.shadow_at = 0                        # ... after this many tokens of the sequence

    def observe(self, proposed: int, accepted: int):
        """A verification (or a shadow proposal checked) of `proposed` tokens, `accepted` of them agreed
        with the model: the per-token acceptance estimate, from accepted / tried positions (a run ends at
        the first miss, so the tried positions are accepted + 1, or all of them)."""
        if proposed <= 0:
            return
        tried = min(proposed, accepted + 1)
        rate = accepted / tried
        self.accept = ACCEPT_DECAY * self.accept + (1.0 - ACCEPT_DECAY) * rate

    def extend(self, tokens):
        tokens = [int(t) for t in tokens]
        self.seq.extend(tokens)
        self.drafter.extend(tokens)

    def check_shadow(self):
        """auto: score the shadow proposal against what the sequence now holds past its point."""
        if not self.shadow:
            return
        seq, at = self.seq, self.shadow_at
        if len(seq) < at + len(self.shadow):
            return                                 # not enough produced yet to check it
        got = seq[at:at + len(self.shadow)]
        n = 0
        while n < len(got) and got[n] == self.shadow[n]:
            n += 1
        self.observe(len(self.shadow), n)
        self.shadow = []


def choose_drafts(cost, base_tokens: int, wants: list) -> list:
    """auto's packing: wants is [(DraftState, proposal)] in step order; returns how many tokens of each
    proposal to verify (0: none). Greedy over the requests: each takes the k in 0..len(proposal) that
    maximises the step's expected tokens per predicted second, given the drafts taken before it, and
    only when that beats its k = 0 by DRAFT_MARGIN. cost: StepCost (None before any step: no drafts)."""
    out = [0] * len(wants)
    if cost is None or base_tokens <= 0:
        return out
    t0 = cost(base_tokens)
    if t0 is None or t0 <= 0:
        return out
    fed, gain = base_tokens, float(base_tokens)
    for i, (st, prop) in enumerate(wants):
        off = gain / float(cost(fed))
        best_k, best = 0, 0.0
        for k in range(1, len(prop) + 1):
            r = (gain - 1.0 + expected_tokens(st.accept, k)) / float(cost(fed + k))
            if r > best:
                best_k, best = k, r
        if best_k and best > off * DRAFT_MARGIN:
            out[i] = best_k
            fed += best_k
            gain += expected_tokens(st.accept, best_k) - 1.0
    return out
