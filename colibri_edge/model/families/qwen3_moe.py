"""Qwen3-MoE (transformers' qwen3_moe; GGUF arch qwen3moe): the Family defaults are Qwen's decoder
(decoder_sparse_step / mlp_only_layers, moe_intermediate_size, experts under mlp.), here without the
shared expert of Qwen2-MoE, with per-head q/k RMSNorm, attention biases only where attention_bias;
softmax top-k renormalised in llama.cpp (norm_topk_prob in a checkpoint)."""
from __future__ import annotations

from .common import Family
from .registry import register


@register
class Qwen3Moe(Family):
    model_types = ("qwen3_moe",)
    gguf_archs = ("qwen3moe",)
    gguf_model_type = "qwen3_moe"
    parts = {"mixer": "attention, per-head q/k norms", "ffn": "routed experts", "router": "softmax top-k"}
    qk_norm = "per_head"
    gguf_ff_exp_required = True
    gguf_norm_topk = True
