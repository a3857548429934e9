"""OLMoE (transformers' olmoe; GGUF arch olmoe): every layer MoE (intermediate_size is the experts'
width), softmax top-k not renormalised, q/k RMSNorm over the whole projection (qk_norm "full", whose
sizes assume head_dim = hidden / heads)."""
from __future__ import annotations

from .common import Family
from .registry import register


@register
class Olmoe(Family):
    model_types = ("olmoe",)
    gguf_archs = ("olmoe",)
    gguf_model_type = "olmoe"
    parts = {"mixer": "attention, q/k norms over the projection", "ffn": "routed experts",
             "router": "softmax top-k, not renormalised"}
    qk_norm = "full"
    head_dim_field = False
    gguf_ff_required = True
    gguf_dense_ok = False

    def moe_width(self, hf):
        return hf["intermediate_size"]

    def gguf_fields(self, m, g, hf, d):
        hf.update(num_experts=d["E"], intermediate_size=d["ff_exp"])
