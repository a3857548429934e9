"""The converter: sharded checkpoints, dtypes, rope_theta in both places, generation_config,
refusals of unsupported types and features, and bounded peak memory."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_edge import ColibriError, Engine, COLIBRI_ERR_INVALID_MODEL, COLIBRI_ERR_INVALID_MODEL_TYPE
from colibri_edge.model.convert import convert, translate_config
from hf_models import build_hf, hf_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_config(case_dir):
    return json.load(open(os.path.join(case_dir, "config.json")))


@pytest.fixture(scope="module")
def mixtral_hf(tmp_path_factory):
    return build_hf(str(tmp_path_factory.mktemp("hf") / "mixtral"), "mixtral")


def test_sharded_checkpoint(tmp_path):
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM
    src = build_hf(str(tmp_path / "one"), "olmoe")
    model = AutoModelForCausalLM.from_pretrained(src)
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 3
    convert(sharded, str(tmp_path / "out"), progress=False)
    ids = np.arange(11)[None] % 99
    with Engine.open(str(tmp_path / "out"), backend="reference") as e:
        got = e.infer(ids)
    want = hf_logits(src, ids)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_convert_to_half_types(mixtral_hf, tmp_path, dtype):
    cfg = convert(mixtral_hf, str(tmp_path / dtype), dtype=dtype, progress=False)
    assert cfg["weight_dtype"] == dtype
    ids = np.arange(9)[None]
    with Engine.open(str(tmp_path / dtype), backend="reference") as e:
        got = e.infer(ids)
    want = hf_logits(mixtral_hf, ids)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < (2e-2 if dtype == "bfloat16" else 3e-3), err   # rounded, but close


def test_rope_theta_top_level_and_in_rope_parameters():
    base = dict(model_type="mixtral", hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=10, num_local_experts=2, num_experts_per_tok=1)
    assert translate_config({**base, "rope_theta": 1234.0}, {})["rope_theta"] == 1234.0
    assert translate_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 777.0}},
                            {})["rope_theta"] == 777.0


def test_generation_config_eos(mixtral_hf, tmp_path):
    gp = os.path.join(mixtral_hf, "generation_config.json")
    g = json.load(open(gp))
    g["eos_token_id"] = [2, 5]
    alt = tmp_path / "hf"
    import shutil
    shutil.copytree(mixtral_hf, alt)
    json.dump(g, open(alt / "generation_config.json", "w"))
    cfg = convert(str(alt), str(tmp_path / "out"), progress=False)
    assert cfg["eos_token_ids"] == [2, 5]
    assert os.path.exists(tmp_path / "out" / "generation_config.json")


def test_unknown_model_type(mixtral_hf, tmp_path):
    import shutil
    alt = tmp_path / "hf"
    shutil.copytree(mixtral_hf, alt)
    c = _hf_config(alt)
    c["model_type"] = "llama"
    json.dump(c, open(alt / "config.json", "w"))
    with pytest.raises(ColibriError) as ei:
        convert(str(alt), str(tmp_path / "out"), progress=False)
    assert ei.value.code == COLIBRI_ERR_INVALID_MODEL_TYPE
    for t in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "'llama'"):
        assert t in str(ei.value)


@pytest.mark.parametrize("field,value", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
    ("rope_scaling", {"type": "linear", "factor": 2.0}),
    ("sliding_window", 16),
    ("clip_qkv", 8.0),
    ("hidden_act", "gelu"),
])
def test_unsupported_feature_named(mixtral_hf, tmp_path, field, value):
    import shutil
    alt = tmp_path / "hf"
    shutil.copytree(mixtral_hf, alt)
    c = _hf_config(alt)
    c[field] = value
    json.dump(c, open(alt / "config.json", "w"))
    with pytest.raises(ColibriError) as ei:
        convert(str(alt), str(tmp_path / "out"), progress=False)
    assert ei.value.code == COLIBRI_ERR_INVALID_MODEL
    assert field.split(".")[0] in str(ei.value) and "config.json" in str(ei.value)


def test_unknown_tensor_refused(mixtral_hf, tmp_path):
    """A tensor the engine would ignore means an unimplemented feature: refuse, don't drop it."""
    import shutil
    from safetensors.numpy import load_file, save_file
    alt = tmp_path / "hf"
    shutil.copytree(mixtral_hf, alt)
    t = load_file(str(alt / "model.safetensors"))
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    save_file(t, str(alt / "model.safetensors"))
    with pytest.raises(ColibriError) as ei:
        convert(str(alt), str(tmp_path / "out"), progress=False)
    assert "o_proj.bias" in str(ei.value)


