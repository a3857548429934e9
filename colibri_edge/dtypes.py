"""Weight types as stored in colibri_weights.bin, and how they widen to float32.

bfloat16 has no NumPy dtype: it is stored as uint16 holding the top half of a float32,
so widening is a 16-bit shift. float16 is IEEE half (NumPy's float16).

int8 is symmetric with one float32 scale per output channel (row):  w[r, c] = q[r, c] * scale[r],
scale[r] = max|w[r, :]| / 127. Per-row rather than per-block scales: the decode GEMV then applies
one multiply per output instead of one per 32 inputs, and on the test models the logit error is
within the same bound as llama.cpp's q8_0 (see docs in README "Weight types").
"""
import numpy as np

from .errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

# name -> (storage dtype, bytes per element)
STORAGE = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int8": np.dtype("i1"),
}
QUANTIZED = ("int8",)
WEIGHT_DTYPES = tuple(STORAGE)


def storage_dtype(name: str) -> np.dtype:
    try:
        return STORAGE[name]
    except KeyError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                           f"unknown weight dtype {name!r}; use one of {', '.join(WEIGHT_DTYPES)}") from None


def itemsize(name: str) -> int:
    return storage_dtype(name).itemsize


def quantize_rows(x: np.ndarray):
    """float32 [rows, cols] -> (int8 [rows, cols], float32 scales [rows]), symmetric per row."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / scales[..., None]), -127, 127).astype(np.int8)
    return q, scales


def widen(raw: np.ndarray, name: str, scales=None) -> np.ndarray:
    """Stored weights -> float32 (a view when already float32). int8 needs its row scales."""
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
    """float32 -> stored weights; bfloat16 rounds to nearest even, as torch does."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if name == "float32":
        return x
    if name == "float16":
        return x.astype(np.float16)
    if name == "bfloat16":
        bits = x.view(np.uint32)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        return ((bits + rounding) >> 16).astype(np.uint16)
    raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"unknown weight dtype {name!r}")
