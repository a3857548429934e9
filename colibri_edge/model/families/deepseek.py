"""Multi-head latent attention: DeepSeek-V2 / V2-Lite, DeepSeek-V3-style (Moonlight), GLM-4.7-Flash
(transformers' deepseek_v2, deepseek_v3, glm4_moe_lite; GGUF arch deepseek2, whose expert_gating_func
tells V2's softmax from V3's sigmoid).

GGUF deepseek2: q_lora_rank, kv_lora_rank, key_length_mla / value_length_mla, the split attn_k_b /
attn_v_b (or an older file's attn_kv_b, split here); the rotated rows in adjacent pairs (llama.cpp's rope
type NORM), un-permuted; expert_gating_func softmax (V2: groups scored by their best, not renormalised)
or sigmoid (V3 / GLM: exp_probs_b for the choice, groups scored by their best two), expert_group_count /
_used_count, expert_weights_scale / _norm; leading dense layers; YaRN's yarn_log_multiplier (0.1
mscale_all_dim); the first nextn_predict_layers layer (multi-token prediction) converted as the MTP head (from a GGUF file: skipped).
"""
from __future__ import annotations

import numpy as np

from .common import Family, decoder_shape, eos_bos, get, nextn_tensors, pos, refuse, unpermute, yarn
from .registry import register
from .. import validate
from ..dtypes import narrow
from ...errors import ColibriError, COLIBRI_ERR_INVALID_MODEL_TYPE, invalid_model

V2, V3, GLM = "deepseek_v2", "deepseek_v3", "glm4_moe_lite"


