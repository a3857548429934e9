"""Granite-MoE (transformers' granitemoe, and granitemoeshared with an ungated shared MLP; no GGUF arch).

Every layer MoE: input_linear [E, 2I, H] = [gate; up] and output_linear per layer, a router under
block_sparse_moe.router (.weight or .layer.weight), head_dim = hidden / heads, q/k/v/o all biased or
none. attention_multiplier is the softmax scale; the other multipliers are folded into the weights by
convert() (Granite(x) = the same model with embed * embedding_multiplier, o_proj / every down projection
* residual_multiplier, lm_head / logits_scaling), so every backend runs it unchanged. Softmax over the
top-k logits = the top-k softmax probabilities renormalised.
"""
from __future__ import annotations

import numpy as np

from .common import Family
from .registry import register
from ...errors import invalid_model

FOLDED = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


@register
class GraniteMoe(Family):
    model_types = ("granitemoe",)
    parts = {"mixer": "attention (scale attention_multiplier)", "ffn": "routed experts (fused input_linear)",
             "router": "softmax top-k, renormalised"}
    renormalise = True
    head_dim_field = False
    moe_prefix = "block_sparse_moe"

    def layer_plan(self, hf, L):
        return hf.get("num_local_experts", 8), hf["intermediate_size"], [True] * L

    def extra(self, hf, path, layer_types, sw):
        extra = {"attention_scale": float(hf.get("attention_multiplier", 1.0)),
                 "folded_multipliers": {k: float(hf.get(k, 1.0)) for k in FOLDED}}
        for k, v in [("attention_multiplier", extra["attention_scale"]), *extra["folded_multipliers"].items()]:
            if not (np.isfinite(v) and v > 0):
                raise invalid_model(path, k, f"{v} is not a positive finite number")
        return extra

    def tied(self, hf, extra):
        fm = extra["folded_multipliers"]
        # the embedding and the head get different factors: lm_head is written on its own
        return super().tied(hf, extra) and fm["embedding_multiplier"] == 1.0 and fm["logits_scaling"] == 1.0

    def layer_sources(self, m, cfg, p, s, src):
        r = s + "block_sparse_moe.router."
        m[p + "router"] = r + "weight" if src is not None and r + "weight" in src else r + "layer.weight"
        Is = cfg["shared_expert_intermediate_size"]      # the shared MLP's input_linear: [gate; up]
        m[p + "shared.gate"] = (s + "shared_mlp.input_linear.weight", 0, Is)
        m[p + "shared.up"] = (s + "shared_mlp.input_linear.weight", Is, 2 * Is)
        m[p + "shared.down"] = s + "shared_mlp.output_linear.weight"

    def fold_factors(self, cfg):
        fm = cfg.get("folded_multipliers")
        if not fm:
            return {}
        r = fm["residual_multiplier"]
        f = {"embed_tokens": fm["embedding_multiplier"], "lm_head": 1.0 / fm["logits_scaling"], "expert.down": r}
        for l in cfg["layers"]:
            p = f"layers.{l['layer_id']}."
            f[p + "attn.wo"] = f[p + "attn.bo"] = f[p + "shared.down"] = f[p + "mlp.down"] = r
        return f


@register
class GraniteMoeShared(GraniteMoe):
    """granitemoeshared: GraniteMoe with an ungated shared MLP of shared_intermediate_size."""
    model_types = ("granitemoeshared",)
    parts = {**GraniteMoe.parts, "ffn": "routed experts + ungated shared MLP"}

    def shared_size(self, hf, moe_inter):
        return hf.get("shared_intermediate_size", 0) or 0
