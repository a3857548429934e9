"""Gemma 4 (transformers' gemma4_text, or gemma4 with the text model under text_config and
model.language_model beside vision / audio towers; GGUF arch gemma4): sandwich norms, a dense GeGLU
MLP beside routed GeGLU experts (moe_dense layers), a router on a scaled norm with per-expert scales,
sliding and full layers with their own head geometry and proportional rope, soft-capped logits.
"""
from __future__ import annotations

import sys

import numpy as np

from .common import Family, eos_bos, get, pos, refuse
from .registry import register
from .. import validate
from ...errors import ColibriError, COLIBRI_ERR_INVALID_MODEL_TYPE, invalid_model

SKIPPED = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def translate(hf: dict, gen: dict, path: str, dtype) -> dict:
    """Gemma 4 (transformers' gemma4_text, or gemma4 with the text model under text_config), the layer
    of modeling_gemma4.Gemma4TextDecoderLayer:
        x += out_norm(attn(input_norm(x)))                      (sandwich norms)
        m  = mlp.out_norm(mlp(pre_norm(x)))                     (GeGLU: gelu_tanh(gate) * up)
        e  = experts.out_norm(experts(experts_norm(x)))         routed on router_norm(x): softmax, top-k,
                                                                renormalised, times expert_scale[e]
        x  = scalar * (x + ffn_out_norm(m + e))
    Attention: q/k norms per head, v normed without a weight, softmax scale 1; sliding layers (window W,
    head_dim, KV heads, default rope) and full layers (their own head dim and KV heads, keys reused as
    values where attention_k_eq_v, proportional rope: frequencies over the whole head dim, the first
    partial_rotary_factor of them rotating). Embeddings times sqrt(H) (rounded to the weights' type),
    final logits soft-capped."""
    mt = hf["model_type"]
    if mt == "gemma4":
        tc = hf.get("text_config")
        if not isinstance(tc, dict):
            raise invalid_model(path, "text_config", "missing (a gemma4 checkpoint nests its text model's config)")
        hf = {**tc, "model_type": "gemma4_text"}
    H, nh, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    nkv = get(hf, "num_key_value_heads", default=nh)
    hd = get(hf, "head_dim", default=H // nh)
    if hf.get("hidden_size_per_layer_input"):
        refuse(path, "hidden_size_per_layer_input", f"per-layer input embeddings ({hf['hidden_size_per_layer_input']} "
                "per layer: Gemma 4 E2B/E4B)")
    if hf.get("num_kv_shared_layers"):
        refuse(path, "num_kv_shared_layers", f"layers that reuse another layer's KV cache "
                f"({hf['num_kv_shared_layers']})")
    if hf.get("use_bidirectional_attention") == "all":
        refuse(path, "use_bidirectional_attention", "bidirectional attention")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        refuse(path, "hidden_activation", f"activation {hf['hidden_activation']!r} (Gemma 4: gelu_pytorch_tanh)")
    if hf.get("attn_logit_softcapping") is not None:
        refuse(path, "attn_logit_softcapping", "attention logit soft-capping")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]
    types = list(types)
    if len(types) != L or any(t not in ("sliding_attention", "full_attention") for t in types):
        refuse(path, "layer_types", f"layer types {types!r}")
    types[-1] = "full_attention"                  # as transformers forces it
    rope = hf.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    per = {}                                      # layer -> overrides; transformers may zero-pad the keys ("05")
    for key, v in (hf.get("per_layer_config") or {}).items():
        if isinstance(v, dict) and str(key).isdigit():
            per[int(key)] = v
    gd, gkv = hf.get("global_head_dim", 512), hf.get("num_global_key_value_heads")
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    layers, E = [], hf.get("num_experts") or 0
    moe = bool(hf.get("enable_moe_block", False))
    if moe and not E:
        raise invalid_model(path, "num_experts", "missing (enable_moe_block is set)")
    top_k = hf.get("top_k_experts") or 1
    if moe and not 1 <= top_k <= E:
        raise invalid_model(path, "top_k_experts", f"{top_k} is not in 1..{E}")
    for i, t in enumerate(types):
        rp = rope.get(t) or {}
        rtype = rp.get("rope_type", "default")
        entry = {"layer_id": i, "type": "moe_dense" if moe else "dense", "moe_expert_start": i * E if moe else 0,
                 "moe_num_experts": E if moe else 0}
        if t == "full_attention":
            if per:        # as saved by transformers: each full layer's overrides
                o = per.get(i) or {}
                entry["head_dim"], entry["num_key_value_heads"] = int(o.get("head_dim", hd)), int(o.get(
                    "num_key_value_heads", nkv))
            else:          # as Google's configs give it
                entry["head_dim"] = int(gd)
                kv = gkv if (k_eq_v or "attention_k_eq_v" not in hf) else None
                entry["num_key_value_heads"] = int(kv if kv is not None else nkv)
            entry["k_eq_v"] = k_eq_v
        if rtype not in ("default", "proportional"):
            refuse(path, f"rope_parameters.{t}.rope_type", f"rope type {rtype!r}")
        if rp.get("factor", 1.0) != 1.0:
            refuse(path, f"rope_parameters.{t}.factor", "scaled proportional rope")
        partial = float(rp.get("partial_rotary_factor", 1.0))
        if rtype == "default" and partial != 1.0:
            refuse(path, f"rope_parameters.{t}.partial_rotary_factor", "partial rotary embeddings")
        entry["rope_theta"] = float(rp.get("rope_theta", 10_000.0))
        if rtype == "proportional" and partial != 1.0:
            entry["rope_partial"] = partial
        layers.append(entry)
    eos, bos = eos_bos(hf, gen)
    sw = int(hf.get("sliding_window", 512))
    cap = hf.get("final_logit_softcapping")
    cfg = {
        "format_version": 1, "model_type": mt, "architectures": hf.get("architectures") or [],
        "num_hidden_layers": L, "hidden_size": H, "intermediate_size": hf["intermediate_size"],
        "moe_intermediate_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 131072),
        "rope_theta": float((rope.get("sliding_attention") or {}).get("rope_theta", 10_000.0)),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "experts_per_layer": E if moe else 0, "top_k": top_k if moe else 1, "router_dtype": "float32",
        "router_mode": "topk", "norm_topk_prob": True, "shared_expert_intermediate_size": 0,
        "shared_expert_gate": False, "attention_bias": bool(hf.get("attention_bias", False)),
        "attention_out_bias": bool(hf.get("attention_bias", False)), "qk_norm": "per_head",
        "eos_token_ids": eos, "bos_token_id": bos, "weight_dtype": dtype, "layers": layers,
        "attention_scale": 1.0, "layer_types": types, "norm_layout": "sandwich", "ffn_act": "gelu_tanh",
        "embed_scale": float(H) ** 0.5, "v_norm": True, "layer_scalar": True,
    }
    if "sliding_attention" in types:
        cfg["sliding_window"] = sw
    if moe:
        cfg.update(expert_act="gelu_tanh", router_input_norm=True, expert_scale=True)
    if cap is not None:
        if not (np.isfinite(cap) and cap > 0):
            raise invalid_model(path, "final_logit_softcapping", f"{cap} is not a positive finite number")
        cfg["final_logit_softcap"] = float(cap)
    return cfg



