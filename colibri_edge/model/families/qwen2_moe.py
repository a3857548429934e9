"""Qwen1.5 / Qwen2-MoE (transformers' qwen2_moe; GGUF arch qwen2moe).

Experts on layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers, softmax top-k (renormalised
when norm_topk_prob; a GGUF: not, unless expert_weights_norm says so), a shared expert with a sigmoid gate
(shared_expert_gate), q/k/v biases (qkv_bias), the sliding window only where use_sliding_window and a
layer is sliding.
"""
from __future__ import annotations

from .common import Family, get
from .registry import register


@register
class Qwen2Moe(Family):
    model_types = ("qwen2_moe",)
    gguf_archs = ("qwen2moe",)
    gguf_model_type = "qwen2_moe"
    parts = {"mixer": "attention (q/k/v biases)", "ffn": "routed experts + shared expert (sigmoid gate)",
             "router": "softmax top-k"}
    shared_gate = True
    gguf_ff_exp_required = True

    def uses_window(self, hf, sw, max_pos):
        return super().uses_window(hf, sw, max_pos) and hf.get("use_sliding_window", False) and \
            "sliding_attention" in (hf.get("layer_types") or ["sliding_attention"])

    def shared_size(self, hf, moe_inter):
        return hf.get("shared_expert_intermediate_size", 0)

    def attention(self, hf, H, nh):
        return get(hf, "head_dim", default=H // nh), hf.get("qkv_bias", True), False

    def gguf_fields(self, m, g, hf, d):
        super().gguf_fields(m, g, hf, d)
        shared = g("expert_shared_feed_forward_length", required=False, default=0)
        if shared == 0 and "blk.0.ffn_gate_shexp.weight" in m.tensors:
            shared = int(m.tensor("blk.0.ffn_gate_shexp.weight").shape[1])
        hf.update(shared_expert_intermediate_size=shared, qkv_bias=hf.pop("attention_bias"))

    def gguf_fixup(self, cfg, m):
        if cfg["shared_expert_intermediate_size"]:      # the gate is there or not: the file says
            cfg["shared_expert_gate"] = "blk.0.ffn_gate_inp_shexp.weight" in m.tensors
