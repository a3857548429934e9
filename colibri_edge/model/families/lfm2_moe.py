"""LFM2-MoE (transformers' lfm2_moe; Liquid's LFM2-8B-A1B and LFM2-24B-A2B, built for devices): a hybrid
of gated short convolutions and attention, modeling_lfm2_moe.Lfm2MoeDecoderLayer:
    x += mixer(operator_norm(x));  x += ffn(ffn_norm(x));  logits = lm_head(embedding_norm(x))
mixer, by layer_types:
  * "conv" (our "short_conv", program.ShortConv): b | c | x = in_proj @ h, y = c * conv(b * x), out_proj @ y,
    conv a depthwise causal conv of conv_L_cache taps with no activation; its state per sequence is the
    conv's last L-1 inputs (the recurrent pool's slot, H floats per tap: 2 x 2048 x 4 B = 16 KiB a layer
    for LFM2-8B-A1B);
  * "full_attention": GQA with per-head q/k RMSNorms (q_layernorm, k_layernorm) before rope (half-split).
ffn: a dense SwiGLU (w1 gate, w3 up, w2 down) on the first num_dense_layers, routed SwiGLU experts after;
router: p = sigmoid(gate @ h); the top-k chosen by p + expert_bias (use_expert_bias: a choice-only bias,
as DeepSeek-V3's), weighted by p, renormalised when norm_topk_prob, times routed_scaling_factor.

transformers divides the chosen weights by (their sum + 1e-6); Colibri's router (backends.routing.route)
divides by the sum itself: for sigmoid scores the sum of k >= 1 weights is far from 0, and the two differ by
a relative 1e-6 / sum (below float32 logits' tolerance), as llama.cpp's graph, which also divides by the sum.

GGUF lfm2moe (llama.cpp's converter): token_embd_norm is the final norm (embedding_norm), shortconv.in_proj
[3H, H] (cut into its thirds here), shortconv.conv [H, L], shortconv.out_proj; per-layer head_count_kv (0 on
conv layers: the layer types); expert_gating_func sigmoid, exp_probs_b the choice bias. The file carries
neither norm_topk_prob nor routed_scaling_factor: llama.cpp's graph renormalises and does not scale (the
released configs' values), and so does the import.
"""
from __future__ import annotations

import numpy as np

from .common import Family, decoder_shape, eos_bos, gguf_vocab, pos, refuse
from .registry import register
from .. import validate
from ...errors import invalid_model

TYPES = {"conv": "short_conv", "full_attention": "full_attention"}     # HF layer_types -> ours
THIRDS = ("b", "c", "x")                                               # in_proj's rows: B | C | x


def translate(hf: dict, gen: dict, path: str, dtype) -> dict:
    H, nh, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    nkv = hf.get("num_key_value_heads") or nh
    hd = hf.get("head_dim") or H // nh
    if hf.get("conv_bias"):
        refuse(path, "conv_bias", "biases in the short convolutions' projections and taps")
    types = hf.get("layer_types")
    if not isinstance(types, list) or len(types) != L or any(t not in TYPES for t in types):
        refuse(path, "layer_types", f"layer types {types!r} (expected {L} of {', '.join(TYPES)})")
    if "full_attention" not in types:
        refuse(path, "layer_types", "a model without any attention layer")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        refuse(path, "rope_parameters.rope_type", f"rope type {rope.get('rope_type')!r}")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
    E, top_k = hf.get("num_experts") or 0, hf.get("num_experts_per_tok", 4)
    if not E or not 1 <= top_k <= E:
        raise invalid_model(path, "num_experts_per_tok", f"{top_k} is not in 1..{E}")
    dense = int(hf.get("num_dense_layers", 2) or 0)
    if not 0 <= dense <= L:
        raise invalid_model(path, "num_dense_layers", f"{dense} is not in 0..{L}")
    kernel = int(hf.get("conv_L_cache", 3))
    if not 2 <= kernel <= validate.MAX_CONV_KERNEL:
        raise invalid_model(path, "conv_L_cache", f"{kernel} taps: Colibri's conv kernels run 2 to "
                            f"{validate.MAX_CONV_KERNEL}")
    scaling = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
    if not np.isfinite(scaling) or scaling <= 0:
        raise invalid_model(path, "routed_scaling_factor", f"{scaling} is not a positive finite number")
    layers, start = [], 0
    for i in range(L):
        if i < dense:
            layers.append({"layer_id": i, "type": "dense", "moe_expert_start": 0, "moe_num_experts": 0})
        else:
            layers.append({"layer_id": i, "type": "moe", "moe_expert_start": start, "moe_num_experts": E})
            start += E
    eos, bos = eos_bos(hf, gen)
    cfg = {
        "format_version": 1, "model_type": hf["model_type"], "architectures": hf.get("architectures") or [],
        "num_hidden_layers": L, "hidden_size": H, "intermediate_size": hf.get("intermediate_size") or 0,
        "moe_intermediate_size": hf["moe_intermediate_size"], "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 128_000), "rope_theta": theta,
        "rms_norm_eps": float(hf.get("norm_eps", 1e-5)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True))),
        "experts_per_layer": E, "top_k": top_k, "router_dtype": "float32", "router_mode": "topk",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "shared_expert_intermediate_size": 0,
        "shared_expert_gate": False, "attention_bias": False, "attention_out_bias": False, "qk_norm": "per_head",
        "eos_token_ids": eos, "bos_token_id": bos, "weight_dtype": dtype, "layers": layers,
        "layer_types": [TYPES[t] for t in types], "short_conv": {"conv_kernel": kernel}, "router_score": "sigmoid",
    }
    if dense and not cfg["intermediate_size"]:
        refuse(path, "intermediate_size", "dense layers (num_dense_layers) without a size")
    if hf.get("use_expert_bias", True):
        cfg["router_choice_bias"] = True
    if scaling != 1.0:
        cfg["routed_scaling_factor"] = scaling
    return cfg


