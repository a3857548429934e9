"""Every corruption of a model directory is a ColibriError with its code, naming file and field."""
import json
import os
import shutil

import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_INVALID_MODEL, COLIBRI_ERR_INVALID_MODEL_TYPE
from colibri_edge.model.modeldir import ALIGN, ModelDir
from hf_models import convert_case


@pytest.fixture
def model_dir(model_cache, tmp_path):
    _, col = convert_case(model_cache, "qwen2_moe")
    dst = tmp_path / "m"
    shutil.copytree(col, dst)
    return str(dst)


def _edit(path, name, fn):
    p = os.path.join(path, name)
    obj = json.load(open(p))
    fn(obj)
    json.dump(obj, open(p, "w"))


def _expect(path, code, *words):
    with pytest.raises(ColibriError) as ei:
        ModelDir(path)
    assert ei.value.code == code, ei.value
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    # the engine refuses the same way, before any compute
    with pytest.raises(ColibriError) as ei2:
        Engine.open(path, backend="reference")
    assert ei2.value.code == code


def test_valid_model_loads(model_dir):
    m = ModelDir(model_dir)
    assert m.moe_layers == [1] and len(m.experts) == 6          # decoder_sparse_step=2, mlp_only_layers=[3]


def test_truncated_weights_file(model_dir):
    p = os.path.join(model_dir, "colibri_weights.bin")
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 3 * ALIGN)
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "truncated", "weight_offset")


def test_misaligned_tensor_offset(model_dir):
    _edit(model_dir, "tensors.json", lambda t: t["layers.0.attn.wq"].update(offset=t["layers.0.attn.wq"]["offset"] + 8))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "tensors.json", "layers.0.attn.wq.offset", "aligned")


def test_misaligned_expert_offset(model_dir):
    _edit(model_dir, "experts.json", lambda e: e[3].update(weight_offset=e[3]["weight_offset"] + 100))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "experts.json", "[3].weight_offset", "aligned")


def test_overlapping_offsets(model_dir):
    _edit(model_dir, "tensors.json", lambda t: t["layers.0.attn.wk"].update(offset=t["layers.0.attn.wq"]["offset"]))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "overlaps", "offset")


def test_overlapping_experts(model_dir):
    _edit(model_dir, "experts.json", lambda e: e[2].update(weight_offset=e[1]["weight_offset"]))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "experts.json", "overlaps")


def test_weight_size_mismatch(model_dir):
    _edit(model_dir, "experts.json", lambda e: e[0].update(weight_size=e[0]["weight_size"] - 4))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "experts.json", "[0].weight_size", "need")


def test_tensor_shape_mismatch(model_dir):
    _edit(model_dir, "tensors.json", lambda t: t["layers.1.router"].update(shape=[5, 64]))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "tensors.json", "layers.1.router.shape")


def test_missing_tensor(model_dir):
    _edit(model_dir, "tensors.json", lambda t: t.pop("layers.1.shared.gate_logit"))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "tensors.json", "layers.1.shared.gate_logit", "missing")


def test_invalid_json(model_dir):
    with open(os.path.join(model_dir, "experts.json"), "w") as f:
        f.write('[{"id": 0,')
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "experts.json", "JSON")


def test_missing_file(model_dir):
    os.remove(os.path.join(model_dir, "tensors.json"))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "tensors.json", "missing")


def test_unknown_model_type(model_dir):
    _edit(model_dir, "config.json", lambda c: c.update(model_type="jamba"))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL_TYPE, "config.json", "model_type", "mixtral", "olmoe")


def test_unsupported_config_feature(model_dir):
    _edit(model_dir, "config.json", lambda c: c.update(router_mode="sigmoid_bias"))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "config.json", "router_mode")


def test_bad_layer_plan(model_dir):
    _edit(model_dir, "config.json", lambda c: c["layers"][1].update(moe_expert_start=3))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "config.json", "layers[1].moe_expert_start")


def test_missing_config_field(model_dir):
    _edit(model_dir, "config.json", lambda c: c.pop("rope_theta"))
    _expect(model_dir, COLIBRI_ERR_INVALID_MODEL, "config.json", "rope_theta", "missing")


def test_not_a_directory(tmp_path):
    _expect(str(tmp_path / "nope"), COLIBRI_ERR_INVALID_MODEL, "not a directory")
