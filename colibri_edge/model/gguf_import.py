"""`colibri convert MODEL.gguf OUT_DIR`: a GGUF file (llama.cpp's, Ollama's) -> model directory.

The file is read with gguf-py's GGUFReader (memory-mapped; it honours `general.alignment`), split
files (NAME-00001-of-000NN.gguf) part by part. Every matrix is copied in the blocks it is stored in:
no requantisation, so Colibri runs exactly the weights llama.cpp runs. What is translated:

  metadata    {arch}.* keys -> config.json (through convert.translate_config, so a GGUF and a
              safetensors checkpoint of one model give the same config), for the architectures below
  tensors     GGUF names -> ours; q/k rows of arch `llama` un-permuted (llama.cpp's converter turns
              Hugging Face's half-split rope layout into adjacent pairs; rows are whole blocks, so
              this moves bytes); stacked experts ffn_{gate,up,down}_exps [E, out, in] (or fused
              ffn_gate_up_exps [E, 2 I, H]) split into one page-aligned blob per expert; norms,
              biases and routers widened to float32 (the converter writes them so already)
  tokenizer   the embedded vocabulary -> tokenizer.json by transformers' convert_gguf_tokenizer
              (torch-free), tokenizer_config.json with the chat template and BOS handling,
              generation_config.json with every end-of-generation id llama.cpp stops at

  GGUF arch   model_type   routing as llama.cpp computes it (no key carries it)
  llama       mixtral      softmax top-k, renormalised (a `llama` file with expert_count > 0)
  qwen2moe    qwen2_moe    softmax top-k, not renormalised; shared expert with sigmoid gate
  qwen3moe    qwen3_moe    softmax top-k, renormalised; per-head q/k RMSNorm
  olmoe       olmoe        softmax top-k, not renormalised; q/k RMSNorm over the whole projection
  ernie4_5-moe ernie4_5_moe softmax, the choice by p + exp_probs_b, renormalised (floor 1e-12, the
                           Hugging Face default: no key carries moe_norm_min); dense layers before
                           leading_dense_block_count, then every interleave_moe_layer_step-th; shared
                           experts as wide as ffn_gate_shexp (the converter's
                           expert_shared_feed_forward_length is not their width); q/k rows un-permuted
  deepseek2   deepseek_v2  (DeepSeek-V2/V3, GLM-4.7-Flash, Moonlight) latent attention: q_lora_rank,
              deepseek_v3  kv_lora_rank, key_length_mla / value_length_mla, the split attn_k_b /
                           attn_v_b (or an older file's attn_kv_b, split here); the rotated rows in
                           adjacent pairs (llama.cpp's rope type NORM), un-permuted; expert_gating_func
                           softmax (V2: groups scored by their best, not renormalised) or sigmoid (V3 /
                           GLM: exp_probs_b for the choice, groups scored by their best two),
                           expert_group_count / _used_count, expert_weights_scale / _norm; leading dense
                           layers; YaRN's yarn_log_multiplier (0.1 mscale_all_dim); nextn_predict_layers
                           (multi-token prediction) skipped
  qwen35moe   qwen3_5_moe_text  (Qwen3.5 / 3.6-MoE) gated delta-nets on attention.recurrent_layers: ssm.*
                           sizes, attn_qkv / attn_gate (z) / ssm_alpha / ssm_beta / ssm_a (= -exp(A_log)) /
                           ssm_dt / ssm_conv1d / ssm_norm / ssm_out, value heads kept in the file's tiled
                           order; full layers' attn_q rows split into query and output gate per head and
                           the partial rotary rows reordered (whole rows); softmax top-k, renormalised,
                           a shared expert with sigmoid gate; nextn_predict_layers skipped
(`{arch}.expert_weights_norm`, when a file has it, overrides the renormalisation.)

Every failure is a ColibriError naming the file and the key or tensor: a GGUF that is not one, a
truncated one, a type Colibri does not run (the IQ family, Q2_K, Q3_K, ...), tensor data past the
end of the file, a missing key, a tensor whose shape is not what the metadata implies.
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np
from tqdm import tqdm

from .dtypes import is_block, narrow, storage_shape, widen
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL_TYPE, invalid_model
from . import validate
from .modeldir import ALIGN, HEAD_TYPES, ModelWriter, check_disk, tensor_roles

ARCHS = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
         "ernie4_5-moe": "ernie4_5_moe", "gpt-oss": "gpt_oss", "gemma4": "gemma4_text",
         "deepseek2": "deepseek_v2 / deepseek_v3", "qwen35moe": "qwen3_5_moe_text"}
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "ernie4_5-moe": True,
             "gpt-oss": True, "gemma4": True}
# archs whose q/k rows the file holds with adjacent rope pairs (llama.cpp's rope type NORM): un-permuted
# to the half-split layout every backend runs (`llama`: the converter permuted them; `ernie4_5-moe`:
# Hugging Face's own layout, kept)
INTERLEAVED = ("llama", "ernie4_5-moe")
# GGML type name -> our format (the types we run as stored)
FORMATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "q8_0", "Q4_0": "q4_0",
           "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
           "MXFP4": "mxfp4"}
# GGUF file types (general.file_type) -> config.json's weight_dtype label
FILE_TYPES = {0: "float32", 1: "float16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 8: "q5_0", 9: "q5_1", 15: "q4_k_m",
              32: "bfloat16"}
# tokens llama.cpp ends generation at by their text (llama-vocab.cpp, the EOG list), besides the
# eos / eot / eom / fim ids the metadata names
EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~["}
EOG_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id", "fim_pad_token_id", "fim_rep_token_id",
            "fim_sep_token_id")
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "reading GGUF files needs the gguf extra: "
                           "pip install 'colibri-edge[gguf]'") from None
    return gguf


# ----------------------------------------------------------------------------------------------
# the file(s)

def _reader_class():
    gguf = _gguf()

    class Reader(gguf.GGUFReader):
        """gguf-py's reader, with each tensor's type and extent checked before gguf-py maps its data,
        so that an unknown type or data past the end is an error naming the tensor."""

        def _build_tensors(self, start_offs, fields):
            size = self.data.shape[0]
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                name = bytes(name).decode("utf-8", "replace")
                try:
                    t = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise invalid_model(self.path, name, f"tensor type id {int(raw_type[0])} is not a GGML type "
                                        "(a damaged file, or one newer than gguf-py knows)") from None
                B, nb = gguf.GGML_QUANT_SIZES[t]
                if not len(dims) or min(int(d) for d in dims) < 1 or max(int(d) for d in dims) > 1 << 40:
                    raise invalid_model(self.path, name, f"tensor shape {dims.tolist()} has an empty or absurd "
                                        "dimension")
                n = int(np.prod(dims, dtype=np.uint64))
                if n % B or (len(dims) and int(dims[0]) % B):
                    raise invalid_model(self.path, name, f"{t.name} tensor of shape {dims.tolist()} is not whole blocks")
                end = int(start_offs) + int(offset[0]) + n // B * nb
                if end > size:
                    raise invalid_model(self.path, name, f"data runs to byte {end}, past the end of the file ({size} "
                                        "bytes): the file is truncated; download it again")
            return super()._build_tensors(start_offs, fields)

    return Reader


def _open(path):
    Reader = _reader_class()
    if not os.path.isfile(path):
        raise invalid_model(path, "(file)", "no such GGUF file")
    try:
        Reader.path = path
        return Reader(path, "r")
    except ColibriError:
        raise
    except ValueError as e:
        field = "magic" if "magic" in str(e) else "(header)"
        raise invalid_model(path, field, f"not a GGUF file gguf-py can read ({e})") from None
    except (IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as e:
        raise invalid_model(path, "(header)", f"truncated or damaged GGUF header ({type(e).__name__}: {e}); "
                            "download the file again") from None


def split_parts(path: str) -> list:
    """The files of a model: [path], or every NAME-0000k-of-0000N.gguf of a split one (from any part)."""
    m = SPLIT.match(os.path.basename(path))
    if not m:
        return [path]
    n = int(m["n"])
    d = os.path.dirname(path)
    parts = [os.path.join(d, f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    for p in parts:
        if not os.path.isfile(p):
            raise invalid_model(p, "(file)", f"part of a {n}-file split model is missing; put every part beside "
                                "the first")
    return parts


class GGUFModel:
    """Metadata and tensors of one GGUF model (one file or the parts of a split one)."""

    def __init__(self, path: str):
        self.parts = split_parts(path)
        self.path = self.parts[0]
        self.readers = [_open(p) for p in self.parts]
        self.fields = self.readers[0].fields
        self.tensors = {}
        for r, p in zip(self.readers, self.parts):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise invalid_model(p, t.name, "tensor appears in two parts of the split model")
                self.tensors[t.name] = (t, p)
        if len(self.parts) > 1:
            want = self.get("split.tensors.count", int, required=False)
            if want is not None and want != len(self.tensors):
                raise invalid_model(self.path, "split.tensors.count", f"{want}, but the parts hold {len(self.tensors)}")

    def get(self, key, kind=int, required=True, default=None):
        """The value of a metadata key, checked to be of `kind` (int, float, bool, str, list)."""
        f = self.fields.get(key)
        if f is None:
            if required:
                raise invalid_model(self.path, key, "missing metadata key (needed to build config.json)")
            return default
        v = self.value(key)
        ok = (isinstance(v, bool) if kind is bool else isinstance(v, (int, np.integer)) and not isinstance(v, bool)
              if kind is int else isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
              if kind is float else isinstance(v, kind))
        if not ok:
            raise invalid_model(self.path, key, f"expected {kind.__name__}, got {type(v).__name__} {v!r:.60}")
        return kind(v) if kind in (int, float) else v

    def value(self, key):
        """A field's value as gguf-py decodes it (a damaged field is an error naming it)."""
        try:
            return self.fields[key].contents()
        except Exception as e:                  # gguf-py raises assorted errors on a damaged field
            raise invalid_model(self.path, key, f"unreadable value ({type(e).__name__}: {e}); the file is "
                                "damaged") from None

    def tensor(self, name):
        return self.tensors[name][0]


