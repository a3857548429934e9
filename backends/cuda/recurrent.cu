// Colibri Edge CUDA kernels: the recurrent mixers (Qwen3.5 / Qwen3-Next gated delta-net linear attention):
// the depthwise causal conv, the gated delta rule and the output gates. Output first.
// A step's tokens are grouped by sequence: sequence s owns tokens starts[s] .. starts[s+1]-1, at consecutive
// positions, and the fixed-size state slot slots[s]. A sequence whose first token in the step is at position 0
// starts from a zero state and never reads its slot; the state after its last token is written back to the
// slot (prefill chunks and decode steps continue it). base.py "recurrent mixers" is the contract,
// backends/reference/backend.py (delta_rule_recurrent, delta_rule_chunked) the NumPy reference.
// No kernel here allocates or talks to the host: a decode step that runs them is captured in a CUDA graph.
#include "colibri_common.cuh"

// CONV_MAX_K (conv taps), DELTA_CHUNK (tokens per chunk of the chunked delta rule), DELTA_MAX_DK and
// DELTA_MAX_DV (head dims: the shared rows and the block of one thread per value column) come from
// sources.py DEFINES
#if !defined(CONV_MAX_K) || !defined(DELTA_CHUNK) || !defined(DELTA_MAX_DK) || !defined(DELTA_MAX_DV)
#error "build with the -D options of backends/cuda/sources.py (python3 backends/cuda/sources.py --defines)"
#endif

// ------------------------------------------------------------------------------------------------------
// Depthwise causal conv1d + SiLU, its last K-1 inputs carried in the state:
//   out[t, c] = silu(sum_{i<K} w[c, i] u(p - K + 1 + i, c)),   p = positions[t]
// u(q, c): the input at position q of t's sequence -- x[t - (p - q), c] for the step's tokens (q >= p0, the
// sequence's first position in the step), state[slot, K - 1 - (p0 - q), c] before them, 0 for q < 0 (a
// sequence from position 0 reads zeros, never its slot). Afterwards state[slot, i, c] = u(pl - K + 2 + i, c),
// i < K - 1 (pl: the sequence's last position): the K-1 inputs ending at its last token.
// x, out [T, C] (distinct buffers); w [C, K] fp32; state [num_slots, K-1, C]
// one thread per (channel c, sequence s) walks the sequence's tokens, the window u of K inputs in registers:
// grid (ceil(C/blockDim), S), block 128
template <int K>
CE_DEV void conv_seq(float* out, const float* x, const float* w, float* state, const int* starts,
                     const int* slots, const int* positions, int C, int silu,
                     const float* bias) {
    const int s = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;                              // no barrier in this kernel
    const int t0 = starts[s], t1 = starts[s + 1];
    if (t1 <= t0) return;                            // a sequence with no token in the step: its slot untouched
    float* st = state + (size_t)slots[s] * (K - 1) * C + c;     // st[i * C] = u(p0 - K + 1 + i, c)
    const bool fresh = positions[t0] == 0;
    float wc[K], u[K];                               // u[0 .. K-2]: the K-1 inputs before the token, u[K-1] its own
#pragma unroll
    for (int i = 0; i < K; ++i) {
        wc[i] = w[(size_t)c * K + i];
        u[i] = 0.f;
    }
    if (!fresh) {
#pragma unroll
        for (int i = 0; i + 1 < K; ++i) u[i] = st[(size_t)i * C];
    }
    for (int t = t0; t < t1; ++t) {
        u[K - 1] = x[(size_t)t * C + c];
        float y = 0.f;
#pragma unroll
        for (int i = 0; i < K; ++i) y += wc[i] * u[i];
        if (bias) y += bias[c];
        out[(size_t)t * C + c] = silu ? y / (1.0f + expf(-y)) : y;  // silu(y); LFM2's short conv: y
#pragma unroll
        for (int i = 0; i + 1 < K; ++i) u[i] = u[i + 1];      // slide the window by one token
    }
#pragma unroll
    for (int i = 0; i + 1 < K; ++i) st[(size_t)i * C] = u[i];
}
static_assert(CONV_MAX_K == 8, "causal_conv instantiates K = 1 .. 8");
extern "C" __global__ void causal_conv(float* out, const float* x, const float* w, float* state, const int* starts,
                                       const int* slots, const int* positions, int C, int K,
                                       int silu, const float* bias) {
    switch (K) {                                     // K is uniform: the host checked 1 <= K <= CONV_MAX_K
        case 1: conv_seq<1>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
        case 2: conv_seq<2>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
        case 3: conv_seq<3>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
        case 4: conv_seq<4>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
        case 5: conv_seq<5>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
        case 6: conv_seq<6>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
        case 7: conv_seq<7>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
        default: conv_seq<8>(out, x, w, state, starts, slots, positions, C, silu, bias); break;
    }
}

