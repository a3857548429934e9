/* Recurrent mixers (Qwen3.5 / Qwen3-Next gated delta-net): causal_conv, delta_rule, gate_mul. fp32.
 *
 * A step's tokens are grouped by sequence: sequence s owns tokens starts[s] .. starts[s+1]-1, at
 * consecutive positions, and the state slot slots[s]. A sequence whose first token in the step is at
 * position 0 starts from a zero state and never reads its slot; the state after its last token is
 * written back to the slot (base.py, "recurrent mixers", has the contract; the NumPy reference is
 * backends/reference/backend.py).
 *
 * Shared with the host (runtime.py DEFINES):
 *   DELTA_CHUNK   tokens per chunk of delta_rule's chunked form (prefill): the bound of its private arrays
 *   CONV_KMAX     the most taps causal_conv runs (its window lives in private memory)
 */
#ifndef DELTA_CHUNK
#error "DELTA_CHUNK comes from runtime.py (-DDELTA_CHUNK=16)"
#endif
#ifndef CONV_KMAX
#error "CONV_KMAX comes from runtime.py (-DCONV_KMAX=8)"
#endif

/* Depthwise causal conv1d + SiLU (or none: silu 0, LFM2) over each sequence, its last K-1 inputs carried in the state:
 *   out[t, c] = silu(sum_{i<K} weight[c, i] u(p - K + 1 + i, c)),  p = positions[t]
 * u(q, c): the sequence's input at position q: x[., c] for the step's tokens, state[slot, K-1-(p0-q), c]
 * for the K-1 positions before the step's first one p0 (0 when p0 == 0: the zero padding). Afterwards
 * state[slot, i, c] = the K-1 inputs ending at the sequence's last token.
 * x, out [T, C]; weight [C, K] (K <= CONV_KMAX); state [num_slots, K-1, C]; starts [S+1], slots [S], positions [T].
 * One work-item per (channel, sequence) walks the sequence's tokens in order, the window in registers:
 * win[i], i < K-1, holds u(p - K + 1 + i) (oldest first). Loops run to the compile-time bound with
 * guards, so the private arrays are indexed by constants only (registers, not spilled memory).
 * global (C, S) */
__kernel void causal_conv(ARG(float, out), CARG(float, x), CARG(float, weight), ARG(float, state),
                          CARG(int, starts), CARG(int, slots), CARG(int, positions), const int S, const int C,
                          const int K, const int silu, CARG(float, bias), const int has_bias)
{
    const int c = get_global_id(0), s = get_global_id(1);
    if (c >= C || s >= S)
        return;
    BIND(float, out); CBIND(float, x); CBIND(float, weight); BIND(float, state);
    CBIND(int, starts); CBIND(int, slots); CBIND(int, positions); CBIND(float, bias);
    const float bc = has_bias ? bias[c] : 0.0f;
    const int r0 = starts[s], r1 = starts[s + 1];
    if (r1 <= r0)
        return;
    __global float* st = state + (size_t)slots[s] * (K - 1) * C + c;       /* state[slot, i, c] = st[i C] */
    float w[CONV_KMAX], win[CONV_KMAX];
    #pragma unroll
    for (int i = 0; i < CONV_KMAX; ++i) {
        w[i] = i < K ? weight[(size_t)c * K + i] : 0.0f;
        win[i] = 0.0f;                                 /* position 0: u(q < 0) = 0, the slot is not read */
    }
    if (positions[r0] != 0) {
        #pragma unroll
        for (int i = 0; i < CONV_KMAX - 1; ++i)
            if (i < K - 1)
                win[i] = st[(size_t)i * C];
    }
    for (int t = r0; t < r1; ++t) {
        const float xt = x[(size_t)t * C + c];
        /* y = sum_{i<K-1} w[i] u(p-K+1+i) + w[K-1] x[t]   (the reference's order: oldest tap first) */
        float y = 0.0f, wl = 0.0f;
        #pragma unroll
        for (int i = 0; i < CONV_KMAX; ++i) {
            if (i < K - 1)
                y += w[i] * win[i];
            if (i == K - 1)
                wl = w[i];
        }
        y += wl * xt;
        y += bc;
        out[(size_t)t * C + c] = silu ? y / (1.0f + exp(-y)) : y;     /* silu(y) = y sigmoid(y); LFM2: y */
        /* slide the window: win[i] = win[i+1], the newest input x[t] last */
        #pragma unroll
        for (int i = 0; i < CONV_KMAX - 1; ++i)
            win[i] = i < K - 2 ? win[i + 1] : (i == K - 2 ? xt : win[i]);
    }
    #pragma unroll
    for (int i = 0; i < CONV_KMAX - 1; ++i)
        if (i < K - 1)
            st[(size_t)i * C] = win[i];
}

