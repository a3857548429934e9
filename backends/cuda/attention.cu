// Colibri Edge CUDA kernels: the paged KV cache (write, attention, latent attention). Output first.
// Cache of one layer: K, V [num_slots, Hkv, D] fp32, slot = block_table[seq, j / B] * B + j % B; latent
// attention's: C [num_slots, 1, Dc] (the latent) and R [num_slots, 1, Dr] (the rope key).
#include "colibri_common.cuh"

#define ATT_WARPS 4        // warps per (token, head) CTA, each walking every 4th key
// ATT_MAX_DPL (head_dim <= 32 * ATT_MAX_DPL = 512), LAT_WARPS, LAT_MAX_DPL and LAT_RPL (latent attention:
// Dc <= 32 * LAT_MAX_DPL, Dr <= 32 * LAT_RPL) come from sources.py DEFINES

// K[slots[t]] = k[t], V[slots[t]] = v[t];  k [T, WK], v [T, WV]: rows of Hkv*D, or latent attention's
// latent (WK = Dc) and rope key (WV = Dr)
// one thread per (t, c < W), W = max(WK, WV); grid ceil(T*W/256), block 256
extern "C" __global__ void kv_write(float* K, float* V, const float* k, const float* v, const int* slots,
                                    int T, int WK, int WV) {
    const int W = max(WK, WV);
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * W) return;
    const int t = (int)(i / W), c = (int)(i % W);
    const size_t slot = (size_t)slots[t];
    if (c < WK) K[slot * WK + c] = k[(size_t)t * WK + c];
    if (c < WV) V[slot * WV + c] = v[(size_t)t * WV + c];
}

// The NW warps' online softmax states merged into one output row (after the barrier that published
// them: running max sm_m[w], sum sm_l[w], accumulator sm_acc[w][0..D)):
//   o[d] = sum_w f_w acc_w[d] / sum_w f_w l_w,   f_w = exp(m_w - M), M = max_w m_w   (f_w = 0 when l_w = 0)
// warp 0 saw the first key (or a sink): M is finite
template <int NW, int W>
CE_DEV void merge_warps(float* o, const float* sm_m, const float* sm_l, const float (*sm_acc)[W], int D) {
    float M = sm_m[0];
    for (int w = 1; w < NW; ++w) M = fmaxf(M, sm_m[w]);
    float L = 0.f, f[NW];
    for (int w = 0; w < NW; ++w) {
        f[w] = sm_l[w] > 0.f ? expf(sm_m[w] - M) : 0.f;
        L += sm_l[w] * f[w];
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < NW; ++w) a += sm_acc[w][d] * f[w];
        o[d] = a / L;
    }
}

// Causal attention through block tables, fp32, for prefill chunks and decode steps alike:
//   token t of sequence s = seq_index[t] at position p = positions[t], query head h, KV head
//   h / (Hq/Hkv), keys j = lo..p, lo = max(0, p - window + 1) (window 0: lo = 0; window < 0: Llama 4's chunks
//   of -window, lo = p - p mod -window):
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
    const int lo = window > 0 ? max(0, n - window) : window < 0 ? (n - 1) - (n - 1) % -window : 0;
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
    merge_warps<ATT_WARPS>(out + ((size_t)t * Hq + h) * D, sm_m, sm_l, sm_acc, D);   // warp 0 saw key lo
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

