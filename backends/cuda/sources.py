"""The CUDA kernel sources, as the backend hands them to NVRTC (no CuPy needed to read them).

Each .cu is one cupy.RawModule. `#include "x.cuh"` lines of this folder are inlined here, so the
text NVRTC compiles is self-contained (CuPy's kernel cache keys on that text, so editing a header
recompiles what uses it). `toolchains/cuda` compiles the very same text with the same options.

Constants both the host and the kernels need are defined here once (DEFINES) and passed to every
compiler as -D options (`python3 backends/cuda/sources.py --defines` prints them for nvcc).

One header is no file of this folder: iq_grids.cuh, the lattice i-quants' grids and KSIGNS, is written
from the data (quant.iq_grid, quant.KSIGNS) by iq_grids_header, which load_source inlines like a file;
for nvcc, toolchains/cuda writes it into its build folder (`sources.py --iq-grids`).
"""
from __future__ import annotations

import functools
import os
import re
import sys

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))

DEFINES = {
    "SK_ROWS": 8,          # rows per skinny GEMM CTA: the block size BM of a skinny MoE plan
    "SK_WARPS": 8,         # output columns per skinny CTA (one warp each, 256 threads)
    "TBM": 64,             # rows per tiled GEMM CTA: BM of a tiled MoE plan
    "TBN": 64,             # output columns per tiled CTA
    "ATT_MAX_DPL": 16,     # head_dim values per lane in paged attention: head_dim <= 32 * 16 (Gemma 4: 512)
    "LAT_WARPS": 8,        # warps per (head, token) CTA of latent attention, each walking every 8th position
    "LAT_MAX_DPL": 32,     # latent values per lane in latent attention: kv_lora_rank <= 32 * 32 (DeepSeek: 512)
    "LAT_RPL": 4,          # rope key values per lane in latent attention: qk_rope_head_dim <= 32 * 4 (DeepSeek: 64)
    "ROUTE_MAXJ": 16,      # experts per lane in moe_route: E <= 32 * 16
    "ALIGN_THREADS": 256,  # threads of the one-CTA moe_align
    "ALIGN_EPT": 4,        # experts per align thread: E <= 256 * 4
    "ACT_SILU": 0,         # FFN activation codes of the MODE 1 tiles (expert_act): SwiGLU,
    "ACT_SWIGLU_OAI": 1,   # gpt-oss's clamped SwiGLU,
    "ACT_GELU_TANH": 2,    # GeGLU (Gemma)
    "CONV_MAX_K": 8,       # causal_conv taps: K <= 8 (Qwen3.5 / Qwen3-Next: 4), the window in registers
    "DELTA_CHUNK": 16,     # tokens per chunk of delta_rule's chunked (prefill) form, as the reference's
    "DELTA_MAX_DK": 256,   # delta_rule key head dim: the chunk's q and k rows in shared memory (32 KiB at 256)
    "DELTA_MAX_DV": 256,   # delta_rule value head dim: a thread per value column, one block per (sequence, head)
}
# base.Act.kind -> its code (None: plain SwiGLU)
ACT_KINDS = {"silu": DEFINES["ACT_SILU"], "swiglu_oai": DEFINES["ACT_SWIGLU_OAI"], "gelu_tanh": DEFINES["ACT_GELU_TANH"]}
MAX_HEAD_DIM = 32 * DEFINES["ATT_MAX_DPL"]
MAX_LATENT_DIM, MAX_LATENT_ROPE = 32 * DEFINES["LAT_MAX_DPL"], 32 * DEFINES["LAT_RPL"]
MAX_ROUTE_EXPERTS = 32 * DEFINES["ROUTE_MAXJ"]
MAX_ALIGN_EXPERTS = DEFINES["ALIGN_THREADS"] * DEFINES["ALIGN_EPT"]
CONV_MAX_K, DELTA_MAX_DK, DELTA_MAX_DV = DEFINES["CONV_MAX_K"], DEFINES["DELTA_MAX_DK"], DEFINES["DELTA_MAX_DV"]

