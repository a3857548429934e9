"""Whole-model parity on every backend, in every engine variant of conftest.ENGINE_VARIANTS
(prefill chunks reaching each matmul path, block sizes, queue and stream counts):
  * against transformers (the oracle) on tiny random checkpoints of every supported model type,
    converted with `colibri convert`: float32 logits within 1e-4 of the largest, a batch, a single
    prompt and ragged lengths, with the same expert ids as the reference backend at every token;
  * against the reference backend on the same stored weights, for every weight type the backend
    declares (float16, bfloat16, int8: the reduced-precision kernels, not the rounding, are tested);
  * decode through the paged cache equals a full prefill."""
import numpy as np
import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_UNAVAILABLE
from colibri_edge.backends import backend_class
from helpers import ExpertIds, fp32, rel_err
from hf_models import CASES, convert_case, hf_logits

TOL = 1e-4   # max |colibri - transformers| / max |transformers logit|


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(engine_variant, case, model_cache):
    name, opts = engine_variant
    hf, col = convert_case(model_cache, case)
    rng = np.random.default_rng(7)
    V = CASES[case][1]["vocab_size"]
    batch = rng.integers(0, V, size=(3, 13))
    want = hf_logits(hf, batch)
    assert np.abs(want).max() > 1.0, "test model's logits are too small to prove anything"
    with Engine.open(col, backend="reference", max_seq_len=64) as ref:
        ref_ids = ExpertIds(ref)
        ref.infer(batch)
    with Engine.open(col, backend=name, max_seq_len=64, **opts) as eng:
        ids = ExpertIds(eng)
        got = eng.infer(batch)                       # a batch
        expert_ids = ids.by_layer()
        eng.runner.hooks.clear()
        single = eng.infer(batch[1])                 # a single prompt ([seq] -> [1, seq, V])
        ragged = eng.infer([batch[0][:5], batch[2]])  # different lengths
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) < TOL
    assert rel_err(single[0], want[1]) < TOL
    assert rel_err(ragged[0], hf_logits(hf, batch[:1, :5])[0]) < TOL
    assert rel_err(ragged[1], want[2]) < TOL
    ref_ids = ref_ids.by_layer()                     # the same expert path for every token and layer
    assert expert_ids.keys() == ref_ids.keys()
    for layer in expert_ids:
        np.testing.assert_array_equal(expert_ids[layer], ref_ids[layer], err_msg=f"{case} layer {layer}")


@pytest.mark.parametrize("case,wd", [("mixtral", "float16"), ("qwen2_moe", "bfloat16"), ("qwen3_moe", "float16"),
                                     ("olmoe", "bfloat16"), ("mixtral_top1_tied", "int8"), ("qwen2_moe", "int8"),
                                     ("granitemoeshared", "float16")])
def test_logits_match_reference_on_stored_weights(engine_variant, case, wd, model_cache):
    """The backend's reduced-precision kernels against the reference on the very same stored weights;
    decode (generate_batch) agrees token for token."""
    name, opts = engine_variant
    if wd not in backend_class(name).weight_dtypes:
        pytest.skip(f"{name} does not declare {wd} weights (refused at open: test_weight_type_refused)")
    _, col = convert_case(model_cache, case, out_dtype=wd)
    V = CASES[case][1]["vocab_size"]
    rng = np.random.default_rng(7)
    ids = rng.integers(0, V, (2, 21)).astype(np.int32)
    ragged = [rng.integers(0, V, n).astype(np.int32) for n in (5, 33)]
    tol = 1e-4                                       # every variant computes in float32
    with Engine.open(col, backend="reference", max_seq_len=64) as ref, \
            Engine.open(col, backend=name, max_seq_len=64, **opts) as eng:
        assert rel_err(eng.infer(ids), ref.infer(ids)) < tol
        for got, want in zip(eng.infer(ragged), ref.infer(ragged)):
            assert rel_err(got, want) < tol
        prompts = [list(ids[0, :7]), list(ids[1, :3])]
        assert eng.generate_batch(prompts, max_new_tokens=6) == ref.generate_batch(prompts, max_new_tokens=6)


def test_weight_type_refused(backend_name, model_cache):
    """A weight type a backend does not declare is refused at open, never run wrongly."""
    for wd in ("float16", "bfloat16", "int8"):
        if wd in backend_class(backend_name).weight_dtypes:
            continue
        _, col = convert_case(model_cache, "mixtral_top1_tied", out_dtype=wd)
        with pytest.raises(ColibriError) as ei:
            Engine.open(col, backend=backend_name)
        assert ei.value.code == COLIBRI_ERR_UNAVAILABLE and wd in ei.value.message


def test_bfloat16_checkpoint(engine_variant, model_cache):
    """A bfloat16 checkpoint keeps bfloat16 weights; the oracle upcasts the same values to float32."""
    name, opts = engine_variant
    hf, col = convert_case(model_cache, "qwen2_moe_norm", dtype="bfloat16")
    if "bfloat16" not in backend_class(name).weight_dtypes:
        pytest.skip(f"{name} does not declare bfloat16 weights")
    ids = np.random.default_rng(3).integers(0, 90, size=(2, 9))
    with Engine.open(col, backend=name, **opts) as eng:
        assert eng.config["weight_dtype"] == "bfloat16"
        assert rel_err(eng.infer(ids), hf_logits(hf, ids)) < TOL


