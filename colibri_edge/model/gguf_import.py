"""`colibri convert MODEL.gguf OUT_DIR`: a GGUF file (llama.cpp's, Ollama's) -> model directory.

The file is read with gguf-py's GGUFReader (memory-mapped; it honours `general.alignment`), split
files (NAME-00001-of-000NN.gguf) part by part. Every matrix is copied in the blocks it is stored in:
no requantisation, so Colibri runs exactly the weights llama.cpp runs. What is translated:

  metadata    {arch}.* keys -> config.json (by the arch's family)
  tensors     GGUF names -> ours; q/k rows un-permuted where the file holds adjacent rope pairs
              (rows are whole blocks, so this moves bytes); stacked experts ffn_{gate,up,down}_exps [E, out, in] (or fused
              ffn_gate_up_exps [E, 2 I, H]) split into one page-aligned blob per expert; norms,
              biases and routers widened to float32 (the converter writes them so already)
  tokenizer   the embedded vocabulary -> tokenizer.json by transformers' convert_gguf_tokenizer
              (torch-free), tokenizer_config.json with the chat template and BOS handling,
              generation_config.json with every end-of-generation id llama.cpp stops at

A driver: it names no architecture. The family is looked up in the registry (families/) by the file's
general.architecture; its hooks read the {arch}.* metadata into a Hugging Face-shaped config (then
translated as a checkpoint's, so a GGUF and a safetensors checkpoint of one model give the same
config), name the file's tensors, fix rows up (un-permuted q/k, split fused tensors, reordered partial
rotary rows) and say which tensors it reads outside the map or skips. docs/families.md lists the
architectures and how each is routed (llama.cpp computes the routing: no key carries it;
`{arch}.expert_weights_norm`, when a file has it, overrides the renormalisation).

Every failure is a ColibriError naming the file and the key or tensor: a GGUF that is not one, a
truncated one, a type Colibri does not run (ggml's Q1_0 and Q2_0, the Q8_1 and Q8_K scratch types), tensor data past the
end of the file, a missing key, a tensor whose shape is not what the metadata implies.
"""
from __future__ import annotations

import os
import re

import numpy as np
from tqdm import tqdm

from .dtypes import block_of, is_block, storage_shape, widen
from .layerplan import all_layers
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, invalid_model
from . import families
from .modeldir import ALIGN, HEAD_TYPES, ModelWriter, check_disk, tensor_roles

# GGML type name -> our format (the types we run as stored)
FORMATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "q8_0", "Q4_0": "q4_0",
           "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
           "MXFP4": "mxfp4", "Q2_K": "q2_k", "Q3_K": "q3_k", "IQ4_NL": "iq4_nl", "IQ4_XS": "iq4_xs", "TQ1_0": "tq1_0",
           "TQ2_0": "tq2_0", "NVFP4": "nvfp4", "IQ2_XXS": "iq2_xxs", "IQ2_XS": "iq2_xs", "IQ2_S": "iq2_s",
           "IQ3_XXS": "iq3_xxs", "IQ3_S": "iq3_s", "IQ1_S": "iq1_s", "IQ1_M": "iq1_m"}
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
# metadata -> config, tensor names

def hf_config(m: GGUFModel) -> tuple[dict, str]:
    """The Hugging Face-shaped config the metadata describes, and the GGUF architecture."""
    arch = m.get("general.architecture", str)
    return families.for_arch(arch, m.path).gguf_config(m, arch), arch


def gguf_names(cfg: dict) -> dict:
    """Our tensor name -> GGUF tensor name (non-expert tensors), by the config's family."""
    return families.for_model_type(cfg["model_type"]).gguf_names(cfg)


# ----------------------------------------------------------------------------------------------
# tensors

class _Tensors:
    """Reads GGUF tensors as our layout wants them: format, logical shape, stored data (a view)."""

    head_types = HEAD_TYPES     # the per-head matrices' formats (a family's row fix-ups read it)

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
    if td.get("tokenizer_type") == _gguf().vocab.SentencePieceVocab.tokenizer_model:   # a sentencepiece vocabulary
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
# the conversion

