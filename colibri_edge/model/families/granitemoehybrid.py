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
without routed experts (Granite-4.0-H-Micro: a dense model).

GGUF (llama.cpp's granitehybrid): the layer types from the per-layer attention.head_count_kv (0: Mamba-2), rope
only when rope.scaling.finetuned (the converter's flag: false for Granite 4.0-H), in_proj cut into z / xBC / dt
rows and the q/k rows un-permuted (whole rows: a quantised row is copied, never requantised). The multipliers
cannot be folded into quantised weights without requantising, so they are taken out exactly instead: with the
residual stream carried as y = x / r (r = residual_scale), every branch adds unscaled (y += f(norm(y))), the
embeddings enter times embedding_scale / r (embed_scale), and the stream's RMSNorms keep their value on y when
their epsilon is eps / r^2 (x / sqrt(mean x^2 + eps) = y / sqrt(mean y^2 + eps / r^2)); the Mamba-2 gated norm,
off the stream, keeps eps (mamba.norm_eps); 1 / logit_scale goes into the final norm's weight (float32).
"""
from __future__ import annotations

import math

import numpy as np

from .common import decoder_shape, gguf_vocab, pos, refuse
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


def gguf_scales(m, arch: str) -> dict:
    """Granite's multipliers in a granitehybrid file (absent: 1), by their config names."""
    out = {}
    for key, field in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                       ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
        v = m.get(f"{arch}.{key}", float, required=False, default=1.0)
        if not (math.isfinite(v) and v > 0):
            raise invalid_model(m.path, f"{arch}.{key}", f"{v} is not a positive finite number")
        out[field] = float(v)
    return out


SSM_PARTS = {"ssm.wz": 0, "ssm.wxbc": 1, "ssm.wdt": 2}         # in_proj's row blocks: z | x B C | dt


@register
class GraniteMoeHybrid(GraniteMoeShared):
    model_types = ("granitemoehybrid",)
    gguf_archs = ("granitehybrid",)
    gguf_model_type = "granitemoehybrid"
    gguf_interleaved = True             # llama.cpp's Granite converters permute q/k rows (llama's layout)
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

    # -- GGUF ----------------------------------------------------------------------------------------
    def gguf_config(self, m, arch):
        a, g, L, H, nh = decoder_shape(m, arch)
        kv = g("attention.head_count_kv", list, required=False)
        if kv is None or len(kv) != L or not all(isinstance(x, (int, np.integer)) and 0 <= int(x) <= nh for x in kv):
            raise invalid_model(m.path, a + "attention.head_count_kv", f"expected {L} per-layer KV head counts in "
                                f"0..{nh} (0: a Mamba-2 layer)")
        nkvs = {int(x) for x in kv if x}
        if len(nkvs) > 1:
            raise invalid_model(m.path, a + "attention.head_count_kv", f"{sorted(nkvs)}: Colibri runs one KV head "
                                "count over the attention layers")
        odd = [i for i, x in enumerate(kv) if not x and f"blk.{i}.attn_q.weight" in m.tensors]
        if odd:
            raise invalid_model(m.path, a + "attention.head_count_kv", f"layer {odd[0]} is a Mamba-2 layer here (0 KV "
                                "heads) but holds attention tensors: llama.cpp's converter read a config whose layer "
                                "types it does not know (transformers 5 writes full_attention / linear_attention; it "
                                "needs attention / mamba); convert again from the published config.json")
        E = pos(m, a + "expert_count", g("expert_count", required=False, default=0), 0, validate.MAX_EXPERTS)
        if not E:
            refuse(m.path, a + "expert_count", "a granitehybrid model without routed experts (a dense model)")
        eps = g("attention.layer_norm_rms_epsilon", float)
        if not 0 < eps < 1:
            raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
        inner = pos(m, a + "ssm.inner_size", g("ssm.inner_size"))
        heads = pos(m, a + "ssm.time_step_rank", g("ssm.time_step_rank"), 1, validate.MAX_HEADS)
        if inner % H or inner % heads:
            raise invalid_model(m.path, a + "ssm.inner_size", f"{inner}: expected a multiple of the hidden size {H} "
                                f"and of the {heads} heads")
        mult = gguf_scales(m, arch)
        return {"model_type": "granitemoehybrid", "architectures": [], "num_hidden_layers": L, "hidden_size": H,
                "num_attention_heads": nh, "num_key_value_heads": nkvs.pop() if nkvs else nh,
                "vocab_size": gguf_vocab(m), "rms_norm_eps": eps, "tie_word_embeddings": "output.weight" not in m.tensors,
                "max_position_embeddings": pos(m, a + "context_length", g("context_length", required=False,
                                                                          default=4096), 1, validate.MAX_POSITIONS),
                "rope_theta": g("rope.freq_base", float, required=False, default=10000.0),
                "position_embedding_type": "rope" if g("rope.scaling.finetuned", bool, required=False,
                                                       default=False) else None,
                "layer_types": ["attention" if x else "mamba" for x in kv],
                "num_local_experts": E, "num_experts_per_tok": pos(m, a + "expert_used_count",
                                                                   g("expert_used_count"), 1, E),
                "intermediate_size": pos(m, a + "feed_forward_length", g("feed_forward_length")),
                "shared_intermediate_size": pos(m, a + "expert_shared_feed_forward_length",
                                                g("expert_shared_feed_forward_length", required=False, default=0), 0),
                "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // H,
                "mamba_d_state": pos(m, a + "ssm.state_size", g("ssm.state_size"), 1, 1 << 10),
                "mamba_d_conv": pos(m, a + "ssm.conv_kernel", g("ssm.conv_kernel"), 2, validate.MAX_CONV_KERNEL),
                "mamba_n_groups": pos(m, a + "ssm.group_count", g("ssm.group_count", required=False, default=1), 1,
                                      validate.MAX_HEADS),
                "attention_multiplier": mult["attention_multiplier"]}

    def gguf_fixup(self, cfg, m):
        mult = gguf_scales(m, self.gguf_archs[0])
        r = mult["residual_multiplier"]
        if mult["embedding_multiplier"] / r != 1.0:
            cfg["embed_scale"] = mult["embedding_multiplier"] / r
        if r != 1.0 and "mamba" in cfg:
            cfg["mamba"]["norm_eps"] = cfg["rms_norm_eps"]
        cfg["rms_norm_eps"] = cfg["rms_norm_eps"] / (r * r)

    def gguf_names(self, cfg):
        m = super().gguf_names(cfg)
        for l in cfg["layers"]:
            i = l["layer_id"]
            if cfg["layer_types"][i] != "mamba":
                continue
            p, b = f"layers.{i}.", f"blk.{i}."
            for part in SSM_PARTS:
                m[p + part] = b + "ssm_in.weight"
            m.update({p + "ssm.conv": b + "ssm_conv1d.weight", p + "ssm.conv_bias": b + "ssm_conv1d.bias",
                      p + "ssm.a_neg": b + "ssm_a", p + "ssm.d": b + "ssm_d", p + "ssm.dt_bias": b + "ssm_dt.bias",
                      p + "ssm.norm": b + "ssm_norm.weight", p + "ssm.wo": b + "ssm_out.weight"})
        return m

    def gguf_tensor(self, tz, cfg, what, name, role):
        part = what.split(".", 2)[-1]
        mb = cfg.get("mamba")
        if part in SSM_PARTS:               # whole rows of in_proj [z | xBC | dt, H]
            D = mb["num_heads"] * mb["head_dim"]
            C = D + 2 * mb["n_groups"] * mb["state_size"]
            edges = (0, D, D + C, D + C + mb["num_heads"])
            data, fmt = tz.stored(name, (edges[-1], *role[0][1:]), float32=role[1] == "float32")   # dt: float32
            j = SSM_PARTS[part]
            return data[edges[j]:edges[j + 1]].copy(), fmt
        if part in ("ssm.a_neg", "ssm.d"):  # stored [heads, 1]
            data, fmt = tz.stored(name, (role[0][0], 1), float32=True)
            return data.reshape(role[0]).copy(), fmt
        data, fmt = super().gguf_tensor(tz, cfg, what, name, role)
        if what == "norm":                  # 1 / logit_scale into the final norm's weight
            ls = gguf_scales(tz.m, self.gguf_archs[0])["logits_scaling"]
            data = (np.asarray(data, np.float32) / np.float32(ls)).astype(np.float32)
        return data, fmt
