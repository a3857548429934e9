"""The CUDA kernel sources, as the backend hands them to NVRTC (no CuPy needed to read them).

Each .cu is one cupy.RawModule. `#include "x.cuh"` lines of this folder are inlined here, so the
text NVRTC compiles is self-contained (CuPy's kernel cache keys on that text, so editing a header
recompiles what uses it). `toolchains/cuda` compiles the very same text with the same options.

Constants both the host and the kernels need are defined here once (DEFINES) and passed to every
compiler as -D options (`python3 backends/cuda/sources.py --defines` prints them for nvcc).
"""
from __future__ import annotations

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
                 "q2_k", "q3_k", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0", "nvfp4")

# file -> the kernels the backend looks up in it (all must exist: the toolchain check verifies it)
KERNELS = {
    "dense.cu": ("embed_f32", "embed_f16", "embed_bf16", "embed_i8",
                 "matmul_skinny_f32", "matmul_skinny_f16", "matmul_skinny_bf16", "matmul_skinny_i8",
                 "matmul_tiled_f32", "matmul_tiled_f16", "matmul_tiled_bf16", "matmul_tiled_i8",
                 "head_matmul_f32", "head_matmul_f16", "head_matmul_bf16",
                 "rmsnorm", "rope", "add", "scale", "f32_to_f16", "f16_to_f32_bias", "bias_add",
                 *(f"{k}_{f}" for f in BLOCK_FORMATS for k in ("embed", "matmul_skinny", "matmul_tiled"))),
    "attention.cu": ("kv_write", "paged_attention", "latent_attention"),
    "recurrent.cu": ("causal_conv", "delta_rule", "gate_mul"),
    "moe.cu": ("moe_route", "moe_align", "moe_combine",
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


if __name__ == "__main__":          # `--defines`: the -D options, for nvcc in toolchains/cuda/Makefile
    if sys.argv[1:] != ["--defines"]:
        sys.exit("usage: sources.py --defines")
    print(" ".join(f"-D{k}={v}" for k, v in DEFINES.items()))
