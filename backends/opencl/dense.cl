/* Dense kernels: embed (row gather), matmul / GEMV, head_matmul (per-head GEMV), rmsnorm, rope, add, scale.
 * Built per matrix type: float32, half (WF16=1), bfloat16 (WBF16=1), int8 (WI8=1), q8_0 and q4_0
 * (WQ8_0=1, WQ4_0=1: row n at WROW(w, n, K)); see common.cl.
 * Every matrix argument w comes with wscale, its int8 row scales [N] (any buffer, unread, otherwise). */

/* out[t, h] = table[ids[t], h] (* tscale[ids[t]])      out [T,H], table [V,H] (storage type), ids [T]
 * global (H, T) */
__kernel void embed(ARG(float, out), CARG(WTYPE, table), CARG(float, tscale), CARG(int, ids), const int T,
                    const int H)
{
    const int h = get_global_id(0), t = get_global_id(1);
    if (h >= H || t >= T)
        return;
    BIND(float, out); CBIND(WTYPE, table); CBIND(float, tscale); CBIND(int, ids);
    out[(size_t)t * H + h] = LDWR(WROW(table, ids[t], H), h) * WSCALE(tscale, ids[t]);
}

/* out[t, n] = sum_k x[t, k] * w[n, k]  (* wscale[n], int8)  (+ bias[n])
 *     out [T,N] (row stride ldo), x [T,K] (row stride ldx), w [N,K] (storage type), bias [N] fp32
 * One work-item per output (GEMV: one weight row each, read along K with 4-wide vector loads,
 * the pattern Mali's load/store unit prefers; no local memory, no barriers). global (N, T) */
__kernel void matmul1(ARG(float, out), const int ldo, CARG(float, x), const int ldx, CARG(WTYPE, w),
                      CARG(float, wscale), CARG(float, bias), const int has_bias, const int T, const int K,
                      const int N)
{
    const int n = get_global_id(0), t = get_global_id(1);
    if (n >= N || t >= T)
        return;
    BIND(float, out); CBIND(float, x); CBIND(WTYPE, w); CBIND(float, wscale); CBIND(float, bias);
    float acc = dotw(WROW(w, n, K), x + (size_t)t * ldx, K) * WSCALE(wscale, n);
    if (has_bias)
        acc += bias[n];
    out[(size_t)t * ldo + n] = acc;
}

/* The same for blocks of ROWS_PER_ITEM (4, the float4 lanes of dotw4) tokens: each weight row is
 * read once per four tokens. Rows past T are clamped to T-1 (valid memory, result discarded).
 * global (N, ceil(T / ROWS_PER_ITEM)) */
__kernel void matmul4(ARG(float, out), const int ldo, CARG(float, x), const int ldx, CARG(WTYPE, w),
                      CARG(float, wscale), CARG(float, bias), const int has_bias, const int T, const int K,
                      const int N)
{
    const int n = get_global_id(0), t0 = ROWS_PER_ITEM * get_global_id(1);
    if (n >= N || t0 >= T)
        return;
    BIND(float, out); CBIND(float, x); CBIND(WTYPE, w); CBIND(float, wscale); CBIND(float, bias);
    const int t1 = min(t0 + 1, T - 1), t2 = min(t0 + 2, T - 1), t3 = min(t0 + 3, T - 1);
    float4 acc = dotw4(WROW(w, n, K), x + (size_t)t0 * ldx, x + (size_t)t1 * ldx,
                       x + (size_t)t2 * ldx, x + (size_t)t3 * ldx, K) * WSCALE(wscale, n);
    if (has_bias)
        acc += (float4)(bias[n]);
    out[(size_t)t0 * ldo + n] = acc.x;
    if (t0 + 1 < T) out[(size_t)(t0 + 1) * ldo + n] = acc.y;
    if (t0 + 2 < T) out[(size_t)(t0 + 2) * ldo + n] = acc.z;
    if (t0 + 3 < T) out[(size_t)(t0 + 3) * ldo + n] = acc.w;
}

/* Up to three projections of the same x in one launch (attention's q, k, v):
 *   out_j[t, n] = sum_k x[t, k] * w_j[n, k]  (* s_j[n], int8)  (+ b_j[n] when bit j of has_bias)
 *   out_j [T,N_j] contiguous, x [T,K] (row stride ldx), w_j [N_j,K] one storage type, b_j [N_j] fp32
 * Work-item n of N0 + N1 + N2 computes column n - (N0 + ... ) of the projection it falls in, for
 * ROWS_PER_ITEM tokens (one, by the single-row dot, when T == 1: decode). global (N0+N1+N2, ceil(T/4)) */