def translate(hf: dict, gen: dict, path: str, dtype) -> dict:
    """DeepSeek-V2 / V3 and GLM-4.7-Flash (transformers' deepseek_v2, deepseek_v3, glm4_moe_lite):
    multi-head latent attention in every layer (q through q_lora_rank or a plain projection, the
    latent of kv_lora_rank and a rope key shared by the heads; interleaved rope pairs, permuted by the
    converter to the half-split layout), dense first layers (first_k_dense_replace, mlp_layer_types),
    then routed experts beside ungated shared ones (n_shared_experts x moe_intermediate_size).
    Routers: V2 softmax, top-k over all experts (greedy) or within the topk_group best of n_group groups
    scored by their maximum (group_limited_greedy), never renormalised; V3 / GLM sigmoid, the choice by
    score + e_score_correction_bias within the topk_group best groups scored by the sum of their top
    two, weights the scores (renormalised when norm_topk_prob, with 1e-20 as transformers); all times
    routed_scaling_factor. YaRN's mscale_all_dim enters the softmax scale squared."""
    mt = hf["model_type"]
    H, nh, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    max_pos = hf.get("max_position_embeddings", 4096)
    for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(hf.get(f), int) or hf[f] < 1:
            raise invalid_model(path, f, f"{hf.get(f)!r}: latent attention needs a positive integer")
    if hf.get("attention_bias"):
        refuse(path, "attention_bias", "biases on the latent attention's projections")
    if hf.get("mlp_bias"):
        refuse(path, "mlp_bias", "biases in the feed-forward")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(path, "hidden_act", f"activation {hf['hidden_act']!r} (only silu / SwiGLU)")
    rope = hf.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(path, "partial_rotary_factor", "partial rotary embeddings of the rope key")
    rope_scaling = yarn(rope, max_pos, path)
    if hf.get("rope_scaling") and (hf["rope_scaling"].get("rope_type", hf["rope_scaling"].get("type")) or "default") \
            != "default" and rope_scaling is None:
        refuse(path, "rope_scaling", f"rope scaling {hf['rope_scaling']!r}")
    theta = float(get(rope, "rope_theta", default=None) or get(hf, "rope_theta", default=10000.0))
    E = get(hf, "n_routed_experts", "num_local_experts", "num_experts", default=0)
    top_k = hf.get("num_experts_per_tok") or 1
    if E and not 1 <= top_k <= E:
        raise invalid_model(path, "num_experts_per_tok", f"{top_k} is not in 1..{E}")
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        k0 = hf.get("first_k_dense_replace", 1 if mt == GLM else 0) or 0
        kinds = ["dense" if i < k0 else "sparse" for i in range(L)]
    if len(kinds) != L or set(kinds) - {"dense", "sparse"}:
        refuse(path, "mlp_layer_types", f"MLP layer types {kinds!r}")
    shared = int(hf.get("n_shared_experts") or 0)
    moe_inter = hf["moe_intermediate_size"]
    layers, start = [], 0
    for i, kind in enumerate(kinds):
        if kind == "sparse" and E:
            layers.append({"layer_id": i, "type": "moe_shared" if shared else "moe", "moe_expert_start": start,
                           "moe_num_experts": E})
            start += E
        else:
            layers.append({"layer_id": i, "type": "dense", "moe_expert_start": 0, "moe_num_experts": 0})
    extra = {}
    n_group, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if mt == V2:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            refuse(path, "topk_method", f"routing method {method!r} (DeepSeek-V2: greedy, group_limited_greedy)")
        normalize, group_top = False, 1
        if method == "greedy":
            n_group = 1
    else:
        normalize, group_top = bool(hf.get("norm_topk_prob", True)), 2
        extra.update(router_score="sigmoid", router_choice_bias=True)
        if normalize:
            extra["router_norm_min"] = 1e-20
    if n_group > 1 and E:
        if E % n_group or not 1 <= topk_group <= n_group or E // n_group < group_top:
            raise invalid_model(path, "n_group", f"{n_group} groups (topk_group {topk_group}) do not fit {E} "
                                f"experts (groups of at least {group_top})")
        if top_k > topk_group * (E // n_group):
            raise invalid_model(path, "num_experts_per_tok", f"{top_k} is more than the {topk_group} kept groups "
                                f"of {E // n_group} experts hold")
        extra["router_groups"] = {"n_group": n_group, "topk_group": topk_group, "group_top": group_top}
    scaling = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
    if not (np.isfinite(scaling) and scaling > 0):
        raise invalid_model(path, "routed_scaling_factor", f"{scaling} is not a positive finite number")
    if scaling != 1.0:
        extra["routed_scaling_factor"] = scaling
    if rope_scaling:
        extra["rope_scaling"] = rope_scaling
    interleaved = mt == V2 or bool(hf.get("rope_interleave", True))
    eos, bos = eos_bos(hf, gen)
    dr = hf["qk_rope_head_dim"]
    return {
        **extra, "format_version": 1, "model_type": mt, "architectures": hf.get("architectures") or [],
        "num_hidden_layers": L, "hidden_size": H, "intermediate_size": hf["intermediate_size"],
        "moe_intermediate_size": moe_inter, "num_attention_heads": nh, "num_key_value_heads": nh, "head_dim": dr,
        "vocab_size": hf["vocab_size"], "max_position_embeddings": max_pos, "rope_theta": theta,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)), "experts_per_layer": E if start else 0,
        "top_k": top_k if start else 1, "router_dtype": "float32", "router_mode": "topk", "norm_topk_prob": normalize,
        "shared_expert_intermediate_size": shared * moe_inter if start else 0, "shared_expert_gate": False,
        "attention_bias": False, "attention_out_bias": False, "qk_norm": "none", "eos_token_ids": eos,
        "bos_token_id": bos, "weight_dtype": dtype, "layers": layers,
        "rope_pairs": "interleaved" if interleaved else "half_split",
        "latent_attention": {"kv_lora_rank": hf["kv_lora_rank"], "q_lora_rank": int(hf.get("q_lora_rank") or 0),
                             "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": dr,
                             "v_head_dim": hf["v_head_dim"], "norm_eps": 1e-6},
    }



