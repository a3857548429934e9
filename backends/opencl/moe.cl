/* The MoE layer as a small program: route, align (group tokens by expert), grouped gated FFN (SwiGLU,
 * gpt-oss's clamped SwiGLU or GeGLU: expert_act), combine.
 * Built per matrix type like dense.cl (only ffn_gate_up reads matrices here). */

/* Router, fp32. p = softmax(logits[t, :]) = exp(x - max) / sum exp(x - max), or with sigmoid
 * p_e = 1 / (1 + exp(-x_e)) per expert (DeepSeek-V3, GLM);  c = p + choice_bias (has_bias: the choice
 * only; otherwise c = p)
 *   topk  (gated == 0): with ngroups > 1 (DeepSeek / GLM group-limited routing) the experts come in
 *                       ngroups groups of E / ngroups consecutive ones; group q scores gs[q] = the sum
 *                       of its `top` (1 or 2) largest c, the `keep` best groups (gs descending, ties to
 *                       the lower group id) stay and the others' experts are out of the choice;
 *                       out_ids[t, :] = the k largest c of what stays, descending, ties to the lower
 *                       expert id; out_w = their p, divided by max(their sum, norm_min) when normalize,
 *                       times scaling (routed_scaling_factor), then times expert_scale[id] when
 *                       has_scale (Gemma 4's per_expert_scale)
 *   gated (gated == 1): k == E, out_ids[t, j] = j, out_w[t, j] = p_j
 * logits [T,E]; choice_bias, expert_scale [E]; out_ids [T,k] int; out_w [T,k]. One work-item per token;
 * gscore: ngroups local floats per work-item (its token's group scores; unread without groups).
 * global (T) */
inline float route_p(const float x, const int sigm, const float m, const float sum)
{
    return sigm ? 1.0f / (1.0f + exp(-x)) : exp(x - m) / sum;
}

__kernel void route(ARG(int, out_ids), ARG(float, out_w), CARG(float, logits), CARG(float, choice_bias),
                    CARG(float, expert_scale), const int T, const int E, const int k, const int gated,
                    const int normalize, const int has_bias, const float norm_min, const int has_scale,
                    const int sigm, const int ngroups, const int keep, const int top, const float scaling,
                    __local float* gscore)
{
    const int t = get_global_id(0);
    if (t >= T)
        return;
    BIND(int, out_ids); BIND(float, out_w); CBIND(float, logits); CBIND(float, choice_bias);
    CBIND(float, expert_scale);
    __global const float* x = logits + (size_t)t * E;
    float m = 0.0f, sum = 1.0f;
    if (!sigm) {
        m = x[0];
        for (int e = 1; e < E; ++e)
            m = fmax(m, x[e]);
        /* compensated (Kahan) sum: a running sum of many small terms onto a large one drifts by
         * many ulps; the reference's pairwise sum does not */
        sum = 0.0f;
        float comp = 0.0f;
        for (int e = 0; e < E; ++e) {
            const float y = exp(x[e] - m) - comp, s = sum + y;
            comp = (s - sum) - y;
            sum = s;
        }
    }
    if (gated) {
        for (int e = 0; e < E; ++e) {
            out_ids[(size_t)t * k + e] = e;
            out_w[(size_t)t * k + e] = route_p(x[e], sigm, m, sum);
        }
        return;
    }
    /* the groups: ng of gsz experts (one group of E without group-limited routing) */
    const int ng = ngroups > 1 ? ngroups : 1, gsz = E / ng;
    __local float* gs = gscore + (size_t)get_local_id(0) * ng;
    /* the keep-th best group (ls, lid): group q stays when it does not come after it in the order
     * (gs descending, id ascending) */
    float ls = -INFINITY;
    int lid = ng - 1;
    if (ng > 1) {
        for (int g = 0; g < ng; ++g) {
            float a1 = -INFINITY, a2 = -INFINITY;          /* the group's largest and second largest c */
            for (int e = g * gsz; e < (g + 1) * gsz; ++e) {
                const float pe = route_p(x[e], sigm, m, sum);
                const float ce = has_bias ? pe + choice_bias[e] : pe;
                if (ce > a1) {
                    a2 = a1;
                    a1 = ce;
                } else if (ce > a2) {
                    a2 = ce;
                }
            }
            gs[g] = top == 2 ? a1 + a2 : a1;
        }
        /* the keep best groups, picked as the experts below: each pick the best strictly after the last */
        float prev_s = INFINITY;
        int prev_id = -1;
        for (int j = 0; j < min(keep, ng); ++j) {
            int best = -1;
            float best_s = 0.0f;
            for (int g = 0; g < ng; ++g) {
                const float sg = gs[g];
                if (((sg < prev_s) || (sg == prev_s && g > prev_id)) && (best < 0 || sg > best_s)) {
                    best = g;
                    best_s = sg;
                }
            }
            prev_s = best_s;
            prev_id = best;
        }
        ls = prev_s;
        lid = prev_id;
    }
    /* selection in the order (c descending, id ascending): the j-th pick is the best candidate
     * strictly after the (j-1)-th in that order, so no private "taken" array is needed */
    float prev_s = INFINITY;
    int prev_id = -1;
    float wsum = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        float best_s = 0.0f, best_p = 0.0f;
        for (int g = 0; g < ng; ++g) {
            if (ng > 1 && !(gs[g] > ls || (gs[g] == ls && g <= lid)))
                continue;                                  /* a group out of the choice */
            for (int e = g * gsz; e < (g + 1) * gsz; ++e) {
                const float pe = route_p(x[e], sigm, m, sum);
                const float se = has_bias ? pe + choice_bias[e] : pe;
                const int after_prev = (se < prev_s) || (se == prev_s && e > prev_id);
                if (after_prev && (best < 0 || se > best_s)) {     /* strict >: ties keep the lower id */
                    best = e;
                    best_s = se;
                    best_p = pe;
                }
            }
        }
        out_ids[(size_t)t * k + j] = best;
        out_w[(size_t)t * k + j] = best_p;
        wsum += best_p;
        prev_s = best_s;
        prev_id = best;
    }
    for (int j = 0; j < k; ++j) {
        float w = out_w[(size_t)t * k + j];
        if (normalize)
            w /= fmax(wsum, norm_min);
        w *= scaling;
        if (has_scale)
            w *= expert_scale[out_ids[(size_t)t * k + j]];
        out_w[(size_t)t * k + j] = w;
    }
}

