"""Qwen3.5 / 3.6-MoE (transformers' qwen3_5_moe, a wrapped VL model, and qwen3_5_moe_text; GGUF arch
qwen35moe): gated delta-net layers with a fixed-size recurrent state beside attention layers with an
output gate and partial rotary; routed experts with a gated shared expert.

GGUF qwen35moe: gated delta-nets on attention.recurrent_layers: ssm.* sizes, attn_qkv / attn_gate (z) /
ssm_alpha / ssm_beta / ssm_a (= -exp(A_log)) / ssm_dt / ssm_conv1d / ssm_norm / ssm_out, value heads kept
in the file's tiled order; full layers' attn_q rows split into query and output gate per head and the
partial rotary rows reordered (whole rows); softmax top-k, renormalised, a shared expert with sigmoid
gate; nextn_predict_layers skipped. From checkpoints the MTP head (mtp.*) is converted (common.mtp_sources).
"""
from __future__ import annotations

import sys

import numpy as np

from .common import (Family, add_mtp, decoder_shape, eos_bos, get, mtp_sources, nextn_tensors, pos, refuse,
                     rope_dim_order, unwrap_text)
from ..layerplan import all_layers, is_linear
from .registry import register
from .. import validate
from ...errors import invalid_model

SKIPPED = ("model.visual.", "mtp.", "model.mtp.")   # the vision tower, multi-token prediction (when not kept)
# the MTP head's names -> DeepSeek-V3's under model.layers.L. (common.mtp_sources reads those)
MTP_RENAMES = {"pre_fc_norm_embedding.weight": "enorm.weight", "pre_fc_norm_hidden.weight": "hnorm.weight",
               "fc.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
ROWS = ("attn.wq", "attn.wq_gate", "attn.wk", "attn.q_norm", "attn.k_norm")


def translate(hf: dict, gen: dict, path: str, dtype) -> dict:
    """Qwen3.5 / 3.6-MoE (transformers' qwen3_5_moe, its text model under text_config, or
    qwen3_5_moe_text), the layer of modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer:
        x += mixer(norm(x));  x += moe(norm(x)) + sigmoid(shared_gate @ h) shared(h)
    mixer: a gated delta-net on layer_types "linear_attention" (program.GatedDeltaNet), else attention
    whose q projection emits a query and an output gate per head (sigmoid, before o_proj), per-head q/k
    norms, partial rotary (the first partial_rotary_factor of the head's dims; M-RoPE, which for text
    is the 1-D rope). Norms are zero-centred (x^ (1 + w)): the converter folds the 1 into the weights;
    the router always renormalises its top-k."""
    mt = hf["model_type"]
    if mt == "qwen3_5_moe":
        hf = unwrap_text(hf, path, "qwen3_5_moe_text")
    H, nh, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    nkv = get(hf, "num_key_value_heads", default=nh)
    hd = get(hf, "head_dim", default=H // nh)
    if hf.get("hidden_act", "silu") != "silu":
        refuse(path, "hidden_act", f"activation {hf['hidden_act']!r} (only silu / SwiGLU)")
    if hf.get("attention_bias"):
        refuse(path, "attention_bias", "biases in the attention projections")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        refuse(path, "rope_parameters.rope_type", f"rope type {rope.get('rope_type')!r}")
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    rope_dim = int(hd * partial)
    if not 2 <= rope_dim <= hd or rope_dim % 2:
        raise invalid_model(path, "rope_parameters.partial_rotary_factor", f"{partial} of head_dim {hd} gives "
                            f"{rope_dim} rotated dims: expected an even number from 2 to {hd}")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000_000.0)))
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % hf.get("full_attention_interval", 4)
                                      else "full_attention" for i in range(L)]
    if len(types) != L or any(t not in ("linear_attention", "full_attention") for t in types):
        refuse(path, "layer_types", f"layer types {types!r}")
    if "full_attention" not in types:
        refuse(path, "layer_types", "a model without any full-attention layer")
    E, top_k = hf.get("num_experts") or 0, hf.get("num_experts_per_tok", 8)
    if not E or not 1 <= top_k <= E:
        raise invalid_model(path, "num_experts_per_tok", f"{top_k} is not in 1..{E}")
    si = hf.get("shared_expert_intermediate_size") or 0
    layers = [{"layer_id": i, "type": "moe_shared" if si else "moe", "moe_expert_start": i * E,
               "moe_num_experts": E} for i in range(L)]
    lin = {"conv_kernel": hf.get("linear_conv_kernel_dim", 4), "num_key_heads": hf.get("linear_num_key_heads", 16),
           "num_value_heads": hf.get("linear_num_value_heads", 32), "key_head_dim": hf.get("linear_key_head_dim", 128),
           "value_head_dim": hf.get("linear_value_head_dim", 128)}
    order = hf.get("linear_value_head_order", "grouped")          # "tiled": llama.cpp's GGUF layout
    if order != "grouped":
        lin["value_head_order"] = order
    eos, bos = eos_bos(hf, gen)
    return {
        "format_version": 1, "model_type": mt, "architectures": hf.get("architectures") or [],
        "num_hidden_layers": L, "hidden_size": H, "intermediate_size": hf.get("intermediate_size") or 0,
        "moe_intermediate_size": hf["moe_intermediate_size"], "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 32768), "rope_theta": theta,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "experts_per_layer": E, "top_k": top_k, "router_dtype": "float32", "router_mode": "topk",
        "norm_topk_prob": True, "shared_expert_intermediate_size": si, "shared_expert_gate": bool(si),
        "attention_bias": False, "attention_out_bias": False, "qk_norm": "per_head",
        "eos_token_ids": eos, "bos_token_id": bos, "weight_dtype": dtype, "layers": layers,
        "layer_types": list(types), "linear_attention": lin, "attention_output_gate": True,
        **({"rope_dim": rope_dim} if rope_dim < hd else {}),
    }



