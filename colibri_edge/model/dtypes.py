"""Weight types as stored in colibri_weights.bin, and how they widen to float32: the registry of every
format a matrix may be stored in.

    float32, float16, bfloat16   one element each. bfloat16 has no NumPy dtype: stored as uint16
                                 holding the top half of a float32, so widening is a 16-bit shift
    int8                         symmetric, one float32 scale per output row (row):
                                 w[r, c] = q[r, c] * scale[r], scale[r] = max|w[r, :]| / 127, the
                                 scales stored beside the matrix. Per-row rather than per-block scales:
                                 the decode GEMV applies one multiply per output instead of one per 32
                                 inputs (README "Weight types")
    q8_0 q4_0 q4_1 q5_0 q5_1 mxfp4 q4_k q5_k q6_k   ggml's block formats, as GGUF stores them
                                 (colibri_edge/model/quant.py): a matrix [N, K] is N rows of K / B blocks,
                                 stored as uint8 [N, row_bytes]

A matrix's *storage shape* is [N, K] for the element formats and [N, row_bytes] (bytes) for the block
formats; tensors.json records the logical shape [N, K] and the format.
"""
import math

import numpy as np

from . import quant
from ..errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

# element formats: name -> storage dtype
STORAGE = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int8": np.dtype("i1"),
}
QUANTIZED = ("int8",)                       # carry float32 row scales beside them
BLOCK_FORMATS = quant.BLOCK_FORMATS
WEIGHT_DTYPES = tuple(STORAGE) + BLOCK_FORMATS
# `colibri convert --dtype` mixes: a per-tensor choice of formats (convert.py states the rule)
MIXES = ("q4_k_m",)


def is_block(name: str) -> bool:
    return name in quant.BLOCK


def storage_dtype(name: str) -> np.dtype:
    if is_block(name):
        return np.dtype(np.uint8)
    try:
        return STORAGE[name]
    except KeyError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                           f"unknown weight dtype {name!r}; use one of {', '.join(WEIGHT_DTYPES)}") from None


def itemsize(name: str) -> int:
    """Bytes per element of an element format (not defined for block formats: see nbytes)."""
    return storage_dtype(name).itemsize


def block_of(name: str) -> int:
    """Elements per block: a row length must be a multiple of it (1 for element formats)."""
    return quant.BLOCK[name][0] if is_block(name) else 1


def storage_shape(name: str, shape) -> tuple:
    """The stored array's shape for a tensor of logical `shape` (vectors and element formats: the same)."""
    shape = tuple(int(s) for s in shape)
    if is_block(name):
        return shape[:-1] + (quant.row_bytes(name, shape[-1]),)
    return shape


def nbytes(name: str, shape) -> int:
    return math.prod(storage_shape(name, shape)) * storage_dtype(name).itemsize


def fits(name: str, cols: int) -> bool:
    """Can rows of `cols` elements be stored in this format?"""
    return cols % block_of(name) == 0


def quantize_rows(x: np.ndarray):
    """float32 [rows, cols] -> (int8 [rows, cols], float32 scales [rows]), symmetric per row."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / scales[..., None]), -127, 127).astype(np.int8)
    return q, scales


def widen(raw: np.ndarray, name: str, scales=None) -> np.ndarray:
    """Stored weights -> float32 (a view when already float32). int8 needs its row scales; block
    formats decode their rows (quant.dequantize)."""
    if is_block(name):
        B, nb = quant.BLOCK[name]
        return quant.dequantize(raw, name, raw.shape[-1] // nb * B)
    if name == "int8":
        if scales is None:
            raise ValueError("int8 weights need their scales")
        return raw.astype(np.float32) * np.asarray(scales, np.float32)[..., None]
    if name == "float32":
        return raw
    if name == "float16":
        return raw.astype(np.float32)
    if name == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"unknown weight dtype {name!r}")


def narrow(x: np.ndarray, name: str) -> np.ndarray:
    """float32 -> stored weights (block formats: our quantisers); bfloat16 rounds to nearest even,
    as torch does."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if is_block(name):
        return quant.quantize(x.reshape(-1, x.shape[-1]), name).reshape(storage_shape(name, x.shape))
    if name == "float32":
        return x
    if name == "float16":
        return x.astype(np.float16)
    if name == "bfloat16":
        bits = x.view(np.uint32)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        return ((bits + rounding) >> 16).astype(np.uint16)
    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"unknown weight dtype {name!r}")
