// Colibri Edge CUDA kernels: the two GEMM tiles shared by dense matmuls and the grouped MoE FFN.
//
// Both compute, for a run of rows r < nrows of one weight matrix (one expert), and a range of
// output columns:
//     MODE 0 (plain)  : out[row0 + r, c] = (A[arow(r)] . W0[c]) * S0[c]  (+ bias[c])
//     MODE 1 (SwiGLU) : out[row0 + r, c] = silu((A[arow(r)] . W0[c]) * S0[c]) * ((A[arow(r)] . W1[c]) * S1[c])
//     arow(r) = gather ? gather[row0 + r] / gdiv : row0 + r        (token of a sorted MoE row)
//     S0/S1: int8 row scales [N], or null (= 1)
// shapes: A [*, K] fp32, W0/W1 [N, K] (fp32, fp16, bf16 or int8), bias [N] fp32 or null, out [*, N] fp32.
// Accumulation is fp32 in both; weights are widened as they are read.
//
// skinny: 8 rows x 8 columns per 256-thread CTA, one warp per column streaming its weight row
//         once while the (<= 8) activation rows sit in shared memory. Decode-sized steps: the
//         weights are read once from DRAM, which is what bounds decode speed.
// tiled : 64 x 64 outputs per 256-thread CTA (4 x 4 per thread), K in steps of 16 through shared
//         memory. Prefill-sized steps: each weight element feeds 64 rows.
#pragma once
#include "colibri_common.cuh"

// SK_ROWS (rows per skinny CTA = block size BM of a skinny MoE plan), SK_WARPS (columns per skinny
// CTA, 256 threads), TBM (rows per tiled CTA = BM of a tiled plan) and TBN (columns per tiled CTA)
// come from sources.py DEFINES: the host sizes grids and plans with the same numbers.
#define SK_KC 512      // K chunk of activation rows staged in shared memory (8 x 512 fp32 = 16 KiB)
#define TBK 16         // K step of the tiled loop

// two consecutive weights (2-byte aligned for int8, 4 for fp16/bf16, 8 for fp32: K even, aligned matrix starts)
CE_DEV void load2(const float* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 8);
    const float2 v = *reinterpret_cast<const float2*>(p);
    a = v.x; b = v.y;
}
CE_DEV void load2(const half_t* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 4);
    const unsigned int v = *reinterpret_cast<const unsigned int*>(p);
    a = h2f((half_t)(v & 0xffffu)); b = h2f((half_t)(v >> 16));
}

CE_DEV void load2(const bf16_t* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 4);
    const unsigned int v = *reinterpret_cast<const unsigned int*>(p);
    a = __int_as_float((int)(v << 16)); b = __int_as_float((int)(v & 0xffff0000u));
}

CE_DEV void load2(const i8_t* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 2);
    const unsigned short v = *reinterpret_cast<const unsigned short*>(p);
    a = (float)(i8_t)(v & 0xffu); b = (float)(i8_t)(v >> 8);
}

