"""The families of issue 49 from GGUF: llama.cpp's own converter's files (f32, q8_0) of tiny random
checkpoints against transformers, on every backend, and the q8_0 files' blocks as stored.
  * Qwen3-Next (families/qwen3_next.py, qwen3next): fused in_proj_qkvz cut by the converter, in_proj_ba
    kept whole as ssm_ba and cut on import, value heads grouped, the multi-token-prediction layer skipped;
  * MiniMax-M2 (families/minimax_m2.py, minimax-m2): partial rotary's q/k rows and norm weights reordered
    on import, exp_probs_b the sigmoid router's choice bias;
  * LFM2-MoE (families/lfm2_moe.py, lfm2moe): the layer types from per-layer KV head counts, shortconv.in_proj
    cut into its thirds on import, token_embd_norm the final norm, a dense first layer.
The checkpoint paths run in test_family_suite.py (parity, routing, greedy, slot pool)."""
import json
import math
import os

import numpy as np
import pytest

from colibri_edge import Engine
from helpers import fp32, mtp_logits
from hf_models import FAMILY_CASES


# case -> overrides of its FAMILY_CASES config for llama.cpp's converter: Qwen3-Next without its dense layer
# (the qwen3next converter maps no dense MLP), with norm_topk_prob (its graph always renormalises); 64 wide
# (rows of a multiple of 32 columns: q8_0 blocks, not the converter's f16 fallback)
# LFM2-MoE without routed_scaling_factor (the lfm2moe metadata has none: llama.cpp's graph does not scale)
# Hunyuan-MoE as Hunyuan-A13B's config spells it (per-layer lists; the converter accepts only A13B's own NTK
# alpha, so a plain rope); Phi-3.5-MoE with the published jitter 0.01 (the file has none) and mscales equal to the
# attention factor the converter writes (it drops the config's); Llama 4 with the values llama.cpp assumes for
# every llama4 file (no rope every 4th layer, chunks and floor_scale 8192, attn_scale 0.1)
PHI_FACTOR = math.sqrt(1 + math.log(256 / 128) / math.log(128))     # max_position 256 over an original 128
GGUF_CASES = {"qwen3_next": dict(mlp_only_layers=[], norm_topk_prob=True, hidden_size=64),
              "minimax_m2": {}, "lfm2_moe": dict(hidden_size=64, moe_intermediate_size=32, routed_scaling_factor=1.0),
              "hunyuan_v1_moe": dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=[32, 32],
                                     moe_topk=[2, 2], num_shared_expert=[1, 1],
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
              "phimoe": dict(router_jitter_noise=0.01, rope_parameters=dict(
                  FAMILY_CASES["phimoe"][1]["rope_parameters"], short_mscale=PHI_FACTOR, long_mscale=PHI_FACTOR)),
              "llama4_text": dict(hidden_size=64, no_rope_layer_interval=4, attention_chunk_size=8192,
                                  floor_scale=8192, attn_scale=0.1),
              "granitemoehybrid": dict(hidden_size=32, mamba_n_heads=4)}
# config.json as the published checkpoints write it, where transformers 5.24 saves another spelling: Phi-3.5-MoE's
# architecture name (the converter registers PhiMoEForCausalLM), Granite 4.0-H's layer types (mamba / attention:
# the converter finds attention layers by that name)
RELEASED = {"phimoe": lambda c: c.update(architectures=["PhiMoEForCausalLM"]),
            "granitemoehybrid": lambda c: c.update(layer_types=[{"linear_attention": "mamba"}.get(
                t, "attention") for t in c["layer_types"]])}


