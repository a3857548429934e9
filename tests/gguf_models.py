"""GGUF test fixtures made by llama.cpp's own converter, and a transformers oracle for GGUF files.

- `build(case, dir)`: a tiny random Hugging Face MoE checkpoint (safetensors, float32) with a tiny
  byte-level BPE tokenizer (special tokens, ChatML chat template, several end-of-generation ids).
- `to_gguf(hf_dir, out)`: llama.cpp's convert_hf_to_gguf.py on it (tests/llamacpp_convert.py, a subprocess).
- `requantize(src, dst, type_of)`: re-encode a GGUF's tensors (gguf-py's quantisers for the 32-blocks,
  colibri_edge.model.quant's for Q4_K/Q5_K/Q6_K, which gguf-py cannot write), copying every metadata field.
- `oracle_checkpoint(gguf, hf_dir, out)`: the GGUF's tensors dequantised and mapped back to the original
  checkpoint's Hugging Face names (llama q/k unpermuted, experts unstacked), saved as a float32
  checkpoint transformers runs: the reference logits *of the GGUF file itself*, quantisation included.
- `gguf_case(case, outtype)`: built once per process and cached; `gguf_cases` is the same as a
  session-scoped pytest fixture (import it into a test module to use it).

The venv's gguf (0.19) is imported here; llama.cpp's vendored gguf-py only ever runs in the
converter subprocess.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import pathlib
import re
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

import llamacpp_convert

# ------------------------------------------------------------------------------------------------
# tokenizer

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")
BOS, EOS, PAD = "<s>", "</s>", "<|endoftext|>"
EOG_TOKENS = ("</s>", "<|im_end|>", "<|eot_id|>")       # generation_config.json's eos_token_id list
TOKENIZER_VOCAB = 320                                   # 6 special + 256 bytes + 58 merges
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = (
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "the quick brown fox jumps over the lazy dog; the dog sleeps.",
    "mixture of experts models route every token to the top experts.",
    "a router picks two experts out of four, then the outputs are mixed.",
    "user: what is the capital of france? assistant: the capital of france is paris.",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = ( ) [ ] { } < >",
    "def main():\n    return print('hello, world')\n",
    "Caf\u00e9 na\u00efve \u00fcber \u4e2d\u6587 \U0001f600 tokens in utf-8 bytes",
)


def build_tokenizer(out_dir):
    """Train the tiny byte-level BPE (deterministic) and save it as a PreTrainedTokenizerFast with a
    ChatML chat template (chat_template.jinja). Returns the PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)        # = llama.cpp pre "gpt-2"
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(CORPUS) * 8, trainer)
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                 additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, EOS, PAD)])
    ft.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    ft.save_pretrained(out_dir)
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if not os.path.exists(jinja):
        with open(jinja, "w", encoding="utf-8") as f:
            f.write(CHAT_TEMPLATE)
    return ft


# ------------------------------------------------------------------------------------------------
# models

_COMMON = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5)
_MOE1 = dict(decoder_sparse_step=1, mlp_only_layers=[])     # llama.cpp: every layer is MoE
_K = dict(hidden_size=256)                                  # K-quant sized: every row length % 256 == 0