// Multi-head latent attention in the latent space (DeepSeek-V2's MLA, absorbed), causal, through block
// tables, fp32: every head attends to the one cache row of each position, the latent c_j = C[slot(j)]
// (the keys' and the values' compressed form) and the rope key r_j = R[slot(j)]:
//   token t of sequence s = seq_index[t] at position p = positions[t], head h, positions j = 0..p:
//   s_j = scale * (q[t,h] . c_j + q_rope[t,h] . r_j)
//   out[t,h] = sum_j softmax_j(s) c_j
// q, out [T,Hq,Dc]; q_rope [T,Hq,Dr]; C [slots,1,Dc], R [slots,1,Dr]; tables [S, tstride] int32;
// Dc <= 32 * LAT_MAX_DPL, Dr <= 32 * LAT_RPL.
// grid (Hq, T), block 32*LAT_WARPS: paged_attention's scheme. Each warp keeps an online softmax over
// every LAT_WARPS-th position (a decode step's positions split LAT_WARPS ways: shorter chains of dependent
// loads at long contexts); lanes split Dc (DPL values each: the smallest of 4, 8, 16, LAT_MAX_DPL
// that covers Dc, chosen per launch) and Dr (LAT_RPL each); each latent is read once per head and
// serves as key and value from registers. The heads' CTAs read the same rows (through L2).
static_assert(LAT_MAX_DPL >= 16, "LAT_MAX_DPL: latent_attention instantiates DPL 4, 8, 16 and LAT_MAX_DPL");
template <int DPL>
CE_DEV void latent_attend(float* sm_m, float* sm_l, float (*sm_acc)[32 * LAT_MAX_DPL], float* out, const float* q,
                          const float* q_rope, const float* C, const float* R, const int* tables,
                          const int* seq_index, const int* positions, int Hq, int Dc, int Dr, int B, int tstride,
                          float scale) {
    const int h = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = positions[t] + 1;
    const int* table = tables + (size_t)seq_index[t] * tstride;
    const float* qv = q + ((size_t)t * Hq + h) * Dc;
    const float* qrv = q_rope + ((size_t)t * Hq + h) * Dr;
    float qc[DPL], qr[LAT_RPL], acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        qc[i] = d < Dc ? qv[d] : 0.f;
        acc[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < LAT_RPL; ++i) {
        const int d = lane + 32 * i;
        qr[i] = d < Dr ? qrv[d] : 0.f;
    }
    float m = neg_inf(), l = 0.f;
    for (int j = warp; j < n; j += LAT_WARPS) {
        const size_t slot = (size_t)table[j / B] * B + j % B;
        const float* c = C + slot * Dc;
        const float* r = R + slot * Dr;
        float cv[DPL], dot = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            cv[i] = d < Dc ? c[d] : 0.f;
            dot += qc[i] * cv[i];
        }
#pragma unroll
        for (int i = 0; i < LAT_RPL; ++i) {
            const int d = lane + 32 * i;
            if (d < Dr) dot += qr[i] * r[d];
        }
        const float s = warp_sum(dot) * scale;
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * corr + p * cv[i];
        m = mn;
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int i = 0; i < DPL; ++i) sm_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    merge_warps<LAT_WARPS>(out + ((size_t)t * Hq + h) * Dc, sm_m, sm_l, sm_acc, Dc);   // warp 0 saw position 0
}
extern "C" __global__ void latent_attention(float* out, const float* q, const float* q_rope, const float* C,
                                            const float* R, const int* tables, const int* seq_index,
                                            const int* positions, int Hq, int Dc, int Dr, int B, int tstride,
                                            float scale) {
    __shared__ float sm_m[LAT_WARPS], sm_l[LAT_WARPS];
    __shared__ float sm_acc[LAT_WARPS][32 * LAT_MAX_DPL];
    if (Dc <= 128)                                   // Dc is uniform: the whole CTA takes one branch
        latent_attend<4>(sm_m, sm_l, sm_acc, out, q, q_rope, C, R, tables, seq_index, positions, Hq, Dc, Dr, B,
                         tstride, scale);
    else if (Dc <= 256)
        latent_attend<8>(sm_m, sm_l, sm_acc, out, q, q_rope, C, R, tables, seq_index, positions, Hq, Dc, Dr, B,
                         tstride, scale);
    else if (Dc <= 512)
        latent_attend<16>(sm_m, sm_l, sm_acc, out, q, q_rope, C, R, tables, seq_index, positions, Hq, Dc, Dr, B,
                          tstride, scale);
    else
        latent_attend<LAT_MAX_DPL>(sm_m, sm_l, sm_acc, out, q, q_rope, C, R, tables, seq_index, positions, Hq, Dc,
                                   Dr, B, tstride, scale);
}
