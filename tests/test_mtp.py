"""Multi-token-prediction heads (program.MTPHead, Runner.mtp_step, draft.MtpDrafter): the head's logits
equal the published module computed outside Colibri, and drafting with it changes no token.

The oracle of the head: the module of the DeepSeek-V3 report (section 2.2) as vLLM and llama.cpp run
it, in torch on the checkpoint's own tensors, its decoder layer transformers' own layer class (a copy
of the model's last layer, loaded with the head's weights, called with the model's rope and causal
mask): h = the model's final-normed hidden state at position i (transformers' last_hidden_state),
    logits(t_{i+2}) = head @ norm(layer(eh_proj [enorm(embed(t_{i+1})); hnorm(h_i)]))
Checkpoints: a Mixtral, DeepSeek-V3 and GLM-4.7-Flash (latent attention) with a nextn layer after the
decoder's, Qwen3.5 (hybrid: recurrent layers; zero-centred norms) with its mtp.* tensors, and the demo
model with its trained head."""
import os

import numpy as np
import pytest

from colibri_edge.errors import ColibriError, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.requests.engine import Engine
from helpers import fp32, mtp_logits
from hf_models import convert_case, reference_mtp_logits

CASES = ["mixtral_mtp", "deepseek_v3_mtp", "glm4_moe_lite_mtp", "qwen3_5_moe_mtp"]


DEMO_HF = os.path.join(os.path.dirname(__file__), "..", "toolchains", "demo-model", "hf")


def _case(model_cache, case):
    if case == "demo":                      # the embedded model and the checkpoint it was converted from
        from colibri_edge.model.demo import SHIPPED
        return DEMO_HF, SHIPPED
    return convert_case(model_cache, case)


@pytest.mark.parametrize("case", CASES + ["demo"])
def test_mtp_head_equals_the_published_module(backend_name, case, model_cache):
    hf, col = _case(model_cache, case)
    ids = np.random.default_rng(3).integers(3, 80, 12).astype(np.int32)
    want = reference_mtp_logits(hf, ids, os.path.join(model_cache, f"mtp_ref_{case}"))
    with Engine.open(col, backend=backend_name, draft="mtp", max_seq_len=64, **fp32(backend_name)) as eng:
        got = mtp_logits(eng, ids)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert np.abs(want).max() > 0.5                            # logits of a size that tests something


@pytest.mark.parametrize("case", CASES)
def test_mtp_drafting_changes_no_token(backend_name, case, model_cache):
    """Greedy tokens with the head drafting equal the undrafted ones, in a batch of three requests (one
    not drafting); on the cpu backend (batch-invariant kernels) the logprobs too, bit for bit, elsewhere
    within float rounding; the head proposed drafts, and the model verified them."""
    _, col = convert_case(model_cache, case)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 60, n)] for n in (9, 17, 5)]
    opts = dict(backend=backend_name, max_batch=4, max_seq_len=96, **fp32(backend_name))

    def run(eng, **kw):
        reqs = [eng.submit(p, max_new_tokens=20, ignore_eos=True, logprobs=True, **(kw if i < 2 else {}))
                for i, p in enumerate(prompts)]
        return [[(ev.token, ev.logprob) for ev in r.iter_events() if ev.kind == "token"] for r in reqs]
    with Engine.open(col, **opts) as eng:
        want = run(eng)
    with Engine.open(col, draft="mtp", draft_tokens=3, **opts) as eng:
        got = run(eng, draft="mtp")
        last = run(eng, draft="off")
        st = eng.stats
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]
    assert [[t for t, _ in g] for g in last] == [[t for t, _ in w] for w in want]
    if backend_name == "cpu":               # batch-invariant kernels: a row's logits whatever the step holds
        assert got == want
    else:                                   # the requests' steps are packed as they arrive (the core's thread):
        lp = lambda runs: np.array([x for r in runs for _, x in r])          # noqa: E731
        assert np.abs(lp(got) - lp(want)).max() < 1e-4                      # BLAS rows may differ by the step
    assert st.draft_proposed > 0 and st.draft_steps > 0


def test_mtp_drafting_through_preemption(model_cache):
    """A KV pool too small for the batch (cpu): requests drafting with the head are preempted and
    recomputed (the head starts over on the new sequence); every one finishes with its solo tokens, and
    every block is back in the pool."""
    _, col = convert_case(model_cache, "mixtral_mtp")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12], list(range(20, 40))]
    opts = dict(backend="cpu", max_batch=3, max_seq_len=64, kv_block_size=4, kv_cache_tokens=44)
    with Engine.open(col, **opts) as eng:
        solo = [eng.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    with Engine.open(col, draft="mtp", draft_tokens=2, **opts) as eng:
        got = eng.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
        assert eng._core.preemptions > 0, "the pool was sized so that the three cannot run together"
        assert eng.kv_free_blocks == eng.runner.pool.num_blocks
        assert eng.stats.draft_proposed > 0
    assert got == solo


def test_demo_model_head_drafts_english(backend_name):
    """The demo model's trained head (toolchains/demo-model/mtp_train.py) on English prompts: the tokens
    equal the undrafted ones, and the model accepts a good share of its drafts (a random head's are
    almost never accepted: test_mtp_drafting_changes_no_token's checkpoints accept about none)."""
    from colibri_edge.model.demo import SHIPPED
    prompts = ["The best thing about working from home is", "A list in Python is"]
    opts = dict(backend=backend_name, max_batch=2, max_seq_len=128)
    with Engine.open(SHIPPED, **opts) as eng:
        want = [eng.generate(p, max_new_tokens=40, ignore_eos=True) for p in prompts]
    with Engine.open(SHIPPED, draft="mtp", draft_tokens=2, **opts) as eng:
        got = [eng.generate(p, max_new_tokens=40, ignore_eos=True) for p in prompts]
        st = eng.stats
    assert got == want
    assert st.draft_accepted > 0.25 * st.draft_proposed > 0, (st.draft_accepted, st.draft_proposed)


def test_mtp_needs_a_head_and_an_engine_that_runs_it(model_cache):
    _, plain = convert_case(model_cache, "mixtral")
    with pytest.raises(ColibriError) as e:
        Engine.open(plain, backend="cpu", draft="mtp")
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "no multi-token-prediction head" in e.value.message
    _, col = convert_case(model_cache, "mixtral_mtp")
    with Engine.open(col, backend="cpu", max_seq_len=64) as eng:
        assert eng.runner.mtp is False                          # off: the head is not loaded
        with pytest.raises(ColibriError) as e:
            eng.generate([5, 6, 7], max_new_tokens=2, draft="mtp")
        assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "draft='mtp'" in e.value.message
    with pytest.raises(ColibriError) as e:
        Engine.open(col, backend="cpu", draft="mtp", expert_slots=6)
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE
