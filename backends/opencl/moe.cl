/* The MoE layer as a small program: route, align (group tokens by expert), grouped SwiGLU, combine.
 * Built per matrix type like dense.cl (only ffn_gate_up reads matrices here). */

/* Router, fp32. p = softmax(logits[t, :]) = exp(x - max) / sum exp(x - max)
 *   topk  (gated == 0): out_ids[t, :] = the k largest scores s = p (+ choice_bias[e] when
 *                       has_bias: the choice only), descending, ties to the lower expert id;
 *                       out_w = their p, divided by max(their sum, norm_min) when normalize
 *   gated (gated == 1): k == E, out_ids[t, j] = j, out_w[t, j] = p_j
 * logits [T,E]; choice_bias [E]; out_ids [T,k] int; out_w [T,k]. One work-item per token. global (T) */
__kernel void route(ARG(int, out_ids), ARG(float, out_w), CARG(float, logits), CARG(float, choice_bias),
                    const int T, const int E, const int k, const int gated, const int normalize,
                    const int has_bias, const float norm_min)
{
    const int t = get_global_id(0);
    if (t >= T)
        return;
    BIND(int, out_ids); BIND(float, out_w); CBIND(float, logits); CBIND(float, choice_bias);
    __global const float* x = logits + (size_t)t * E;
    float m = x[0];
    for (int e = 1; e < E; ++e)
        m = fmax(m, x[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e)
        sum += exp(x[e] - m);
    if (gated) {
        for (int e = 0; e < E; ++e) {
            out_ids[(size_t)t * k + e] = e;
            out_w[(size_t)t * k + e] = exp(x[e] - m) / sum;
        }
        return;
    }
    /* selection in the order (s descending, id ascending): the j-th pick is the best candidate
     * strictly after the (j-1)-th in that order, so no private "taken" array is needed */
    float prev_s = INFINITY;
    int prev_id = -1;
    float wsum = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        float best_s = 0.0f, best_p = 0.0f;
        for (int e = 0; e < E; ++e) {
            const float pe = exp(x[e] - m) / sum;
            const float se = has_bias ? pe + choice_bias[e] : pe;
            const int after_prev = (se < prev_s) || (se == prev_s && e > prev_id);
            if (after_prev && (best < 0 || se > best_s)) {     /* strict >: ties keep the lower id */
                best = e;
                best_s = se;
                best_p = pe;
            }
        }
        out_ids[(size_t)t * k + j] = best;
        out_w[(size_t)t * k + j] = best_p;
        wsum += best_p;
        prev_s = best_s;
        prev_id = best;
    }
    if (normalize)
        for (int j = 0; j < k; ++j)
            out_w[(size_t)t * k + j] /= fmax(wsum, norm_min);
}

/* align: counting sort of the N = T*k assignments a = t*k + j by expert ids[a] (stable):
 *   counts[e] = #{a : ids[a] == e};   offsets[e] = sum_{e' < e} counts[e'],  offsets[E] = N
 *   order[offsets[e] + r] = the r-th assignment (ascending a) with ids[a] == e
 *   inverse[order[s]] = s
 *   tally[e] += counts[e]  when has_tally (tokens routed to each expert, over the engine's life)
 * One work-group (size L); work-item i handles experts i, i + L, ... (no atomics: deterministic).
 * cnt: E local ints. global (L), local (L) */
__kernel void align(ARG(int, offsets), ARG(int, order), ARG(int, inverse), ARG(int, tally), const int has_tally,
                    CARG(int, ids), const int N, const int E, __local int* cnt)
{
    const int i = get_local_id(0), L = get_local_size(0);
    BIND(int, offsets); BIND(int, order); BIND(int, inverse); BIND(int, tally); CBIND(int, ids);
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
        int s = 0;
        for (int e = 0; e < E; ++e) {
            const int c = cnt[e];
            cnt[e] = s;
            offsets[e] = s;
            s += c;
        }
        offsets[E] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = i; e < E; e += L) {
        int pos = cnt[e];
        for (int a = 0; a < N; ++a)
            if (ids[a] == e) {
                order[pos] = a;
                inverse[a] = pos;
                ++pos;
            }
    }
}

/* One expert's SwiGLU first half over its rows r < n of the plan (sorted rows row0 + r):
 *   tok(r) = order[row0 + r] / topk
 *   act[row0 + r, i] = silu(g) * u,  g = gate[i] . x[tok(r)],  u = up[i] . x[tok(r)]  (int8: times the
 *                      rows' scales gscale[i], uscale[i]),
 *   silu(g) = g / (1 + exp(-g))
 * act: the scratch [T*k, lda] (first I columns used); x [T,H]; gate, up [I,H] (storage type).
 * ROWS_PER_ITEM (4: the float4 lanes of dotw4) rows per work-item, clamped; each gate/up row is
 * read once per four tokens. global (I, ceil(n / ROWS_PER_ITEM)) */
__kernel void ffn_gate_up(ARG(float, act), const int lda, CARG(float, x), CARG(int, order), const int row0,
                          const int n, const int topk, CARG(WTYPE, gate), CARG(float, gscale), CARG(WTYPE, up),
                          CARG(float, uscale), const int H, const int I)
{
    const int i = get_global_id(0), r0 = ROWS_PER_ITEM * get_global_id(1);
    if (i >= I || r0 >= n)
        return;
    BIND(float, act); CBIND(float, x); CBIND(int, order); CBIND(WTYPE, gate); CBIND(float, gscale);
    CBIND(WTYPE, up); CBIND(float, uscale);
    __global const int* ord = order + row0;
    const int r1 = min(r0 + 1, n - 1), r2 = min(r0 + 2, n - 1), r3 = min(r0 + 3, n - 1);
    __global const float* x0 = x + (size_t)(ord[r0] / topk) * H;
    __global const float* x1 = x + (size_t)(ord[r1] / topk) * H;
    __global const float* x2 = x + (size_t)(ord[r2] / topk) * H;
    __global const float* x3 = x + (size_t)(ord[r3] / topk) * H;
    const float4 g = dotw4(WROW(gate, i, H), x0, x1, x2, x3, H) * WSCALE(gscale, i);
    const float4 u = dotw4(WROW(up, i, H), x0, x1, x2, x3, H) * WSCALE(uscale, i);
    const float4 a = g / (1.0f + exp(-g)) * u;
    __global float* out = act + (size_t)(row0 + r0) * lda + i;
    out[0] = a.x;
    if (r0 + 1 < n) out[(size_t)lda] = a.y;
    if (r0 + 2 < n) out[(size_t)2 * lda] = a.z;
    if (r0 + 3 < n) out[(size_t)3 * lda] = a.w;
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
