"""Runtime knobs (DESIGN.md, "Runtime knobs"): explicit arguments beat environment variables, which
beat defaults. A bad value is an error at start, never a silent fallback."""
from __future__ import annotations

import os

from .errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

KNOBS = {
    # name: (default, parser description)
    "COLIBRI_BACKEND": ("auto", "one of auto, cpu, opencl, cuda, reference"),
    "COLIBRI_NUM_STREAMS": (1, "a positive integer"),
    "COLIBRI_KV_BLOCK_SIZE": (16, "a positive integer"),
    "COLIBRI_ROUTER_WARMUP": (0, "a non-negative integer"),
    "COLIBRI_DISABLE_FP16": (0, "0 or 1"),
    "COLIBRI_NUM_THREADS": (0, "a positive integer (0: all available cores)"),
    "COLIBRI_EXPERT_SLOTS": (0, "a positive integer (0: every expert resident, no slot pool)"),
    "COLIBRI_SLOT_POLICY": ("lru", "one of lru, lfu, prefetch"),
}


def _parse(name, raw):
    default, what = KNOBS[name]
    if name == "COLIBRI_BACKEND":
        if raw not in ("auto", "cpu", "opencl", "cuda", "reference"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
        return raw
    if name == "COLIBRI_SLOT_POLICY":
        if raw not in ("lru", "lfu", "prefetch"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
        return raw
    try:
        v = int(str(raw).strip())
    except ValueError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}") from None
    bad = (v < 1 if name in ("COLIBRI_NUM_STREAMS", "COLIBRI_KV_BLOCK_SIZE") else
           v not in (0, 1) if name == "COLIBRI_DISABLE_FP16" else v < 0)
    if bad:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
    return v


def resolve(name: str, explicit=None):
    """explicit argument > environment > default, validated."""
    if explicit is not None:
        return _parse(name, explicit)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return KNOBS[name][0]
    return _parse(name, raw)
