/* Paged KV cache: kv_write, paged attention and latent attention (prefill chunks and decode alike). */

/* K[slots[t], e] = k[t, e]  (e < krow);  V[slots[t], e] = v[t, e]  (e < vrow)
 * K [num_slots, Hkv, D], V [num_slots, Hkv, Dv]; k [T, Hkv, D], v [T, Hkv, Dv] (rows of krow = Hkv*D and
 * vrow = Hkv*Dv floats: latent attention's latent [.., 1, Dc] and rope key [.., 1, Dr] differ); slots [T].
 * global (max(krow, vrow), T) */
__kernel void kv_write(ARG(float, K), ARG(float, V), CARG(float, k), CARG(float, v), CARG(int, slots),
                       const int T, const int krow, const int vrow)
{
    const int e = get_global_id(0), t = get_global_id(1);
    if (t >= T)
        return;
    BIND(float, K); BIND(float, V); CBIND(float, k); CBIND(float, v); CBIND(int, slots);
    const size_t slot = (size_t)slots[t];
    if (e < krow)
        K[slot * krow + e] = k[(size_t)t * krow + e];
    if (e < vrow)
        V[slot * vrow + e] = v[(size_t)t * vrow + e];
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
 *   lo <= j <= p, lo = max(0, p - window + 1) (window 0: lo = 0; window < 0: chunks of -window, lo = p - p mod
 *   -window: Llama 4's chunked attention),
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
    for (int j0 = window > 0 ? max(0, p - window + 1) : window < 0 ? p - p % -window : 0; j0 <= p; j0 += C) {
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

/* Multi-head latent attention in the latent space (DeepSeek-V2's MLA, absorbed), fp32: every head
 * attends to one shared cache row per position, the latent c_j = C[slot(j)] (the keys' and the values'
 * compressed form) and the rope key r_j = R[slot(j)]:
 *   s_j = scale * (q[t, h] . c_j + q_rope[t, h] . r_j),   j = 0 .. p,  p = positions[t]
 *   out[t, h] = sum_j softmax(s)_j c_j
 *   slot(j) = block_tables[seq_index[t], j / B] * B + j % B
 * q, out [T, Hq, Dc]; q_rope [T, Hq, Dr]; C [num_slots, 1, Dc]; R [num_slots, 1, Dr];
 * block_tables [S, max_blocks] (row stride ldb).
 *
 * paged_attention's scheme: one work-group of L work-items per (head, token), L a power of two;
 * positions in chunks of L with an online softmax (running max m and sum l):
 *   1. work-item i scores position j0 + i (serial dots over Dc and Dr)  -> s_loc[i], its slot slot_loc[i]
 *   2. every work-item reads the chunk's max                            -> m_new
 *      work-item i writes p_loc[i] = exp(s_loc[i] - m_new)
 *   3. work-item i owns dims d = i, i + L, ...: acc[d] = acc[d] exp(m - m_new) + sum_c p_loc[c] c_{j0+c}[d]
 * The heads' work-groups read the same cache rows (one row per position for all heads).
 * Local memory: q_loc [Dc], qr_loc [Dr], acc [Dc], s_loc [L], p_loc [L], slot_loc [L] (int).
 * global (L * Hq, T), local (L, 1) */
__kernel void latent_attention(ARG(float, out), CARG(float, q), CARG(float, q_rope), CARG(float, C), CARG(float, R),
                               CARG(int, block_tables), const int ldb, CARG(int, seq_index), CARG(int, positions),
                               const int Hq, const int Dc, const int Dr, const int B, const float scale,
                               __local float* q_loc, __local float* qr_loc, __local float* acc, __local float* s_loc,
                               __local float* p_loc, __local int* slot_loc)
{
    const int i = get_local_id(0), L = get_local_size(0);
    const int h = get_group_id(0), t = get_global_id(1);
    BIND(float, out); CBIND(float, q); CBIND(float, q_rope); CBIND(float, C); CBIND(float, R);
    CBIND(int, block_tables); CBIND(int, seq_index); CBIND(int, positions);
    const int p = positions[t];
    __global const int* table = block_tables + (size_t)seq_index[t] * ldb;
    __global const float* qt = q + ((size_t)t * Hq + h) * Dc;
    __global const float* qrt = q_rope + ((size_t)t * Hq + h) * Dr;
    for (int d = i; d < Dc; d += L) {
        q_loc[d] = qt[d];
        acc[d] = 0.0f;
    }
    for (int d = i; d < Dr; d += L)
        qr_loc[d] = qrt[d];
    barrier(CLK_LOCAL_MEM_FENCE);
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 <= p; j0 += L) {
        /* 1. scores */
        const int j = j0 + i;
        float s = -INFINITY;
        if (j <= p) {
            const size_t slot = slot_of(table, j, B);
            __global const float* cj = C + slot * Dc;
            __global const float* rj = R + slot * Dr;
            float dp = 0.0f;
            for (int d = 0; d < Dc; ++d)
                dp += q_loc[d] * cj[d];
            for (int d = 0; d < Dr; ++d)
                dp += qr_loc[d] * rj[d];
            s = dp * scale;
            slot_loc[i] = (int)slot;
        }
        s_loc[i] = s;
        barrier(CLK_LOCAL_MEM_FENCE);
        /* 2. running max and the chunk's probabilities (j0 <= p, so s_loc[0] is finite) */
        const int n = min(L, p - j0 + 1);
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
        /* 3. accumulate the latents (the values) */
        for (int d = i; d < Dc; d += L) {
            float a = acc[d] * alpha;
            for (int c = 0; c < n; ++c)
                a += p_loc[c] * C[(size_t)slot_loc[c] * Dc + d];
            acc[d] = a;
        }
        m = m_new;
        barrier(CLK_LOCAL_MEM_FENCE);      /* s_loc / p_loc / slot_loc are rewritten by the next chunk */
    }
    __global float* ot = out + ((size_t)t * Hq + h) * Dc;
    for (int d = i; d < Dc; d += L)
        ot[d] = acc[d] / l;
}