@pytest.fixture(scope="module")
def family_ggufs(tmp_path_factory):
    """case -> (checkpoint dir, tokenizer, f32 GGUF, q8_0 GGUF); one converter process for all."""
    import torch
    import gguf_models as gm
    import llamacpp_convert
    from hf_models import add_mtp_weights, config_for, randomize
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("gguf_families3")
    jobs, built = [], {}
    for case, over in GGUF_CASES.items():
        hf = str(d / case)
        ft = gm.build_tokenizer(hf)
        mt, kw = FAMILY_CASES[case]
        cfg = config_for(mt, **dict(kw, vocab_size=len(ft), **over))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        randomize(model, cfg)
        model.save_pretrained(hf)
        if mt == "qwen3_next":
            add_mtp_weights(hf, cfg)
        if case in RELEASED:
            with open(os.path.join(hf, "config.json")) as f:
                c = json.load(f)
            RELEASED[case](c)
            with open(os.path.join(hf, "config.json"), "w") as f:
                json.dump(c, f)
        built[case] = (hf, ft)
        jobs += [(hf, str(d / f"{case}-f32.gguf"), "f32", "gpt-2"), (hf, str(d / f"{case}-q8.gguf"), "q8_0", "gpt-2")]
    paths = llamacpp_convert.convert_many(jobs)
    return {case: (*built[case], paths[2 * i], paths[2 * i + 1]) for i, case in enumerate(GGUF_CASES)}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_matches_transformers(backend_name, case, family_ggufs, tmp_path):
    from colibri_edge.model.convert import convert
    from hf_models import hf_logits, reference_mtp_logits
    hf, ft, f32, _ = family_ggufs[case]
    cfg = convert(f32, str(tmp_path / "m"), progress=False)
    assert cfg["model_type"] == case
    if case == "qwen3_next":
        assert cfg["norm_topk_prob"] and cfg["layer_types"] == FAMILY_CASES[case][1]["layer_types"]
        assert cfg["linear_attention"].get("value_head_order", "grouped") == "grouped"
    elif case == "lfm2_moe":
        assert cfg["layer_types"] == ["short_conv", "full_attention", "short_conv", "short_conv"]
        assert cfg["short_conv"] == {"conv_kernel": 3} and cfg["tie_word_embeddings"] and cfg["router_choice_bias"]
        assert [l["type"] for l in cfg["layers"]] == ["dense", "moe", "moe", "moe"]
    elif case == "minimax_m2":
        assert cfg["rope_dim"] == 8 and cfg["router_score"] == "sigmoid" and cfg["router_choice_bias"]
    elif case == "hunyuan_v1_moe":
        assert cfg["qk_norm"] == "per_head_after_rope" and cfg["norm_topk_prob"] and cfg["top_k"] == 2
    elif case == "phimoe":
        rs = cfg["rope_scaling"]
        assert np.allclose(rs["short_factor"], FAMILY_CASES[case][1]["rope_parameters"]["short_factor"], rtol=1e-7)
        assert abs(rs["attention_factor"] - PHI_FACTOR) < 1e-6 and cfg["router_jitter"] == 0.01
        assert cfg["lm_head_bias"] and cfg["norm_type"] == "layernorm"
    elif case == "llama4_text":
        # the llama3 table as llama.cpp's rope_freqs divisors: the same frequencies as the checkpoint's
        from colibri_edge.runtime.rope import inv_freq
        assert cfg["rope_scaling"]["rope_type"] == "freq_factors" and cfg["attention_chunk"] == 8192
        rp = FAMILY_CASES[case][1]["rope_parameters"]
        want_f, _ = inv_freq(rp["rope_theta"], 12, {k: v for k, v in rp.items() if k != "rope_theta"})
        got_f, _ = inv_freq(cfg["rope_theta"], 12, cfg["rope_scaling"])
        assert np.allclose(got_f, want_f, rtol=1e-6, atol=0)
        assert [bool(l.get("nope")) for l in cfg["layers"]] == [False, False, False, True]
    else:                   # Granite 4.0-H: the multipliers taken out exactly (granitemoehybrid.py)
        kw = FAMILY_CASES[case][1]
        r = kw["residual_multiplier"]
        assert cfg["layer_types"] == ["mamba", "full_attention", "mamba", "mamba"] and cfg["layers"][1]["nope"]
        assert cfg["embed_scale"] == pytest.approx(kw["embedding_multiplier"] / r)
        assert cfg["rms_norm_eps"] == pytest.approx(1e-6 / r ** 2) and cfg["mamba"]["norm_eps"] == pytest.approx(1e-6)
        assert cfg["attention_scale"] == pytest.approx(kw["attention_multiplier"])
    ids = np.random.default_rng(3).integers(0, len(ft), size=(2, 19))
    want = hf_logits(hf, ids)
    with Engine.open(str(tmp_path / "m"), backend=backend_name, max_seq_len=64, **fp32(backend_name)) as eng:
        assert np.abs(eng.infer(ids) - want).max() / np.abs(want).max() < 1e-4
    if case == "qwen3_next":
        # llama.cpp's converter exports the checkpoint's MTP head (blk.L.nextn.*): imported as the head, its
        # logits the published module's on the checkpoint's own tensors
        assert cfg["mtp"]["layers"][0]["layer_id"] == cfg["num_hidden_layers"]
        seqids = ids[0].astype(np.int32)
        ref = reference_mtp_logits(hf, seqids, str(tmp_path / "ref"))
        with Engine.open(str(tmp_path / "m"), backend=backend_name, draft="mtp", max_seq_len=64,
                         **fp32(backend_name)) as eng:
            got = mtp_logits(eng, seqids)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_gguf_q8_0_runs_as_stored(backend_name, family_ggufs, tmp_path):
    """The q8_0 files: Qwen3-Next's ssm_ba rows cut into b and a (per key head, whole rows: never
    requantised) and attn_qkv as stored, MiniMax-M2's attn_q rows reordered for partial rotary, LFM2's
    in_proj thirds, Granite 4.0-H's ssm_in cut into z / xBC / dt, Llama 4's q rows un-permuted, each equal
    to the file's decoded rows; every backend equal to the reference backend on the same file (float32
    activations), Hunyuan-MoE's and Phi-3.5-MoE's too."""
    import gguf
    from colibri_edge.model.convert import convert
    from colibri_edge.model.dtypes import widen
    from colibri_edge.model.modeldir import ModelDir
    from colibri_edge.model.families.common import rope_dim_order
    _, _, _, mq8 = family_ggufs["minimax_m2"]
    mcfg = convert(mq8, str(tmp_path / "mq8"), progress=False)
    mm = ModelDir(str(tmp_path / "mq8"))
    q = {x.name: x for x in gguf.GGUFReader(mq8).tensors}["blk.1.attn_q.weight"]
    D = mcfg["head_dim"]
    rows = gguf.dequantize(q.data, q.tensor_type).reshape(mcfg["num_attention_heads"], D, -1)[:, rope_dim_order(D, 8)]
    assert mm.tensor_dtype("layers.1.attn.wq") == "q8_0"
    assert (widen(mm.raw_tensor("layers.1.attn.wq"), "q8_0") == rows.reshape(-1, rows.shape[-1])).all()
    hf, ft, _, q8 = family_ggufs["qwen3_next"]
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
    _, _, _, lq8 = family_ggufs["lfm2_moe"]
    lcfg = convert(lq8, str(tmp_path / "lq8"), progress=False)
    lm = ModelDir(str(tmp_path / "lq8"))
    inp = gguf.dequantize(*(lambda x: (x.data, x.tensor_type))({x.name: x for x in gguf.GGUFReader(lq8).tensors}[
        "blk.0.shortconv.in_proj.weight"]))
    H = lcfg["hidden_size"]
    for j, part in enumerate("bcx"):
        assert lm.tensor_dtype(f"layers.0.conv.w{part}") == "q8_0"
        assert (widen(lm.raw_tensor(f"layers.0.conv.w{part}"), "q8_0") == inp[j * H:(j + 1) * H]).all(), part
    # Granite 4.0-H: ssm_in's rows cut into z / xBC / dt; Llama 4: q rows un-permuted to the half-split pairs
    _, _, _, gq8 = family_ggufs["granitemoehybrid"]
    gcfg = convert(gq8, str(tmp_path / "gq8"), progress=False)
    gm_ = ModelDir(str(tmp_path / "gq8"))
    t = {x.name: x for x in gguf.GGUFReader(gq8).tensors}
    inp = gguf.dequantize(t["blk.0.ssm_in.weight"].data, t["blk.0.ssm_in.weight"].tensor_type)
    mb = gcfg["mamba"]
    D = mb["num_heads"] * mb["head_dim"]
    edges = (0, D, 2 * D + 2 * mb["state_size"], 2 * D + 2 * mb["state_size"] + mb["num_heads"])
    for j, part in enumerate(("wz", "wxbc", "wdt")):
        fmt = gm_.tensor_dtype(f"layers.0.ssm.{part}")          # dt's rows decoded (a float32 matrix)
        assert fmt == ("float32" if part == "wdt" else "q8_0")
        got = widen(gm_.raw_tensor(f"layers.0.ssm.{part}"), fmt)
        assert (got == inp[edges[j]:edges[j + 1]]).all(), part
    _, _, _, l4q8 = family_ggufs["llama4_text"]
    l4cfg = convert(l4q8, str(tmp_path / "l4q8"), progress=False)
    l4 = ModelDir(str(tmp_path / "l4q8"))
    t = {x.name: x for x in gguf.GGUFReader(l4q8).tensors}
    q = gguf.dequantize(t["blk.0.attn_q.weight"].data, t["blk.0.attn_q.weight"].tensor_type)
    hd = l4cfg["head_dim"]
    half = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])        # interleaved pairs -> halves
    want = q.reshape(l4cfg["num_attention_heads"], hd, -1)[:, half].reshape(q.shape)
    assert l4.tensor_dtype("layers.0.attn.wq") == "q8_0"
    assert (widen(l4.raw_tensor("layers.0.attn.wq"), "q8_0") == want).all()
    ids = np.random.default_rng(4).integers(0, len(ft), size=(1, 17))
    from colibri_edge.backends import backend_class
    opts = dict(fp32(backend_name), **({"int8_activations": False} if "int8_activations" in
                                       backend_class(backend_name).OPTIONS else {}))
    for case in ("hunyuan_v1_moe", "phimoe"):
        convert(family_ggufs[case][3], str(tmp_path / case), progress=False)
    for model in (out, str(tmp_path / "mq8"), str(tmp_path / "lq8"), str(tmp_path / "gq8"), str(tmp_path / "l4q8"),
                  str(tmp_path / "hunyuan_v1_moe"), str(tmp_path / "phimoe")):
        with Engine.open(model, backend="reference", max_seq_len=64) as eng:
            ref = eng.infer(ids)
        with Engine.open(model, backend=backend_name, max_seq_len=64, **opts) as eng:
            got = eng.infer(ids)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4, model


