"""Qwen3-Next (transformers' qwen3_next; Qwen3-Next-80B-A3B): Qwen3.5's layer before its projections were
split (qwen3_5_moe.py runs it: gated delta-nets beside attention with an output gate and partial rotary,
zero-centred norms, routed experts with a gated shared expert), with three differences:

* the gated delta-net's q, k, v and z come from one fused in_proj_qkvz whose rows run per key head g,
      [ q_g (dk) | k_g (dk) | v of g's r = Hv / Hk value heads (r dv) | z of them (r dv) ]
  and its b and a from one in_proj_ba, per key head [ b of g's value heads (r) | a of them (r) ]
  (transformers' fix_query_key_value_ordering); the converter cuts them into Qwen3.5's wqkv
  (every q, every k, every v), wz, wb and wa, value heads in the grouped order Qwen3.5 runs;
* experts on layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers, a dense SwiGLU of
  intermediate_size elsewhere;
* the router renormalises its top-k when norm_topk_prob (the released config: true).

The multi-token-prediction head (mtp.*) is converted, counted from its tensors (the configs do not say).

GGUF qwen3next (llama.cpp's converter): Qwen3.5's qwen35moe tensors, except that the converter has
already cut in_proj_qkvz into attn_qkv and attn_gate (value heads kept grouped, where qwen35moe tiles
them) and keeps in_proj_ba whole as ssm_ba (cut here, whole rows); the metadata says nothing of
norm_topk_prob, which llama.cpp's graph always applies (the released config's value), nor of dense
layers, which its converter cannot write.
"""
from __future__ import annotations

import numpy as np

from . import qwen3_5_moe as q35
from .common import refuse
from .registry import register


def translate(hf: dict, gen: dict, path: str, dtype) -> dict:
    E = hf.get("num_experts") or 0
    if not E:
        refuse(path, "num_experts", "a Qwen3-Next without routed experts")
    cfg = q35.translate(hf, gen, path, dtype)
    L, step = cfg["num_hidden_layers"], int(hf.get("decoder_sparse_step", 1) or 1)
    only = set(hf.get("mlp_only_layers") or [])
    si = cfg["shared_expert_intermediate_size"]
    layers, start = [], 0
    for i in range(L):
        if i not in only and (i + 1) % step == 0:
            layers.append({"layer_id": i, "type": "moe_shared" if si else "moe", "moe_expert_start": start,
                           "moe_num_experts": E})
            start += E
        else:
            layers.append({"layer_id": i, "type": "dense", "moe_expert_start": 0, "moe_num_experts": 0})
    cfg.update(model_type=hf["model_type"], layers=layers, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
               intermediate_size=hf.get("intermediate_size") or 0)
    if any(l["type"] == "dense" for l in layers) and not cfg["intermediate_size"]:
        refuse(path, "intermediate_size", "dense layers (mlp_only_layers / decoder_sparse_step) without a size")
    return cfg


def unfused(cfg: dict) -> dict:
    """Colibri tensor -> (checkpoint tensor, function): the fused projections cut per key head."""
    lin = cfg["linear_attention"]
    Hk, Hv, dk, dv = lin["num_key_heads"], lin["num_value_heads"], lin["key_head_dim"], lin["value_head_dim"]
    r = Hv // Hk

    def qkvz(x, part):
        g = x.reshape(Hk, 2 * dk + 2 * r * dv, -1)
        cuts = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv), "z": (2 * dk + r * dv, None)}
        a, b = cuts[part]
        return g[:, a:b].reshape(-1, x.shape[-1])

    def ba(x, j):
        return x.reshape(Hk, 2, r, -1)[:, j].reshape(Hv, -1).copy()

    m = {}
    for l in cfg["layers"]:
        i = l["layer_id"]
        if cfg["layer_types"][i] != "linear_attention":
            continue
        p, a = f"layers.{i}.", f"model.layers.{i}.linear_attn."
        m[p + "lin.wqkv"] = (a + "in_proj_qkvz.weight",
                             lambda x: np.concatenate([qkvz(x, "q"), qkvz(x, "k"), qkvz(x, "v")]).copy())
        m[p + "lin.wz"] = (a + "in_proj_qkvz.weight", lambda x: qkvz(x, "z").copy())
        m[p + "lin.wb"] = (a + "in_proj_ba.weight", lambda x: ba(x, 0))
        m[p + "lin.wa"] = (a + "in_proj_ba.weight", lambda x: ba(x, 1))
    return m


def gguf_ba(tz, cfg: dict, what: str, name: str, role):
    """(data, format) of lin.wb or lin.wa from ssm_ba [Hk * 2r rows]: per key head its r b rows, then its
    r a rows; whole rows move (a quantised row is copied)."""
    lin = cfg["linear_attention"]
    Hk, Hv = lin["num_key_heads"], lin["num_value_heads"]
    shape = role[0]
    data, fmt = tz.stored(name, (2 * shape[0], *shape[1:]), float32=role[1] == "float32")
    j = 0 if what.endswith("lin.wb") else 1
    return data.reshape(Hk, 2, Hv // Hk, *data.shape[1:])[:, j].reshape(Hv, *data.shape[1:]).copy(), fmt


@register
class Qwen3Next(q35.Qwen35Moe):
    model_types = ("qwen3_next",)
    mtp_from_tensors = True     # its configs do not say mtp_num_hidden_layers (as llama.cpp's converter finds)
    gguf_archs = ("qwen3next",)
    gguf_model_type = "qwen3_next"
    parts = {"mixer": "gated delta-net (fused q/k/v/z projection; recurrent state) / attention with output gate, "
                      "partial rotary",
             "ffn": "routed experts + shared expert (sigmoid gate), dense SwiGLU on mlp_only_layers",
             "router": "softmax top-k, renormalised when norm_topk_prob"}

    def translate(self, hf, gen, path, dtype):
        return translate(hf, gen, path, dtype)

    def source_names(self, cfg, src=None):
        m = super().source_names(cfg, src)
        m.update(unfused(cfg))
        return m

    def gguf_config(self, m, arch):
        hf = q35.gguf_config(m, arch)
        hf.update(model_type="qwen3_next", linear_value_head_order="grouped", norm_topk_prob=True)
        return hf

    def gguf_layer_names(self, m, cfg, p, b):
        super().gguf_layer_names(m, cfg, p, b)
        m[p + "lin.wa"] = m[p + "lin.wb"] = b + "ssm_ba.weight"

    def gguf_tensor(self, tz, cfg, what, name, role):
        if what.endswith(("lin.wa", "lin.wb")):
            return gguf_ba(tz, cfg, what, name, role)
        return super().gguf_tensor(tz, cfg, what, name, role)
