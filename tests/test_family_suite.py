"""The suite every model family runs, on every backend, against transformers on tiny random checkpoints
(hf_models.FAMILY_CASES builds them; `colibri convert` converts them). A family is a row of SUITE:
  * logits of a batch [3, n], its second prompt alone and ragged prompts within 1e-4 of max |logit|,
    and each token's experts equal to transformers' router choice wherever the choice is not within
    the row's margin of a tie (helpers.check_batch_single_ragged);
  * greedy tokens equal to transformers' token for token in each of the row's engine variants (KV
    block sizes, prefill chunks), every KV block and state slot back in its pool at the end;
  * (rows with slot_pool) the experts streamed through 4 slots: the same logits and greedy tokens
    as with every expert resident, with misses on the way.
What only one family has (sliding windows, latent caches, recurrent state, harmony chat) stays in its
own test file (test_families.py, test_gemma4.py, test_mla.py, test_qwen35.py).
The row's `router_of(layer)` finds transformers' router module of a decoder layer (None: a dense layer)
and `choice(mod, out)` reads (expert ids [T, k], margin [T]) from that module's forward output."""
import json
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from colibri_edge import Engine
from colibri_edge.backends import routing
from helpers import OracleDrafter, check_batch_single_ragged, check_slot_pool, fp32
from hf_models import FAMILY_CASES, checkpoint_class, convert_case, hf_greedy


def _gap(scores, k):
    """The k-th minus the (k+1)-th largest score per row (inf when every expert is chosen)."""
    import torch
    if k >= scores.shape[-1]:
        return np.full(scores.shape[0], np.inf, np.float32)
    top = torch.topk(scores, k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]).numpy().astype(np.float32)


def top_k_gap(mod, out):
    """Routers returning (scores, weights, ids) with the module's own top_k (gpt-oss, Qwen3.5)."""
    scores, _, idx = out
    return idx.numpy().copy(), _gap(scores, mod.top_k)


def sigmoid_bias_gap(mod, out):
    """MiniMax-M2's router: (logits, weights, ids), the choice by sigmoid(logit) + the block's
    e_score_correction_bias (minimax_router_of hands it to the router module as _bias)."""
    import torch
    logits, _, idx = out
    return idx.numpy().copy(), _gap(torch.sigmoid(logits.float()) + mod._bias.float(), mod.top_k)


def minimax_router_of(layer):
    layer.mlp.gate._bias = layer.mlp.e_score_correction_bias
    return layer.mlp.gate


def lfm2_router_of(layer):
    """LFM2-MoE: feed_forward.gate on MoE layers (a dense layer's feed_forward has none), its choice by
    sigmoid(logit) + the block's expert_bias."""
    gate = getattr(layer.feed_forward, "gate", None)
    if not hasattr(gate, "top_k"):
        return None
    gate._bias = layer.feed_forward.expert_bias
    return gate


def sparsemixer_gap(mod, out):
    """Phi-3.5-MoE's router: (logits, weights, ids), the choice the top two logits: the margin is the
    smaller of the gaps between the first and second and the second and third."""
    import torch
    logits, _, idx = out
    top = torch.topk(logits.float(), 3, dim=-1).values
    return idx.numpy().copy(), torch.minimum(top[:, 0] - top[:, 1], top[:, 1] - top[:, 2]).numpy()


def llama4_gap(mod, out):
    """Llama 4's router: (scores, logits), the top-1 logit chosen."""
    _, logits = out
    return logits.argmax(-1, keepdim=True).numpy().astype(np.int32), _gap(logits.float(), 1)


def gemma4_gap(mod, out):
    """Gemma 4's router: (probabilities, weights, ids), k from the config."""
    probs, _, idx = out
    return idx.numpy().copy(), _gap(probs, mod.config.top_k_experts)


