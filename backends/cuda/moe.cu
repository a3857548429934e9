// Colibri Edge CUDA kernels: the MoE layer on the device, with no host round trip:
//     route (fp32 softmax or sigmoid + top-k)  ->  align (tokens grouped by expert)  ->  grouped SwiGLU  ->  combine
// Output first. T tokens, k choices per token, A = T*k assignments, E experts, H hidden, I expert
// intermediate size.
#include "colibri_gemm.cuh"

// ROUTE_MAXJ (experts per lane: E <= 32 * ROUTE_MAXJ), ALIGN_THREADS and ALIGN_EPT (experts per
// align thread: E <= ALIGN_THREADS * ALIGN_EPT) come from sources.py DEFINES
#define ALIGN_CHUNK 2048   // assignments staged in shared memory per pass

// the warp's largest v, ties to the lower id i (0x7fffffff: none), into every lane
CE_DEV void warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
}

// Phi-3.5-MoE's inference router (base.py sparsemixer): per token, twice, the best remaining expert i (ties to
// the lower id) and its weight 1 / sum exp(s_e - s_i) over the remaining experts not dropped,
// (s_i - s_e) / max(|s_e|, s_i) > thr dropping one (thr = 2 jitter; a NaN ratio keeps it).
// logits [T,E]; ids, w [T,2]. A thread per token: grid ceil(T/128), block 128
extern "C" __global__ void moe_sparsemixer(int* out_ids, float* out_w, const float* logits, int T, int E, float thr) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* s = logits + (size_t)t * E;
    int first = -1;
    for (int j = 0; j < 2; ++j) {
        int best = -1;
        float m = 0.f;
        for (int e = 0; e < E; ++e)
            if (e != first && (best < 0 || s[e] > m)) { best = e; m = s[e]; }
        float tot = 0.f;
        for (int e = 0; e < E; ++e)
            if (e != first && !((m - s[e]) / fmaxf(fabsf(s[e]), m) > thr)) tot += expf(s[e] - m);
        out_ids[(size_t)t * 2 + j] = best;
        out_w[(size_t)t * 2 + j] = 1.0f / tot;
        first = best;
    }
}

// logits [T,E] fp32 -> ids [T,k] int32, w [T,k] fp32.
//   p = softmax(logits[t]), or with sigmoid p_e = 1 / (1 + exp(-logits[t,e]));
//   c = p (+ choice_bias[e] when choice_bias is not null: the choice only);
//   groups (ngroups > 1: DeepSeek / GLM, ngroups groups of E/ngroups consecutive experts): a group
//   scores the sum of its gtop (1 or 2) largest c, the largest first; the gkeep best groups stay (ties
//   to the lower group id), the other groups' experts leave the choice;
//   topk: the k largest c that stay in descending order, ties to the lower expert id, w = their p
//   (/ max(sum of the k chosen p, norm_min) when normalize) * scaling (routed_scaling_factor), then
//   * expert_scale[id] when expert_scale is not null (Gemma 4's per_expert_scale);
//   gated (k == E): ids = 0..E-1, w = p.
// one warp per token, lane l holding experts l + 32 j: grid ceil(T/4), block 128
extern "C" __global__ void moe_route(int* out_ids, float* out_w, const float* logits, const float* choice_bias,
                                     int T, int E, int k, int gated, int normalize, float norm_min,
                                     const float* expert_scale, int sigmoid, int ngroups, int gkeep, int gtop,
                                     float scaling) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T) return;                              // whole warps; this kernel has no block barrier
    const float* x = logits + (size_t)t * E;
    float p[ROUTE_MAXJ], sc[ROUTE_MAXJ];
    if (sigmoid) {
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j) {
            const int e = lane + 32 * j;
            p[j] = e < E ? 1.0f / (1.0f + expf(-x[e])) : 0.f;
        }
    } else {
        float mx = neg_inf();
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j) {
            const int e = lane + 32 * j;
            p[j] = e < E ? x[e] : neg_inf();
            mx = fmaxf(mx, p[j]);
        }
        mx = warp_max(mx);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j) {
            const int e = lane + 32 * j;
            p[j] = e < E ? expf(p[j] - mx) : 0.f;
            s += p[j];
        }
        s = warp_sum(s);
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j) p[j] = p[j] / s;
    }
