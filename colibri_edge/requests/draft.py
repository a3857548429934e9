"""Speculative decoding: drafters propose the next tokens, one step verifies them (scheduler.Core).

A decode step at batch 1 is bound by the weight bytes it reads; feeding the pending token and k
drafted ones as one short prefill reads the weights once for k + 1 positions, and every drafted token
the model agrees with is a token gained. The request core verifies: row i's logits decide token i + 1
(greedy: the argmax; sampled: the speculative-sampling rule, sampling.speculative_choice), the first
disagreement ends the run (its token is the model's own choice there), and the positions past it are
rolled back (scheduler.Core._verify). Greedy output is the undrafted output token for token on the
batch-invariant backends (reference, cpu: a row's logits do not depend on the rows beside it).

Drafters:
    MtpDrafter     the model's own multi-token-prediction head (DeepSeek-V3's nextn layer, Qwen3.5's mtp.*,
                   the demo model's): run by the request core after each step, chained for k drafts
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
ACCEPT_DECAY = 0.8                  # weight of the old counts per verification (exponential forgetting)
DRAFT_MARGIN = 1.05                 # auto drafts only when the predicted tokens/s beats not drafting by 5%
EXPLORE_AGE = 128                   # auto re-measures a step size the curve last saw this many steps ago ...
EXPLORE_ACCEPT = 0.5                # ... for a request whose acceptance is at least this


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
                           "(convert a checkpoint that stores one: DeepSeek-V3 / GLM nextn layers, Qwen3.5's mtp.*); "
                           "use draft='ngram' or draft='auto'")
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


class NgramMemory:
    """The engine's memory of the sequences it ran (prompts and outputs): for every MEM_N tokens, the token
    that followed them, in a fixed table of MEM_SLOTS entries indexed by the n-gram's hash (a collision
    overwrites: a wrong guess is only a rejected draft). A prompt-lookup drafter with no match in its own
    sequence chains lookups here (the last MEM_N tokens, then those shifted by the guess, ...), so a
    request that repeats what an earlier one produced (a regenerated answer, a recurring tool-call
    format, boilerplate) drafts it: llama.cpp's ngram-mod, bounded at 4 MiB."""

    def __init__(self, n: int = 0, slots: int = 0):
        import numpy as np
        self.n = int(n or MEM_N)
        self.table = np.full(int(slots or MEM_SLOTS), -1, np.int32)
        self.mask = len(self.table) - 1

    def add(self, seq):
        n, t, m = self.n, self.table, self.mask
        seq = [int(x) for x in seq]
        for j in range(n, len(seq)):
            t[hash(tuple(seq[j - n:j])) & m] = seq[j]

    def propose(self, seq, k: int) -> list:
        n = self.n
        if len(seq) < n:
            return []
        ctx, out = list(seq[-n:]), []
        for _ in range(k):
            g = int(self.table[hash(tuple(ctx)) & self.mask])
            if g < 0:
                break
            out.append(g)
            ctx = ctx[1:] + [g]
        return out


MEM_N = 8                           # the n-gram the engine's memory keys on
MEM_SLOTS = 1 << 20                 # its table's entries (int32: 4 MiB)


# drafter name -> class (adding a drafter is one class with extend and propose)
class MtpDrafter:
    """The model's multi-token-prediction head (runtime/program.MTPHead). The request core runs the head
    after each step (scheduler.Core._mtp): over the positions the step kept (the head's KV, beside the
    model's), then chained from the last one: proposal = its drafts of the tokens after the pending one,
    made when the sequence held `at` tokens. propose() hands it out while the sequence still holds that
    many (the drafts are greedy: the head's argmax, a proposal without a distribution, so verification
    by equality is the speculative-sampling rule, as for prompt lookup)."""

    def __init__(self):
        self.n = 0                  # tokens of the sequence seen (prompt, produced, the pending one)
        self.proposal: list = []
        self.at = -1
        self.seq = None             # the engine sequence it wrote the head's KV for (a preempted request's
                                    # new one starts over)
        self.mtp_at = 0             # the first position whose head KV this request has not written
        self.chain = 1              # drafts the head makes after a step (auto: one more than it last took;
                                    # 0: auto is not drafting, and the head does not run: see idle)
        self.idle = 0               # steps the head skipped while auto was not drafting (it probes again
                                    # after MTP_PROBE: a shadow proposal keeps the acceptance current)

    def extend(self, tokens):
        self.n += len(tokens)

    def propose(self, k: int) -> list:
        return self.proposal[:k] if self.at == self.n else []