def _sc(**kw):
    return lambda c: c["short_conv"].update(kw)


@pytest.mark.parametrize("edit,field,words", [
    (_sc(conv_kernel=1), "short_conv.conv_kernel", "out of range"),
    (_sc(conv_kernel=9), "short_conv.conv_kernel", "out of range"),
    (_sc(conv_kernel=4), "layers.0.conv.w", "shape"),
    (_sc(taps=3), "short_conv.taps", "not a field"),
    (lambda c: c.pop("short_conv"), "short_conv", "missing"),
    (lambda c: c.update(layer_types=["full_attention"] * 4), "layer_types", "no short_conv"),
])
def test_short_conv_fields_are_checked(model_cache, tmp_path, edit, field, words):
    """LFM2's short-convolution fields typed and ranged, refused by name; a config implying other tensors
    than the directory holds refused naming the tensor."""
    from helpers import refused_edit
    from hf_models import convert_case
    refused_edit(convert_case(model_cache, "lfm2_moe")[1], str(tmp_path / "m"), edit, field, words)


def test_lfm2_refusals_by_name():
    """What the LFM2-MoE converter cannot compute is refused naming the field."""
    from colibri_edge import ColibriError
    from colibri_edge.model.convert import translate_config
    from hf_models import config_for
    base = config_for(*[FAMILY_CASES["lfm2_moe"][0]], **FAMILY_CASES["lfm2_moe"][1]).to_dict()
    for field, value in (("conv_bias", True), ("layer_types", ["conv"] * 4), ("layer_types", ["mamba"] * 4),
                         ("conv_L_cache", 12), ("rope_parameters", dict(rope_type="yarn", factor=2.0, rope_theta=1e4))):
        with pytest.raises(ColibriError) as e:
            translate_config({**base, field: value}, {}, "config.json")
        assert field in e.value.message


