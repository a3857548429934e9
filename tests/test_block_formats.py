"""`colibri convert --dtype` in ggml's block formats and llama.cpp's q4_k_m mix, whole models on every
backend against transformers running the same stored weights decoded (hf_models.dequantised_checkpoint:
the oracle sees exactly the rounding Colibri runs, so the tolerance is float32's), and llama.cpp's
per-tensor rule for q4_k_m written out from llama-quant.cpp, not from our code."""
import os

import numpy as np
import pytest

from colibri_edge import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL, COLIBRI_ERR_UNAVAILABLE, Engine
from colibri_edge.backends import backend_class
from colibri_edge.model.convert import convert
from colibri_edge.model.modeldir import ModelDir
from helpers import activation_runs, close
from hf_models import build_hf, dequantised_checkpoint, hf_logits

TOL = 1e-4
FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q4_k", "q5_k", "q6_k", "q4_k_m", "q2_k", "q3_k", "iq4_nl",
           "iq4_xs", "tq1_0", "tq2_0", "nvfp4")
# K-quant sized: every row a whole number of 256-blocks
KQ = dict(hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
          vocab_size=97)
_built = {}


def _model(cache, case, fmt, **over):
    key = (case, fmt, tuple(sorted(over.items())))
    if key not in _built:
        tag = f"{case}_{abs(hash(tuple(sorted(over.items())))) % 10**8}"
        hf = os.path.join(cache, f"bf_hf_{tag}")
        if not os.path.exists(os.path.join(hf, "config.json")):
            build_hf(hf, case, **over)
        col = os.path.join(cache, f"bf_col_{tag}_{fmt}")
        convert(hf, col, dtype=fmt, progress=False)
        _built[key] = hf, col, dequantised_checkpoint(hf, col, os.path.join(cache, f"bf_oracle_{tag}_{fmt}"))
    return _built[key]


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_formats_match_transformers_on_the_decoded_weights(engine_variant, fmt, model_cache):
    name, opts = engine_variant
    hf, col, oracle = _model(model_cache, "mixtral", fmt, **KQ)
    formats = ModelDir(col).formats
    if not formats <= set(backend_class(name).weight_dtypes):
        with pytest.raises(ColibriError) as e:          # not yet on this backend: said so at open
            Engine.open(col, backend=name)
        assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "re-convert" in str(e.value)
        return
    ids = np.random.default_rng(3).integers(0, KQ["vocab_size"], (2, 11))
    want = hf_logits(oracle, ids)
    for o, tol in activation_runs(name, opts, TOL):
        with Engine.open(col, backend=name, max_seq_len=64, **o) as eng:
            got = eng.infer(ids)
            short = [eng.infer([ids[0][:n]])[0] for n in (1, 2)]     # one and two tokens: the decode paths
            steps = eng.generate(list(ids[1][:6]), max_new_tokens=3, ignore_eos=True)
        pairs = [(got, want)] + [(s, want[0, :len(s)]) for s in short]
        if tol != TOL:            # the int8 criterion is statistical (median, argmax share): over all positions
            pairs = [(np.concatenate([g.reshape(-1, g.shape[-1]) for g, _ in pairs]),
                      np.concatenate([w.reshape(-1, w.shape[-1]) for _, w in pairs]))]
        for g, w in pairs:
            assert close(g, w, tol), (o, fmt)
        if tol == TOL:            # teacher-forced greedy agreement, and generation token for token
            assert (got.argmax(-1) == want.argmax(-1)).all()
            assert steps == list(hf_logits(oracle, [list(ids[1][:6]) + steps[:2]])[0, 5:].argmax(-1))
    plain = hf_logits(hf, ids)                       # and the quantisation was real, not a copy
    assert np.abs(plain - want).max() > 0


def test_slot_pool_holds_block_formats(backend_name, model_cache):
    """The slot pool with a q4_k_m model (q4_k gate/up, q6_k down in the layers llama.cpp gives more
    bits) on every backend: a slot holds an expert's blob as stored, the kernels read the blocks from
    the slot, and the logits match the decoded oracle as the resident engine's do, with real misses."""
    hf, col, oracle = _model(model_cache, "mixtral", "q4_k_m", **KQ)
    ids = np.random.default_rng(5).integers(0, KQ["vocab_size"], (1, 9))
    want = hf_logits(oracle, ids)
    for o, tol in activation_runs(backend_name, {}, TOL):
        with Engine.open(col, backend=backend_name, max_seq_len=32, expert_slots=2, **o) as eng:
            got = eng.infer(ids)
            st = eng.slot_stats
            assert st["misses"] > 0 and st["resident_bytes"] <= 2 * eng.trace_meta()["bytes_per_expert"]
        assert close(got, want, tol), o