def gguf_config(m) -> dict:
    """llama.cpp's gemma4 metadata -> a gemma4_text config (translate's input): per-layer
    KV heads (an array), sliding-layer and full-layer head dims (key_length_swa / key_length), the
    window pattern, both rope bases, the full layers' proportional rope from rope_freqs (1 where a
    frequency rotates, 1e30 where llama.cpp stops it), soft-capping, per-layer embeddings and shared
    KV layers (refused by name in translation when present)."""
    a = "gemma4."
    g = lambda k, kind=int, **kw: m.get(a + k, kind, **kw)            # noqa: E731
    L = pos(m, a + "block_count", g("block_count"), 1, validate.MAX_LAYERS)
    H = pos(m, a + "embedding_length", g("embedding_length"))
    nh = pos(m, a + "attention.head_count", g("attention.head_count"), 1, validate.MAX_HEADS)
    kv = g("attention.head_count_kv", list)
    kv = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * L
    swa = g("attention.sliding_window_pattern", list, required=False, default=[False] * L)
    if len(kv) != L or len(swa) != L:
        raise invalid_model(m.path, a + "attention.head_count_kv", f"{len(kv)} / {len(swa)} entries for {L} layers")
    hd_full = pos(m, a + "attention.key_length", g("attention.key_length"))
    hd_swa = pos(m, a + "attention.key_length_swa", g("attention.key_length_swa", required=False, default=hd_full))
    for k, want in (("attention.value_length", hd_full), ("attention.value_length_swa", hd_swa),
                    ("rope.dimension_count", hd_full), ("rope.dimension_count_swa", hd_swa)):
        v = g(k, required=False, default=want)
        if v != want:
            raise invalid_model(m.path, a + k, f"{v}, expected {want}: value dims unlike key dims, or partial rope "
                                "on the sliding layers, are not implemented")
    sw_kv = {kv[i] for i in range(L) if swa[i]}
    full_kv = {kv[i] for i in range(L) if not swa[i]}
    if len(sw_kv) > 1 or len(full_kv) != 1:
        raise invalid_model(m.path, a + "attention.head_count_kv", f"{kv}: one KV head count per layer kind expected")
    E = pos(m, a + "expert_count", g("expert_count", required=False, default=0), 0, validate.MAX_EXPERTS)
    if E == 0:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE, f"{m.path}: field '{a}expert_count': a dense gemma4 model "
                           "(no experts); Colibri runs mixture-of-experts models")
    partial = 1.0
    if "rope_freqs.weight" in m.tensors:
        ff = np.asarray(m.tensor("rope_freqs.weight").data, np.float32).reshape(-1)
        rot = int(np.sum(ff == 1.0))
        if ff.size != hd_full // 2 or not np.all((ff == 1.0) | (ff >= 1e29)) or np.any(ff[:rot] != 1.0):
            raise invalid_model(m.path, "rope_freqs.weight", "frequency factors other than llama.cpp's proportional "
                                "rope (1 for the rotated dims first, 1e30 for the rest) are not implemented")
        partial = rot / (hd_full // 2)
    ctx = pos(m, a + "context_length", g("context_length", required=False, default=131072), 1, validate.MAX_POSITIONS)
    eps = g("attention.layer_norm_rms_epsilon", float)
    V = int(m.tensor("token_embd.weight").shape[1]) if "token_embd.weight" in m.tensors else None
    if V is None:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    full = [i for i in range(L) if not swa[i]]
    k_eq_v = all(f"blk.{i}.attn_v.weight" not in m.tensors for i in full)
    cap = g("final_logit_softcapping", float, required=False)
    return {
        "model_type": "gemma4_text", "architectures": [], "num_hidden_layers": L, "hidden_size": H,
        "intermediate_size": pos(m, a + "feed_forward_length", g("feed_forward_length")),
        "moe_intermediate_size": pos(m, a + "expert_feed_forward_length", g("expert_feed_forward_length")),
        "num_attention_heads": nh, "num_key_value_heads": sw_kv.pop() if sw_kv else full_kv.copy().pop(),
        "head_dim": hd_swa, "vocab_size": V, "max_position_embeddings": ctx, "rms_norm_eps": eps,
        "tie_word_embeddings": "output.weight" not in m.tensors, "enable_moe_block": True, "num_experts": E,
        "top_k_experts": pos(m, a + "expert_used_count", g("expert_used_count"), 1, E),
        "sliding_window": g("attention.sliding_window", required=False, default=ctx),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "per_layer_config": {str(i): {"head_dim": hd_full, "num_key_value_heads": kv[i]} for i in full},
        "attention_k_eq_v": k_eq_v, "final_logit_softcapping": cap,
        "hidden_size_per_layer_input": g("embedding_length_per_layer_input", required=False, default=0),
        "num_kv_shared_layers": g("attention.shared_kv_layers", required=False, default=0),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": g("rope.freq_base_swa", float, required=False, default=10000.0)},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial,
                               "rope_theta": g("rope.freq_base", float, required=False, default=1e6)}},
    }


