"""Speculative decoding (colibri_edge/requests/draft.py, scheduler.Core._verify): drafting changes no
token. Greedy and seeded sampled output with drafts verified equal the undrafted output on every
backend, for attention, sliding-window, latent-attention and hybrid (recurrent) families, in batches
of requests that draft, do not, and prefill beside them; the n-gram drafter and auto's cost rule on
their own; the arguments' errors."""
import numpy as np
import pytest

from colibri_edge.errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.requests import draft
from colibri_edge.requests.engine import Engine
from colibri_edge.requests.scheduler import StepCost
from helpers import OracleDrafter, fp32
from hf_models import convert_case

BITWISE = ("reference", "cpu")          # a row's logits do not depend on its neighbours (batch invariance)


@pytest.fixture
def oracle():
    draft.DRAFTERS["oracle"] = OracleDrafter
    OracleDrafter.targets = {}
    yield OracleDrafter
    del draft.DRAFTERS["oracle"]


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    base = [int(t) for t in rng.integers(3, 40, 7)]
    return [base * 3, [int(t) for t in rng.integers(3, 40, 13)], [5, 6, 7, 8] * 4]


def _run(eng, prompts, **gen):
    """Each prompt's [(token, logprob)] (submitted together: one batch)."""
    reqs = [eng.submit(p, index=i, ignore_eos=True, logprobs=True, **gen) for i, p in enumerate(prompts)]
    return [[(ev.token, ev.logprob) for ev in r.iter_events() if ev.kind == "token"] for r in reqs]


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5_moe"])
def test_drafting_changes_no_token(backend_name, case, model_cache, oracle):
    """Greedy: the oracle drafter proposes the undrafted output with every third position wrong, so
    each request verifies accepted runs, rejections (KV rolled back; a recurrent state restored and
    its kept tokens fed again) and bonus tokens: the tokens equal the undrafted ones, and on the
    batch-invariant backends so do their logprobs, bit for bit (the hybrid's verification runs its
    recurrence token by token: decode's arithmetic). Seeded sampling (reference, cpu): equal too (for
    a proposal without a distribution the speculative-sampling rule is the model's own draw, accepted
    when it equals the draft)."""
    _, col = convert_case(model_cache, case)
    prompts = _prompts()
    opts = dict(backend=backend_name, max_batch=4, max_seq_len=96, **fp32(backend_name))
    bitwise = backend_name in BITWISE
    with Engine.open(col, **opts) as eng:
        want = _run(eng, prompts, max_new_tokens=24)
        sampled = _run(eng, prompts, max_new_tokens=16, temperature=0.9, seed=11) if bitwise else None
    oracle.targets = {tuple(p): list(p) + [t for t, _ in w] for p, w in zip(prompts, want)}
    with Engine.open(col, draft="oracle", draft_tokens=4, **opts) as eng:
        got = _run(eng, prompts, max_new_tokens=24)
        st = eng.stats
        assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]
        if bitwise:
            assert got == want
        assert 0 < st.draft_accepted < st.draft_proposed, (st.draft_accepted, st.draft_proposed)
        assert st.decode_tokens == sum(len(w) for w in want) - len(prompts)   # each first token is prefill's
        if sampled is not None:
            assert _run(eng, prompts, max_new_tokens=16, temperature=0.9, seed=11, draft="ngram") == sampled


def test_mixed_batch_with_prefill(model_cache, oracle):
    """Requests that draft (oracle, n-gram) and one that does not decode while a long prompt prefills in
    chunks of 8 beside them (cpu; on the hybrid model drafting pauses while it prefills, and the kept
    tokens of a rejection ride in the next step): every request's tokens equal its undrafted ones."""
    for case in ("qwen3_moe", "qwen3_5_moe"):
        _, col = convert_case(model_cache, case)
        prompts = _prompts(1) + [[int(t) for t in np.random.default_rng(2).integers(3, 40, 50)]]
        opts = dict(backend="cpu", max_batch=4, max_seq_len=128, prefill_chunk=8)
        with Engine.open(col, **opts) as eng:
            want = [eng.generate(p, max_new_tokens=20, ignore_eos=True) for p in prompts]
        oracle.targets = {tuple(p): list(p) + list(w) for p, w in zip(prompts, want)}
        with Engine.open(col, draft="ngram", **opts) as eng:
            reqs = [eng.submit(p, max_new_tokens=20, ignore_eos=True, draft=m)
                    for p, m in zip(prompts[:3], ("oracle", "off", "ngram"))]
            reqs.append(eng.submit(prompts[3], max_new_tokens=20, ignore_eos=True, draft="oracle"))
            got = [[ev.token for ev in r.iter_events() if ev.kind == "token"] for r in reqs]
            assert got == [list(w) for w in want], case
            assert eng.stats.draft_accepted > 0, case