def test_shared_expert_and_dense_layers_in_block_formats(model_cache):
    """qwen2_moe: shared expert with its gate, a dense layer (mlp_only_layers), on reference and cpu."""
    over = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                head_dim=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=101)
    hf, col, oracle = _model(model_cache, "qwen2_moe", "q4_k_m", **over)
    cfg = ModelDir(col).config
    assert {l["type"] for l in cfg["layers"]} == {"dense", "moe_shared"}
    ids = np.random.default_rng(4).integers(0, 101, (1, 9))
    want = hf_logits(oracle, ids)
    for b in ("reference", "cpu"):
        for o, tol in activation_runs(b, {}, TOL):
            with Engine.open(col, backend=b, max_seq_len=32, **o) as eng:
                assert close(eng.infer(ids), want, tol)
                assert close(eng.infer(ids[:, :2]), want[:, :2], tol)


def _more_bits(n):
    """use_more_bits(i, n) layers, listed in llama.cpp's tables for these layer counts."""
    return {1: {0}, 2: {1}, 4: {2, 3}, 8: {0, 3, 6, 7}}[n]


@pytest.mark.parametrize("experts,layers", [(4, 4), (8, 8), (4, 1)])
def test_q4_k_m_chooses_as_llama_cpp(tmp_path, experts, layers):
    """llama.cpp's Q4_K_M (llama-quant.cpp llama_tensor_get_type_impl, no imatrix), for Mixtral-shaped
    models: output Q6_K, untied token_embd Q4_K, attn_v and every ffn_down Q6_K in the use_more_bits
    layers, and with exactly 8 experts attn_k/attn_v Q8_0 and attn_output Q5_K."""
    hf = build_hf(str(tmp_path / "hf"), "mixtral", **{**KQ, "num_local_experts": experts, "num_hidden_layers": layers})
    convert(hf, str(tmp_path / "col"), dtype="q4_k_m", progress=False)
    m = ModelDir(str(tmp_path / "col"))
    assert m.tensor_dtype("lm_head") == "q6_k" and m.tensor_dtype("embed_tokens") == "q4_k"
    more = _more_bits(layers)
    for i in range(layers):
        p = f"layers.{i}.attn."
        want_v = "q8_0" if experts == 8 else "q6_k" if i in more else "q4_k"
        assert m.tensor_dtype(p + "wq") == "q4_k"
        assert m.tensor_dtype(p + "wk") == ("q8_0" if experts == 8 else "q4_k")
        assert m.tensor_dtype(p + "wv") == want_v, i
        assert m.tensor_dtype(p + "wo") == ("q5_k" if experts == 8 else "q4_k")
        assert m.layer_formats[i] == ("q4_k", "q4_k", "q6_k" if i in more else "q4_k"), i
        assert m.tensor_dtype(f"layers.{i}.router") == "float32"


def test_q4_k_m_falls_back_where_rows_are_not_256(tmp_path):
    """Rows of 96 (whole 32-blocks only): Q4_K -> Q5_0, Q6_K -> Q8_0; rows of 40: float16 (llama.cpp:
    tensor_type_fallback, then F16). An untied-output model with hidden 96: output Q8_0."""
    hf = build_hf(str(tmp_path / "hf"), "mixtral", hidden_size=96, intermediate_size=40, head_dim=24,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=97)
    convert(hf, str(tmp_path / "col"), dtype="q4_k_m", progress=False)
    m = ModelDir(str(tmp_path / "col"))
    assert m.tensor_dtype("lm_head") == "q8_0"
    assert m.tensor_dtype("embed_tokens") == "q5_0"
    assert m.tensor_dtype("layers.0.attn.wq") == "q5_0"
    assert m.tensor_dtype("layers.1.attn.wv") == "q8_0"           # Q6_K (layer 1 of 2) -> Q8_0
    assert m.layer_formats[0] == ("q5_0", "q5_0", "float16")      # down rows of 40
    with Engine.open(str(tmp_path / "col"), backend="cpu") as eng:
        assert np.isfinite(eng.infer(np.arange(5))).all()


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0"])
def test_a_format_that_cannot_hold_a_row_is_refused_by_name(tmp_path, fmt):
    hf = build_hf(str(tmp_path / "hf"), "mixtral", hidden_size=64, intermediate_size=40, head_dim=16)
    with pytest.raises(ColibriError) as e:
        convert(hf, str(tmp_path / "col"), dtype=fmt, progress=False)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT
    assert "embed_tokens" in str(e.value) or "layers.0" in str(e.value)
    assert "q4_k_m" in str(e.value)
    assert not os.path.exists(tmp_path / "col" / "config.json")


def test_model_dir_refuses_a_block_format_that_does_not_fit_its_rows(tmp_path, model_cache):
    """A hand-edited tensors.json claiming q4_k for rows of 64 is refused at open."""
    import json
    hf = build_hf(str(tmp_path / "hf"), "mixtral", hidden_size=64, intermediate_size=64, head_dim=16)
    col = str(tmp_path / "col")
    convert(hf, col, dtype="q8_0", progress=False)
    t = json.load(open(os.path.join(col, "tensors.json")))
    t["layers.0.attn.wq"]["dtype"] = "q4_k"
    json.dump(t, open(os.path.join(col, "tensors.json"), "w"))
    with pytest.raises(ColibriError) as e:
        ModelDir(col)
    assert e.value.code == COLIBRI_ERR_INVALID_MODEL and "layers.0.attn.wq" in str(e.value)