/* Phi-3.5-MoE's inference router (base.py sparsemixer): per token, twice, the best remaining expert i
 * (ties to the lower id) and its weight 1 / sum exp(s_e - s_i) over the remaining experts not dropped,
 * (s_i - s_e) / max(|s_e|, s_i) > thr dropping one (thr = 2 jitter; a NaN ratio keeps it).
 * logits [T,E]; out_ids, out_w [T,2]. One work-item per token. global (T) */
__kernel void sparsemixer(ARG(int, out_ids), ARG(float, out_w), CARG(float, logits), const int T, const int E,
                          const float thr)
{
    const int t = get_global_id(0);
    if (t >= T)
        return;
    BIND(int, out_ids); BIND(float, out_w); CBIND(float, logits);
    __global const float* s = logits + (size_t)t * E;
    int first = -1;
    for (int j = 0; j < 2; ++j) {
        int best = -1;
        float m = 0.0f;
        for (int e = 0; e < E; ++e)
            if (e != first && (best < 0 || s[e] > m)) {
                best = e;
                m = s[e];
            }
        float tot = 0.0f;
        for (int e = 0; e < E; ++e)
            if (e != first && !((m - s[e]) / fmax(fabs(s[e]), m) > thr))
                tot += exp(s[e] - m);
        out_ids[(size_t)t * 2 + j] = best;
        out_w[(size_t)t * 2 + j] = 1.0f / tot;
        first = best;
    }
}

/* align: counting sort of the N = T*k assignments a = t*k + j by expert ids[a] (stable), then the
 * rows cut into blocks of at most BM rows, each block one expert (CUDA's moe_align, vLLM's
 * moe_align_block_size without padding rows):
 *   counts[e] = #{a : ids[a] == e};   offsets[e] = sum_{e' < e} counts[e'],  offsets[E] = N
 *   order[offsets[e] + r] = the r-th assignment (ascending a) with ids[a] == e
 *   inverse[order[s]] = s
 *   blocks[b] = (expert, first row, end row), nblocks[0] = number of blocks
 *   tally[e] += counts[e]  when has_tally (tokens routed to each expert, over the engine's life)
 * Worked example: ids = [[2,0],[0,3],[2,0]] (T=3, k=2, E=4), BM = 2
 *   counts = [3,0,2,1], offsets = [0,3,3,5,6], order = [1,2,5, 0,4, 3], inverse = [3,0,1,5,4,2]
 *   blocks = (0,0,2) (0,2,3) (2,3,5) (3,5,6), nblocks = 4
 * There are never more than min(N, ceil(N/BM) + E - 1) blocks: the grouped kernels are launched over
 * that bound and work-items past nblocks[0] return, so no host copy of the plan is needed.
 * One work-group (size L); work-item i handles experts i, i + L, ... (no atomics: deterministic).
 * cnt, bst: E local ints each. global (L), local (L) */