# options the backend passes to cupy.RawModule (CuPy adds the -arch of the device it runs on)
NVRTC_OPTIONS = ("-std=c++17", *(f"-D{k}={v}" for k, v in DEFINES.items()))

BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q4_k", "q5_k", "q6_k",   # quant.BLOCK's
                 "q2_k", "q3_k", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0", "nvfp4",
                 "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
# the lattice grids (quant.iq_grid's names) as the kernels name them: <name>_grid
IQ_GRIDS = ("iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s")

# file -> the kernels the backend looks up in it (all must exist: the toolchain check verifies it)
KERNELS = {
    "dense.cu": ("embed_f32", "embed_f16", "embed_bf16", "embed_i8",
                 "matmul_skinny_f32", "matmul_skinny_f16", "matmul_skinny_bf16", "matmul_skinny_i8",
                 "matmul_tiled_f32", "matmul_tiled_f16", "matmul_tiled_bf16", "matmul_tiled_i8",
                 "head_matmul_f32", "head_matmul_f16", "head_matmul_bf16",
                 "rmsnorm", "layernorm", "pos_scale", "rope", "add", "scale", "f32_to_f16", "f16_to_f32_bias", "bias_add",
                 *(f"{k}_{f}" for f in BLOCK_FORMATS for k in ("embed", "matmul_skinny", "matmul_tiled"))),
    "attention.cu": ("kv_write", "paged_attention", "latent_attention"),
    "recurrent.cu": ("causal_conv", "delta_rule", "ssm_scan", "gate_mul"),
    "moe.cu": ("moe_route", "moe_sparsemixer", "moe_align", "moe_combine",
               "moe_gate_up_skinny_f32", "moe_gate_up_skinny_f16", "moe_gate_up_skinny_bf16", "moe_gate_up_skinny_i8",
               "moe_down_skinny_f32", "moe_down_skinny_f16", "moe_down_skinny_bf16", "moe_down_skinny_i8",
               "moe_gate_up_tiled_f32", "moe_gate_up_tiled_f16", "moe_gate_up_tiled_bf16", "moe_gate_up_tiled_i8",
               "moe_down_tiled_f32", "moe_down_tiled_f16", "moe_down_tiled_bf16", "moe_down_tiled_i8",
               *(f"moe_{k}_{f}" for f in BLOCK_FORMATS for k in ("gate_up_skinny", "down_skinny", "gate_up_tiled",
                                                                  "down_tiled"))),
}

# weight storage -> the kernels of each weight-reading op (bfloat16 is stored as uint16)
EMBED = {"float32": "embed_f32", "float16": "embed_f16", "bfloat16": "embed_bf16", "int8": "embed_i8"}
MATMUL_SKINNY = {"float32": "matmul_skinny_f32", "float16": "matmul_skinny_f16", "bfloat16": "matmul_skinny_bf16",
                 "int8": "matmul_skinny_i8"}
MATMUL_TILED = {"float32": "matmul_tiled_f32", "float16": "matmul_tiled_f16", "bfloat16": "matmul_tiled_bf16",
                "int8": "matmul_tiled_i8"}
HEAD_MATMUL = {"float32": "head_matmul_f32", "float16": "head_matmul_f16", "bfloat16": "head_matmul_bf16"}
for _f in BLOCK_FORMATS:
    EMBED[_f], MATMUL_SKINNY[_f], MATMUL_TILED[_f] = f"embed_{_f}", f"matmul_skinny_{_f}", f"matmul_tiled_{_f}"
MOE_SKINNY = {"float32": ("moe_gate_up_skinny_f32", "moe_down_skinny_f32"),
              "float16": ("moe_gate_up_skinny_f16", "moe_down_skinny_f16"),
              "bfloat16": ("moe_gate_up_skinny_bf16", "moe_down_skinny_bf16"),
              "int8": ("moe_gate_up_skinny_i8", "moe_down_skinny_i8")}