// ------------------------------------------------------------------------------------------------------
// The gated delta rule, fp32, per sequence s and value head h (key head kh = (h / group) % Hk: group = Hv/Hk
// repeats each key head to Hv/Hk consecutive value heads, group 1 tiles them), its state
// S [dk, dv] = state[slots[s], h] (zero for a sequence from position 0). Per token t:
//   q = l2(qkv[t, q part, kh]) / sqrt(dk),  k = l2(qkv[t, k part, kh]),  v = qkv[t, v part, h]
//   l2(x) = x / sqrt(sum x^2 + 1e-6)
//   beta = sigmoid(b[t, h]),  g = a_neg[h] softplus(a[t, h] + dt_bias[h])    (softplus(y) = y past 20)
//   S = e^g S;  S += k (beta (v - S^T k))^T;  out[t, h] = S^T q
// qkv [T, 2 Hk dk + Hv dv] (q heads | k heads | v heads); a, b [T, Hv]; a_neg, dt_bias [Hv]; out [T, Hv dv];
// state [num_slots, Hv, dk, dv] (row i of S: dv floats, so a warp's columns j are one coalesced access).
//
// The recurrence is independent per value column j: with kv_j = sum_i (e^g S[i,j]) k_i and
// d_j = beta (v_j - kv_j), S[i,j] = e^g S[i,j] + k_i d_j and o_j = sum_i S[i,j] q_i. So one thread owns a
// column and walks it in the state buffer itself (its own column only: no other thread touches it); the
// threads share only the token's normalised q and k (shared rows, norms by a warp reduction).
//
// A sequence of one token in the step (decode) runs that recurrence. A longer one (prefill) runs the chunked
// form (DeltaNet's WY / UT transform, reference.delta_rule_chunked), chunks of c <= DELTA_CHUNK tokens from
// its first token (the last one may be shorter). With G the cumulative log decay in the chunk
// (G_i = g_0 + .. + g_i) and D[i, i'] = e^(G_i - G_i') for i >= i' (<= 1: g <= 0):
//   A = strictly_lower((beta k) k^T * D)                 [c, c]   (warps, a dot product over dk each)
//   L = lower(q k^T * D)                                 [c, c]
//   W = (I + A)^-1 (beta k e^G)                          [c, dk]  (forward substitution, a thread per i)
//   U = (I + A)^-1 (beta v)                              [c, dv]  (forward substitution, per column j)
//   v' = U - W S;   out = (q e^G) S + L v'
//   S  = e^(G_last) S + sum_c k_c e^(G_last - G_c) v'_c^T
// per column j: three passes over S[:, j] a chunk (q S, W S, the update), the c values of v'[:, j], U[:, j]
// and (q S)[:, j] in registers.
// grid (Hv, S), block 32 * ceil(dv / 32) <= DELTA_MAX_DV: thread j owns column j < dv (the others only help
// with the shared rows and reach every barrier).
// Shared: the chunk's q (later W) and k rows, 2 DELTA_CHUNK DELTA_MAX_DK floats (32 KiB), A and L (2 KiB),
// a few per-token values: about 34.4 KiB static, within 48 KiB.
static_assert(DELTA_CHUNK <= 32, "delta_rule: the per-token values of a chunk are computed by warp 0's lanes");

