"""Refuse, never guess: every file and every JSON value of a model directory checked for type and
range before anything uses it. A failure is COLIBRI_ERR_INVALID_MODEL (or _INVALID_MODEL_TYPE)
naming the file, the field and what was expected; nothing else escapes.

    regular_file   exists, is a regular file (not a directory, link, device or fifo), readable
    load_json      size-bounded, UTF-8, parsed with a nesting limit
    config         config.json: every field typed and ranged, the layer plan consistent
    tensor_index   tensors.json: every record's offset / shape / dtype / nbytes
    expert_index   experts.json: every record's fields
    generation_config, tokenizer_config   the fields of these Hugging Face files the engine reads

Sizes are bounded twice: by sane maxima here (a hidden size of 2^31 is refused as such), and by
what the weights file holds (modeldir checks every extent against its size), so no size a file
declares is ever allocated before it is proven.
"""
from __future__ import annotations

import json
import math
import os
import stat

from . import dtypes
from ..errors import ColibriError, COLIBRI_ERR_INVALID_MODEL_TYPE, invalid_model

FORMAT_VERSION = 2            # written; 1 (one weight type for the directory) is still read
READ_VERSIONS = (1, 2)
LAYER_TYPES = ("dense", "moe", "moe_shared", "moe_dense")   # moe_dense: experts beside a dense MLP (Gemma 4)
LAYER_FIELDS = ("layer_id", "type", "moe_expert_start", "moe_num_experts")
# a layer's own attention geometry and rope where it differs from the config's (Gemma 4's full layers):
# head_dim, num_key_value_heads, rope_theta, rope_partial (proportional rope: the first rope_partial of
# the head's D/2 frequencies, theta^(-2i/D), rotate; the rest do not), k_eq_v (keys reused as values)
LAYER_OPTIONAL = ("head_dim", "num_key_value_heads", "rope_theta", "rope_partial", "k_eq_v", "nope")
# nope (Llama 4's no-rope layers): the layer's attention has no rope and no q/k norm, and its queries take the
# attention temperature (attn_temperature) when the config has one


# rope_scaling fields of YaRN / longrope (colibri_edge.runtime.rope reads them)
YARN_FIELDS = ("rope_type", "factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
               "attention_factor", "truncate", "mscale", "mscale_all_dim",
               "short_factor", "long_factor", "short_mscale", "long_mscale",     # longrope's
               "low_freq_factor", "high_freq_factor",                             # llama3's
               "freq_factors")                                                    # a GGUF's rope_freqs


ROUTER_MODES = ("topk", "gated", "sparsemixer")    # sparsemixer: Phi-3.5-MoE's (top-2, router_jitter)
NORM_TYPES = ("rmsnorm", "layernorm")               # layernorm: with biases (layers.N.*_norm_bias, norm_bias)
QK_NORMS = ("none", "per_head", "full", "per_head_after_rope", "l2_after_rope")   # l2: no weight (Llama 4)
WEIGHT_TYPES = dtypes.WEIGHT_DTYPES
WEIGHT_LABELS = WEIGHT_TYPES + dtypes.MIXES + ("mixed",)      # config.json's weight_dtype: what it was made as

MAX_DIM = 1 << 20            # hidden, intermediate and head sizes
MAX_HEADS = 1 << 12
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 24
MAX_OFFSET = 1 << 50         # 1 PiB: far past any file, well inside int64 arithmetic
MAX_JSON_DEPTH = 32
JSON_LIMITS = {"config.json": 1 << 22, "tensors.json": 1 << 28, "experts.json": 1 << 28,
               "generation_config.json": 1 << 22, "tokenizer_config.json": 1 << 26}