MTP_PROBE = 32                      # auto, not drafting with the head: it runs once every this many steps


DRAFTERS = {"ngram": NgramDrafter}
AUTO_DRAFTER = "ngram"              # the drafter "auto" sizes and switches (benchmarks may name another)


class DraftState:
    """One request's drafting: its mode, the drafter, the sequence it has seen (seq: prompt, produced
    tokens, the pending one), acceptance, and the shadow proposal auto checks while it is not drafting."""

    def __init__(self, mode: str, k: int, prompt, memory: NgramMemory | None = None, mtp: bool = False):
        self.mode, self.k = mode, int(k)
        # "mtp", and "auto" on an engine running the model's MTP head, draft with the head
        self.drafter = MtpDrafter() if mode == "mtp" or (mode == "auto" and mtp) else \
            DRAFTERS[AUTO_DRAFTER if mode == "auto" else mode]()
        self.memory = memory if isinstance(self.drafter, NgramDrafter) else None
        self.seq = [int(t) for t in prompt]
        self.drafter.extend(self.seq)
        self.hits, self.tries = ACCEPT_PRIOR, 1.0   # forgetful counts of accepted / tried positions
        self.shadow: list = []                    # auto, not drafting: what it would have proposed
        self.shadow_at = 0                        # ... after this many tokens of the sequence

    @property
    def accept(self) -> float:
        """The per-token acceptance estimate: accepted / tried positions over the verifications, older
        ones forgotten by ACCEPT_DECAY each (a run ends at the first miss, so a verification tried
        accepted + 1 positions, or all it had; pooling the counts is the maximum-likelihood rate of those
        geometric runs, where averaging each run's accepted / tried would be biased low: 0.31 for 0.5)."""
        return self.hits / self.tries

    @accept.setter
    def accept(self, a: float):
        self.hits, self.tries = float(a), 1.0

    def observe(self, proposed: int, accepted: int):
        """A verification (or a shadow proposal checked) of `proposed` tokens, `accepted` of them agreed
        with the model."""
        if proposed <= 0:
            return
        tried = min(proposed, accepted + 1)
        self.hits = ACCEPT_DECAY * self.hits + accepted
        self.tries = ACCEPT_DECAY * self.tries + tried

    def extend(self, tokens):
        tokens = [int(t) for t in tokens]
        self.seq.extend(tokens)
        self.drafter.extend(tokens)

    def propose(self, k: int) -> list:
        """Prompt lookup: the engine's memory's guess when it has one (it matched MEM_N tokens, longer
        than any n-gram of the sequence's own), else the sequence's own; other drafters: theirs."""
        out = self.memory.propose(self.seq, k) if self.memory is not None else []
        return out or [int(t) for t in self.drafter.propose(k)][:k]

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


