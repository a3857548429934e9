"""`colibri convert`: a Hugging Face MoE checkpoint (safetensors, possibly sharded) -> model directory.

Streams tensor by tensor from memory-mapped shards, so peak memory is about one tensor (in float32)
whatever the checkpoint's size. float32/float16/bfloat16 sources are read without torch.

A driver: it names no family. The family is looked up in the registry (families/) by config.json's
model_type; its hooks translate the config, name the checkpoint's tensors, prepare them (wrapped models,
skipped towers, folded multipliers, permuted rows) and read its experts.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
from tqdm import tqdm

from .dtypes import MIXES, WEIGHT_DTYPES, block_of, fits, is_block, narrow, nbytes, widen
from .layerplan import all_layers
from .quant import QUANTIZERS
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT, invalid_model
from . import families
from .families.common import prepare_mtp, row_permutations, unpermute
from .gguf_import import convert_gguf
from .modeldir import ALIGN, ModelWriter, check_disk, expected_tensors, expert_blob_bytes

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

def translate_config(hf: dict, gen: dict, path: str = "config.json", dtype: str | None = None) -> dict:
    """Hugging Face config.json (+ generation_config.json) -> Colibri config.json, by the family of its
    model_type (an unknown one refused, COLIBRI_ERR_INVALID_MODEL_TYPE, with the supported list)."""
    from .families.common import add_mtp
    return add_mtp(families.for_model_type(hf.get("model_type"), path).translate(hf, gen, path, dtype), hf)



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


def convert(hf_dir: str, out_dir: str, dtype: str | None = None, progress: bool = True, lora=None,
            lora_scale: float = 1.0, mtp: bool = True) -> dict:
    """Convert a Hugging Face checkpoint directory, or a GGUF file (gguf_import.py); returns the
    Colibri config written. lora: a PEFT LoRA adapter directory merged into the weights (model/lora.py:
    W + lora_scale s B A per matrix and per expert, in float32, before the family's layout changes and
    the requested dtype). mtp=False: a multi-token-prediction head the checkpoint stores is left out
    (it drafts for speculative decoding, draft="mtp"; kept by default)."""
    hf_dir, out_dir = os.fspath(hf_dir), os.fspath(out_dir)
    if lora is not None and os.path.isfile(hf_dir) and hf_dir.endswith(".gguf"):
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, "--lora merges into a Hugging Face checkpoint; a GGUF model "
                           "takes its adapter at run time (Engine.open(..., adapters=...), serve --lora)")
    if os.path.isfile(hf_dir) and hf_dir.endswith(".gguf"):
        if dtype is not None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--dtype {dtype}: a GGUF file is converted in the "
                               "formats it is stored in (no requantisation); leave --dtype out")
        return convert_gguf(hf_dir, out_dir, progress)
    if dtype is not None and dtype not in WEIGHT_DTYPES + MIXES:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                           f"--dtype {dtype!r}: use one of {', '.join(WEIGHT_DTYPES + MIXES)}")
    if dtype is not None and is_block(dtype) and dtype not in QUANTIZERS:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                           f"--dtype {dtype}: llama.cpp quantises the lattice i-quants only with an importance "
                           "matrix, and Colibri has no quantiser for them; make the file with llama-quantize "
                           "--imatrix and convert (or run) the GGUF, whose types are kept as stored")
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
    fam = families.for_model_type(cfg["model_type"], cpath)
    fam.prepare_source(src, hf, cfg, progress)   # wrapped models' text weights; towers skipped; MTP names
    prepare_mtp(src, cfg, {**hf, "_path": cpath}, progress, keep=mtp)
    if cfg["weight_dtype"] is None:   # keep the checkpoint's precision
        cfg["weight_dtype"] = src.dtype("model.embed_tokens.weight") if "model.embed_tokens.weight" in src else "float32"
    emb = "model.embed_tokens.weight"
    if cfg.get("embed_scale") and emb in src and src.dtype(emb) in ("bfloat16", "float16"):
        # transformers multiplies by the scale cast to the embedding's type (Gemma's ScaledWordEmbedding)
        cfg["embed_scale"] = float(widen(narrow(np.float32([cfg["embed_scale"]]), src.dtype(emb)), src.dtype(emb))[0])
    merge = None
    if lora is not None:
        from .lora import check_scale, read_adapter, resolve
        merge = resolve(read_adapter(os.fspath(lora)), cfg, fam, check_scale(lora_scale))
        if merge.gguf:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--lora {lora}: a GGUF adapter applies at run time "
                               "(Engine.open(..., adapters=...)); --lora merges a PEFT adapter directory")
    merged, merged_arrays = set(), {}      # (a source tensor read for several of ours is merged once)
    names = fam.source_names(cfg, src)
    fold = fam.fold_factors(cfg)
    perm = row_permutations(cfg)
    plan = FormatPlan(cfg, cfg["weight_dtype"])
    wanted = expected_tensors(cfg, plan)
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    expert_fmts = {l["layer_id"]: plan.expert(l["layer_id"], H, I) for l in all_layers(cfg) if l["type"] != "dense"}
    packed = {l for l in expert_fmts if fam.packed_experts(src, l)}
    if packed and dtype is None:        # packed (MXFP4) experts stay MXFP4 (ggml's layout), the rest as stored
        expert_fmts.update({l: ("mxfp4",) * 3 for l in packed})
    used = set()
    need = sum(nbytes(f, s) + ALIGN for s, f in wanted.values())
    need += sum(expert_blob_bytes(H, I, expert_fmts[l["layer_id"]]) + ALIGN
                for l in all_layers(cfg) if l["type"] != "dense" for _ in range(l["moe_num_experts"]))
    check_disk(out_dir, need)
    w = ModelWriter(out_dir, cfg)
    jobs = [("tensor", n) for n in wanted]
    jobs += [("expert", (l["layer_id"], j)) for l in all_layers(cfg) if l["type"] != "dense"
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
            if merge is not None and hf_name in merge.linear and hf_name not in merged_arrays:
                d = merge.delta(hf_name)
                if d.shape != arr.shape:
                    raise invalid_model(os.path.join(os.fspath(lora), "adapter_model.safetensors"), hf_name,
                                        f"an update of shape {list(d.shape)} for a tensor of {list(arr.shape)}")
                merged_arrays[hf_name] = arr = arr + d
                merged.add(hf_name)
            elif merge is not None and hf_name in merged_arrays:
                arr = merged_arrays[hf_name]
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
            if merge is not None and what in merge.experts:
                raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--lora changes the MXFP4 experts of layer {what[0]}; "
                                   "merging needs them widened: give --dtype (e.g. --dtype mxfp4 requantises after "
                                   "the merge)")
            mats, src_names = fam.packed_expert(src, cfg, *what)
            w.add_expert(what[0], what[1], *mats, expert_fmts[what[0]], hidden=H, inter=I)
            used.update(src_names)
        else:
            if what[0] in packed:            # dequantised, then written in the chosen format
                rows, src_names = fam.packed_expert(src, cfg, *what)
                mats = [np.asarray(widen(m, "mxfp4"), np.float32) for m in rows]
            else:
                getters, src_names = fam.expert_sources(src, cfg, *what)
                mats = [g() for g in getters]
            if merge is not None and what in merge.experts:
                for i, part in enumerate(("gate", "up", "down")):
                    if part in merge.experts[what]:
                        a, b = merge.experts[what][part]
                        mats[i] = mats[i] + b @ a
                merged.add(what)
            if "expert.down" in fold:
                mats[2] = mats[2] * np.float32(fold["expert.down"])
            for m, part in zip(mats, ("gate", "up", "down")):
                _finite(hf_dir, f"{src_names[0].rsplit('.', 2)[0]} (expert {what[1]} of layer {what[0]}, {part})", m)
            w.add_expert(what[0], what[1], *mats, expert_fmts[what[0]])
            used.update(src_names)
    if merge is not None:
        left = sorted(str(k) for k in set(merge.linear) | set(merge.experts) if k not in merged)
        if left:
            w.finish()
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"--lora {lora}: the adapter changes {left[0]}"
                               f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''}, which this conversion "
                               "does not write; was it trained on another model?")
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