__kernel void matmul3(ARG(float, out0), ARG(float, out1), ARG(float, out2), CARG(float, x), const int ldx,
                      CARG(WTYPE, w0), CARG(WTYPE, w1), CARG(WTYPE, w2), CARG(float, s0), CARG(float, s1),
                      CARG(float, s2), CARG(float, b0), CARG(float, b1), CARG(float, b2), const int has_bias,
                      const int N0, const int N1, const int N2, const int T, const int K)
{
    const int col = get_global_id(0), t0 = ROWS_PER_ITEM * get_global_id(1);
    if (col >= N0 + N1 + N2 || t0 >= T)
        return;
    BIND(float, out0); BIND(float, out1); BIND(float, out2); CBIND(float, x);
    CBIND(WTYPE, w0); CBIND(WTYPE, w1); CBIND(WTYPE, w2); CBIND(float, s0); CBIND(float, s1); CBIND(float, s2);
    CBIND(float, b0); CBIND(float, b1); CBIND(float, b2);
    const int j = col < N0 ? 0 : (col < N0 + N1 ? 1 : 2);
    const int n = col - (j > 0 ? N0 : 0) - (j > 1 ? N1 : 0);
    const int N = j == 0 ? N0 : (j == 1 ? N1 : N2);
    __global const WTYPE* w = j == 0 ? w0 : (j == 1 ? w1 : w2);
    __global const float* sc = j == 0 ? s0 : (j == 1 ? s1 : s2);
    __global const float* b = j == 0 ? b0 : (j == 1 ? b1 : b2);
    __global float* out = j == 0 ? out0 : (j == 1 ? out1 : out2);
    const float bias = (has_bias >> j) & 1 ? b[n] : 0.0f;
    if (T == 1) {
        out[n] = dotw(WROW(w, n, K), x, K) * WSCALE(sc, n) + bias;
        return;
    }
    const int t1 = min(t0 + 1, T - 1), t2 = min(t0 + 2, T - 1), t3 = min(t0 + 3, T - 1);
    const float4 acc = dotw4(WROW(w, n, K), x + (size_t)t0 * ldx, x + (size_t)t1 * ldx, x + (size_t)t2 * ldx,
                             x + (size_t)t3 * ldx, K) * WSCALE(sc, n) + bias;
    out[(size_t)t0 * N + n] = acc.x;
    if (t0 + 1 < T) out[(size_t)(t0 + 1) * N + n] = acc.y;
    if (t0 + 2 < T) out[(size_t)(t0 + 2) * N + n] = acc.z;
    if (t0 + 3 < T) out[(size_t)(t0 + 3) * N + n] = acc.w;
}

#if !WBLOCK && !WI8
/* Per-head projections (latent attention's absorbed up-projections), the float types only:
 *   out[t, g, n] = sum_k x[t, g, k] * w[g, n, k]
 *   out [T,G,N], x [T,G,K] contiguous, w [G,N,K] float32, half or bfloat16 (head g's [N,K] matrix
 *   contiguous, row-major)
 * One work-item per (n, g) and ROWS_PER_ITEM tokens: each weight row is read once per four tokens
 * (decode: once, by the single-row dot). The weights are widened to float and multiplied in float
 * whatever COLIBRI_HALF_MATH: the products are fp32 as the reference's.
 * global (N, G, ceil(T / ROWS_PER_ITEM)) */
