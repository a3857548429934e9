"""The CUDA kernel sources, as the backend hands them to NVRTC (no CuPy needed to read them).

Each .cu is one cupy.RawModule. `#include "x.cuh"` lines of this folder are inlined here, so the
text NVRTC compiles is self-contained (CuPy's kernel cache keys on that text, so editing a header
recompiles what uses it). `toolchains/cuda` compiles the very same text with the same options.
"""
from __future__ import annotations

import os
import re

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))

# options the backend passes to cupy.RawModule (CuPy adds the -arch of the device it runs on)
NVRTC_OPTIONS = ("-std=c++17",)

# file -> the kernels the backend looks up in it (all must exist: the toolchain check verifies it)
WEIGHT_SUFFIXES = ("f32", "f16", "bf16", "i8")     # float32, float16, bfloat16 (as uint16), int8 (+ row scales)
KERNELS = {
    "dense.cu": (*(f"embed_{s}" for s in WEIGHT_SUFFIXES),
                 *(f"matmul_{kind}_{s}" for kind in ("skinny", "tiled") for s in WEIGHT_SUFFIXES),
                 "rmsnorm", "rope", "add", "f32_to_f16", "f16_to_f32_bias", "bias_add"),
    "attention.cu": ("kv_write", "paged_attention"),
    "moe.cu": ("moe_route", "moe_align", "moe_combine",
               *(f"moe_{op}_{kind}_{s}" for op in ("gate_up", "down") for kind in ("skinny", "tiled")
                 for s in WEIGHT_SUFFIXES)),
}

_PRAGMA_ONCE = re.compile(r'^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$', re.M)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)


def load_source(name: str, _seen=None) -> str:
    """The text of backends/cuda/<name> with its local includes inlined (each header once)."""
    seen = set() if _seen is None else _seen
    with open(os.path.join(KERNEL_DIR, name), encoding="utf-8") as f:
        text = f.read()

    def inline(m):
        inc = m.group(1)
        if inc in seen:
            return f"// (already included: {inc})"
        seen.add(inc)
        return f"// ---- begin {inc}\n{load_source(inc, seen)}\n// ---- end {inc}"

    text = _PRAGMA_ONCE.sub("", text)      # the inlined text is one file: nothing to guard
    return _INCLUDE.sub(inline, text)


def kernel_files():
    return tuple(KERNELS)