class Realized:
    """The throughput decode steps actually reached, with verifications in them and without (decode-only
    steps: tokens emitted / seconds, older steps forgotten by REALIZED_DECAY each): auto's check of its
    own predictions. A step's cost depends on more than its token count where experts stream through a
    slot pool (which experts miss), so the curve can promise a gain the steps do not deliver (measured:
    0.91x of off at acceptance 0.8 with 24 of 64 experts resident); while drafting steps yield fewer
    tokens per second than plain ones, auto drafts only to explore."""

    def __init__(self):
        self.tok = [0.0, 0.0]
        self.sec = [0.0, 0.0]
        self.n = [0, 0]

    def add(self, drafted: bool, tokens: int, seconds: float):
        i = int(bool(drafted))
        self.tok[i] = REALIZED_DECAY * self.tok[i] + tokens
        self.sec[i] = REALIZED_DECAY * self.sec[i] + seconds
        self.n[i] += 1

    def losing(self) -> bool:
        if min(self.n) < REALIZED_MIN:
            return False
        return self.tok[1] * self.sec[0] < self.tok[0] * self.sec[1]


REALIZED_DECAY = 0.9
PLAIN_REFRESH = 16                  # auto decodes plainly when the curve has not seen a plain step for this long
REALIZED_MIN = 4                    # steps of each kind before the realized rates are trusted


def choose_drafts(cost, base_tokens: int, wants: list, realized: Realized | None = None, head: float = 0.0) -> list:
    """auto's packing: wants is [(DraftState, proposal)] in step order; returns how many tokens of each
    proposal to verify (0: none). Greedy over the requests: each takes the k in 0..len(proposal) that
    maximises the step's expected tokens per predicted second, given the drafts taken before it, and
    only when that beats its k = 0 by DRAFT_MARGIN. cost: StepCost (None before any step: no drafts).
    head: the measured seconds of one run of the model's MTP head (Core._mtp): a request drafting k
    with it pays k runs a step (the kept positions, then k - 1 chained drafts) and none while it does
    not draft (the head then rests: MtpDrafter.idle), so on a shallow model whose head costs a good
    share of a step (the demo model: 4 layers and the head's 1) the head's drafts must beat that too.

    Refresh: drafting every step would leave the curve's point for a plain step (and the realized plain
    rate) as measured before it started, for good; so when that point is PLAIN_REFRESH steps old, the
    step drafts nothing (a plain step is never worse than draft="off").

    Exploration: the curve learns a step size only when steps of that size run, so a point measured
    once in a bad moment (a cold slot pool's first prefill) would keep drafting off for good. A request
    whose acceptance is at least EXPLORE_ACCEPT verifies, once every EXPLORE_AGE steps, the smallest
    draft whose step size the curve has not measured for that long: at most one step in 128 costs what
    the curve feared (measured: within 3% of off where drafts fail, bench results/draft.md)."""
    out = [0] * len(wants)
    if cost is None or base_tokens <= 0:
        return out
    t0 = cost(base_tokens)
    if t0 is None or t0 <= 0:
        return out
    losing = realized is not None and realized.losing()
    if hasattr(cost, "age") and cost.age[cost.bucket(base_tokens)] >= PLAIN_REFRESH:
        return out                  # a plain step now and then keeps the curve's no-draft point current
    fed, gain, extra = base_tokens, float(base_tokens), 0.0
    for i, (st, prop) in enumerate(wants):
        off = gain / (float(cost(fed)) + extra)
        per = head if isinstance(st.drafter, MtpDrafter) else 0.0
        best_k, best = 0, 0.0
        for k in range(1, len(prop) + 1):
            r = (gain - 1.0 + expected_tokens(st.accept, k)) / (float(cost(fed + k)) + extra + per * k)
            if r > best:
                best_k, best = k, r
        if losing or not (best_k and best > off * DRAFT_MARGIN):
            best_k = 0
            if st.accept >= EXPLORE_ACCEPT and hasattr(cost, "age"):
                best_k = next((k for k in range(1, len(prop) + 1)
                               if cost.age[cost.bucket(fed + k)] >= EXPLORE_AGE or not cost.seen[cost.bucket(fed + k)]),
                              0)
                if best_k:
                    cost.age[cost.bucket(fed + best_k)] = 0      # one exploration per bucket and window
        if best_k:
            out[i] = best_k
            fed += best_k
            gain += expected_tokens(st.accept, best_k) - 1.0
            extra += per * best_k
    return out
