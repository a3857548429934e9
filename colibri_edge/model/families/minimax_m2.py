"""MiniMax-M2 (transformers' minimax_m2; MiniMax-M2 / M2.1, 230B-A10B): the standard decoder with

* q/k RMSNorm over the whole projection, before rope (qk_norm "full", as OLMoE);
* partial rotary: the first rotary_dim = partial_rotary_factor x head_dim dims of each head rotate, in
  half-split pairs (i, i + rotary_dim / 2); the converter moves them to the pairs (i, i + D / 2) the
  rope kernels rotate (common.rope_dim_order), the q/k rows and their norms' weights alike (an RMS is
  blind to the order of what it averages; q.k is unchanged);
* a sigmoid router: experts chosen by sigmoid(logit) + e_score_correction_bias, weighted by the
  sigmoid scores renormalised over the chosen (DeepSeek-V3's rule without groups or scaling);
* routed experts only (block_sparse_moe.experts.N.w1 / w3 / w2, Mixtral's names), no shared expert.

GGUF minimax-m2 (llama.cpp's converter): the same tensors under llama.cpp's names, q/k rows as the
checkpoint's (no rope permutation), rope.dimension_count the rotated dims, exp_probs_b the choice bias.
"""
from __future__ import annotations

from .common import Family, get, refuse, rope_dim_order
from .registry import register
from ...errors import invalid_model


def reorder_rows(data, cfg: dict, part: str):
    """Partial rotary's dims moved to the rotated places (common.rope_dim_order) in q/k rows or norm
    weights, per head; whole rows move (a quantised row is copied)."""
    D = cfg["head_dim"]
    order = rope_dim_order(D, cfg.get("rope_dim", D))
    heads = cfg["num_attention_heads"] if part in ("attn.wq", "attn.q_norm") else cfg["num_key_value_heads"]
    if part.endswith("_norm"):
        return data.reshape(heads, D)[:, order].reshape(-1).copy()
    return data.reshape(heads, D, *data.shape[1:])[:, order].reshape(data.shape).copy()


@register
class MiniMaxM2(Family):
    model_types = ("minimax_m2",)
    gguf_archs = ("minimax-m2",)
    gguf_model_type = "minimax_m2"
    gguf_partial_rotary = True
    parts = {"mixer": "attention, q/k norm over the whole projection, partial rotary",
             "ffn": "routed SwiGLU experts", "router": "sigmoid + choice bias top-k, renormalised"}
    qk_norm = "full"
    renormalise = True
    moe_prefix = "block_sparse_moe"     # the checkpoints' (and save_pretrained's) names: experts.N.w1/w2/w3

    def translate(self, hf, gen, path, dtype):
        rope = dict(hf.get("rope_parameters") or {})
        partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        H, nh = hf["hidden_size"], hf["num_attention_heads"]
        hd = get(hf, "head_dim", default=H // nh)
        rope_dim = int(round(hd * partial))
        if not 2 <= rope_dim <= hd or rope_dim % 2:
            raise invalid_model(path, "rope_parameters.partial_rotary_factor", f"{partial} of head_dim {hd} gives "
                                f"{rope_dim} rotated dims: expected an even number from 2 to {hd}")
        if hf.get("shared_intermediate_size"):
            refuse(path, "shared_intermediate_size", "a shared expert in a MiniMax-M2 model")
        cfg = super().translate({**hf, "rope_parameters": rope, "partial_rotary_factor": 1.0}, gen, path, dtype)
        cfg.update(router_score="sigmoid", router_choice_bias=True)
        if rope_dim < hd:
            cfg["rope_dim"] = rope_dim
        return cfg

    def layer_sources(self, m, cfg, p, s, src):
        m[p + "router_choice_bias"] = s + "block_sparse_moe.e_score_correction_bias"
        if not cfg.get("rope_dim"):
            return
        a = s + "self_attn."
        for x in "qk":
            m[p + f"attn.w{x}"] = (a + f"{x}_proj.weight", lambda w, t=f"attn.w{x}": reorder_rows(w, cfg, t))
            m[p + f"attn.{x}_norm"] = (a + f"{x}_norm.weight", lambda w, t=f"attn.{x}_norm": reorder_rows(w, cfg, t))

    def gguf_tensor(self, tz, cfg, what, name, role):
        data, fmt = super().gguf_tensor(tz, cfg, what, name, role)
        part = what.split(".", 2)[-1]
        if cfg.get("rope_dim") and part in ("attn.wq", "attn.wk", "attn.q_norm", "attn.k_norm"):
            data = reorder_rows(data, cfg, part)
        return data, fmt
