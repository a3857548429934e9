"""Granite 4.0-H (transformers' granitemoehybrid; IBM's Granite-4.0-H-Tiny 7B-A1B and -Small 32B-A9B): Mamba-2
layers beside a few attention layers, every layer's FFN routed experts plus a shared MLP,
modeling_granitemoehybrid.GraniteMoeHybridDecoderLayer:
    x += r * mixer(input_layernorm(x));  x += r * (moe(h) + shared_mlp(h)),  h = post_attention_layernorm(x)
mixer, by layer_types ("mamba" / transformers 5's "linear_attention", "attention" / "full_attention"):
  * Mamba-2 (our "mamba", program.Mamba2): in_proj @ h = z | x B C | dt; x B C through a depthwise causal
    conv of mamba_d_conv taps with a bias, then SiLU; per head h of mamba_d_head dims the selective scan
    S = e^(dt A) S + dt x B^T, y = S C + D x with dt = softplus(dt + dt_bias), A = -exp(A_log) (base.ssm_scan:
    the chunked SSD form in prefill, the recurrence in decode); out_proj @ (rmsnorm(y * silu(z)) * norm). Its
    state per sequence is the conv's last K-1 inputs and S [heads, head_dim, d_state] (the recurrent pool's
    slot: with 48 heads of 64, d_state 128, 4 taps over 1536 hidden, as Granite-4.0-H-Tiny, 3 x 3328 x 4 B +
    48 x 64 x 128 x 4 B = 1.54 MiB a layer);
  * attention: GQA, softmax scale attention_multiplier, rope only when position_embedding_type is "rope"
    (the released models use none: every attention layer "nope").
Granite's multipliers are folded into the weights as in granitemoe.py (embedding_multiplier into the
embeddings, residual_multiplier into every residual branch's last projection, 1 / logits_scaling into the
head). Router: softmax over the top-k logits (= the top-k softmax renormalised).

Refused: mamba_n_groups > 1 (the gated RMSNorm then normalises per group), biases in in_proj / out_proj
(mamba_proj_bias), a conv without bias, a time_step_limit other than (0, inf) (the released configs'), models
without routed experts (Granite-4.0-H-Micro: a dense model). GGUF (llama.cpp's granitehybrid) is not imported yet.
"""
from __future__ import annotations

import math

import numpy as np

from .common import refuse
from .granitemoe import GraniteMoeShared
from .registry import register
from .. import validate
from ...errors import invalid_model

TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
         "full_attention": "full_attention"}                    # HF layer_types (both spellings) -> ours


def _number(v):
    """A config number: JSON's, or transformers' spelling of a non-finite one ({"__float__": "Infinity"})."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


@register
class GraniteMoeHybrid(GraniteMoeShared):
    model_types = ("granitemoehybrid",)
    parts = {"mixer": "Mamba-2 (recurrent state: the conv's last inputs and the scan's S) / attention (scale "
                      "attention_multiplier, rope or none)",
             "ffn": "routed experts + shared MLP", "router": "softmax top-k, renormalised"}

    def check(self, hf, path):
        if hf.get("mamba_proj_bias"):
            refuse(path, "mamba_proj_bias", "biases in the Mamba-2 layers' in_proj / out_proj")
        if not hf.get("mamba_conv_bias", True):
            refuse(path, "mamba_conv_bias", "a Mamba-2 conv without its bias")
        lim = hf.get("time_step_limit", (0.0, math.inf))
        if lim is not None and (not isinstance(lim, (list, tuple)) or len(lim) != 2 or
                                [_number(v) for v in lim] != [0.0, math.inf]):
            refuse(path, "time_step_limit", f"clamping the time steps to {lim!r}")
        if not hf.get("num_local_experts", 8):
            refuse(path, "num_local_experts", "a Granite 4.0-H model without routed experts (a dense model)")
        pe = hf.get("position_embedding_type")
        if pe not in (None, "nope", "rope"):
            refuse(path, "position_embedding_type", f"position embeddings {pe!r}")

    def extra(self, hf, path, layer_types, sw):
        extra = super().extra(hf, path, layer_types, sw)
        H, L = hf["hidden_size"], hf["num_hidden_layers"]
        types = hf.get("layer_types") or hf.get("layers_block_type")
        if not isinstance(types, list) or len(types) != L or any(t not in TYPES for t in types):
            refuse(path, "layer_types", f"layer types {types!r} (expected {L} of {', '.join(TYPES)})")
        inner = int(hf.get("mamba_expand", 2)) * H
        nh = int(hf.get("mamba_n_heads", 128))
        P = hf.get("mamba_d_head", "auto")
        P = inner // nh if P == "auto" else int(P)
        if nh * P != inner:
            raise invalid_model(path, "mamba_d_head", f"{nh} heads x {P} dims is not mamba_expand x hidden_size "
                                f"= {inner}")
        K = int(hf.get("mamba_d_conv", 4))
        if not 2 <= K <= validate.MAX_CONV_KERNEL:
            raise invalid_model(path, "mamba_d_conv", f"{K} taps: Colibri's conv kernels run 2 to "
                                f"{validate.MAX_CONV_KERNEL}")
        G = int(hf.get("mamba_n_groups", 1))
        if G != 1:
            refuse(path, "mamba_n_groups", f"{G} groups (the gated RMSNorm per group; Granite 4.0-H has 1)")
        extra["layer_types"] = [TYPES[t] for t in types]
        extra["mamba"] = {"conv_kernel": K, "num_heads": nh, "head_dim": P, "n_groups": G,
                          "state_size": int(hf.get("mamba_d_state", 256))}
        return extra

    def translate(self, hf, gen, path, dtype):
        cfg = super().translate(hf, gen, path, dtype)
        if hf.get("position_embedding_type") != "rope":      # no rope anywhere: every attention layer "nope"
            for l in cfg["layers"]:
                if cfg["layer_types"][l["layer_id"]] == "full_attention":
                    l["nope"] = True
        return cfg

    def layer_sources(self, m, cfg, p, s, src):
        super().layer_sources(m, cfg, p, s, src)
        i = int(p.split(".")[1])
        if cfg["layer_types"][i] != "mamba":
            return
        mb, a = cfg["mamba"], s + "mamba."
        D = mb["num_heads"] * mb["head_dim"]
        C = D + 2 * mb["n_groups"] * mb["state_size"]
        m[p + "ssm.wz"] = (a + "in_proj.weight", 0, D)
        m[p + "ssm.wxbc"] = (a + "in_proj.weight", D, D + C)
        m[p + "ssm.wdt"] = (a + "in_proj.weight", D + C, D + C + mb["num_heads"])
        m[p + "ssm.conv"] = (a + "conv1d.weight", lambda w: w.reshape(w.shape[0], -1).copy())
        m[p + "ssm.conv_bias"] = a + "conv1d.bias"
        m[p + "ssm.a_neg"] = (a + "A_log", lambda x: (-np.exp(x.astype(np.float64))).astype(np.float32))
        m[p + "ssm.d"] = a + "D"
        m[p + "ssm.dt_bias"] = a + "dt_bias"
        m[p + "ssm.norm"] = a + "norm.weight"
        m[p + "ssm.wo"] = a + "out_proj.weight"

    def fold_factors(self, cfg):
        f = super().fold_factors(cfg)
        if f:
            r = cfg["folded_multipliers"]["residual_multiplier"]
            for l in cfg["layers"]:
                f[f"layers.{l['layer_id']}.ssm.wo"] = r
        return f