def test_longrope_tables_are_transformers(model_cache):
    """LongRoPE (Phi-3.5-MoE): the short and long frequency tables against transformers' own
    _compute_longrope_parameters (seq_len within and past the original context), the attention factor
    sqrt(1 + ln(factor) / ln(L0)) when no mscale is given; an engine opened past the original context runs
    the long table with long_mscale squared on the scores, one within it the short one."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from colibri_edge.runtime import rope
    from transformers import Phi3Config
    from hf_models import convert_case
    _, kw = FAMILY_CASES["phimoe"]
    rp = {k: v for k, v in kw["rope_parameters"].items() if not k.endswith("mscale")}
    hf = Phi3Config(hidden_size=48, num_attention_heads=4, max_position_embeddings=256, rope_parameters=rp,
                    original_max_position_embeddings=rp["original_max_position_embeddings"])
    ours = dict(rp, factor=hf.max_position_embeddings / rp["original_max_position_embeddings"])
    for seq_len, long in ((100, False), (200, True)):
        f, af = ROPE_INIT_FUNCTIONS["longrope"](hf, torch.device("cpu"), seq_len=seq_len)
        got, gaf = rope.inv_freq(rp["rope_theta"], 12, ours, long=long)
        np.testing.assert_allclose(got, f.numpy(), rtol=1e-6)
        assert abs(gaf - af) < 1e-6 and gaf > 1.0
    _, col = convert_case(model_cache, "phimoe")
    rs = kw["rope_parameters"]
    for max_seq_len, factors, mscale in ((128, "short_factor", "short_mscale"), (256, "long_factor", "long_mscale")):
        with Engine.open(col, backend="reference", max_seq_len=max_seq_len) as eng:
            att = eng.runner.program.layers[0].mixer
            want = 1.0 / (np.asarray(rs[factors], np.float32) * np.float32(1e4) ** (np.arange(0, 12, 2,
                                                                                        dtype=np.float32) / 12))
            np.testing.assert_allclose(att.inv_freq, want, rtol=1e-6)
            assert abs(att.scale - 12 ** -0.5 * rs[mscale] ** 2) < 1e-6


@pytest.mark.parametrize("edit,field,words", [
    (lambda c: c.update(top_k=3), "top_k", "sparsemixer"),
    (lambda c: c.pop("router_jitter"), "router_jitter", "missing"),
    (lambda c: c.update(router_jitter=2.0), "router_jitter", "out of range"),
    (lambda c: c.update(norm_type="batchnorm"), "norm_type", "is not one of"),
    (lambda c: c["rope_scaling"].update(short_factor=[1.0] * 5), "rope_scaling.short_factor", "head_dim / 2"),
    (lambda c: c["rope_scaling"].update(long_factor=[1.0] * 5 + [-1.0]), "rope_scaling.long_factor[5]", "range"),
    (lambda c: c["rope_scaling"].pop("long_factor"), "rope_scaling.long_factor", "missing"),
    (lambda c: c.update(norm_type="rmsnorm"), "input_norm_bias", "not"),
    (lambda c: c.pop("lm_head_bias"), "lm_head_bias", "not"),
])
def test_phimoe_fields_are_checked(model_cache, tmp_path, edit, field, words):
    """Phi-3.5-MoE's fields (sparsemixer, LayerNorm, LongRoPE, head bias) typed and ranged, refused by name;
    a config implying other tensors than the directory holds refused naming the tensor."""
    from helpers import refused_edit
    from hf_models import convert_case
    refused_edit(convert_case(model_cache, "phimoe")[1], str(tmp_path / "m"), edit, field, words)


def test_llama3_rope_table_is_transformers():
    """Llama 4's llama3 rope scaling: the frequency table against transformers' own
    _compute_llama3_parameters, with wavelengths in each of its three ranges."""
    import torch
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from colibri_edge.runtime import rope
    rp = FAMILY_CASES["llama4_text"][1]["rope_parameters"]
    hf = Llama4TextConfig(hidden_size=48, num_attention_heads=4, head_dim=12, rope_parameters=rp)
    f, af = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    got, gaf = rope.inv_freq(rp["rope_theta"], 12, {k: v for k, v in rp.items() if k != "rope_theta"})
    np.testing.assert_allclose(got, f.numpy(), rtol=1e-6)
    plain, _ = rope.inv_freq(rp["rope_theta"], 12)
    wl = 2 * np.pi / plain
    L0 = rp["original_max_position_embeddings"]
    assert (wl < L0 / 4).any() and ((wl > L0 / 4) & (wl < L0)).any() and (wl > L0).any() and gaf == af == 1.0


@pytest.mark.parametrize("edit,field,words", [
    (lambda c: c.pop("attention_chunk"), "attention_chunk", "together"),
    (lambda c: c.update(attention_chunk=0), "attention_chunk", "out of range"),
    (lambda c: c["attn_temperature"].pop("attn_scale"), "attn_temperature.attn_scale", "missing"),
    (lambda c: c["attn_temperature"].update(floor_scale=0), "attn_temperature.floor_scale", "out of range"),
    (lambda c: c.update(top_k=2), "router_input_scale", "top-1"),
    (lambda c: c["layers"][1].update(nope="yes"), "layers[1].nope", "expected"),
    (lambda c: c["rope_scaling"].update(high_freq_factor=0.5), "rope_scaling.high_freq_factor", "must exceed"),
    (lambda c: c["rope_scaling"].pop("low_freq_factor"), "rope_scaling.low_freq_factor", "missing"),
    (lambda c: c.update(qk_norm="per_head"), "attn.q_norm", "missing"),
])
def test_llama4_fields_are_checked(model_cache, tmp_path, edit, field, words):
    """Llama 4's fields (chunked attention, the no-rope layers' temperature, the input-scaled top-1 router,
    llama3 rope) typed and ranged, refused by name; a config implying other tensors refused naming one."""
    from helpers import refused_edit
    from hf_models import convert_case
    refused_edit(convert_case(model_cache, "llama4_text")[1], str(tmp_path / "m"), edit, field, words)


def test_a_wrapped_llama4_runs_its_text_model(tmp_path):
    """A llama4 checkpoint (Llama4ForConditionalGeneration: a vision tower and projector beside the text
    model under language_model.*): the tower skipped, the text model converted, its logits those of the
    checkpoint's own language model (the wrapper's forward needs image inputs in transformers 5.24)."""
    import torch
    import transformers
    from colibri_edge.model.convert import convert
    from hf_models import randomize
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    cfg = transformers.Llama4Config(text_config=dict(FAMILY_CASES["llama4_text"][1]), vision_config=vc)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration._from_config(cfg, attn_implementation="eager").eval()
    randomize(model, cfg.text_config)
    model.save_pretrained(str(tmp_path / "hf"))
    out = convert(str(tmp_path / "hf"), str(tmp_path / "m"), progress=False)
    assert out["model_type"] == "llama4_text" and out["attention_chunk"] == 5
    ids = np.random.default_rng(0).integers(0, cfg.text_config.vocab_size, size=(2, 13))
    with torch.no_grad():
        want = model.language_model(input_ids=torch.as_tensor(ids)).logits.numpy()
    with Engine.open(str(tmp_path / "m"), backend="reference", max_seq_len=64) as eng:
        got = eng.infer(ids)
    assert np.abs(want).max() > 1.0 and np.abs(got - want).max() / np.abs(want).max() < 1e-4


def _mb(**kw):
    return lambda c: c["mamba"].update(kw)


@pytest.mark.parametrize("edit,field,words", [
    (_mb(conv_kernel=1), "mamba.conv_kernel", "out of range"),
    (_mb(conv_kernel=3), "layers.0.ssm.conv", "shape"),
    (_mb(state_size=16), "layers.0.ssm.wxbc", "shape"),
    (_mb(n_groups=2), "mamba.n_groups", "one group"),
    (_mb(chunk=8), "mamba.chunk", "not a field"),
    (lambda c: c["mamba"].pop("head_dim"), "mamba.head_dim", "missing"),
    (lambda c: c.pop("mamba"), "mamba", "missing"),
    (lambda c: c.update(layer_types=["full_attention"] * 4), "layer_types", "no mamba"),
    (lambda c: c["layers"][0].update(head_dim=8), "layers", "per-layer attention geometry"),
])
def test_mamba_fields_are_checked(model_cache, tmp_path, edit, field, words):
    """Granite 4.0-H's Mamba-2 fields typed and ranged, refused by name; a config implying other tensors
    than the directory holds refused naming the tensor."""
    from helpers import refused_edit
    from hf_models import convert_case
    refused_edit(convert_case(model_cache, "granitemoehybrid")[1], str(tmp_path / "m"), edit, field, words)


def test_granite_hybrid_refusals_by_name():
    """What the Granite 4.0-H converter cannot compute is refused naming the field; the older spelling of
    the layer types ("mamba" / "attention") is the same model."""
    from colibri_edge import ColibriError
    from colibri_edge.model.convert import translate_config
    from hf_models import config_for
    base = config_for(FAMILY_CASES["granitemoehybrid"][0], **FAMILY_CASES["granitemoehybrid"][1]).to_dict()
    for field, value in (("mamba_proj_bias", True), ("mamba_conv_bias", False), ("time_step_limit", [0.0, 10.0]),
                         ("mamba_n_groups", 2), ("num_local_experts", 0), ("position_embedding_type", "alibi"),
                         ("layer_types", ["conv"] * 4), ("mamba_d_head", 12), ("mamba_d_conv", 12)):
        with pytest.raises(ColibriError) as e:
            translate_config({**base, field: value}, {}, "config.json")
        assert field in e.value.message, (field, e.value.message)
    old = translate_config({**base, "layer_types": ["mamba", "attention", "mamba", "mamba"]}, {}, "config.json")
    assert old == translate_config(base, {}, "config.json")
    assert old["layer_types"] == ["mamba", "full_attention", "mamba", "mamba"] and old["layers"][1]["nope"]
    roped = translate_config({**base, "position_embedding_type": "rope"}, {}, "config.json")
    assert not any(l.get("nope") for l in roped["layers"])


def test_mamba_state_is_constant_and_counted(model_cache, capsys):
    """The Mamba-2 layers' state per sequence is the conv's last K-1 inputs and S [nh, P, N] per layer, the
    same at a context of 256 as at 64 (only the attention layer's KV grows); inspect prints it per layer;
    a Granite-4.0-H-Tiny-shaped config (48 heads of 64, a state of 128, 4 taps, 1536 hidden) holds
    39,936 + 1,572,864 bytes a Mamba-2 layer."""
    from colibri_edge.analysis.sizing import kv_full_bytes_per_token, state_bytes_per_sequence
    from colibri_edge.model.convert import translate_config
    from colibri_edge.model.modeldir import ModelDir
    from colibri_edge.serving.cli import main
    from hf_models import config_for, convert_case
    _, col = convert_case(model_cache, "granitemoehybrid")
    cfg = ModelDir(col).config
    mb = cfg["mamba"]
    per_layer = 4 * (3 * (3 * 16 + 2 * 8) + 3 * 16 * 8)
    assert state_bytes_per_sequence(cfg) == 3 * per_layer
    got = {}
    for ctx in (64, 256):
        with Engine.open(col, backend="reference", max_seq_len=ctx, max_batch=1, prefill_chunk=32,
                         kv_cache_tokens=ctx) as eng:
            got[ctx] = (eng.runner.state_bytes, eng.runner.state_bytes_per_seq)
    assert got[64][1] == got[256][1] == 3 * per_layer
    assert got[256][0] - got[64][0] == (256 - 64) * kv_full_bytes_per_token(cfg) > 0
    assert mb == {"conv_kernel": 4, "num_heads": 3, "head_dim": 16, "n_groups": 1, "state_size": 8}
    main(["inspect", col])
    out = capsys.readouterr().out
    assert f"Mamba-2 (3 heads of 16, state 8, conv 4; state {per_layer} bytes)" in out
    assert "3 Mamba-2 layers" in out
    tiny = translate_config(config_for("granitemoehybrid", hidden_size=1536, num_hidden_layers=4,
                                       layer_types=["linear_attention"] * 3 + ["full_attention"], mamba_n_heads=48,
                                       mamba_d_head=64, mamba_d_state=128, mamba_d_conv=4, num_attention_heads=12,
                                       num_key_value_heads=4, num_local_experts=8, intermediate_size=512).to_dict(),
                            {}, "config.json")
    assert state_bytes_per_sequence(tiny) == 3 * (39_936 + 1_572_864)


U32, F32, ARRAY = 4, 6, 9   # gguf.GGUFValueType.UINT32 / FLOAT32 / ARRAY (gguf is imported inside the tests)


# case -> (what the file is changed by: fields {key: (value, type)} and names dropped, the field the refusal names,
# words of its message): what each arch's import refuses rather than guesses
GGUF_REFUSALS = [
    ("hunyuan_v1_moe", {"hunyuan-moe.expert_shared_feed_forward_length": (48, U32)}, (),
     "expert_shared_feed_forward_length", "a shared MLP of 48"),
    ("hunyuan_v1_moe", {"hunyuan-moe.expert_shared_count": (2, U32)}, (), "expert_shared_count", "2 shared experts"),
    ("phimoe", {}, ("rope_factors_long.weight",), "rope_factors_long.weight", "both factor lists"),
    ("llama4_text", {"llama4.attention.sliding_window": (0, U32)}, (), "attention.sliding_window",
     "its own attention pattern"),
    ("llama4_text", {}, (), "rope_freqs.weight", "positive"),
    ("granitemoehybrid", {"granitehybrid.expert_count": (0, U32)}, (), "expert_count", "without routed experts"),
    ("granitemoehybrid", {"granitehybrid.residual_scale": (-1.0, F32)}, (), "residual_scale", "positive finite"),
    ("granitemoehybrid", {"granitehybrid.ssm.inner_size": (50, U32)}, (), "ssm.inner_size", "multiple"),
    # what llama.cpp's converter writes from a transformers 5 config (full_attention): every layer 0 KV heads
    ("granitemoehybrid", {"granitehybrid.attention.head_count_kv": ([0, 0, 0, 0], ARRAY, U32)}, (),
     "attention.head_count_kv", "layer 1 is a Mamba-2 layer here"),
]


@pytest.mark.parametrize("case,fields,drop,field,words", GGUF_REFUSALS,
                         ids=[f"{c}-{f}" for c, _, _, f, _ in GGUF_REFUSALS])
def test_gguf_refusals_by_name(family_ggufs, tmp_path, case, fields, drop, field, words):
    import gguf
    import gguf_models as gm
    from colibri_edge import COLIBRI_ERR_INVALID_MODEL, ColibriError
    from colibri_edge.model.convert import convert
    src = family_ggufs[case][2]
    bad = tmp_path / "bad.gguf"
    fields = {k: (v, *map(gguf.GGUFValueType, t)) for k, (v, *t) in fields.items()}
    edit = {field: lambda f: np.where(np.arange(f.size) == 0, 0.0, f)} if field == "rope_freqs.weight" else None
    gm.rewrite_gguf(src, bad, fields=fields, drop=drop, edit=edit)      # rope_freqs: a zero divisor
    with pytest.raises(ColibriError) as e:
        convert(str(bad), str(tmp_path / "out"), progress=False)
    assert e.value.code == COLIBRI_ERR_INVALID_MODEL and field in str(e.value) and words in str(e.value), str(e.value)



@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_q8_0_is_its_files_truth(case, family_ggufs, tmp_path):
    """Each q8_0 file against its own truth: the same file with every tensor dequantised by gguf-py and stored
    float32, run alike (reference backend, float32 activations): equal within float rounding. (Against
    transformers on the f32 checkpoint a q8_0 file moves the logits by 0.1-0.3 of the largest, up to 1.3 for
    Qwen3-Next: the 8-bit rounding flips near-tied expert choices of a random MoE -- the file's weights are
    not the checkpoint's, so that is not the measure.)"""
    import gguf_models as gm
    from colibri_edge.model.convert import convert
    q8 = family_ggufs[case][3]
    gm.rewrite_gguf(q8, tmp_path / "truth.gguf", dequantize=True)
    ids = np.random.default_rng(5).integers(0, len(family_ggufs[case][1]), size=(2, 19))
    got = {}
    for name, path in (("q8", q8), ("truth", str(tmp_path / "truth.gguf"))):
        convert(path, str(tmp_path / name), progress=False)
        with Engine.open(str(tmp_path / name), backend="reference", max_seq_len=64) as eng:
            got[name] = eng.infer(ids)
    err = np.abs(got["q8"] - got["truth"]).max() / np.abs(got["truth"]).max()
    assert err < 1e-5, err