/* -- the gated delta rule ------------------------------------------------------------------------
 * Per token t and value head h (key head hk = (h / group) % Hk: group = Hv / Hk, the checkpoint's grouped
 * order, or 1, llama.cpp's tiled one), S the head's state [dk, dv]:
 *   q = l2(qkv[t, q part, hk]) / sqrt(dk),  k = l2(qkv[t, k part, hk]),  v = qkv[t, v part, h]
 *   l2(x) = x / sqrt(sum x^2 + 1e-6),  beta = sigmoid(b[t, h]),  g = a_neg[h] softplus(a[t, h] + dt_bias[h])
 *   S = e^g S;  S += k (beta (v - S^T k))^T;  out[t, h] = S^T q
 * Column j of S (S[:, j], j < dv) evolves on its own: with kv_j = e^g sum_i S[i, j] k_i,
 *   d_j = beta (v_j - kv_j),  S[i, j] = e^g S[i, j] + k_i d_j,  o_j = sum_i S[i, j] q_i
 * so one work-item owns columns j = lid, lid + L, ... and the work-group shares only the per-token
 * q, k (normalised once, in local memory), g and beta. S stays in the state slot itself (global
 * memory, [num_slots, Hv, dk, dv]), read along a column with consecutive work-items on consecutive j.
 *
 * A sequence of more than one token runs in chunks of c <= DELTA_CHUNK tokens (the chunked form,
 * reference delta_rule_chunked). With G the cumulative log decay within the chunk and
 * D[a, b] = e^(G_a - G_b) for a >= b (every exponent <= 0: nothing overflows):
 *   A  = strictly_lower((beta k) k^T * D)    QK = lower(q k^T * D)                 [c, c]
 *   W  = (I + A)^-1 (beta k e^G)             [c, dk], shared            (forward substitution)
 *   U  = (I + A)^-1 (beta v)                 [c, dv], per column
 *   v' = U - W S;  out = (q e^G) S + QK v';  S = e^(G_last) S + (k e^(G_last - G))^T v'
 * q, k, W, A, QK, G and beta live in local memory; a column's U / v' and its partial products in
 * private arrays of DELTA_CHUNK (loops to that bound with guards: constant indices, registers). */

/* Load the chunk of C tokens t0 .. t0+C-1 into local memory for value head h:
 *   q_loc[c, i] = q of token t0+c (l2-normed, / sqrt(dk)),  k_loc[c, i] = k (l2-normed)   [C, dk]
 *   tok_loc[c]  = G_c (the cumulative log decay sum_{c' <= c} g_c'),  tok_loc[D..+c] = beta_c,
 *   tok_loc[2 D + r] = the norm of row r (r < C: q rows, C + c: k rows), D = DELTA_CHUNK
 * The sums of squares are tree reductions: P work-items per row (P a power of two, L / P rows a pass).
 * Called by every work-item of the group (barriers inside); ends with a barrier. */
