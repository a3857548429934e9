// Colibri Edge CUDA kernels: the dense ops of a layer (embed, matmul, head_matmul, rmsnorm, rope, add, scale)
// and the casts around cuBLAS. Output first; T tokens, H hidden, N/K matmul out/in, D head_dim.
#include "colibri_gemm.cuh"

// out[T,H] = table[ids[t], :] (* scales[ids[t]] for int8)   (table [V,H] fp32/fp16/bf16/int8, widened)
// grid (ceil(H/256), T), block 256
template <typename WT>
CE_DEV void embed_rows(float* out, const WStore<WT>* table, const float* scales, const int* ids, int T, int H) {
    const int t = blockIdx.y, h = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T || h >= H) return;
    const float v = WFmt<WT>::one(WFmt<WT>::row(table, ids[t], H), h);
    out[(size_t)t * H + h] = scales ? v * scales[ids[t]] : v;
}
extern "C" __global__ void embed_f32(float* out, const float* table, const float* scales, const int* ids,
                                    int T, int H) {
    embed_rows<float>(out, table, scales, ids, T, H);
}
extern "C" __global__ void embed_f16(float* out, const half_t* table, const float* scales, const int* ids,
                                    int T, int H) {
    embed_rows<half_t>(out, table, scales, ids, T, H);
}
extern "C" __global__ void embed_bf16(float* out, const bf16_t* table, const float* scales, const int* ids,
                                    int T, int H) {
    embed_rows<bf16_t>(out, table, scales, ids, T, H);
}
extern "C" __global__ void embed_i8(float* out, const i8_t* table, const float* scales, const int* ids,
                                    int T, int H) {
    embed_rows<i8_t>(out, table, scales, ids, T, H);
}

// out[T,N] = x[T,K] @ (W[N,K] * scales[N, None])^T (+ bias[N])     (scales: int8 only, else null)
// skinny: grid (ceil(N/SK_WARPS), ceil(T/SK_ROWS)), block 256   tiled: grid (ceil(N/TBN), ceil(T/TBM)), block 256
template <typename WT>
CE_DEV void matmul_skinny(float* out, const float* x, const WStore<WT>* W, const float* scales, const float* bias, int T,
                          int N, int K) {
    const int row0 = blockIdx.y * SK_ROWS;
    skinny_tile<WT, 0>(out, x, nullptr, 1, row0, min(SK_ROWS, T - row0), W, nullptr, scales, nullptr, bias, N, K, K,
                       N, blockIdx.x * SK_WARPS);
}
template <typename WT>
CE_DEV void matmul_tiled(float* out, const float* x, const WStore<WT>* W, const float* scales, const float* bias, int T,
                         int N, int K) {
    const int row0 = blockIdx.y * TBM;
    tiled_tile<WT, 0>(out, x, nullptr, 1, row0, min(TBM, T - row0), W, nullptr, scales, nullptr, bias, N, K,
                      blockIdx.x * TBN);
}
extern "C" __global__ void matmul_skinny_f32(float* out, const float* x, const float* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_skinny<float>(out, x, W, scales, bias, T, N, K);
}
extern "C" __global__ void matmul_skinny_f16(float* out, const float* x, const half_t* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_skinny<half_t>(out, x, W, scales, bias, T, N, K);
}
extern "C" __global__ void matmul_skinny_bf16(float* out, const float* x, const bf16_t* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_skinny<bf16_t>(out, x, W, scales, bias, T, N, K);
}
extern "C" __global__ void matmul_skinny_i8(float* out, const float* x, const i8_t* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_skinny<i8_t>(out, x, W, scales, bias, T, N, K);
}
extern "C" __global__ void matmul_tiled_f32(float* out, const float* x, const float* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_tiled<float>(out, x, W, scales, bias, T, N, K);
}
extern "C" __global__ void matmul_tiled_f16(float* out, const float* x, const half_t* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_tiled<half_t>(out, x, W, scales, bias, T, N, K);
}
extern "C" __global__ void matmul_tiled_bf16(float* out, const float* x, const bf16_t* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_tiled<bf16_t>(out, x, W, scales, bias, T, N, K);
}
extern "C" __global__ void matmul_tiled_i8(float* out, const float* x, const i8_t* W, const float* scales,
                                           const float* bias, int T, int N, int K) {
    matmul_tiled<i8_t>(out, x, W, scales, bias, T, N, K);
}