__kernel void head_matmul(ARG(float, out), CARG(float, x), CARG(WTYPE, w), const int T, const int G, const int N,
                          const int K)
{
    const int n = get_global_id(0), g = get_global_id(1), t0 = ROWS_PER_ITEM * get_global_id(2);
    if (n >= N || t0 >= T)
        return;
    BIND(float, out); CBIND(float, x); CBIND(WTYPE, w);
    __global const WTYPE* wr = w + ((size_t)g * N + n) * K;
    const size_t ldx = (size_t)G * K;                       /* x's token stride */
    __global const float* x0 = x + ((size_t)t0 * G + g) * K;
    __global float* o = out + ((size_t)t0 * G + g) * N + n;
    const int rows = min(ROWS_PER_ITEM, T - t0);
    int k = 0;
    if (rows == 1) {
        float acc = 0.0f;
        for (; k + 4 <= K; k += 4)
            acc += dot(LDW4(wr, k), vload4(0, x0 + k));
        for (; k < K; ++k)
            acc += LDW(wr, k) * x0[k];
        o[0] = acc;
        return;
    }
    /* rows past T are clamped to the last one (valid memory, result discarded) */
    __global const float* x1 = x0 + ldx * min(1, rows - 1);
    __global const float* x2 = x0 + ldx * min(2, rows - 1);
    __global const float* x3 = x0 + ldx * min(3, rows - 1);
    float4 acc = (float4)(0.0f);
    for (; k + 4 <= K; k += 4) {
        const float4 wv = LDW4(wr, k);
        acc += (float4)(dot(wv, vload4(0, x0 + k)), dot(wv, vload4(0, x1 + k)), dot(wv, vload4(0, x2 + k)),
                        dot(wv, vload4(0, x3 + k)));
    }
    for (; k < K; ++k) {
        const float wk = LDW(wr, k);
        acc += wk * (float4)(x0[k], x1[k], x2[k], x3[k]);
    }
    const size_t ldo = (size_t)G * N;                       /* out's token stride */
    o[0] = acc.x;
    if (rows > 1) o[ldo] = acc.y;
    if (rows > 2) o[2 * ldo] = acc.z;
    if (rows > 3) o[3 * ldo] = acc.w;
}
#endif

/* int8 activations (WACT8 builds; quant.py quantize_activations is the definition): per block of blk (32, or
 * 256 in front of quant.ACT256's formats) of row t of x, dx = max|x| / 127, q = clamp(rint(x / dx), -127, 127)
 * (dx = 0: q = 0); per 32 b, xs = dx sum q, packed as 10 floats: q:i8[32] | dx | xs at out + t * ldo + 10 b
 * (dx repeated for each 32 of a block).   global (K / 32, T) */
__kernel void quantize_act(ARG(float, out), const int ldo, CARG(float, x), const int ldx, const int T, const int K,
                           const int blk)
{
    const int b = get_global_id(0), t = get_global_id(1);
    if (b >= K / 32 || t >= T)
        return;
    BIND(float, out); CBIND(float, x);
    __global const float* xb = x + (size_t)t * ldx + (32 * b) / blk * blk;
    float amax = 0.0f;
    for (int i = 0; i < blk; ++i)
        amax = fmax(amax, fabs(xb[i]));
    __global const float* xr = x + (size_t)t * ldx + 32 * b;
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    __global float* ob = out + (size_t)t * ldo + 10 * b;
    __global char* q = (__global char*)ob;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
        const int v = (int)clamp(rint(xr[i] * inv), -127.0f, 127.0f);
        q[i] = (char)v;
        sum += v;
    }
    ob[8] = d;
    ob[9] = d * (float)sum;
}

/* The work-group's sum of every work-item's s (local size L a power of two; part: L local floats), in every
 * work-item; part is free again when it returns. */
