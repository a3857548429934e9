"""Weight types as stored in colibri_weights.bin, and how they widen to float32.

bfloat16 has no NumPy dtype: it is stored as uint16 holding the top half of a float32,
so widening is a 16-bit shift. float16 is IEEE half (NumPy's float16).
"""
import numpy as np

from .errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

# name -> (storage dtype, bytes per element)
STORAGE = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}
WEIGHT_DTYPES = tuple(STORAGE)


def storage_dtype(name: str) -> np.dtype:
    try:
        return STORAGE[name]
    except KeyError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                           f"unknown weight dtype {name!r}; use one of {', '.join(WEIGHT_DTYPES)}") from None


def itemsize(name: str) -> int:
    return storage_dtype(name).itemsize


def widen(raw: np.ndarray, name: str) -> np.ndarray:
    """Stored weights -> float32 (a view when already float32)."""
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