#pragma unroll
    for (int j = 0; j < ROUTE_MAXJ; ++j) {
        const int e = lane + 32 * j;
        sc[j] = e < E ? (choice_bias ? p[j] + choice_bias[e] : p[j]) : neg_inf();   // -inf: none, out or chosen
    }
    if (gated) {
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j) {
            const int e = lane + 32 * j;
            if (e < E) { out_ids[(size_t)t * E + e] = e; out_w[(size_t)t * E + e] = p[j]; }
        }
        return;
    }
    if (ngroups > 1) {
        const int gsize = E / ngroups;
        int gid[ROUTE_MAXJ];                         // each expert's group (>= ngroups past E: in none)
        float gsc[ROUTE_MAXJ];                       // group g's score in lane g % 32, slot g / 32
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j) { gid[j] = (lane + 32 * j) / gsize; gsc[j] = neg_inf(); }
        for (int g = 0; g < ngroups; ++g) {
            float a = neg_inf(), b = neg_inf();      // the group's two largest c, a >= b (a multiset's)
#pragma unroll
            for (int j = 0; j < ROUTE_MAXJ; ++j)
                if (gid[j] == g) {
                    if (sc[j] > a) { b = a; a = sc[j]; }
                    else b = fmaxf(b, sc[j]);
                }
            for (int o = 16; o > 0; o >>= 1) {       // disjoint lanes at every step: merge the pairs
                const float oa = __shfl_xor_sync(0xffffffffu, a, o), ob = __shfl_xor_sync(0xffffffffu, b, o);
                b = fmaxf(fminf(a, oa), fmaxf(b, ob));
                a = fmaxf(a, oa);
            }
            const float score = gtop == 2 ? a + b : a;
#pragma unroll
            for (int j = 0; j < ROUTE_MAXJ; ++j)
                if (lane + 32 * j == g) gsc[j] = score;
        }
        unsigned kept = 0;                           // bit j: slot j's group stays
        for (int r = 0; r < gkeep; ++r) {
            float bv = neg_inf();
            int bg = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < ROUTE_MAXJ; ++j)     // ascending ids: strict > keeps the lower id
                if (gsc[j] > bv) { bv = gsc[j]; bg = lane + 32 * j; }
            warp_argmax(bv, bg);
#pragma unroll
            for (int j = 0; j < ROUTE_MAXJ; ++j) {
                if (lane + 32 * j == bg) gsc[j] = neg_inf();
                if (gid[j] == bg) kept |= 1u << j;
            }
        }
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j)
            if (!((kept >> j) & 1u)) sc[j] = neg_inf();
    }
    float wsum = 0.f;
    for (int r = 0; r < k; ++r) {
        float bv = neg_inf(), mine = 0.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j)         // ascending ids: strict > keeps the lower id
            if (sc[j] > bv) { bv = sc[j]; bi = lane + 32 * j; }
        warp_argmax(bv, bi);
#pragma unroll
        for (int j = 0; j < ROUTE_MAXJ; ++j)
            if (lane + 32 * j == bi) { sc[j] = neg_inf(); mine = p[j]; }
        const float bp = __shfl_sync(0xffffffffu, mine, bi & 31);    // the chosen expert's p, from its lane
        if (lane == 0) { out_ids[(size_t)t * k + r] = bi; out_w[(size_t)t * k + r] = bp; }
        wsum += bp;
    }
    if ((normalize || scaling != 1.0f || expert_scale) && lane == 0)
        for (int r = 0; r < k; ++r) {
            float w = out_w[(size_t)t * k + r];
            if (normalize) w = w / fmaxf(wsum, norm_min);
            w *= scaling;
            if (expert_scale) w *= expert_scale[out_ids[(size_t)t * k + r]];
            out_w[(size_t)t * k + r] = w;
        }
}

