"""gpt-oss (transformers' gpt_oss; GGUF arch gpt-oss).

Router logits + bias, top-k, softmax over the k (= the top-k of the softmax renormalised); experts with
biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit); a sink logit per head; sliding and full
layers (transformers' default: even layers sliding, odd full; a window as long as the context is no
window), YaRN (llama.cpp's file: gpt-oss's untruncated correction range). The checkpoint computes x @ W:
gate_up_proj [E, H, 2I] with gate and up interleaved, down_proj [E, I, H]; its MXFP4 experts
(*_blocks / *_scales, U8) are kept in MXFP4 (ggml's layout, losslessly repacked) when no --dtype is given.
"""
from __future__ import annotations

import numpy as np

from .common import Family, pos, refuse
from .registry import register
from .. import validate
from ...errors import invalid_model


def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An OpenAI MXFP4 tensor -> ggml's mxfp4 rows, losslessly: blocks [R, G, 16] uint8 (byte b holds
    values 2b (low nibble) and 2b + 1 (high)), scales [R, G] uint8 (E8M0: 2^(e - 127)) ->
    [R, G * 17] (e | qs[16]: qs[i] holds value i (low nibble) and i + 16 (high)), the same numbers:
    ggml's 2^(e-128) times the doubled E2M1 value."""
    vals = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    out = np.empty((*blocks.shape[:-1], 17), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = vals[..., :16] | (vals[..., 16:] << 4)
    return out.reshape(blocks.shape[0], -1)


@register
class GptOss(Family):
    model_types = ("gpt_oss",)
    gguf_archs = ("gpt-oss",)
    gguf_model_type = "gpt_oss"
    parts = {"mixer": "attention with sinks, sliding / full layers", "ffn": "routed experts (clamped SwiGLU, biases)",
             "router": "top-k of logits + bias, softmax over the k"}
    renormalise = True
    refuses_act = False
    bias_default = True          # q/k/v/o all biased or none
    gguf_norm_topk = True
    gguf_yarn = True
    gguf_window = True

    def layer_plan(self, hf, L):
        return hf.get("num_local_experts", 8), hf["intermediate_size"], [True] * L

    def window_layers(self, hf, path, L, sw, uses_window, max_pos):
        layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                for i in range(L)]
        if not uses_window:                     # a window as long as the context is no window
            layer_types = ["full_attention"] * L
        bad = [t for t in layer_types if t not in ("sliding_attention", "full_attention")]
        if bad or len(layer_types) != L:
            refuse(path, "layer_types", f"layer types {sorted(set(bad)) or layer_types!r}")
        return layer_types

    def extra(self, hf, path, layer_types, sw):
        extra = dict(router_bias=True, expert_bias=True, attention_sinks=True, expert_act="swiglu_oai",
                     swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                     layer_types=layer_types)
        if "sliding_attention" in layer_types:
            extra["sliding_window"] = int(sw)
        return extra

    def layer_sources(self, m, cfg, p, s, src):
        m[p + "router"], m[p + "router_bias"] = s + "mlp.router.weight", s + "mlp.router.bias"
        m[p + "attn.sinks"] = s + "self_attn.sinks"
        gub = s + "mlp.experts.gate_up_proj_bias"       # [E, 2I], gate and up interleaved
        m[p + "experts.gate_bias"] = (gub, lambda a: a[:, 0::2].copy())
        m[p + "experts.up_bias"] = (gub, lambda a: a[:, 1::2].copy())
        m[p + "experts.down_bias"] = s + "mlp.experts.down_proj_bias"

    def fused_gate_up(self, src, cfg, fused, j):
        # x @ W, gate_up_proj [E, H, 2I] with gate and up interleaved, down_proj [E, I, H]
        gu = lambda: src.float32(fused + "gate_up_proj", j)          # noqa: E731
        return (lambda: gu()[:, 0::2].T.copy(), lambda: gu()[:, 1::2].T.copy(),
                lambda: src.float32(fused + "down_proj", j).T.copy()), [fused + "gate_up_proj", fused + "down_proj"]

    def packed_experts(self, src, layer):
        return f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks" in src

    def packed_expert(self, src, cfg, layer, j):
        """MXFP4 expert j as stored rows (gate [I, H/32*17], up, down [H, I/32*17]) and the source names:
        gate_up_proj_blocks [E, 2I, H/32, 16] (rows interleaved gate/up), down_proj_blocks [E, H, I/32, 16],
        with their *_scales."""
        p = f"model.layers.{layer}.mlp.experts."
        names = [p + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")]
        H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
        for n, shape in zip(names, ((2 * I, H // 32, 16), (2 * I, H // 32), (H, I // 32, 16), (H, I // 32))):
            if n not in src:
                raise invalid_model(p, n, "missing (an MXFP4 checkpoint holds blocks and scales of both projections)")
            if src.dtype(n) != "uint8" or tuple(src.shape(n)[1:]) != shape or H % 32 or I % 32:
                raise invalid_model(p, n, f"{src.dtype(n)} {list(src.shape(n))}: expected uint8 "
                                    f"[E, {', '.join(map(str, shape))}]")
        gu = mxfp4_rows(src.raw(names[0], j), src.raw(names[1], j))
        return (gu[0::2].copy(), gu[1::2].copy(), mxfp4_rows(src.raw(names[2], j), src.raw(names[3], j))), names

    def gguf_fields(self, m, g, hf, d):
        # llama.cpp's gpt-oss: even layers sliding (its fixed pattern), alpha 1.702 and limit 7 (fixed in
        # its graph; translate's defaults), YaRN with gpt-oss's untruncated correction range
        a, theta, scaling, factor = d["a"], d["theta"], d["scaling"], d["factor"]
        rope = {"rope_type": "default", "rope_theta": theta}
        if scaling == "yarn" and factor != 1.0:
            rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "truncate": False,
                    "original_max_position_embeddings": pos(m, a + "rope.scaling.original_context_length",
                                                            g("rope.scaling.original_context_length"), 1,
                                                            validate.MAX_POSITIONS),
                    "beta_fast": g("rope.scaling.yarn_beta_fast", float, required=False, default=32.0),
                    "beta_slow": g("rope.scaling.yarn_beta_slow", float, required=False, default=1.0)}
            af = g("rope.scaling.yarn_attn_factor", float, required=False)
            if af is not None:
                rope["attention_factor"] = af
        hf.update(num_local_experts=d["E"], intermediate_size=d["ff_exp"], attention_bias=True, rope_parameters=rope,
                  sliding_window=d["window"] or None)

    def gguf_layer_names(self, m, cfg, p, b):
        m[p + "post_attention_norm"] = b + "post_attention_norm.weight"
        m[p + "attn.sinks"] = b + "attn_sinks.weight"
        m[p + "router_bias"] = b + "ffn_gate_inp.bias"
        for x in ("gate", "up", "down"):
            m[p + f"experts.{x}_bias"] = b + f"ffn_{x}_exps.bias"


