"""ERNIE-4.5-MoE (transformers' ernie4_5_moe; GGUF arch ernie4_5-moe).

MoE where (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index (-1:
the last layer), moe_num_shared_experts ungated shared experts of the experts' width. The router: softmax,
the choice by p + e_score_correction_bias, weights p / max(sum, moe_norm_min) (a GGUF: floor 1e-12, the
Hugging Face default: no key carries moe_norm_min). The rope pairs adjacent dims (2i, 2i+1), in a
checkpoint and a GGUF alike: the q/k rows are permuted to the half-split layout every backend runs
(attention scores are unchanged: q and k get the same permutation). A GGUF's shared experts are as wide as
ffn_gate_shexp (its expert_shared_feed_forward_length is not their width).
"""
from __future__ import annotations

from .common import Family, get, pos, refuse
from .registry import register
from ...errors import invalid_model


@register
class Ernie45Moe(Family):
    model_types = ("ernie4_5_moe",)
    gguf_archs = ("ernie4_5-moe",)
    gguf_model_type = "ernie4_5_moe"
    parts = {"mixer": "attention (interleaved rope pairs, permuted at conversion)",
             "ffn": "routed experts + ungated shared experts; dense layers",
             "router": "softmax, choice bias, renormalised with a floor"}
    renormalise = True
    gguf_ff_required = True
    gguf_ff_exp_required = True
    gguf_norm_topk = True
    gguf_interleaved = True

    def check(self, hf, path):
        if hf.get("use_bias"):
            refuse(path, "use_bias", "biases in every projection and the head")

    def layer_plan(self, hf, L):
        E = get(hf, "moe_num_experts", "num_experts", default=64)
        start, interval = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_interval", 1) or 1
        end = hf.get("moe_layer_end_index", -1)
        end = L - 1 if end in (None, -1) else end
        return E, hf["moe_intermediate_size"], [(i + 1) % interval == 0 and start <= i <= end for i in range(L)]

    def shared_size(self, hf, moe_inter):
        return moe_inter * (hf.get("moe_num_shared_experts", 0) or 0)

    def top_k(self, hf):
        return get(hf, "moe_k", "num_experts_per_tok", default=6)

    def attention(self, hf, H, nh):          # use_bias is refused (check)
        return get(hf, "head_dim", default=H // nh), False, False

    def extra(self, hf, path, layer_types, sw):
        extra = {"router_choice_bias": True, "router_norm_min": float(hf.get("moe_norm_min", 1e-12)),
                 "rope_pairs": "interleaved"}
        if not 0.0 <= extra["router_norm_min"] <= 1.0:
            raise invalid_model(path, "moe_norm_min", f"{extra['router_norm_min']} is not in [0, 1]")
        return extra

    def layer_sources(self, m, cfg, p, s, src):
        for x in ("gate", "up", "down"):
            m[p + f"shared.{x}"] = s + f"mlp.shared_experts.{x}_proj.weight"
        m[p + "router_choice_bias"] = s + "mlp.moe_statics.e_score_correction_bias"

    def gguf_fields(self, m, g, hf, d):
        a, L, dense, ff_exp = d["a"], d["L"], d["dense"], d["ff_exp"]
        step = pos(m, a + "interleave_moe_layer_step", g("interleave_moe_layer_step", required=False, default=1), 1, L)
        shared = 0
        if "blk.0.ffn_gate_shexp.weight" in m.tensors or f"blk.{dense}.ffn_gate_shexp.weight" in m.tensors:
            t = m.tensor(f"blk.{dense}.ffn_gate_shexp.weight" if f"blk.{dense}.ffn_gate_shexp.weight" in m.tensors
                         else "blk.0.ffn_gate_shexp.weight")
            shared = int(t.shape[1])
            if shared % ff_exp:
                raise invalid_model(m.path, f"blk.{dense}.ffn_gate_shexp.weight", f"{shared} rows is not a whole "
                                    f"number of experts of {ff_exp}")
        hf.update(moe_num_experts=d["E"], moe_k=d["k"], moe_intermediate_size=ff_exp, intermediate_size=d["ff"],
                  moe_layer_start_index=dense, moe_layer_interval=step, moe_layer_end_index=-1,
                  moe_num_shared_experts=shared // ff_exp, moe_norm_min=1e-12)