// the block formats: the same three kernels each, W their bytes [N, K / B * NB]
#define COLIBRI_DENSE_BLOCK(SUF, TAG)                                                                            \
    extern "C" __global__ void embed_##SUF(float* out, const u8* table, const float* scales, const int* ids,     \
                                          int T, int H) {                                                      \
        embed_rows<TAG>(out, table, scales, ids, T, H);                                                        \
    }                                                                                                          \
    extern "C" __global__ void matmul_skinny_##SUF(float* out, const float* x, const u8* W, const float* scales, \
                                                  const float* bias, int T, int N, int K) {                   \
        matmul_skinny<TAG>(out, x, W, scales, bias, T, N, K);                                                  \
    }                                                                                                          \
    extern "C" __global__ void matmul_tiled_##SUF(float* out, const float* x, const u8* W, const float* scales,  \
                                                 const float* bias, int T, int N, int K) {                    \
        matmul_tiled<TAG>(out, x, W, scales, bias, T, N, K);                                                   \
    }
COLIBRI_DENSE_BLOCK(q8_0, q8_0_t) COLIBRI_DENSE_BLOCK(q4_0, q4_0_t) COLIBRI_DENSE_BLOCK(q4_1, q4_1_t)
COLIBRI_DENSE_BLOCK(q5_0, q5_0_t) COLIBRI_DENSE_BLOCK(q5_1, q5_1_t) COLIBRI_DENSE_BLOCK(mxfp4, mxfp4_t)
COLIBRI_DENSE_BLOCK(q4_k, q4_k_t) COLIBRI_DENSE_BLOCK(q5_k, q5_k_t) COLIBRI_DENSE_BLOCK(q6_k, q6_k_t)
COLIBRI_DENSE_BLOCK(q2_k, q2_k_t) COLIBRI_DENSE_BLOCK(q3_k, q3_k_t) COLIBRI_DENSE_BLOCK(iq4_nl, iq4_nl_t)
COLIBRI_DENSE_BLOCK(iq4_xs, iq4_xs_t) COLIBRI_DENSE_BLOCK(tq1_0, tq1_0_t) COLIBRI_DENSE_BLOCK(tq2_0, tq2_0_t)
COLIBRI_DENSE_BLOCK(nvfp4, nvfp4_t)
COLIBRI_DENSE_BLOCK(iq2_xxs, iq2_xxs_t) COLIBRI_DENSE_BLOCK(iq2_xs, iq2_xs_t) COLIBRI_DENSE_BLOCK(iq2_s, iq2_s_t)
COLIBRI_DENSE_BLOCK(iq3_xxs, iq3_xxs_t) COLIBRI_DENSE_BLOCK(iq3_s, iq3_s_t) COLIBRI_DENSE_BLOCK(iq1_s, iq1_s_t)
COLIBRI_DENSE_BLOCK(iq1_m, iq1_m_t)

// Per-head projections (latent attention's absorbed up-projections):
//   out[t,g,n] = sum_k x[t,g,k] * W[g,n,k]        x [T,G,K], out [T,G,N], W [G,N,K] fp32/fp16/bf16
// the skinny tile on head g's matrix W[g] [N,K], its rows t the tokens (x's rows G*K apart, out's
// G*N): a decode step streams every weight row once, coalesced, one warp per row
// grid (ceil(N/SK_WARPS), ceil(T/SK_ROWS), G), block 256
template <typename WT>
CE_DEV void head_rows(float* out, const float* x, const WT* W, int T, int G, int N, int K) {
    const int g = blockIdx.z, row0 = blockIdx.y * SK_ROWS;
    skinny_tile<WT, 0>(out + (size_t)g * N, x + (size_t)g * K, nullptr, 1, row0, min(SK_ROWS, T - row0),
                       W + (size_t)g * N * K, nullptr, nullptr, nullptr, nullptr, N, K, G * K, G * N,
                       blockIdx.x * SK_WARPS);
}
extern "C" __global__ void head_matmul_f32(float* out, const float* x, const float* W, int T, int G, int N, int K) {
    head_rows<float>(out, x, W, T, G, N, K);
}
extern "C" __global__ void head_matmul_f16(float* out, const float* x, const half_t* W, int T, int G, int N, int K) {
    head_rows<half_t>(out, x, W, T, G, N, K);
}
extern "C" __global__ void head_matmul_bf16(float* out, const float* x, const bf16_t* W, int T, int G, int N, int K) {
    head_rows<bf16_t>(out, x, W, T, G, N, K);
}

