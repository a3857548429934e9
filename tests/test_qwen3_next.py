"""Qwen3-Next (colibri_edge/model/families/qwen3_next.py) from GGUF: llama.cpp's own converter's qwen3next
files of a tiny random checkpoint (fused in_proj_qkvz cut by the converter, in_proj_ba kept whole as
ssm_ba and cut on import, value heads grouped, the multi-token-prediction layer skipped) against
transformers, on every backend; the q8_0 file's blocks as stored. The checkpoint path (fused projections
cut at conversion, a dense layer among the sparse ones) runs in test_family_suite.py."""
import numpy as np
import pytest

from colibri_edge import Engine
from helpers import fp32
from hf_models import FAMILY_CASES


@pytest.fixture(scope="module")
def qwen3_next_gguf(tmp_path_factory):
    """(checkpoint dir, tokenizer, f32 GGUF, q8_0 GGUF): the family case without its dense layer (llama.cpp's
    qwen3next converter maps no dense MLP), with norm_topk_prob (its graph always renormalises), 64 wide
    (rows of a multiple of 32 columns: q8_0 blocks, not its f16 fallback)."""
    import torch
    import gguf_models as gm
    import llamacpp_convert
    from hf_models import add_mtp_weights, config_for, randomize
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("gguf_qwen3_next")
    hf = str(d / "hf")
    ft = gm.build_tokenizer(hf)
    mt, kw = FAMILY_CASES["qwen3_next"]
    cfg = config_for(mt, **dict(kw, vocab_size=len(ft), mlp_only_layers=[], norm_topk_prob=True, hidden_size=64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize(model, cfg)
    model.save_pretrained(hf)
    add_mtp_weights(hf, cfg)
    f32, q8 = llamacpp_convert.convert_many([(hf, str(d / "f32.gguf"), "f32", "gpt-2"),
                                             (hf, str(d / "q8.gguf"), "q8_0", "gpt-2")])
    return hf, ft, f32, q8


def test_gguf_matches_transformers(backend_name, qwen3_next_gguf, tmp_path):
    from colibri_edge.model.convert import convert
    from hf_models import hf_logits
    hf, ft, f32, _ = qwen3_next_gguf
    cfg = convert(f32, str(tmp_path / "m"), progress=False)
    assert cfg["model_type"] == "qwen3_next" and cfg["norm_topk_prob"]
    assert cfg["layer_types"] == FAMILY_CASES["qwen3_next"][1]["layer_types"]
    assert cfg["linear_attention"].get("value_head_order", "grouped") == "grouped"
    ids = np.random.default_rng(3).integers(0, len(ft), size=(2, 19))
    want = hf_logits(hf, ids)
    with Engine.open(str(tmp_path / "m"), backend=backend_name, max_seq_len=64, **fp32(backend_name)) as eng:
        assert np.abs(eng.infer(ids) - want).max() / np.abs(want).max() < 1e-4


def test_gguf_q8_0_runs_as_stored(backend_name, qwen3_next_gguf, tmp_path):
    """The q8_0 file: ssm_ba's rows cut into b and a (per key head, whole rows: never requantised) and
    attn_qkv / attn_gate as stored, equal to the file's decoded rows; every backend equal to the reference
    backend on the same file (float32 activations)."""
    import gguf
    from colibri_edge.model.convert import convert
    from colibri_edge.model.dtypes import widen
    from colibri_edge.model.modeldir import ModelDir
    hf, ft, _, q8 = qwen3_next_gguf
    out = str(tmp_path / "q8")
    cfg = convert(q8, out, progress=False)
    m = ModelDir(out)
    assert cfg["model_type"] == "qwen3_next" and m.tensor_dtype("layers.0.lin.wqkv") == "q8_0"
    t = {x.name: x for x in gguf.GGUFReader(q8).tensors}
    lin = cfg["linear_attention"]
    Hk, Hv = lin["num_key_heads"], lin["num_value_heads"]
    ba = gguf.dequantize(t["blk.0.ssm_ba.weight"].data, t["blk.0.ssm_ba.weight"].tensor_type)
    ba = ba.reshape(Hk, 2, Hv // Hk, -1)
    for ours, j in (("layers.0.lin.wb", 0), ("layers.0.lin.wa", 1)):
        got = widen(m.raw_tensor(ours), m.tensor_dtype(ours))
        assert (got == ba[:, j].reshape(Hv, -1)).all(), ours
    qkv = gguf.dequantize(t["blk.0.attn_qkv.weight"].data, t["blk.0.attn_qkv.weight"].tensor_type)
    assert (widen(m.raw_tensor("layers.0.lin.wqkv"), "q8_0") == qkv).all()
    ids = np.random.default_rng(4).integers(0, len(ft), size=(1, 17))
    with Engine.open(out, backend="reference", max_seq_len=64) as eng:
        ref = eng.infer(ids)
    from colibri_edge.backends import backend_class
    opts = dict(fp32(backend_name), **({"int8_activations": False} if "int8_activations" in
                                       backend_class(backend_name).OPTIONS else {}))
    with Engine.open(out, backend=backend_name, max_seq_len=64, **opts) as eng:
        got = eng.infer(ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