// One chunk's (or decode token's) normalised q and k rows into sq, sk [n, dk], and per token g, beta,
// the cumulative decay G, e^G and e^(G_last - G) (n >= 1 tokens from row c0).
CE_DEV void delta_load_rows(float* sq, float* sk, float* sg, float* sbeta, float* seG, float* sdec, float* snorm,
                            const float* qkv, const float* a, const float* b, float ah, float dth, int c0, int n,
                            int h, int kh, int Hk, int Hv, int dk, int width, float qscale) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    // the raw rows: q at kh dk, k at Hk dk + kh dk of each qkv row
    for (int e = tid; e < n * dk; e += blockDim.x) {
        const int c = e / dk, i = e - c * dk;
        const float* row = qkv + (size_t)(c0 + c) * width + (size_t)kh * dk + i;
        sq[e] = row[0];
        sk[e] = row[(size_t)Hk * dk];
    }
    // g = a_neg softplus(a + dt_bias),  beta = sigmoid(b)
    if (tid < n) {
        const size_t th = (size_t)(c0 + tid) * Hv + h;
        const float y = a[th] + dth;
        sg[tid] = ah * (y > 20.f ? y : log1pf(expf(y)));
        sbeta[tid] = 1.0f / (1.0f + expf(-b[th]));
    }
    __syncthreads();
    // the rows' norms sqrt(sum x^2 + 1e-6), a warp per row (q rows 0..n-1, k rows n..2n-1)
    for (int r = warp; r < 2 * n; r += nwarps) {     // r is uniform over the warp: every lane shuffles
        const float* row = r < n ? sq + (size_t)r * dk : sk + (size_t)(r - n) * dk;
        float ss = 0.f;
        for (int i = lane; i < dk; i += 32) ss += row[i] * row[i];
        ss = warp_sum(ss);
        if (lane == 0) snorm[r] = sqrtf(ss + 1e-6f);
    }
    // G = cumsum(g) (in order, as NumPy's fp32 cumsum), e^G, e^(G_last - G)
    if (tid == 0) {
        float G = 0.f, Gc[DELTA_CHUNK];
        for (int c = 0; c < n; ++c) {
            G += sg[c];
            Gc[c] = G;
        }
        for (int c = 0; c < n; ++c) {
            sg[c] = Gc[c];                           // sg now holds G
            seG[c] = expf(Gc[c]);
            sdec[c] = expf(G - Gc[c]);
        }
    }
    __syncthreads();
    // q = x / norm / sqrt(dk),  k = x / norm
    for (int e = tid; e < n * dk; e += blockDim.x) {
        const int c = e / dk;
        sq[e] = sq[e] / snorm[c] * qscale;
        sk[e] = sk[e] / snorm[n + c];
    }
    __syncthreads();
}