# -- files -------------------------------------------------------------------------------------------
def regular_file(path: str, what: str) -> int:
    """-> the file's size; refuses a missing, linked, special or unreadable file by name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise invalid_model(path, "(file)", f"missing; a model directory needs {what}. "
                            "Create one with `colibri convert HF_DIR OUT_DIR`.") from None
    except OSError as e:
        raise invalid_model(path, "(file)", f"cannot be examined ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise invalid_model(path, "(file)", "is a symbolic link; a model directory holds its own files "
                            "(copy the file in, or re-run `colibri convert`)")
    if stat.S_ISDIR(st.st_mode):
        raise invalid_model(path, "(file)", f"is a directory, not {what}; re-run `colibri convert`")
    if not stat.S_ISREG(st.st_mode):
        raise invalid_model(path, "(file)", f"is not a regular file (a device, socket or pipe), not {what}")
    if not os.access(path, os.R_OK):
        raise invalid_model(path, "(file)", "is not readable by this user; fix its permissions")
    return st.st_size


MAX_TEXT = 1 << 22


def text_file(path: str, what: str) -> str:
    """A UTF-8 text file of at most MAX_TEXT bytes (a chat template)."""
    if regular_file(path, what) > MAX_TEXT:
        raise invalid_model(path, "(file)", f"larger than {MAX_TEXT} bytes; not {what}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError) as e:
        raise invalid_model(path, "(file)", f"not UTF-8 text ({e}); not {what}") from None


def _depth(obj, limit):
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return False
        if isinstance(o, dict):
            stack += [(v, d + 1) for v in o.values()]
        elif isinstance(o, list):
            stack += [(v, d + 1) for v in o]
    return True


def load_json(path: str, what: str):
    name = os.path.basename(path)
    size = regular_file(path, what)
    limit = JSON_LIMITS.get(name, 1 << 26)
    if size > limit:
        raise invalid_model(path, "(file)", f"is {size} bytes, more than a valid {name} can be ({limit}); "
                            "re-run `colibri convert`")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        obj = json.loads(text)
    except UnicodeDecodeError as e:
        raise invalid_model(path, "(json)", f"not UTF-8 text ({e.reason} at byte {e.start}); re-run `colibri convert`") \
            from None
    except json.JSONDecodeError as e:
        raise invalid_model(path, "(json)", f"not valid JSON ({e}); re-run `colibri convert`") from None
    except RecursionError:
        raise invalid_model(path, "(json)", f"nested deeper than {MAX_JSON_DEPTH} levels; not a {name}") from None
    except OSError as e:
        raise invalid_model(path, "(file)", f"cannot be read ({e.strerror})") from None
    if not _depth(obj, MAX_JSON_DEPTH):
        raise invalid_model(path, "(json)", f"nested deeper than {MAX_JSON_DEPTH} levels; not a {name}")
    return obj


# -- typed fields ------------------------------------------------------------------------------------
def _int(path, field, v, lo, hi):
    if not isinstance(v, int) or isinstance(v, bool):
        raise invalid_model(path, field, f"expected an integer, got {v!r:.60}")
    if not lo <= v <= hi:
        raise invalid_model(path, field, f"{v} is out of range [{lo}, {hi}]")
    return v


def _num(path, field, v, lo, hi, lo_open=False):
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise invalid_model(path, field, f"expected a number, got {v!r:.60}")
    v = float(v)
    if not math.isfinite(v):
        raise invalid_model(path, field, f"{v} is not finite")
    if v < lo or v > hi or (lo_open and v == lo):
        raise invalid_model(path, field, f"{v} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
    return v


def _bool(path, field, v):
    if not isinstance(v, bool):
        raise invalid_model(path, field, f"expected true or false, got {v!r:.60}")
    return v


def _enum(path, field, v, choices):
    if not isinstance(v, str) or v not in choices:
        raise invalid_model(path, field, f"{v!r:.60} is not one of {', '.join(choices)}")
    return v


def _obj(path, field, v):
    if not isinstance(v, dict):
        raise invalid_model(path, field, f"expected an object, got {type(v).__name__}")
    return v


def _list(path, field, v, max_len):
    if not isinstance(v, list):
        raise invalid_model(path, field, f"expected a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise invalid_model(path, field, f"has {len(v)} entries, at most {max_len} are possible")
    return v


def _known(path, field, obj, allowed):
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise invalid_model(path, f"{field}{extra[0]}", "is not a field this Colibri knows; the directory was "
                            "written by another version or edited: re-run `colibri convert`")


# -- config.json ---------------------------------------------------------------------------------------
CONFIG_FIELDS = (
    "format_version", "model_type", "architectures", "num_hidden_layers", "hidden_size", "intermediate_size",
    "moe_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "experts_per_layer", "top_k",
    "router_dtype", "router_mode", "norm_topk_prob", "shared_expert_intermediate_size", "shared_expert_gate",
    "attention_bias", "attention_out_bias", "qk_norm", "eos_token_ids", "bos_token_id", "weight_dtype", "layers",
    "attention_scale", "folded_multipliers", "router_choice_bias", "router_norm_min", "rope_pairs",
    "layer_types", "sliding_window", "attention_sinks", "rope_scaling", "router_bias", "expert_bias", "expert_act",
    "swiglu_alpha", "swiglu_limit", "norm_layout", "ffn_act", "embed_scale", "final_logit_softcap", "v_norm",
    "layer_scalar", "router_input_norm", "expert_scale", "latent_attention", "router_score", "router_groups",
    "routed_scaling_factor", "linear_attention", "attention_output_gate", "rope_dim", "mtp", "short_conv",
    "norm_type", "lm_head_bias", "router_jitter", "attention_chunk", "attn_temperature", "router_input_scale",
    "mamba")
# mamba (Granite 4.0-H): the layers of layer_types "mamba" are Mamba-2 mixers with a fixed-size state per
# sequence: {conv_kernel K, num_heads nh, head_dim P, n_groups G, state_size N}: in_proj's z [nh P], x|B|C
# [nh P + 2 G N] (through a depthwise causal conv of K taps with a bias, then SiLU) and dt [nh]; the state is
# the conv's last K-1 inputs and S [nh, P, N]; the gated RMSNorm over the nh P channels (one group), its epsilon
# norm_eps when given (else rms_norm_eps: a GGUF import sets the residual stream's apart, granitemoehybrid.py)
# Llama 4: layer_types "chunked_attention" attend within chunks of attention_chunk positions (p - p mod C .. p);
# attn_temperature {floor_scale, attn_scale}: the nope layers' queries times log1p(floor((p + 1) / floor_scale))
# * attn_scale + 1; router_input_scale: the routed experts see h times the token's routing weight (top-1),
# not their output scaled; rope_scaling rope_type "llama3" (factor, low_freq_factor, high_freq_factor,
# original_max_position_embeddings); rope_type "freq_factors" (freq_factors [head_dim / 2]: f_i divided by them, a
# GGUF file's rope_freqs tensor)
# Phi-3.5-MoE: norm_type "layernorm" (every norm a LayerNorm with a bias: layers.N.input_norm_bias /
# post_attention_norm_bias, norm_bias [H]); lm_head_bias: the head's bias lm_head_bias [V]; router_mode
# "sparsemixer" with router_jitter (top-2, each weight its expert's softmax within a 2 jitter band);
# rope_scaling rope_type "longrope": short_factor / long_factor [head_dim / 2], short_mscale / long_mscale,
# original_max_position_embeddings (an engine whose context exceeds it runs the long factors)
# short_conv (LFM2-MoE): the layers of layer_types "short_conv" are gated short convolutions with a fixed-size
# state per sequence: {"conv_kernel": K} (a depthwise causal conv over the H channels, its last K-1 inputs kept)
# mtp: the model's multi-token-prediction head (DeepSeek-V3's nextn layer, Qwen3.5's mtp.*): {"layers": [one
# layer spec, layer_id num_hidden_layers, its experts after the decoder's], "own_head", "own_embed"}; its
# tensors mtp.enorm / mtp.hnorm [H], mtp.e_proj / mtp.h_proj [H, H] (eh_proj's halves), mtp.norm [H],
# mtp.head [V, H] / mtp.embed [V, H] when own_*, and layers.L.* as a decoder layer's
# linear_attention (Qwen3.5 / Qwen3-Next): the layers of layer_types "linear_attention" are gated delta-nets
# with a fixed-size state per sequence: conv_kernel K (a depthwise causal conv over the q|k|v channels, its
# last K-1 inputs kept), num_key_heads Hk, num_value_heads Hv, key_head_dim dk, value_head_dim dv (a recurrent
# state [Hv, dk, dv]), value_head_order (grouped | tiled: which key head a value head reads); attention_output_gate: the full-attention layers' output times sigmoid(attn.wq_gate @ h)
# before wo; rope_dim: only the first rope_dim of each head's dims rotate (partial rotary), the converter having
# moved them to the half-split places (pairs i, i + D/2 for i < rope_dim / 2), frequencies theta^(-2i/rope_dim)
# latent_attention (DeepSeek-V2/V3, GLM-4.7-Flash): every layer's mixer is multi-head latent attention
# with kv_lora_rank (the cached latent's width), q_lora_rank (0: a plain q projection),
# qk_nope_head_dim, qk_rope_head_dim (head_dim, the rotated part), v_head_dim, norm_eps; router_score: softmax
# (default) or sigmoid; router_groups: group-limited top-k {n_group, topk_group, group_top} (a group
# scores the sum of its group_top best); routed_scaling_factor multiplies the routed weights
# Gemma 4: norm_layout "sandwich" (layers.N.attn.out_norm after attention; the FFN stage's parts each
# normed in and out: mlp.out_norm, experts_norm / experts_out_norm, their sum by ffn_out_norm); ffn_act
# the dense MLP's activation (silu or gelu_tanh); embed_scale multiplies the embeddings;
# final_logit_softcap: logits = cap tanh(logits / cap); v_norm: values RMS-normed per head (no weight);
# layer_scalar: layers.N.scalar [1] multiplies the residual after the layer; router_input_norm: the
# router reads norm(x) * layers.N.router_norm [H]; expert_scale: layers.N.expert_scale [E] on the weights
# attention_scale: the softmax scale when it is not 1/sqrt(head_dim) (Granite's attention_multiplier);
# folded_multipliers: what the converter multiplied into the weights (Granite), kept for inspection;
# router_choice_bias: every MoE layer has a router_choice_bias [E] added to p for the choice only, and
# router_norm_min floors the renormalisation's denominator (ERNIE-4.5); rope_pairs: the source's rope
# layout ("interleaved": the converter permuted q/k rows to the half-split layout), for inspection
# layer_types (per layer: full_attention | sliding_attention) and sliding_window W: those layers attend
# to their last W positions; attention_sinks: every layer has attn.sinks [heads] (gpt-oss); rope_scaling:
# YaRN (colibri_edge.runtime.rope); router_bias: router logits + layers.N.router_bias [E]; expert_bias: the
# routed experts' biases layers.N.experts.{gate,up,down}_bias; expert_act: silu (SwiGLU) or swiglu_oai
# (gpt-oss's clamped SwiGLU, with swiglu_alpha and swiglu_limit)
OPTIONAL = ("architectures", "bos_token_id", "attention_scale", "folded_multipliers", "router_choice_bias",
            "router_norm_min", "rope_pairs", "layer_types", "sliding_window", "attention_sinks", "rope_scaling",
            "router_bias", "expert_bias", "expert_act", "swiglu_alpha", "swiglu_limit", "norm_layout", "ffn_act",
            "embed_scale", "final_logit_softcap", "v_norm", "layer_scalar", "router_input_norm", "expert_scale",
            "latent_attention", "router_score", "router_groups", "routed_scaling_factor", "linear_attention",
            "attention_output_gate", "rope_dim", "mtp", "short_conv", "norm_type", "lm_head_bias", "router_jitter",
            "attention_chunk", "attn_temperature", "router_input_scale", "mamba")
MAMBA_FIELDS = ("conv_kernel", "num_heads", "head_dim", "n_groups", "state_size")
SHORT_CONV_FIELDS = ("conv_kernel",)
MTP_FIELDS = ("layers", "own_head", "own_embed")
LINEAR_FIELDS = ("conv_kernel", "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                 "value_head_order")    # optional: grouped (value head h reads key head h // (Hv/Hk), HF's
                                        # layout) or tiled (h % Hk: llama.cpp's GGUF files)
MAX_CONV_KERNEL = 8
LATENT_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "norm_eps")
GROUP_FIELDS = ("n_group", "topk_group", "group_top")
ATTENTION_TYPES = ("full_attention", "sliding_attention", "linear_attention", "short_conv", "chunked_attention",
                   "mamba")
EXPERT_ACTS = ("silu", "swiglu_oai", "gelu_tanh")
FOLDED = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def config(cfg, path: str = "config.json", model_types: tuple | None = None) -> dict:
    """config.json, every field typed and ranged; returns it (a dict of plain values). model_types:
    the supported model_type names (modeldir passes the family registry's; None: not checked here)."""
    _obj(path, "(root)", cfg)
    mt = cfg.get("model_type")
    if model_types is not None and mt not in model_types:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE,
                           f"{path}: field 'model_type': {mt!r:.60} is not supported; supported: "
                           f"{', '.join(model_types)}")
    for f in CONFIG_FIELDS:
        if f not in cfg and f not in OPTIONAL:
            raise invalid_model(path, f, "missing")
    _known(path, "", cfg, CONFIG_FIELDS)
    if _int(path, "format_version", cfg["format_version"], 0, 1 << 30) not in READ_VERSIONS:
        raise invalid_model(path, "format_version", f"is {cfg['format_version']}, this Colibri reads "
                            f"{', '.join(map(str, READ_VERSIONS))}; re-convert the model with this Colibri")
    if "architectures" in cfg:
        for i, a in enumerate(_list(path, "architectures", cfg["architectures"], 64)):
            if not isinstance(a, str):
                raise invalid_model(path, f"architectures[{i}]", f"expected a string, got {a!r:.60}")
    L = _int(path, "num_hidden_layers", cfg["num_hidden_layers"], 1, MAX_LAYERS)
    _int(path, "hidden_size", cfg["hidden_size"], 1, MAX_DIM)
    for f in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        _int(path, f, cfg[f], 0, MAX_DIM)
    nh = _int(path, "num_attention_heads", cfg["num_attention_heads"], 1, MAX_HEADS)
    nkv = _int(path, "num_key_value_heads", cfg["num_key_value_heads"], 1, MAX_HEADS)
    hd = _int(path, "head_dim", cfg["head_dim"], 2, 1 << 12)
    V = _int(path, "vocab_size", cfg["vocab_size"], 1, MAX_VOCAB)
    _int(path, "max_position_embeddings", cfg["max_position_embeddings"], 1, MAX_POSITIONS)
    _num(path, "rope_theta", cfg["rope_theta"], 1.0, 1e12, lo_open=True)
    _num(path, "rms_norm_eps", cfg["rms_norm_eps"], 0.0, 1.0, lo_open=True)
    E = _int(path, "experts_per_layer", cfg["experts_per_layer"], 0, MAX_EXPERTS)
    _int(path, "top_k", cfg["top_k"], 1, max(E, 1))
    _enum(path, "router_dtype", cfg["router_dtype"], ("float32",))
    _enum(path, "router_mode", cfg["router_mode"], ROUTER_MODES)
    _enum(path, "norm_type", cfg.get("norm_type", "rmsnorm"), NORM_TYPES)
    if "lm_head_bias" in cfg:
        _bool(path, "lm_head_bias", cfg["lm_head_bias"])
    if cfg["router_mode"] == "sparsemixer":
        if "router_jitter" not in cfg:
            raise invalid_model(path, "router_jitter", "missing (router_mode is sparsemixer)")
        _num(path, "router_jitter", cfg["router_jitter"], 0.0, 1.0)
        if cfg["top_k"] != 2 or E < 2:
            raise invalid_model(path, "top_k", f"{cfg['top_k']} of {E} experts: sparsemixer routing picks 2 of at "
                                "least 2")
    elif "router_jitter" in cfg:
        raise invalid_model(path, "router_jitter", "is given, but router_mode is not sparsemixer")
    chunked = "chunked_attention" in (cfg.get("layer_types") or ())
    if chunked or "attention_chunk" in cfg:
        if not chunked or "attention_chunk" not in cfg:
            raise invalid_model(path, "attention_chunk", "and layer_types' chunked_attention layers go together")
        _int(path, "attention_chunk", cfg["attention_chunk"], 1, MAX_POSITIONS)
    if "attn_temperature" in cfg:
        at = _obj(path, "attn_temperature", cfg["attn_temperature"])
        _known(path, "attn_temperature.", at, ("floor_scale", "attn_scale"))
        for f in ("floor_scale", "attn_scale"):
            if f not in at:
                raise invalid_model(path, f"attn_temperature.{f}", "missing")
        _num(path, "attn_temperature.floor_scale", at["floor_scale"], 0.0, 1e9, lo_open=True)
        _num(path, "attn_temperature.attn_scale", at["attn_scale"], 0.0, 1e3)
    if "router_input_scale" in cfg:
        _bool(path, "router_input_scale", cfg["router_input_scale"])
        if cfg["router_input_scale"] and (cfg["top_k"] != 1 or cfg["router_mode"] != "topk"):
            raise invalid_model(path, "router_input_scale", f"scales the experts' input by the weight of a top-1 "
                                f"choice; top_k is {cfg['top_k']} ({cfg['router_mode']})")
    if cfg.get("norm_type") == "layernorm" and (cfg.get("norm_layout", "pre") != "pre" or cfg.get("mtp")):
        raise invalid_model(path, "norm_type", "layernorm does not combine with sandwich norms or an MTP head")
    _enum(path, "qk_norm", cfg["qk_norm"], QK_NORMS)
    _enum(path, "weight_dtype", cfg["weight_dtype"], WEIGHT_TYPES if cfg["format_version"] == 1 else WEIGHT_LABELS)
    if cfg["format_version"] == 1 and cfg["weight_dtype"] not in ("float32", "float16", "bfloat16", "int8"):
        raise invalid_model(path, "weight_dtype", f"{cfg['weight_dtype']} needs format_version 2")
    for f in ("tie_word_embeddings", "norm_topk_prob", "shared_expert_gate", "attention_bias", "attention_out_bias"):
        _bool(path, f, cfg[f])
    if nh % nkv:
        raise invalid_model(path, "num_key_value_heads", f"{nkv} does not divide num_attention_heads={nh}")
    if hd % 2:
        raise invalid_model(path, "head_dim", f"{hd} is odd; rotary embeddings need an even head_dim")
    for i, e in enumerate(_list(path, "eos_token_ids", cfg["eos_token_ids"], 1024)):
        _int(path, f"eos_token_ids[{i}]", e, 0, V - 1)
    if cfg.get("bos_token_id") is not None:
        _int(path, "bos_token_id", cfg["bos_token_id"], 0, V - 1)
    if "attention_scale" in cfg:
        _num(path, "attention_scale", cfg["attention_scale"], 0.0, 1e3, lo_open=True)
    if "folded_multipliers" in cfg:
        _obj(path, "folded_multipliers", cfg["folded_multipliers"])
        _known(path, "folded_multipliers.", cfg["folded_multipliers"], FOLDED)
        for k, v in cfg["folded_multipliers"].items():
            _num(path, f"folded_multipliers.{k}", v, 0.0, 1e6, lo_open=True)
    if "router_choice_bias" in cfg:
        _bool(path, "router_choice_bias", cfg["router_choice_bias"])
    if "router_norm_min" in cfg:
        _num(path, "router_norm_min", cfg["router_norm_min"], 0.0, 1.0)
    if "rope_pairs" in cfg:
        _enum(path, "rope_pairs", cfg["rope_pairs"], ("half_split", "interleaved"))
    if (cfg.get("router_choice_bias") or cfg.get("router_norm_min")) and cfg["router_mode"] != "topk":
        raise invalid_model(path, "router_mode", f"{cfg['router_mode']} routing takes no choice bias or "
                            "renormalisation floor (topk does)")
    _attention_fields(path, cfg, L)
    _latent_fields(path, cfg)
    _linear_fields(path, cfg)
    _short_conv_fields(path, cfg)
    _mamba_fields(path, cfg)
    _router_fields(path, cfg, E)
    layers = _list(path, "layers", cfg["layers"], MAX_LAYERS)
    if len(layers) != L:
        raise invalid_model(path, "layers", f"has {len(layers)} entries, num_hidden_layers is {L}")
    next_expert = 0
    for i, layer in enumerate(layers):
        next_expert = _layer(path, f"layers[{i}]", cfg, layer, i, next_expert)
    if "mtp" in cfg:
        m = _obj(path, "mtp", cfg["mtp"])
        _known(path, "mtp.", m, MTP_FIELDS)
        for k in ("own_head", "own_embed"):
            if k in m:
                _bool(path, f"mtp.{k}", m[k])
        extra = _list(path, "mtp.layers", m.get("layers"), 1)
        if len(extra) != 1:
            raise invalid_model(path, "mtp.layers", "expected one layer (the head's)")
        _layer(path, "mtp.layers[0]", cfg, extra[0], L, next_expert)
    return cfg