# ----------------------------------------------------------------------------------------------
# metadata -> config

def _pos(m, key, v, lo=1, hi=validate.MAX_DIM):
    if v is not None and not lo <= v <= hi:
        raise invalid_model(m.path, key, f"{v} is out of range ({lo}..{hi})")
    return v


def hf_config(m: GGUFModel) -> tuple[dict, str]:
    """The Hugging Face-shaped config the metadata describes, and the GGUF architecture."""
    arch = m.get("general.architecture", str)
    if arch not in ARCHS:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE,
                           f"{m.path}: field 'general.architecture': {arch!r} is not supported; supported: "
                           f"{', '.join(ARCHS)} (llama with experts: Mixtral)")
    if arch == "gemma4":
        return _gemma4_config(m), arch
    if arch == "deepseek2":
        return _deepseek2_config(m), arch
    if arch == "qwen35moe":
        return _qwen35moe_config(m), arch
    a = arch + "."
    g = lambda k, kind=int, **kw: m.get(a + k, kind, **kw)            # noqa: E731
    L = _pos(m, a + "block_count", g("block_count"), 1, validate.MAX_LAYERS)
    H = _pos(m, a + "embedding_length", g("embedding_length"))
    nh = _pos(m, a + "attention.head_count", g("attention.head_count"), 1, validate.MAX_HEADS)
    nkv = _pos(m, a + "attention.head_count_kv", g("attention.head_count_kv", required=False, default=nh), 1, nh)
    E = _pos(m, a + "expert_count", g("expert_count", required=False, default=0), 0, validate.MAX_EXPERTS)
    if E == 0:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE, f"{m.path}: field '{a}expert_count': a dense {arch} model "
                           "(no experts); Colibri runs mixture-of-experts models")
    k = _pos(m, a + "expert_used_count", g("expert_used_count"), 1, validate.MAX_EXPERTS)
    if k > E:
        raise invalid_model(m.path, a + "expert_used_count", f"{k} experts per token of {E}")
    ff = _pos(m, a + "feed_forward_length", g("feed_forward_length", required=arch in ("llama", "olmoe",
                                                                                       "ernie4_5-moe")))
    ff_exp = _pos(m, a + "expert_feed_forward_length",
                  g("expert_feed_forward_length", required=arch in ("qwen2moe", "qwen3moe", "ernie4_5-moe"),
                    default=ff))
    dense = _pos(m, a + "leading_dense_block_count", g("leading_dense_block_count", required=False, default=0), 0, L)
    if dense and arch in ("llama", "olmoe"):
        raise invalid_model(m.path, a + "leading_dense_block_count", f"{dense} dense layers in a {arch} model; "
                            "Colibri's layer plan for it has none")
    head_dim = _pos(m, a + "attention.key_length", g("attention.key_length", required=False, default=H // nh))
    vdim = g("attention.value_length", required=False, default=head_dim)
    if vdim != head_dim:
        raise invalid_model(m.path, a + "attention.value_length", f"{vdim} differs from key_length {head_dim}; "
                            "Colibri's attention needs them equal")
    rot = g("rope.dimension_count", required=False, default=head_dim)
    if rot != head_dim:
        raise invalid_model(m.path, a + "rope.dimension_count", f"{rot} of {head_dim}: partial rotary embeddings "
                            "are not implemented")
    scaling = g("rope.scaling.type", str, required=False, default="none")
    factor = g("rope.scaling.factor", float, required=False, default=1.0)
    oss = arch == "gpt-oss"
    if scaling not in ("none", "") and factor != 1.0 and not (oss and scaling == "yarn"):
        raise invalid_model(m.path, a + "rope.scaling.type", f"rope scaling {scaling!r} x{factor} is not implemented")
    ctx = _pos(m, a + "context_length", g("context_length", required=False, default=4096), 1,
               validate.MAX_POSITIONS)
    window = g("attention.sliding_window", required=False, default=0)
    if window and window < ctx and not oss:
        raise invalid_model(m.path, a + "attention.sliding_window", f"a window of {window} tokens, shorter than "
                            f"the context ({ctx}): sliding-window attention is not implemented")
    gating = g("expert_gating_func", required=False, default=1)
    if gating != 1:
        raise invalid_model(m.path, a + "expert_gating_func", f"{gating}: only softmax gating (1) is implemented")
    scale = g("expert_weights_scale", float, required=False, default=1.0)
    if scale != 1.0:
        raise invalid_model(m.path, a + "expert_weights_scale", f"{scale}: scaled expert weights are not implemented")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if g(key, float, required=False):
            raise invalid_model(m.path, a + key, "logit soft-capping is not implemented")
    eps = g("attention.layer_norm_rms_epsilon", float)
    if not 0 < eps < 1:
        raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
    theta = g("rope.freq_base", float, required=False, default=10000.0)
    if not theta > 0:
        raise invalid_model(m.path, a + "rope.freq_base", f"{theta} is not positive")
    if "token_embd.weight" not in m.tensors:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    V = int(m.tensor("token_embd.weight").shape[1])
    vocab = g("vocab_size", required=False, default=V)
    if vocab != V:
        raise invalid_model(m.path, a + "vocab_size", f"{vocab}, but token_embd.weight has {V} rows")
    hf = {"model_type": ARCHS[arch], "architectures": [], "num_hidden_layers": L, "hidden_size": H,
          "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": head_dim, "vocab_size": V,
          "max_position_embeddings": ctx, "rope_theta": theta, "rms_norm_eps": eps, "num_experts_per_tok": k,
          "tie_word_embeddings": "output.weight" not in m.tensors,
          "norm_topk_prob": g("expert_weights_norm", bool, required=False, default=NORM_TOPK[arch])}
    if arch == "llama":
        hf.update(num_local_experts=E, intermediate_size=ff_exp)
    elif oss:
        # llama.cpp's gpt-oss: even layers sliding (its fixed pattern), alpha 1.702 and limit 7 (fixed in
        # its graph; translate_config's defaults), YaRN with gpt-oss's untruncated correction range
        rope = {"rope_type": "default", "rope_theta": theta}
        if scaling == "yarn" and factor != 1.0:
            rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "truncate": False,
                    "original_max_position_embeddings": _pos(m, a + "rope.scaling.original_context_length",
                                                             g("rope.scaling.original_context_length"), 1,
                                                             validate.MAX_POSITIONS),
                    "beta_fast": g("rope.scaling.yarn_beta_fast", float, required=False, default=32.0),
                    "beta_slow": g("rope.scaling.yarn_beta_slow", float, required=False, default=1.0)}
            af = g("rope.scaling.yarn_attn_factor", float, required=False)
            if af is not None:
                rope["attention_factor"] = af
        hf.update(num_local_experts=E, intermediate_size=ff_exp, attention_bias=True, rope_parameters=rope,
                  sliding_window=window or None)
    elif arch == "ernie4_5-moe":
        step = _pos(m, a + "interleave_moe_layer_step", g("interleave_moe_layer_step", required=False, default=1), 1, L)
        shared = 0
        if "blk.0.ffn_gate_shexp.weight" in m.tensors or f"blk.{dense}.ffn_gate_shexp.weight" in m.tensors:
            t = m.tensor(f"blk.{dense}.ffn_gate_shexp.weight" if f"blk.{dense}.ffn_gate_shexp.weight" in m.tensors
                         else "blk.0.ffn_gate_shexp.weight")
            shared = int(t.shape[1])
            if shared % ff_exp:
                raise invalid_model(m.path, f"blk.{dense}.ffn_gate_shexp.weight", f"{shared} rows is not a whole "
                                    f"number of experts of {ff_exp}")
        hf.update(moe_num_experts=E, moe_k=k, moe_intermediate_size=ff_exp, intermediate_size=ff,
                  moe_layer_start_index=dense, moe_layer_interval=step, moe_layer_end_index=-1,
                  moe_num_shared_experts=shared // ff_exp, moe_norm_min=1e-12)
    elif arch == "olmoe":
        hf.update(num_experts=E, intermediate_size=ff_exp)
    else:
        hf.update(num_experts=E, moe_intermediate_size=ff_exp, intermediate_size=ff or ff_exp,
                  decoder_sparse_step=1, mlp_only_layers=list(range(dense)),
                  attention_bias="blk.0.attn_q.bias" in m.tensors)
        if arch == "qwen2moe":
            shared = g("expert_shared_feed_forward_length", required=False, default=0)
            if shared == 0 and "blk.0.ffn_gate_shexp.weight" in m.tensors:
                shared = int(m.tensor("blk.0.ffn_gate_shexp.weight").shape[1])
            hf.update(shared_expert_intermediate_size=shared, qkv_bias=hf.pop("attention_bias"))
    return hf, arch


def _decoder_shape(m: GGUFModel, arch: str) -> tuple:
    """(key prefix, getter, decoder layers, hidden, heads) of an arch whose file may append
    multi-token-prediction layers after the decoder's (nextn_predict_layers: not in the plan)."""
    a = arch + "."
    g = lambda k, kind=int, **kw: m.get(a + k, kind, **kw)            # noqa: E731
    nextn = _pos(m, a + "nextn_predict_layers", g("nextn_predict_layers", required=False, default=0), 0, 64)
    L = _pos(m, a + "block_count", g("block_count"), 1 + nextn, validate.MAX_LAYERS) - nextn
    H = _pos(m, a + "embedding_length", g("embedding_length"))
    nh = _pos(m, a + "attention.head_count", g("attention.head_count"), 1, validate.MAX_HEADS)
    return a, g, L, H, nh


def _deepseek2_config(m: GGUFModel) -> dict:
    """llama.cpp's deepseek2 metadata -> a deepseek_v2 (softmax gating) or deepseek_v3 (sigmoid) config
    for convert._mla_config. The MTP layers a file appends (nextn_predict_layers) are not in the plan."""
    a, g, L, H, nh = _decoder_shape(m, "deepseek2")
    r = _pos(m, a + "attention.kv_lora_rank", g("attention.kv_lora_rank"))
    rq = _pos(m, a + "attention.q_lora_rank", g("attention.q_lora_rank", required=False, default=0), 0)
    dr = _pos(m, a + "rope.dimension_count", g("rope.dimension_count"))
    kmla = _pos(m, a + "attention.key_length_mla", g("attention.key_length_mla", required=False,
                                                    default=g("attention.key_length", required=False)), dr + 1)
    dv = _pos(m, a + "attention.value_length_mla", g("attention.value_length_mla", required=False,
                                                    default=g("attention.value_length", required=False)))
    if kmla is None or dv is None:
        raise invalid_model(m.path, a + "attention.key_length_mla", "missing (the latent attention's head sizes)")
    E = _pos(m, a + "expert_count", g("expert_count", required=False, default=0), 0, validate.MAX_EXPERTS)
    if E == 0:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE, f"{m.path}: field '{a}expert_count': a dense deepseek2 "
                           "model (no experts); Colibri runs mixture-of-experts models")
    k = _pos(m, a + "expert_used_count", g("expert_used_count"), 1, E)
    gating = g("expert_gating_func", required=False, default=1)      # llama.cpp: absent = softmax (V2)
    if gating not in (1, 2):
        raise invalid_model(m.path, a + "expert_gating_func", f"{gating}: softmax (1) and sigmoid (2) are implemented")
    sigmoid = gating == 2
    n_group = _pos(m, a + "expert_group_count", g("expert_group_count", required=False, default=1), 1, E)
    topk_group = _pos(m, a + "expert_group_used_count", g("expert_group_used_count", required=False, default=1),
                      1, n_group)
    eps = g("attention.layer_norm_rms_epsilon", float)
    if not 0 < eps < 1:
        raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
    ctx = _pos(m, a + "context_length", g("context_length", required=False, default=4096), 1, validate.MAX_POSITIONS)
    rope = {"rope_type": "default", "rope_theta": g("rope.freq_base", float, required=False, default=10000.0)}
    scaling = g("rope.scaling.type", str, required=False, default="none")
    factor = g("rope.scaling.factor", float, required=False, default=1.0)
    if scaling == "yarn" and factor != 1.0:
        mul = g("rope.scaling.yarn_log_multiplier", float, required=False, default=0.0)
        rope.update(rope_type="yarn", factor=factor,
                    original_max_position_embeddings=_pos(m, a + "rope.scaling.original_context_length",
                                                          g("rope.scaling.original_context_length"), 1,
                                                          validate.MAX_POSITIONS),
                    beta_fast=g("rope.scaling.yarn_beta_fast", float, required=False, default=32.0),
                    beta_slow=g("rope.scaling.yarn_beta_slow", float, required=False, default=1.0))
        if mul:             # llama.cpp stores 0.1 mscale_all_dim and runs the rope key unscaled (mscale equal)
            rope.update(mscale=mul / 0.1, mscale_all_dim=mul / 0.1)
    elif scaling not in ("none", "") and factor != 1.0:
        raise invalid_model(m.path, a + "rope.scaling.type", f"rope scaling {scaling!r} x{factor} is not implemented")
    if "token_embd.weight" not in m.tensors:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    V = int(m.tensor("token_embd.weight").shape[1])
    hf = {"model_type": "deepseek_v3" if sigmoid else "deepseek_v2", "architectures": [], "num_hidden_layers": L,
          "hidden_size": H, "num_attention_heads": nh, "num_key_value_heads": nh, "vocab_size": V,
          "max_position_embeddings": ctx, "rms_norm_eps": eps, "rope_parameters": rope,
          "q_lora_rank": rq or None, "kv_lora_rank": r, "qk_nope_head_dim": kmla - dr, "qk_rope_head_dim": dr,
          "v_head_dim": dv, "n_routed_experts": E, "num_experts_per_tok": k,
          "moe_intermediate_size": _pos(m, a + "expert_feed_forward_length", g("expert_feed_forward_length")),
          "intermediate_size": _pos(m, a + "feed_forward_length", g("feed_forward_length", required=False, default=1)),
          "first_k_dense_replace": _pos(m, a + "leading_dense_block_count",
                                        g("leading_dense_block_count", required=False, default=0), 0, L),
          "n_shared_experts": _pos(m, a + "expert_shared_count", g("expert_shared_count", required=False, default=0),
                                   0, 64),
          "routed_scaling_factor": g("expert_weights_scale", float, required=False, default=1.0),
          "norm_topk_prob": g("expert_weights_norm", bool, required=False, default=False),
          "n_group": n_group, "topk_group": topk_group, "tie_word_embeddings": "output.weight" not in m.tensors,
          "rope_interleave": True}
    if not sigmoid:
        hf["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
        if hf["norm_topk_prob"]:
            raise invalid_model(m.path, a + "expert_weights_norm", "renormalised softmax routing in a deepseek2 file: "
                                "DeepSeek-V2's router (transformers') never renormalises")
    return hf


def _qwen35moe_config(m: GGUFModel) -> dict:
    """llama.cpp's qwen35moe metadata -> a qwen3_5_moe_text config (convert._qwen35_config's input): the
    recurrent_layers array (the gated delta-nets), ssm.* (conv_kernel, state_size = key head dim,
    group_count = key heads, time_step_rank = value heads, inner_size = value heads x value dim), partial
    rotary (rope.dimension_count of key_length), the shared expert. The appended multi-token-prediction
    layers (nextn_predict_layers) are not in the plan. llama.cpp stores the value heads tiled by key head
    (value head j * Hk + k reads key head k) where Hk < Hv: kept as stored (linear_value_head_order)."""
    a, g, L, H, nh = _decoder_shape(m, "qwen35moe")
    nextn = g("nextn_predict_layers", required=False, default=0)
    nkv = _pos(m, a + "attention.head_count_kv", g("attention.head_count_kv", required=False, default=nh), 1, nh)
    hd = _pos(m, a + "attention.key_length", g("attention.key_length", required=False, default=H // nh))
    if g("attention.value_length", required=False, default=hd) != hd:
        raise invalid_model(m.path, a + "attention.value_length", "differs from key_length; Colibri's attention "
                            "needs them equal")
    rot = _pos(m, a + "rope.dimension_count", g("rope.dimension_count", required=False, default=hd), 2, hd)
    E = _pos(m, a + "expert_count", g("expert_count"), 1, validate.MAX_EXPERTS)
    rec = g("attention.recurrent_layers", list, required=False)
    if rec is None:
        step = _pos(m, a + "full_attention_interval", g("full_attention_interval", required=False, default=4), 1, L)
        rec = [bool((i + 1) % step) for i in range(L)]
    if len(rec) < L or not all(isinstance(x, (bool, np.bool_)) for x in rec):
        raise invalid_model(m.path, a + "attention.recurrent_layers", f"expected {L} (+ {nextn}) booleans")
    Hk = _pos(m, a + "ssm.group_count", g("ssm.group_count"), 1, validate.MAX_HEADS)
    Hv = _pos(m, a + "ssm.time_step_rank", g("ssm.time_step_rank"), 1, validate.MAX_HEADS)
    inner = _pos(m, a + "ssm.inner_size", g("ssm.inner_size"))
    if inner % Hv or Hv % Hk:
        raise invalid_model(m.path, a + "ssm.inner_size", f"{inner} over {Hv} value heads of {Hk} key heads")
    eps = g("attention.layer_norm_rms_epsilon", float)
    if not 0 < eps < 1:
        raise invalid_model(m.path, a + "attention.layer_norm_rms_epsilon", f"{eps} is not in (0, 1)")
    scaling = g("rope.scaling.type", str, required=False, default="none")
    if scaling not in ("none", "") and g("rope.scaling.factor", float, required=False, default=1.0) != 1.0:
        raise invalid_model(m.path, a + "rope.scaling.type", f"rope scaling {scaling!r} is not implemented")
    if g("expert_weights_scale", float, required=False, default=1.0) != 1.0:
        raise invalid_model(m.path, a + "expert_weights_scale", "scaled expert weights are not implemented")
    if "token_embd.weight" not in m.tensors:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    V = int(m.tensor("token_embd.weight").shape[1])
    return {"model_type": "qwen3_5_moe_text", "architectures": [], "num_hidden_layers": L, "hidden_size": H,
            "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": V,
            "max_position_embeddings": _pos(m, a + "context_length", g("context_length", required=False,
                                                                          default=4096), 1, validate.MAX_POSITIONS),
            "rms_norm_eps": eps, "tie_word_embeddings": "output.weight" not in m.tensors,
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": rot / hd,
                                "rope_theta": g("rope.freq_base", float, required=False, default=10_000_000.0)},
            "layer_types": ["linear_attention" if x else "full_attention" for x in rec[:L]],
            "num_experts": E, "num_experts_per_tok": _pos(m, a + "expert_used_count", g("expert_used_count"), 1, E),
            "moe_intermediate_size": _pos(m, a + "expert_feed_forward_length", g("expert_feed_forward_length")),
            "shared_expert_intermediate_size": _pos(m, a + "expert_shared_feed_forward_length",
                                                    g("expert_shared_feed_forward_length", required=False,
                                                      default=0), 0),
            "linear_conv_kernel_dim": _pos(m, a + "ssm.conv_kernel", g("ssm.conv_kernel"), 2, validate.MAX_CONV_KERNEL),
            "linear_key_head_dim": _pos(m, a + "ssm.state_size", g("ssm.state_size")),
            "linear_value_head_dim": inner // Hv, "linear_num_key_heads": Hk, "linear_num_value_heads": Hv,
            "linear_value_head_order": "tiled" if Hk != Hv else "grouped"}


def _gemma4_config(m: GGUFModel) -> dict:
    """llama.cpp's gemma4 metadata -> a gemma4_text config (convert._gemma4_config's input): per-layer
    KV heads (an array), sliding-layer and full-layer head dims (key_length_swa / key_length), the
    window pattern, both rope bases, the full layers' proportional rope from rope_freqs (1 where a
    frequency rotates, 1e30 where llama.cpp stops it), soft-capping, per-layer embeddings and shared
    KV layers (refused by name in translation when present)."""
    a = "gemma4."
    g = lambda k, kind=int, **kw: m.get(a + k, kind, **kw)            # noqa: E731
    L = _pos(m, a + "block_count", g("block_count"), 1, validate.MAX_LAYERS)
    H = _pos(m, a + "embedding_length", g("embedding_length"))
    nh = _pos(m, a + "attention.head_count", g("attention.head_count"), 1, validate.MAX_HEADS)
    kv = g("attention.head_count_kv", list)
    kv = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * L
    swa = g("attention.sliding_window_pattern", list, required=False, default=[False] * L)
    if len(kv) != L or len(swa) != L:
        raise invalid_model(m.path, a + "attention.head_count_kv", f"{len(kv)} / {len(swa)} entries for {L} layers")
    hd_full = _pos(m, a + "attention.key_length", g("attention.key_length"))
    hd_swa = _pos(m, a + "attention.key_length_swa", g("attention.key_length_swa", required=False, default=hd_full))
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
    E = _pos(m, a + "expert_count", g("expert_count", required=False, default=0), 0, validate.MAX_EXPERTS)
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
    ctx = _pos(m, a + "context_length", g("context_length", required=False, default=131072), 1, validate.MAX_POSITIONS)
    eps = g("attention.layer_norm_rms_epsilon", float)
    V = int(m.tensor("token_embd.weight").shape[1]) if "token_embd.weight" in m.tensors else None
    if V is None:
        raise invalid_model(m.path, "token_embd.weight", "missing tensor")
    full = [i for i in range(L) if not swa[i]]
    k_eq_v = all(f"blk.{i}.attn_v.weight" not in m.tensors for i in full)
    cap = g("final_logit_softcapping", float, required=False)
    return {
        "model_type": "gemma4_text", "architectures": [], "num_hidden_layers": L, "hidden_size": H,
        "intermediate_size": _pos(m, a + "feed_forward_length", g("feed_forward_length")),
        "moe_intermediate_size": _pos(m, a + "expert_feed_forward_length", g("expert_feed_forward_length")),
        "num_attention_heads": nh, "num_key_value_heads": sw_kv.pop() if sw_kv else full_kv.copy().pop(),
        "head_dim": hd_swa, "vocab_size": V, "max_position_embeddings": ctx, "rms_norm_eps": eps,
        "tie_word_embeddings": "output.weight" not in m.tensors, "enable_moe_block": True, "num_experts": E,
        "top_k_experts": _pos(m, a + "expert_used_count", g("expert_used_count"), 1, E),
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
# tensors

def gguf_names(cfg: dict) -> dict:
    """Our tensor name -> GGUF tensor name (non-expert tensors)."""
    m = {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
    for layer in cfg["layers"]:
        i = layer["layer_id"]
        p, b = f"layers.{i}.", f"blk.{i}."
        m[p + "input_norm"] = b + "attn_norm.weight"
        m[p + "post_attention_norm"] = b + "ffn_norm.weight"
        for x, g in zip("qkvo", ("attn_q", "attn_k", "attn_v", "attn_output")):
            m[p + f"attn.w{x}"] = b + g + ".weight"
            m[p + f"attn.b{x}"] = b + g + ".bias"
        m[p + "attn.q_norm"] = b + "attn_q_norm.weight"
        m[p + "attn.k_norm"] = b + "attn_k_norm.weight"
        m[p + "router"] = b + "ffn_gate_inp.weight"
        m[p + "router_choice_bias"] = b + "exp_probs_b.bias"
        for x in ("gate", "up", "down"):
            m[p + f"mlp.{x}"] = b + f"ffn_{x}.weight"
            m[p + f"shared.{x}"] = b + f"ffn_{x}_shexp.weight"
        m[p + "shared.gate_logit"] = b + "ffn_gate_inp_shexp.weight"
        if cfg["model_type"] == "gemma4_text":
            m.update({p + "attn.out_norm": b + "post_attention_norm.weight", p + "mlp.out_norm": b + "post_ffw_norm_1.weight",
                      p + "ffn_out_norm": b + "post_ffw_norm.weight", p + "experts_norm": b + "pre_ffw_norm_2.weight",
                      p + "experts_out_norm": b + "post_ffw_norm_2.weight", p + "router_norm": b + "ffn_gate_inp.scale",
                      p + "expert_scale": b + "ffn_down_exps.scale", p + "scalar": b + "layer_output_scale.weight"})
        if cfg.get("latent_attention"):
            m.update({p + "mla.wq_a": b + "attn_q_a.weight", p + "mla.q_a_norm": b + "attn_q_a_norm.weight",
                      p + "mla.kv_a_norm": b + "attn_kv_a_norm.weight", p + "mla.wk_b": b + "attn_k_b.weight",
                      p + "mla.wv_b": b + "attn_v_b.weight"})
            q = b + ("attn_q_b.weight" if cfg["latent_attention"]["q_lora_rank"] else "attn_q.weight")
            m[p + "mla.wq"] = m[p + "mla.wq_rope"] = q
            m[p + "mla.wkv_a"] = m[p + "mla.wk_rope"] = b + "attn_kv_a_mqa.weight"
        if cfg.get("linear_attention"):
            m[p + "post_attention_norm"] = b + "post_attention_norm.weight"
            m.update({p + "lin.wqkv": b + "attn_qkv.weight", p + "lin.wz": b + "attn_gate.weight",
                      p + "lin.wa": b + "ssm_alpha.weight", p + "lin.wb": b + "ssm_beta.weight",
                      p + "lin.a_neg": b + "ssm_a", p + "lin.dt_bias": b + "ssm_dt.bias",
                      p + "lin.conv": b + "ssm_conv1d.weight", p + "lin.norm": b + "ssm_norm.weight",
                      p + "lin.wo": b + "ssm_out.weight", p + "attn.wq_gate": b + "attn_q.weight"})
        if cfg["model_type"] == "gpt_oss":
            m[p + "post_attention_norm"] = b + "post_attention_norm.weight"
            m[p + "attn.sinks"] = b + "attn_sinks.weight"
            m[p + "router_bias"] = b + "ffn_gate_inp.bias"
            for x in ("gate", "up", "down"):
                m[p + f"experts.{x}_bias"] = b + f"ffn_{x}_exps.bias"
    return m


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf LlamaModel.permute): inside each head of
    d rows, GGUF row 2 i + p holds Hugging Face row p d/2 + i. Works on any row content (float rows,
    rows of blocks, bias entries)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class _Tensors:
    """Reads GGUF tensors as our layout wants them: format, logical shape, stored data (a view)."""

    def __init__(self, m: GGUFModel):
        self.m = m
        self.used = set()

    def fmt(self, name):
        t = self.m.tensor(name)
        f = FORMATS.get(t.tensor_type.name)
        if f is None:
            raise invalid_model(self.m.tensors[name][1], name,
                                f"type {t.tensor_type.name} is not one Colibri runs ({', '.join(FORMATS)}); "
                                "re-quantise the model to one of them (llama-quantize ... Q4_K_M)")
        return f

    def shape(self, name):
        return tuple(int(d) for d in reversed(self.m.tensor(name).shape.tolist()))

    def stored(self, name, want_shape, float32=False):
        """(data, format) of a tensor checked against the shape the metadata implies: data in its
        storage dtype (block formats: uint8 [..., row_bytes]), or float32 when asked (lossless for
        float formats; a quantised vector is decoded)."""
        where = self.m.tensors[name][1]
        t, fmt, shape = self.m.tensor(name), self.fmt(name), self.shape(name)
        if len(want_shape) == 2 and want_shape[0] == 1 and shape == tuple(want_shape[1:]):
            shape = tuple(want_shape)                            # a [1, H] gate stored 1-D
        if len(want_shape) == 1 and shape == (1, *want_shape):
            shape = tuple(want_shape)                            # an [E] bias stored [1, E] (exp_probs_b)
        if shape != tuple(want_shape):
            raise invalid_model(where, name, f"shape {list(shape)}, but the metadata implies {list(want_shape)}")
        self.used.add(name)
        data = np.asarray(t.data)
        if fmt == "bfloat16":
            data = data.view(np.uint16)
        data = data.reshape(storage_shape(fmt, shape))
        if float32 and fmt != "float32":
            data = np.asarray(widen(data, fmt), np.float32)
            fmt = "float32"
        return data, fmt


def latent_rows(tz: _Tensors, cfg: dict, what: str, name: str, shape):
    """(data, format) of a latent-attention tensor (modeldir.latent_tensors) from llama.cpp's: the q rows
    [nope | rope] of each head split, attn_kv_a_mqa's [latent | rope key] rows split, the rotated rows
    un-permuted from adjacent pairs (rows are whole blocks: bytes move, nothing is requantised);
    attn_k_b [Hq, r, dn] / attn_v_b [Hq, dv, r] (or an older file's attn_kv_b [Hq*(dn+dv), r], cut
    here) widened to float32 when not a float format (the per-head matrices run in float, head_matmul)."""
    la, nh = cfg["latent_attention"], cfg["num_attention_heads"]
    r, rq, dn, dr, dv = (la[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim"))
    part = what.split(".", 2)[-1]
    if part in ("mla.wq", "mla.wq_rope"):
        data, fmt = tz.stored(name, (nh * (dn + dr), rq or cfg["hidden_size"]))
        heads = data.reshape(nh, dn + dr, *data.shape[1:])
        if part == "mla.wq":
            return heads[:, :dn].reshape(nh * dn, *data.shape[1:]).copy(), fmt
        return unpermute(heads[:, dn:].reshape(nh * dr, *data.shape[1:]).copy(), nh), fmt
    if part in ("mla.wkv_a", "mla.wk_rope"):
        data, fmt = tz.stored(name, (r + dr, cfg["hidden_size"]))
        return (data[:r].copy(), fmt) if part == "mla.wkv_a" else (unpermute(data[r:].copy(), 1), fmt)
    split = name not in tz.m.tensors            # an older file: attn_kv_b, not yet split
    src = name.replace("attn_k_b", "attn_kv_b").replace("attn_v_b", "attn_kv_b") if split else name
    if split and src not in tz.m.tensors:
        raise invalid_model(tz.m.path, name, "missing tensor (nor is attn_kv_b there)")
    fmt = tz.fmt(src)
    out = fmt if fmt in HEAD_TYPES else "float16"      # a quantised per-head matrix runs as float16
    if split:
        kv, _ = tz.stored(src, (nh * (dn + dv), r), float32=True)
        kv = kv.reshape(nh, dn + dv, r)
        data = kv[:, :dn].transpose(0, 2, 1) if part == "mla.wk_b" else kv[:, dn:]
    else:
        data, _ = tz.stored(name, shape, float32=True)
    return narrow(data, out), out


QWEN35_ROWS = ("attn.wq", "attn.wq_gate", "attn.wk", "attn.q_norm", "attn.k_norm")


def qwen35_rows(tz: _Tensors, cfg: dict, what: str, name: str, role):
    """(data, format) of a Qwen3.5 full-attention tensor from llama.cpp's: attn_q [Hq * 2D, H] holds each
    head's query rows then its output gate's (split here); the query and key rows (and the q/k norms) of
    each head reordered for partial rotary (convert.rope_dim_order: llama.cpp's rope rotates pairs
    (i, i + r/2) of the first r dims, ours the pairs (i, i + D/2)). Whole rows move: a quantised row is
    copied, never requantised. The norms are stored with the + 1 folded in (as ours)."""
    from .convert import rope_dim_order
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    order = rope_dim_order(D, cfg.get("rope_dim", D))
    part, (shape, r) = what.split(".", 2)[-1], role
    if part in ("attn.wq", "attn.wq_gate"):
        data, fmt = tz.stored(name, (nh * 2 * D, shape[1]))
        heads = data.reshape(nh, 2, D, *data.shape[1:])
        if part == "attn.wq_gate":
            return heads[:, 1].reshape(nh * D, *data.shape[1:]).copy(), fmt
        return heads[:, 0][:, order].reshape(nh * D, *data.shape[1:]).copy(), fmt
    if part == "attn.wk":
        data, fmt = tz.stored(name, shape)
        return data.reshape(nkv, D, *data.shape[1:])[:, order].reshape(data.shape).copy(), fmt
    data, fmt = tz.stored(name, shape, float32=True)          # q_norm / k_norm [D]
    return data[order].copy(), fmt


def _expert_matrices(tz: _Tensors, layer: int, E: int, H: int, I: int):
    """-> ((gate, up, down) stacked data [E, ...], formats) of a layer's routed experts."""
    b = f"blk.{layer}."
    if b + "ffn_gate_up_exps.weight" in tz.m.tensors:          # fused [E, 2I, H]: gate rows first
        gu, fgu = tz.stored(b + "ffn_gate_up_exps.weight", (E, 2 * I, H))
        gate, up, fg, fu = gu[:, :I], gu[:, I:], fgu, fgu
    else:
        for part in ("gate", "up"):
            if b + f"ffn_{part}_exps.weight" not in tz.m.tensors:
                raise invalid_model(tz.m.path, b + f"ffn_{part}_exps.weight", "missing tensor (the layer's experts)")
        gate, fg = tz.stored(b + "ffn_gate_exps.weight", (E, I, H))
        up, fu = tz.stored(b + "ffn_up_exps.weight", (E, I, H))
    if b + "ffn_down_exps.weight" not in tz.m.tensors:
        raise invalid_model(tz.m.path, b + "ffn_down_exps.weight", "missing tensor (the layer's experts)")
    down, fd = tz.stored(b + "ffn_down_exps.weight", (E, H, I))
    if is_block(fg) != is_block(fu):
        raise invalid_model(tz.m.path, b + "ffn_up_exps.weight", f"gate {fg} and up {fu}: Colibri's fused gate/up "
                            "kernels need both in block formats or neither; re-quantise the file")
    return (gate, up, down), (fg, fu, fd)


# ----------------------------------------------------------------------------------------------
# tokenizer

def tokenizer(m: GGUFModel):
    """The embedded vocabulary as a transformers fast tokenizer, built as
    AutoTokenizer.from_pretrained(..., gguf_file=...) builds it: convert_gguf_tokenizer (torch-free;
    not get_gguf_tokenizer, whose reader imports torch) with the chat template, BOS handling
    (tokenizer.ggml.add_bos_token; on by default for a sentencepiece vocabulary, as llama.cpp) and
    the special tokens of the metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers import PreTrainedTokenizerFast
    groups = {}
    for group, renames in GGUF_TOKENIZER_MAPPING.items():
        groups[group] = {name: m.value("tokenizer." + key) for key, name in renames.items()
                         if "tokenizer." + key in m.fields}
    td, tc = groups["tokenizer"], groups["tokenizer_config"]
    tokens = td.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise invalid_model(m.path, "tokenizer.ggml.tokens", "missing: the file embeds no vocabulary")
    if td.get("tokenizer_type") == "llama":
        tc.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        i = m.get("tokenizer.ggml." + key, int, required=False)
        if i is not None:
            if not 0 <= i < len(tokens):
                raise invalid_model(m.path, "tokenizer.ggml." + key, f"{i} is not a token id (a vocabulary of "
                                    f"{len(tokens)})")
            tc[name] = tokens[i]
    try:
        backend, extra = convert_gguf_tokenizer(m.get("general.architecture", str), td)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tc, **extra)
    except ColibriError:
        raise
    except Exception as e:                  # the builders raise assorted errors on odd vocabularies
        raise invalid_model(m.path, "tokenizer.ggml.model", f"transformers cannot build a tokenizer from the "
                            f"embedded vocabulary ({type(e).__name__}: {e})") from None


def eog_ids(m: GGUFModel) -> list:
    """Every id llama.cpp ends generation at: the eos / eot / eom / fim ids of the metadata, and the
    tokens spelled as an end-of-turn marker (<|im_end|>, <|eot_id|>, <end_of_turn>, ...)."""
    tokens = m.get("tokenizer.ggml.tokens", list, required=False, default=[])
    out = []
    for key in EOG_KEYS:
        i = m.get("tokenizer.ggml." + key, int, required=False)
        if i is not None and 0 <= i < len(tokens) and i not in out:
            out.append(i)
    out += [i for i, t in enumerate(tokens) if t in EOG_TEXTS and i not in out]
    return out


# ----------------------------------------------------------------------------------------------
# the conversion

def convert_gguf(path: str, out_dir: str, progress: bool = True) -> dict:
    """Convert a GGUF file (or the first part of a split one); returns the config written."""
    from .convert import translate_config
    m = GGUFModel(path)
    hf, arch = hf_config(m)
    label = FILE_TYPES.get(m.get("general.file_type", int, required=False), "mixed")
    eos = eog_ids(m)
    gen = {"eos_token_id": eos, "bos_token_id": m.get("tokenizer.ggml.bos_token_id", int, required=False)}
    cfg = translate_config(hf, gen, m.path, label)
    cfg["architectures"] = []
    if cfg["model_type"] == "qwen2_moe" and cfg["shared_expert_intermediate_size"]:
        cfg["shared_expert_gate"] = "blk.0.ffn_gate_inp_shexp.weight" in m.tensors
    names = gguf_names(cfg)
    roles = tensor_roles(cfg)
    tz = _Tensors(m)
    for ours, (shape, role) in roles.items():               # everything present and well-shaped first
        g = names[ours]
        if g not in m.tensors:
            raise invalid_model(m.path, g, f"missing tensor (the metadata implies {ours} {list(shape)})")
    tok = tokenizer(m)
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["experts_per_layer"]
    moe = [l["layer_id"] for l in cfg["layers"] if l["type"] != "dense"]
    need = sum(int(t.n_bytes) + ALIGN for t, _ in m.tensors.values()) + len(moe) * E * ALIGN + (1 << 20)
    check_disk(out_dir, need)
    permuted = arch in INTERLEAVED
    heads = {"attn.wq": cfg["num_attention_heads"], "attn.bq": cfg["num_attention_heads"],
             "attn.wk": cfg["num_key_value_heads"], "attn.bk": cfg["num_key_value_heads"]}
    w = ModelWriter(out_dir, cfg)
    jobs = [("tensor", n) for n in roles] + [("experts", l) for l in moe]
    for kind, what in tqdm(jobs, desc="convert", unit="tensor", disable=not progress):
        if kind == "tensor" and what.split(".", 2)[-1].startswith("mla.") and roles[what][1] != "float32":
            data, fmt = latent_rows(tz, cfg, what, names[what], roles[what][0])
            w.add_tensor(what, data, fmt, shape=roles[what][0])
        elif kind == "tensor" and cfg.get("linear_attention") and what.split(".", 2)[-1] in QWEN35_ROWS:
            data, fmt = qwen35_rows(tz, cfg, what, names[what], roles[what])
            w.add_tensor(what, data, fmt, shape=roles[what][0])
        elif kind == "tensor":
            shape, role = roles[what]
            data, fmt = tz.stored(names[what], shape, float32=role == "float32")
            part = what.split(".", 2)[-1]
            if part == "router_norm":           # the router reads norm(x) * scale / sqrt(H) (Gemma 4)
                data = (data * np.float32(H ** -0.5)).astype(np.float32)
            if permuted and part in heads:
                data = unpermute(data, heads[part])
            w.add_tensor(what, data, fmt, shape=shape)
        else:
            mats, fmts = _expert_matrices(tz, what, E, H, I)
            for j in range(E):
                w.add_expert(what, j, *(x[j] for x in mats), fmts, hidden=H, inter=I)
    if arch == "gemma4":
        tz.used.add("rope_freqs.weight")        # read into the full layers' rope (hf_config)
    nextn = m.get(arch + ".nextn_predict_layers", int, required=False, default=0) \
        if arch in ("deepseek2", "qwen35moe") else 0
    if nextn:                                   # the appended multi-token-prediction layers: not run
        L = cfg["num_hidden_layers"]
        mtp = [n for n in m.tensors if re.match(rf"blk\.({'|'.join(str(L + j) for j in range(nextn))})\.", n)]
        tz.used.update(mtp)
        if progress:
            print(f"convert: {len(mtp)} tensors of {nextn} multi-token-prediction layer(s) skipped "
                  "(speculative-decoding heads; the model runs without them)", file=sys.stderr)
    leftover = sorted(set(m.tensors) - tz.used)
    if leftover:
        w.finish()
        raise invalid_model(m.tensors[leftover[0]][1], leftover[0],
                            f"{len(leftover)} tensor(s) Colibri's plan for this {arch} model has no place for "
                            f"(e.g. {leftover[:3]}); their feature is not implemented")
    tok.save_pretrained(out_dir)            # tokenizer.json, tokenizer_config.json, chat_template.jinja
    w.finish({"generation_config.json": {"eos_token_id": cfg["eos_token_ids"], "bos_token_id": cfg["bos_token_id"]}})
    return w.config
