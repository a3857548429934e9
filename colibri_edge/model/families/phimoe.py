"""Phi-3.5-MoE (transformers' phimoe; microsoft/Phi-3.5-MoE-instruct, 42B-A6.6B): the standard decoder with

* LayerNorms with biases everywhere a norm is (input_layernorm, post_attention_layernorm, model.norm:
  norm_type "layernorm", program.norm);
* q/k/v/o biases (attention_bias) and, when lm_head_bias, a bias on the head;
* LongRoPE (rope_type "longrope"): frequencies theta^(-2i/D) / ext_i, ext the short factors, cos and sin
  times short_mscale -- transformers' PhimoeRotaryEmbedding for a sequence within the original context.
  Past it transformers keeps the short factors and switches only the mscale, per forward call, so that
  one sequence's keys are rotated one way and its later queries another; Colibri picks once per engine,
  as llama.cpp does by its context: an engine whose max_seq_len exceeds original_max_position_embeddings
  runs the long factors and long_mscale (runtime/rope.py);
* the sparsemixer router at inference (router_mode "sparsemixer", base.Backend.sparsemixer): top-2, each
  weight the softmax of its expert over the experts within a relative 2 router_jitter_noise of it, not
  renormalised;
* routed SwiGLU experts under block_sparse_moe (Mixtral's names, as the checkpoints and save_pretrained
  write them).

GGUF (llama.cpp's phimoe): the LongRoPE factors are tensors (rope_factors_short / rope_factors_long), the
original context rope.scaling.original_context_length, and the attention factor rope.scaling.attn_factor, which
llama.cpp's converter computes as sqrt(1 + ln(factor) / ln(L0)) instead of copying the config's short_mscale /
long_mscale (Phi-3.5-MoE-instruct's 1.2432 become 1.1902 in its files): the file's value is run, as llama.cpp
does. The file does not carry router_jitter_noise: the sparsemixer band is Phi-3.5-MoE's published 0.01.
"""
from __future__ import annotations

import math

import numpy as np

from .common import Family, refuse
from .registry import register
from ...errors import invalid_model


ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
PUBLISHED_JITTER = 0.01             # Phi-3.5-MoE-instruct's router_jitter_noise (not in its GGUF files)


@register
class PhiMoe(Family):
    model_types = ("phimoe",)
    gguf_archs = ("phimoe",)
    gguf_model_type = "phimoe"
    parts = {"mixer": "attention with q/k/v/o biases, LongRoPE", "ffn": "routed SwiGLU experts (block_sparse_moe)",
             "router": "sparsemixer top-2 (softmax within the jitter band), LayerNorms with biases"}
    moe_prefix = "block_sparse_moe"

    def translate(self, hf, gen, path, dtype):
        rope = dict(hf.get("rope_parameters") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if kind == "longrope":
            scaling = longrope(rope, hf, path)
        elif kind != "default":
            refuse(path, "rope_parameters.rope_type", f"rope type {kind!r}")
        k = hf.get("num_experts_per_tok", 2)
        if k != 2:
            refuse(path, "num_experts_per_tok", f"{k}: Phi-3.5-MoE's sparsemixer router picks 2 experts")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        cfg = super().translate({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": theta}},
                                gen, path, dtype)
        jitter = float(hf.get("router_jitter_noise", 0.01))
        if not 0 <= jitter <= 1:
            raise invalid_model(path, "router_jitter_noise", f"{jitter} is not in [0, 1]")
        cfg.update(norm_type="layernorm", router_mode="sparsemixer", router_jitter=jitter, norm_topk_prob=False,
                   attention_out_bias=cfg["attention_bias"])
        if hf.get("lm_head_bias"):
            cfg["lm_head_bias"] = True
        if scaling:
            cfg["rope_scaling"] = scaling
        return cfg

    def source_names(self, cfg, src=None):
        return biases(super().source_names(cfg, src), cfg, "model.norm.bias", "lm_head.bias", "model.layers.{}.",
                      "input_layernorm.bias", "post_attention_layernorm.bias")

    # -- GGUF ----------------------------------------------------------------------------------------
    def gguf_fields(self, m, g, hf, d):
        a = d["a"]
        if d["dense"]:
            refuse(m.path, a + "leading_dense_block_count", f"{d['dense']} dense layers in a phimoe model")
        hf.update(num_local_experts=d["E"], intermediate_size=d["ff_exp"], attention_bias="blk.0.attn_q.bias"
                  in m.tensors, lm_head_bias="output.bias" in m.tensors, router_jitter_noise=PUBLISHED_JITTER)
        have = [n in m.tensors for n in ROPE_FACTORS]
        if any(have) and not all(have):
            raise invalid_model(m.path, ROPE_FACTORS[have.index(False)], "missing (LongRoPE needs both factor lists)")
        if all(have):
            short, long_ = (np.asarray(m.tensor(n).data, np.float64).reshape(-1).tolist() for n in ROPE_FACTORS)
            orig = g("rope.scaling.original_context_length")
            hf["rope_parameters"] = {"rope_type": "longrope", "rope_theta": d["theta"], "short_factor": short,
                                     "long_factor": long_, "original_max_position_embeddings": orig,
                                     "attention_factor": g("rope.scaling.attn_factor", float, required=False,
                                                           default=1.0)}

    def gguf_names(self, cfg):
        return biases(super().gguf_names(cfg), cfg, "output_norm.bias", "output.bias", "blk.{}.", "attn_norm.bias",
                      "ffn_norm.bias")

    def gguf_skipped(self, m, cfg, arch, progress):
        return {n for n in ROPE_FACTORS if n in m.tensors}       # read into rope_scaling


def biases(m: dict, cfg: dict, norm: str, head: str, layer: str, inp: str, post: str) -> dict:
    """The LayerNorms' and the head's biases added to a name map (layer: the source's layer prefix, "{}" the
    layer id)."""
    m.update({"norm_bias": norm, "lm_head_bias": head})
    for l in cfg["layers"]:
        p, s = f"layers.{l['layer_id']}.", layer.format(l["layer_id"])
        m[p + "input_norm_bias"], m[p + "post_attention_norm_bias"] = s + inp, s + post
    return m


def longrope(rope: dict, hf: dict, path: str) -> dict:
    """rope_parameters of rope_type longrope -> our rope_scaling (runtime/rope.py reads it)."""
    H, nh = hf["hidden_size"], hf["num_attention_heads"]
    half = (hf.get("head_dim") or H // nh) // 2
    orig = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if not isinstance(orig, int) or orig < 1:
        refuse(path, "rope_parameters.original_max_position_embeddings", "LongRoPE without its original context")
    out = {"rope_type": "longrope", "original_max_position_embeddings": orig,
           "factor": hf.get("max_position_embeddings", orig) / orig}
    for f in ("short_factor", "long_factor"):
        v = rope.get(f)
        if not isinstance(v, list) or len(v) != half or not all(isinstance(x, (int, float)) and x > 0 for x in v):
            raise invalid_model(path, f"rope_parameters.{f}", f"expected {half} positive factors (head_dim / 2)")
        out[f] = [float(x) for x in v]
    for f in ("short_mscale", "long_mscale", "attention_factor"):
        if rope.get(f) is not None:
            if not (isinstance(rope[f], (int, float)) and math.isfinite(rope[f]) and rope[f] > 0):
                raise invalid_model(path, f"rope_parameters.{f}", f"{rope[f]!r} is not a positive number")
            out[f] = float(rope[f])
    return out