def _layer(path, f, cfg, layer, want_id, next_expert) -> int:
    """One layer spec (the decoder's layer want_id, or the MTP head's); -> the next expert id."""
    E = cfg["experts_per_layer"]
    _obj(path, f, layer)
    for k in ("layer_id", "type", "moe_expert_start", "moe_num_experts"):
        if k not in layer:
            raise invalid_model(path, f"{f}.{k}", "missing")
    _known(path, f"{f}.", layer, LAYER_FIELDS + LAYER_OPTIONAL)
    _layer_attention(path, f, cfg, layer)
    if _int(path, f"{f}.layer_id", layer["layer_id"], 0, MAX_LAYERS) != want_id:
        raise invalid_model(path, f"{f}.layer_id", f"expected {want_id}, got {layer['layer_id']}")
    kind = _enum(path, f"{f}.type", layer["type"], LAYER_TYPES)
    start = _int(path, f"{f}.moe_expert_start", layer["moe_expert_start"], 0, MAX_LAYERS * MAX_EXPERTS)
    n = _int(path, f"{f}.moe_num_experts", layer["moe_num_experts"], 0, MAX_EXPERTS)
    if kind == "dense":
        if n != 0:
            raise invalid_model(path, f"{f}.moe_num_experts", "a dense layer has 0 experts")
        if cfg["intermediate_size"] < 1:
            raise invalid_model(path, "intermediate_size", "must be positive with dense layers")
    else:
        if n != E or E < 1:
            raise invalid_model(path, f"{f}.moe_num_experts", f"expected experts_per_layer={E} (at least 1)")
        if start != next_expert:
            raise invalid_model(path, f"{f}.moe_expert_start", f"expected {next_expert}")
        if cfg["moe_intermediate_size"] < 1:
            raise invalid_model(path, "moe_intermediate_size", "must be positive with MoE layers")
        next_expert += n
    if kind == "moe_shared" and cfg["shared_expert_intermediate_size"] < 1:
        raise invalid_model(path, "shared_expert_intermediate_size", "must be positive with moe_shared layers")
    if kind == "moe_dense" and cfg["intermediate_size"] < 1:
        raise invalid_model(path, "intermediate_size", "must be positive with moe_dense layers")
    if kind == "moe_dense" and cfg.get("norm_layout") != "sandwich":
        raise invalid_model(path, f"{f}.type", "moe_dense layers need norm_layout 'sandwich' (Gemma 4)")
    return next_expert
    return cfg


