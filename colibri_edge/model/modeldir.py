"""The model directory (DESIGN.md, "The model directory"): writer, read-only memmap reader, validation.

    <model>/config.json          hyper-parameters and the layer plan
            experts.json         one record per routed expert: where its blob is, its matrices' formats
            tensors.json         every non-expert tensor: name -> offset, shape, dtype (its format)
            colibri_weights.bin  raw little-endian data, everything 4096-byte aligned

One expert = one contiguous blob:  gate [I,H] | up [I,H] | down [H,I]   (row-major, each matrix in its
own format: a Q4_K_M file mixes Q4_K and Q6_K), so it can be mapped, copied to a device or evicted as
one unit. Every matrix of tensors.json may have its own format too (dtypes.WEIGHT_DTYPES); vectors,
the router and the shared expert's gate are float32.

Format versions: 2 (this one) records per-matrix formats ("formats" in experts.json); 1 had one
weight type for the whole directory ("dtype"), and is still read.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import numpy as np

from . import families, layerplan, validate
from .dtypes import (QUANTIZED, WEIGHT_DTYPES, fits, is_block, narrow, nbytes, quantize_rows, storage_dtype,
                     storage_shape)
from ..errors import ColibriError, COLIBRI_ERR_OUT_OF_MEMORY, invalid_model

ALIGN = 4096
WEIGHTS_FILE = "colibri_weights.bin"
FORMAT_VERSION = validate.FORMAT_VERSION
SUPPORTED_MODEL_TYPES = families.SUPPORTED_MODEL_TYPES      # every family's model_type names (the registry)
PLAIN = ("float32", "float16", "bfloat16")      # formats whose blob sections are not padded


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def expert_matrix_shapes(hidden: int, inter: int):
    """(name, shape) of the matrices of one expert blob, in blob order."""
    return (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))


def _pad64(n: int) -> int:
    return (n + 63) // 64 * 64


def expert_formats(fmts) -> tuple:
    """One format for all three matrices, or (gate, up, down)."""
    return (fmts,) * 3 if isinstance(fmts, str) else tuple(fmts)


def expert_sections(hidden: int, inter: int, fmts):
    """Layout of one expert blob: [(name, shape, format, offset, scales_offset or None)], and its size.
    float32/16 and bfloat16 sections lie back to back; int8 (followed by its float32 row scales) and
    block-format sections are padded to 64 bytes (a cache line; keeps scales 4-byte aligned and
    block rows where a device's loads want them)."""
    out, pos = [], 0
    for (name, shape), fmt in zip(expert_matrix_shapes(hidden, inter), expert_formats(fmts)):
        n = nbytes(fmt, shape)
        if fmt in QUANTIZED:
            out.append((name, shape, fmt, pos, pos + _pad64(n)))
            pos += _pad64(n) + _pad64(4 * shape[0])
        else:
            out.append((name, shape, fmt, pos, None))
            pos += n if fmt in PLAIN else _pad64(n)
    return out, pos


def expert_blob_bytes(hidden: int, inter: int, fmts) -> int:
    return expert_sections(hidden, inter, fmts)[1]


def latent_tensors(cfg: dict, p: str) -> dict:
    """A latent-attention layer's tensors (DeepSeek-V2's MLA; H hidden, Hq heads, r kv_lora_rank,
    rq q_lora_rank, dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim), each [out, in]:
        mla.wq_a [rq, H], mla.q_a_norm [rq]    the query's low-rank input, normed (absent when rq = 0)
        mla.wq [Hq*dn, rq or H]               the unrotated query heads
        mla.wq_rope [Hq*dr, rq or H]          the rotated query heads (half-split rope layout)
        mla.wkv_a [r, H], mla.kv_a_norm [r]   the latent c = norm(wkv_a @ x), cached
        mla.wk_rope [dr, H]                   the rope key shared by every head, cached (rotated)
        mla.wk_b [Hq, r, dn]                  the key up-projection, absorbed into the query side:
                                              q_lat[h] = wk_b[h] @ q_nope[h], and q_lat[h] . c = q_nope[h] . k_nope[h]
        mla.wv_b [Hq, dv, r]                  the value up-projection, applied after attention in latent space
        attn.wo [H, Hq*dv]
    (the converter splits the checkpoint's q rows [nope | rope] per head and kv_a_proj_with_mqa's
    [c | rope] rows, and cuts kv_b_proj [Hq*(dn+dv), r] per head into wk_b (transposed) and wv_b)."""
    la, H, nh = cfg["latent_attention"], cfg["hidden_size"], cfg["num_attention_heads"]
    r, rq, dn, dr, dv = (la[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim"))
    W, f32, HW = "weight", "float32", "head"
    t = {}
    if rq:
        t[p + "mla.wq_a"], t[p + "mla.q_a_norm"] = ((rq, H), W), ((rq,), f32)
    t[p + "mla.wq"] = ((nh * dn, rq or H), W)
    t[p + "mla.wk_b"] = ((nh, r, dn), HW)
    t[p + "mla.wq_rope"] = ((nh * dr, rq or H), W)
    t[p + "mla.wkv_a"], t[p + "mla.kv_a_norm"] = ((r, H), W), ((r,), f32)
    t[p + "mla.wk_rope"] = ((dr, H), W)
    t[p + "mla.wv_b"] = ((nh, dv, r), HW)
    t[p + "attn.wo"] = ((H, nh * dv), W)
    return t


def linear_tensors(cfg: dict, p: str) -> dict:
    """A gated delta-net layer's tensors (Qwen3.5's linear attention; H hidden, Hk / Hv key / value heads
    of dk / dv dims, K the conv kernel, C = 2 Hk dk + Hv dv the conv's channels), each [out, in]:
        lin.wqkv [C, H]          q | k | v heads, the conv's input
        lin.conv [C, K]          the depthwise causal conv's taps (SiLU after)
        lin.wz [Hv*dv, H]        the output gate: out = norm(o) * silu(z)
        lin.wa, lin.wb [Hv, H]   decay and update-rate inputs: g = a_neg * softplus(a + dt_bias), beta = sigmoid(b)
        lin.a_neg, lin.dt_bias [Hv]   a_neg = -exp(A_log)
        lin.norm [dv]            the gated RMSNorm's weight (per value head)
        lin.wo [H, Hv*dv]"""
    la, H, W, f32 = cfg["linear_attention"], cfg["hidden_size"], "weight", "float32"
    Hk, Hv, dk, dv = (la[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    C = 2 * Hk * dk + Hv * dv
    return {p + "lin.wqkv": ((C, H), W), p + "lin.conv": ((C, la["conv_kernel"]), f32),
            p + "lin.wz": ((Hv * dv, H), W), p + "lin.wa": ((Hv, H), f32), p + "lin.wb": ((Hv, H), f32),
            p + "lin.a_neg": ((Hv,), f32), p + "lin.dt_bias": ((Hv,), f32), p + "lin.norm": ((dv,), f32),
            p + "lin.wo": ((H, Hv * dv), W)}


def short_conv_tensors(cfg: dict, p: str) -> dict:
    """A gated short-convolution layer's tensors (LFM2; H hidden, K the conv kernel), each [out, in]:
        conv.wb, conv.wc, conv.wx [H, H]   the three thirds of in_proj: b, c, x
        conv.w [H, K]                      the depthwise causal conv's taps (no activation)
        conv.wo [H, H]                     out = wo @ (c * conv(b * x))"""
    H, W = cfg["hidden_size"], "weight"
    t = {p + f"conv.w{x}": ((H, H), W) for x in "bcxo"}
    t[p + "conv.w"] = ((H, cfg["short_conv"]["conv_kernel"]), "float32")
    return t


def mamba_tensors(cfg: dict, p: str) -> dict:
    """A Mamba-2 layer's tensors (Granite 4.0-H; H hidden, nh heads of P dims, G groups of B / C, N the state
    size, K the conv kernel, D = nh P, C = D + 2 G N the conv's channels), each [out, in]; in_proj's three
    parts stored apart:
        ssm.wz [D, H]            the gate: y = rmsnorm(scan(..) * silu(z)) * norm
        ssm.wxbc [C, H]          x | B | C, the conv's input
        ssm.wdt [nh, H]          the time steps: dt = softplus(wdt @ h + dt_bias)
        ssm.conv [C, K], ssm.conv_bias [C]   the depthwise causal conv's taps and bias (SiLU after)
        ssm.a_neg, ssm.d, ssm.dt_bias [nh]   a_neg = -exp(A_log), d the skip (D): y += d x
        ssm.norm [D]             the gated RMSNorm's weight
        ssm.wo [H, D]"""
    mb, H, W, f32 = cfg["mamba"], cfg["hidden_size"], "weight", "float32"
    nh, P, G, N = (mb[k] for k in ("num_heads", "head_dim", "n_groups", "state_size"))
    D, C = nh * P, nh * P + 2 * G * N
    return {p + "ssm.wz": ((D, H), W), p + "ssm.wxbc": ((C, H), W), p + "ssm.wdt": ((nh, H), f32),
            p + "ssm.conv": ((C, mb["conv_kernel"]), f32), p + "ssm.conv_bias": ((C,), f32),
            p + "ssm.a_neg": ((nh,), f32), p + "ssm.d": ((nh,), f32), p + "ssm.dt_bias": ((nh,), f32),
            p + "ssm.norm": ((D,), f32), p + "ssm.wo": ((H, D), W)}


def _attention_tensors(cfg: dict, layer: dict, p: str) -> dict:
    """A GQA layer's attention tensors."""
    H, W, f32 = cfg["hidden_size"], "weight", "float32"
    nh, nkv, hd = layerplan.geometry(cfg, layer)
    t = {}
    t[p + "attn.wq"] = ((nh * hd, H), W)
    if cfg.get("attention_output_gate"):
        t[p + "attn.wq_gate"] = ((nh * hd, H), W)     # the output gate's rows of a fused q projection
    t[p + "attn.wk"] = ((nkv * hd, H), W)
    if not layer.get("k_eq_v"):
        t[p + "attn.wv"] = ((nkv * hd, H), W)
    t[p + "attn.wo"] = ((H, nh * hd), W)
    if cfg["attention_bias"]:
        t[p + "attn.bq"] = ((nh * hd,), f32)
        t[p + "attn.bk"] = ((nkv * hd,), f32)
        if not layer.get("k_eq_v"):
            t[p + "attn.bv"] = ((nkv * hd,), f32)
    if cfg["attention_out_bias"]:
        t[p + "attn.bo"] = ((H,), f32)
    if cfg.get("attention_sinks"):
        t[p + "attn.sinks"] = ((nh,), f32)
    if layer.get("nope") and cfg["qk_norm"] != "none":
        pass                                         # Llama 4's no-rope layers: no q/k norm (l2 has no weight)
    elif cfg["qk_norm"] in ("per_head", "per_head_after_rope"):
        t[p + "attn.q_norm"] = ((hd,), f32)
        t[p + "attn.k_norm"] = ((hd,), f32)
    elif cfg["qk_norm"] == "full":
        t[p + "attn.q_norm"] = ((nh * hd,), f32)
        t[p + "attn.k_norm"] = ((nkv * hd,), f32)
    return t


HEAD_TYPES = PLAIN          # the per-head matrices' formats (head_matmul): float16 when the model's is not one


def tensor_roles(cfg: dict) -> dict:
    """name -> (shape, role) of every non-expert tensor the config implies; role "weight" (a matrix in
    any weight format), "head" (per-head matrices [G, N, K] in a float format: latent attention's) or
    "float32" (norms, biases, the router and gates). Matrices are [out, in]."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    W, f32 = "weight", "float32"
    t = {"embed_tokens": ((V, H), W), "norm": ((H,), f32)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head"] = ((V, H), W)
    layernorm = cfg.get("norm_type") == "layernorm"     # LayerNorms: each norm with its bias (Phi-3.5-MoE)
    if layernorm:
        t["norm_bias"] = ((H,), f32)
    if cfg.get("lm_head_bias"):
        t["lm_head_bias"] = ((V,), f32)
    sandwich = cfg.get("norm_layout") == "sandwich"
    mtp = cfg.get("mtp")
    if mtp:                                      # the MTP head: x = e_proj enorm(embed(t)) + h_proj hnorm(h)
        for n in ("enorm", "hnorm", "norm"):
            t["mtp." + n] = ((H,), f32)
        t["mtp.e_proj"] = ((H, H), W)
        t["mtp.h_proj"] = ((H, H), W)
        if mtp.get("own_head"):
            t["mtp.head"] = ((V, H), W)
        if mtp.get("own_embed"):
            t["mtp.embed"] = ((V, H), W)
    for layer in layerplan.all_layers(cfg):
        p = f"layers.{layer['layer_id']}."
        t[p + "input_norm"] = ((H,), f32)
        t[p + "post_attention_norm"] = ((H,), f32)
        if layernorm:
            t[p + "input_norm_bias"] = ((H,), f32)
            t[p + "post_attention_norm_bias"] = ((H,), f32)
        if sandwich:                             # Gemma 4: every branch normed on its way out too
            t[p + "attn.out_norm"] = ((H,), f32)
            t[p + "ffn_out_norm"] = ((H,), f32)
            if layer["type"] == "moe_dense":
                t[p + "mlp.out_norm"] = ((H,), f32)
                t[p + "experts_norm"] = ((H,), f32)
                t[p + "experts_out_norm"] = ((H,), f32)
        if cfg.get("layer_scalar"):
            t[p + "scalar"] = ((1,), f32)
        if cfg.get("latent_attention"):
            t.update(latent_tensors(cfg, p))
        elif layerplan.mixer_type(cfg, layer) == "short_conv":
            t.update(short_conv_tensors(cfg, p))
        elif layerplan.mixer_type(cfg, layer) == "mamba":
            t.update(mamba_tensors(cfg, p))
        elif layerplan.is_linear(cfg, layer):
            t.update(linear_tensors(cfg, p))
        else:
            t.update(_attention_tensors(cfg, layer, p))
        if layer["type"] in ("dense", "moe_dense"):
            inter = cfg["intermediate_size"]
            t[p + "mlp.gate"] = ((inter, H), W)
            t[p + "mlp.up"] = ((inter, H), W)
            t[p + "mlp.down"] = ((H, inter), W)
        if layer["type"] != "dense":
            t[p + "router"] = ((layer["moe_num_experts"], H), f32)
            if cfg.get("router_input_norm"):
                t[p + "router_norm"] = ((H,), f32)
            if cfg.get("expert_scale"):
                t[p + "expert_scale"] = ((layer["moe_num_experts"],), f32)
            if cfg.get("router_choice_bias"):
                t[p + "router_choice_bias"] = ((layer["moe_num_experts"],), f32)
            if cfg.get("router_bias"):
                t[p + "router_bias"] = ((layer["moe_num_experts"],), f32)
            if cfg.get("expert_bias"):
                E, I = layer["moe_num_experts"], cfg["moe_intermediate_size"]
                t[p + "experts.gate_bias"] = ((E, I), f32)
                t[p + "experts.up_bias"] = ((E, I), f32)
                t[p + "experts.down_bias"] = ((E, H), f32)
        if layer["type"] == "moe_shared":
            si = cfg["shared_expert_intermediate_size"]
            t[p + "shared.gate"] = ((si, H), W)
            t[p + "shared.up"] = ((si, H), W)
            t[p + "shared.down"] = ((H, si), W)
            if cfg["shared_expert_gate"]:
                t[p + "shared.gate_logit"] = ((1, H), f32)
    return t


def head_format(cfg: dict) -> str:
    """The format the per-head matrices are written in: the model's when a float one, else float16."""
    return cfg["weight_dtype"] if cfg["weight_dtype"] in HEAD_TYPES else "float16"


def expected_tensors(cfg: dict, fmt_of=None) -> dict:
    """name -> (shape, dtype) of every non-expert tensor, for writers: matrices in fmt_of(name, shape)
    (default: the config's weight_dtype), the rest float32; every int8 matrix carries its float32 row
    scales beside it (name.scales)."""
    fmt_of = fmt_of or (lambda name, shape: cfg["weight_dtype"])
    t = {}
    for name, (shape, role) in tensor_roles(cfg).items():
        t[name] = (shape, fmt_of(name, shape) if role == "weight" else head_format(cfg) if role == "head" else
                   "float32")
        if t[name][1] in QUANTIZED:
            t[name + ".scales"] = ((shape[0],), "float32")
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
        for name in ("config.json", "tensors.json", "experts.json"):   # an interrupted write leaves no
            if os.path.exists(os.path.join(out_dir, name)):            # directory that looks whole
                os.remove(os.path.join(out_dir, name))
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
            if c.nbytes:
                self._f.write(memoryview(np.ascontiguousarray(c)).cast("B"))
            self._pos += c.nbytes
        return start, self._pos - start

    def add_tensor(self, name: str, array: np.ndarray, dtype: str = "float32", shape=None):
        """A float array in the format `dtype` (quantised here), or data already stored in it (then
        `shape` is its logical shape when that differs from the array's: the block formats)."""
        array = np.asarray(array)
        if dtype in QUANTIZED and array.dtype.kind == "f":
            q, scales = quantize_rows(array)
            self.add_tensor(name, q, dtype)
            self.add_tensor(name + ".scales", scales, "float32")
            return
        shape = tuple(array.shape if shape is None else shape)
        raw = self._stored(array, dtype, shape, name)
        off, n = self._write_aligned([raw])
        self.tensors[name] = {"offset": off, "shape": list(shape), "dtype": dtype, "nbytes": n}

    @staticmethod
    def _stored(array, dtype, shape, what):
        """Data in storage type: already stored as dtype, or floats narrowed to it (float64 via float32)."""
        array = np.asarray(array)
        if array.dtype == storage_dtype(dtype) and array.shape == storage_shape(dtype, shape) and \
                not (is_block(dtype) and array.dtype.kind == "f"):
            return array
        if array.dtype.kind != "f":
            raise ValueError(f"{what}: array of {array.dtype} {array.shape} is not stored {dtype} {shape}")
        return narrow(np.asarray(array, np.float32), dtype)

    def add_expert(self, layer: int, local_id: int, gate, up, down, fmts, activation_fn=None, hidden=None,
                   inter=None):
        """gate [I,H], up [I,H], down [H,I] as float (quantised here to fmts: one format or (gate, up,
        down)) or already stored in their formats (then give hidden and inter)."""
        fmts = expert_formats(fmts)
        if activation_fn is None:      # the config's: SwiGLU, or gpt-oss's clamped one
            activation_fn = {"silu": "swiglu"}.get(self.config.get("expert_act", "silu"), self.config.get("expert_act"))
        if hidden is None:
            inter, hidden = np.asarray(gate).shape
        sections, size = expert_sections(hidden, inter, fmts)
        chunks, pos = [], 0                      # written piece by piece: no copy of the whole blob

        def put(at, arr):
            nonlocal pos
            if at > pos:
                chunks.append(np.zeros(at - pos, np.uint8))
            chunks.append(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
            pos = at + chunks[-1].size
        for (mname, shape, fmt, off, soff), m in zip(sections, (gate, up, down)):
            m = np.asarray(m)
            sc = None
            if fmt in QUANTIZED and m.dtype.kind == "f":
                m, sc = quantize_rows(m)
            put(off, self._stored(m, fmt, shape, f"expert {local_id} of layer {layer} ({mname})"))
            if sc is not None:
                put(soff, sc)
        if size > pos:
            chunks.append(np.zeros(size - pos, np.uint8))
        off, n = self._write_aligned(chunks)
        self.experts.append({
            "id": len(self.experts), "layer": layer, "local_id": local_id, "weight_offset": off,
            "weight_size": n, "hidden_size": hidden, "intermediate_size": inter, "has_residual": False,
            "activation_fn": activation_fn, "formats": dict(zip(("gate", "up", "down"), fmts)),
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


def check_disk(out_dir: str, need: int):
    """Refuse (before writing anything) a model directory the disk has no room for."""
    probe = os.path.abspath(out_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    old = os.path.join(out_dir, WEIGHTS_FILE)
    if os.path.isfile(old):
        free += os.path.getsize(old)                 # replaced by the new one
    if need > free:
        raise ColibriError(COLIBRI_ERR_OUT_OF_MEMORY, f"{out_dir}: the model directory needs {need / 2**30:.2f} GiB "
                           f"and its disk has {free / 2**30:.2f} GiB free; free space or convert to another disk")


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
    formats: tuple        # (gate, up, down)
    activation_fn: str


def validate_config(cfg: dict, path: str = "config.json") -> dict:
    return validate.config(cfg, path, SUPPORTED_MODEL_TYPES)


class ModelDir:
    """A validated, read-only model directory. Weights are views into one np.memmap:
    pages of experts never routed to are never read."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise invalid_model(self.path, "(directory)", "not a directory; pass a model directory "
                                "made by `colibri convert`")
        p = lambda n: os.path.join(self.path, n)
        self.config = validate.config(validate.load_json(p("config.json"), "config.json"), p("config.json"),
                                      SUPPORTED_MODEL_TYPES)
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
        jinja = p("chat_template.jinja")         # transformers 5 saves the template beside the config,
        if os.path.lexists(jinja):               # and prefers it there
            self.tokenizer_config["chat_template"] = validate.text_file(jinja, "a chat template")
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
        roles = tensor_roles(self.config)
        v1 = self.config["format_version"] == 1
        scales = set()
        for name, (shape, role) in roles.items():
            if name not in self.tensors:
                raise invalid_model(path, name, "missing tensor required by config.json")
            rec = self.tensors[name]
            validate.tensor_record(path, name, rec)
            if list(rec["shape"]) != list(shape):
                raise invalid_model(path, f"{name}.shape", f"expected {list(shape)}, got {rec['shape']}")
            want = ("float32",) if role == "float32" else HEAD_TYPES if role == "head" else \
                (self.config["weight_dtype"],) if v1 else WEIGHT_DTYPES
            if rec["dtype"] not in want:
                raise invalid_model(path, f"{name}.dtype", f"expected {' or '.join(want) if len(want) < 3 else 'a weight format'}, "
                                    f"got {rec['dtype']}")
            if not fits(rec["dtype"], shape[-1]):
                raise invalid_model(path, f"{name}.dtype", f"{rec['dtype']} cannot hold rows of {shape[-1]}")
            if rec["dtype"] in QUANTIZED:
                scales.add(name + ".scales")
            self._check_record(path, name, rec, shape)
        for name in sorted(scales):
            rec = self.tensors.get(name)
            if rec is None:
                raise invalid_model(path, name, "missing: an int8 matrix needs its float32 row scales")
            validate.tensor_record(path, name, rec)
            n = self.tensors[name[:-len(".scales")]]["shape"][0]
            if list(rec["shape"]) != [n] or rec["dtype"] != "float32":
                raise invalid_model(path, name, f"expected float32 [{n}], got {rec['dtype']} {rec['shape']}")
            self._check_record(path, name, rec, (n,))
        for name in roles:                       # the fused gate/up kernels read both the same way
            if name.endswith((".mlp.gate", ".shared.gate")):
                up = name[:-len("gate")] + "up"
                if is_block(self.tensors[name]["dtype"]) != is_block(self.tensors[up]["dtype"]):
                    raise invalid_model(path, up + ".dtype", f"{self.tensors[up]['dtype']} beside gate "
                                        f"{self.tensors[name]['dtype']}: gate and up must both be block formats "
                                        "or neither")
        extra = sorted(set(self.tensors) - set(roles) - scales)
        if extra:
            raise invalid_model(path, extra[0], "is not a tensor of this layer plan; the engine would ignore it, "
                                "so the directory does not match its config.json: re-run `colibri convert`")

    def _check_record(self, path, name, rec, shape):
        n = nbytes(rec["dtype"], shape)
        if rec.get("nbytes", n) != n:
            raise invalid_model(path, f"{name}.nbytes", f"expected {n} for {rec['dtype']} {list(shape)}")
        rec["nbytes"] = n
        self._check_extent(path, f"{name}.offset", rec["offset"], n)

    def _validate_experts(self, experts, path):
        cfg = self.config
        if not isinstance(experts, list):
            raise invalid_model(path, "(root)", "expected a list of expert records")
        want = [(l["layer_id"], j) for l in layerplan.all_layers(cfg) if l["type"] != "dense"
                for j in range(l["moe_num_experts"])]
        if len(experts) != len(want):
            raise invalid_model(path, "(length)", f"{len(experts)} records, the layer plan needs {len(want)}")
        out = []
        H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
        v1 = cfg["format_version"] == 1
        self.layer_formats = {}
        for i, (rec, (layer, local)) in enumerate(zip(experts, want)):
            f = f"[{i}]"
            fmts = validate.expert_record(path, i, rec, v1)
            if v1 and fmts[0] != cfg["weight_dtype"]:
                raise invalid_model(path, f + ".dtype", f"expected {cfg['weight_dtype']} from config.json")
            for mname, fmt, k in zip(("gate", "up", "down"), fmts, (H, H, I)):
                if not fits(fmt, k):
                    raise invalid_model(path, f"{f}.formats.{mname}", f"{fmt} cannot hold rows of {k}")
            if is_block(fmts[0]) != is_block(fmts[1]):
                raise invalid_model(path, f + ".formats", f"gate {fmts[0]} and up {fmts[1]} must both be block "
                                    "formats or both not (the fused gate/up kernels read them together)")
            r = ExpertRecord(rec["id"], rec["layer"], rec["local_id"], rec["weight_offset"], rec["weight_size"],
                             rec["hidden_size"], rec["intermediate_size"], fmts, rec["activation_fn"])
            if (r.id, r.layer, r.local_id) != (i, layer, local):
                raise invalid_model(path, f + ".id/layer/local_id",
                                    f"expected id {i}, layer {layer}, local_id {local}")
            if (r.hidden_size, r.intermediate_size) != (H, I):
                raise invalid_model(path, f + ".hidden_size/intermediate_size", f"expected {H}, {I} from config.json")
            if self.layer_formats.setdefault(layer, fmts) != fmts:
                raise invalid_model(path, f + ".formats", f"expert formats {fmts} differ from the layer's first expert "
                                    f"{self.layer_formats[layer]}; one layer's experts share their formats")
            size = expert_blob_bytes(H, I, fmts)
            if r.weight_size != size:
                raise invalid_model(path, f + ".weight_size", f"is {r.weight_size}, gate+up+down of "
                                    f"[{I},{H}] in {'/'.join(fmts)} need {size}")
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
        dt = storage_dtype(r["dtype"])
        return self.mmap[r["offset"]:r["offset"] + r["nbytes"]].view(dt).reshape(storage_shape(r["dtype"], r["shape"]))

    def tensor_shape(self, name: str) -> tuple:
        return tuple(self.tensors[name]["shape"])

    @property
    def formats(self) -> set:
        """Every weight format the directory's matrices use."""
        return {r["dtype"] for r in self.tensors.values()} | {f for fm in self.layer_formats.values() for f in fm}

    @property
    def gate_up_splits(self) -> list:
        """[(where, gate format, up format)] of every FFN whose gate and up projections differ in
        format (a GGUF file may store them so; one backend kernel per format fuses them elsewhere)."""
        out = [(f"layers.{l}.experts", f[0], f[1]) for l, f in sorted(self.layer_formats.items()) if f and f[0] != f[1]]
        for name, r in sorted(self.tensors.items()):
            if name.endswith((".mlp.gate", ".shared.gate")) and r["dtype"] != self.tensors[name[:-4] + "up"]["dtype"]:
                out.append((name[:-5], r["dtype"], self.tensors[name[:-4] + "up"]["dtype"]))
        return out

    def layer_blob_bytes(self, layer: int) -> int:
        cfg = self.config
        return expert_blob_bytes(cfg["hidden_size"], cfg["moe_intermediate_size"], self.layer_formats[layer])

    def tensor_dtype(self, name: str) -> str:
        return self.tensors[name]["dtype"]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def expert_blob(self, layer: int, local_id: int) -> np.ndarray:
        """One expert's whole blob as uint8 (no copy)."""
        e = self.expert_record(layer, local_id)
        return self.mmap[e.weight_offset:e.weight_offset + e.weight_size]

    def expert_record(self, layer: int, local_id: int) -> ExpertRecord:
        cfg = self.config
        spec = cfg["layers"][layer] if layer < len(cfg["layers"]) else layerplan.mtp_layers(cfg)[0]
        start = spec["moe_expert_start"]
        return self.experts[start + local_id]

    @property
    def moe_layers(self):
        return [l["layer_id"] for l in self.config["layers"] if l["type"] != "dense"]


def split_expert_blob_scaled(blob: np.ndarray, hidden: int, inter: int, fmts):
    """uint8 blob -> ((gate, scales), (up, scales), (down, scales)) views in their storage dtypes and
    shapes (no copy); scales are None unless int8."""
    out = []
    for _, shape, fmt, off, soff in expert_sections(hidden, inter, fmts)[0]:
        n = nbytes(fmt, shape)
        m = blob[off:off + n].view(storage_dtype(fmt)).reshape(storage_shape(fmt, shape))
        out.append((m, None if soff is None else blob[soff:soff + 4 * shape[0]].view(np.float32)))
    return tuple(out)