__kernel void align(ARG(int, offsets), ARG(int, order), ARG(int, inverse), ARG(int, blocks), ARG(int, nblocks),
                    ARG(int, tally), const int has_tally, CARG(int, ids), const int N, const int E, const int BM,
                    __local int* cnt, __local int* bst)
{
    const int i = get_local_id(0), L = get_local_size(0);
    BIND(int, offsets); BIND(int, order); BIND(int, inverse); BIND(int, blocks); BIND(int, nblocks);
    BIND(int, tally); CBIND(int, ids);
    for (int e = i; e < E; e += L) {
        int c = 0;
        for (int a = 0; a < N; ++a)
            c += (ids[a] == e);
        cnt[e] = c;
        if (has_tally)
            tally[e] += c;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (i == 0) {
        int s = 0, nb = 0;
        for (int e = 0; e < E; ++e) {
            const int c = cnt[e];
            cnt[e] = s;
            bst[e] = nb;
            offsets[e] = s;
            s += c;
            nb += (c + BM - 1) / BM;
        }
        offsets[E] = s;
        nblocks[0] = nb;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = i; e < E; e += L) {
        const int first = cnt[e];
        int pos = first;
        for (int a = 0; a < N; ++a)
            if (ids[a] == e) {
                order[pos] = a;
                inverse[a] = pos;
                ++pos;
            }
        for (int r = first, b = bst[e]; r < pos; r += BM, ++b) {
            blocks[3 * b] = e;
            blocks[3 * b + 1] = r;
            blocks[3 * b + 2] = min(r + BM, pos);
        }
    }
}

/* The experts' activation, by kind (backend.py ACT_KINDS):
 *   ACT_SILU       SwiGLU:             g / (1 + exp(-g)) * u
 *   ACT_SWIGLU_OAI gpt-oss's clamped:  (u' + 1) * g' / (1 + exp(-alpha g')),  g' = min(g, limit),
 *                                      u' = clamp(u, -limit, limit)
 *   ACT_GELU_TANH  GeGLU (Gemma):      gelu_tanh(g) * u,
 *                                      gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
 * g and u arrive with their biases added (gpt-oss's experts have them; others pass none). */
#define ACT_SILU 0
#define ACT_SWIGLU_OAI 1
#define ACT_GELU_TANH 2
#define GELU_C 0.7978845608028654f          /* sqrt(2/pi) */

inline float4 expert_act4(float4 g, float4 u, const int kind, const float alpha, const float limit)
{
    if (kind == ACT_GELU_TANH)
        return 0.5f * g * (1.0f + tanh(GELU_C * (g + 0.044715f * g * g * g))) * u;
    if (kind != ACT_SWIGLU_OAI)
        return g / (1.0f + exp(-g)) * u;
    g = fmin(g, (float4)(limit));
    u = clamp(u, (float4)(-limit), (float4)(limit));
    return (u + 1.0f) * (g / (1.0f + exp(-alpha * g)));
}

inline float expert_act(float g, float u, const int kind, const float alpha, const float limit)
{
    if (kind == ACT_GELU_TANH)
        return 0.5f * g * (1.0f + tanh(GELU_C * (g + 0.044715f * g * g * g))) * u;
    if (kind != ACT_SWIGLU_OAI)
        return g / (1.0f + exp(-g)) * u;
    g = fmin(g, limit);
    u = clamp(u, -limit, limit);
    return (u + 1.0f) * (g / (1.0f + exp(-alpha * g)));
}

/* One expert's gated FFN first half over its rows r < n of the plan (sorted rows row0 + r):
 *   tok(r) = order[row0 + r] / topk
 *   act[row0 + r, i] = expert_act(g, u),  g = gate[i] . x[tok(r)],  u = up[i] . x[tok(r)]  (int8: times
 *                      the rows' scales gscale[i], uscale[i]), of activation kind `kind` (ACT_*);
 *   g + gbias[i] when bit 0 of has_bias, u + ubias[i] when bit 1 (the expert's rows of the layer's
 *   bias tables, offset by the host)
 * act: the scratch [T*k, lda] (first I columns used); x [T,H]; gate, up [I,H] (storage type).
 * ROWS_PER_ITEM (4: the float4 lanes of dotw4) rows per work-item, clamped; each gate/up row is
 * read once per four tokens. global (I, ceil(n / ROWS_PER_ITEM)) */
__kernel void ffn_gate_up(ARG(float, act), const int lda, CARG(float, x), CARG(int, order), const int row0,
                          const int n, const int topk, CARG(WTYPE, gate), CARG(float, gscale), CARG(WTYPE, up),
                          CARG(float, uscale), const int H, const int I, CARG(float, gbias), CARG(float, ubias),
                          const int has_bias, const int kind, const float alpha, const float limit)
{
    const int i = get_global_id(0), r0 = ROWS_PER_ITEM * get_global_id(1);
    if (i >= I || r0 >= n)
        return;
    BIND(float, act); CBIND(float, x); CBIND(int, order); CBIND(WTYPE, gate); CBIND(float, gscale);
    CBIND(WTYPE, up); CBIND(float, uscale); CBIND(float, gbias); CBIND(float, ubias);
    __global const int* ord = order + row0;
    const int r1 = min(r0 + 1, n - 1), r2 = min(r0 + 2, n - 1), r3 = min(r0 + 3, n - 1);
    __global const float* x0 = x + (size_t)(ord[r0] / topk) * XLD(H);
    __global const float* x1 = x + (size_t)(ord[r1] / topk) * XLD(H);
    __global const float* x2 = x + (size_t)(ord[r2] / topk) * XLD(H);
    __global const float* x3 = x + (size_t)(ord[r3] / topk) * XLD(H);
    const float4 g = dotw4(WROW(gate, i, H), x0, x1, x2, x3, H) * WSCALE(gscale, i) + ((has_bias & 1) ? gbias[i] : 0.0f);
    const float4 u = dotw4(WROW(up, i, H), x0, x1, x2, x3, H) * WSCALE(uscale, i) + ((has_bias & 2) ? ubias[i] : 0.0f);
    const float4 a = expert_act4(g, u, kind, alpha, limit);
    __global float* out = act + (size_t)(row0 + r0) * lda + i;
    out[0] = a.x;
    if (r0 + 1 < n) out[(size_t)lda] = a.y;
    if (r0 + 2 < n) out[(size_t)2 * lda] = a.z;
    if (r0 + 3 < n) out[(size_t)3 * lda] = a.w;
}

/* The grouped kernels: one launch covers every block of the plan (every active expert), so a MoE
 * layer is route, align, ffn_gate_up_grouped, ffn_down_grouped, combine whatever the routing, and the
 * host never reads the plan. OpenCL 1.2 has no pointer tables: the experts' matrices are found as
 * byte offsets into a few base buffers (the backend packs a layer's experts into one buffer):
 *   tab [E, 6] uint: byte offsets of expert e's gate, up, down and of their int8 row scales, into
 *   gbase, ubase, dbase, gsbase, usbase, dsbase (the float types: scale offsets unread).
 * A work-item owns one block (<= ROWS_PER_ITEM rows of one expert) and one output column; a block
 * of one row (decode) takes the single-row dot, so a token costs no more arithmetic than a GEMV. */
#define EXPERT_MAT(base, e, m) ((__global const WTYPE*)((base) + tab[6 * (e) + (m)]))
#define EXPERT_SCALES(base, e, m) ((__global const float*)((base) + tab[6 * (e) + 3 + (m)]))

/* act[r, i] = expert_act(gate_e[i] . x[tok(r)], up_e[i] . x[tok(r)])  (kind: ACT_*) for the rows r of
 * block b (expert e), tok(r) = order[r] / topk; + gbias[e, i] when bit 0 of has_bias, + ubias[e, i] when
 * bit 1 ([E, I]).
 * global (I, max_blocks) */
__kernel void ffn_gate_up_grouped(ARG(float, act), const int lda, CARG(float, x), CARG(int, order),
                                  CARG(int, blocks), CARG(int, nblocks), CARG(uint, tab),
                                  __global const uchar* gbase, __global const uchar* ubase,
                                  __global const uchar* gsbase, __global const uchar* usbase,
                                  const int topk, const int H, const int I, CARG(float, gbias), CARG(float, ubias),
                                  const int has_bias, const int kind, const float alpha, const float limit)
{
    const int i = get_global_id(0), b = get_global_id(1);
    BIND(float, act); CBIND(float, x); CBIND(int, order); CBIND(int, blocks); CBIND(int, nblocks); CBIND(uint, tab);
    CBIND(float, gbias); CBIND(float, ubias);
    if (i >= I || b >= nblocks[0])
        return;
    const int e = blocks[3 * b], r0 = blocks[3 * b + 1], n = blocks[3 * b + 2] - r0;
    __global const WTYPE* grow = WROW(EXPERT_MAT(gbase, e, 0), i, H);
    __global const WTYPE* urow = WROW(EXPERT_MAT(ubase, e, 1), i, H);
    const float gs = WSCALE(EXPERT_SCALES(gsbase, e, 0), i), us = WSCALE(EXPERT_SCALES(usbase, e, 1), i);
    __global const int* ord = order + r0;
    __global float* out = act + (size_t)r0 * lda + i;
    const float gb = (has_bias & 1) ? gbias[(size_t)e * I + i] : 0.0f;
    const float ub = (has_bias & 2) ? ubias[(size_t)e * I + i] : 0.0f;
    if (n == 1) {
        __global const float* x0 = x + (size_t)(ord[0] / topk) * XLD(H);
        const float g = dotw(grow, x0, H) * gs + gb, u = dotw(urow, x0, H) * us + ub;
        out[0] = expert_act(g, u, kind, alpha, limit);
        return;
    }
    const int r1 = min(1, n - 1), r2 = min(2, n - 1), r3 = min(3, n - 1);
    __global const float* x0 = x + (size_t)(ord[0] / topk) * XLD(H);
    __global const float* x1 = x + (size_t)(ord[r1] / topk) * XLD(H);
    __global const float* x2 = x + (size_t)(ord[r2] / topk) * XLD(H);
    __global const float* x3 = x + (size_t)(ord[r3] / topk) * XLD(H);
    const float4 g = dotw4(grow, x0, x1, x2, x3, H) * gs + gb;
    const float4 u = dotw4(urow, x0, x1, x2, x3, H) * us + ub;
    const float4 a = expert_act4(g, u, kind, alpha, limit);
    out[0] = a.x;
    if (n > 1) out[(size_t)lda] = a.y;
    if (n > 2) out[(size_t)2 * lda] = a.z;
    if (n > 3) out[(size_t)3 * lda] = a.w;
}

/* y[r, h] = down_e[h] . act[r, :I] (+ dbias[e, h] with has_bias, [E, H])  for the rows r of block b
 * (expert e).  global (H, max_blocks) */
__kernel void ffn_down_grouped(ARG(float, y), CARG(float, act), const int lda, CARG(int, blocks),
                               CARG(int, nblocks), CARG(uint, tab), __global const uchar* dbase,
                               __global const uchar* dsbase, const int H, const int I, CARG(float, dbias),
                               const int has_bias)
{
    const int h = get_global_id(0), b = get_global_id(1);
    BIND(float, y); CBIND(float, act); CBIND(int, blocks); CBIND(int, nblocks); CBIND(uint, tab);
    CBIND(float, dbias);
    if (h >= H || b >= nblocks[0])
        return;
    const int e = blocks[3 * b], r0 = blocks[3 * b + 1], n = blocks[3 * b + 2] - r0;
    __global const WTYPE* drow = WROW(EXPERT_MAT(dbase, e, 2), h, I);
    const float ds = WSCALE(EXPERT_SCALES(dsbase, e, 2), h);
    __global const float* a0 = act + (size_t)r0 * lda;
    __global float* out = y + (size_t)r0 * H + h;
    const float db = has_bias ? dbias[(size_t)e * H + h] : 0.0f;
    if (n == 1) {
        out[0] = dotw(drow, a0, I) * ds + db;
        return;
    }
    const float4 v = dotw4(drow, a0, a0 + (size_t)min(1, n - 1) * lda, a0 + (size_t)min(2, n - 1) * lda,
                           a0 + (size_t)min(3, n - 1) * lda, I) * ds + db;
    out[0] = v.x;
    if (n > 1) out[(size_t)H] = v.y;
    if (n > 2) out[(size_t)2 * H] = v.z;
    if (n > 3) out[(size_t)3 * H] = v.w;
}

/* out[t, h] += sum_j w[t, j] * y[inverse[t*k + j], h]     (the residual add is fused)
 * out [T,H]; y [T*k,H] in plan order; w [T,k]. global (H, T) */
__kernel void combine(ARG(float, out), CARG(float, y), CARG(float, w), CARG(int, inverse), const int T,
                      const int k, const int H)
{
    const int h = get_global_id(0), t = get_global_id(1);
    if (h >= H || t >= T)
        return;
    BIND(float, out); CBIND(float, y); CBIND(float, w); CBIND(int, inverse);
    float s = 0.0f;
    for (int j = 0; j < k; ++j)
        s += w[(size_t)t * k + j] * y[(size_t)inverse[(size_t)t * k + j] * H + h];
    out[(size_t)t * H + h] += s;
}