inline void delta_load(__global const float* qkv, __global const float* a, __global const float* b,
                       __global const float* a_neg, __global const float* dt_bias, const int t0, const int C,
                       const int h, const int hk, const int Hk, const int Hv, const int dk, const int ld,
                       const float qscale, __local float* q_loc, __local float* k_loc, __local float* tok_loc,
                       __local float* red)
{
    const int lid = get_local_id(0), L = get_local_size(0);
    __local float* G = tok_loc;
    __local float* beta = tok_loc + DELTA_CHUNK;
    __local float* nrm = tok_loc + 2 * DELTA_CHUNK;
    barrier(CLK_LOCAL_MEM_FENCE);              /* the previous chunk's readers are done with local memory */
    for (int e = lid; e < C * dk; e += L) {
        const int c = e / dk, i = e - c * dk;
        __global const float* row = qkv + (size_t)(t0 + c) * ld;
        q_loc[e] = row[hk * dk + i];
        k_loc[e] = row[(Hk + hk) * dk + i];
    }
    /* g = a_neg[h] softplus(a + dt_bias[h]) (softplus(y) = y past 20, torch's threshold), beta = sigmoid(b) */
    for (int c = lid; c < C; c += L) {
        const size_t th = (size_t)(t0 + c) * Hv + h;
        const float y = a[th] + dt_bias[h];
        G[c] = a_neg[h] * (y > 20.0f ? y : log1p(exp(y)));
        beta[c] = 1.0f / (1.0f + exp(-b[th]));
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* nrm[r] = sqrt(sum_i row_r[i]^2 + 1e-6) for the 2C rows (q rows, then k rows) */
    const int R = 2 * C;
    int P = 1;                                 /* work-items per row: the largest power of two <= L / R */
    while (2 * P * R <= L)
        P *= 2;
    const int per_pass = L / P;                /* rows per pass (L is a power of two, so is P) */
    /* lid = row * P + p, the remainder written without `%`: with both `/` and `%` LLVM's DivRemPairs
     * inserts a `freeze`, which Oclgrind's uninitialized-value checker cannot interpret */
    const int prow = lid / P, p = lid - prow * P;
    for (int base = 0; base < R; base += per_pass) {      /* uniform: every work-item runs every pass */
        const int r = base + prow;
        float ss = 0.0f;
        if (r < R) {
            __local const float* x = r < C ? q_loc + r * dk : k_loc + (r - C) * dk;
            for (int i = p; i < dk; i += P)
                ss += x[i] * x[i];
        }
        red[lid] = ss;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int o = P / 2; o > 0; o >>= 1) {              /* within each row's segment of P */
            if (p < o)
                red[lid] += red[lid + o];
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        if (p == 0 && r < R)
            nrm[r] = sqrt(red[lid] + 1e-6f);
        barrier(CLK_LOCAL_MEM_FENCE);                      /* red is rewritten by the next pass */
    }
    /* normalise in place; G_c = sum_{c' <= c} g_c' (one work-item: C <= DELTA_CHUNK terms, in order) */
    for (int e = lid; e < C * dk; e += L) {
        const int c = e / dk;
        q_loc[e] = q_loc[e] / nrm[c] * qscale;
        k_loc[e] = k_loc[e] / nrm[C + c];
    }
    if (lid == 0)
        for (int c = 1; c < C; ++c)
            G[c] += G[c - 1];
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* out [T, Hv * dv]; qkv [T, ld], ld = 2 Hk dk + Hv dv (q heads | k heads | v heads); a, b [T, Hv];
 * a_neg, dt_bias [Hv]; state [num_slots, Hv, dk, dv]; starts [S+1], slots [S], positions [T].
 * qscale = 1 / sqrt(dk); group: see above. One work-group of L work-items (a power of two) per (value head, sequence).
 * Local memory (floats), Cm = the longest chunk the launch may see (min(DELTA_CHUNK, T)):
 *   q_loc, k_loc, w_loc [Cm * dk] each, a_loc, qk_loc [Cm * Cm] each, tok_loc [4 * DELTA_CHUNK], red [L]
 * global (L * Hv, S), local (L, 1) */
__kernel void delta_rule(ARG(float, out), CARG(float, qkv), CARG(float, a), CARG(float, b), CARG(float, a_neg),
                         CARG(float, dt_bias), ARG(float, state), CARG(int, starts), CARG(int, slots),
                         CARG(int, positions), const int Hk, const int Hv, const int dk, const int dv,
                         const int group, const float qscale, const int stepwise, __local float* q_loc, __local float* k_loc,
                         __local float* w_loc, __local float* a_loc, __local float* qk_loc, __local float* tok_loc,
                         __local float* red)
{
    const int lid = get_local_id(0), L = get_local_size(0);
    const int h = get_group_id(0), s = get_group_id(1);
    BIND(float, out); CBIND(float, qkv); CBIND(float, a); CBIND(float, b); CBIND(float, a_neg);
    CBIND(float, dt_bias); BIND(float, state); CBIND(int, starts); CBIND(int, slots); CBIND(int, positions);
    const int r0 = starts[s], r1 = starts[s + 1];
    if (r1 <= r0)                              /* uniform over the work-group */
        return;
    const int hk = (h / group) % Hk;
    const int ld = 2 * Hk * dk + Hv * dv, voff = 2 * Hk * dk + h * dv;
    const size_t ldo = (size_t)Hv * dv;
    __global float* Sh = state + ((size_t)slots[s] * Hv + h) * dk * dv;      /* S[i, j] = Sh[i dv + j] */
    __local const float* G = tok_loc;
    __local const float* beta = tok_loc + DELTA_CHUNK;
    int fresh = positions[r0] == 0;            /* S starts at 0: the slot is never read */

    /* chunk by chunk (the last one may be shorter); a sequence of one token (decode) runs the recurrence.
     * PoCL 3.0 (pip's, LLVM 14) and this kernel: Oclgrind runs every shape below clean, but PoCL's
     * work-group compiler crashes ("Could not find a dominating alternative variable", work-groups of
     * 1 or 2) when decode and prefill each call delta_load in their own branch, and writes out of
     * bounds when a column loop after the barriers is written `for (j = lid; j < dv; j += L)`. Hence one
     * loop and one delta_load for both, and the column loops as `j = j0 + lid ... continue`. */
    /* stepwise (a verification of drafted tokens): every token by the recurrence, decode's arithmetic */
    const int one = stepwise || r1 - r0 == 1;
    for (int t0 = r0; t0 < r1; t0 += one ? 1 : DELTA_CHUNK) {
        const int C = one ? 1 : min(DELTA_CHUNK, r1 - t0);
        delta_load(qkv, a, b, a_neg, dt_bias, t0, C, h, hk, Hk, Hv, dk, ld, qscale, q_loc, k_loc, tok_loc, red);
        if (one) {
            /* decode: the recurrence, one token */
            const float eg = exp(G[0]), bt = beta[0];
            for (int j0 = 0; j0 < dv; j0 += L) {
                const int j = j0 + lid;
                if (j >= dv)
                    continue;
                __global float* Sj = Sh + j;
                /* kv_j = sum_i (e^g S[i, j]) k_i,  d_j = beta (v_j - kv_j) */
                float kv = 0.0f;
                if (!fresh)
                    for (int i = 0; i < dk; ++i)
                        kv += (eg * Sj[(size_t)i * dv]) * k_loc[i];
                const float d = bt * (qkv[(size_t)t0 * ld + voff + j] - kv);
                /* S[i, j] = e^g S[i, j] + k_i d_j,  o_j = sum_i S[i, j] q_i */
                float o = 0.0f;
                for (int i = 0; i < dk; ++i) {
                    const float sij = (fresh ? 0.0f : eg * Sj[(size_t)i * dv]) + k_loc[i] * d;
                    Sj[(size_t)i * dv] = sij;
                    o += sij * q_loc[i];
                }
                out[(size_t)t0 * ldo + h * dv + j] = o;
            }
        } else {
            /* prefill: the chunked form */
            /* A[x, y] = beta_x (k_x . k_y) D[x, y] (y < x),  QK[x, y] = (q_x . k_y) D[x, y] (y <= x), 0 above */
            for (int e = lid; e < C * C; e += L) {
                const int x = e / C, y = e - x * C;
                float av = 0.0f, qv = 0.0f;
                if (y <= x) {
                    __local const float* kx = k_loc + x * dk;
                    __local const float* qx = q_loc + x * dk;
                    __local const float* ky = k_loc + y * dk;
                    float kk = 0.0f, qk = 0.0f;
                    for (int i = 0; i < dk; ++i) {
                        kk += kx[i] * ky[i];
                        qk += qx[i] * ky[i];
                    }
                    const float Dxy = exp(G[x] - G[y]);
                    av = y < x ? beta[x] * kk * Dxy : 0.0f;
                    qv = qk * Dxy;
                }
                a_loc[e] = av;
                qk_loc[e] = qv;
            }
            barrier(CLK_LOCAL_MEM_FENCE);
            /* W = (I + A)^-1 (beta k e^G): W[x, :] = beta_x e^(G_x) k_x - sum_{y<x} A[x, y] W[y, :], row by row;
             * each work-item owns columns i of W, so the rows need no barrier between them */
            for (int i = lid; i < dk; i += L)
                for (int x = 0; x < C; ++x) {
                    float wv = beta[x] * exp(G[x]) * k_loc[x * dk + i];
                    for (int y = 0; y < x; ++y)
                        wv -= a_loc[x * C + y] * w_loc[y * dk + i];
                    w_loc[x * dk + i] = wv;
                }
            barrier(CLK_LOCAL_MEM_FENCE);
            const float eGl = exp(G[C - 1]);
            for (int j0 = 0; j0 < dv; j0 += L) {
                const int j = j0 + lid;
                if (j >= dv)
                    continue;
                __global float* Sj = Sh + j;
                float u[DELTA_CHUNK], ws[DELTA_CHUNK], qs[DELTA_CHUNK];
                /* U[:, j] = (I + A)^-1 (beta v[:, j]): u_x = beta_x v_xj - sum_{y<x} A[x, y] u_y */
                #pragma unroll
                for (int x = 0; x < DELTA_CHUNK; ++x) {
                    float ux = 0.0f;
                    if (x < C) {
                        ux = beta[x] * qkv[(size_t)(t0 + x) * ld + voff + j];
                        #pragma unroll
                        for (int y = 0; y < x; ++y)
                            ux -= a_loc[x * C + y] * u[y];
                    }
                    u[x] = ux;
                    ws[x] = 0.0f;
                    qs[x] = 0.0f;
                }
                /* ws = W S[:, j],  qs = q S[:, j]  (one pass over the column) */
                if (!fresh)
                    for (int i = 0; i < dk; ++i) {
                        const float sij = Sj[(size_t)i * dv];
                        #pragma unroll
                        for (int x = 0; x < DELTA_CHUNK; ++x)
                            if (x < C) {
                                ws[x] += w_loc[x * dk + i] * sij;
                                qs[x] += q_loc[x * dk + i] * sij;
                            }
                    }
                /* v' = U - W S[:, j];  out[x, j] = e^(G_x) (q_x . S[:, j]) + sum_{y<=x} QK[x, y] v'_y */
                #pragma unroll
                for (int x = 0; x < DELTA_CHUNK; ++x)
                    u[x] -= ws[x];
                #pragma unroll
                for (int x = 0; x < DELTA_CHUNK; ++x)
                    if (x < C) {
                        float o = exp(G[x]) * qs[x];
                        #pragma unroll
                        for (int y = 0; y <= x; ++y)
                            o += qk_loc[x * C + y] * u[y];
                        out[(size_t)(t0 + x) * ldo + h * dv + j] = o;
                    }
                /* S[:, j] = e^(G_last) S[:, j] + sum_x k_x e^(G_last - G_x) v'_x */
                #pragma unroll
                for (int x = 0; x < DELTA_CHUNK; ++x)
                    u[x] = x < C ? u[x] * exp(G[C - 1] - G[x]) : 0.0f;
                for (int i = 0; i < dk; ++i) {
                    float sij = fresh ? 0.0f : eGl * Sj[(size_t)i * dv];
                    #pragma unroll
                    for (int x = 0; x < DELTA_CHUNK; ++x)
                        if (x < C)
                            sij += k_loc[x * dk + i] * u[x];
                    Sj[(size_t)i * dv] = sij;
                }
            }
        }
        fresh = 0;                             /* later chunks continue the state just written */
    }
}

/* Mamba-2's selective state space (base.py ssm_scan), token by token (prefill and decode alike):
 *   d = softplus(dt[t, h] + dt_bias[h]);  S[p, :] = e^(d a_neg[h]) S[p, :] + d x[p] B;
 *   out[t, h P + p] = S[p, :] . C + d_skip[h] x[p]
 * xbc [T, nh P + 2 G N] (x | B | C, head h reading group h / (nh / G)); dt [T, nh]; state [slots, nh, P, N].
 * One work-item per (head dim p of head h, sequence s) owns the state row S[h, p, :] in the slot.
 * global (nh P, S) */
__kernel void ssm_scan(ARG(float, out), CARG(float, xbc), CARG(float, dt), CARG(float, a_neg), CARG(float, d_skip),
                       CARG(float, dt_bias), ARG(float, state), CARG(int, starts), CARG(int, slots),
                       CARG(int, positions), const int S, const int nh, const int P, const int G, const int N)
{
    const int hp = get_global_id(0), s = get_global_id(1);
    if (hp >= nh * P || s >= S)
        return;
    BIND(float, out); CBIND(float, xbc); CBIND(float, dt); CBIND(float, a_neg); CBIND(float, d_skip);
    CBIND(float, dt_bias); BIND(float, state); CBIND(int, starts); CBIND(int, slots); CBIND(int, positions);
    const int r0 = starts[s], r1 = starts[s + 1];
    if (r1 <= r0)
        return;
    const int h = hp / P, di = nh * P, W = di + 2 * G * N, g = h / (nh / G);
    __global float* row = state + ((size_t)slots[s] * nh * P + hp) * N;
    if (positions[r0] == 0)
        for (int n = 0; n < N; ++n)
            row[n] = 0.0f;
    const int b0 = di + g * N, c0 = di + G * N + g * N;
    for (int t = r0; t < r1; ++t) {
        const float v = dt[(size_t)t * nh + h] + dt_bias[h];
        const float d = v > 20.0f ? v : log1p(exp(v));
        const float dA = exp(d * a_neg[h]);
        __global const float* xr = xbc + (size_t)t * W;
        const float xv = xr[hp];
        float y = 0.0f;
        for (int n = 0; n < N; ++n) {
            const float sn = row[n] * dA + (d * xr[b0 + n]) * xv;
            row[n] = sn;
            y += sn * xr[c0 + n];
        }
        out[(size_t)t * di + hp] = y + d_skip[h] * xv;
    }
}

/* out[i] = x[i] * act(gate[i]), n contiguous floats (any [R, N]; out may be x):
 *   silu    = gate sigmoid(gate)      (the gated RMSNorm's output gate)
 *   sigmoid = sigmoid(gate)           (Qwen3.5's attention output gate)
 *   none    = gate                    (LFM2's short-convolution gates)
 * mode: 0 sigmoid, 1 silu, 2 none.  global (n) */
__kernel void gate_mul(ARG(float, out), CARG(float, x), CARG(float, gate), const int n, const int mode)
{
    const int i = get_global_id(0);
    if (i >= n)
        return;
    BIND(float, out); CBIND(float, x); CBIND(float, gate);
    const float g = gate[i];
    out[i] = mode == 1 ? x[i] * (g / (1.0f + exp(-g))) : mode == 2 ? x[i] * g : x[i] / (1.0f + exp(-g));
}
