"""Whole-model parity with Hugging Face transformers (the oracle), on every backend present:
tiny random checkpoints of every supported model type, converted with `colibri convert`."""
import numpy as np
import pytest

from colibri_edge import Engine
from hf_models import CASES, convert_case, hf_logits

TOL = 1e-4   # max |colibri - transformers| / max |transformers logit|


def rel_err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(backend_name, case, model_cache):
    hf, col = convert_case(model_cache, case)
    rng = np.random.default_rng(7)
    V = CASES[case][1]["vocab_size"]
    batch = rng.integers(0, V, size=(3, 13))
    want = hf_logits(hf, batch)
    assert np.abs(want).max() > 1.0, "test model's logits are too small to prove anything"
    with Engine.open(col, backend=backend_name, max_seq_len=64, disable_fp16=1) as eng:
        got = eng.infer(batch)                       # a batch
        single = eng.infer(batch[1])                 # a single prompt ([seq] -> [1, seq, V])
        ragged = eng.infer([batch[0][:5], batch[2]])  # different lengths
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) < TOL
    assert rel_err(single[0], want[1]) < TOL
    assert rel_err(ragged[0], hf_logits(hf, batch[:1, :5])[0]) < TOL
    assert rel_err(ragged[1], want[2]) < TOL


def test_bfloat16_checkpoint(backend_name, model_cache):
    """A bfloat16 checkpoint keeps bfloat16 weights; the oracle upcasts the same values to float32."""
    hf, col = convert_case(model_cache, "qwen2_moe_norm", dtype="bfloat16")
    from colibri_edge.backends import create
    from colibri_edge import ColibriError, COLIBRI_ERR_UNAVAILABLE
    with Engine.open(col, backend="reference") as probe_engine:
        assert probe_engine.config["weight_dtype"] == "bfloat16"
    ids = np.random.default_rng(3).integers(0, 90, size=(2, 9))
    want = hf_logits(hf, ids)
    if "bfloat16" not in create(backend_name).weight_dtypes:
        with pytest.raises(ColibriError) as ei:         # refused at open, never a wrong result
            Engine.open(col, backend=backend_name)
        assert ei.value.code == COLIBRI_ERR_UNAVAILABLE and "bfloat16" in ei.value.message
        return
    with Engine.open(col, backend=backend_name, disable_fp16=1) as eng:
        assert rel_err(eng.infer(ids), want) < TOL


def test_chunked_prefill_equals_one_pass(backend_name, model_cache):
    """Prefill split into chunks through the paged cache gives the same logits as one pass."""
    hf, col = convert_case(model_cache, "qwen3_moe")
    ids = np.random.default_rng(5).integers(0, 96, size=40)
    with Engine.open(col, backend=backend_name, prefill_chunk=7, kv_block_size=3, disable_fp16=1) as eng:
        got = eng.infer(ids)
    assert rel_err(got, hf_logits(hf, ids[None])) < TOL