inline float group_sum(const float s, __local float* part)
{
    const int l = get_local_id(0), L = get_local_size(0);
    part[l] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = L / 2; o > 0; o >>= 1) {
        if (l < o)
            part[l] += part[l + o];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float total = part[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight[:]      out, x [R,D], weight [D] fp32
 * One work-group per row; local size L a power of two; part: L floats of local memory.
 * In place (out == x) is safe: each element is read and written by the same work-item. */
__kernel void rmsnorm(ARG(float, out), CARG(float, x), CARG(float, weight), const int D, const float eps,
                      __local float* part)
{
    const int r = get_group_id(0), l = get_local_id(0), L = get_local_size(0);
    BIND(float, out); CBIND(float, x); CBIND(float, weight);
    __global const float* xr = x + (size_t)r * D;
    __global float* outr = out + (size_t)r * D;
    float s = 0.0f;
    for (int i = l; i < D; i += L)
        s += xr[i] * xr[i];
    const float rms = sqrt(group_sum(s, part) / (float)D + eps);
    for (int i = l; i < D; i += L)
        outr[i] = xr[i] / rms * weight[i];
}

/* out[r, :] = (x[r, :] - mean) / sqrt(mean((x[r, :] - mean)^2) + eps) * weight[:] + bias[:]  (LayerNorm:
 * Phi-3.5-MoE)  out, x [R,D], weight, bias [D] fp32. One work-group per row; local size L a power of two;
 * part: L floats of local memory. In place (out == x) is safe, as rmsnorm. */
__kernel void layernorm(ARG(float, out), CARG(float, x), CARG(float, weight), CARG(float, bias), const int D,
                        const float eps, __local float* part)
{
    const int r = get_group_id(0), l = get_local_id(0), L = get_local_size(0);
    BIND(float, out); CBIND(float, x); CBIND(float, weight); CBIND(float, bias);
    __global const float* xr = x + (size_t)r * D;
    __global float* outr = out + (size_t)r * D;
    float s = 0.0f;
    for (int i = l; i < D; i += L)
        s += xr[i];
    const float mean = group_sum(s, part) / (float)D;
    float ss = 0.0f;
    for (int i = l; i < D; i += L) {
        const float c = xr[i] - mean;
        ss += c * c;
    }
    const float sd = sqrt(group_sum(ss, part) / (float)D + eps);
    for (int i = l; i < D; i += L)
        outr[i] = (xr[i] - mean) / sd * weight[i] + bias[i];
}

/* Rotary embedding, rotate-half convention, x and out [T, heads, D], positions [T]:
 *   out[..., i]       = x_i cos(p f_i) - x_{i+D/2} sin(p f_i)
 *   out[..., i + D/2] = x_{i+D/2} cos(p f_i) + x_i sin(p f_i),     f_i = theta^(-2i/D), i < D/2
 * inv_freq [D/2] holds f_i, computed once on the host in fp32 (as the reference does), so the
 * angle p * f_i is one correctly rounded fp32 product on every backend. global (D/2, T*heads) */
__kernel void rope(ARG(float, out), CARG(float, x), CARG(int, positions), CARG(float, inv_freq),
                   const int T, const int heads, const int D)
{
    const int i = get_global_id(0), row = get_global_id(1);
    const int half_d = D / 2;
    if (i >= half_d || row >= T * heads)
        return;
    BIND(float, out); CBIND(float, x); CBIND(int, positions); CBIND(float, inv_freq);
    const int t = row / heads;
    const float ang = (float)positions[t] * inv_freq[i];
    const float c = cos(ang), s = sin(ang);
    const size_t base = (size_t)row * D;
    const float x1 = x[base + i], x2 = x[base + i + half_d];
    out[base + i] = x1 * c - x2 * s;
    out[base + i + half_d] = x2 * c + x1 * s;
}

/* out[t, h] = a[t, h] + b[t, h]                                     (has_gate == 0)
 * out[t, h] = a[t, h] + b[t, h] / (1 + exp(-gate[t]))  (sigmoid gate; Qwen2-MoE shared expert)
 * out, a, b [T,H]; gate [T,1]. global (n = T*H) */
__kernel void add(ARG(float, out), CARG(float, a), CARG(float, b), CARG(float, gate), const int has_gate,
                  const int n, const int H)
{
    const int i = get_global_id(0);
    if (i >= n)
        return;
    BIND(float, out); CBIND(float, a); CBIND(float, b); CBIND(float, gate);
    if (has_gate)
        out[i] = a[i] + b[i] / (1.0f + exp(-gate[i / H]));
    else
        out[i] = a[i] + b[i];
}

/* out[i] = factor * x[i]                          (cap == 0: Gemma's embedding scale, layer scalar)
 * out[i] = cap * tanh(factor * x[i] / cap)        (cap > 0: soft-capping of the final logits)
 * out, x: n contiguous floats (any [R, N]); in place (out == x) is safe. global (n) */
__kernel void scale(ARG(float, out), CARG(float, x), const int n, const float factor, const float cap)
{
    const int i = get_global_id(0);
    if (i >= n)
        return;
    BIND(float, out); CBIND(float, x);
    const float v = x[i] * factor;
    out[i] = cap > 0.0f ? cap * tanh(v / cap) : v;
}

/* out[t, i] = x[t, i] * (log1p(floor((positions[t] + 1) / floor_scale)) * attn_scale + 1), rows of N
 * (Llama 4's attention temperature on its no-rope layers' queries; out may be x). global (N, T) */
__kernel void pos_scale(ARG(float, out), CARG(float, x), CARG(int, positions), const int T, const int N,
                        const float floor_scale, const float attn_scale)
{
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= N || t >= T)
        return;
    BIND(float, out); CBIND(float, x); CBIND(int, positions);
    const float f = log1p(floor(((float)positions[t] + 1.0f) / floor_scale)) * attn_scale + 1.0f;
    out[(size_t)t * N + i] = x[(size_t)t * N + i] * f;
}

/* out[i] = 0 for i < n, any 4-byte element type (arena and KV cache zero-fill: a kernel rather than
 * clEnqueueFillBuffer, so Oclgrind's uninitialized-value tracking sees the buffers written). global (n) */
__kernel void zero(ARG(uint, out), const int n)
{
    const int i = get_global_id(0);
    if (i >= n)
        return;
    BIND(uint, out);
    out[i] = 0u;
}
