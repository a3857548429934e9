"""`colibri convert`: a Hugging Face MoE checkpoint (safetensors, possibly sharded) -> model directory.

Streams tensor by tensor from memory-mapped shards, so peak memory is about one tensor (in float32)
whatever the checkpoint's size. float32/float16/bfloat16 sources are read without torch.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
from tqdm import tqdm

from .dtypes import MIXES, WEIGHT_DTYPES, block_of, fits, narrow, nbytes, widen
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL_TYPE, invalid_model
from .gguf_import import unpermute
from .validate import YARN_FIELDS
from .modeldir import ALIGN, SUPPORTED_MODEL_TYPES, ModelWriter, check_disk, expected_tensors, expert_blob_bytes

SAFETENSORS_DTYPES = {"F32": ("<f4", "float32"), "F16": ("<f2", "float16"), "BF16": ("<u2", "bfloat16"),
                      "U8": ("u1", "uint8")}      # U8: only as packed MXFP4 (*_blocks / *_scales, gpt-oss)
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json", "chat_template.jinja", "chat_template.json")


# ----------------------------------------------------------------------------------------------
# reading safetensors shards lazily

class SafetensorsIndex:
    """name -> lazily read tensor, over one or many .safetensors shards.

    The header of a shard is JSON after an 8-byte length (the format's spec); each tensor is read
    with one positioned read when it is converted (not mapped: mapped pages would count in the
    process's resident memory). The `safetensors` package cannot hand bfloat16 to NumPy, hence this.
    """

    def __init__(self, hf_dir: str):
        self.entries = {}
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise invalid_model(index, "weight_map", f"unreadable shard index ({e})") from None
        else:
            shards = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
        if not shards:
            raise invalid_model(hf_dir, "(files)", "no .safetensors weights found; save the model with "
                                "save_pretrained(..., safe_serialization=True)")
        for shard in shards:
            self._add_shard(os.path.join(hf_dir, shard))

    def _add_shard(self, path):
        if not os.path.exists(path):
            raise invalid_model(path, "(file)", "shard named in the index is missing")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise invalid_model(path, "(header)", f"not a safetensors file ({e})") from None
        data_start = 8 + n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in SAFETENSORS_DTYPES:
                raise invalid_model(path, name, f"dtype {meta['dtype']} is not supported; "
                                    "expected F32, F16 or BF16")
            self.entries[name] = (path, data_start + meta["data_offsets"][0], data_start + meta["data_offsets"][1],
                                  meta["dtype"], tuple(meta["shape"]))

    def __contains__(self, name):
        return name in self.entries

    def rebase(self, prefix: str, to: str, skip: tuple = ()) -> int:
        """Tensors named prefix... are read as to... (a wrapped model's text weights); those under a
        `skip` prefix are dropped (a vision tower the text model does not run). -> how many dropped."""
        kept = {}
        for n, e in self.entries.items():
            if n.startswith(skip):
                continue
            kept[to + n[len(prefix):] if n.startswith(prefix) else n] = e
        dropped = len(self.entries) - len(kept)
        self.entries = kept
        return dropped

    def dtype(self, name) -> str:
        return SAFETENSORS_DTYPES[self.entries[name][3]][1]

    def shape(self, name):
        return self.entries[name][4]

    def raw(self, name, index=None) -> np.ndarray:
        """The tensor (or its slice [index] along the first axis) as stored."""
        path, a, b, dt, shape = self.entries[name]
        np_dt = SAFETENSORS_DTYPES[dt][0]
        count = int(np.prod(shape))
        if index is not None:
            count //= shape[0]
            a += index * count * np.dtype(np_dt).itemsize
            shape = shape[1:]
        if a + count * np.dtype(np_dt).itemsize > os.path.getsize(path):
            raise invalid_model(path, name, "data runs past the end of the file (truncated shard?)")
        return np.fromfile(path, dtype=np_dt, count=count, offset=a).reshape(shape)

    def float32(self, name, index=None) -> np.ndarray:
        """The tensor (or its slice [index] along the first axis) widened to float32: one copy."""
        path, a, b, dt, shape = self.entries[name]
        np_dt, ours = SAFETENSORS_DTYPES[dt]
        if ours == "uint8":
            raise invalid_model(path, name, "holds U8 data where a float tensor belongs; only MXFP4 experts "
                                "(*_blocks with *_scales) may be U8")
        count = int(np.prod(shape))
        if index is not None:                   # one slice along the first axis: read only it
            count //= shape[0]
            a += index * count * np.dtype(np_dt).itemsize
            shape = shape[1:]
        if a + count * np.dtype(np_dt).itemsize > os.path.getsize(path):
            raise invalid_model(path, name, "data runs past the end of the file (truncated shard?)")
        raw = np.fromfile(path, dtype=np_dt, count=count, offset=a).reshape(shape)
        return np.asarray(widen(raw, ours), dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# config translation

def _get(hf, *names, default=None):
    for n in names:
        if hf.get(n) is not None:
            return hf[n]
    return default


def _refuse(path, field, msg):
    raise invalid_model(path, field, f"{msg}; Colibri does not implement it and will not guess")


def _eos_bos(hf: dict, gen: dict):
    eos = _get(gen, "eos_token_id", default=None)
    if eos is None:
        eos = hf.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return [e for e in eos if 0 <= e < hf["vocab_size"]], _get(gen, "bos_token_id", default=hf.get("bos_token_id"))


GEMMA4_SKIPPED = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def _gemma4_config(hf: dict, gen: dict, path: str, dtype) -> dict:
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
    nkv = _get(hf, "num_key_value_heads", default=nh)
    hd = _get(hf, "head_dim", default=H // nh)
    if hf.get("hidden_size_per_layer_input"):
        _refuse(path, "hidden_size_per_layer_input", f"per-layer input embeddings ({hf['hidden_size_per_layer_input']} "
                "per layer: Gemma 4 E2B/E4B)")
    if hf.get("num_kv_shared_layers"):
        _refuse(path, "num_kv_shared_layers", f"layers that reuse another layer's KV cache "
                f"({hf['num_kv_shared_layers']})")
    if hf.get("use_bidirectional_attention") == "all":
        _refuse(path, "use_bidirectional_attention", "bidirectional attention")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        _refuse(path, "hidden_activation", f"activation {hf['hidden_activation']!r} (Gemma 4: gelu_pytorch_tanh)")
    if hf.get("attn_logit_softcapping") is not None:
        _refuse(path, "attn_logit_softcapping", "attention logit soft-capping")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]
    types = list(types)
    if len(types) != L or any(t not in ("sliding_attention", "full_attention") for t in types):
        _refuse(path, "layer_types", f"layer types {types!r}")
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
            _refuse(path, f"rope_parameters.{t}.rope_type", f"rope type {rtype!r}")
        if rp.get("factor", 1.0) != 1.0:
            _refuse(path, f"rope_parameters.{t}.factor", "scaled proportional rope")
        partial = float(rp.get("partial_rotary_factor", 1.0))
        if rtype == "default" and partial != 1.0:
            _refuse(path, f"rope_parameters.{t}.partial_rotary_factor", "partial rotary embeddings")
        entry["rope_theta"] = float(rp.get("rope_theta", 10_000.0))
        if rtype == "proportional" and partial != 1.0:
            entry["rope_partial"] = partial
        layers.append(entry)
    eos, bos = _eos_bos(hf, gen)
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


MLA_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
QWEN35_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
QWEN35_SKIPPED = ("model.visual.", "mtp.", "model.mtp.")   # the vision tower, multi-token prediction


def _qwen35_config(hf: dict, gen: dict, path: str, dtype) -> dict:
    """Qwen3.5 / 3.6-MoE (transformers' qwen3_5_moe, its text model under text_config, or
    qwen3_5_moe_text), the layer of modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer:
        x += mixer(norm(x));  x += moe(norm(x)) + sigmoid(shared_gate @ h) shared(h)
    mixer: a gated delta-net on layer_types "linear_attention" (program.GatedDeltaNet), else attention
    whose q projection emits a query and an output gate per head (sigmoid, before o_proj), per-head q/k
    norms, partial rotary (the first partial_rotary_factor of the head's dims; M-RoPE, which for text
    is the 1-D rope). Norms are zero-centred (x^ (1 + w)): the converter folds the 1 into the weights;
    the router always renormalises its top-k."""
    mt = hf["model_type"]
    if mt == "qwen3_5_moe":
        tc = hf.get("text_config")
        if not isinstance(tc, dict):
            raise invalid_model(path, "text_config", "missing (a qwen3_5_moe checkpoint nests its text model's config)")
        hf = {**tc, "model_type": "qwen3_5_moe_text", "tie_word_embeddings": hf.get(
            "tie_word_embeddings", tc.get("tie_word_embeddings", False))}
    H, nh, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    nkv = _get(hf, "num_key_value_heads", default=nh)
    hd = _get(hf, "head_dim", default=H // nh)
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(path, "hidden_act", f"activation {hf['hidden_act']!r} (only silu / SwiGLU)")
    if hf.get("attention_bias"):
        _refuse(path, "attention_bias", "biases in the attention projections")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        _refuse(path, "rope_parameters.rope_type", f"rope type {rope.get('rope_type')!r}")
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    rope_dim = int(hd * partial)
    if not 2 <= rope_dim <= hd or rope_dim % 2:
        raise invalid_model(path, "rope_parameters.partial_rotary_factor", f"{partial} of head_dim {hd} gives "
                            f"{rope_dim} rotated dims: expected an even number from 2 to {hd}")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000_000.0)))
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % hf.get("full_attention_interval", 4)
                                      else "full_attention" for i in range(L)]
    if len(types) != L or any(t not in ("linear_attention", "full_attention") for t in types):
        _refuse(path, "layer_types", f"layer types {types!r}")
    if "full_attention" not in types:
        _refuse(path, "layer_types", "a model without any full-attention layer")
    E, top_k = hf.get("num_experts") or 0, hf.get("num_experts_per_tok", 8)
    if not E or not 1 <= top_k <= E:
        raise invalid_model(path, "num_experts_per_tok", f"{top_k} is not in 1..{E}")
    si = hf.get("shared_expert_intermediate_size") or 0
    layers = [{"layer_id": i, "type": "moe_shared" if si else "moe", "moe_expert_start": i * E,
               "moe_num_experts": E} for i in range(L)]
    lin = {"conv_kernel": hf.get("linear_conv_kernel_dim", 4), "num_key_heads": hf.get("linear_num_key_heads", 16),
           "num_value_heads": hf.get("linear_num_value_heads", 32), "key_head_dim": hf.get("linear_key_head_dim", 128),
           "value_head_dim": hf.get("linear_value_head_dim", 128)}
    order = hf.get("linear_value_head_order", "grouped")          # "tiled": llama.cpp's GGUF layout
    if order != "grouped":
        lin["value_head_order"] = order
    eos, bos = _eos_bos(hf, gen)
    return {
        "format_version": 1, "model_type": mt, "architectures": hf.get("architectures") or [],
        "num_hidden_layers": L, "hidden_size": H, "intermediate_size": hf.get("intermediate_size") or 0,
        "moe_intermediate_size": hf["moe_intermediate_size"], "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 32768), "rope_theta": theta,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "experts_per_layer": E, "top_k": top_k, "router_dtype": "float32", "router_mode": "topk",
        "norm_topk_prob": True, "shared_expert_intermediate_size": si, "shared_expert_gate": bool(si),
        "attention_bias": False, "attention_out_bias": False, "qk_norm": "per_head",
        "eos_token_ids": eos, "bos_token_id": bos, "weight_dtype": dtype, "layers": layers,
        "layer_types": list(types), "linear_attention": lin, "attention_output_gate": True,
        **({"rope_dim": rope_dim} if rope_dim < hd else {}),
    }


def rope_dim_order(D: int, r: int) -> np.ndarray:
    """The head's dims in the order that puts partial rotary's pairs (i, i + r/2), i < r/2, at the
    half-split places (i, i + D/2): new dim -> old dim. The unrotated dims fill the rest in order."""
    h, p = r // 2, (D - r) // 2
    return np.concatenate([np.arange(h), r + np.arange(p), h + np.arange(h), r + p + np.arange(D - r - p)])


def _yarn(rope: dict, max_pos: int, path: str):
    """rope_parameters -> our rope_scaling (None for the default rope); other rope types refused."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        _refuse(path, "rope_parameters.rope_type", f"rope type {rope_type!r}")
    rs = {k: rope[k] for k in YARN_FIELDS if rope.get(k) is not None}
    if "original_max_position_embeddings" not in rs:
        _refuse(path, "rope_parameters.original_max_position_embeddings", "YaRN without its original context")
    rs.setdefault("factor", max_pos / rs["original_max_position_embeddings"])
    return rs


def mtp_layers(hf: dict) -> int:
    """Multi-token-prediction layers a DeepSeek-V3 / GLM checkpoint stores after its decoder layers
    (model.layers.L.. ): the converter skips them (speculative heads; the model runs without them)."""
    return int(_get(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0) or 0) \
        if hf.get("model_type") in ("deepseek_v3", "glm4_moe_lite") else 0


def _mla_config(hf: dict, gen: dict, path: str, dtype) -> dict:
    """DeepSeek-V2 / V3 and GLM-4.7-Flash (transformers' deepseek_v2, deepseek_v3, glm4_moe_lite):
    multi-head latent attention in every layer (q through q_lora_rank or a plain projection, the
    latent of kv_lora_rank and a rope key shared by the heads; interleaved rope pairs, permuted by the
    converter to the half-split layout), dense first layers (first_k_dense_replace, mlp_layer_types),
    then routed experts beside ungated shared ones (n_shared_experts x moe_intermediate_size).
    Routers: V2 softmax, top-k over all experts (greedy) or within the topk_group best of n_group groups
    scored by their maximum (group_limited_greedy), never renormalised; V3 / GLM sigmoid, the choice by
    score + e_score_correction_bias within the topk_group best groups scored by the sum of their top
    two, weights the scores (renormalised when norm_topk_prob, with 1e-20 as transformers); all times
    routed_scaling_factor. YaRN's mscale_all_dim enters the softmax scale squared."""
    mt = hf["model_type"]
    H, nh, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    max_pos = hf.get("max_position_embeddings", 4096)
    for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(hf.get(f), int) or hf[f] < 1:
            raise invalid_model(path, f, f"{hf.get(f)!r}: latent attention needs a positive integer")
    if hf.get("attention_bias"):
        _refuse(path, "attention_bias", "biases on the latent attention's projections")
    if hf.get("mlp_bias"):
        _refuse(path, "mlp_bias", "biases in the feed-forward")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(path, "hidden_act", f"activation {hf['hidden_act']!r} (only silu / SwiGLU)")
    rope = hf.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(path, "partial_rotary_factor", "partial rotary embeddings of the rope key")
    rope_scaling = _yarn(rope, max_pos, path)
    if hf.get("rope_scaling") and (hf["rope_scaling"].get("rope_type", hf["rope_scaling"].get("type")) or "default") \
            != "default" and rope_scaling is None:
        _refuse(path, "rope_scaling", f"rope scaling {hf['rope_scaling']!r}")
    theta = float(_get(rope, "rope_theta", default=None) or _get(hf, "rope_theta", default=10000.0))
    E = _get(hf, "n_routed_experts", "num_local_experts", "num_experts", default=0)
    top_k = hf.get("num_experts_per_tok") or 1
    if E and not 1 <= top_k <= E:
        raise invalid_model(path, "num_experts_per_tok", f"{top_k} is not in 1..{E}")
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        k0 = hf.get("first_k_dense_replace", 1 if mt == "glm4_moe_lite" else 0) or 0
        kinds = ["dense" if i < k0 else "sparse" for i in range(L)]
    if len(kinds) != L or set(kinds) - {"dense", "sparse"}:
        _refuse(path, "mlp_layer_types", f"MLP layer types {kinds!r}")
    shared = int(hf.get("n_shared_experts") or 0)
    moe_inter = hf["moe_intermediate_size"]
    layers, start = [], 0
    for i, kind in enumerate(kinds):
        if kind == "sparse" and E:
            layers.append({"layer_id": i, "type": "moe_shared" if shared else "moe", "moe_expert_start": start,
                           "moe_num_experts": E})
            start += E
        else:
            layers.append({"layer_id": i, "type": "dense", "moe_expert_start": 0, "moe_num_experts": 0})
    extra = {}
    n_group, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if mt == "deepseek_v2":
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            _refuse(path, "topk_method", f"routing method {method!r} (DeepSeek-V2: greedy, group_limited_greedy)")
        normalize, group_top = False, 1
        if method == "greedy":
            n_group = 1
    else:
        normalize, group_top = bool(hf.get("norm_topk_prob", True)), 2
        extra.update(router_score="sigmoid", router_choice_bias=True)
        if normalize:
            extra["router_norm_min"] = 1e-20
    if n_group > 1 and E:
        if E % n_group or not 1 <= topk_group <= n_group or E // n_group < group_top:
            raise invalid_model(path, "n_group", f"{n_group} groups (topk_group {topk_group}) do not fit {E} "
                                f"experts (groups of at least {group_top})")
        if top_k > topk_group * (E // n_group):
            raise invalid_model(path, "num_experts_per_tok", f"{top_k} is more than the {topk_group} kept groups "
                                f"of {E // n_group} experts hold")
        extra["router_groups"] = {"n_group": n_group, "topk_group": topk_group, "group_top": group_top}
    scaling = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
    if not (np.isfinite(scaling) and scaling > 0):
        raise invalid_model(path, "routed_scaling_factor", f"{scaling} is not a positive finite number")
    if scaling != 1.0:
        extra["routed_scaling_factor"] = scaling
    if rope_scaling:
        extra["rope_scaling"] = rope_scaling
    interleaved = mt == "deepseek_v2" or bool(hf.get("rope_interleave", True))
    eos, bos = _eos_bos(hf, gen)
    dr = hf["qk_rope_head_dim"]
    return {
        **extra, "format_version": 1, "model_type": mt, "architectures": hf.get("architectures") or [],
        "num_hidden_layers": L, "hidden_size": H, "intermediate_size": hf["intermediate_size"],
        "moe_intermediate_size": moe_inter, "num_attention_heads": nh, "num_key_value_heads": nh, "head_dim": dr,
        "vocab_size": hf["vocab_size"], "max_position_embeddings": max_pos, "rope_theta": theta,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)), "experts_per_layer": E if start else 0,
        "top_k": top_k if start else 1, "router_dtype": "float32", "router_mode": "topk", "norm_topk_prob": normalize,
        "shared_expert_intermediate_size": shared * moe_inter if start else 0, "shared_expert_gate": False,
        "attention_bias": False, "attention_out_bias": False, "qk_norm": "none", "eos_token_ids": eos,
        "bos_token_id": bos, "weight_dtype": dtype, "layers": layers,
        "rope_pairs": "interleaved" if interleaved else "half_split",
        "latent_attention": {"kv_lora_rank": hf["kv_lora_rank"], "q_lora_rank": int(hf.get("q_lora_rank") or 0),
                             "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": dr,
                             "v_head_dim": hf["v_head_dim"], "norm_eps": 1e-6},
    }


def translate_config(hf: dict, gen: dict, path: str = "config.json", dtype: str | None = None) -> dict:
    """Hugging Face config.json (+ generation_config.json) -> Colibri config.json."""
    mt = hf.get("model_type")
    if mt in ("gemma4", "gemma4_text"):
        return _gemma4_config(hf, gen, path, dtype)
    if mt in MLA_TYPES:
        return _mla_config(hf, gen, path, dtype)
    if mt in QWEN35_TYPES:
        return _qwen35_config(hf, gen, path, dtype)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE,
                           f"{path}: field 'model_type': {mt!r} is not supported; supported: "
                           f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    H, nh = hf["hidden_size"], hf["num_attention_heads"]
    nkv = _get(hf, "num_key_value_heads", default=nh)
    L = hf["num_hidden_layers"]
    max_pos = hf.get("max_position_embeddings", 4096)

    # -- features we refuse rather than compute wrongly --
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None
    if rope_type == "yarn":
        rope_scaling = {k: rope[k] for k in YARN_FIELDS if rope.get(k) is not None}
        if "original_max_position_embeddings" not in rope_scaling:
            _refuse(path, "rope_parameters.original_max_position_embeddings", "YaRN without its original context")
        rope_scaling.setdefault("factor", max_pos / rope_scaling["original_max_position_embeddings"])
    elif rope_type != "default":
        _refuse(path, "rope_parameters.rope_type", f"rope type {rope_type!r}")
    if hf.get("rope_scaling"):
        rs = hf["rope_scaling"]
        if rs.get("rope_type", rs.get("type", "default")) != "default":
            _refuse(path, "rope_scaling", f"rope scaling {rs!r}")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(path, "partial_rotary_factor", "partial rotary embeddings")
    if hf.get("clip_qkv") is not None:
        _refuse(path, "clip_qkv", f"clipping q/k/v to {hf['clip_qkv']}")
    oss = mt == "gpt_oss"
    if hf.get("hidden_act", "silu") != "silu" and not oss:
        _refuse(path, "hidden_act", f"activation {hf['hidden_act']!r} (only silu / SwiGLU)")
    sw = hf.get("sliding_window")
    uses_window = sw not in (None, 0) and sw < max_pos
    if mt == "qwen2_moe":
        uses_window = uses_window and hf.get("use_sliding_window", False) and \
            "sliding_attention" in (hf.get("layer_types") or ["sliding_attention"])
    layer_types = None
    if oss:         # transformers' default: even layers sliding, odd layers full
        layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                for i in range(L)]
        if not uses_window:                     # a window as long as the context is no window
            layer_types = ["full_attention"] * L
        bad = [t for t in layer_types if t not in ("sliding_attention", "full_attention")]
        if bad or len(layer_types) != L:
            _refuse(path, "layer_types", f"layer types {sorted(set(bad)) or layer_types!r}")
    elif uses_window:
        _refuse(path, "sliding_window", f"a sliding window of {sw} tokens, shorter than the context "
                f"({max_pos})")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(field) is not None:
            _refuse(path, field, "logit soft-capping")
    if hf.get("mlp_bias"):
        _refuse(path, "mlp_bias", "biases in the feed-forward")
    if mt == "ernie4_5_moe" and hf.get("use_bias"):
        _refuse(path, "use_bias", "biases in every projection and the head")

    rope_theta = _get(rope, "rope_theta", default=None) or _get(hf, "rope_theta", default=10000.0)

    # -- layer plan --
    granite, ernie = mt in ("granitemoe", "granitemoeshared"), mt == "ernie4_5_moe"
    if mt == "mixtral" or granite or oss:
        E = hf.get("num_local_experts", 8)
        moe_inter = hf["intermediate_size"]
        sparse = [True] * L
    elif ernie:     # MoE where (i + 1) % interval == 0 and start <= i <= end (end -1: the last layer)
        E = _get(hf, "moe_num_experts", "num_experts", default=64)
        moe_inter = hf["moe_intermediate_size"]
        start, interval = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_interval", 1) or 1
        end = hf.get("moe_layer_end_index", -1)
        end = L - 1 if end in (None, -1) else end
        sparse = [(i + 1) % interval == 0 and start <= i <= end for i in range(L)]
    else:
        E = _get(hf, "num_experts", "num_local_experts", default=0)
        moe_inter = hf.get("moe_intermediate_size", hf["intermediate_size"]) if mt != "olmoe" else hf["intermediate_size"]
        step = hf.get("decoder_sparse_step", 1) or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        sparse = [(i not in mlp_only) and E > 0 and (i + 1) % step == 0 for i in range(L)]
    shared_inter = hf.get("shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else \
        (hf.get("shared_intermediate_size", 0) or 0) if mt == "granitemoeshared" else \
        moe_inter * (hf.get("moe_num_shared_experts", 0) or 0) if ernie else 0
    top_k = _get(hf, "moe_k", "num_experts_per_tok", default=6) if ernie else hf.get("num_experts_per_tok", 2)
    if E and not 1 <= top_k <= E:
        raise invalid_model(path, "num_experts_per_tok", f"{top_k} is not in 1..{E}")
    layers, start = [], 0
    for i in range(L):
        if sparse[i]:
            layers.append({"layer_id": i, "type": "moe_shared" if shared_inter > 0 else "moe",
                           "moe_expert_start": start, "moe_num_experts": E})
            start += E
        else:
            layers.append({"layer_id": i, "type": "dense", "moe_expert_start": 0, "moe_num_experts": 0})

    if mt == "qwen2_moe":
        head_dim = _get(hf, "head_dim", default=H // nh)
        bias, out_bias = hf.get("qkv_bias", True), False
    elif mt == "mixtral":
        head_dim = _get(hf, "head_dim", default=H // nh)
        bias = out_bias = False
    elif mt == "qwen3_moe":
        head_dim = _get(hf, "head_dim", default=H // nh)
        bias = out_bias = bool(hf.get("attention_bias", False))
    elif oss:         # q/k/v/o all biased or none
        head_dim = _get(hf, "head_dim", default=H // nh)
        bias = out_bias = bool(hf.get("attention_bias", True))
    elif granite:     # q/k/v/o all biased or none; head_dim = hidden / heads (transformers' GraniteMoe)
        head_dim = H // nh
        bias = out_bias = bool(hf.get("attention_bias", False))
    elif ernie:       # use_bias is refused above
        head_dim = _get(hf, "head_dim", default=H // nh)
        bias = out_bias = False
    else:  # olmoe: q/k norm sizes assume hidden/heads
        head_dim = H // nh
        bias = out_bias = bool(hf.get("attention_bias", False))

    eos, bos = _eos_bos(hf, gen)

    extra = {}
    if granite:
        # attention_multiplier is the softmax scale; the other multipliers are folded into the weights by
        # convert() (Granite(x) = same model with: embed * embedding_multiplier, o_proj / every down
        # projection * residual_multiplier, lm_head / logits_scaling), so every backend runs it unchanged
        extra["attention_scale"] = float(hf.get("attention_multiplier", 1.0))
        extra["folded_multipliers"] = {k: float(hf.get(k, 1.0)) for k in
                                       ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
        for k, v in [("attention_multiplier", extra["attention_scale"]), *extra["folded_multipliers"].items()]:
            if not (np.isfinite(v) and v > 0):
                raise invalid_model(path, k, f"{v} is not a positive finite number")
    if ernie:
        # the choice by p + e_score_correction_bias, weights p / max(sum, moe_norm_min); the rope pairs
        # adjacent dims (2i, 2i+1): convert() permutes q/k rows to the half-split layout every backend
        # runs (attention scores are unchanged: q and k get the same permutation)
        extra.update(router_choice_bias=True, router_norm_min=float(hf.get("moe_norm_min", 1e-12)),
                     rope_pairs="interleaved")
        if not 0.0 <= extra["router_norm_min"] <= 1.0:
            raise invalid_model(path, "moe_norm_min", f"{extra['router_norm_min']} is not in [0, 1]")
    if oss:
        # router logits + bias, top-k, softmax over the k (= the top-k of the softmax renormalised); experts
        # with biases and the clamped SwiGLU; a sink logit per head; the window on the sliding layers
        extra.update(router_bias=True, expert_bias=True, attention_sinks=True, expert_act="swiglu_oai",
                     swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                     layer_types=layer_types)
        if "sliding_attention" in layer_types:
            extra["sliding_window"] = int(sw)
    if rope_scaling:
        extra["rope_scaling"] = rope_scaling
    tied = bool(hf.get("tie_word_embeddings", False))
    if granite and tied and (extra["folded_multipliers"]["embedding_multiplier"] != 1.0
                             or extra["folded_multipliers"]["logits_scaling"] != 1.0):
        tied = False     # the embedding and the head get different factors: lm_head is written on its own
    return {
        **extra,
        "format_version": 1,
        "model_type": mt,
        "architectures": hf.get("architectures", []),
        "num_hidden_layers": L,
        "hidden_size": H,
        "intermediate_size": hf["intermediate_size"],
        "moe_intermediate_size": moe_inter,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": head_dim,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": max_pos,
        "rope_theta": float(rope_theta),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": tied,
        "experts_per_layer": E,
        "top_k": top_k,
        "router_dtype": "float32",
        "router_mode": "topk",
        # Granite: softmax over the top-k logits = the top-k softmax probabilities renormalised
        "norm_topk_prob": True if mt == "mixtral" or granite or ernie or oss else bool(hf.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": shared_inter,
        "shared_expert_gate": shared_inter > 0 and mt == "qwen2_moe",     # Granite's shared MLP is ungated
        "attention_bias": bool(bias),
        "attention_out_bias": bool(out_bias),
        "qk_norm": {"qwen3_moe": "per_head", "olmoe": "full"}.get(mt, "none"),
        "eos_token_ids": eos,
        "bos_token_id": bos,
        "weight_dtype": dtype,
        "layers": layers,
    }


# ----------------------------------------------------------------------------------------------
# tensor names

def _source_names(cfg: dict, src=None) -> dict:
    """Colibri tensor name -> Hugging Face tensor name, or (name, row0, row1) for rows of a fused
    tensor (non-expert tensors). src, when given, picks between a checkpoint's naming variants."""
    m = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    moe = "block_sparse_moe" if cfg["model_type"] == "mixtral" else "mlp"
    for l in cfg["layers"]:
        i = l["layer_id"]
        p, s = f"layers.{i}.", f"model.layers.{i}."
        m[p + "input_norm"] = s + "input_layernorm.weight"
        m[p + "post_attention_norm"] = s + "post_attention_layernorm.weight"
        for x in "qkvo":
            m[p + f"attn.w{x}"] = s + f"self_attn.{x}_proj.weight"
            m[p + f"attn.b{x}"] = s + f"self_attn.{x}_proj.bias"
        m[p + "attn.q_norm"] = s + "self_attn.q_norm.weight"
        m[p + "attn.k_norm"] = s + "self_attn.k_norm.weight"
        for x in ("gate", "up", "down"):
            m[p + f"mlp.{x}"] = s + f"mlp.{x}_proj.weight"
            m[p + f"shared.{x}"] = s + f"mlp.shared_expert.{x}_proj.weight"
        m[p + "shared.gate_logit"] = s + "mlp.shared_expert_gate.weight"
        m[p + "router"] = s + f"{moe}.gate.weight"
        if cfg["model_type"] in ("granitemoe", "granitemoeshared"):
            r = s + "block_sparse_moe.router."
            m[p + "router"] = r + "weight" if src is not None and r + "weight" in src else r + "layer.weight"
            Is = cfg["shared_expert_intermediate_size"]      # the shared MLP's input_linear: [gate; up]
            m[p + "shared.gate"] = (s + "shared_mlp.input_linear.weight", 0, Is)
            m[p + "shared.up"] = (s + "shared_mlp.input_linear.weight", Is, 2 * Is)
            m[p + "shared.down"] = s + "shared_mlp.output_linear.weight"
        if cfg["model_type"] == "gpt_oss":
            m[p + "router"], m[p + "router_bias"] = s + "mlp.router.weight", s + "mlp.router.bias"
            m[p + "attn.sinks"] = s + "self_attn.sinks"
            gub = s + "mlp.experts.gate_up_proj_bias"       # [E, 2I], gate and up interleaved
            m[p + "experts.gate_bias"] = (gub, lambda a: a[:, 0::2].copy())
            m[p + "experts.up_bias"] = (gub, lambda a: a[:, 1::2].copy())
            m[p + "experts.down_bias"] = s + "mlp.experts.down_proj_bias"
        if cfg.get("norm_layout") == "sandwich":     # Gemma 4
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
        if cfg["model_type"] == "ernie4_5_moe" or cfg.get("latent_attention"):
            for x in ("gate", "up", "down"):
                m[p + f"shared.{x}"] = s + f"mlp.shared_experts.{x}_proj.weight"
        if cfg["model_type"] == "ernie4_5_moe":
            m[p + "router_choice_bias"] = s + "mlp.moe_statics.e_score_correction_bias"
        if cfg.get("latent_attention"):
            m.update(_latent_sources(cfg, p, s))
            m[p + "router_choice_bias"] = s + "mlp.gate.e_score_correction_bias"
    if cfg.get("linear_attention"):
        m.update(_qwen35_sources(cfg))
    if src is not None and "lm_head.weight" not in src and not cfg["tie_word_embeddings"] and \
            cfg.get("folded_multipliers"):
        m["lm_head"] = "model.embed_tokens.weight"         # tied in the checkpoint, untied by folding
    return m


def _qwen35_sources(cfg: dict) -> dict:
    """Qwen3.5's tensors from the checkpoint's: zero-centred norms + 1; q_proj's rows per head [query D |
    gate D] split into attn.wq and attn.wq_gate; with partial rotary the q/k rows (and the q/k norms) of
    each head reordered by rope_dim_order (q.k unchanged); conv1d [C, 1, K] -> [C, K]; A_log -> -exp(A_log)."""
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    order = rope_dim_order(D, cfg.get("rope_dim", D))
    one = lambda a: (a + np.float32(1)).astype(np.float32)           # noqa: E731
    rows = lambda a, n: a.reshape(n, D, -1)[:, order].reshape(a.shape).copy()  # noqa: E731
    m = {"norm": ("model.norm.weight", one)}
    for l in cfg["layers"]:
        i = l["layer_id"]
        p, s = f"layers.{i}.", f"model.layers.{i}."
        m[p + "input_norm"] = (s + "input_layernorm.weight", one)
        m[p + "post_attention_norm"] = (s + "post_attention_layernorm.weight", one)
        if cfg["layer_types"][i] == "linear_attention":
            a = s + "linear_attn."
            m.update({p + "lin.wqkv": a + "in_proj_qkv.weight", p + "lin.wz": a + "in_proj_z.weight",
                      p + "lin.wa": a + "in_proj_a.weight", p + "lin.wb": a + "in_proj_b.weight",
                      p + "lin.wo": a + "out_proj.weight", p + "lin.dt_bias": a + "dt_bias",
                      p + "lin.norm": a + "norm.weight",
                      p + "lin.conv": (a + "conv1d.weight", lambda x: x.reshape(x.shape[0], -1).copy()),
                      p + "lin.a_neg": (a + "A_log", lambda x: (-np.exp(x.astype(np.float64))).astype(np.float32))})
        else:
            a = s + "self_attn."
            q = lambda x, j: x.reshape(nh, 2, D, -1)[:, j].reshape(nh * D, -1)   # noqa: E731
            m[p + "attn.wq"] = (a + "q_proj.weight", lambda x: rows(q(x, 0), nh))
            m[p + "attn.wq_gate"] = (a + "q_proj.weight", lambda x: q(x, 1).copy())
            m[p + "attn.wk"] = (a + "k_proj.weight", lambda x: rows(x, nkv))
            m[p + "attn.q_norm"] = (a + "q_norm.weight", lambda x: one(x)[order].copy())
            m[p + "attn.k_norm"] = (a + "k_norm.weight", lambda x: one(x)[order].copy())
    return m


def _latent_sources(cfg: dict, p: str, s: str) -> dict:
    """Latent attention's tensors (modeldir.latent_tensors) from the checkpoint's: the query rows
    [nope | rope] of each head split, kv_a_proj_with_mqa's [latent | rope key] rows split, kv_b_proj
    [Hq*(dn+dv), r] cut per head into wk_b [Hq, r, dn] (transposed) and wv_b [Hq, dv, r]; rotated rows
    in interleaved pairs (cfg rope_pairs) permuted to the half-split layout (q and k alike)."""
    la, nh = cfg["latent_attention"], cfg["num_attention_heads"]
    r, dn, dr, dv = la["kv_lora_rank"], la["qk_nope_head_dim"], la["qk_rope_head_dim"], la["v_head_dim"]
    a = s + "self_attn."
    inter = cfg.get("rope_pairs") == "interleaved"

    def rope_rows(x, heads):
        return unpermute(x, heads) if inter else x

    q = a + ("q_b_proj.weight" if la["q_lora_rank"] else "q_proj.weight")
    heads = lambda x: x.reshape(nh, dn + dr, -1)                    # noqa: E731 (q rows by head)
    kvb = lambda x: x.reshape(nh, dn + dv, r)                       # noqa: E731
    m = {p + "mla.wq": (q, lambda x: heads(x)[:, :dn].reshape(nh * dn, -1).copy()),
         p + "mla.wq_rope": (q, lambda x: rope_rows(heads(x)[:, dn:].reshape(nh * dr, -1).copy(), nh)),
         p + "mla.wkv_a": (a + "kv_a_proj_with_mqa.weight", lambda x: x[:r].copy()),
         p + "mla.wk_rope": (a + "kv_a_proj_with_mqa.weight", lambda x: rope_rows(x[r:].copy(), 1)),
         p + "mla.kv_a_norm": a + "kv_a_layernorm.weight",
         p + "mla.wk_b": (a + "kv_b_proj.weight", lambda x: kvb(x)[:, :dn].transpose(0, 2, 1).copy()),
         p + "mla.wv_b": (a + "kv_b_proj.weight", lambda x: kvb(x)[:, dn:].copy()),
         p + "mla.wq_a": a + "q_a_proj.weight", p + "mla.q_a_norm": a + "q_a_layernorm.weight"}
    return m


def _fold_factors(cfg: dict) -> dict:
    """Colibri tensor name -> the factor convert() multiplies it by (Granite's multipliers); the
    routed experts' down projections get factors["expert.down"]."""
    fm = cfg.get("folded_multipliers")
    if not fm:
        return {}
    r = fm["residual_multiplier"]
    f = {"embed_tokens": fm["embedding_multiplier"], "lm_head": 1.0 / fm["logits_scaling"], "expert.down": r}
    for l in cfg["layers"]:
        p = f"layers.{l['layer_id']}."
        f[p + "attn.wo"] = f[p + "attn.bo"] = f[p + "shared.down"] = f[p + "mlp.down"] = r
    return f


def row_permutations(cfg: dict) -> dict:
    """Colibri tensor name -> heads, for the q/k rows a source with interleaved rope pairs (cfg
    rope_pairs) holds in that layout: they are permuted to the half-split layout by
    gguf_import.unpermute (q and k alike, so q.k is unchanged)."""
    if cfg.get("rope_pairs") != "interleaved" or cfg.get("latent_attention"):
        return {}                   # latent attention: its rotated rows are permuted by _latent_sources
    out = {}
    for l in cfg["layers"]:
        p = f"layers.{l['layer_id']}."
        out[p + "attn.wq"] = out[p + "attn.bq"] = cfg["num_attention_heads"]
        out[p + "attn.wk"] = out[p + "attn.bk"] = cfg["num_key_value_heads"]
    return out


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


def mxfp4_experts(src: SafetensorsIndex, layer: int) -> bool:
    return f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks" in src


def _mxfp4_expert(src: SafetensorsIndex, cfg: dict, layer: int, j: int):
    """gpt-oss's MXFP4 expert j as stored rows (gate [I, H/32*17], up, down [H, I/32*17]) and the
    source names: gate_up_proj_blocks [E, 2I, H/32, 16] (rows interleaved gate/up), down_proj_blocks
    [E, H, I/32, 16], with their *_scales."""
    p = f"model.layers.{layer}.mlp.experts."
    names = [p + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")]
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for n, shape in zip(names, ((2 * I, H // 32, 16), (2 * I, H // 32), (H, I // 32, 16), (H, I // 32))):
        if n not in src:
            raise invalid_model(p, n, "missing (an MXFP4 checkpoint holds blocks and scales of both projections)")
        if src.dtype(n) != "uint8" or tuple(src.shape(n)[1:]) != shape or H % 32 or I % 32:
            raise invalid_model(p, n, f"{src.dtype(n)} {list(src.shape(n))}: expected uint8 [E, {', '.join(map(str, shape))}]")
    gu = mxfp4_rows(src.raw(names[0], j), src.raw(names[1], j))
    return (gu[0::2].copy(), gu[1::2].copy(), mxfp4_rows(src.raw(names[2], j), src.raw(names[3], j))), names


def _expert_sources(src: SafetensorsIndex, cfg: dict, layer: int, j: int):
    """-> callables giving gate [I,H], up [I,H], down [H,I] in float32 for expert j of a layer."""
    s = f"model.layers.{layer}."
    for moe in ("block_sparse_moe", "mlp", ""):
        moe = moe and moe + "."                          # "": Gemma 4's layers.N.experts
        per = s + f"{moe}experts.{j}."
        if per + "w1.weight" in src:                      # Mixtral: w1 gate, w3 up, w2 down
            return (lambda: src.float32(per + "w1.weight"), lambda: src.float32(per + "w3.weight"),
                    lambda: src.float32(per + "w2.weight")), [per + n for n in ("w1.weight", "w3.weight", "w2.weight")]
        if per + "gate_proj.weight" in src:
            names = [per + f"{x}_proj.weight" for x in ("gate", "up", "down")]
            return tuple((lambda n=n: src.float32(n)) for n in names), names
        if s + f"{moe}input_linear.weight" in src:          # Granite: input_linear [E, 2I, H] = [gate; up]
            I = cfg["moe_intermediate_size"]
            gi, do = s + f"{moe}input_linear.weight", s + f"{moe}output_linear.weight"
            gu = lambda: src.float32(gi, j)
            return (lambda: gu()[:I].copy(), lambda: gu()[I:].copy(), lambda: src.float32(do, j)), [gi, do]
        fused = s + f"{moe}experts."
        if cfg["model_type"] == "gpt_oss" and fused + "gate_up_proj" in src:
            # gpt-oss: x @ W, gate_up_proj [E, H, 2I] with gate and up interleaved, down_proj [E, I, H]
            gu = lambda: src.float32(fused + "gate_up_proj", j)
            return (lambda: gu()[:, 0::2].T.copy(), lambda: gu()[:, 1::2].T.copy(),
                    lambda: src.float32(fused + "down_proj", j).T.copy()), [fused + "gate_up_proj",
                                                                            fused + "down_proj"]
        if fused + "gate_up_proj" in src:                 # transformers 5 fused layout [E, 2I, H], [E, H, I]
            I = cfg["moe_intermediate_size"]
            gu = lambda: src.float32(fused + "gate_up_proj", j)
            return (lambda: gu()[:I].copy(), lambda: gu()[I:].copy(),
                    lambda: src.float32(fused + "down_proj", j)), [fused + "gate_up_proj", fused + "down_proj"]
    raise invalid_model(f"model.layers.{layer}", f"experts.{j}", "expert weights not found in the checkpoint")


# ----------------------------------------------------------------------------------------------
# which format each matrix is written in

def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in a _M mix (C integer division): the first
    and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def _q4_k_m(cfg: dict, name: str, cols: int) -> str:
    """llama.cpp's Q4_K_M (llama-quant.cpp, no importance matrix), per matrix of our layout:
        lm_head                         q6_k, q8_0 when hidden % 256 (and then f16 when % 32)
        embed_tokens                    q4_k; q6_k (as lm_head) when the embeddings are tied
        attn.wv                         q6_k in use_more_bits(layer, layers) layers, else q4_k
        attn.wk / attn.wv / attn.wo     q8_0 / q8_0 / q5_k when a layer has exactly 8 experts (Mixtral)
        every down projection           q6_k in use_more_bits layers, else q4_k (dense, shared, experts)
        everything else                 q4_k (routers, norms, biases, gates stay float32)
    then a row that does not fill whole super-blocks of 256 falls back q4_k -> q5_0, q5_k -> q5_1,
    q6_k -> q8_0, and to float16 when not a multiple of 32 either (a 1408-wide expert, the demo's
    384)."""
    n, E = cfg["num_hidden_layers"], cfg["experts_per_layer"]
    layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
    role = name.split(".", 2)[-1] if layer >= 0 else name
    if name == "lm_head" or (name == "embed_tokens" and cfg["tie_word_embeddings"]):
        return "q6_k" if cols % 256 == 0 else "q8_0" if cols % 32 == 0 else "float16"
    fmt = "q4_k"
    if role == "attn.wv" and use_more_bits(layer, n):
        fmt = "q6_k"
    if role.endswith("down") and use_more_bits(layer, n):
        fmt = "q6_k"
    if E == 8:
        fmt = {"attn.wk": "q8_0", "attn.wv": "q8_0", "attn.wo": "q5_k"}.get(role, fmt)
    if not fits(fmt, cols):
        fmt = FALLBACK.get(fmt, fmt)
    return fmt if fits(fmt, cols) else "float16"


class FormatPlan:
    """The format of every matrix written for `dtype`: one format throughout (a matrix whose rows it
    cannot hold is refused, named), or a mix (q4_k_m, as llama.cpp chooses)."""

    def __init__(self, cfg: dict, dtype: str):
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, name: str, shape) -> str:
        cols = shape[-1]
        if self.dtype == "q4_k_m":
            return _q4_k_m(self.cfg, name, cols)
        if not fits(self.dtype, cols):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"--dtype {self.dtype}: {name} has rows of {cols}, not a multiple of "
                               f"{self.dtype}'s block of {block_of(self.dtype)}; use --dtype q4_k_m (which falls "
                               "back per matrix, as llama.cpp does) or a format with smaller blocks")
        return self.dtype

    def expert(self, layer: int, hidden: int, inter: int) -> tuple:
        """(gate, up, down) formats of the routed experts of a layer."""
        p = f"layers.{layer}.experts."
        return self(p + "gate", (inter, hidden)), self(p + "up", (inter, hidden)), self(p + "down", (hidden, inter))


def _finite(hf_dir, name, arr):
    """A tensor holding NaN or inf is refused, named: it would give NaN logits wherever it is read."""
    if not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise invalid_model(os.path.join(hf_dir, "*.safetensors"), name,
                            f"holds {bad} NaN or inf value(s) of {arr.size}; the checkpoint is damaged (or was "
                            "saved after a diverged step): convert a sound one")


def convert(hf_dir: str, out_dir: str, dtype: str | None = None, progress: bool = True) -> dict:
    """Convert a Hugging Face checkpoint directory, or a GGUF file (gguf_import.py); returns the
    Colibri config written."""
    hf_dir, out_dir = os.fspath(hf_dir), os.fspath(out_dir)
    if os.path.isfile(hf_dir) and hf_dir.endswith(".gguf"):
        if dtype is not None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--dtype {dtype}: a GGUF file is converted in the "
                               "formats it is stored in (no requantisation); leave --dtype out")
        from .gguf_import import convert_gguf
        return convert_gguf(hf_dir, out_dir, progress)
    if dtype is not None and dtype not in WEIGHT_DTYPES + MIXES:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                           f"--dtype {dtype!r}: use one of {', '.join(WEIGHT_DTYPES + MIXES)}")
    cpath = os.path.join(hf_dir, "config.json")
    if not os.path.exists(cpath):
        raise invalid_model(cpath, "(file)", "missing; HF_DIR must hold a save_pretrained checkpoint")
    try:
        hf = json.load(open(cpath))
    except json.JSONDecodeError as e:
        raise invalid_model(cpath, "(json)", f"not valid JSON ({e})") from None
    gpath = os.path.join(hf_dir, "generation_config.json")
    gen = json.load(open(gpath)) if os.path.exists(gpath) else {}
    cfg = translate_config(hf, gen, cpath, dtype)
    src = SafetensorsIndex(hf_dir)
    if hf.get("model_type") == "gemma4":      # text weights under model.language_model, the towers skipped
        dropped = src.rebase("model.language_model.", "model.", GEMMA4_SKIPPED)
        if dropped and progress:
            print(f"convert: {dropped} vision/audio tower tensors skipped (Colibri runs the text model)",
                  file=sys.stderr)
    if hf.get("model_type") in QWEN35_TYPES:   # text weights under model.language_model (or not), towers skipped
        dropped = src.rebase("model.language_model.", "model.", QWEN35_SKIPPED)
        if dropped and progress:
            print(f"convert: {dropped} vision-tower / multi-token-prediction tensors skipped (Colibri runs the "
                  "text model without speculative heads)", file=sys.stderr)
    skip_mtp = mtp_layers(hf)
    if skip_mtp:                      # multi-token-prediction layers after the decoder's: not run, skipped
        L = cfg["num_hidden_layers"]
        dropped = src.rebase("", "", tuple(f"model.layers.{L + j}." for j in range(skip_mtp)))
        if dropped and progress:
            print(f"convert: {dropped} tensors of {skip_mtp} multi-token-prediction layer(s) skipped "
                  "(speculative-decoding heads; the model runs without them)", file=sys.stderr)
    if cfg["weight_dtype"] is None:   # keep the checkpoint's precision
        cfg["weight_dtype"] = src.dtype("model.embed_tokens.weight") if "model.embed_tokens.weight" in src else "float32"
    emb = "model.embed_tokens.weight"
    if cfg.get("embed_scale") and emb in src and src.dtype(emb) in ("bfloat16", "float16"):
        # transformers multiplies by the scale cast to the embedding's type (Gemma's ScaledWordEmbedding)
        cfg["embed_scale"] = float(widen(narrow(np.float32([cfg["embed_scale"]]), src.dtype(emb)), src.dtype(emb))[0])
    names = _source_names(cfg, src)
    fold = _fold_factors(cfg)
    perm = row_permutations(cfg)
    plan = FormatPlan(cfg, cfg["weight_dtype"])
    wanted = expected_tensors(cfg, plan)
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    expert_fmts = {l["layer_id"]: plan.expert(l["layer_id"], H, I) for l in cfg["layers"] if l["type"] != "dense"}
    packed = {l for l in expert_fmts if mxfp4_experts(src, l)}
    if packed and dtype is None:        # MXFP4 experts stay MXFP4 (ggml's layout), the rest as stored
        expert_fmts.update({l: ("mxfp4",) * 3 for l in packed})
    used = set()
    need = sum(nbytes(f, s) + ALIGN for s, f in wanted.values())
    need += sum(expert_blob_bytes(H, I, expert_fmts[l["layer_id"]]) + ALIGN
                for l in cfg["layers"] if l["type"] != "dense" for _ in range(l["moe_num_experts"]))
    check_disk(out_dir, need)
    w = ModelWriter(out_dir, cfg)
    jobs = [("tensor", n) for n in wanted]
    jobs += [("expert", (l["layer_id"], j)) for l in cfg["layers"] if l["type"] != "dense"
             for j in range(l["moe_num_experts"])]
    for kind, what in tqdm(jobs, desc="convert", unit="tensor", disable=not progress):
        if kind == "tensor" and what.endswith(".scales"):
            continue                                   # written with its quantised matrix
        if kind == "tensor":
            shape, tdtype = wanted[what]
            hf_name, rows, fn = names[what], None, None
            if isinstance(hf_name, tuple) and callable(hf_name[1]):
                hf_name, fn = hf_name           # a function of the source tensor (a strided slice)
            elif isinstance(hf_name, tuple):
                hf_name, rows = hf_name[0], slice(*hf_name[1:])
            if hf_name not in src:
                raise invalid_model(os.path.join(hf_dir, "*.safetensors"), hf_name,
                                    f"missing (needed for {what} by the config)")
            arr = src.float32(hf_name)
            _finite(hf_dir, hf_name, arr)
            if rows is not None:
                if arr.ndim != 2 or arr.shape[0] < rows.stop:
                    raise invalid_model(os.path.join(hf_dir, "*.safetensors"), hf_name,
                                        f"shape {list(arr.shape)}: expected at least {rows.stop} rows (fused {what})")
                arr = arr[rows].copy()
            if fn is not None:
                arr = fn(arr)
            if what in fold:
                arr = arr * np.float32(fold[what])
            if len(shape) == 1 and arr.shape == (1, *shape):
                arr = arr.reshape(shape)                  # a [1, E] vector (ERNIE's correction bias)
            if tuple(arr.shape) != tuple(shape):
                raise invalid_model(os.path.join(hf_dir, "*.safetensors"), hf_name,
                                    f"shape {list(arr.shape)}, config implies {list(shape)}")
            if what in perm:
                arr = unpermute(arr, perm[what])
            w.add_tensor(what, arr, tdtype)
            used.add(hf_name)
        elif what[0] in packed and dtype is None:
            mats, src_names = _mxfp4_expert(src, cfg, *what)
            w.add_expert(what[0], what[1], *mats, expert_fmts[what[0]], hidden=H, inter=I)
            used.update(src_names)
        else:
            if what[0] in packed:            # dequantised, then written in the chosen format
                rows, src_names = _mxfp4_expert(src, cfg, *what)
                mats = [np.asarray(widen(m, "mxfp4"), np.float32) for m in rows]
            else:
                getters, src_names = _expert_sources(src, cfg, *what)
                mats = [g() for g in getters]
            if "expert.down" in fold:
                mats[2] = mats[2] * np.float32(fold["expert.down"])
            for m, part in zip(mats, ("gate", "up", "down")):
                _finite(hf_dir, f"{src_names[0].rsplit('.', 2)[0]} (expert {what[1]} of layer {what[0]}, {part})", m)
            w.add_expert(what[0], what[1], *mats, expert_fmts[what[0]])
            used.update(src_names)
    if cfg["tie_word_embeddings"]:
        used.add("lm_head.weight")
    leftover = sorted(n for n in src.entries if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        w.finish()
        raise invalid_model(os.path.join(hf_dir, "*.safetensors"), leftover[0],
                            f"{len(leftover)} tensor(s) the engine would ignore (e.g. {leftover[:3]}); "
                            "their feature is not implemented")
    if packed and dtype is None and cfg["weight_dtype"] != "mxfp4":
        w.config["weight_dtype"] = "mixed"
    w.finish()
    for name in COPIED_FILES:
        if os.path.exists(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    return w.config