# name -> (model_type, config overrides). Routing normalisation matches what llama.cpp hard-codes per
# arch (norm_topk: llama/Mixtral and qwen3moe yes, qwen2moe and olmoe no: it is not in the GGUF).
CASES = {
    "mixtral": ("mixtral", dict(_COMMON, hidden_size=64, intermediate_size=96, head_dim=24, num_local_experts=4,
                                num_experts_per_tok=2, rope_theta=10000.0)),
    "qwen2_moe": ("qwen2_moe", dict(_COMMON, **_MOE1, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                    norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(_COMMON, **_MOE1, hidden_size=48, intermediate_size=96, moe_intermediate_size=32,
                                    head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("olmoe", dict(_COMMON, hidden_size=64, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=False)),
    # K-quant sized (hidden and every expert / shared / dense row a multiple of 256)
    "mixtral_k": ("mixtral", dict(_COMMON, **_K, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_k": ("qwen2_moe", dict(_COMMON, **_MOE1, **_K, intermediate_size=256, moe_intermediate_size=256,
                                      shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=False)),
    "qwen3_moe_k": ("qwen3_moe", dict(_COMMON, **_MOE1, **_K, num_key_value_heads=1, head_dim=128,
                                      intermediate_size=256, moe_intermediate_size=256, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe_k": ("olmoe", dict(_COMMON, **_K, intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=False)),
    # exactly 8 experts: llama.cpp's Q4_K_M rule special-cases n_expert == 8 (attn_v/attn_k -> Q8_0 ...)
    "mixtral8_k": ("mixtral", dict(_COMMON, **_K, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)),
    # ERNIE-4.5: a dense first layer (leading_dense_block_count), two shared experts (their width from the
    # tensors: the converter's expert_shared_feed_forward_length is intermediate_size / kv heads), a
    # choice-only correction bias (exp_probs_b), interleaved rope (llama.cpp keeps HF's q/k rows)
    "ernie4_5_moe": ("ernie4_5_moe", dict(_COMMON, num_hidden_layers=3, hidden_size=64, intermediate_size=96,
                                          moe_intermediate_size=32, moe_num_experts=4, moe_k=2,
                                          moe_num_shared_experts=2, moe_layer_start_index=1)),
}
# Families with their own GGUF tests (test_families.py), kept out of CASES (whose fixture tests map a
# file back to a checkpoint generically). gpt-oss: MXFP4 experts as OpenAI ships them
# (hf_models.pack_mxfp4), llama.cpp's converter repacks them; YaRN; even layers sliding (llama.cpp's
# pattern for the arch); llama.cpp's fixed alpha / limit
FAMILY_CASES = {
    "gpt_oss": ("gpt_oss", dict(_COMMON, num_key_value_heads=1, hidden_size=64, intermediate_size=64, head_dim=16,
                                num_local_experts=3, num_experts_per_tok=2, sliding_window=5,
                                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0,
                                                     beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                     original_max_position_embeddings=32))),
}
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "ernie4_5_moe")
K_CASES = ("mixtral_k", "qwen2_moe_k", "qwen3_moe_k", "olmoe_k", "mixtral8_k")
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
             "ernie4_5_moe": "ernie4_5-moe"}


def config_for(case: str, vocab_size: int, **overrides):
    import transformers
    model_type, kw = {**CASES, **FAMILY_CASES}[case]
    cls = {"mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "olmoe": transformers.OlmoeConfig,
           "ernie4_5_moe": transformers.Ernie4_5_MoeConfig, "gpt_oss": transformers.GptOssConfig}[model_type]
    return cls(**{**kw, "vocab_size": vocab_size, "tie_word_embeddings": False, **overrides})


def build(case: str, out_dir, seed: int = 0, **overrides):
    """Save tokenizer + random float32 model of `case` to out_dir (save_pretrained, safetensors);
    weights scaled so logits are O(1). Returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    out_dir = str(out_dir)
    ft = build_tokenizer(out_dir)
    ids = {t: ft.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    cfg = config_for(case, len(ft), bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD],
                     **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    from hf_models import randomize
    randomize(model, cfg)
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], pad_token_id=ids[PAD],
                                               eos_token_id=[ids[t] for t in EOG_TOKENS])
    model.save_pretrained(out_dir)
    return out_dir


def hf_logits(model_dir, ids) -> np.ndarray:
    from hf_models import hf_logits as _hf_logits
    return _hf_logits(str(model_dir), ids)


def to_gguf(hf_dir, out_path, outtype: str = "f32", pre: str = "gpt-2"):
    """llama.cpp's convert_hf_to_gguf.py (f32, f16, bf16 or q8_0); returns out_path."""
    return llamacpp_convert.convert(hf_dir, out_path, outtype=outtype, pre=pre)


def build_spm_tokenizer(out_dir, vocab_size: int = 330):
    """A SentencePiece-style BPE (byte fallback, '▁' for spaces, <0xNN> byte tokens, Gemma's special
    tokens) as llama.cpp's LlamaHfVocab reads it (Gemma 4's converter). Returns the fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)],
                                  show_progress=False)
    tok.train_from_iterator([c.replace(" ", "\u2581") for c in CORPUS] * 8, trainer)
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                 unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    os.makedirs(out_dir, exist_ok=True)
    ft.save_pretrained(out_dir)
    return ft


# ------------------------------------------------------------------------------------------------
# requantize

SKIP_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")    # the writer derives these
K_FORMATS = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q2_K": "q2_k", "Q3_K": "q3_k", "IQ4_NL": "iq4_nl",
             "IQ4_XS": "iq4_xs", "NVFP4": "nvfp4"}             # ours (gguf-py cannot quantise them)
# an unsloth-style "dynamic" file: each matrix its own type, from these (ud_mix_rule)
UD_MIX = ("Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "TQ2_0", "TQ1_0", "NVFP4", "Q4_K", "Q6_K")
# the lattice i-quants (llama.cpp quantises them only with an importance matrix): random valid blocks
# scaled to the matrix's RMS (random_iq_blocks), each matrix one of these in turn ("iq_mix"; "iq_mix_pairs":
# an FFN's gate and up together, as the GPU backends' fused gate/up kernels take them)
IQ_MIX = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
# llama.cpp's fallback when a row is not a multiple of 256 (llama-quant.cpp), then F16 if not of 32
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_1"}


def _field_value(field):
    """(value, type, sub_type) of a GGUFReader field, strings as raw bytes (copied byte-exact)."""
    import gguf
    T = gguf.GGUFValueType
    main = field.types[0]
    if main == T.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:
            raise NotImplementedError(f"nested array field {field.name!r}")
        if sub == T.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return [field.parts[i].tolist()[0] for i in field.data], main, sub
    if main == T.STRING:
        return bytes(field.parts[field.data[0]]), main, None
    return field.parts[field.data[0]].tolist()[0], main, None


def quant_rule(qtype, fallback: bool = True):
    """A type_of for requantize: every matrix weight (token_embd, output, attention, experts, shared
    experts) to `qtype` (a GGMLQuantizationType or its name, e.g. "Q4_K"); norms, biases and routers
    (ffn_gate_inp, ffn_gate_inp_shexp) kept, as llama.cpp does. With fallback, a row length the block
    does not divide gets llama.cpp's fallback type (Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0, then F16)."""
    import gguf
    Q = gguf.GGMLQuantizationType
    qtype = Q[qtype.upper()] if isinstance(qtype, str) else Q(qtype)

    def type_of(name, shape):
        if len(shape) < 2 or not name.endswith(".weight") or "norm" in name or ".ffn_gate_inp" in name:
            return None
        t = qtype
        block = gguf.GGML_QUANT_SIZES[t][0]
        if shape[-1] % block:
            if not fallback:
                raise ValueError(f"{name}: row of {shape[-1]} is not a multiple of {t.name}'s block {block}")
            t = Q[K_FALLBACK.get(t.name, "F16")]
            if shape[-1] % gguf.GGML_QUANT_SIZES[t][0]:
                t = Q.F16
        return t
    return type_of


def random_iq_blocks(x: np.ndarray, qtype) -> np.ndarray:
    """Random valid blocks of a lattice i-quant for a matrix shaped like x (uint8 [..., row_bytes]), the
    f16 scale set so that their RMS is x's: every grid index and sign pattern is as likely, and the
    file stays a plausible model (its oracle dequantises these bytes, whatever they hold)."""
    import zlib
    import gguf
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}{x.shape}".encode()))
    raw = rng.integers(0, 256, (*x.shape[:-1], x.shape[-1] // block, nbytes), dtype=np.uint8)

    def set_d(d):
        bits = np.frombuffer(np.float16(d).tobytes(), np.uint16)[0]
        if qtype.name == "IQ1_M":                  # d's four nibbles atop the four 16-bit scales
            for j, at in enumerate((49, 51, 53, 55)):
                raw[..., at] = (raw[..., at] & 15) | (((int(bits) >> (4 * j)) & 15) << 4)
        else:
            raw[..., 0:2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    set_d(1.0)
    w = gguf.quants.dequantize(raw.reshape(-1, nbytes), qtype)
    set_d(float(np.sqrt((x.astype(np.float64) ** 2).mean() / max((w.astype(np.float64) ** 2).mean(), 1e-30))))
    return raw.reshape(*x.shape[:-1], -1)


_GATE_UP = re.compile(r"\.ffn_(gate|up)(_exps|_shexp)?\.weight$")


def mix_rule(types, pair_gate_up: bool = False):
    """A type_of for requantize: the matrix weights, in file order, through `types` in turn (so gate,
    up and down of one layer differ, and every type appears in a file of that many matrices or more),
    as unsloth's dynamic files mix types per matrix; quant_rule's fallback where a row does not fit.
    pair_gate_up: an FFN's gate and up (experts', shared expert's, dense) take one turn, so they share
    a type (the backends whose fused gate/up kernel reads one format run such a file)."""
    rules = [quant_rule(t) for t in types]
    seen = {}

    def type_of(name, shape):
        if rules[0](name, shape) is None:       # norms, biases, routers: kept
            return None
        i = seen.setdefault(_GATE_UP.sub(r".ffn_gate_up\2.weight", name) if pair_gate_up else name, len(seen))
        return rules[i % len(rules)](name, shape)
    return type_of


def ud_mix_rule():
    return mix_rule(UD_MIX)


def _encode(x: np.ndarray, qtype):
    """float32 numpy-shaped x -> (array for GGUFWriter.add_tensor, raw_dtype)."""
    import gguf
    from gguf import quants
    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return np.ascontiguousarray(x, np.float32), None
    if qtype == Q.F16:
        return np.ascontiguousarray(x.astype(np.float16)), None
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if x.shape[-1] % block:
        raise ValueError(f"row of {x.shape[-1]} is not a multiple of {qtype.name}'s block of {block}")
    if qtype.name in IQ_MIX:
        q = random_iq_blocks(x, qtype)
    elif qtype.name in K_FORMATS:
        from colibri_edge.model.quant import quantize as colibri_quantize
        q = colibri_quantize(x.reshape(-1, x.shape[-1]), K_FORMATS[qtype.name])
    else:
        q = quants.quantize(x, qtype)
    q = np.ascontiguousarray(q, np.uint8).reshape(*x.shape[:-1], x.shape[-1] // block * nbytes)
    return q, qtype


def dequantize_tensor(t) -> np.ndarray:
    """A GGUFReader tensor as float32, numpy order (reversed ggml ne)."""
    from gguf import quants
    shape = tuple(int(n) for n in reversed(t.shape))
    return np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def requantize(src_gguf, dst_gguf, type_of, file_type: int | None = None):
    """Copy src_gguf to dst_gguf with every tensor re-encoded to type_of(name, numpy_shape) (None: kept
    byte-for-byte). Every metadata field is copied (same keys, order, types, values). Q4_K/Q5_K/Q6_K
    come from colibri_edge.model.quant, other types from gguf.quants. file_type, if given, sets
    general.file_type (a gguf.LlamaFileType). Returns dst_gguf, checked to re-read."""
    import gguf
    T = gguf.GGUFValueType
    dst_gguf = pathlib.Path(dst_gguf)
    part = dst_gguf.with_name(dst_gguf.name + ".part")       # renamed into place once it re-reads
    r = gguf.GGUFReader(str(src_gguf))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(part), arch)
    w.kv_data[0].clear()                            # the constructor's general.architecture: copied below, in order
    keys = []
    for key, field in r.fields.items():
        if key in SKIP_KEYS:
            continue
        val, vtype, sub = _field_value(field)
        if key == gguf.Keys.General.ALIGNMENT:
            w.data_alignment = int(val)
        if key == gguf.Keys.General.FILE_TYPE and file_type is not None:
            val = int(file_type)
        w.add_key_value(key, val, vtype, sub_type=sub)
        keys.append(key)
    if file_type is not None and gguf.Keys.General.FILE_TYPE not in keys:
        w.add_key_value(gguf.Keys.General.FILE_TYPE, int(file_type), T.UINT32)
        keys.append(gguf.Keys.General.FILE_TYPE)

    expect = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        new = type_of(t.name, shape)
        if new is None or new == t.tensor_type:
            data, raw = t.data, t.tensor_type
            if data.dtype in (np.float32, np.float16) and raw in (gguf.GGMLQuantizationType.F32,
                                                                 gguf.GGMLQuantizationType.F16):
                raw = None
            w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=raw)
            expect[t.name] = (t.tensor_type, shape)
        else:
            data, raw = _encode(dequantize_tensor(t), gguf.GGMLQuantizationType(new))
            w.add_tensor(t.name, data, raw_dtype=raw)
            expect[t.name] = (gguf.GGMLQuantizationType(new), shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    back = gguf.GGUFReader(str(part))                # must re-read, with the same fields and tensors
    got_keys = [k for k in back.fields if k not in SKIP_KEYS]
    got = {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in back.tensors}
    del back
    if got_keys != keys:
        raise AssertionError(f"requantize: fields {got_keys} != {keys}")
    if got != expect:
        bad = {k: (got.get(k), v) for k, v in expect.items() if got.get(k) != v}
        raise AssertionError(f"requantize: tensors differ after re-reading: {bad}")
    os.replace(part, dst_gguf)
    return dst_gguf


# ------------------------------------------------------------------------------------------------
# the oracle: GGUF -> Hugging Face checkpoint

def safetensors_names(hf_dir) -> dict:
    """{name: shape} of a checkpoint's safetensors files (read from the headers, no torch)."""
    hf_dir = pathlib.Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else sorted(p.name for p in hf_dir.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors in {hf_dir}")
    out = {}
    for fn in files:
        with open(hf_dir / fn, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = tuple(v["shape"])
    return out


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's LlamaModel.permute (rows of q or k, weight or bias)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# names the venv's gguf-py (0.19) does not map but llama.cpp's converter writes (its own renames)
_EXTRA = {re.compile(r"^model\.layers\.(\d+)\.mlp\.moe_statics\.e_score_correction_bias$"): "blk.{}.exp_probs_b.bias"}


def gguf_name_map(arch: str, hf_names, n_blocks: int) -> dict:
    """{gguf_tensor_name: [(expert or None, hf_name), ...]} for the HF names (per-expert on disk),
    using gguf-py's TensorNameMap; raises if an HF name has no GGUF counterpart."""
    import gguf
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        raise ValueError(f"unknown GGUF architecture {arch!r}")
    tmap = gguf.get_tensor_name_map(archs[arch], n_blocks)
    out, missing = {}, []
    for hf in hf_names:
        m = _EXPERT.search(hf)
        expert, base = (int(m.group(1)), _EXPERT.sub(".experts.", hf, count=1)) if m else (None, hf)
        g = tmap.get_name(base, try_suffixes=(".weight", ".bias"))
        for pat, name in _EXTRA.items():
            if g is None and pat.match(hf):
                g = name.format(pat.match(hf).group(1))
        if g is None:
            missing.append(hf)
            continue
        out.setdefault(g, []).append((expert, hf))
    if missing:
        raise KeyError(f"HF tensors with no GGUF name for arch {arch}: {missing}")
    return out


def _meta(r, key, default=None):
    f = r.fields.get(key)
    return f.contents() if f is not None else default


def oracle_tensors(gguf_path, hf_dir) -> dict:
    """{hf_name: float32 array} from the GGUF, in the original checkpoint's names and shapes."""
    import gguf
    r = gguf.GGUFReader(str(gguf_path))
    arch = _meta(r, "general.architecture")
    cfg = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
    hf_shapes = safetensors_names(hf_dir)
    n_blocks = int(_meta(r, f"{arch}.block_count", cfg.get("num_hidden_layers")))
    nmap = gguf_name_map(arch, hf_shapes, n_blocks)
    n_head = int(_meta(r, f"{arch}.attention.head_count", cfg.get("num_attention_heads")))
    n_kv = int(_meta(r, f"{arch}.attention.head_count_kv", cfg.get("num_key_value_heads") or n_head))
    permuted = arch == "llama"     # LlamaModel (Llama/Mistral/Mixtral) permutes q/k; qwen*moe/olmoe do not

    out, unmapped = {}, []
    for t in r.tensors:
        if t.name not in nmap:
            unmapped.append(t.name)
            continue
        x = dequantize_tensor(t)
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
        if permuted and kind in ("attn_q", "attn_k"):
            x = unpermute(x, n_head if kind == "attn_q" else n_kv)
        targets = nmap[t.name]
        experts = sorted(e for e, _ in targets if e is not None)
        if experts:
            if len(experts) != len(targets) or experts != list(range(x.shape[0])):
                raise AssertionError(f"{t.name} {x.shape}: HF experts {experts} do not cover the stack")
            for e, hf in targets:
                out[hf] = x[e]
        else:
            if len(targets) != 1:
                raise AssertionError(f"{t.name} maps to several HF tensors: {targets}")
            out[targets[0][1]] = x
    if unmapped:
        raise KeyError(f"GGUF tensors of {gguf_path} with no HF tensor in {hf_dir}: {unmapped}")
    unfilled = sorted(set(hf_shapes) - set(out))
    if unfilled:
        raise KeyError(f"HF tensors of {hf_dir} not filled from {gguf_path}: {unfilled}")
    for hf, shape in hf_shapes.items():
        x = out[hf]
        if x.shape != shape:       # only size-1 axes may differ (ffn_gate_inp_shexp is ne [H, 1])
            if x.size != math.prod(shape) or [n for n in x.shape if n != 1] != [n for n in shape if n != 1]:
                raise AssertionError(f"{hf}: GGUF gives {x.shape}, checkpoint has {shape}")
            out[hf] = x.reshape(shape)
    return out


def oracle_checkpoint(gguf_path, hf_dir, out_dir):
    """The GGUF's weights (dequantised to float32) as a Hugging Face checkpoint in out_dir, with
    hf_dir's config, generation config and tokenizer files: AutoModelForCausalLM.from_pretrained(out_dir)
    computes what the GGUF file encodes. Every GGUF tensor must map to an HF tensor and vice versa."""
    from safetensors.numpy import save_file
    tensors = oracle_tensors(gguf_path, hf_dir)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in pathlib.Path(hf_dir).iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy2(p, out_dir / p.name)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# ------------------------------------------------------------------------------------------------
# cached fixtures

CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")


@dataclass(frozen=True)
class GGUFCase:
    case: str
    outtype: str
    seed: int
    hf_dir: pathlib.Path        # the original checkpoint (tokenizer included)
    gguf: pathlib.Path          # the GGUF file

    def oracle(self) -> pathlib.Path:
        """The oracle checkpoint of this GGUF (built once)."""
        return _cached(("oracle", self.case, self.outtype, self.seed),
                       lambda d: oracle_checkpoint(self.gguf, self.hf_dir, d))


_lock = threading.RLock()
_cache: dict = {}
_base: list = []


def set_base_dir(path) -> None:
    """Where gguf_case builds (default: a temporary directory removed at exit)."""
    with _lock:
        _base[:] = [pathlib.Path(path)]


def _base_dir() -> pathlib.Path:
    with _lock:
        if not _base:
            d = pathlib.Path(tempfile.mkdtemp(prefix="colibri-gguf-"))
            atexit.register(shutil.rmtree, d, True)
            _base.append(d)
        return _base[0]


def _key_dir(key) -> pathlib.Path:
    return _base_dir() / "-".join(str(k) for k in key)


def _cached(key, make):
    with _lock:
        if key not in _cache:
            d = _key_dir(key)
            if d.exists():
                shutil.rmtree(d)
            _cache[key] = make(d)
        return _cache[key]


def hf_case(case: str, seed: int = 0) -> pathlib.Path:
    """The original checkpoint of `case` (built once per process)."""
    return _cached(("hf", case, seed), lambda d: pathlib.Path(build(case, d, seed=seed)))


def _gguf_file(case, outtype, seed) -> pathlib.Path:
    return _key_dir(("gguf", case, outtype, seed)) / f"{case}-{outtype}.gguf"


def gguf_case(case: str, outtype: str = "f32", seed: int = 0) -> GGUFCase:
    """`case` as a GGUF, built once per process. outtype: one of the converter's own (f32, f16, bf16,
    q8_0), or any other GGMLQuantizationType name (q4_k, q5_k, q6_k, q4_0, q5_1, mxfp4, ...): the f32
    conversion re-encoded by requantize(quant_rule(outtype))."""
    outtype = outtype.lower()
    hf = hf_case(case, seed)

    def make(d):
        d.mkdir(parents=True)
        out = _gguf_file(case, outtype, seed)
        if outtype in CONVERTER_TYPES:
            to_gguf(hf, out, outtype)
        else:
            rule = {"ud_mix": ud_mix_rule, "iq_mix": lambda: mix_rule(IQ_MIX),
                    "iq_mix_pairs": lambda: mix_rule(IQ_MIX, pair_gate_up=True)}.get(outtype,
                                                                                    lambda: quant_rule(outtype))()
            requantize(gguf_case(case, "f32", seed).gguf, out, rule)
        return out
    return GGUFCase(case, outtype, seed, hf, _cached(("gguf", case, outtype, seed), make))


def gguf_cases_many(specs, seed: int = 0) -> list:
    """gguf_case for each (case, outtype) of specs, with every missing converter run batched into a
    single converter subprocess (it costs ~5 s of imports per process, ~0.1 s per tiny model)."""
    specs = [(c, o.lower()) for c, o in specs]
    with _lock:
        need = {}
        for c, o in specs:
            conv = o if o in CONVERTER_TYPES else "f32"
            if ("gguf", c, conv, seed) not in _cache:
                need[(c, conv)] = None
        jobs = []
        for c, o in need:
            hf = hf_case(c, seed)
            d = _key_dir(("gguf", c, o, seed))
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
            jobs.append((hf, _gguf_file(c, o, seed), o))
        for (c, o), path in zip(need, llamacpp_convert.convert_many(jobs)):
            _cache[("gguf", c, o, seed)] = path
        return [gguf_case(c, o, seed) for c, o in specs]


try:
    import pytest

    @pytest.fixture(scope="session")
    def gguf_cases(tmp_path_factory):
        """gguf_case, building under the session's pytest temporary directory."""
        with _lock:
            if not _base:
                set_base_dir(tmp_path_factory.mktemp("gguf-cases"))
        return gguf_case
except ImportError:          # pragma: no cover - outside pytest
    pass


def rewrite_gguf(src, dst, alignment=None, fields=None, drop=(), edit=None, dequantize=False, **writer_kw):
    """src's fields and tensors written again by gguf-py's writer: fields {key: (value, GGUFValueType[, sub type of
    an ARRAY])} set or
    replaced, keys and tensor names in `drop` left out, edit {tensor name: fn(float32 data) -> data}, with
    dequantize every tensor written as float32 by gguf-py's own dequantisation (the file's truth) (with split_max_tensors: as NAME-0000k-of-0000N.gguf;
    with alignment: general.alignment set)."""
    import gguf
    import numpy as np
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents(), **writer_kw)
    w.kv_data[0].clear()
    if alignment:
        w.data_alignment = alignment
    fields = dict(fields or {})
    for key, field in r.fields.items():
        if key in SKIP_KEYS or key in drop or key in fields:
            continue
        val, vtype, sub = _field_value(field)
        w.add_key_value(key, val, vtype, sub_type=sub)
    for key, (val, vtype, *sub) in fields.items():
        w.add_key_value(key, val, vtype, sub_type=sub[0] if sub else None)
    if alignment:
        w.add_key_value("general.alignment", alignment, gguf.GGUFValueType.UINT32)
    for t in r.tensors:
        if t.name in drop:
            continue
        raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
        data = np.ascontiguousarray(t.data)
        if dequantize and raw is not None:
            data, raw = np.ascontiguousarray(gguf.dequantize(t.data, t.tensor_type), np.float32), None
        if edit and t.name in edit:
            data = np.ascontiguousarray(edit[t.name](np.array(data, np.float32)), np.float32)
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