// the sum of every thread's s over the block (block of 32..1024, a multiple of 32), in every thread; part:
// 32 shared floats
CE_DEV float block_sum(float s, float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    s = warp_sum(s);
    __syncthreads();                                 // part may still be read from a previous sum
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        float v = lane < nwarps ? part[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) part[0] = v;
    }
    __syncthreads();
    return part[0];
}

// out[R,D] = x / sqrt(mean(x^2) + eps) * w[D]     (in place allowed: out == x)
// grid R, block 32..1024 (a multiple of 32)
extern "C" __global__ void rmsnorm(float* out, const float* x, const float* w, int R, int D, float eps) {
    __shared__ float part[32];
    const int tid = threadIdx.x;
    const float* xr = x + (size_t)blockIdx.x * D;
    float s = 0.f;
    for (int i = tid; i < D; i += blockDim.x) s += xr[i] * xr[i];
    const float denom = sqrtf(block_sum(s, part) / (float)D + eps);
    float* o = out + (size_t)blockIdx.x * D;
    for (int i = tid; i < D; i += blockDim.x) o[i] = xr[i] / denom * w[i];
}

// out[R,D] = (x - mean) / sqrt(mean((x - mean)^2) + eps) * w[D] + b[D]   (LayerNorm: Phi-3.5-MoE; in place allowed)
// grid R, block 32..1024 (a multiple of 32)
extern "C" __global__ void layernorm(float* out, const float* x, const float* w, const float* b, int R, int D,
                                     float eps) {
    __shared__ float part[32];
    const int row = blockIdx.x, tid = threadIdx.x;
    const float* xr = x + (size_t)row * D;
    float s = 0.f;
    for (int i = tid; i < D; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, part) / (float)D;
    float ss = 0.f;
    for (int i = tid; i < D; i += blockDim.x) { const float c = xr[i] - mean; ss += c * c; }
    const float sd = sqrtf(block_sum(ss, part) / (float)D + eps);
    float* o = out + (size_t)row * D;
    for (int i = tid; i < D; i += blockDim.x) o[i] = (xr[i] - mean) / sd * w[i] + b[i];
}

// Rotary embedding, rotate-half convention, on x[T,heads,D] at positions[T] (in place allowed):
//   f_i = theta^(-2i/D);  out_i = x_i cos(p f_i) - x_{i+D/2} sin(p f_i)
//                         out_{i+D/2} = x_{i+D/2} cos(p f_i) + x_i sin(p f_i),   i < D/2
// inv_freq [D/2]: a model's table of f_i (a scaled rope: YaRN), or null for theta's
// one thread per (t, head, i); grid ceil(T*heads*D/2 / 256), block 256
extern "C" __global__ void rope(float* out, const float* x, const int* positions, int T, int heads, int D,
                                float theta, const float* inv_freq) {
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
    const float inv = inv_freq ? inv_freq[i] : 1.0f / p32;
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

// out[n] = factor * x[n], or with cap > 0 the soft-capped cap * tanh(factor * x[n] / cap)   (Gemma's
// embedding scale / layer scalar; final logit soft-capping).  x, out [R, N] contiguous = [n]; in place allowed
// grid ceil(n/256), block 256
extern "C" __global__ void scale(float* out, const float* x, long long n, float factor, float cap) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i] * factor;
    out[i] = cap > 0.f ? cap * tanhf(v / cap) : v;
}

// out[t, i] = x[t, i] * (log1p(floor((positions[t] + 1) / floor_scale)) * attn_scale + 1), rows of N (Llama 4's
// attention temperature on its no-rope layers' queries; in place allowed)     grid (ceil(N/256), T), block 256
extern "C" __global__ void pos_scale(float* out, const float* x, const int* positions, int N, float floor_scale,
                                     float attn_scale) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const float f = log1pf(floorf(((float)positions[t] + 1.0f) / floor_scale)) * attn_scale + 1.0f;
    out[(size_t)t * N + i] = x[(size_t)t * N + i] * f;
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