def _layer_attention(path, f, cfg, layer):
    """A layer's own head_dim / KV heads / rope (LAYER_OPTIONAL)."""
    nh = cfg["num_attention_heads"]
    if "head_dim" in layer:
        hd = _int(path, f"{f}.head_dim", layer["head_dim"], 2, 1 << 12)
        if hd % 2:
            raise invalid_model(path, f"{f}.head_dim", f"{hd} is odd; rotary embeddings need an even head_dim")
    if "num_key_value_heads" in layer:
        nkv = _int(path, f"{f}.num_key_value_heads", layer["num_key_value_heads"], 1, MAX_HEADS)
        if nh % nkv:
            raise invalid_model(path, f"{f}.num_key_value_heads", f"{nkv} does not divide num_attention_heads={nh}")
    if "rope_theta" in layer:
        _num(path, f"{f}.rope_theta", layer["rope_theta"], 1.0, 1e12, lo_open=True)
    if "rope_partial" in layer:
        _num(path, f"{f}.rope_partial", layer["rope_partial"], 0.0, 1.0)
    if "k_eq_v" in layer:
        _bool(path, f"{f}.k_eq_v", layer["k_eq_v"])
    if "nope" in layer:
        _bool(path, f"{f}.nope", layer["nope"])


def _latent_fields(path, cfg):
    """latent_attention: ranks and head dims, and what latent attention does not combine with."""
    if "latent_attention" not in cfg:
        return
    la = _obj(path, "latent_attention", cfg["latent_attention"])
    _known(path, "latent_attention.", la, LATENT_FIELDS)
    for f in LATENT_FIELDS:
        if f not in la:
            raise invalid_model(path, f"latent_attention.{f}", "missing")
        if f == "norm_eps":             # the latents' norms' own eps (transformers: 1e-6, not rms_norm_eps)
            _num(path, "latent_attention.norm_eps", la[f], 0.0, 1.0, lo_open=True)
        else:
            _int(path, f"latent_attention.{f}", la[f], 0 if f == "q_lora_rank" else 1, 1 << 14)
    if la["qk_rope_head_dim"] % 2:
        raise invalid_model(path, "latent_attention.qk_rope_head_dim", f"{la['qk_rope_head_dim']} is odd; "
                            "rotary embeddings need an even width")
    if cfg["head_dim"] != la["qk_rope_head_dim"]:
        raise invalid_model(path, "head_dim", f"is {cfg['head_dim']}; with latent attention it is the rotated "
                            f"width, latent_attention.qk_rope_head_dim = {la['qk_rope_head_dim']}")
    for f, off in (("layer_types", None), ("attention_sinks", False), ("v_norm", False)):
        if cfg.get(f, off) not in (off, None) and not (f == "layer_types" and
                                                       set(cfg[f]) == {"full_attention"}):
            raise invalid_model(path, f, "does not combine with latent_attention (every layer attends to all "
                                "its positions through the latent cache)")
    if cfg["qk_norm"] != "none" or cfg["attention_bias"] or cfg.get("norm_layout", "pre") != "pre":
        raise invalid_model(path, "latent_attention", "takes qk_norm 'none', no attention_bias and norm_layout "
                            "'pre' (its own norms are the latents')")
    if any(k in l for l in cfg["layers"] for k in LAYER_OPTIONAL):
        raise invalid_model(path, "layers", "per-layer attention geometry does not combine with latent_attention")


