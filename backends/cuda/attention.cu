// Colibri Edge CUDA kernels: the paged KV cache (write, attention). Output first.
// Cache of one layer: K, V [num_slots, Hkv, D] fp32, slot = block_table[seq, j / B] * B + j % B.
#include "colibri_common.cuh"

#define ATT_WARPS 4        // warps per (token, head) CTA, each walking every 4th key
// ATT_MAX_DPL (head_dim <= 32 * ATT_MAX_DPL = 512) comes from sources.py DEFINES

// K[slots[t]] = k[t], V[slots[t]] = v[t];  k, v [T, Hkv*D] = [T, W]
// grid ceil(T*W/256), block 256
extern "C" __global__ void kv_write(float* K, float* V, const float* k, const float* v, const int* slots,
                                    int T, int W) {
    const long long n = (long long)T * W;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int t = (int)(i / W), c = (int)(i % W);
    const size_t dst = (size_t)slots[t] * W + c;
    K[dst] = k[i];
    V[dst] = v[i];
}

// Causal attention through block tables, fp32, for prefill chunks and decode steps alike:
//   token t of sequence s = seq_index[t] at position p = positions[t], query head h, KV head
//   h / (Hq/Hkv), keys j = lo..p, lo = max(0, p - window + 1) (window 0: lo = 0):
//   out[t,h] = sum_j softmax_j(scale * q[t,h] . K[slot(j)]) V[slot(j)]
//   sinks [Hq] (or null): a logit per head in the denominator only -- warp 0's online softmax
//   starts from m = sinks[h], l = 1, the others from -inf, 0
// q, out [T,Hq,D]; tables [S, tstride] int32. Every shape is the call's own: one engine may hold
// layers of different head_dim and KV heads (Gemma 4: sliding 256, full 512), up to 32 * ATT_MAX_DPL.
// grid (Hq, T), block 32*ATT_WARPS. Each warp keeps an online softmax (running max m, sum l,
// accumulator acc[D]) over its keys; lanes split D (DPL values each: the smallest of 2, 4, 8,
// ATT_MAX_DPL that covers D, chosen per launch); the warps' partial results merge at the end.
static_assert(ATT_MAX_DPL >= 8, "ATT_MAX_DPL: paged_attention instantiates DPL 2, 4, 8 and ATT_MAX_DPL");
template <int DPL>
CE_DEV void attend(float* sm_m, float* sm_l, float (*sm_acc)[32 * ATT_MAX_DPL], float* out, const float* q,
                   const float* K, const float* V, const int* tables, const int* seq_index, const int* positions,
                   int Hq, int Hkv, int D, int B, int tstride, float scale, int window, const float* sinks) {
    const int h = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (Hq / Hkv);
    const int n = positions[t] + 1;
    const int* table = tables + (size_t)seq_index[t] * tstride;
    const float* qv = q + ((size_t)t * Hq + h) * D;
    float qr[DPL], acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        qr[i] = d < D ? qv[d] : 0.f;
        acc[i] = 0.f;
    }
    float m = neg_inf(), l = 0.f;
    if (sinks && warp == 0) { m = sinks[h]; l = 1.f; }
    const int lo = window > 0 ? max(0, n - window) : 0;
    for (int j = lo + warp; j < n; j += ATT_WARPS) {
        const size_t base = ((size_t)table[j / B] * B + j % B) * Hkv * D + (size_t)kvh * D;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            if (d < D) dot += qr[i] * K[base + d];
        }
        const float s = warp_sum(dot) * scale;
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            acc[i] = acc[i] * corr + (d < D ? p * V[base + d] : 0.f);
        }
        m = mn;
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int i = 0; i < DPL; ++i) sm_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float M = sm_m[0];
    for (int w = 1; w < ATT_WARPS; ++w) M = fmaxf(M, sm_m[w]);   // warp 0 saw key lo (or a sink): M is finite
    float L = 0.f, f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; ++w) {
        f[w] = sm_l[w] > 0.f ? expf(sm_m[w] - M) : 0.f;
        L += sm_l[w] * f[w];
    }
    float* o = out + ((size_t)t * Hq + h) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w) a += sm_acc[w][d] * f[w];
        o[d] = a / L;
    }
}
extern "C" __global__ void paged_attention(float* out, const float* q, const float* K, const float* V,
                                           const int* tables, const int* seq_index, const int* positions,
                                           int T, int Hq, int Hkv, int D, int B, int tstride, float scale,
                                           int window, const float* sinks) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][32 * ATT_MAX_DPL];
    if (D <= 64)                                     // D is uniform: the whole CTA takes one branch
        attend<2>(sm_m, sm_l, sm_acc, out, q, K, V, tables, seq_index, positions, Hq, Hkv, D, B, tstride, scale,
                  window, sinks);
    else if (D <= 128)
        attend<4>(sm_m, sm_l, sm_acc, out, q, K, V, tables, seq_index, positions, Hq, Hkv, D, B, tstride, scale,
                  window, sinks);
    else if (D <= 256)
        attend<8>(sm_m, sm_l, sm_acc, out, q, K, V, tables, seq_index, positions, Hq, Hkv, D, B, tstride, scale,
                  window, sinks);
    else
        attend<ATT_MAX_DPL>(sm_m, sm_l, sm_acc, out, q, K, V, tables, seq_index, positions, Hq, Hkv, D, B, tstride,
                            scale, window, sinks);
}
