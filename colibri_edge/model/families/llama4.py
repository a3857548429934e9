"""Llama 4 (transformers' llama4_text, and llama4 with its vision tower skipped; Llama-4-Scout-17B-16E,
Maverick-17B-128E), modeling_llama4.Llama4TextDecoderLayer:

* attention of two kinds, by no_rope_layers (1: rope): rope layers rotate q and k (complex pairs, i.e.
  interleaved: the converter permutes q/k rows to the half-split layout, rope_pairs), L2-normalise them
  per head after rope (use_qk_norm: an RMS norm without weight, qk_norm "l2_after_rope") and attend in
  chunks of attention_chunk_size positions (layer_types "chunked_attention": p - p mod C .. p); no-rope
  layers ("nope") attend to every position, without rope or norm, their queries times the temperature
  log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (attn_temperature_tuning);
* rope scaling "llama3" (Scout: factor 8 over 8192) as a frequency table (runtime/rope.py);
* FFN: on moe_layers (interleave_moe_layer_step) a sigmoid top-1 router whose weight scales the expert's
  *input*, expert(sigmoid(logit) h) (router_input_scale; SwiGLU is not linear, so not its output), beside an
  ungated shared expert of the experts' width; elsewhere a dense SwiGLU of intermediate_size_mlp;
* experts stored fused and transposed: gate_up_proj [E, H, 2I] (gate columns first), down_proj [E, I, H].

GGUF (llama.cpp's llama4): the file says less than the config, and llama.cpp fills the rest with Scout's and
Maverick's values, as Colibri does: a no-rope layer every 4th (n_no_rope_layer_step), chunks of 8192 positions on
the rope layers, the temperature's floor_scale 8192 and attn_scale 0.1, L2 q/k norms unless the model has 128
experts (Maverick); a file with attention.sliding_window (MobileLLM-style patterns) is refused. The llama3
scaling arrives as rope_freqs, divisors of the frequencies (rope_scaling "freq_factors"); q/k rows are stored
as the checkpoint's (interleaved pairs), permuted on import as from a checkpoint.
"""
from __future__ import annotations

import sys

import numpy as np

from .common import Family, eos_bos, pos, refuse, unwrap_text
from .registry import register
from ...errors import invalid_model

SKIPPED = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")


def translate(hf: dict, gen: dict, path: str, dtype) -> dict:
    mt = hf["model_type"]
    if mt == "llama4":
        hf = unwrap_text(hf, path, "llama4_text")
    H, nh, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    nkv = hf.get("num_key_value_heads") or nh
    hd = hf.get("head_dim") or H // nh
    if hf.get("hidden_act", "silu") != "silu":
        refuse(path, "hidden_act", f"activation {hf['hidden_act']!r} (only silu / SwiGLU)")
    k = hf.get("num_experts_per_tok", 1)
    if k != 1:
        refuse(path, "num_experts_per_tok", f"{k}: Llama 4's router scales the expert's input by a top-1 weight")
    E = hf.get("num_local_experts", 16)
    interval = hf.get("no_rope_layer_interval", 4)
    rope_on = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
    step = hf.get("interleave_moe_layer_step", 1)
    moe = set(hf.get("moe_layers") if hf.get("moe_layers") is not None else range(step - 1, L, step))
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                      for r in rope_on]
    if len(rope_on) != L or len(types) != L or any(t not in ("chunked_attention", "full_attention") for t in types):
        refuse(path, "layer_types", f"layer types {types!r} / no_rope_layers {rope_on!r} for {L} layers")
    rope = dict(hf.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        refuse(path, "rope_parameters.rope_type", f"rope type {kind!r}")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 500000.0)))
    layers, start = [], 0
    for i in range(L):
        spec = {"layer_id": i, "type": "moe_shared" if i in moe else "dense",
                "moe_expert_start": start if i in moe else 0, "moe_num_experts": E if i in moe else 0}
        if not rope_on[i]:
            spec["nope"] = True
        layers.append(spec)
        start += E if i in moe else 0
    eos, bos = eos_bos(hf, gen)
    bias = bool(hf.get("attention_bias", False))
    cfg = {
        "format_version": 1, "model_type": "llama4_text", "architectures": hf.get("architectures") or [],
        "num_hidden_layers": L, "hidden_size": H, "intermediate_size": hf.get("intermediate_size_mlp") or 0,
        "moe_intermediate_size": hf["intermediate_size"], "num_attention_heads": nh, "num_key_value_heads": nkv,
        "head_dim": hd, "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 131072), "rope_theta": theta,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)), "experts_per_layer": E, "top_k": 1,
        "router_dtype": "float32", "router_mode": "topk", "norm_topk_prob": False,
        "shared_expert_intermediate_size": hf["intermediate_size"], "shared_expert_gate": False,
        "attention_bias": bias, "attention_out_bias": bias,
        "qk_norm": "l2_after_rope" if hf.get("use_qk_norm", True) else "none",
        "eos_token_ids": eos, "bos_token_id": bos, "weight_dtype": dtype, "layers": layers,
        "layer_types": types, "router_score": "sigmoid", "router_input_scale": True, "rope_pairs": "interleaved",
    }
    if "chunked_attention" in types:
        cfg["attention_chunk"] = int(chunk)
    if hf.get("attn_temperature_tuning", True) and not all(rope_on):
        cfg["attn_temperature"] = {"floor_scale": float(hf.get("floor_scale", 8192)),
                                   "attn_scale": float(hf.get("attn_scale", 0.1))}
    if kind == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(rope.get(f) is None for f in need):
            refuse(path, "rope_parameters", f"llama3 rope scaling without {', '.join(f for f in need if rope.get(f) is None)}")
        cfg["rope_scaling"] = {"rope_type": "llama3", **{f: rope[f] for f in need}}
    if any(l["type"] == "dense" for l in layers) and not cfg["intermediate_size"]:
        refuse(path, "intermediate_size_mlp", "dense layers without a size")
    return cfg