// exclusive prefix sum over the ALIGN_THREADS threads of the CTA; *total gets the sum
static __device__ int block_exscan(int v, int* sm, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sm[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < ALIGN_THREADS / 32 ? sm[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < ALIGN_THREADS / 32) sm[lane] = w;
    }
    __syncthreads();
    const int pre = (warp > 0 ? sm[warp - 1] : 0) + x - v;
    *total = sm[ALIGN_THREADS / 32 - 1];
    __syncthreads();                                 // sm may be reused
    return pre;
}

// align: the A assignments a = t*k + j (expert ids[a]) grouped by expert with a counting sort,
// stable within an expert (the plan of colibri_edge.backends.routing.align), then cut into blocks of at
// most BM rows, each block one expert (vLLM's moe_align_block_size, without padding rows: a
// block knows where its expert's rows end).
//   counts[e]  = #{a : ids[a] == e}          offsets[e] = counts[0] + ... + counts[e-1], offsets[E] = A
//   order[offsets[e] + r] = the r-th a (ascending) with ids[a] == e,   inverse[order[i]] = i
//   blocks[b] = (expert, first row, end row),  nblocks[0] = number of blocks
//   tally[e] += counts[e]  when tally is not null
// Worked example: ids = [[2,0],[0,3],[2,0]] (T=3, k=2, E=4), BM = 2
//   a:       0 1 2 3 4 5          counts  = [3,0,2,1]      offsets = [0,3,3,5,6]
//   expert:  2 0 0 3 2 0          order   = [1,2,5, 0,4, 3] inverse = [3,0,1,5,4,2]
//   blocks  = (0,0,2) (0,2,3) (2,3,5) (3,5,6)   nblocks = 4
//   (expert 0's three rows take two blocks of BM = 2; expert 1 has none; the grouped kernels run
//    one CTA per block and read that block's expert weights once per CTA)
// Blocks never exceed min(A, ceil(A/BM) + E - 1): the grouped kernels' grid is sized by that bound
// and CTAs past nblocks[0] exit at once, so the launch needs no host copy of the plan.
// one CTA of ALIGN_THREADS threads; thread i owns experts 4i .. 4i+3 (E <= 1024)
extern "C" __global__ void moe_align(int* offsets, int* order, int* inverse, int* counts, int* blocks,
                                     int* nblocks, int* tally, const int* ids, int A, int E, int BM) {
    __shared__ int s_ids[ALIGN_CHUNK];
    __shared__ int s_scan[32];
    const int tid = threadIdx.x, e0 = tid * ALIGN_EPT;
    int c[ALIGN_EPT];
#pragma unroll
    for (int q = 0; q < ALIGN_EPT; ++q) c[q] = 0;
    for (int base = 0; base < A; base += ALIGN_CHUNK) {  // pass 1: count
        const int n = min(ALIGN_CHUNK, A - base);
        __syncthreads();
        for (int i = tid; i < n; i += ALIGN_THREADS) s_ids[i] = ids[base + i];
        __syncthreads();
        if (e0 < E)
            for (int i = 0; i < n; ++i) {
                const int d = s_ids[i] - e0;
#pragma unroll
                for (int q = 0; q < ALIGN_EPT; ++q) c[q] += d == q;
            }
    }
    int mine = 0, mine_blocks = 0;
#pragma unroll
    for (int q = 0; q < ALIGN_EPT; ++q) {
        if (e0 + q < E) { mine += c[q]; mine_blocks += (c[q] + BM - 1) / BM; }
    }
    int total, total_blocks;
    int off = block_exscan(mine, s_scan, &total);
    int boff = block_exscan(mine_blocks, s_scan, &total_blocks);
    int cur[ALIGN_EPT];
#pragma unroll
    for (int q = 0; q < ALIGN_EPT; ++q) {
        const int e = e0 + q;
        cur[q] = off;
        if (e < E) {
            offsets[e] = off;
            counts[e] = c[q];
            if (tally) tally[e] += c[q];     // tokens routed to e over the engine's life (graph replays too)
            for (int r = 0; r < c[q]; r += BM) {
                blocks[3 * boff] = e;
                blocks[3 * boff + 1] = off + r;
                blocks[3 * boff + 2] = off + min(r + BM, c[q]);
                ++boff;
            }
            off += c[q];
        }
    }
    if (tid == 0) { offsets[E] = total; nblocks[0] = total_blocks; }
    for (int base = 0; base < A; base += ALIGN_CHUNK) {  // pass 2: scatter, ascending a per expert
        const int n = min(ALIGN_CHUNK, A - base);
        __syncthreads();
        for (int i = tid; i < n; i += ALIGN_THREADS) s_ids[i] = ids[base + i];
        __syncthreads();
        if (e0 < E)
            for (int i = 0; i < n; ++i) {
                const int d = s_ids[i] - e0;
#pragma unroll
                for (int q = 0; q < ALIGN_EPT; ++q) {
                    if (d == q) {
                        const int a = base + i;
                        order[cur[q]] = a;
                        inverse[a] = cur[q];
                        ++cur[q];
                    }
                }
            }
    }
}