def _linear_fields(path, cfg):
    """linear_attention (gated delta-net layers), attention_output_gate, rope_dim."""
    if "attention_output_gate" in cfg:
        _bool(path, "attention_output_gate", cfg["attention_output_gate"])
    if "rope_dim" in cfg:
        r = _int(path, "rope_dim", cfg["rope_dim"], 2, cfg["head_dim"])
        if r % 2:
            raise invalid_model(path, "rope_dim", f"{r} is odd; rotary embeddings rotate pairs of dims")
        if any("head_dim" in l or "rope_partial" in l for l in cfg["layers"]):
            raise invalid_model(path, "rope_dim", "does not combine with per-layer head dims or rope_partial")
    la = _mixer_section(path, cfg, "linear_attention", LINEAR_FIELDS)
    if la is None:
        return
    _enum(path, "linear_attention.value_head_order", la.get("value_head_order", "grouped"), ("grouped", "tiled"))
    for f in LINEAR_FIELDS:
        if f == "value_head_order":
            continue
        if f not in la:
            raise invalid_model(path, f"linear_attention.{f}", "missing")
        _int(path, f"linear_attention.{f}", la[f], 2 if f == "conv_kernel" else 1,
             MAX_CONV_KERNEL if f == "conv_kernel" else MAX_HEADS if f.startswith("num") else 1 << 10)
    if la["num_value_heads"] % la["num_key_heads"]:
        raise invalid_model(path, "linear_attention.num_value_heads", f"{la['num_value_heads']} is not a multiple "
                            f"of num_key_heads={la['num_key_heads']} (each key head serves whole value heads)")
    if cfg.get("latent_attention") or cfg.get("norm_layout", "pre") != "pre":
        raise invalid_model(path, "linear_attention", "does not combine with latent_attention or sandwich norms")
    if any(k in l for l in cfg["layers"] for k in LAYER_OPTIONAL):
        raise invalid_model(path, "layers", "per-layer attention geometry does not combine with linear_attention")