def latent_router_gap(mod, out):
    """DeepSeek-V2/V3 and GLM routers: the smaller of the gaps between the k-th and (k+1)-th choice
    scores and between the kept and the first dropped group's score (sigmoid + correction bias for
    V3 / GLM, softmax for V2)."""
    import torch
    logits, _, idx = out
    v3 = hasattr(mod, "e_score_correction_bias")
    p = torch.sigmoid(logits) if v3 else torch.softmax(logits, -1)
    c = (p + mod.e_score_correction_bias if v3 else p).numpy().astype(np.float32)
    T, E = c.shape
    margin = np.full(T, np.inf)
    n = mod.num_group if (v3 or mod.topk_method == "group_limited_greedy") else 1
    if n and n > 1:
        top = 2 if v3 else 1
        gs = -np.sort(-np.sort(c.reshape(T, n, E // n), -1)[..., ::-1][..., :top].sum(-1), -1)
        if mod.topk_group < n:
            margin = gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]
        c = routing.group_mask(c, (n, mod.topk_group, top))
    s = -np.sort(-c, -1)
    k = mod.top_k
    if k < E:
        gap = s[:, k - 1] - s[:, k]
        margin = np.minimum(margin, np.where(np.isfinite(gap), gap, np.inf))
    return idx.numpy().copy(), margin


def latent_router_of(layer):
    gate = getattr(layer.mlp, "gate", None)
    return gate if hasattr(gate, "top_k") else None          # dense first layers have no router


SHORT = [5, 17, 3, 42, 8, 11, 29, 60, 2, 71]                         # longer than the sliding windows (6)
LONG = [5, 17, 3, 42, 8, 11, 29, 60, 2, 71, 13, 4, 50, 33, 7, 21, 9, 40, 1]   # 19: longer than a delta chunk
BLOCKS = {f"block{b}": {"kv_block_size": b} for b in (1, 7, 16)}


@dataclass
class Family:
    router_of: Callable                 # decoder layer -> its router module, or None
    choice: Callable                    # (router module, its output) -> (ids [T, k], margin [T])
    seed: int = 7                       # the batch's RNG
    length: int = 13                    # batch [3, length]
    margin: float = 1e-6                # router choices compared where farther than this from a tie
    float64: bool = False               # the oracle runs in float64 (ill-conditioned float32 positions)
    hf_kwargs: dict = field(default_factory=dict)   # from_pretrained options of the oracle
    prompt: list = field(default_factory=lambda: SHORT)
    greedy: dict = field(default_factory=dict)      # variant name -> Engine.open options
    greedy_open: dict = field(default_factory=dict)  # options every greedy variant takes
    slot_pool: bool = False


def _window_kv(v):                      # the sliding-window models' pools for 32 tokens past the prompt
    return {name: {**o, "kv_cache_tokens": 40 * o["kv_block_size"] + 128} for name, o in v.items()}


QWEN35 = dict(router_of=lambda layer: layer.mlp.gate, choice=top_k_gap, seed=11, length=21, margin=1e-4,
              float64=True, hf_kwargs={"experts_implementation": "eager"}, prompt=LONG)
SUITE = {
    "gpt_oss": Family(lambda layer: layer.mlp.router, top_k_gap, margin=1e-4, greedy=_window_kv(BLOCKS),
                      greedy_open={"max_seq_len": 128}),
    "gpt_oss_k4": Family(lambda layer: layer.mlp.router, top_k_gap, margin=1e-4),
    "gemma4": Family(lambda layer: layer.router, gemma4_gap, seed=11, greedy=_window_kv(BLOCKS),
                     greedy_open={"max_seq_len": 128}),
    "gemma4_vl": Family(lambda layer: layer.router, gemma4_gap, seed=11, slot_pool=True),
    "deepseek_v2": Family(latent_router_of, latent_router_gap, seed=13, greedy=BLOCKS,
                          greedy_open={"max_seq_len": 64, "kv_cache_tokens": 64}),
    "deepseek_v3": Family(latent_router_of, latent_router_gap, seed=13, greedy=BLOCKS, slot_pool=True,
                          greedy_open={"max_seq_len": 64, "kv_cache_tokens": 64}),
    "glm4_moe_lite": Family(latent_router_of, latent_router_gap, seed=13, greedy=BLOCKS,
                            greedy_open={"max_seq_len": 64, "kv_cache_tokens": 64}),
    "qwen3_5_moe": Family(**QWEN35, slot_pool=True, greedy_open={"max_seq_len": 128, "kv_block_size": 7},
                          greedy={f"chunk{c}": {"prefill_chunk": c} for c in (1, 5, 64)}),
    "qwen3_5_moe_vl": Family(**QWEN35),
    "hunyuan_v1_moe": Family(lambda layer: layer.mlp.gate, top_k_gap, seed=3, greedy=BLOCKS, slot_pool=True),
    "minimax_m2": Family(minimax_router_of, sigmoid_bias_gap, seed=5, greedy=BLOCKS, slot_pool=True),
    "lfm2_moe": Family(lfm2_router_of, sigmoid_bias_gap, seed=17, length=21, prompt=LONG, slot_pool=True,
                       greedy={**BLOCKS, **{f"chunk{c}": {"prefill_chunk": c} for c in (1, 5)}}),
    "phimoe": Family(lambda layer: layer.mlp.router, sparsemixer_gap, seed=19, slot_pool=True, greedy=BLOCKS,
                     greedy_open={"max_seq_len": 128}),
    "llama4_text": Family(lambda layer: getattr(layer.feed_forward, "router", None), llama4_gap, seed=23, length=17,
                          prompt=LONG, slot_pool=True, greedy=BLOCKS, greedy_open={"max_seq_len": 128}),
    "granitemoehybrid": Family(lambda layer: layer.block_sparse_moe.router, top_k_gap, seed=29, length=21,
                               prompt=LONG, slot_pool=True,
                               greedy={**BLOCKS, **{f"chunk{c}": {"prefill_chunk": c} for c in (1, 5)}}),
    "qwen3_next": Family(**{**QWEN35, "router_of": lambda layer: getattr(layer.mlp, "gate", None)},
                         greedy={f"chunk{c}": {"prefill_chunk": c} for c in (1, 5, 64)},
                         greedy_open={"max_seq_len": 128, "kv_block_size": 7}),
}


def open_engine(col, name, **kw):
    return Engine.open(col, backend=name, **fp32(name), **kw)


def hf_logits_and_choices(hf, ids, fam: Family):
    """transformers' logits (float32) and every routed layer's choice {layer: (ids [T, k], margin [T])}."""
    import torch
    dtype = torch.float64 if fam.float64 else torch.float32
    model = checkpoint_class(hf).from_pretrained(hf, dtype=dtype, attn_implementation="eager",
                                                 **fam.hf_kwargs).eval()
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    seen = {}

    def hook(i):
        def f(mod, inp, out):
            seen[i] = fam.choice(mod, out)
        return f
    for i, layer in enumerate(inner.layers):
        mod = fam.router_of(layer)
        if mod is not None:
            mod.register_forward_hook(hook(i))
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits
    return logits.numpy().astype(np.float32), seen


def all_returned(eng) -> bool:
    st = eng.runner.states
    return all(p.free_blocks == p.num_blocks for p in st.paged) and all(f.free_slots == f.num_slots for f in st.fixed)


@pytest.mark.parametrize("case", sorted(SUITE))
def test_logits_and_routing_match_transformers(backend_name, case, model_cache):
    fam = SUITE[case]
    hf, col = convert_case(model_cache, case)
    V = FAMILY_CASES[case][1]["vocab_size"]
    batch = np.random.default_rng(fam.seed).integers(0, V, size=(3, fam.length))
    want, choices = hf_logits_and_choices(hf, batch, fam)
    assert np.abs(want).max() > 1.0 and choices, "the test model's logits or routing are too small to prove anything"
    with open_engine(col, backend_name, max_seq_len=64) as eng:
        check_batch_single_ragged(eng, batch, want, choices, lambda b: hf_logits_and_choices(hf, b, fam)[0],
                                  fam.margin)
        assert all_returned(eng)


GREEDY = [pytest.param(case, v, id=f"{case}-{v}") for case in sorted(SUITE) for v in SUITE[case].greedy]


@pytest.mark.parametrize("case,variant", GREEDY)
def test_greedy_matches_transformers(backend_name, case, variant, model_cache):
    fam = SUITE[case]
    hf, col = convert_case(model_cache, case)
    key = os.path.join(model_cache, f"greedy_{case}_{len(fam.prompt)}.json")
    if not os.path.exists(key):
        json.dump(hf_greedy(hf, fam.prompt, 32), open(key, "w"))
    with open_engine(col, backend_name, **{**fam.greedy_open, **fam.greedy[variant]}) as eng:
        got = eng.generate(fam.prompt, max_new_tokens=32, ignore_eos=True)
        assert all_returned(eng)
    assert got == json.load(open(key))


@pytest.mark.parametrize("case", sorted(SUITE))
def test_drafting_matches_transformers(backend_name, case, model_cache):
    """Speculative decoding on every family: helpers.OracleDrafter proposes transformers' greedy output
    with every third drafted position wrong, so each step verifies accepted runs, a rejection (KV, and a
    recurrent state, rolled back) and the bonus token; the tokens still equal transformers'."""
    from colibri_edge.requests import draft
    fam = SUITE[case]
    hf, col = convert_case(model_cache, case)
    key = os.path.join(model_cache, f"greedy_{case}_{len(fam.prompt)}.json")
    if not os.path.exists(key):
        json.dump(hf_greedy(hf, fam.prompt, 32), open(key, "w"))
    want = json.load(open(key))
    draft.DRAFTERS["oracle_suite"] = OracleDrafter
    OracleDrafter.targets = {tuple(fam.prompt): list(fam.prompt) + want}
    try:
        with open_engine(col, backend_name, **fam.greedy_open, draft="oracle_suite", draft_tokens=4) as eng:
            got = eng.generate(fam.prompt, max_new_tokens=32, ignore_eos=True)
            st = eng.stats
            assert all_returned(eng)
    finally:
        del draft.DRAFTERS["oracle_suite"]
    assert got == want
    assert 0 < st.draft_accepted < st.draft_proposed


@pytest.mark.parametrize("case", sorted(c for c in SUITE if SUITE[c].slot_pool))
def test_through_the_slot_pool(backend_name, case, model_cache):
    _, col = convert_case(model_cache, case)
    check_slot_pool(lambda **kw: open_engine(col, backend_name, max_seq_len=64, **kw),
                    FAMILY_CASES[case][1]["vocab_size"])