MOE_TILED = {"float32": ("moe_gate_up_tiled_f32", "moe_down_tiled_f32"),
             "float16": ("moe_gate_up_tiled_f16", "moe_down_tiled_f16"),
             "bfloat16": ("moe_gate_up_tiled_bf16", "moe_down_tiled_bf16"),
             "int8": ("moe_gate_up_tiled_i8", "moe_down_tiled_i8")}
for _f in BLOCK_FORMATS:
    MOE_SKINNY[_f] = (f"moe_gate_up_skinny_{_f}", f"moe_down_skinny_{_f}")
    MOE_TILED[_f] = (f"moe_gate_up_tiled_{_f}", f"moe_down_tiled_{_f}")


def _quant():
    """colibri_edge.model.quant: the package's, or, where it is not installed (sources.py run on its own by
    toolchains/cuda), this checkout's quant.py loaded alone (it needs only numpy)."""
    import importlib
    try:
        return importlib.import_module("colibri_edge.model.quant")
    except ImportError:
        import importlib.util
        path = os.path.join(os.path.dirname(os.path.dirname(KERNEL_DIR)), "colibri_edge", "model", "quant.py")
        spec = importlib.util.spec_from_file_location("colibri_quant", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


@functools.lru_cache(maxsize=None)
def iq_grids_header() -> str:
    """iq_grids.cuh: the lattice grids (quant.iq_grid) as __device__ const arrays <name>_grid, a row's values
    packed little-endian (8 values: unsigned long long, 4: unsigned int; the first value the lowest byte,
    IQ1's -1 as 0xff), and iq_ksigns (quant.KSIGNS). Global memory, not __constant__: a warp's lanes
    read different entries, which constant memory would serialise."""
    q = _quant()
    out = ["// iq_grids.cuh: written by backends/cuda/sources.py (iq_grids_header) from colibri_edge/model/quant.py's",
           "// iq_grid and KSIGNS; not a file to edit", "#pragma once"]
    for name in IQ_GRIDS:
        rows = q.iq_grid(name)
        w = rows.shape[1]
        vals = [int.from_bytes(bytes(int(v) & 255 for v in r), "little") for r in rows]
        ty, suf, digits = ("unsigned long long", "ull", 16) if w == 8 else ("unsigned int", "u", 8)
        body = ",\n".join(", ".join(f"0x{v:0{digits}x}{suf}" for v in vals[i:i + 8]) for i in range(0, len(vals), 8))
        out.append(f"__device__ const {ty} {name}_grid[{len(vals)}] = {{\n{body}}};")
    ks = ",\n".join(", ".join(str(int(v)) for v in q.KSIGNS[i:i + 16]) for i in range(0, len(q.KSIGNS), 16))
    out.append(f"__device__ const unsigned char iq_ksigns[{len(q.KSIGNS)}] = {{\n{ks}}};")
    return "\n".join(out) + "\n"


# headers written from data rather than read from this folder: name -> the function that writes them
GENERATED = {"iq_grids.cuh": iq_grids_header}

_PRAGMA_ONCE = re.compile(r'^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$', re.M)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)


def load_source(name: str, _seen=None) -> str:
    """The text of backends/cuda/<name> with its local includes inlined (each header once; GENERATED ones
    written from their data)."""
    seen = set() if _seen is None else _seen
    if name in GENERATED:
        text = GENERATED[name]()
    else:
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


if __name__ == "__main__":          # for nvcc in toolchains/cuda/Makefile
    if sys.argv[1:] == ["--defines"]:     # the -D options
        print(" ".join(f"-D{k}={v}" for k, v in DEFINES.items()))
    elif sys.argv[1:] == ["--iq-grids"]:  # iq_grids.cuh (numpy and colibri_edge's quant.py)
        sys.stdout.write(iq_grids_header())
    else:
        sys.exit("usage: sources.py --defines | --iq-grids")
