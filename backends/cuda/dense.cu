// Colibri Edge CUDA kernels: the dense ops of a layer (embed, matmul, rmsnorm, rope, add) and the
// casts around cuBLAS. Output first; T tokens, H hidden, N/K matmul out/in, D head_dim.
#include "colibri_gemm.cuh"

// out[T,H] = table[ids[t], :] (* scales[ids[t]] for int8)   (table [V,H] fp32/fp16/bf16/int8, widened)
// grid (ceil(H/256), T), block 256
#define CE_EMBED(SUF, WT)                                                                           \
    extern "C" __global__ void embed_##SUF(float* out, const WT* table, const float* scales, const int* ids, \
                                           int T, int H) {                                           \
        const int t = blockIdx.y, h = blockIdx.x * blockDim.x + threadIdx.x;                       \
        if (t >= T || h >= H) return;                                                               \
        const float v = to_f32(table[(size_t)ids[t] * H + h]);                                      \
        out[(size_t)t * H + h] = scales ? v * scales[ids[t]] : v;                                   \
    }
CE_EMBED(f32, float)
CE_EMBED(f16, half_t)
CE_EMBED(bf16, bf16_t)
CE_EMBED(i8, i8_t)

// out[T,N] = x[T,K] @ (W[N,K] * scales[N, None])^T (+ bias[N])     (scales: int8 only, else null)
// skinny: grid (ceil(N/8), ceil(T/8)), block 256      tiled: grid (ceil(N/64), ceil(T/64)), block 256
#define CE_MATMUL(SUF, WT)                                                                          \
    extern "C" __global__ void matmul_skinny_##SUF(float* out, const float* x, const WT* W,          \
                                                   const float* scales, const float* bias, int T,    \
                                                   int N, int K) {                                   \
        const int row0 = blockIdx.y * SK_ROWS;                                                      \
        skinny_tile<WT, 0>(out, x, nullptr, 1, row0, min(SK_ROWS, T - row0), W, nullptr, scales,    \
                           nullptr, bias, N, K, blockIdx.x * SK_WARPS);                              \
    }                                                                                               \
    extern "C" __global__ void matmul_tiled_##SUF(float* out, const float* x, const WT* W,           \
                                                  const float* scales, const float* bias, int T,     \
                                                  int N, int K) {                                    \
        const int row0 = blockIdx.y * TBM;                                                          \
        tiled_tile<WT, 0>(out, x, nullptr, 1, row0, min(TBM, T - row0), W, nullptr, scales, nullptr, \
                          bias, N, K, blockIdx.x * TBN);                                            \
    }
CE_MATMUL(f32, float)
CE_MATMUL(f16, half_t)
CE_MATMUL(bf16, bf16_t)
CE_MATMUL(i8, i8_t)

// out[R,D] = x / sqrt(mean(x^2) + eps) * w[D]     (in place allowed: out == x)
// grid R, block 32..1024 (a multiple of 32)
extern "C" __global__ void rmsnorm(float* out, const float* x, const float* w, int R, int D, float eps) {
    __shared__ float part[32];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = blockDim.x >> 5;
    const float* xr = x + (size_t)row * D;
    float s = 0.f;
    for (int i = tid; i < D; i += blockDim.x) s += xr[i] * xr[i];
    s = warp_sum(s);
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        float v = lane < nwarps ? part[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) part[0] = v;
    }
    __syncthreads();
    const float denom = sqrtf(part[0] / (float)D + eps);
    float* o = out + (size_t)row * D;
    for (int i = tid; i < D; i += blockDim.x) o[i] = xr[i] / denom * w[i];
}

// Rotary embedding, rotate-half convention, on x[T,heads,D] at positions[T] (in place allowed):
//   f_i = theta^(-2i/D);  out_i = x_i cos(p f_i) - x_{i+D/2} sin(p f_i)
//                         out_{i+D/2} = x_{i+D/2} cos(p f_i) + x_i sin(p f_i),   i < D/2
// one thread per (t, head, i); grid ceil(T*heads*D/2 / 256), block 256
extern "C" __global__ void rope(float* out, const float* x, const int* positions, int T, int heads, int D,
                                float theta) {
    const int half = D >> 1;
    const long long n = (long long)T * heads * half;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n) return;
    const int i = (int)(g % half);
    const long long th = g / half;                   // t * heads + head
    const int t = (int)(th / heads);
    // f_i as NumPy computes it in fp32: e = fp32(2i/D), p = fp32(theta^e) (rounded once, from a
    // double pow), f = 1/p -- at positions in the thousands one ulp of f moves the angle visibly
    const float e = (float)(2 * i) / (float)D;
    const float p32 = (float)pow((double)theta, (double)e);
    const float inv = 1.0f / p32;
    const float ang = (float)positions[t] * inv;
    float sn, cs;
    sincosf(ang, &sn, &cs);
    const size_t base = (size_t)th * D;
    const float x1 = x[base + i], x2 = x[base + i + half];
    out[base + i] = x1 * cs - x2 * sn;
    out[base + i + half] = x2 * cs + x1 * sn;
}

// out[T,H] = a + b    or, with gate [T,1],  out = a + sigmoid(gate[t]) * b  (written b / (1 + e^-g))
// grid ceil(T*H/256), block 256
extern "C" __global__ void add(float* out, const float* a, const float* b, const float* gate, int T, int H) {
    const long long n = (long long)T * H;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (gate) out[i] = a[i] + b[i] / (1.0f + expf(-gate[i / H]));
    else out[i] = a[i] + b[i];
}

// y16[n] = fp16(x[n])   (activations into cuBLAS)      grid ceil(n/256), block 256
extern "C" __global__ void f32_to_f16(half_t* y, const float* x, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}

// out[T,N] = fp32(y16[T,N]) (+ bias[N])   (cuBLAS fp16 results back)   grid ceil(T*N/256), block 256
extern "C" __global__ void f16_to_f32_bias(float* out, const half_t* y, const float* bias, int T, int N) {
    const long long n = (long long)T * N;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = h2f(y[i]);
    out[i] = bias ? v + bias[i % N] : v;
}

// out[T,N] += bias[N]   (after an fp32 cuBLAS GEMM)   grid ceil(T*N/256), block 256
extern "C" __global__ void bias_add(float* out, const float* bias, int T, int N) {
    const long long n = (long long)T * N;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += bias[i % N];
}