def test_ngram_drafter_proposes_the_latest_longest_match():
    d = draft.NgramDrafter(n_max=3, n_min=2)
    d.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3])
    # suffix (5, 2, 3) never occurred before; (2, 3) last followed by 4 (position 7), not 9
    assert d.propose(3) == [4, 5, 2]
    d.extend([4])                                        # (2, 3, 4) occurred: followed by 5, 2, 3, 4
    assert d.propose(8) == [5, 2, 3, 4]
    d2 = draft.NgramDrafter(n_max=3, n_min=2)
    d2.extend([7, 8, 9])
    assert d2.propose(4) == []                           # nothing repeats
    assert draft.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert draft.expected_tokens(1.0, 4) == 5.0 and draft.expected_tokens(0.3, 0) == 1.0


def test_auto_drafts_only_when_the_cost_curve_says_it_pays():
    """choose_drafts against a measured step-cost curve: a flat curve (weights-bound: 4 tokens cost
    what 1 does) and a high acceptance draft the whole proposal; a low acceptance, or a curve where
    each token costs a full step (compute-bound), none; with the curve of an MoE step (each extra token
    wakes experts: +60% at 2 tokens), only a good acceptance drafts."""
    def curve(points):
        c = StepCost(64)
        for n, t in points:
            c.add(n, t)
        return c

    flat = curve([(1, 1.0), (2, 1.0), (4, 1.02), (8, 1.05)])
    linear = curve([(1, 1.0), (2, 2.0), (4, 4.0), (8, 8.0)])
    moe = curve([(1, 1.0), (2, 1.6), (4, 2.0), (8, 2.4)])

    def st(a):
        s = draft.DraftState("auto", 4, [1, 2, 3])
        s.accept = a
        return s
    prop = [5, 6, 7, 8]
    assert draft.choose_drafts(flat, 1, [(st(0.9), prop)]) == [4]
    assert draft.choose_drafts(flat, 1, [(st(0.02), prop)]) == [0]
    assert draft.choose_drafts(linear, 1, [(st(0.9), prop)]) == [0]
    assert draft.choose_drafts(moe, 1, [(st(0.2), prop)]) == [0]
    assert draft.choose_drafts(moe, 1, [(st(0.95), prop)])[0] > 0
    assert draft.choose_drafts(None, 1, [(st(0.9), prop)]) == [0]        # nothing measured yet
    # exploration: a step size the curve has not measured for EXPLORE_AGE steps is tried once, with the
    # smallest draft that reaches it, by a request that accepts well; not again until it ages again
    linear.age[1:] = draft.EXPLORE_AGE
    assert draft.choose_drafts(linear, 1, [(st(0.9), prop)]) == [1]
    assert draft.choose_drafts(linear, 1, [(st(0.9), prop)]) == [3]      # the next stale size (3 tokens: 2's bucket)
    assert draft.choose_drafts(linear, 1, [(st(0.3), prop)]) == [0]      # acceptance too low to explore
    # refresh: the plain step's point PLAIN_REFRESH steps old: a step without drafts, however good they look
    flat.age[0] = draft.PLAIN_REFRESH
    assert draft.choose_drafts(flat, 1, [(st(0.9), prop)]) == [0]
    flat.add(1, 1.0)
    assert draft.choose_drafts(flat, 1, [(st(0.9), prop)]) == [4]