def sources(cfg: dict) -> dict:
    """Qwen3.5's tensors from the checkpoint's: zero-centred norms + 1; q_proj's rows per head [query D |
    gate D] split into attn.wq and attn.wq_gate; with partial rotary the q/k rows (and the q/k norms) of
    each head reordered by rope_dim_order (q.k unchanged); conv1d [C, 1, K] -> [C, K]; A_log -> -exp(A_log)."""
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    order = rope_dim_order(D, cfg.get("rope_dim", D))
    one = lambda a: (a + np.float32(1)).astype(np.float32)           # noqa: E731
    rows = lambda a, n: a.reshape(n, D, -1)[:, order].reshape(a.shape).copy()  # noqa: E731
    m = {"norm": ("model.norm.weight", one)}
    if cfg.get("mtp"):
        m.update({k: v for k, v in mtp_sources(cfg, one).items() if k.endswith("norm")})
    for l in all_layers(cfg):
        i = l["layer_id"]
        p, s = f"layers.{i}.", f"model.layers.{i}."
        m[p + "input_norm"] = (s + "input_layernorm.weight", one)
        m[p + "post_attention_norm"] = (s + "post_attention_layernorm.weight", one)
        if is_linear(cfg, l):
            a = s + "linear_attn."
            m.update({p + "lin.wqkv": a + "in_proj_qkv.weight", p + "lin.wz": a + "in_proj_z.weight",
                      p + "lin.wa": a + "in_proj_a.weight", p + "lin.wb": a + "in_proj_b.weight",
                      p + "lin.wo": a + "out_proj.weight", p + "lin.dt_bias": a + "dt_bias",
                      p + "lin.norm": a + "norm.weight",
                      p + "lin.conv": (a + "conv1d.weight", lambda x: x.reshape(x.shape[0], -1).copy()),
                      p + "lin.a_neg": (a + "A_log", lambda x: (-np.exp(x.astype(np.float64))).astype(np.float32))})
        else:
            a = s + "self_attn."
            q = lambda x, j: x.reshape(nh, 2, D, -1)[:, j].reshape(nh * D, -1)   # noqa: E731
            m[p + "attn.wq"] = (a + "q_proj.weight", lambda x: rows(q(x, 0), nh))
            m[p + "attn.wq_gate"] = (a + "q_proj.weight", lambda x: q(x, 1).copy())
            m[p + "attn.wk"] = (a + "k_proj.weight", lambda x: rows(x, nkv))
            m[p + "attn.q_norm"] = (a + "q_norm.weight", lambda x: one(x)[order].copy())
            m[p + "attn.k_norm"] = (a + "k_norm.weight", lambda x: one(x)[order].copy())
    return m