extern "C" __global__ void delta_rule(float* out, const float* qkv, const float* a, const float* b, const float* a_neg,
                                      const float* dt_bias, float* state, const int* starts, const int* slots,
                                      const int* positions, int Hk, int Hv, int dk, int dv, int group,
                                      float qscale, int stepwise) {
    __shared__ float sq[DELTA_CHUNK * DELTA_MAX_DK];     // the chunk's q rows [n, dk]; then W
    __shared__ float sk[DELTA_CHUNK * DELTA_MAX_DK];     // its k rows [n, dk]
    __shared__ float sA[DELTA_CHUNK][DELTA_CHUNK];       // A = strictly_lower((beta k) k^T * D)
    __shared__ float sL[DELTA_CHUNK][DELTA_CHUNK];       // L = lower(q k^T * D)
    __shared__ float sg[DELTA_CHUNK], sbeta[DELTA_CHUNK];   // per token: g (then G), beta
    __shared__ float seG[DELTA_CHUNK], sdec[DELTA_CHUNK];   // e^G, e^(G_last - G)
    __shared__ float snorm[2 * DELTA_CHUNK];             // the q rows' then the k rows' norms

    const int h = blockIdx.x, s = blockIdx.y;
    const int r0 = starts[s], r1 = starts[s + 1];
    if (r1 <= r0) return;                            // uniform over the block: no barrier reached yet
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int kh = (h / group) % Hk;
    const int width = 2 * Hk * dk + Hv * dv;         // a qkv row
    const size_t voff = (size_t)2 * Hk * dk + (size_t)h * dv;   // head h's v in a qkv row
    const int j = tid;                               // this thread's value column
    const bool own = j < dv;
    float* Sj = state + ((size_t)slots[s] * Hv + h) * dk * dv + j;    // Sj[i * dv] = S[i, j]
    bool fresh = positions[r0] == 0;                 // S = 0: its slot is never read
    const float ah = a_neg[h], dth = dt_bias[h];

    if (r1 - r0 == 1 || stepwise) {                  // decode: the recurrence, token by token (stepwise: a
        for (int t = r0; t < r1; ++t) {              // verification of drafted tokens, decode's arithmetic)
            delta_load_rows(sq, sk, sg, sbeta, seG, sdec, snorm, qkv, a, b, ah, dth, t, 1, h, kh, Hk, Hv, dk,
                            width, qscale);
            if (own) {
                const float eg = seG[0], beta = sbeta[0];
                // kv_j = sum_i (e^g S[i,j]) k_i;   d_j = beta (v_j - kv_j)
                float kv = 0.f;
                if (!fresh)
                    for (int i = 0; i < dk; ++i) kv += Sj[(size_t)i * dv] * eg * sk[i];
                const float d = beta * (qkv[(size_t)t * width + voff + j] - kv);
                // S[i,j] = e^g S[i,j] + k_i d_j;   o_j = sum_i S[i,j] q_i
                float o = 0.f;
                for (int i = 0; i < dk; ++i) {
                    const float x = (fresh ? 0.f : Sj[(size_t)i * dv] * eg) + sk[i] * d;
                    Sj[(size_t)i * dv] = x;
                    o += x * sq[i];
                }
                out[(size_t)t * Hv * dv + (size_t)h * dv + j] = o;
            }
            fresh = false;
            __syncthreads();                         // every reader of this token's rows is done
        }
        return;
    }

    for (int c0 = r0; c0 < r1; c0 += DELTA_CHUNK) {  // prefill: the chunked form
        const int n = min(DELTA_CHUNK, r1 - c0);
        delta_load_rows(sq, sk, sg, sbeta, seG, sdec, snorm, qkv, a, b, ah, dth, c0, n, h, kh, Hk, Hv, dk, width,
                        qscale);
        // A[c][c'] = beta_c (k_c . k_c') D[c][c'] (c' < c),  L[c][c'] = (q_c . k_c') D[c][c'] (c' <= c),
        // D[c][c'] = e^(G_c - G_c'); 0 elsewhere (and for rows past n). A warp per entry.
        for (int e = warp; e < DELTA_CHUNK * DELTA_CHUNK; e += nwarps) {
            const int c = e / DELTA_CHUNK, c2 = e % DELTA_CHUNK;
            const bool low = c2 <= c && c < n;      // uniform over the warp
            float kk = 0.f, qk = 0.f;
            if (low) {
                for (int i = lane; i < dk; i += 32) {
                    const float k2 = sk[c2 * dk + i];
                    kk += sk[c * dk + i] * k2;
                    qk += sq[c * dk + i] * k2;
                }
                kk = warp_sum(kk);
                qk = warp_sum(qk);
            }
            if (lane == 0) {
                const float D = low ? expf(sg[c] - sg[c2]) : 0.f;
                sA[c][c2] = c2 < c ? sbeta[c] * kk * D : 0.f;
                sL[c][c2] = qk * D;
            }
        }
        __syncthreads();
        float U[DELTA_CHUNK], qS[DELTA_CHUNK];       // column j: U[:, j] (then v'[:, j]) and (q S)[:, j]
        if (own) {
            // U = (I + A)^-1 (beta v):  U_c = beta_c v_c - sum_{c' < c} A[c][c'] U_c'
#pragma unroll
            for (int c = 0; c < DELTA_CHUNK; ++c) {
                float u = 0.f;
                if (c < n) {
                    u = sbeta[c] * qkv[(size_t)(c0 + c) * width + voff + j];
#pragma unroll
                    for (int c2 = 0; c2 < c; ++c2) u -= sA[c][c2] * U[c2];
                }
                U[c] = u;
                qS[c] = 0.f;
            }
            // (q S)_c = sum_i q_c[i] S[i, j]    (rows c >= n: unused)
            if (!fresh)
                for (int i = 0; i < dk; ++i) {
                    const float x = Sj[(size_t)i * dv];
#pragma unroll
                    for (int c = 0; c < DELTA_CHUNK; ++c) qS[c] += sq[c * dk + i] * x;
                }
        }
        __syncthreads();                             // every thread is done with the q rows
        // W = (I + A)^-1 (beta k e^G) over the q rows:  W_c = beta_c e^G_c k_c - sum_{c' < c} A[c][c'] W_c'
        // (each column i of dk on its own: a thread per i)
        for (int i = tid; i < dk; i += blockDim.x)
            for (int c = 0; c < n; ++c) {
                float w = sbeta[c] * seG[c] * sk[c * dk + i];
                for (int c2 = 0; c2 < c; ++c2) w -= sA[c][c2] * sq[c2 * dk + i];
                sq[c * dk + i] = w;
            }
        __syncthreads();
        if (own) {
            // v'_c = U_c - sum_i W_c[i] S[i, j]    (rows c >= n: unused)
            if (!fresh)
                for (int i = 0; i < dk; ++i) {
                    const float x = Sj[(size_t)i * dv];
#pragma unroll
                    for (int c = 0; c < DELTA_CHUNK; ++c) U[c] -= sq[c * dk + i] * x;
                }
            // out_c = e^G_c (q S)_c + sum_{c' <= c} L[c][c'] v'_c'
#pragma unroll
            for (int c = 0; c < DELTA_CHUNK; ++c)
                if (c < n) {
                    float o = seG[c] * qS[c];
#pragma unroll
                    for (int c2 = 0; c2 <= c; ++c2) o += sL[c][c2] * U[c2];
                    out[(size_t)(c0 + c) * Hv * dv + (size_t)h * dv + j] = o;
                }
            // S[i, j] = e^G_last S[i, j] + sum_c k_c[i] e^(G_last - G_c) v'_c
            const float elast = seG[n - 1];
            for (int i = 0; i < dk; ++i) {
                float x = fresh ? 0.f : Sj[(size_t)i * dv] * elast;
#pragma unroll
                for (int c = 0; c < DELTA_CHUNK; ++c)
                    if (c < n) x += sk[c * dk + i] * sdec[c] * U[c];
                Sj[(size_t)i * dv] = x;
            }
        }
        fresh = false;                               // S now lives in the slot
        __syncthreads();                             // before the next chunk overwrites the shared rows
    }
}