def _mixer_section(path, cfg, kind: str, fields) -> dict | None:
    """A recurrent mixer's parameters, cfg[kind], present exactly when layer_types names that kind; None
    when neither; its keys among `fields`."""
    used = kind in (cfg.get("layer_types") or ())
    if kind not in cfg:
        if used:
            raise invalid_model(path, kind, f"missing (layer_types has {kind} layers)")
        return None
    if not used:
        raise invalid_model(path, "layer_types", f"has no {kind} layer, but {kind} is given")
    sec = _obj(path, kind, cfg[kind])
    _known(path, kind + ".", sec, fields)
    return sec


def _short_conv_fields(path, cfg):
    """short_conv (LFM2's gated short-convolution layers)."""
    sc = _mixer_section(path, cfg, "short_conv", SHORT_CONV_FIELDS)
    if sc is None:
        return
    if "conv_kernel" not in sc:
        raise invalid_model(path, "short_conv.conv_kernel", "missing")
    _int(path, "short_conv.conv_kernel", sc["conv_kernel"], 2, MAX_CONV_KERNEL)
    if "linear_attention" in cfg or cfg.get("latent_attention") or cfg.get("norm_layout", "pre") != "pre":
        raise invalid_model(path, "short_conv", "does not combine with linear_attention, latent_attention or "
                            "sandwich norms")
    if any(k in l for l in cfg["layers"] for k in LAYER_OPTIONAL):
        raise invalid_model(path, "layers", "per-layer attention geometry does not combine with short_conv")