def latent_sources(cfg: dict, p: str, s: str) -> dict:
    """Latent attention's tensors (modeldir.latent_tensors) from the checkpoint's: the query rows
    [nope | rope] of each head split, kv_a_proj_with_mqa's [latent | rope key] rows split, kv_b_proj
    [Hq*(dn+dv), r] cut per head into wk_b [Hq, r, dn] (transposed) and wv_b [Hq, dv, r]; rotated rows
    in interleaved pairs (cfg rope_pairs) permuted to the half-split layout (q and k alike)."""
    la, nh = cfg["latent_attention"], cfg["num_attention_heads"]
    r, dn, dr, dv = la["kv_lora_rank"], la["qk_nope_head_dim"], la["qk_rope_head_dim"], la["v_head_dim"]
    a = s + "self_attn."
    inter = cfg.get("rope_pairs") == "interleaved"

    def rope_rows(x, heads):
        return unpermute(x, heads) if inter else x

    q = a + ("q_b_proj.weight" if la["q_lora_rank"] else "q_proj.weight")
    heads = lambda x: x.reshape(nh, dn + dr, -1)                    # noqa: E731 (q rows by head)
    kvb = lambda x: x.reshape(nh, dn + dv, r)                       # noqa: E731
    m = {p + "mla.wq": (q, lambda x: heads(x)[:, :dn].reshape(nh * dn, -1).copy()),
         p + "mla.wq_rope": (q, lambda x: rope_rows(heads(x)[:, dn:].reshape(nh * dr, -1).copy(), nh)),
         p + "mla.wkv_a": (a + "kv_a_proj_with_mqa.weight", lambda x: x[:r].copy()),
         p + "mla.wk_rope": (a + "kv_a_proj_with_mqa.weight", lambda x: rope_rows(x[r:].copy(), 1)),
         p + "mla.kv_a_norm": a + "kv_a_layernorm.weight",
         p + "mla.wk_b": (a + "kv_b_proj.weight", lambda x: kvb(x)[:, :dn].transpose(0, 2, 1).copy()),
         p + "mla.wv_b": (a + "kv_b_proj.weight", lambda x: kvb(x)[:, dn:].copy()),
         p + "mla.wq_a": a + "q_a_proj.weight", p + "mla.q_a_norm": a + "q_a_layernorm.weight"}
    return m



