"""Hunyuan-MoE (transformers' hunyuan_v1_moe; Hunyuan-A13B): the standard decoder with

* q/k RMSNorm per head applied after rope (query_layernorm / key_layernorm on the rotated q and k:
  qk_norm "per_head_after_rope"; a rotation keeps each pair's norm but not the weights' pairing, so the
  order matters);
* NTK-alpha rope (rope_parameters type "dynamic" with a fixed alpha): the base stretched once,
  theta' = theta alpha^(D / (D - 2)), independent of the sequence length: a plain rope of theta';
* a float32 softmax router (mlp.gate.wg), top-k renormalised; routed experts of intermediate_size and
  a shared MLP of intermediate_size added without a gate (mlp.shared_mlp).
Per-layer lists of experts or top-k (num_experts / moe_topk as lists) are refused unless constant.

GGUF (llama.cpp's hunyuan-moe): the converter writes the NTK-alpha base already stretched (rope.freq_base) and
Hunyuan's q/k norms as attn_q_norm / attn_k_norm; experts and the shared MLP must share one width
(expert_feed_forward_length = expert_shared_feed_forward_length, as Hunyuan-A13B's) and one shared expert.
"""
from __future__ import annotations

from .common import Family, get, pos, refuse
from .registry import register
from ...errors import invalid_model


def _one(hf: dict, key: str, path: str):
    v = hf.get(key)
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            refuse(path, key, f"per-layer values {v!r:.80} (Colibri's layer plan takes one)")
        v = v[0]
    return v


@register
class HunyuanMoe(Family):
    model_types = ("hunyuan_v1_moe",)
    gguf_archs = ("hunyuan-moe",)
    gguf_model_type = "hunyuan_v1_moe"
    gguf_norm_topk = True           # llama.cpp's hunyuan-moe graph renormalises the top-k weights
    parts = {"mixer": "attention, q/k norm per head after rope, NTK-alpha rope",
             "ffn": "routed SwiGLU experts + shared MLP (no gate)", "router": "softmax top-k, renormalised"}
    qk_norm = "per_head_after_rope"
    renormalise = True

    def translate(self, hf, gen, path, dtype):
        rope = dict(hf.get("rope_parameters") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        H, nh = hf["hidden_size"], hf["num_attention_heads"]
        D = get(hf, "head_dim", default=H // nh) or H // nh
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        if kind == "dynamic" and rope.get("alpha"):
            alpha = float(rope["alpha"])
            if not alpha > 0:
                raise invalid_model(path, "rope_parameters.alpha", f"{alpha} is not positive")
            theta *= alpha ** (D / (D - 2))
        elif kind not in ("default", None):
            refuse(path, "rope_parameters", f"rope type {kind!r} (default and NTK-alpha are run)")
        hf = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
              "num_experts": _one(hf, "num_experts", path), "num_experts_per_tok": _one(hf, "moe_topk", path)}
        return super().translate(hf, gen, path, dtype)

    def moe_width(self, hf):
        return hf["intermediate_size"]

    def shared_size(self, hf, moe_inter):
        return hf["intermediate_size"]

    def layer_sources(self, m, cfg, p, s, src):
        m[p + "router"] = s + "mlp.gate.wg.weight"
        m[p + "attn.q_norm"] = s + "self_attn.query_layernorm.weight"
        m[p + "attn.k_norm"] = s + "self_attn.key_layernorm.weight"
        for x in ("gate", "up", "down"):
            m[p + f"shared.{x}"] = s + f"mlp.shared_mlp.{x}_proj.weight"

    def gguf_fields(self, m, g, hf, d):
        a = d["a"]
        shared = pos(m, a + "expert_shared_feed_forward_length", g("expert_shared_feed_forward_length",
                                                                   required=False, default=d["ff_exp"]))
        if shared != d["ff_exp"]:
            refuse(m.path, a + "expert_shared_feed_forward_length", f"a shared MLP of {shared} beside experts of "
                   f"{d['ff_exp']} (Hunyuan-MoE's share intermediate_size)")
        n = g("expert_shared_count", required=False, default=1)
        if n != 1:
            refuse(m.path, a + "expert_shared_count", f"{n} shared experts (Hunyuan-MoE has one)")
        if d["dense"]:
            refuse(m.path, a + "leading_dense_block_count", f"{d['dense']} dense layers in a hunyuan-moe model")
        hf.update(num_experts=d["E"], moe_topk=d["k"], intermediate_size=d["ff_exp"],
                  attention_bias="blk.0.attn_q.bias" in m.tensors)