// ------------------------------------------------------------------------------------------------------
// out = x * act(gate), elementwise over n floats (in place allowed: out == x):
//   act 0 (silu, the gated RMSNorm's output gate):  out = x * (g / (1 + e^-g))
//   act 1 (sigmoid, Qwen3.5's attention output gate): out = x / (1 + e^-g)
// grid ceil(n/256), block 256
// Mamba-2's selective state space (base.py ssm_scan), token by token (prefill and decode alike):
//   d = softplus(dt[t, h] + dt_bias[h]);  S[p, :] = e^(d a_neg[h]) S[p, :] + d x[p] B;  out[t, h P + p] = S[p, :] . C + D[h] x[p]
// xbc [T, nh P + 2 G N] (x | B | C, head h reading group h / (nh / G)); dt [T, nh]; state [slots, nh, P, N].
// A thread per (head dim p of head h, sequence s) owns the state row S[h, p, :]: grid (ceil(nh P / 128), S), block 128
extern "C" __global__ void ssm_scan(float* out, const float* xbc, const float* dt, const float* a_neg, const float* d_skip,
                                    const float* dt_bias, float* state, const int* starts, const int* slots,
                                    const int* positions, int nh, int P, int G, int N) {
    const int hp = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (hp >= nh * P) return;
    const int r0 = starts[s], r1 = starts[s + 1];
    if (r1 <= r0) return;
    const int h = hp / P, di = nh * P, W = di + 2 * G * N, g = h / (nh / G);
    float* row = state + ((size_t)slots[s] * nh * P + hp) * N;
    if (positions[r0] == 0)
        for (int n = 0; n < N; ++n) row[n] = 0.f;
    const int b0 = di + g * N, c0 = di + G * N + g * N;
    for (int t = r0; t < r1; ++t) {
        const float v = dt[(size_t)t * nh + h] + dt_bias[h];
        const float d = v > 20.f ? v : log1pf(expf(v));
        const float dA = expf(d * a_neg[h]);
        const float* xr = xbc + (size_t)t * W;
        const float xv = xr[hp];
        float y = 0.f;
        for (int n = 0; n < N; ++n) {
            const float sn = row[n] * dA + (d * xr[b0 + n]) * xv;
            row[n] = sn;
            y += sn * xr[c0 + n];
        }
        out[(size_t)t * di + hp] = y + d_skip[h] * xv;
    }
}

// mode: 0 sigmoid, 1 silu, 2 none (out = x * gate: LFM2's short-convolution gates)
extern "C" __global__ void gate_mul(float* out, const float* x, const float* gate, long long n, int mode) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    out[i] = mode == 0 ? x[i] / (1.0f + expf(-g)) : mode == 2 ? x[i] * g : x[i] * (g / (1.0f + expf(-g)));
}