# ----------------------------------------------------------------------------------------------


@register
class Gemma4(Family):
    model_types = ("gemma4_text", "gemma4")
    gguf_archs = ("gemma4",)
    gguf_model_type = "gemma4_text"
    parts = {"mixer": "attention: sliding / full layers, own head dims, q/k/v norms, proportional rope",
             "ffn": "dense GeGLU MLP + routed GeGLU experts (moe_dense), sandwich norms, layer scalar",
             "router": "softmax top-k on a scaled norm, renormalised, per-expert scale"}
    wrapped = "gemma4"              # the model_type whose text weights are under model.language_model

    def translate(self, hf, gen, path, dtype):
        return translate(hf, gen, path, dtype)

    def prepare_source(self, src, hf, cfg, progress):
        if hf.get("model_type") == self.wrapped:      # text weights under model.language_model, towers skipped
            dropped = src.rebase("model.language_model.", "model.", SKIPPED)
            if dropped and progress:
                print(f"convert: {dropped} vision/audio tower tensors skipped (Colibri runs the text model)",
                      file=sys.stderr)

    def layer_sources(self, m, cfg, p, s, src):
        m[p + "attn.out_norm"] = s + "post_attention_layernorm.weight"
        m[p + "post_attention_norm"] = s + "pre_feedforward_layernorm.weight"
        m[p + "mlp.out_norm"] = s + "post_feedforward_layernorm_1.weight"
        m[p + "ffn_out_norm"] = s + "post_feedforward_layernorm.weight"
        m[p + "experts_norm"] = s + "pre_feedforward_layernorm_2.weight"
        m[p + "experts_out_norm"] = s + "post_feedforward_layernorm_2.weight"
        m[p + "router"] = s + "router.proj.weight"
        rs = np.float32(cfg["hidden_size"] ** -0.5)       # the router's input: norm(x) * scale / sqrt(H)
        m[p + "router_norm"] = (s + "router.scale", lambda a: (a * rs).astype(np.float32))
        m[p + "expert_scale"] = s + "router.per_expert_scale"
        m[p + "scalar"] = s + "layer_scalar"

    def gguf_config(self, m, arch):
        return gguf_config(m)

    def gguf_layer_names(self, m, cfg, p, b):
        m.update({p + "attn.out_norm": b + "post_attention_norm.weight", p + "mlp.out_norm": b + "post_ffw_norm_1.weight",
                  p + "ffn_out_norm": b + "post_ffw_norm.weight", p + "experts_norm": b + "pre_ffw_norm_2.weight",
                  p + "experts_out_norm": b + "post_ffw_norm_2.weight", p + "router_norm": b + "ffn_gate_inp.scale",
                  p + "expert_scale": b + "ffn_down_exps.scale", p + "scalar": b + "layer_output_scale.weight"})

    def gguf_tensor(self, tz, cfg, what, name, role):
        data, fmt = super().gguf_tensor(tz, cfg, what, name, role)
        if what.split(".", 2)[-1] == "router_norm":      # the router reads norm(x) * scale / sqrt(H)
            data = (data * np.float32(cfg["hidden_size"] ** -0.5)).astype(np.float32)
        return data, fmt

    def gguf_skipped(self, m, cfg, arch, progress):
        return {"rope_freqs.weight"}            # read into the full layers' rope (gguf_config)
