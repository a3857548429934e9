"""Latent attention (issue 17: DeepSeek-V2, DeepSeek-V3 / Moonlight, GLM-4.7-Flash) against transformers
on tiny random checkpoints, on every backend: the latent cache (kv_lora_rank + rope key per token and
layer), decode in the latent space (the up-projections absorbed into the query and output sides),
q through a low rank or projected, interleaved and half-split rope, YaRN's mscale; the routers
(softmax or sigmoid scores, the choice-only correction bias, group-limited top-k, routed scaling),
ungated shared experts and dense first layers."""
import json
import os

import numpy as np
import pytest

from colibri_edge import Engine, ColibriError, COLIBRI_ERR_INVALID_MODEL
from colibri_edge.model.convert import translate_config
from helpers import activation_runs, close, edit_json, fp32, refused
from hf_models import FAMILY_CASES, config_for, convert_case

CASES = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


def open_engine(col, name, **kw):
    return Engine.open(col, backend=name, **fp32(name), **kw)


@pytest.mark.parametrize("case", CASES)
def test_latent_cache_bytes(case, model_cache, capsys):
    """The latent cache: (kv_lora_rank + qk_rope_head_dim) x layers x 4 bytes per token, what
    `colibri inspect` prints and what the engine allocates (one pool, c and r per layer), against
    heads x (k + v) for full heads, and what the simulator's memory fit (planning.engine_memory) counts;
    no arena buffer grows with the cache (two cache sizes, one arena)."""
    from colibri_edge.serving.cli import main
    from colibri_edge.model.modeldir import ModelDir
    _, col = convert_case(model_cache, case)
    cfg = ModelDir(col).config
    la, L, nh = cfg["latent_attention"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    per_token = (la["kv_lora_rank"] + la["qk_rope_head_dim"]) * L * 4
    full = nh * (la["qk_nope_head_dim"] + la["qk_rope_head_dim"] + la["v_head_dim"]) * L * 4
    assert main(["inspect", col, "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert f"KV cache: {per_token} bytes per token" in out
    assert f"{per_token} bytes per token, against {full} for full heads" in out
    arenas = []
    for tokens in (64, 640):
        with Engine.open(col, backend="reference", max_seq_len=64, kv_cache_tokens=tokens, kv_block_size=16) as eng:
            (pool,) = eng.runner.states.paged
            assert pool.bytes_per_token() == per_token
            assert eng.runner.state_bytes == per_token * tokens
            shapes = {k[1:]: v for k, v in eng.runner.states.storage().items()}
            assert shapes[(0, "c")] == (tokens, 1, la["kv_lora_rank"])
            assert shapes[(0, "r")] == (tokens, 1, la["qk_rope_head_dim"])
            arenas.append({n: s for n, (s, _) in eng.runner.spec.items() if not n.startswith("inputs")})
        from colibri_edge.analysis.sizing import engine_memory      # what the simulator's memory fit counts
        assert engine_memory(cfg, 64, 1, 64, tokens, 16)["state_bytes"] == per_token * tokens
    assert arenas[0] == arenas[1]


def _hf(case, **kw):
    mt, base = FAMILY_CASES[case]
    return config_for(mt, **{**base, **kw}).to_dict()


@pytest.mark.parametrize("case,kw,field", [
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias"),
    ("deepseek_v3", dict(n_group=3), "n_group"),
    ("glm4_moe_lite", dict(hidden_act="gelu"), "hidden_act"),
    ("deepseek_v2", dict(num_experts_per_tok=12, n_group=4, topk_group=2), "num_experts_per_tok"),
])
def test_mla_configs_refused_by_name(case, kw, field):
    """What the family's configs can ask for that Colibri does not run is refused, naming the field."""
    with pytest.raises(ColibriError) as e:
        translate_config(_hf(case, **kw), {})
    assert e.value.code == COLIBRI_ERR_INVALID_MODEL and field in str(e.value)


def test_mtp_layer_refused_when_partial_and_left_out_on_request(model_cache, tmp_path, capsys):
    """A V3-style checkpoint's multi-token-prediction layer (model.layers.L.*) is converted as the MTP
    head (test_mtp.py); one that lacks its tensors is refused, naming the first missing; with
    mtp=False (convert --no-mtp) it is skipped with a note on stderr, and the model converts to the
    same weights as without it."""
    from safetensors.numpy import load_file, save_file
    from colibri_edge.model.convert import convert
    hf, col = convert_case(model_cache, "deepseek_v3")
    cfg = json.load(open(os.path.join(hf, "config.json")))
    L = cfg["num_hidden_layers"]
    src = tmp_path / "hf"
    src.mkdir()
    for n in os.listdir(hf):
        if n.endswith(".json"):
            (src / n).write_bytes(open(os.path.join(hf, n), "rb").read())
    state = load_file(os.path.join(hf, "model.safetensors"))
    state[f"model.layers.{L}.eh_proj.weight"] = np.ones((4, 4), np.float32)
    state[f"model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight"] = np.ones((4, 4), np.float32)
    save_file(state, str(src / "model.safetensors"))
    cfg["num_nextn_predict_layers"] = 1
    json.dump(cfg, open(src / "config.json", "w"))
    with pytest.raises(ColibriError) as e:
        convert(str(src), str(tmp_path / "bad"), progress=False)
    assert e.value.code == COLIBRI_ERR_INVALID_MODEL and f"model.layers.{L}.enorm.weight" in e.value.message
    capsys.readouterr()
    convert(str(src), str(tmp_path / "col"), progress=True, mtp=False)
    assert "2 tensors of 1 multi-token-prediction layer(s) skipped" in capsys.readouterr().err
    assert open(tmp_path / "col" / "colibri_weights.bin", "rb").read() == \
        open(os.path.join(col, "colibri_weights.bin"), "rb").read()


def test_mla_full_size_kv_bytes():
    """transformers' own DeepSeek-V2-Lite-shaped and GLM-4.7-Flash configs: one latent pool, and the KV
    bytes per token `inspect` reports (fp32 cache) against a Mixtral-shaped model of the same hidden
    size and layers (16 heads of 128, 4 KV heads): V2-Lite 27 x (512 + 64) x 4 = 62208 against
    27 x 2 x 4 x 128 x 4 = 110592; GLM-4.7-Flash 47 x 576 x 4 = 108288 against 192512 (1.78x)."""
    import transformers
    from colibri_edge.analysis.sizing import kv_full_bytes_per_token
    from colibri_edge.runtime.state import attention_pools
    lite = translate_config(transformers.DeepseekV2Config(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, first_k_dense_replace=1, moe_intermediate_size=1408, intermediate_size=10944,
        vocab_size=102400).to_dict(), {}, dtype="bfloat16")
    glm = translate_config(transformers.Glm4MoeLiteConfig().to_dict(), {}, dtype="bfloat16")
    for cfg, L in ((lite, 27), (glm, 47)):
        (pool,) = attention_pools(cfg, 4, 16)
        assert pool.layers == tuple(range(L)) and pool.shapes == {"c": (1, 512), "r": (1, 64)}
        assert kv_full_bytes_per_token(cfg) == L * (512 + 64) * 4
        mixtral = translate_config(transformers.MixtralConfig(hidden_size=2048, num_hidden_layers=L,
                                                              num_attention_heads=16, num_key_value_heads=4,
                                                              head_dim=128).to_dict(), {}, dtype="bfloat16")
        assert kv_full_bytes_per_token(mixtral) == L * 2 * 4 * 128 * 4
        assert kv_full_bytes_per_token(mixtral) / kv_full_bytes_per_token(cfg) == pytest.approx(1024 / 576)
    assert lite["layers"][0]["type"] == "dense" and lite["layers"][1]["type"] == "moe_shared"
    assert glm["router_score"] == "sigmoid" and glm["routed_scaling_factor"] == 1.8 and glm["top_k"] == 4


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def mla_gguf(request, tmp_path_factory):
    """llama.cpp's converter (arch deepseek2) on tiny DeepSeek-V2 / V3 checkpoints with a byte-level BPE
    tokenizer, float32 and q8_0 (V3's config carries scoring_func sigmoid, as DeepSeek's does: the file's
    expert_gating_func; V2's YaRN with mscale = mscale_all_dim, as V2-Lite's: what a file can say)."""
    import torch
    import gguf_models as gm
    from transformers import AutoModelForCausalLM
    from hf_models import randomize
    case = request.param
    d = tmp_path_factory.mktemp(f"gguf_{case}")
    hf = str(d / "hf")
    ft = gm.build_tokenizer(hf)
    kw = dict(FAMILY_CASES[case][1], vocab_size=len(ft))
    if case == "deepseek_v2":
        kw["rope_parameters"] = dict(kw["rope_parameters"], mscale=0.707, mscale_all_dim=0.707)
    else:
        kw.update(scoring_func="sigmoid", topk_method="noaux_tc")
    cfg = config_for(case, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize(model, cfg)
    model.save_pretrained(hf)
    return case, hf, ft, gm.to_gguf(hf, str(d / "f32.gguf"), "f32"), gm.to_gguf(hf, str(d / "q8.gguf"), "q8_0")


def test_mla_gguf(backend_name, mla_gguf, tmp_path):
    """A deepseek2 GGUF (split attn_k_b / attn_v_b, rotated rows in adjacent pairs, exp_probs_b, expert
    groups, gating function, weights scale and norm, leading dense layers, YaRN's log multiplier) gives
    the checkpoint's logits within float32 tolerance, and its q8_0 file (the per-head matrices run as
    float16) the reference backend's logits of the same file within 1e-4 (int8 activations: their
    tolerance), the reference's the checkpoint's within quantisation error (at the median position: a
    top-1 choice may flip)."""
    from colibri_edge.model.convert import convert
    from hf_models import hf_logits
    case, hf, ft, f32, q8 = mla_gguf
    ids = np.random.default_rng(3).integers(0, len(ft), size=(2, 11))
    want = hf_logits(hf, ids)
    scale = np.abs(want).max()
    cfg = convert(f32, str(tmp_path / "f32"), progress=False)
    assert cfg["model_type"] == case and cfg["latent_attention"]["kv_lora_rank"] == FAMILY_CASES[case][1]["kv_lora_rank"]
    with open_engine(str(tmp_path / "f32"), backend_name, max_seq_len=64) as eng:
        assert np.abs(eng.infer(ids) - want).max() / scale < 1e-4
    cfg = convert(q8, str(tmp_path / "q8"), progress=False)
    from colibri_edge.model.modeldir import ModelDir
    m = ModelDir(str(tmp_path / "q8"))
    assert m.tensor_dtype("layers.1.mla.wk_b") == "float16" and m.tensor_dtype("layers.1.mla.wq_rope") == "q8_0"
    with Engine.open(str(tmp_path / "q8"), backend="reference", max_seq_len=64) as eng:
        ref = eng.infer(ids)
    per_position = np.abs(ref - want).max(-1) / scale            # a top-1 router may flip where q8_0 moved a
    assert 1e-6 < np.median(per_position) < 5e-2                 # score past a near tie: the median position
    for opts, tol in activation_runs(backend_name, fp32(backend_name), 1e-4):   # (the cpu's int8 activations too)
        with Engine.open(str(tmp_path / "q8"), backend=backend_name, max_seq_len=64, **opts) as eng:
            assert close(eng.infer(ids), ref, tol), opts


def _la(**kw):
    return lambda c: c["latent_attention"].update(kw)


@pytest.mark.parametrize("edit,field,words", [
    (_la(kv_lora_rank=0), "latent_attention.kv_lora_rank", "out of range"),
    (_la(qk_rope_head_dim=7), "latent_attention.qk_rope_head_dim", "odd"),
    (_la(norm_eps=0.0), "latent_attention.norm_eps", "out of range"),
    (_la(heads=4), "latent_attention.heads", "not a field"),
    (_la(kv_lora_rank=16), "layers.0.mla.wk_b.shape", "expected [3, 16, 10]"),
    (lambda c: c.update(head_dim=12), "head_dim", "rotated width"),
    (lambda c: c.update(qk_norm="per_head"), "latent_attention", "qk_norm"),
    (lambda c: c.update(attention_sinks=True), "attention_sinks", "latent_attention"),
    (lambda c: c.update(router_score="relu"), "router_score", "is not one of"),
    (lambda c: c.update(routed_scaling_factor=0.0), "routed_scaling_factor", "out of range"),
    (lambda c: c["router_groups"].update(n_group=3), "router_groups.n_group", "does not divide"),
    (lambda c: c["router_groups"].update(topk_group=5), "router_groups.topk_group", "out of range"),
    (lambda c: c["router_groups"].update(group_top=3), "router_groups.group_top", "out of range"),
    (lambda c: c.update(top_k=5), "top_k", "kept groups"),
    (lambda c: c.update(router_mode="gated", router_choice_bias=False, router_norm_min=0.0), "router_mode",
     "sigmoid"),
])
def test_mla_fields_are_checked(model_cache, tmp_path, edit, field, words):
    """Latent attention's and the routers' fields are typed and ranged, refused by name, and a config
    that implies other tensors than the directory holds is refused naming the tensor."""
    import shutil
    _, col = convert_case(model_cache, "deepseek_v3")
    dst = str(tmp_path / "m")
    shutil.copytree(col, dst)
    edit_json(dst, "config.json", edit)
    refused(dst, field, words)