def _write_big_mixtral(path, H=256, I=1024, E=16, L=2, V=512):
    """A Mixtral checkpoint written tensor by tensor (never whole in memory)."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    cfg = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=H, intermediate_size=I,
               num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=4, vocab_size=V,
               num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5,
               rope_theta=1e6, tie_word_embeddings=False, hidden_act="silu")
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    weight_map = {}
    shard = 0

    def put(tensors):
        nonlocal shard
        name = f"model-{shard:05d}.safetensors"
        save_file(tensors, os.path.join(path, name))
        weight_map.update({k: name for k in tensors})
        shard += 1

    put({"model.embed_tokens.weight": rng.standard_normal((V, H), np.float32),
         "lm_head.weight": rng.standard_normal((V, H), np.float32),
         "model.norm.weight": np.ones(H, np.float32)})
    for l in range(L):
        p = f"model.layers.{l}."
        put({p + "input_layernorm.weight": np.ones(H, np.float32),
             p + "post_attention_layernorm.weight": np.ones(H, np.float32),
             **{p + f"self_attn.{x}_proj.weight": rng.standard_normal((H, H), np.float32) for x in "qkvo"},
             p + "block_sparse_moe.gate.weight": rng.standard_normal((E, H), np.float32)})
        for e in range(E):
            q = p + f"block_sparse_moe.experts.{e}."
            put({q + "w1.weight": rng.standard_normal((I, H), np.float32),
                 q + "w3.weight": rng.standard_normal((I, H), np.float32),
                 q + "w2.weight": rng.standard_normal((H, I), np.float32)})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def test_converter_peak_memory_is_bounded(tmp_path):
    """Streaming: the converter's peak allocation stays near one tensor, far below the checkpoint."""
    size = _write_big_mixtral(str(tmp_path / "hf"))
    script = (
        "import tracemalloc, sys, json, resource; tracemalloc.start();"
        "from colibri_edge.model.convert import convert, SafetensorsIndex;"
        f"SafetensorsIndex({str(tmp_path / 'hf')!r});"   # warms lazy imports, so only conversion is measured
        "tracemalloc.reset_peak(); base = tracemalloc.get_traced_memory()[0];"
        "rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024;"
        f"convert({str(tmp_path / 'hf')!r}, {str(tmp_path / 'out')!r}, progress=False);"
        "print(json.dumps([tracemalloc.get_traced_memory()[1] - base,"
        " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    peak, rss_growth = json.loads(out.stdout.strip().splitlines()[-1])
    bound = 8 * 2 ** 20                 # largest tensor is 1 MiB; experts are 3 MiB
    assert size > 10 * bound, size
    assert peak < bound, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB checkpoint"
    # resident memory too: tensors are read one at a time, not mapped
    assert rss_growth < 3 * bound, f"peak RSS grew {rss_growth / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB checkpoint"
    # and the result is whole: the model directory validates
    with Engine.open(str(tmp_path / "out"), backend="reference", max_seq_len=8) as e:
        assert e.infer(np.arange(4)).shape == (1, 4, 512)


def test_granite_multipliers_folded(model_cache, tmp_path):
    """Granite's multipliers: attention_multiplier becomes the softmax scale, the others are folded
    into the weights (embedding, o_proj and every down projection, lm_head), which unties a tied
    embedding; the stored tensors are the checkpoint's times the factors (float32: exactly)."""
    from safetensors.numpy import load_file
    from colibri_edge.model.modeldir import ModelDir
    from hf_models import CASES, convert_case
    hf, col = convert_case(model_cache, "granitemoe")
    kw = CASES["granitemoe"][1]
    m = ModelDir(col)
    assert m.config["attention_scale"] == pytest.approx(kw["attention_multiplier"])
    assert m.config["folded_multipliers"] == pytest.approx(
        {k: kw[k] for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling")})
    assert not m.config["tie_word_embeddings"] and "lm_head" in m.tensors
    src = load_file(os.path.join(hf, "model.safetensors"))
    emb = src["model.embed_tokens.weight"]
    assert "lm_head.weight" not in src                       # tied in the checkpoint
    np.testing.assert_array_equal(m.raw_tensor("embed_tokens"), emb * np.float32(kw["embedding_multiplier"]))
    np.testing.assert_array_equal(m.raw_tensor("lm_head"), emb * np.float32(1 / kw["logits_scaling"]))
    np.testing.assert_array_equal(m.raw_tensor("layers.1.attn.wo"),
                                  src["model.layers.1.self_attn.o_proj.weight"] * np.float32(kw["residual_multiplier"]))
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "inspect", col], capture_output=True, text=True)
    assert r.returncode == 0 and "attention softmax scale 0.3" in r.stdout and "embedding x3" in r.stdout, r.stdout


def test_ernie_layout(model_cache):
    """ERNIE-4.5: the layer plan from moe_layer_start/end_index and interval, q/k rows permuted from
    interleaved to half-split rope pairs (exactly: a row permutation), v untouched, the correction bias
    stored as the router's choice bias, shared experts' width, inspect's lines."""
    from safetensors.numpy import load_file
    from colibri_edge.model.families.common import unpermute
    from colibri_edge.model.modeldir import ModelDir
    from hf_models import CASES, convert_case
    for case, plan in (("ernie4_5_moe", ["dense", "moe_shared", "moe_shared", "dense"]),
                       ("ernie4_5_moe_k1", ["dense", "moe", "dense"])):
        hf, col = convert_case(model_cache, case)
        kw, m = CASES[case][1], ModelDir(col)
        assert [l["type"] for l in m.config["layers"]] == plan
        assert m.config["router_choice_bias"] and m.config["rope_pairs"] == "interleaved"
        assert m.config["router_norm_min"] == pytest.approx(kw.get("moe_norm_min", 1e-12))
        assert m.config["shared_expert_intermediate_size"] == kw["moe_intermediate_size"] * kw["moe_num_shared_experts"]
        src = load_file(os.path.join(hf, "model.safetensors"))
        s = "model.layers.1."
        q = src[s + "self_attn.q_proj.weight"]
        hd = m.config["head_dim"]
        np.testing.assert_array_equal(m.raw_tensor("layers.1.attn.wq"), unpermute(q, kw["num_attention_heads"]))
        # head 0 of the stored q: rows 0..hd/2-1 are the source's even rows, the rest its odd rows
        np.testing.assert_array_equal(m.raw_tensor("layers.1.attn.wq")[:hd], np.concatenate([q[0:hd:2], q[1:hd:2]]))
        np.testing.assert_array_equal(m.raw_tensor("layers.1.attn.wk"),
                                      unpermute(src[s + "self_attn.k_proj.weight"], kw["num_key_value_heads"]))
        np.testing.assert_array_equal(m.raw_tensor("layers.1.attn.wv"), src[s + "self_attn.v_proj.weight"])
        bias = src[s + "mlp.moe_statics.e_score_correction_bias"]
        assert np.abs(bias).max() > 0.05
        np.testing.assert_array_equal(m.raw_tensor("layers.1.router_choice_bias"), bias.reshape(-1))
        r = subprocess.run([sys.executable, "-m", "colibri_edge", "inspect", col], capture_output=True, text=True)
        assert r.returncode == 0 and "correction bias" in r.stdout and "half-split" in r.stdout, r.stdout


def test_ernie_use_bias_refused(model_cache, tmp_path):
    import shutil
    from hf_models import convert_case
    hf, _ = convert_case(model_cache, "ernie4_5_moe_k1")
    alt = tmp_path / "hf"
    shutil.copytree(hf, alt)
    c = _hf_config(alt)
    c["use_bias"] = True
    (alt / "config.json").write_text(json.dumps(c))
    with pytest.raises(ColibriError) as ei:
        convert(str(alt), str(tmp_path / "out"), progress=False)
    assert ei.value.code == COLIBRI_ERR_INVALID_MODEL and "use_bias" in str(ei.value)


@pytest.mark.parametrize("field,value", [("residual_multiplier", 0.0), ("logits_scaling", -2.0),
                                         ("attention_multiplier", float("inf"))])
def test_granite_bad_multiplier_refused(model_cache, tmp_path, field, value):
    import shutil
    from hf_models import convert_case
    hf, _ = convert_case(model_cache, "granitemoe")
    alt = tmp_path / "hf"
    shutil.copytree(hf, alt)
    c = _hf_config(alt)
    c[field] = value
    with open(alt / "config.json", "w") as f:
        f.write(json.dumps(c).replace("Infinity", "1e999"))
    with pytest.raises(ColibriError) as ei:
        convert(str(alt), str(tmp_path / "out"), progress=False)
    assert ei.value.code == COLIBRI_ERR_INVALID_MODEL and field in str(ei.value)