def _mamba_fields(path, cfg):
    """mamba (Granite 4.0-H's Mamba-2 layers)."""
    mb = _mixer_section(path, cfg, "mamba", MAMBA_FIELDS + ("norm_eps",))
    if mb is None:
        return
    if "norm_eps" in mb:
        _num(path, "mamba.norm_eps", mb["norm_eps"], 0.0, 1.0, lo_open=True)
    for f in MAMBA_FIELDS:
        if f not in mb:
            raise invalid_model(path, f"mamba.{f}", "missing")
        _int(path, f"mamba.{f}", mb[f], 2 if f == "conv_kernel" else 1,
             MAX_CONV_KERNEL if f == "conv_kernel" else MAX_HEADS if f in ("num_heads", "n_groups") else 1 << 10)
    if mb["n_groups"] != 1:
        raise invalid_model(path, "mamba.n_groups", f"{mb['n_groups']}: Colibri's gated RMSNorm normalises the "
                            "heads' channels as one group (Granite 4.0-H's n_groups is 1)")
    if any(k in cfg for k in ("linear_attention", "short_conv")) or cfg.get("latent_attention") or \
            cfg.get("norm_layout", "pre") != "pre":
        raise invalid_model(path, "mamba", "does not combine with linear_attention, short_conv, latent_attention "
                            "or sandwich norms")
    if any(k in l for l in cfg["layers"] for k in LAYER_OPTIONAL if k != "nope"):
        raise invalid_model(path, "layers", "per-layer attention geometry does not combine with mamba")