@register
class Lfm2Moe(Family):
    model_types = ("lfm2_moe",)
    gguf_archs = ("lfm2moe",)
    gguf_model_type = "lfm2_moe"
    parts = {"mixer": "gated short convolution (recurrent state: the conv's last inputs) / attention with "
                      "per-head q/k norms",
             "ffn": "routed SwiGLU experts, dense SwiGLU on the first num_dense_layers",
             "router": "sigmoid + choice bias top-k, renormalised"}

    def translate(self, hf, gen, path, dtype):
        return translate(hf, gen, path, dtype)

    def source_names(self, cfg, src=None):
        H = cfg["hidden_size"]
        m = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.embedding_norm.weight",
             "lm_head": "lm_head.weight"}
        for l in cfg["layers"]:
            i = l["layer_id"]
            p, s = f"layers.{i}.", f"model.layers.{i}."
            m[p + "input_norm"] = s + "operator_norm.weight"
            m[p + "post_attention_norm"] = s + "ffn_norm.weight"
            if cfg["layer_types"][i] == "short_conv":
                c = s + "conv."
                for j, x in enumerate(THIRDS):
                    m[p + f"conv.w{x}"] = (c + "in_proj.weight", j * H, (j + 1) * H)
                m[p + "conv.w"] = (c + "conv.weight", lambda w: w.reshape(w.shape[0], -1).copy())
                m[p + "conv.wo"] = c + "out_proj.weight"
            else:
                a = s + "self_attn."
                for x in "qkv":
                    m[p + f"attn.w{x}"] = a + f"{x}_proj.weight"
                m[p + "attn.wo"] = a + "out_proj.weight"
                m[p + "attn.q_norm"] = a + "q_layernorm.weight"
                m[p + "attn.k_norm"] = a + "k_layernorm.weight"
            f = s + "feed_forward."
            for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                m[p + f"mlp.{ours}"] = f + f"{theirs}.weight"
            m[p + "router"] = f + "gate.weight"
            m[p + "router_choice_bias"] = f + "expert_bias"
        return m

    def expert_sources(self, src, cfg, layer, j):
        """Experts under feed_forward.experts: per expert w1 / w3 / w2 (the checkpoints' and save_pretrained's
        names), or transformers' fused gate_up_proj / down_proj."""
        f = f"model.layers.{layer}.feed_forward.experts."
        per = f + f"{j}."
        if per + "w1.weight" in src:
            names = [per + f"{w}.weight" for w in ("w1", "w3", "w2")]
            return tuple((lambda n=n: src.float32(n)) for n in names), names
        if f + "gate_up_proj" in src:
            return self.fused_gate_up(src, cfg, f, j)
        raise invalid_model(f"model.layers.{layer}", f"feed_forward.experts.{j}", "expert weights not found in "
                            "the checkpoint")

    # -- GGUF ----------------------------------------------------------------------------------------
    def gguf_config(self, m, arch):
        """llama.cpp's lfm2moe metadata -> an lfm2_moe config (translate's input): the layer types from the
        per-layer head_count_kv (0: a short convolution), the conv's taps from shortconv.l_cache."""
        a, g, L, H, nh = decoder_shape(m, arch)
        kv = g("attention.head_count_kv", list, required=False)
        if kv is None:
            raise invalid_model(m.path, a + "attention.head_count_kv", f"missing: an lfm2moe file lists {L} "
                                "per-layer KV head counts (0 for the short convolutions)")
        if len(kv) != L or not all(isinstance(x, (int, np.integer)) and 0 <= int(x) <= nh for x in kv):
            raise invalid_model(m.path, a + "attention.head_count_kv", f"expected {L} counts in 0..{nh}")
        nkvs = {int(x) for x in kv if x}
        if len(nkvs) != 1:
            raise invalid_model(m.path, a + "attention.head_count_kv", f"{sorted(nkvs)}: Colibri runs one KV head "
                                "count over the attention layers (and needs at least one)")
        gating = g("expert_gating_func", required=False, default=2)
        if gating != 2:
            raise invalid_model(m.path, a + "expert_gating_func", f"{gating}: an lfm2moe router is sigmoid (2)")
        eps = g("attention.layer_norm_rms_epsilon", float)
        if not 0 < eps < 1:
            raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
        E = pos(m, a + "expert_count", g("expert_count"), 1, validate.MAX_EXPERTS)
        dense = pos(m, a + "leading_dense_block_count", g("leading_dense_block_count", required=False, default=0),
                    0, L)
        hd = pos(m, a + "attention.key_length", g("attention.key_length", required=False, default=H // nh))
        return {"model_type": "lfm2_moe", "architectures": [], "num_hidden_layers": L, "hidden_size": H,
                "num_attention_heads": nh, "num_key_value_heads": nkvs.pop(), "head_dim": hd,
                "vocab_size": gguf_vocab(m),
                "max_position_embeddings": pos(m, a + "context_length", g("context_length", required=False,
                                                                          default=4096), 1, validate.MAX_POSITIONS),
                "norm_eps": eps, "tie_word_embeddings": "output.weight" not in m.tensors,
                "rope_parameters": {"rope_type": "default",
                                    "rope_theta": g("rope.freq_base", float, required=False, default=1_000_000.0)},
                "layer_types": ["full_attention" if x else "conv" for x in kv],
                "num_experts": E, "num_experts_per_tok": pos(m, a + "expert_used_count", g("expert_used_count"), 1, E),
                "moe_intermediate_size": pos(m, a + "expert_feed_forward_length", g("expert_feed_forward_length")),
                "intermediate_size": pos(m, a + "feed_forward_length", g("feed_forward_length", required=False,
                                                                          default=0), 0),
                "num_dense_layers": dense, "conv_L_cache": pos(m, a + "shortconv.l_cache", g("shortconv.l_cache"),
                                                               2, validate.MAX_CONV_KERNEL),
                "use_expert_bias": f"blk.{dense}.exp_probs_b.bias" in m.tensors, "norm_topk_prob": True}

    def gguf_names(self, cfg):
        m = super().gguf_names(cfg)
        m["norm"] = "token_embd_norm.weight"
        for l in cfg["layers"]:
            p, b = f"layers.{l['layer_id']}.", f"blk.{l['layer_id']}."
            for x in THIRDS:
                m[p + f"conv.w{x}"] = b + "shortconv.in_proj.weight"
            m[p + "conv.w"] = b + "shortconv.conv.weight"
            m[p + "conv.wo"] = b + "shortconv.out_proj.weight"
        return m

    def gguf_tensor(self, tz, cfg, what, name, role):
        part = what.split(".", 2)[-1]
        if part in ("conv.wb", "conv.wc", "conv.wx"):      # whole rows of in_proj [3H, H]: a quantised row is copied
            H = cfg["hidden_size"]
            data, fmt = tz.stored(name, (3 * H, *role[0][1:]))
            j = THIRDS.index(part[-1])
            return data[j * H:(j + 1) * H].copy(), fmt
        return super().gguf_tensor(tz, cfg, what, name, role)