def test_auto_stops_where_drafting_steps_deliver_less_than_plain_ones():
    """The realized check: once decode steps with verifications yield fewer tokens per second than plain
    ones, auto drafts only to explore, whatever the curve promises."""
    c = StepCost(64)
    for n in (1, 2, 4, 8):
        c.add(n, 1.0)                                   # a flat curve: drafting looks free
    s = draft.DraftState("auto", 4, [1, 2, 3])
    s.accept = 0.9
    real = draft.Realized()
    for _ in range(draft.REALIZED_MIN):
        real.add(False, 1, 0.02)                        # plain: 50 tok/s
        real.add(True, 3, 0.10)                         # drafting: 30 tok/s
    assert real.losing()
    assert draft.choose_drafts(c, 1, [(s, [5, 6, 7, 8])], real) == [0]
    for _ in range(30):
        real.add(True, 5, 0.05)                         # drafting pays again (explorations measured it)
    assert not real.losing()
    assert draft.choose_drafts(c, 1, [(s, [5, 6, 7, 8])], real) == [4]


def test_auto_stops_drafting_what_fails_and_learns_from_shadow_proposals():
    """A request whose n-gram proposals keep failing: its acceptance falls and auto stops verifying
    them; the shadow proposals still score (a run that later copies starts drafting again)."""
    s = draft.DraftState("auto", 4, [1, 2, 3, 1, 2])
    for _ in range(12):
        s.observe(4, 0)
    assert s.accept < 0.05
    s.shadow, s.shadow_at = [3, 1, 2], len(s.seq)
    s.extend([3, 1, 2])
    s.check_shadow()
    assert s.accept > 0.2 and s.shadow == []


def test_draft_arguments_are_checked(model_cache):
    _, col = convert_case(model_cache, "qwen3_moe")
    for bad, code in (({"draft": "medusa"}, COLIBRI_ERR_INVALID_ARGUMENT),
                      ({"draft": "ngram", "draft_tokens": 0}, COLIBRI_ERR_INVALID_ARGUMENT),
                      ({"draft": "ngram", "draft_tokens": 17}, COLIBRI_ERR_INVALID_ARGUMENT),
                      ({"draft": "mtp"}, COLIBRI_ERR_UNAVAILABLE)):
        with pytest.raises(ColibriError) as e:
            Engine.open(col, backend="reference", **bad)
        assert e.value.code == code
    with Engine.open(col, backend="reference") as eng:
        with pytest.raises(ColibriError) as e:
            eng.generate([3, 4, 5], max_new_tokens=2, draft_tokens=True, draft="ngram")
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT
    _, hyb = convert_case(model_cache, "qwen3_5_moe")
    with Engine.open(hyb, backend="reference") as eng:
        with pytest.raises(ColibriError) as e:
            eng.generate([3, 4, 5], max_new_tokens=2, draft="ngram")
        assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "draft='ngram'" in e.value.message


def test_ngram_memory_drafts_what_an_earlier_request_produced(model_cache):
    """The engine's n-gram memory: the same prompt again, on an engine that ran it once, drafts the
    earlier output (its own sequence has no match) and nearly every draft is accepted; the tokens are
    the undrafted ones. The table alone: chained lookups of the last MEM_N tokens."""
    mem = draft.NgramMemory(n=3, slots=1 << 10)
    mem.add([1, 2, 3, 4, 5, 6, 7])
    assert mem.propose([9, 2, 3, 4], 3) == [5, 6, 7] and mem.propose([3, 2, 1], 2) == []
    _, col = convert_case(model_cache, "qwen3_moe")
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 40, 12)]
    with Engine.open(col, backend="cpu", max_batch=2, max_seq_len=96) as eng:
        want = eng.generate(prompt, max_new_tokens=40, ignore_eos=True)
    with Engine.open(col, backend="cpu", max_batch=2, max_seq_len=96, draft="ngram", draft_tokens=8) as eng:
        first = eng.generate(prompt, max_new_tokens=40, ignore_eos=True)
        p0, a0 = eng.stats.draft_proposed, eng.stats.draft_accepted
        again = eng.generate(prompt, max_new_tokens=40, ignore_eos=True)
        p1, a1 = eng.stats.draft_proposed - p0, eng.stats.draft_accepted - a0
    assert list(first) == list(want) and list(again) == list(want)
    assert a1 >= 30 and a1 >= 0.9 * p1 and a1 > a0, (p0, a0, p1, a1)
