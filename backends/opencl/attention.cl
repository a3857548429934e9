/* Paged KV cache: kv_write and paged attention (prefill chunks and decode alike). */

/* K[slots[t], e] = k[t, e];  V[slots[t], e] = v[t, e]     e < Hkv*D (row of [Hkv, D])
 * K, V [num_slots, Hkv, D]; k, v [T, Hkv, D]; slots [T]. global (Hkv*D, T) */
__kernel void kv_write(ARG(float, K), ARG(float, V), CARG(float, k), CARG(float, v), CARG(int, slots),
                       const int T, const int row)
{
    const int e = get_global_id(0), t = get_global_id(1);
    if (e >= row || t >= T)
        return;
    BIND(float, K); BIND(float, V); CBIND(float, k); CBIND(float, v); CBIND(int, slots);
    const size_t dst = (size_t)slots[t] * row + e, src = (size_t)t * row + e;
    K[dst] = k[src];
    V[dst] = v[src];
}

/* slot of position j: table[j / B] * B + j % B. The remainder is written as j - (j / B) * B: with
 * both `/` and `%` LLVM's DivRemPairs pass inserts a `freeze`, an instruction Oclgrind's
 * uninitialized-value checker cannot interpret. */
inline size_t slot_of(__global const int* table, const int j, const int B)
{
    const int blk = j / B;
    return (size_t)table[blk] * B + (j - blk * B);
}

/* Causal attention through block tables, fp32:
 *   token t of sequence s = seq_index[t] at position p = positions[t] attends to positions
 *   lo <= j <= p, lo = max(0, p - window + 1) (window 0: lo = 0),
 *   slot(j) = block_tables[s, j / B] * B + j % B;  query head h reads KV head h / (Hq / Hkv);
 *   out[t, h] = softmax_j(q[t, h] . K[slot(j), g] * scale) @ V[slot(j), g]
 *   with sinks (has_sinks): a logit sinks[h] joins the softmax's denominator only -- the online
 *   softmax starts from m = sinks[h], l = 1 instead of m = -inf, l = 0
 * q, out [T, Hq, D]; K, V [num_slots, Hkv, D]; block_tables [S, max_blocks] (row stride ldb).
 *
 * One work-group of C work-items per (head, token), C a power of two. Keys are taken in chunks
 * of C with an online softmax (running max m and sum l, accumulator rescaled by exp(m - m_new)):
 *   1. work-item i scores key j0 + i (a serial dot over D)              -> s_loc[i]
 *   2. every work-item reads the chunk's max (same value everywhere)    -> m_new
 *      work-item i writes p_loc[i] = exp(s_loc[i] - m_new)
 *   3. work-item i owns dims d = i, i + C, ...: acc[d] = acc[d] exp(m - m_new) + sum_i p_loc[i] V[., d]
 * Local memory: q_loc [D], acc [D], s_loc [C], p_loc [C].
 * global (C * Hq, T), local (C, 1) */
__kernel void paged_attention(ARG(float, out), CARG(float, q), CARG(float, K), CARG(float, V),
                              CARG(int, block_tables), const int ldb, CARG(int, seq_index), CARG(int, positions),
                              const int Hq, const int Hkv, const int D, const int B, const float scale,
                              const int window, CARG(float, sinks), const int has_sinks, __local float* q_loc, __local float* acc, __local float* s_loc,
                              __local float* p_loc)
{
    const int i = get_local_id(0), C = get_local_size(0);
    const int h = get_group_id(0), t = get_global_id(1);
    BIND(float, out); CBIND(float, q); CBIND(float, K); CBIND(float, V);
    CBIND(int, block_tables); CBIND(int, seq_index); CBIND(int, positions); CBIND(float, sinks);
    const int g = h / (Hq / Hkv);
    const int p = positions[t];
    __global const int* table = block_tables + (size_t)seq_index[t] * ldb;
    __global const float* qt = q + ((size_t)t * Hq + h) * D;
    for (int d = i; d < D; d += C) {
        q_loc[d] = qt[d];
        acc[d] = 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float m = has_sinks ? sinks[h] : -INFINITY, l = has_sinks ? 1.0f : 0.0f;
    for (int j0 = window > 0 ? max(0, p - window + 1) : 0; j0 <= p; j0 += C) {
        /* 1. scores */
        const int j = j0 + i;
        float s = -INFINITY;
        if (j <= p) {
            const size_t slot = slot_of(table, j, B);
            __global const float* kj = K + (slot * Hkv + g) * D;
            float dp = 0.0f;
            for (int d = 0; d < D; ++d)
                dp += q_loc[d] * kj[d];
            s = dp * scale;
        }
        s_loc[i] = s;
        barrier(CLK_LOCAL_MEM_FENCE);
        /* 2. running max and the chunk's probabilities (j0 <= p, so s_loc[0] is finite) */
        const int n = min(C, p - j0 + 1);
        float m_new = m;
        for (int c = 0; c < n; ++c)
            m_new = fmax(m_new, s_loc[c]);
        p_loc[i] = (i < n) ? exp(s_loc[i] - m_new) : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        const float alpha = exp(m - m_new);        /* exp(-inf) = 0 on the first chunk */
        float psum = 0.0f;
        for (int c = 0; c < n; ++c)
            psum += p_loc[c];
        l = l * alpha + psum;
        /* 3. accumulate V */
        for (int d = i; d < D; d += C) {
            float a = acc[d] * alpha;
            for (int c = 0; c < n; ++c) {
                const size_t slot = slot_of(table, j0 + c, B);
                a += p_loc[c] * V[(slot * Hkv + g) * D + d];
            }
            acc[d] = a;
        }
        m = m_new;
        barrier(CLK_LOCAL_MEM_FENCE);      /* s_loc / p_loc are rewritten by the next chunk */
    }
    __global float* ot = out + ((size_t)t * Hq + h) * D;
    for (int d = i; d < D; d += C)
        ot[d] = acc[d] / l;
}
