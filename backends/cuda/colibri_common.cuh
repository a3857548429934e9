// Colibri Edge CUDA kernels: shared helpers (included by every .cu of backends/cuda).
//
// The kernels are compiled at run time by NVRTC through cupy.RawModule, so they include no
// header at all (no <cuda_fp16.h>, which a pip-only CuPy install may not find): fp16 storage is
// a raw 16-bit word (half_t) converted with one PTX instruction each way.
// Conventions: every kernel takes its output buffer(s) first; activations are fp32, row-major and
// contiguous; weights are fp32, fp16, bf16 or int8 ([out, in], row-major, as nn.Linear stores
// them), widened to fp32 as they are read; int8's per-row scales multiply each output once.
// The same source also builds as plain C++ for the CPU kernel emulator of toolchains/cuda/emu
// (there __CUDACC__ is undefined and the emulator's header supplies the intrinsics).
#pragma once

// Constants the host needs too are defined once, in sources.py DEFINES, and passed as -D options
// to NVRTC, to nvcc (toolchains/cuda) and to the emulator's g++: a build without them stops here.
#if !defined(SK_ROWS) || !defined(SK_WARPS) || !defined(TBM) || !defined(TBN) || !defined(ATT_MAX_DPL) || \
    !defined(LAT_WARPS) || !defined(LAT_MAX_DPL) || !defined(LAT_RPL) || !defined(ROUTE_MAXJ) ||            \
    !defined(ALIGN_THREADS) || !defined(ALIGN_EPT) || !defined(ACT_SILU) || !defined(ACT_SWIGLU_OAI) ||      \
    !defined(ACT_GELU_TANH)
#error "build with the -D options of backends/cuda/sources.py (python3 backends/cuda/sources.py --defines)"
#endif

typedef unsigned short half_t;     // IEEE fp16 bits
struct bf16_t { unsigned short v; };  // bfloat16 bits: the top half of an fp32
typedef signed char i8_t;          // int8 weights: w[r, c] = q[r, c] * scale[r]  (fp32 row scales)
typedef unsigned long long u64;

#ifdef __CUDACC__
#define CE_DEV __device__ __forceinline__
#define CE_RESTRICT __restrict__
#define CE_CHECK_ALIGNED(p, n)          // the emulator checks what the hardware would fault on

CE_DEV float h2f(half_t h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
CE_DEV half_t f2h(float f) {            // round to nearest even, as numpy's astype(float16)
    half_t h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}
#else
#define CE_DEV inline
#define CE_RESTRICT
#endif

CE_DEV float to_f32(float v) { return v; }
CE_DEV float to_f32(half_t v) { return h2f(v); }
CE_DEV float to_f32(bf16_t v) { return __int_as_float(((int)v.v) << 16); }
CE_DEV float to_f32(i8_t v) { return (float)v; }          // the row scale is applied per output

CE_DEV float neg_inf() { return __int_as_float(0xff800000); }

// silu(g) * u, written as the reference writes it: g / (1 + exp(-g)) * u
CE_DEV float swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// GeGLU's gate activation (Gemma's gelu_pytorch_tanh), in the reference's order of fp32 operations:
//   0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
CE_DEV float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// the FFN activation of a MODE 1 tile, by kind (the ACT_* codes of sources.py DEFINES, base.Act.kind):
//   ACT_SILU        SwiGLU: silu(g) * u                                            (alpha, limit unused)
//   ACT_SWIGLU_OAI  gpt-oss's clamped one, g' = min(g, limit), u' = clamp(u, -limit, limit):
//                   (u' + 1) * g' / (1 + exp(-alpha g'))
//   ACT_GELU_TANH   GeGLU: gelu_tanh(g) * u                                        (alpha, limit unused)
// g and u already include the expert's biases, when it has them
CE_DEV float expert_act(int kind, float g, float u, float alpha, float limit) {
    if (kind == ACT_GELU_TANH) return gelu_tanh(g) * u;
    if (kind != ACT_SWIGLU_OAI) return swiglu(g, u);
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

CE_DEV float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
CE_DEV float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
