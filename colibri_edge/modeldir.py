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
import math
import os
from dataclasses import dataclass

import numpy as np

from . import validate
from .dtypes import QUANTIZED, STORAGE, itemsize, narrow, quantize_rows
from .errors import invalid_model

ALIGN = 4096
WEIGHTS_FILE = "colibri_weights.bin"
FORMAT_VERSION, SUPPORTED_MODEL_TYPES = validate.FORMAT_VERSION, validate.SUPPORTED_MODEL_TYPES


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
        raw = self._stored(array, dtype, name)
        off, n = self._write_aligned([raw])
        self.tensors[name] = {"offset": off, "shape": list(raw.shape), "dtype": dtype, "nbytes": n}

    @staticmethod
    def _stored(array, dtype, what):
        """Data in storage type: already stored as dtype, or floats narrowed to it (float64 via float32)."""
        array = np.asarray(array)
        if array.dtype == STORAGE[dtype]:
            return array
        if array.dtype.kind != "f":
            raise ValueError(f"{what}: array of {array.dtype} is not stored {dtype}")
        return narrow(np.asarray(array, np.float32), dtype)

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
            chunks = [self._stored(m, dtype, f"expert {local_id} of layer {layer}") for m in (gate, up, down)]
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


def validate_config(cfg: dict, path: str = "config.json") -> dict:
    return validate.config(cfg, path)


class ModelDir:
    """A validated, read-only model directory. Weights are views into one np.memmap:
    pages of experts never routed to are never read."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise invalid_model(self.path, "(directory)", "not a directory; pass a model directory "
                                "made by `colibri convert`")
        p = lambda n: os.path.join(self.path, n)
        self.config = validate.config(validate.load_json(p("config.json"), "config.json"), p("config.json"))
        self.tensors = validate.load_json(p("tensors.json"), "tensors.json")
        experts = validate.load_json(p("experts.json"), "experts.json")
        wpath = p(WEIGHTS_FILE)
        self.file_size = validate.regular_file(wpath, "its weights file (re-run `colibri convert`)")
        self.weights_path = wpath
        self._validate_tensors(p("tensors.json"))
        self.experts = self._validate_experts(experts, p("experts.json"))
        self._validate_no_overlap()
        try:            # file_size is > 0: validation proved every tensor inside it
            self.mmap = np.memmap(wpath, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise invalid_model(wpath, "(file)", f"cannot be mapped ({e})") from None
        V = self.config["vocab_size"]
        self.generation_config = self._optional_json("generation_config.json",
                                                     lambda o, f: validate.generation_config(o, f, V))
        self.tokenizer_config = self._optional_json("tokenizer_config.json", validate.tokenizer_config)
        tok = p("tokenizer.json")
        if os.path.lexists(tok):
            validate.regular_file(tok, "a tokenizer (tokenizer.json)")

    def _optional_json(self, name, check):
        path = os.path.join(self.path, name)
        return check(validate.load_json(path, name), path) if os.path.lexists(path) else {}

    # -- validation -------------------------------------------------------------------------
    def _check_extent(self, path, field, off, size):
        if off % ALIGN:
            raise invalid_model(path, field, f"offset {off} is not {ALIGN}-byte aligned")
        if off + size > self.file_size:
            raise invalid_model(path, field, f"extent [{off}, {off + size}) runs past the end of "
                                f"{WEIGHTS_FILE} ({self.file_size} bytes): the weights file is truncated")

    def _validate_tensors(self, path):
        if not isinstance(self.tensors, dict):
            raise invalid_model(path, "(root)", "expected an object name -> tensor")
        want = expected_tensors(self.config)
        extra = sorted(set(self.tensors) - set(want))
        if extra:
            raise invalid_model(path, extra[0], "is not a tensor of this layer plan; the engine would ignore it, "
                                "so the directory does not match its config.json: re-run `colibri convert`")
        for name, (shape, dtype) in want.items():
            if name not in self.tensors:
                raise invalid_model(path, name, "missing tensor required by config.json")
            rec = self.tensors[name]
            validate.tensor_record(path, name, rec)
            if list(rec["shape"]) != list(shape):
                raise invalid_model(path, f"{name}.shape", f"expected {list(shape)}, got {rec['shape']}")
            if rec["dtype"] != dtype:
                raise invalid_model(path, f"{name}.dtype", f"expected {dtype}, got {rec['dtype']}")
            nbytes = math.prod(shape) * itemsize(dtype)
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
            validate.expert_record(path, i, rec)
            r = ExpertRecord(**{k: rec[k] for k in ExpertRecord.__dataclass_fields__})
            if (r.id, r.layer, r.local_id) != (i, layer, local):
                raise invalid_model(path, f + ".id/layer/local_id",
                                    f"expected id {i}, layer {layer}, local_id {local}")
            if (r.hidden_size, r.intermediate_size, r.dtype) != (H, I, wd):
                raise invalid_model(path, f + ".hidden_size/intermediate_size/dtype",
                                    f"expected {H}, {I}, {wd} from config.json")
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
        n = math.prod(r["shape"])
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