def _router_fields(path, cfg, E):
    """router_score, router_groups, routed_scaling_factor."""
    score = _enum(path, "router_score", cfg.get("router_score", "softmax"), ("softmax", "sigmoid"))
    if "routed_scaling_factor" in cfg:
        _num(path, "routed_scaling_factor", cfg["routed_scaling_factor"], 0.0, 1e6, lo_open=True)
    if (score != "softmax" or "router_groups" in cfg) and cfg["router_mode"] != "topk":
        raise invalid_model(path, "router_mode", f"{cfg['router_mode']} routing takes no sigmoid scores or groups "
                            "(topk does)")
    if "router_groups" not in cfg:
        return
    g = _obj(path, "router_groups", cfg["router_groups"])
    _known(path, "router_groups.", g, GROUP_FIELDS)
    for f in GROUP_FIELDS:
        if f not in g:
            raise invalid_model(path, f"router_groups.{f}", "missing")
    n = _int(path, "router_groups.n_group", g["n_group"], 1, max(E, 1))
    if E % n:
        raise invalid_model(path, "router_groups.n_group", f"{n} does not divide experts_per_layer={E}")
    keep = _int(path, "router_groups.topk_group", g["topk_group"], 1, n)
    _int(path, "router_groups.group_top", g["group_top"], 1, min(2, E // n))
    if cfg["top_k"] > keep * (E // n):
        raise invalid_model(path, "top_k", f"{cfg['top_k']} is more than the {keep} kept groups of {E // n} "
                            "experts hold")


def _attention_fields(path, cfg, L):
    """layer_types / sliding_window, sinks, rope scaling, router and expert biases, the activation."""
    if "layer_types" in cfg:
        types = _list(path, "layer_types", cfg["layer_types"], MAX_LAYERS)
        if len(types) != L:
            raise invalid_model(path, "layer_types", f"has {len(types)} entries, num_hidden_layers is {L}")
        for i, t in enumerate(types):
            _enum(path, f"layer_types[{i}]", t, ATTENTION_TYPES)
        if "sliding_attention" in types and "sliding_window" not in cfg:
            raise invalid_model(path, "sliding_window", "missing (layer_types has sliding_attention layers)")
    if "sliding_window" in cfg:
        _int(path, "sliding_window", cfg["sliding_window"], 1, MAX_POSITIONS)
    for f in ("attention_sinks", "router_bias", "expert_bias"):
        if f in cfg:
            _bool(path, f, cfg[f])
    _enum(path, "ffn_act", cfg.get("ffn_act", "silu"), ("silu", "gelu_tanh"))
    if "norm_layout" in cfg:
        _enum(path, "norm_layout", cfg["norm_layout"], ("pre", "sandwich"))
    if "embed_scale" in cfg:
        _num(path, "embed_scale", cfg["embed_scale"], 0.0, 1e6, lo_open=True)
    if "final_logit_softcap" in cfg:
        _num(path, "final_logit_softcap", cfg["final_logit_softcap"], 0.0, 1e6, lo_open=True)
    for f in ("v_norm", "layer_scalar", "router_input_norm", "expert_scale"):
        if f in cfg:
            _bool(path, f, cfg[f])
    act = _enum(path, "expert_act", cfg.get("expert_act", "silu"), EXPERT_ACTS)
    if act == "swiglu_oai":
        for f in ("swiglu_alpha", "swiglu_limit"):
            if f not in cfg:
                raise invalid_model(path, f, "missing (expert_act is swiglu_oai)")
            _num(path, f, cfg[f], 0.0, 1e6, lo_open=True)
    if "rope_scaling" in cfg:
        rs = _obj(path, "rope_scaling", cfg["rope_scaling"])
        _known(path, "rope_scaling.", rs, YARN_FIELDS)
        kind = _enum(path, "rope_scaling.rope_type", rs.get("rope_type"),
                     ("yarn", "longrope", "llama3", "freq_factors"))
        need = {"yarn": ("factor", "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "freq_factors": ("freq_factors",)}
        for f in need[kind]:
            if f not in rs:
                raise invalid_model(path, f"rope_scaling.{f}", "missing")
        if "factor" in rs:
            _num(path, "rope_scaling.factor", rs["factor"], 0.0, 1e6, lo_open=True)
        for f in ("short_factor", "long_factor", "freq_factors"):
            if f in rs:
                fs = _list(path, f"rope_scaling.{f}", rs[f], 1 << 12)
                if len(fs) != cfg["head_dim"] // 2:
                    raise invalid_model(path, f"rope_scaling.{f}", f"has {len(fs)} factors, head_dim / 2 is "
                                        f"{cfg['head_dim'] // 2}")
                for i, v in enumerate(fs):
                    _num(path, f"rope_scaling.{f}[{i}]", v, 0.0, 1e6, lo_open=True)
        if kind == "llama3" and not 0 < rs["low_freq_factor"] < rs["high_freq_factor"]:
            raise invalid_model(path, "rope_scaling.high_freq_factor", f"{rs['high_freq_factor']!r} must exceed "
                                f"low_freq_factor {rs['low_freq_factor']!r} (> 0)")
        for f in ("short_mscale", "long_mscale"):
            if rs.get(f) is not None:
                _num(path, f"rope_scaling.{f}", rs[f], 0.0, 1e6, lo_open=True)
        if kind != "freq_factors" or "original_max_position_embeddings" in rs:
            _int(path, "rope_scaling.original_max_position_embeddings", rs["original_max_position_embeddings"], 1,
                 MAX_POSITIONS)
        for f in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if rs.get(f) is not None:
                _num(path, f"rope_scaling.{f}", rs[f], 0.0, 1e6, lo_open=True)
        if "truncate" in rs:
            _bool(path, "rope_scaling.truncate", rs["truncate"])


# -- tensors.json / experts.json ----------------------------------------------------------------------
def tensor_record(path: str, name: str, rec):
    _obj(path, name, rec)
    for k in ("offset", "shape", "dtype"):
        if k not in rec:
            raise invalid_model(path, f"{name}.{k}", "missing")
    _known(path, f"{name}.", rec, ("offset", "shape", "dtype", "nbytes"))
    _int(path, f"{name}.offset", rec["offset"], 0, MAX_OFFSET)
    for i, d in enumerate(_list(path, f"{name}.shape", rec["shape"], 8)):
        _int(path, f"{name}.shape[{i}]", d, 0, MAX_POSITIONS)
    _enum(path, f"{name}.dtype", rec["dtype"], ("float32",) + WEIGHT_TYPES)
    if "nbytes" in rec:
        _int(path, f"{name}.nbytes", rec["nbytes"], 0, MAX_OFFSET)


EXPERT_FIELDS = ("id", "layer", "local_id", "weight_offset", "weight_size", "hidden_size", "intermediate_size",
                 "has_residual", "activation_fn")


def expert_record(path: str, i: int, rec, v1: bool = False) -> tuple:
    """-> the (gate, up, down) formats of a checked experts.json record ("formats" in version 2,
    one "dtype" in version 1)."""
    f = f"[{i}]"
    _obj(path, f, rec)
    fields = EXPERT_FIELDS + (("dtype",) if v1 else ("formats",))
    for k in fields:
        if k not in rec:
            raise invalid_model(path, f"{f}.{k}", "missing")
    _known(path, f"{f}.", rec, fields)
    for k, hi in (("id", MAX_LAYERS * MAX_EXPERTS), ("layer", MAX_LAYERS), ("local_id", MAX_EXPERTS),
                  ("weight_offset", MAX_OFFSET), ("weight_size", MAX_OFFSET), ("hidden_size", MAX_DIM),
                  ("intermediate_size", MAX_DIM)):
        _int(path, f"{f}.{k}", rec[k], 0, hi)
    _bool(path, f"{f}.has_residual", rec["has_residual"])
    if rec["has_residual"]:
        raise invalid_model(path, f"{f}.has_residual", "residual experts are not implemented")
    _enum(path, f"{f}.activation_fn", rec["activation_fn"], ("swiglu", "swiglu_oai", "gelu_tanh"))
    if v1:
        return (_enum(path, f"{f}.dtype", rec["dtype"], ("float32", "float16", "bfloat16", "int8")),) * 3
    fm = _obj(path, f"{f}.formats", rec["formats"])
    _known(path, f"{f}.formats.", fm, ("gate", "up", "down"))
    out = []
    for k in ("gate", "up", "down"):
        if k not in fm:
            raise invalid_model(path, f"{f}.formats.{k}", "missing")
        out.append(_enum(path, f"{f}.formats.{k}", fm[k], WEIGHT_TYPES))
    return tuple(out)


# -- generation_config.json / tokenizer_config.json ------------------------------------------------------
def generation_config(obj, path: str, vocab: int) -> dict:
    _obj(path, "(root)", obj)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        v = obj.get(key)
        if v is None:
            continue
        vals = v if isinstance(v, list) else [v]
        if len(vals) > 1024:
            raise invalid_model(path, key, f"has {len(vals)} ids")
        for i, t in enumerate(vals):
            _int(path, f"{key}[{i}]" if isinstance(v, list) else key, t, 0, vocab - 1)
    return obj


def tokenizer_config(obj, path: str) -> dict:
    _obj(path, "(root)", obj)
    tpl = obj.get("chat_template")
    if tpl is not None and not isinstance(tpl, str):
        for i, t in enumerate(_list(path, "chat_template", tpl, 64)):
            _obj(path, f"chat_template[{i}]", t)
            if not isinstance(t.get("name"), str) or not isinstance(t.get("template"), str):
                raise invalid_model(path, f"chat_template[{i}]", "a named template needs string 'name' and 'template'")
    for key, v in obj.items():
        if key.endswith("_token") and v is not None and not isinstance(v, str):
            if not isinstance(v, dict) or not isinstance(v.get("content"), str):
                raise invalid_model(path, key, f"expected a string or {{\"content\": string}}, got {v!r:.60}")
    if "add_bos_token" in obj and obj["add_bos_token"] is not None:
        _bool(path, "add_bos_token", obj["add_bos_token"])
    return obj