def gguf_config(m) -> dict:
    """llama.cpp's deepseek2 metadata -> a deepseek_v2 (softmax gating) or deepseek_v3 (sigmoid) config
    for translate. The MTP layers a file appends (nextn_predict_layers) are not in the plan."""
    a, g, L, H, nh = decoder_shape(m, "deepseek2")
    r = pos(m, a + "attention.kv_lora_rank", g("attention.kv_lora_rank"))
    rq = pos(m, a + "attention.q_lora_rank", g("attention.q_lora_rank", required=False, default=0), 0)
    dr = pos(m, a + "rope.dimension_count", g("rope.dimension_count"))
    kmla = pos(m, a + "attention.key_length_mla", g("attention.key_length_mla", required=False,
                                                    default=g("attention.key_length", required=False)), dr + 1)
    dv = pos(m, a + "attention.value_length_mla", g("attention.value_length_mla", required=False,
                                                    default=g("attention.value_length", required=False)))
    if kmla is None or dv is None:
        raise invalid_model(m.path, a + "attention.key_length_mla", "missing (the latent attention's head sizes)")
    E = pos(m, a + "expert_count", g("expert_count", required=False, default=0), 0, validate.MAX_EXPERTS)
    if E == 0:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE, f"{m.path}: field '{a}expert_count': a dense deepseek2 "
                           "model (no experts); Colibri runs mixture-of-experts models")
    k = pos(m, a + "expert_used_count", g("expert_used_count"), 1, E)
    gating = g("expert_gating_func", required=False, default=1)      # llama.cpp: absent = softmax (V2)
    if gating not in (1, 2):
        raise invalid_model(m.path, a + "expert_gating_func", f"{gating}: softmax (1) and sigmoid (2) are implemented")
    sigmoid = gating == 2
    n_group = pos(m, a + "expert_group_count", g("expert_group_count", required=False, default=1), 1, E)
    topk_group = pos(m, a + "expert_group_used_count", g("expert_group_used_count", required=False, default=1),
                      1, n_group)
    eps = g("attention.layer_norm_rms_epsilon", float)
    if not 0 < eps < 1:
        raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
    ctx = pos(m, a + "context_length", g("context_length", required=False, default=4096), 1, validate.MAX_POSITIONS)
    rope = {"rope_type": "default", "rope_theta": g("rope.freq_base", float, required=False, default=10000.0)}
    scaling = g("rope.scaling.type", str, required=False, default="none")
    factor = g("rope.scaling.factor", float, required=False, default=1.0)
    if scaling == "yarn" and factor != 1.0:
        mul = g("rope.scaling.yarn_log_multiplier", float, required=False, default=0.0)
        rope.update(rope_type="yarn", factor=factor,
                    original_max_position_embeddings=pos(m, a + "rope.scaling.original_context_length",
                                                          g("rope.scaling.original_context_length"), 1,
                                                          validate.MAX_POSITIONS),
                    beta_fast=g("rope.scaling.yarn_beta_fast", float, required=False, default=32.0),
                    beta_slow=g("rope.scaling.yarn_beta_slow", float, required=False, default=1.0))
        if mul:             # llama.cpp stores 0.1 mscale_all_dim and runs the rope key unscaled (mscale equal)
            rope.update(mscale=mul / 0.1, mscale_all_dim=mul / 0.1)
    elif scaling not in ("none", "") and factor != 1.0:
        raise invalid_model(m.path, a + "rope.scaling.type", f"rope scaling {scaling!r} x{factor} is not implemented")
    if "token_embd.weight" not in m.tensors:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    V = int(m.tensor("token_embd.weight").shape[1])
    hf = {"model_type": V3 if sigmoid else V2, "architectures": [], "num_hidden_layers": L,
          "hidden_size": H, "num_attention_heads": nh, "num_key_value_heads": nh, "vocab_size": V,
          "max_position_embeddings": ctx, "rms_norm_eps": eps, "rope_parameters": rope,
          "q_lora_rank": rq or None, "kv_lora_rank": r, "qk_nope_head_dim": kmla - dr, "qk_rope_head_dim": dr,
          "v_head_dim": dv, "n_routed_experts": E, "num_experts_per_tok": k,
          "moe_intermediate_size": pos(m, a + "expert_feed_forward_length", g("expert_feed_forward_length")),
          "intermediate_size": pos(m, a + "feed_forward_length", g("feed_forward_length", required=False, default=1)),
          "first_k_dense_replace": pos(m, a + "leading_dense_block_count",
                                        g("leading_dense_block_count", required=False, default=0), 0, L),
          "n_shared_experts": pos(m, a + "expert_shared_count", g("expert_shared_count", required=False, default=0),
                                   0, 64),
          "routed_scaling_factor": g("expert_weights_scale", float, required=False, default=1.0),
          "norm_topk_prob": g("expert_weights_norm", bool, required=False, default=False),
          "n_group": n_group, "topk_group": topk_group, "tie_word_embeddings": "output.weight" not in m.tensors,
          "rope_interleave": True}
    if not sigmoid:
        hf["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
        if hf["norm_topk_prob"]:
            raise invalid_model(m.path, a + "expert_weights_norm", "renormalised softmax routing in a deepseek2 file: "
                                "DeepSeek-V2's router (transformers') never renormalises")
    return hf



def latent_rows(tz, cfg: dict, what: str, name: str, shape):
    """(data, format) of a latent-attention tensor (modeldir.latent_tensors) from llama.cpp's: the q rows
    [nope | rope] of each head split, attn_kv_a_mqa's [latent | rope key] rows split, the rotated rows
    un-permuted from adjacent pairs (rows are whole blocks: bytes move, nothing is requantised);
    attn_k_b [Hq, r, dn] / attn_v_b [Hq, dv, r] (or an older file's attn_kv_b [Hq*(dn+dv), r], cut
    here) widened to float32 when not a float format (the per-head matrices run in float, head_matmul)."""
    la, nh = cfg["latent_attention"], cfg["num_attention_heads"]
    r, rq, dn, dr, dv = (la[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim"))
    part = what.split(".", 2)[-1]
    if part in ("mla.wq", "mla.wq_rope"):
        data, fmt = tz.stored(name, (nh * (dn + dr), rq or cfg["hidden_size"]))
        heads = data.reshape(nh, dn + dr, *data.shape[1:])
        if part == "mla.wq":
            return heads[:, :dn].reshape(nh * dn, *data.shape[1:]).copy(), fmt
        return unpermute(heads[:, dn:].reshape(nh * dr, *data.shape[1:]).copy(), nh), fmt
    if part in ("mla.wkv_a", "mla.wk_rope"):
        data, fmt = tz.stored(name, (r + dr, cfg["hidden_size"]))
        return (data[:r].copy(), fmt) if part == "mla.wkv_a" else (unpermute(data[r:].copy(), 1), fmt)
    split = name not in tz.m.tensors            # an older file: attn_kv_b, not yet split
    src = name.replace("attn_k_b", "attn_kv_b").replace("attn_v_b", "attn_kv_b") if split else name
    if split and src not in tz.m.tensors:
        raise invalid_model(tz.m.path, name, "missing tensor (nor is attn_kv_b there)")
    fmt = tz.fmt(src)
    out = fmt if fmt in tz.head_types else "float16"      # a quantised per-head matrix runs as float16
    if split:
        kv, _ = tz.stored(src, (nh * (dn + dv), r), float32=True)
        kv = kv.reshape(nh, dn + dv, r)
        data = kv[:, :dn].transpose(0, 2, 1) if part == "mla.wk_b" else kv[:, dn:]
    else:
        data, _ = tz.stored(name, shape, float32=True)
    return narrow(data, out), out



@register
class DeepseekV2(Family):
    model_types = (V2,)
    gguf_archs = ("deepseek2",)
    parts = {"mixer": "latent attention (latent paged cache, absorbed decode)",
             "ffn": "routed experts + ungated shared experts; leading dense layers",
             "router": "softmax (greedy / group-limited), not renormalised, scaled"}

    def translate(self, hf, gen, path, dtype):
        return translate(hf, gen, path, dtype)

    def layer_sources(self, m, cfg, p, s, src):
        for x in ("gate", "up", "down"):
            m[p + f"shared.{x}"] = s + f"mlp.shared_experts.{x}_proj.weight"
        m.update(latent_sources(cfg, p, s))
        m[p + "router_choice_bias"] = s + "mlp.gate.e_score_correction_bias"

    def gguf_config(self, m, arch):
        return gguf_config(m)

    def gguf_layer_names(self, m, cfg, p, b):
        m.update({p + "mla.wq_a": b + "attn_q_a.weight", p + "mla.q_a_norm": b + "attn_q_a_norm.weight",
                  p + "mla.kv_a_norm": b + "attn_kv_a_norm.weight", p + "mla.wk_b": b + "attn_k_b.weight",
                  p + "mla.wv_b": b + "attn_v_b.weight"})
        q = b + ("attn_q_b.weight" if cfg["latent_attention"]["q_lora_rank"] else "attn_q.weight")
        m[p + "mla.wq"] = m[p + "mla.wq_rope"] = q
        m[p + "mla.wkv_a"] = m[p + "mla.wk_rope"] = b + "attn_kv_a_mqa.weight"

    def gguf_tensor(self, tz, cfg, what, name, role):
        if what.split(".", 2)[-1].startswith("mla.") and role[1] != "float32":
            return latent_rows(tz, cfg, what, name, role[0])
        return super().gguf_tensor(tz, cfg, what, name, role)

    def gguf_skipped(self, m, cfg, arch, progress):
        return nextn_tensors(m, cfg, arch, progress)


@register
class DeepseekV3(DeepseekV2):
    """deepseek_v3: sigmoid scores, the choice by score + e_score_correction_bias (V2's class does all)."""
    model_types = (V3,)
    gguf_archs = ()
    parts = {**DeepseekV2.parts, "router": "sigmoid + choice bias, groups by their top two, renormalised, scaled"}


@register
class Glm4MoeLite(DeepseekV3):
    """glm4_moe_lite (GLM-4.7-Flash): V3's router, a dense first layer by default, half-split rope when
    rope_interleave is off."""
    model_types = (GLM,)