// Grouped GLU FFN over the plan's blocks, each block one expert e and sorted rows [r0, r1):
//   gate_up: act[r, :] = expert_act(kind, g + gbias[e], u + ubias[e], alpha, limit)          act [A, I]
//            g = x[order[r] / k] @ gate_e^T, u = x[order[r] / k] @ up_e^T
//            (kind ACT_SILU: silu(g) * u; ACT_SWIGLU_OAI: gpt-oss; ACT_GELU_TANH: Gemma's GeGLU)
//   down   : y[r, :]   = act[r] @ down_e^T + dbias[e]                                        y   [A, H]
// gbias, ubias [E, I], dbias [E, H] (each null = none)
// gate_e [I,H], up_e [I,H], down_e [H,I]: device pointers in the tables gate_tab/up_tab/down_tab [E];
// int8 experts also have row-scale pointers in gs_tab/us_tab/ds_tab (0 otherwise).
// Blocks b = blockIdx.x * nparts + part (the experts are split over `nparts` streams); CTAs whose
// block is past nblocks[0], or whose expert is off in `active` [E] (when given: the slot pool runs
// a layer's experts in waves), return at once.
// skinny (BM <= 8): grid (ceil(max_blocks / nparts), ceil(N / 8)), block 256
// tiled (BM <= 64): grid (ceil(max_blocks / nparts), ceil(N / 64)), block 256
template <typename WT, bool SKINNY>
CE_DEV void moe_gate_up(float* act, const float* x, const int* order, const int* blocks, const int* nblocks,
                        const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
                        const int* active, int k, int H, int I, int part, int nparts, const float* gbias,
                        const float* ubias, int kind, float alpha, float limit) {
    const int b = blockIdx.x * nparts + part;
    if (b >= nblocks[0]) return;
    const int e = blocks[3 * b], r0 = blocks[3 * b + 1], r1 = blocks[3 * b + 2];
    if (active && !active[e]) return;
    const float* gb = gbias ? gbias + (size_t)e * I : nullptr;
    const float* ub = ubias ? ubias + (size_t)e * I : nullptr;
    if constexpr (SKINNY)
        skinny_tile<WT, 1>(act, x, order, k, r0, r1 - r0, (const WStore<WT>*)gate_tab[e], (const WStore<WT>*)up_tab[e],
                           (const float*)gs_tab[e], (const float*)us_tab[e], gb, I, H, H, I, blockIdx.y * SK_WARPS,
                           ub, kind, alpha, limit);
    else
        tiled_tile<WT, 1>(act, x, order, k, r0, r1 - r0, (const WStore<WT>*)gate_tab[e], (const WStore<WT>*)up_tab[e],
                          (const float*)gs_tab[e], (const float*)us_tab[e], gb, I, H, blockIdx.y * TBN, ub, kind,
                          alpha, limit);
}
template <typename WT, bool SKINNY>
CE_DEV void moe_down(float* y, const float* act, const int* blocks, const int* nblocks, const u64* down_tab,
                     const u64* ds_tab, const int* active, int H, int I, int part, int nparts, const float* dbias) {
    const int b = blockIdx.x * nparts + part;
    if (b >= nblocks[0]) return;
    const int e = blocks[3 * b], r0 = blocks[3 * b + 1], r1 = blocks[3 * b + 2];
    if (active && !active[e]) return;
    const float* db = dbias ? dbias + (size_t)e * H : nullptr;
    if constexpr (SKINNY)
        skinny_tile<WT, 0>(y, act, nullptr, 1, r0, r1 - r0, (const WStore<WT>*)down_tab[e], nullptr, (const float*)ds_tab[e],
                           nullptr, db, H, I, I, H, blockIdx.y * SK_WARPS);
    else
        tiled_tile<WT, 0>(y, act, nullptr, 1, r0, r1 - r0, (const WStore<WT>*)down_tab[e], nullptr, (const float*)ds_tab[e],
                          nullptr, db, H, I, blockIdx.y * TBN);
}
extern "C" __global__ void moe_gate_up_skinny_f32(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<float, true>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_skinny_f32(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<float, true>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}
extern "C" __global__ void moe_gate_up_skinny_f16(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<half_t, true>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_skinny_f16(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<half_t, true>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}
extern "C" __global__ void moe_gate_up_skinny_bf16(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<bf16_t, true>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_skinny_bf16(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<bf16_t, true>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}
extern "C" __global__ void moe_gate_up_skinny_i8(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<i8_t, true>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_skinny_i8(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<i8_t, true>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}
extern "C" __global__ void moe_gate_up_tiled_f32(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<float, false>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_tiled_f32(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<float, false>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}
extern "C" __global__ void moe_gate_up_tiled_f16(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<half_t, false>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_tiled_f16(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<half_t, false>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}
extern "C" __global__ void moe_gate_up_tiled_bf16(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<bf16_t, false>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_tiled_bf16(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<bf16_t, false>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}
extern "C" __global__ void moe_gate_up_tiled_i8(float* act, const float* x, const int* order, const int* blocks,
        const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab, const u64* us_tab,
        const int* active, int k, int H, int I, int part, int nparts, const float* gbias, const float* ubias,
        int kind, float alpha, float limit) {
    moe_gate_up<i8_t, false>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, I, part,
                      nparts, gbias, ubias, kind, alpha, limit);
}
extern "C" __global__ void moe_down_tiled_i8(float* y, const float* act, const int* blocks, const int* nblocks,
        const u64* down_tab, const u64* ds_tab, const int* active, int H, int I, int part, int nparts,
        const float* dbias) {
    moe_down<i8_t, false>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);
}

// the block formats: the same four kernels each
#define COLIBRI_MOE_BLOCK(SUF, TAG)                                                                              \
    extern "C" __global__ void moe_gate_up_skinny_##SUF(float* act, const float* x, const int* order,            \
            const int* blocks, const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab,    \
            const u64* us_tab, const int* active, int k, int H, int I, int part, int nparts, const float* gbias, \
            const float* ubias, int kind, float alpha, float limit) {                                         \
        moe_gate_up<TAG, true>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H,  \
                               I, part, nparts, gbias, ubias, kind, alpha, limit);                            \
    }                                                                                                          \
    extern "C" __global__ void moe_down_skinny_##SUF(float* y, const float* act, const int* blocks,              \
            const int* nblocks, const u64* down_tab, const u64* ds_tab, const int* active, int H, int I,        \
            int part, int nparts, const float* dbias) {                                                        \
        moe_down<TAG, true>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);     \
    }                                                                                                          \
    extern "C" __global__ void moe_gate_up_tiled_##SUF(float* act, const float* x, const int* order,             \
            const int* blocks, const int* nblocks, const u64* gate_tab, const u64* up_tab, const u64* gs_tab,    \
            const u64* us_tab, const int* active, int k, int H, int I, int part, int nparts, const float* gbias, \
            const float* ubias, int kind, float alpha, float limit) {                                         \
        moe_gate_up<TAG, false>(act, x, order, blocks, nblocks, gate_tab, up_tab, gs_tab, us_tab, active, k, H, \
                                I, part, nparts, gbias, ubias, kind, alpha, limit);                           \
    }                                                                                                          \
    extern "C" __global__ void moe_down_tiled_##SUF(float* y, const float* act, const int* blocks,               \
            const int* nblocks, const u64* down_tab, const u64* ds_tab, const int* active, int H, int I,        \
            int part, int nparts, const float* dbias) {                                                        \
        moe_down<TAG, false>(y, act, blocks, nblocks, down_tab, ds_tab, active, H, I, part, nparts, dbias);    \
    }