def test_chunked_prefill_equals_one_pass(engine_variant, model_cache):
    """Prefill split into chunks of 7 through a paged cache of 3-token blocks gives the same logits."""
    name, opts = engine_variant
    hf, col = convert_case(model_cache, "qwen3_moe")
    ids = np.random.default_rng(5).integers(0, 96, size=40)
    with Engine.open(col, backend=name, **{**opts, "prefill_chunk": 7, "kv_block_size": 3}) as eng:
        got = eng.infer(ids)
    assert rel_err(got, hf_logits(hf, ids[None])) < TOL


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "olmoe"])
def test_decode_matches_prefill(engine_variant, case, model_cache):
    """Paged decode (one token per step, several sequences) gives the logits of a full prefill."""
    name, opts = engine_variant
    _, col = convert_case(model_cache, case)
    V = CASES[case][1]["vocab_size"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, 5).tolist(), rng.integers(0, V, 2).tolist()]
    with Engine.open(col, backend=name, **{"kv_block_size": 3, **opts}) as eng:
        gens = eng.generate_batch(prompts, max_new_tokens=6)
        full = eng.infer([np.array(p + g[:-1]) for p, g in zip(prompts, gens)])
    for p, g, logits in zip(prompts, gens, full):
        assert np.argmax(logits[len(p) - 1:], axis=-1).tolist() == g


@pytest.mark.parametrize("case", ["ernie4_5_moe", "ernie4_5_moe_k1"])
def test_expert_ids_match_transformers_router(backend_name, case, model_cache):
    """The experts every MoE layer chose == transformers' router choice (its selected_experts, read
    from the router module) at every position whose top-k+1 scores are not near-tied."""
    import torch
    from transformers import AutoModelForCausalLM
    hf, col = convert_case(model_cache, case)
    V, k = CASES[case][1]["vocab_size"], CASES[case][1]["moe_k"]
    ids = np.random.default_rng(11).integers(0, V, (2, 17))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    seen, scores = {}, {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "moe_statics"):
            def grab(mod, args, out, i=i):
                logits, _, chosen = out
                seen[i] = chosen.numpy()
                scores[i] = (torch.softmax(logits.float(), -1) + mod.moe_statics.e_score_correction_bias).numpy()
            gate.register_forward_hook(grab)
    with torch.no_grad():
        model(torch.as_tensor(ids))
    with Engine.open(col, backend=backend_name, max_seq_len=64, **fp32(backend_name)) as eng:
        rec = ExpertIds(eng)
        eng.infer(ids)
        ours = rec.by_layer()
    assert sorted(ours) == sorted(seen) and seen
    checked = 0
    for layer, want in seen.items():
        srt = -np.sort(-scores[layer], axis=-1)[:, :k + 1]
        clear = np.min(np.abs(np.diff(srt, axis=-1)), axis=-1) > 1e-5
        assert clear.mean() > 0.8
        np.testing.assert_array_equal(ours[layer][clear], want[clear], err_msg=f"layer {layer}")
        checked += int(clear.sum())
    assert checked >= len(seen) * ids.size * 0.8


# (case, k): renormalised softmax (mixtral, k 2 -> 1), not renormalised with a gated shared expert
# (qwen2_moe, 3 -> 5), top-k on logits then softmax (granitemoe, 3 -> 2), the choice-only correction
# bias with ERNIE's floor (ernie4_5_moe, 4 -> 2), not renormalised (olmoe, 2 -> 1)
TOP_K_CASES = [("mixtral", 1), ("qwen2_moe", 5), ("granitemoe", 2), ("ernie4_5_moe", 2), ("olmoe", 1)]


@pytest.mark.parametrize("case,k", TOP_K_CASES)
def test_top_k_override_matches_transformers(backend_name, case, k, model_cache):
    """Engine.open(top_k=k) equals transformers with the config's experts per token set to k (its
    router, normalisation and choice bias unchanged): float32 logits within TOL, k experts a token."""
    from colibri_edge import COLIBRI_ERR_INVALID_ARGUMENT
    hf, col = convert_case(model_cache, case)
    rng = np.random.default_rng(11)
    batch = rng.integers(0, CASES[case][1]["vocab_size"], size=(2, 9))
    want = hf_logits(hf, batch, **{"moe_k" if case.startswith("ernie") else "num_experts_per_tok": k})
    with Engine.open(col, backend=backend_name, max_seq_len=64, **fp32(backend_name), top_k=k) as eng:
        ids = ExpertIds(eng)
        got = eng.infer(batch)
        assert eng.runner.top_k == k and all(v.shape[1] == k for v in ids.by_layer().values())
    assert rel_err(got, want) < TOL
    assert rel_err(got, hf_logits(hf, batch)) > 10 * TOL             # it really routes differently
    with pytest.raises(ColibriError) as e:
        Engine.open(col, backend="reference", top_k=CASES[case][1].get("num_local_experts", 99) + 100)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "experts per layer" in e.value.message
