"""Runtime knobs (DESIGN.md, "Runtime knobs"): explicit arguments beat environment variables, which
beat defaults. A bad value is an error at start, never a silent fallback."""
from __future__ import annotations

import os

import numpy as np

from .errors import ColibriError, COLIBRI_ERR_INVALID_ARGUMENT

KV_DTYPES = ("float32", "float16", "q8_0")    # Engine.open kv_dtype: the paged KV cache's storage types
                                                # (laid out by backends.base.kv_parts)

KNOBS = {
    # name: (default, parser description)
    "COLIBRI_BACKEND": ("auto", "one of auto, cpu, opencl, cuda, reference"),
    "COLIBRI_NUM_STREAMS": (1, "an integer from 1 to 64"),
    "COLIBRI_KV_BLOCK_SIZE": (16, "an integer from 1 to 65536"),
    "COLIBRI_ROUTER_WARMUP": (0, "an integer from 0 to 1000"),
    "COLIBRI_DISABLE_FP16": (0, "0 or 1"),
    "COLIBRI_NUM_THREADS": (0, "an integer from 0 to 4096 (0: all available cores)"),
    "COLIBRI_EXPERT_SLOTS": (0, "a non-negative integer (0: every expert resident, no slot pool) or auto "
                                "(sized from the memory free for the engine)"),
    "COLIBRI_SLOT_POLICY": ("lru", "one of lru, lfu, prefetch"),
    "COLIBRI_IO_THREADS": (4, "an integer from 0 to 64 (threads reading expert slots' misses; 0: the step reads them itself)"),
    "COLIBRI_DIRECT_IO": ("auto", "one of auto, on, off (O_DIRECT reads of expert slots; auto: probe-device's verdict)"),
    "COLIBRI_HOT_SET": (25, "an integer from 0 to 100 (percent of the expert slots pinned to the learned hot set)"),
    "COLIBRI_CUDA_GRAPHS": (1, "0 or 1 (0 runs CUDA decode steps on streams)"),
    "COLIBRI_INT8_ACTIVATIONS": (1, "0 or 1 (0: block formats decode with float32 activations on the cpu and opencl backends)"),
    "COLIBRI_CORE_THREAD": (1, "0 or 1 (0: the threads waiting for results run the steps, no core thread)"),
    "COLIBRI_TOP_K": (0, "an integer from 0 to the model's experts per layer (0: the model's experts per token)"),
    "COLIBRI_KV_DTYPE": ("float32", "one of float32, float16, q8_0 (the paged KV cache's storage type)"),
}
FLAGS = ("COLIBRI_DISABLE_FP16", "COLIBRI_CUDA_GRAPHS", "COLIBRI_INT8_ACTIVATIONS", "COLIBRI_CORE_THREAD")      # 0 or 1 (or a bool)
# upper bounds (far past any real use; a larger value is a mistake, refused before anything is sized by it)
UPPER = {"COLIBRI_NUM_STREAMS": 64, "COLIBRI_KV_BLOCK_SIZE": 1 << 16, "COLIBRI_ROUTER_WARMUP": 1000,
         "COLIBRI_NUM_THREADS": 4096, "COLIBRI_EXPERT_SLOTS": 1 << 24, "COLIBRI_TOP_K": 1 << 16,
         "COLIBRI_IO_THREADS": 64, "COLIBRI_HOT_SET": 100}
# Engine.open option -> its knob, for the options a backend may or may not take (Backend.OPTIONS)
BACKEND_KNOBS = {"num_streams": "COLIBRI_NUM_STREAMS", "disable_fp16": "COLIBRI_DISABLE_FP16",
                 "num_threads": "COLIBRI_NUM_THREADS", "cuda_graphs": "COLIBRI_CUDA_GRAPHS",
                 "int8_activations": "COLIBRI_INT8_ACTIVATIONS"}


def _parse(name, raw):
    default, what = KNOBS[name]
    if not isinstance(raw, (str, int, np.integer)) or isinstance(raw, bool) and name not in FLAGS:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r:.60}: expected {what}")
    if name == "COLIBRI_BACKEND":
        if raw not in ("auto", "cpu", "opencl", "cuda", "reference"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
        return raw
    if name == "COLIBRI_KV_DTYPE":
        if raw not in KV_DTYPES:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
        return raw
    if name == "COLIBRI_DIRECT_IO":
        if raw not in ("auto", "on", "off"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
        return raw
    if name == "COLIBRI_SLOT_POLICY":
        if raw not in ("lru", "lfu", "prefetch"):
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
        return raw
    if isinstance(raw, bool) and name in FLAGS:
        return int(raw)
    if name == "COLIBRI_EXPERT_SLOTS" and isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    try:
        v = int(str(raw).strip())
    except ValueError:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}") from None
    bad = (v < 1 if name in ("COLIBRI_NUM_STREAMS", "COLIBRI_KV_BLOCK_SIZE") else
           v not in (0, 1) if name in FLAGS else v < 0)
    bad = bad or v > UPPER.get(name, 1 << 24)
    if bad:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, f"{name}={raw!r}: expected {what}")
    return v


def device_profile_path() -> str:
    """Where `colibri probe-device` writes this machine's profile (COLIBRI_CACHE, else ~/.cache/colibri)."""
    root = os.environ.get("COLIBRI_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "colibri")
    return os.path.join(root, "device-this.json")


def resolve(name: str, explicit=None):
    """explicit argument > environment > default, validated."""
    if explicit is not None:
        return _parse(name, explicit)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return KNOBS[name][0]
    return _parse(name, raw)


def backend_options(backend_cls, explicit: dict):
    """The options for a backend class: -> (options, not_applicable).
    An option given explicitly that the backend does not take is COLIBRI_ERR_INVALID_ARGUMENT naming
    it; environment values and defaults that do not apply are left out and reported (knob -> where
    the value came from), for the backend's describe(). Every knob is validated either way."""
    takes = backend_cls.OPTIONS
    opts, skipped = {}, {}
    for name, knob in BACKEND_KNOBS.items():
        v = explicit.get(name)
        value = resolve(knob, v)
        if name in takes:
            opts[name] = bool(value) if knob in FLAGS else value
        elif v is not None:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"{name}={v!r}: the {backend_cls.name} backend does not take this option "
                               f"(it takes: {', '.join(takes) or 'none'}); leave it out or pick another backend")
        else:
            raw = os.environ.get(knob)
            skipped[name] = f"{knob}={raw}" if raw else "default"
    for name, v in explicit.items():
        if name in BACKEND_KNOBS or v is None:
            continue
        if name not in takes:
            raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                               f"{name}={v!r}: the {backend_cls.name} backend does not take this option "
                               f"(it takes: {', '.join(takes) or 'none'})")
        opts[name] = v
    return opts, skipped
