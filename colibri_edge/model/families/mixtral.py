"""Mixtral (transformers' mixtral; GGUF arch `llama` with expert_count > 0).

Every layer MoE: num_local_experts SwiGLU experts (w1 gate, w3 up, w2 down) under block_sparse_moe,
softmax top-k renormalised (llama.cpp computes it so: no key carries it), no attention biases.
llama.cpp's converter permutes the q/k rows of a `llama` file from Hugging Face's half-split rope
layout into adjacent pairs: they are un-permuted on import (rows are whole blocks: bytes move).
"""
from __future__ import annotations

from .common import Family, get
from .registry import register


@register
class Mixtral(Family):
    model_types = ("mixtral",)
    gguf_archs = ("llama",)
    gguf_model_type = "mixtral"
    gguf_note = "llama with experts: Mixtral"
    parts = {"mixer": "attention", "ffn": "routed experts (SwiGLU), every layer", "router": "softmax top-k, renormalised"}
    renormalise = True
    moe_prefix = "block_sparse_moe"
    gguf_ff_required = True
    gguf_dense_ok = False
    gguf_norm_topk = True
    gguf_interleaved = True

    def layer_plan(self, hf, L):
        return hf.get("num_local_experts", 8), hf["intermediate_size"], [True] * L

    def attention(self, hf, H, nh):
        return get(hf, "head_dim", default=H // nh), False, False

    def gguf_fields(self, m, g, hf, d):
        hf.update(num_local_experts=d["E"], intermediate_size=d["ff_exp"])
