"""The model directory (DESIGN.md, "The model directory"): writer, read-only memmap reader, validation.

    <model>/config.json          hyper-parameters and the layer plan
            experts.json         one record per routed expert: where its blob is
            tensors.json         every non-expert tensor: name -> offset, shape, dtype
            colibri_weights.bin  raw little-endian data, everything 4096-byte aligned

One expert = one contiguous blob:  gate [I,H] | up [I,H] | down [H,I]   (row-major, weight dtype)
so it can be mapped, copied to a device or evicted as one unit.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from .dtypes import QUANTIZED, STORAGE, itemsize, narrow, quantize_rows
from .errors import (ColibriError, COLIBRI_ERR_INVALID_MODEL, COLIBRI_ERR_INVALID_MODEL_TYPE,
                     invalid_model)

FORMAT_VERSION = 1
ALIGN = 4096
WEIGHTS_FILE = "colibri_weights.bin"
SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
LAYER_TYPES = ("dense", "moe", "moe_shared")
ROUTER_MODES = ("topk", "gated")
QK_NORMS = ("none", "per_head", "full")

# field -> python type(s) every config.json must carry
REQUIRED_CONFIG = {
    "format_version": int, "model_type": str, "num_hidden_layers": int, "hidden_size": int,
    "intermediate_size": int, "moe_intermediate_size": int, "num_attention_heads": int,
    "num_key_value_heads": int, "head_dim": int, "vocab_size": int, "max_position_embeddings": int,
    "rope_theta": (int, float), "rms_norm_eps": (int, float), "tie_word_embeddings": bool,
    "experts_per_layer": int, "top_k": int, "router_dtype": str, "router_mode": str,
    "norm_topk_prob": bool, "shared_expert_intermediate_size": int, "shared_expert_gate": bool,
    "attention_bias": bool, "attention_out_bias": bool, "qk_norm": str, "eos_token_ids": list,
    "weight_dtype": str, "layers": list,
}


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def expert_matrix_shapes(hidden: int, inter: int):
    """(name, shape) of the matrices of one expert blob, in blob order."""
    return (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))


def _pad64(n: int) -> int:
    return (n + 63) // 64 * 64


def expert_sections(hidden: int, inter: int, dtype: str):
    """Layout of one expert blob: [(name, shape, offset, scales_offset or None)], and its size.
    Unquantised: gate | up | down back to back. int8: each matrix, then its float32 row scales,
    every section padded to 64 bytes (cache line; keeps the scales 4-byte aligned)."""
    out, pos = [], 0
    for name, shape in expert_matrix_shapes(hidden, inter):
        n = shape[0] * shape[1] * itemsize(dtype)
        if dtype in QUANTIZED:
            out.append((name, shape, pos, pos + _pad64(n)))
            pos += _pad64(n) + _pad64(4 * shape[0])
        else:
            out.append((name, shape, pos, None))
            pos += n
    return out, pos


def expert_blob_bytes(hidden: int, inter: int, dtype: str) -> int:
    return expert_sections(hidden, inter, dtype)[1]


def expected_tensors(cfg: dict) -> dict:
    """name -> (shape, dtype) of every non-expert tensor the config implies.

    Matrices are stored [out, in] (as nn.Linear); norms, biases and the router are float32.
    """
    H, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv, wd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["weight_dtype"]
    f32 = "float32"
    t = {"embed_tokens": ((V, H), wd), "norm": ((H,), f32)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head"] = ((V, H), wd)
    for layer in cfg["layers"]:
        p = f"layers.{layer['layer_id']}."
        t[p + "input_norm"] = ((H,), f32)
        t[p + "post_attention_norm"] = ((H,), f32)
        t[p + "attn.wq"] = ((nh * hd, H), wd)
        t[p + "attn.wk"] = ((nkv * hd, H), wd)
        t[p + "attn.wv"] = ((nkv * hd, H), wd)
        t[p + "attn.wo"] = ((H, nh * hd), wd)
        if cfg["attention_bias"]:
            t[p + "attn.bq"] = ((nh * hd,), f32)
            t[p + "attn.bk"] = ((nkv * hd,), f32)
            t[p + "attn.bv"] = ((nkv * hd,), f32)
        if cfg["attention_out_bias"]:
            t[p + "attn.bo"] = ((H,), f32)
        if cfg["qk_norm"] == "per_head":
            t[p + "attn.q_norm"] = ((hd,), f32)
            t[p + "attn.k_norm"] = ((hd,), f32)
        elif cfg["qk_norm"] == "full":
            t[p + "attn.q_norm"] = ((nh * hd,), f32)
            t[p + "attn.k_norm"] = ((nkv * hd,), f32)
        if layer["type"] == "dense":
            inter = cfg["intermediate_size"]
            t[p + "mlp.gate"] = ((inter, H), wd)
            t[p + "mlp.up"] = ((inter, H), wd)
            t[p + "mlp.down"] = ((H, inter), wd)
        else:
            t[p + "router"] = ((layer["moe_num_experts"], H), f32)
        if layer["type"] == "moe_shared":
            si = cfg["shared_expert_intermediate_size"]
            t[p + "shared.gate"] = ((si, H), wd)
            t[p + "shared.up"] = ((si, H), wd)
            t[p + "shared.down"] = ((H, si), wd)
            if cfg["shared_expert_gate"]:
                t[p + "shared.gate_logit"] = ((1, H), f32)
    if wd in QUANTIZED:      # every quantised matrix carries its float32 row scales beside it
        for name, (shape, dtype) in list(t.items()):
            if dtype == wd:
                t[name + ".scales"] = ((shape[0],), f32)
    return t


# ----------------------------------------------------------------------------------------------
# writer

class ModelWriter:
    """Streams tensors and expert blobs into colibri_weights.bin, each 4096-byte aligned.

    Usage: w = ModelWriter(out, cfg); w.add_tensor(...); w.add_expert(...); w.finish(); nothing
    is held in memory but the tensor being written.
    """

    def __init__(self, out_dir: str, config: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.config = dict(config)
        self.tensors: dict = {}
        self.experts: list = []
        self._f = open(os.path.join(out_dir, WEIGHTS_FILE), "wb")
        self._pos = 0

    def _write_aligned(self, chunks) -> tuple[int, int]:
        pad = align_up(self._pos) - self._pos
        if pad:
            self._f.write(b"\0" * pad)
            self._pos += pad
        start = self._pos
        for c in chunks:
            self._f.write(np.ascontiguousarray(c).tobytes(order="C"))
            self._pos += c.nbytes
        return start, self._pos - start

    def add_tensor(self, name: str, array: np.ndarray, dtype: str = "float32"):
        if dtype in QUANTIZED and array.dtype == np.float32:
            q, scales = quantize_rows(array)
            self.add_tensor(name, q, dtype)
            self.add_tensor(name + ".scales", scales, "float32")
            return
        raw = narrow(array, dtype) if array.dtype == np.float32 else array
        if raw.dtype != STORAGE[dtype]:
            raise ValueError(f"{name}: array of {raw.dtype} is not stored {dtype}")
        off, n = self._write_aligned([raw])
        self.tensors[name] = {"offset": off, "shape": list(raw.shape), "dtype": dtype, "nbytes": n}

    def add_expert(self, layer: int, local_id: int, gate, up, down, dtype: str, activation_fn="swiglu"):
        """gate [I,H], up [I,H], down [H,I] as float32 (or already in storage dtype)."""
        inter, hidden = gate.shape
        if dtype in QUANTIZED:
            chunks = []
            for m in (gate, up, down):
                q, sc = quantize_rows(m)
                for part in (q, sc):
                    b = np.frombuffer(part.tobytes(), np.uint8)
                    chunks += [b, np.zeros(_pad64(b.size) - b.size, np.uint8)]
        else:
            chunks = [narrow(m, dtype) if m.dtype == np.float32 else m for m in (gate, up, down)]
        off, n = self._write_aligned(chunks)
        self.experts.append({
            "id": len(self.experts), "layer": layer, "local_id": local_id, "weight_offset": off,
            "weight_size": n, "hidden_size": hidden, "intermediate_size": inter, "has_residual": False,
            "activation_fn": activation_fn, "dtype": dtype,
        })

    def finish(self, extra_files: dict | None = None):
        # the file ends on a boundary too, so every extent is whole pages
        pad = align_up(self._pos) - self._pos
        self._f.write(b"\0" * pad)
        self._f.close()
        self.config["format_version"] = FORMAT_VERSION
        for name, obj in (("config.json", self.config), ("tensors.json", self.tensors),
                          ("experts.json", self.experts), *(extra_files or {}).items()):
            with open(os.path.join(self.out_dir, name), "w") as f:
                json.dump(obj, f, indent=1)


# ----------------------------------------------------------------------------------------------
# reader

@dataclass
class ExpertRecord:
    id: int
    layer: int
    local_id: int
    weight_offset: int
    weight_size: int
    hidden_size: int
    intermediate_size: int
    dtype: str
    activation_fn: str


def _load_json(path, kind):
    if not os.path.exists(path):
        raise invalid_model(path, "(file)", f"missing; a model directory needs {kind}. "
                            "Create one with `colibri convert HF_DIR OUT_DIR`.")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid_model(path, "(json)", f"not valid JSON ({e}); re-run `colibri convert`") from None


def _check_type(path, field, value, typ):
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if typ == (int, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        want = typ.__name__ if isinstance(typ, type) else "number"
        raise invalid_model(path, field, f"expected {want}, got {value!r}")


def validate_config(cfg: dict, path: str = "config.json") -> dict:
    if not isinstance(cfg, dict):
        raise invalid_model(path, "(root)", "expected a JSON object")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE,
                           f"{path}: field 'model_type': {mt!r} is not supported; supported: "
                           f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    for field, typ in REQUIRED_CONFIG.items():
        if field not in cfg:
            raise invalid_model(path, field, "missing")
        _check_type(path, field, cfg[field], typ)
    if cfg["format_version"] != FORMAT_VERSION:
        raise invalid_model(path, "format_version", f"is {cfg['format_version']}, this Colibri reads "
                            f"{FORMAT_VERSION}; re-convert the model")
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "vocab_size", "max_position_embeddings"):
        if cfg[field] <= 0:
            raise invalid_model(path, field, f"must be positive, got {cfg[field]}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise invalid_model(path, "num_key_value_heads", "must divide num_attention_heads")
    if cfg["head_dim"] % 2:
        raise invalid_model(path, "head_dim", "must be even for rotary embeddings")
    if cfg["weight_dtype"] not in STORAGE:
        raise invalid_model(path, "weight_dtype", f"{cfg['weight_dtype']!r}; expected one of {list(STORAGE)}")
    if cfg["router_mode"] not in ROUTER_MODES:
        raise invalid_model(path, "router_mode", f"{cfg['router_mode']!r}; expected one of {ROUTER_MODES}")
    if cfg["router_dtype"] != "float32":
        raise invalid_model(path, "router_dtype", "the router always runs in float32")
    if cfg["qk_norm"] not in QK_NORMS:
        raise invalid_model(path, "qk_norm", f"{cfg['qk_norm']!r}; expected one of {QK_NORMS}")
    if not 1 <= cfg["top_k"] <= max(cfg["experts_per_layer"], 1):
        raise invalid_model(path, "top_k", f"must be in 1..experts_per_layer, got {cfg['top_k']}")
    layers = cfg["layers"]
    if len(layers) != cfg["num_hidden_layers"]:
        raise invalid_model(path, "layers", f"has {len(layers)} entries, num_hidden_layers is "
                            f"{cfg['num_hidden_layers']}")
    next_expert = 0
    for i, layer in enumerate(layers):
        f = f"layers[{i}]"
        if not isinstance(layer, dict):
            raise invalid_model(path, f, "expected an object")
        for k in ("layer_id", "type", "moe_expert_start", "moe_num_experts"):
            if k not in layer:
                raise invalid_model(path, f"{f}.{k}", "missing")
        if layer["layer_id"] != i:
            raise invalid_model(path, f"{f}.layer_id", f"expected {i}, got {layer['layer_id']}")
        if layer["type"] not in LAYER_TYPES:
            raise invalid_model(path, f"{f}.type", f"{layer['type']!r}; expected one of {LAYER_TYPES}")
        if layer["type"] == "dense":
            if layer["moe_num_experts"] != 0:
                raise invalid_model(path, f"{f}.moe_num_experts", "a dense layer has 0 experts")
        else:
            if layer["moe_num_experts"] != cfg["experts_per_layer"]:
                raise invalid_model(path, f"{f}.moe_num_experts",
                                    f"expected experts_per_layer={cfg['experts_per_layer']}")
            if layer["moe_expert_start"] != next_expert:
                raise invalid_model(path, f"{f}.moe_expert_start", f"expected {next_expert}")
            next_expert += layer["moe_num_experts"]
    if cfg["shared_expert_intermediate_size"] <= 0 and any(l["type"] == "moe_shared" for l in layers):
        raise invalid_model(path, "shared_expert_intermediate_size", "must be positive with moe_shared layers")
    return cfg


class ModelDir:
    """A validated, read-only model directory. Weights are views into one np.memmap:
    pages of experts never routed to are never read."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise invalid_model(self.path, "(directory)", "not a directory; pass a model directory "
                                "made by `colibri convert`")
        p = lambda n: os.path.join(self.path, n)
        self.config = validate_config(_load_json(p("config.json"), "config.json"), p("config.json"))
        self.tensors = _load_json(p("tensors.json"), "tensors.json")
        experts = _load_json(p("experts.json"), "experts.json")
        wpath = p(WEIGHTS_FILE)
        if not os.path.exists(wpath):
            raise invalid_model(wpath, "(file)", "missing weights file; re-run `colibri convert`")
        self.weights_path = wpath
        self.file_size = os.path.getsize(wpath)
        self._validate_tensors(p("tensors.json"))
        self.experts = self._validate_experts(experts, p("experts.json"))
        self._validate_no_overlap()
        # file_size may be 0 only for an empty model, which validation already refused
        self.mmap = np.memmap(wpath, dtype=np.uint8, mode="r")
        self.generation_config = self._optional_json("generation_config.json")
        self.tokenizer_config = self._optional_json("tokenizer_config.json")

    def _optional_json(self, name):
        path = os.path.join(self.path, name)
        return _load_json(path, name) if os.path.exists(path) else {}

    # -- validation -------------------------------------------------------------------------
    def _check_extent(self, path, field, off, size):
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise invalid_model(path, field, f"offset must be a non-negative integer, got {off!r}")
        if off % ALIGN:
            raise invalid_model(path, field, f"offset {off} is not {ALIGN}-byte aligned")
        if off + size > self.file_size:
            raise invalid_model(path, field, f"extent [{off}, {off + size}) runs past the end of "
                                f"{WEIGHTS_FILE} ({self.file_size} bytes): the weights file is truncated")

    def _validate_tensors(self, path):
        if not isinstance(self.tensors, dict):
            raise invalid_model(path, "(root)", "expected an object name -> tensor")
        for name, (shape, dtype) in expected_tensors(self.config).items():
            if name not in self.tensors:
                raise invalid_model(path, name, "missing tensor required by config.json")
            rec = self.tensors[name]
            if not isinstance(rec, dict) or not {"offset", "shape", "dtype"} <= set(rec):
                raise invalid_model(path, name, "needs offset, shape and dtype")
            if list(rec["shape"]) != list(shape):
                raise invalid_model(path, f"{name}.shape", f"expected {list(shape)}, got {rec['shape']}")
            if rec["dtype"] != dtype:
                raise invalid_model(path, f"{name}.dtype", f"expected {dtype}, got {rec['dtype']}")
            nbytes = int(np.prod(shape)) * itemsize(dtype)
            if rec.get("nbytes", nbytes) != nbytes:
                raise invalid_model(path, f"{name}.nbytes", f"expected {nbytes} for shape {list(shape)}")
            rec["nbytes"] = nbytes
            self._check_extent(path, f"{name}.offset", rec["offset"], nbytes)

    def _validate_experts(self, experts, path):
        cfg = self.config
        if not isinstance(experts, list):
            raise invalid_model(path, "(root)", "expected a list of expert records")
        want = [(l["layer_id"], j) for l in cfg["layers"] if l["type"] != "dense"
                for j in range(l["moe_num_experts"])]
        if len(experts) != len(want):
            raise invalid_model(path, "(length)", f"{len(experts)} records, the layer plan needs {len(want)}")
        out = []
        H, I, wd = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["weight_dtype"]
        size = expert_blob_bytes(H, I, wd)
        for i, (rec, (layer, local)) in enumerate(zip(experts, want)):
            f = f"[{i}]"
            try:
                r = ExpertRecord(**{k: rec[k] for k in ExpertRecord.__dataclass_fields__})
            except (KeyError, TypeError) as e:
                raise invalid_model(path, f + ".(record)", f"missing field {e}") from None
            if (r.id, r.layer, r.local_id) != (i, layer, local):
                raise invalid_model(path, f + ".id/layer/local_id",
                                    f"expected id {i}, layer {layer}, local_id {local}")
            if (r.hidden_size, r.intermediate_size, r.dtype) != (H, I, wd):
                raise invalid_model(path, f + ".hidden_size/intermediate_size/dtype",
                                    f"expected {H}, {I}, {wd} from config.json")
            if r.activation_fn != "swiglu":
                raise invalid_model(path, f + ".activation_fn", f"{r.activation_fn!r} is not implemented; "
                                    "only 'swiglu'")
            if r.weight_size != size:
                raise invalid_model(path, f + ".weight_size", f"is {r.weight_size}, gate+up+down of "
                                    f"[{I},{H}] {wd} need {size}")
            self._check_extent(path, f + ".weight_offset", r.weight_offset, size)
            out.append(r)
        return out

    def _validate_no_overlap(self):
        extents = [(r["offset"], r["nbytes"], f"tensors.json: {n}") for n, r in self.tensors.items()]
        extents += [(e.weight_offset, e.weight_size, f"experts.json: [{e.id}]") for e in self.experts]
        extents.sort()
        for (o1, n1, a), (o2, _, b) in zip(extents, extents[1:]):
            if o1 + n1 > o2:
                raise invalid_model(os.path.join(self.path, b.split(":")[0]), b.split(": ")[1] + ".offset",
                                    f"overlaps {a} ([{o1}, {o1 + n1}) vs start {o2})")

    # -- access -----------------------------------------------------------------------------
    def raw_tensor(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, viewed with its storage dtype and shape (no copy)."""
        r = self.tensors[name]
        dt = STORAGE[r["dtype"]]
        n = int(np.prod(r["shape"]))
        return self.mmap[r["offset"]:r["offset"] + n * dt.itemsize].view(dt).reshape(r["shape"])

    def tensor_dtype(self, name: str) -> str:
        return self.tensors[name]["dtype"]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def expert_blob(self, layer: int, local_id: int) -> np.ndarray:
        """One expert's whole blob as uint8 (no copy)."""
        e = self.expert_record(layer, local_id)
        return self.mmap[e.weight_offset:e.weight_offset + e.weight_size]

    def expert_record(self, layer: int, local_id: int) -> ExpertRecord:
        start = self.config["layers"][layer]["moe_expert_start"]
        return self.experts[start + local_id]

    @property
    def moe_layers(self):
        return [l["layer_id"] for l in self.config["layers"] if l["type"] != "dense"]


def split_expert_blob(blob: np.ndarray, hidden: int, inter: int, dtype: str):
    """uint8 blob -> (gate [I,H], up [I,H], down [H,I]) views in storage dtype (no copy)."""
    return tuple(m for m, _ in split_expert_blob_scaled(blob, hidden, inter, dtype))


def split_expert_blob_scaled(blob: np.ndarray, hidden: int, inter: int, dtype: str):
    """uint8 blob -> ((gate, scales), (up, scales), (down, scales)); scales are None unless quantised."""
    dt = STORAGE[dtype]
    out = []
    sections, _ = expert_sections(hidden, inter, dtype)
    for _, shape, off, soff in sections:
        n = shape[0] * shape[1] * dt.itemsize
        m = blob[off:off + n].view(dt).reshape(shape)
        sc = None if soff is None else blob[soff:soff + 4 * shape[0]].view(np.float32)
        out.append((m, sc))
    return tuple(out)