template <typename WT, int MODE>
static __device__ void skinny_tile(float* CE_RESTRICT out, const float* CE_RESTRICT A, const int* gather, int gdiv,
                                   int row0, int nrows, const WT* W0, const WT* W1, const float* S0,
                                   const float* S1, const float* bias, int N, int K, int colbase) {
    __shared__ float xs[SK_ROWS][SK_KC];
    __shared__ int arow[SK_ROWS];
    const int tid = threadIdx.x, lane = tid & 31;
    const int col = colbase + (tid >> 5);
    const bool active = col < N;                     // uniform within a warp
    if (tid < SK_ROWS) arow[tid] = tid < nrows ? (gather ? gather[row0 + tid] / gdiv : row0 + tid) : 0;
    const WT* w0 = W0 + (size_t)(active ? col : 0) * K;
    const WT* w1 = MODE == 1 ? W1 + (size_t)(active ? col : 0) * K : w0;
    float acc0[SK_ROWS], acc1[SK_ROWS];
#pragma unroll
    for (int r = 0; r < SK_ROWS; ++r) { acc0[r] = 0.f; acc1[r] = 0.f; }

    for (int k0 = 0; k0 < K; k0 += SK_KC) {
        const int kc = min(SK_KC, K - k0);
        __syncthreads();                             // the previous chunk is consumed; arow is visible
        for (int r = 0; r < nrows; ++r) {
            const float* a = A + (size_t)arow[r] * K + k0;
            for (int kk = tid; kk < kc; kk += blockDim.x) xs[r][kk] = a[kk];
        }
        __syncthreads();
        if (!active) continue;
        if ((K & 1) == 0) {                          // kc is even too: pairs of weights per lane
            for (int kk = 2 * lane; kk < kc; kk += 64) {
                float g0, g1, u0 = 0.f, u1 = 0.f;
                load2(w0 + k0 + kk, g0, g1);
                if (MODE == 1) load2(w1 + k0 + kk, u0, u1);
#pragma unroll
                for (int r = 0; r < SK_ROWS; ++r) {
                    if (r < nrows) {
                        const float xa = xs[r][kk], xb = xs[r][kk + 1];
                        acc0[r] += xa * g0 + xb * g1;
                        if (MODE == 1) acc1[r] += xa * u0 + xb * u1;
                    }
                }
            }
        } else {
            for (int kk = lane; kk < kc; kk += 32) {
                const float g = to_f32(w0[k0 + kk]);
                const float u = MODE == 1 ? to_f32(w1[k0 + kk]) : 0.f;
#pragma unroll
                for (int r = 0; r < SK_ROWS; ++r) {
                    if (r < nrows) {
                        acc0[r] += xs[r][kk] * g;
                        if (MODE == 1) acc1[r] += xs[r][kk] * u;
                    }
                }
            }
        }
    }
    if (!active) return;                             // whole warps leave; no barrier follows
#pragma unroll
    for (int r = 0; r < SK_ROWS; ++r) {
        if (r < nrows) {                             // nrows is uniform in the CTA
            float s0 = warp_sum(acc0[r]);
            float s1 = MODE == 1 ? warp_sum(acc1[r]) : 0.f;
            if (lane == 0) {
                if (S0) s0 *= S0[col];
                if (MODE == 1 && S1) s1 *= S1[col];
                float v;
                if (MODE == 1) v = swiglu(s0, s1);
                else v = bias ? s0 + bias[col] : s0;
                out[(size_t)(row0 + r) * N + col] = v;
            }
        }
    }
}

template <typename WT, int MODE>
static __device__ void tiled_tile(float* CE_RESTRICT out, const float* CE_RESTRICT A, const int* gather, int gdiv,
                                  int row0, int nrows, const WT* W0, const WT* W1, const float* S0,
                                  const float* S1, const float* bias, int N, int K, int colbase) {
    __shared__ float As[TBK][TBM + 4];
    __shared__ float Bs0[TBK][TBN + 4];
    __shared__ float Bs1[TBK][TBN + 4];
    __shared__ int arow[TBM];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    if (tid < TBM) arow[tid] = tid < nrows ? (gather ? gather[row0 + tid] / gdiv : row0 + tid) : -1;
    float acc0[4][4], acc1[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) { acc0[i][j] = 0.f; acc1[i][j] = 0.f; }

    for (int k0 = 0; k0 < K; k0 += TBK) {
        __syncthreads();                             // previous tile consumed; arow is visible
#pragma unroll
        for (int i = 0; i < 4; ++i) {                // 64 x 16 elements of A and of each W, 4 per thread
            const int e = tid + 256 * i, r = e >> 4, kk = e & 15, k = k0 + kk;
            const int ar = arow[r];
            As[kk][r] = (ar >= 0 && k < K) ? A[(size_t)ar * K + k] : 0.f;
            const int c = colbase + r;               // here r indexes the 64 columns
            const bool ok = c < N && k < K;
            Bs0[kk][r] = ok ? to_f32(W0[(size_t)c * K + k]) : 0.f;
            if (MODE == 1) Bs1[kk][r] = ok ? to_f32(W1[(size_t)c * K + k]) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TBK; ++kk) {
            float a[4], b0[4], b1[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                b0[j] = Bs0[kk][tx + 16 * j];
                b1[j] = MODE == 1 ? Bs1[kk][tx + 16 * j] : 0.f;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc0[i][j] += a[i] * b0[j];
                    if (MODE == 1) acc1[i][j] += a[i] * b1[j];
                }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = ty + 16 * i;
        if (r >= nrows) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = colbase + tx + 16 * j;
            if (c >= N) continue;
            const float g = S0 ? acc0[i][j] * S0[c] : acc0[i][j];
            float v;
            if (MODE == 1) v = swiglu(g, S1 ? acc1[i][j] * S1[c] : acc1[i][j]);
            else v = bias ? g + bias[c] : g;
            out[(size_t)(row0 + r) * N + c] = v;
        }
    }
}