def gguf_config(m, arch: str = "qwen35moe") -> dict:
    """llama.cpp's qwen35moe metadata -> a qwen3_5_moe_text config (translate's input): the
    recurrent_layers array (the gated delta-nets), ssm.* (conv_kernel, state_size = key head dim,
    group_count = key heads, time_step_rank = value heads, inner_size = value heads x value dim), partial
    rotary (rope.dimension_count of key_length), the shared expert. The appended multi-token-prediction
    layers (nextn_predict_layers) are not in the plan. llama.cpp stores the value heads tiled by key head
    (value head j * Hk + k reads key head k) where Hk < Hv: kept as stored (linear_value_head_order)."""
    a, g, L, H, nh = decoder_shape(m, arch)
    nextn = g("nextn_predict_layers", required=False, default=0)
    nkv = pos(m, a + "attention.head_count_kv", g("attention.head_count_kv", required=False, default=nh), 1, nh)
    hd = pos(m, a + "attention.key_length", g("attention.key_length", required=False, default=H // nh))
    if g("attention.value_length", required=False, default=hd) != hd:
        raise invalid_model(m.path, a + "attention.value_length", "differs from key_length; Colibri's attention "
                            "needs them equal")
    rot = pos(m, a + "rope.dimension_count", g("rope.dimension_count", required=False, default=hd), 2, hd)
    E = pos(m, a + "expert_count", g("expert_count"), 1, validate.MAX_EXPERTS)
    rec = g("attention.recurrent_layers", list, required=False)
    if rec is None:
        step = pos(m, a + "full_attention_interval", g("full_attention_interval", required=False, default=4), 1, L)
        rec = [bool((i + 1) % step) for i in range(L)]
    if len(rec) < L or not all(isinstance(x, (bool, np.bool_)) for x in rec):
        raise invalid_model(m.path, a + "attention.recurrent_layers", f"expected {L} (+ {nextn}) booleans")
    Hk = pos(m, a + "ssm.group_count", g("ssm.group_count"), 1, validate.MAX_HEADS)
    Hv = pos(m, a + "ssm.time_step_rank", g("ssm.time_step_rank"), 1, validate.MAX_HEADS)
    inner = pos(m, a + "ssm.inner_size", g("ssm.inner_size"))
    if inner % Hv or Hv % Hk:
        raise invalid_model(m.path, a + "ssm.inner_size", f"{inner} over {Hv} value heads of {Hk} key heads")
    eps = g("attention.layer_norm_rms_epsilon", float)
    if not 0 < eps < 1:
        raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
    scaling = g("rope.scaling.type", str, required=False, default="none")
    if scaling not in ("none", "") and g("rope.scaling.factor", float, required=False, default=1.0) != 1.0:
        raise invalid_model(m.path, a + "rope.scaling.type", f"rope scaling {scaling!r} is not implemented")
    if g("expert_weights_scale", float, required=False, default=1.0) != 1.0:
        raise invalid_model(m.path, a + "expert_weights_scale", "scaled expert weights are not implemented")
    if "token_embd.weight" not in m.tensors:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    V = int(m.tensor("token_embd.weight").shape[1])
    return {"model_type": "qwen3_5_moe_text", "architectures": [], "num_hidden_layers": L, "hidden_size": H,
            "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": V,
            "max_position_embeddings": pos(m, a + "context_length", g("context_length", required=False,
                                                                          default=4096), 1, validate.MAX_POSITIONS),
            "rms_norm_eps": eps, "tie_word_embeddings": "output.weight" not in m.tensors,
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": rot / hd,
                                "rope_theta": g("rope.freq_base", float, required=False, default=10_000_000.0)},
            "layer_types": ["linear_attention" if x else "full_attention" for x in rec[:L]],
            "num_experts": E, "num_experts_per_tok": pos(m, a + "expert_used_count", g("expert_used_count"), 1, E),
            "moe_intermediate_size": pos(m, a + "expert_feed_forward_length", g("expert_feed_forward_length")),
            "shared_expert_intermediate_size": pos(m, a + "expert_shared_feed_forward_length",
                                                    g("expert_shared_feed_forward_length", required=False,
                                                      default=0), 0),
            "linear_conv_kernel_dim": pos(m, a + "ssm.conv_kernel", g("ssm.conv_kernel"), 2, validate.MAX_CONV_KERNEL),
            "linear_key_head_dim": pos(m, a + "ssm.state_size", g("ssm.state_size")),
            "linear_value_head_dim": inner // Hv, "linear_num_key_heads": Hk, "linear_num_value_heads": Hv,
            "linear_value_head_order": "tiled" if Hk != Hv else "grouped"}



def gguf_rows(tz, cfg: dict, what: str, name: str, role):
    """(data, format) of a Qwen3.5 full-attention tensor from llama.cpp's: attn_q [Hq * 2D, H] holds each
    head's query rows then its output gate's (split here); the query and key rows (and the q/k norms) of
    each head reordered for partial rotary (common.rope_dim_order: llama.cpp's rope rotates pairs
    (i, i + r/2) of the first r dims, ours the pairs (i, i + D/2)). Whole rows move: a quantised row is
    copied, never requantised. The norms are stored with the + 1 folded in (as ours)."""
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    order = rope_dim_order(D, cfg.get("rope_dim", D))
    part, shape = what.split(".", 2)[-1], role[0]
    if part in ("attn.wq", "attn.wq_gate"):
        data, fmt = tz.stored(name, (nh * 2 * D, shape[1]))
        heads = data.reshape(nh, 2, D, *data.shape[1:])
        if part == "attn.wq_gate":
            return heads[:, 1].reshape(nh * D, *data.shape[1:]).copy(), fmt
        return heads[:, 0][:, order].reshape(nh * D, *data.shape[1:]).copy(), fmt
    if part == "attn.wk":
        data, fmt = tz.stored(name, shape)
        return data.reshape(nkv, D, *data.shape[1:])[:, order].reshape(data.shape).copy(), fmt
    data, fmt = tz.stored(name, shape, float32=True)          # q_norm / k_norm [D]
    return data[order].copy(), fmt



def rename_mtp(src, L: int):
    """Qwen's MTP head (mtp.* or model.mtp.*: fc, pre_fc_norm_embedding / _hidden, norm, layers.j.) read
    under DeepSeek-V3's names, model.layers.(L + j). (prepare_mtp and mtp_sources take it from there)."""
    out = {}
    for n, e in src.entries.items():
        for pre in ("mtp.", "model.mtp."):
            if n.startswith(pre):
                rest = n[len(pre):]
                if rest.startswith("layers."):
                    j, tail = rest[len("layers."):].split(".", 1)
                    n = f"model.layers.{L + int(j)}.{tail}"
                else:
                    n = f"model.layers.{L}.{MTP_RENAMES.get(rest, rest)}"
                break
        out[n] = e
    src.entries = out


@register
class Qwen35Moe(Family):
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    gguf_archs = ("qwen35moe",)
    gguf_model_type = "qwen3_5_moe_text"
    parts = {"mixer": "gated delta-net (recurrent state) / attention with output gate, partial rotary",
             "ffn": "routed experts + shared expert (sigmoid gate)", "router": "softmax top-k, renormalised"}

    def translate(self, hf, gen, path, dtype):
        return translate(hf, gen, path, dtype)

    mtp_from_tensors = False    # the MTP head counted from mtp.layers.* when the config does not say (Qwen3-Next)

    def prepare_source(self, src, hf, cfg, progress):
        if not cfg.get("mtp") and self.mtp_from_tensors:
            n = len({k.split(".")[2] for k in src.entries if k.startswith("mtp.layers.")})
            if n:
                hf["mtp_num_hidden_layers"] = n
                add_mtp(cfg, hf)
        if cfg.get("mtp"):
            rename_mtp(src, cfg["num_hidden_layers"])
        dropped = src.rebase("model.language_model.", "model.", SKIPPED)   # wrapped or not, towers skipped
        if dropped and progress:
            print(f"convert: {dropped} vision-tower / multi-token-prediction tensors skipped (Colibri runs the "
                  "text model without speculative heads)", file=sys.stderr)

    def source_names(self, cfg, src=None):
        m = super().source_names(cfg, src)
        m.update(sources(cfg))
        return m

    def gguf_config(self, m, arch):
        return gguf_config(m, arch)

    def gguf_layer_names(self, m, cfg, p, b):
        m[p + "post_attention_norm"] = b + "post_attention_norm.weight"
        m.update({p + "lin.wqkv": b + "attn_qkv.weight", p + "lin.wz": b + "attn_gate.weight",
                  p + "lin.wa": b + "ssm_alpha.weight", p + "lin.wb": b + "ssm_beta.weight",
                  p + "lin.a_neg": b + "ssm_a", p + "lin.dt_bias": b + "ssm_dt.bias",
                  p + "lin.conv": b + "ssm_conv1d.weight", p + "lin.norm": b + "ssm_norm.weight",
                  p + "lin.wo": b + "ssm_out.weight", p + "attn.wq_gate": b + "attn_q.weight"})

    def gguf_tensor(self, tz, cfg, what, name, role):
        if what.split(".", 2)[-1] in ROWS:
            return gguf_rows(tz, cfg, what, name, role)
        return super().gguf_tensor(tz, cfg, what, name, role)

    def gguf_skipped(self, m, cfg, arch, progress):
        return nextn_tensors(m, cfg, arch, progress)