def gguf_mtp(m: GGUFModel, cfg: dict, arch: str):
    """cfg["mtp"] from a file whose first nextn layer (blk.L.nextn.*, llama.cpp's converter with its MTP
    export) is whole: the layer a dense one when it has a plain FFN and no experts; a head / embedding
    of its own when the file stores one."""
    nextn = m.get(arch + ".nextn_predict_layers", int, required=False, default=0)
    L = cfg["num_hidden_layers"]
    b = f"blk.{L}."
    if not nextn or b + "nextn.eh_proj.weight" not in m.tensors:
        return
    from .families.common import add_mtp
    add_mtp(cfg, {"num_nextn_predict_layers": nextn})
    if "mtp" not in cfg:
        return
    spec = cfg["mtp"]["layers"][0]
    if b + "ffn_gate.weight" in m.tensors and not any(n.startswith(b + "ffn_gate_exps") or
                                                     n.startswith(b + "ffn_gate_up_exps") for n in m.tensors):
        spec.update(type="dense", moe_expert_start=0, moe_num_experts=0)
    for own, n in (("own_head", "shared_head_head"), ("own_embed", "embed_tokens")):
        if b + f"nextn.{n}.weight" in m.tensors:
            cfg["mtp"][own] = True


def eh_half(tz: "_Tensors", name: str, H: int, second: bool) -> tuple:
    """(data, format) of one half of eh_proj [H, 2H] (columns H.. when second): e_proj over the embedding,
    h_proj over the hidden state. A block format's row holds whole blocks: cut where a block starts."""
    data, fmt = tz.stored(name, (H, 2 * H))
    half = data.shape[-1] // 2
    if is_block(fmt) and H % block_of(fmt):
        raise invalid_model(tz.m.tensors[name][1], name, f"{fmt} blocks of {block_of(fmt)} do not end at column {H}; "
                            "re-quantise the file with the MTP head in a format whose blocks divide the hidden size")
    return np.ascontiguousarray(data[:, half:] if second else data[:, :half]), fmt


def convert_gguf(path: str, out_dir: str, progress: bool = True) -> dict:
    """Convert a GGUF file (or the first part of a split one); returns the config written."""
    m = GGUFModel(path)
    hf, arch = hf_config(m)
    fam = families.for_arch(arch, m.path)
    label = FILE_TYPES.get(m.get("general.file_type", int, required=False), "mixed")
    eos = eog_ids(m)
    gen = {"eos_token_id": eos, "bos_token_id": m.get("tokenizer.ggml.bos_token_id", int, required=False)}
    cfg = families.for_model_type(hf["model_type"], m.path).translate(hf, gen, m.path, label)
    cfg["architectures"] = []
    fam.gguf_fixup(cfg, m)
    gguf_mtp(m, cfg, arch)
    names = fam.gguf_names(cfg)
    roles = tensor_roles(cfg)
    tz = _Tensors(m)
    for ours, (shape, role) in roles.items():               # everything present and well-shaped first
        g = names[ours]
        if g not in m.tensors:
            raise invalid_model(m.path, g, f"missing tensor (the metadata implies {ours} {list(shape)})")
    tok = tokenizer(m)
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["experts_per_layer"]
    moe = [l["layer_id"] for l in all_layers(cfg) if l["type"] != "dense"]
    need = sum(int(t.n_bytes) + ALIGN for t, _ in m.tensors.values()) + len(moe) * E * ALIGN + (1 << 20)
    check_disk(out_dir, need)
    w = ModelWriter(out_dir, cfg)
    jobs = [("tensor", n) for n in roles] + [("experts", l) for l in moe]
    for kind, what in tqdm(jobs, desc="convert", unit="tensor", disable=not progress):
        if kind == "tensor" and what in ("mtp.e_proj", "mtp.h_proj"):
            data, fmt = eh_half(tz, names[what], H, what == "mtp.h_proj")
            w.add_tensor(what, data, fmt, shape=roles[what][0])
        elif kind == "tensor":                  # as stored, or fixed up by the family (rows whole: no requantising)
            data, fmt = fam.gguf_tensor(tz, cfg, what, names[what], roles[what])
            w.add_tensor(what, data, fmt, shape=roles[what][0])
        else:
            mats, fmts = _expert_matrices(tz, what, E, H, I)
            for j in range(E):
                w.add_expert(what, j, *(x[j] for x in mats), fmts, hidden=H, inter=I)
    tz.used.update(fam.gguf_skipped(m, cfg, arch, progress))   # read outside the map, or not run (MTP layers)
    leftover = sorted(set(m.tensors) - tz.used)
    if leftover:
        w.finish()
        raise invalid_model(m.tensors[leftover[0]][1], leftover[0],
                            f"{len(leftover)} tensor(s) Colibri's plan for this {arch} model has no place for "
                            f"(e.g. {leftover[:3]}); their feature is not implemented")
    tok.save_pretrained(out_dir)            # tokenizer.json, tokenizer_config.json, chat_template.jinja
    w.finish({"generation_config.json": {"eos_token_id": cfg["eos_token_ids"], "bos_token_id": cfg["bos_token_id"]}})
    return w.config