@register
class Llama4(Family):
    model_types = ("llama4_text", "llama4")
    gguf_archs = ("llama4",)
    gguf_model_type = "llama4_text"
    gguf_interleaved = True             # the checkpoint's interleaved q/k rows, as stored by the converter
    parts = {"mixer": "attention: chunked, rope + L2 q/k norm / full, no rope, query temperature",
             "ffn": "routed SwiGLU experts (input scaled by the weight) + ungated shared expert; dense SwiGLU "
                    "between MoE layers",
             "router": "sigmoid top-1"}

    def translate(self, hf, gen, path, dtype):
        return translate(hf, gen, path, dtype)

    def prepare_source(self, src, hf, cfg, progress):
        dropped = src.rebase("language_model.", "", SKIPPED)
        if dropped and progress:
            print(f"convert: {dropped} vision-tower tensors skipped (Colibri runs the text model)", file=sys.stderr)

    def source_names(self, cfg, src=None):
        m = super().source_names(cfg, src)               # the standard decoder's names; the FFN's differ
        for l in cfg["layers"]:
            p, f = f"layers.{l['layer_id']}.", f"model.layers.{l['layer_id']}.feed_forward."
            for x in ("gate", "up", "down"):
                m[p + f"mlp.{x}"] = f + f"{x}_proj.weight"
                m[p + f"shared.{x}"] = f + f"shared_expert.{x}_proj.weight"
            m[p + "router"] = f + "router.weight"
        return m

    def expert_sources(self, src, cfg, layer, j):
        """gate_up_proj [E, H, 2I] (gate columns, then up), down_proj [E, I, H]: each transposed to [out, in]."""
        f = f"model.layers.{layer}.feed_forward.experts."
        gu, dn = f + "gate_up_proj", f + "down_proj"
        if gu not in src:
            raise invalid_model(f"model.layers.{layer}", "feed_forward.experts.gate_up_proj", "missing")
        I = cfg["moe_intermediate_size"]
        return (lambda: src.float32(gu, j)[:, :I].T.copy(), lambda: src.float32(gu, j)[:, I:].T.copy(),
                lambda: src.float32(dn, j).T.copy()), [gu, dn]

    # -- GGUF ----------------------------------------------------------------------------------------
    def gguf_fields(self, m, g, hf, d):
        a, E = d["a"], d["E"]
        step = pos(m, a + "interleave_moe_layer_step", g("interleave_moe_layer_step", required=False, default=1),
                   1, d["L"])
        if d["dense"]:
            refuse(m.path, a + "leading_dense_block_count", f"{d['dense']} leading dense layers in a llama4 model "
                   "(its dense layers are those between interleave_moe_layer_step)")
        window = g("attention.sliding_window", required=False)
        if window is not None:          # llama.cpp: absent -> Scout's chunks; 0 -> none (its rope pattern unstated)
            refuse(m.path, a + "attention.sliding_window", f"{window}: a llama4 file with its own attention "
                   "pattern (Colibri runs llama4 files as llama.cpp does without the key: chunks of 8192)")
        hf.update(num_local_experts=E, intermediate_size=d["ff_exp"], intermediate_size_mlp=d["ff"] or 0,
                  interleave_moe_layer_step=step, use_qk_norm=E != 128,
                  no_rope_layer_interval=4, attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1,
                  attention_bias="blk.0.attn_q.bias" in m.tensors)

    def gguf_fixup(self, cfg, m):
        if "rope_freqs.weight" in m.tensors:
            ff = np.asarray(m.tensor("rope_freqs.weight").data, np.float64).reshape(-1)
            if ff.size != cfg["head_dim"] // 2 or not np.all(np.isfinite(ff) & (ff > 0)):
                raise invalid_model(m.path, "rope_freqs.weight", f"{ff.size} factors, expected head_dim / 2 = "
                                    f"{cfg['head_dim'] // 2} positive ones")
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": ff.tolist()}

    def gguf_skipped(self, m, cfg, arch, progress):
        return {"rope_freqs.weight"} & set(m.tensors)