COLIBRI_MOE_BLOCK(q8_0, q8_0_t) COLIBRI_MOE_BLOCK(q4_0, q4_0_t) COLIBRI_MOE_BLOCK(q4_1, q4_1_t)
COLIBRI_MOE_BLOCK(q5_0, q5_0_t) COLIBRI_MOE_BLOCK(q5_1, q5_1_t) COLIBRI_MOE_BLOCK(mxfp4, mxfp4_t)
COLIBRI_MOE_BLOCK(q4_k, q4_k_t) COLIBRI_MOE_BLOCK(q5_k, q5_k_t) COLIBRI_MOE_BLOCK(q6_k, q6_k_t)
COLIBRI_MOE_BLOCK(q2_k, q2_k_t) COLIBRI_MOE_BLOCK(q3_k, q3_k_t) COLIBRI_MOE_BLOCK(iq4_nl, iq4_nl_t)
COLIBRI_MOE_BLOCK(iq4_xs, iq4_xs_t) COLIBRI_MOE_BLOCK(tq1_0, tq1_0_t) COLIBRI_MOE_BLOCK(tq2_0, tq2_0_t)
COLIBRI_MOE_BLOCK(nvfp4, nvfp4_t)
COLIBRI_MOE_BLOCK(iq2_xxs, iq2_xxs_t) COLIBRI_MOE_BLOCK(iq2_xs, iq2_xs_t) COLIBRI_MOE_BLOCK(iq2_s, iq2_s_t)
COLIBRI_MOE_BLOCK(iq3_xxs, iq3_xxs_t) COLIBRI_MOE_BLOCK(iq3_s, iq3_s_t) COLIBRI_MOE_BLOCK(iq1_s, iq1_s_t)
COLIBRI_MOE_BLOCK(iq1_m, iq1_m_t)

// out[t,:] += sum_j w[t,j] * y[inverse[t*k + j], :]   (the residual add is fused)
// grid (ceil(H/256), T), block 256
extern "C" __global__ void moe_combine(float* out, const float* y, const float* w, const int* inverse,
                                       int T, int k, int H) {
    const int t = blockIdx.y, h = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T || h >= H) return;
    float s = 0.f;
    for (int j = 0; j < k; ++j) s += w[(size_t)t * k + j] * y[(size_t)inverse[(size_t)t * k + j] * H + h];
    out[(size_t)t * H + h] += s;
}
