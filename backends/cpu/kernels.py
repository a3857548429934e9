"""Numba kernels of the cpu backend. Output first; each docstring quotes the math it implements.

Weights are read-only views of the model's memmap in their stored bits, widened to float32 inside
the inner loops (never copied, so experts never routed are never read):
    float32   as is
    float16   IEEE half bits viewed as uint16 -> LLVM `fpext half to float` (F16C vcvtph2ps on
              x86-64, fcvt on ARM64); Numba has no float16 arrays
    bfloat16  bits viewed as int16 -> zero-extend, shift left 16, bitcast to float
    int8      signed integer -> float; its float32 row scales (w[r] = q[r] * scales[r]) multiply
              each output once, after the dot product
The element type of the view picks the widening, so one source serves all four weight types and
each weight-reading kernel has one specialisation per weight type. Optional vectors (bias,
scales) are passed as empty arrays when absent, so absence costs no extra specialisation.

No kernel allocates: no array is created here, prange loops carry no cross-iteration reduction
(Numba would allocate per-thread reduction arrays), all scratch comes from the caller.

Float flags: REDUCE = {"reassoc", "contract"} lets LLVM split sums across SIMD lanes and fuse
multiply-adds (a dot product does not vectorise otherwise); no "nnan"/"ninf", so NaN and inf still
propagate and -inf works as the empty softmax maximum. Constants are np.float32 so nothing
silently promotes to float64.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

REDUCE = {"reassoc", "contract"}
ROWS = 4          # weight rows per work item of a GEMV/GEMM: 4 dot products share each load of x
AHEAD = 2         # blocks of ROWS rows to prefetch ahead of the one being computed
F0 = np.float32(0.0)
F1 = np.float32(1.0)


# -- widening stored weight bits to float32 ------------------------------------------------------
@intrinsic
def half_bits_to_f32(typingctx, bits):
    """uint16 holding IEEE half bits -> float32 (fpext: exact, vectorises to vcvtph2ps / fcvt)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def bf16_bits_to_f32(typingctx, bits):
    """int16 holding bfloat16 bits -> float32: the bits are the top half of a float32."""
    if bits != types.int16:
        return None

    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the cache line holding element `index` of C-contiguous `arr` into L2 (llvm.prefetch
    locality 2: prefetcht1 / prfm pldl2keep). Never faults. L2, not L1: measured ~25% faster on
    cold expert weights, as L1-bound hints compete with the dot loops' own misses."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])   # read, locality 2, data
        return context.get_dummy_value()
    return types.none(arr, index), codegen


def widen(v):
    """Stored weight element -> float32 (compiled only; the element type picks the conversion)."""
    raise NotImplementedError("widen runs inside Numba kernels only")


@overload(widen, inline="always")
def _widen(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: half_bits_to_f32(v)
    if v == types.int16:
        return lambda v: bf16_bits_to_f32(v)
    if v == types.int8:
        return lambda v: np.float32(v)


@njit(inline="always")
def scaled(v, scales, n):
    """v * scales[n] for int8 rows; v when scales is empty (unquantised weights)."""
    return v * scales[n] if scales.shape[0] else v


# -- dot products (inlined into the kernels below) ----------------------------------------------
@njit(fastmath=REDUCE, error_model="numpy", inline="always")
def dot1(w, n, xr):
    """w[n] . xr   (w [N,K] stored weights, xr [K] float32)"""
    wn = w[n]
    acc = F0
    for k in range(xr.shape[0]):
        acc += widen(wn[k]) * xr[k]
    return acc


@njit(fastmath=REDUCE, error_model="numpy", inline="always")
def dot4(w, n, xr):
    """(w[n] . xr, w[n+1] . xr, w[n+2] . xr, w[n+3] . xr): four rows in one pass over xr."""
    w0, w1, w2, w3 = w[n], w[n + 1], w[n + 2], w[n + 3]
    a0 = a1 = a2 = a3 = F0
    for k in range(xr.shape[0]):
        xk = xr[k]
        a0 += widen(w0[k]) * xk
        a1 += widen(w1[k]) * xk
        a2 += widen(w2[k]) * xk
        a3 += widen(w3[k]) * xk
    return a0, a1, a2, a3


@njit(fastmath=REDUCE, error_model="numpy", inline="always")
def dot4x2(w, n, xa, xb):
    """dot4 for two tokens at once: each widened weight vector feeds two FMAs (prefill GEMM)."""
    w0, w1, w2, w3 = w[n], w[n + 1], w[n + 2], w[n + 3]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = F0
    for k in range(xa.shape[0]):
        xk, yk = xa[k], xb[k]
        v0, v1, v2, v3 = widen(w0[k]), widen(w1[k]), widen(w2[k]), widen(w3[k])
        a0 += v0 * xk
        a1 += v1 * xk
        a2 += v2 * xk
        a3 += v3 * xk
        b0 += v0 * yk
        b1 += v1 * yk
        b2 += v2 * yk
        b3 += v3 * yk
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(inline="always")
def store4(out, t, n, a0, a1, a2, a3):
    """out[t, n:n+4] = (a0, a1, a2, a3)"""
    out[t, n] = a0
    out[t, n + 1] = a1
    out[t, n + 2] = a2
    out[t, n + 3] = a3


@njit(error_model="numpy", inline="always")
def silu_mul(g, u):
    """silu(g) * u = g / (1 + exp(-g)) * u   (SwiGLU)"""
    return g / (F1 + np.exp(-g)) * u


@njit(error_model="numpy", inline="always")
def store_swiglu4(act, r, i, g0, g1, g2, g3, u0, u1, u2, u3, gate_scales, up_scales):
    """act[r, i+j] = silu(g_j * gate_scales[i+j]) * (u_j * up_scales[i+j]),  j < 4 (empty scales = 1)"""
    act[r, i] = silu_mul(scaled(g0, gate_scales, i), scaled(u0, up_scales, i))
    act[r, i + 1] = silu_mul(scaled(g1, gate_scales, i + 1), scaled(u1, up_scales, i + 1))
    act[r, i + 2] = silu_mul(scaled(g2, gate_scales, i + 2), scaled(u2, up_scales, i + 2))
    act[r, i + 3] = silu_mul(scaled(g3, gate_scales, i + 3), scaled(u3, up_scales, i + 3))


@njit(inline="always")
def prefetch_rows(w, n0, n1):
    """Prefetch rows n0..n1-1 of the C-contiguous weight w [N,K] (clipped to N), one hint per
    64-byte line. Hardware prefetchers stop at 4 KiB page edges and a weight block spans only a
    few pages, so a cold weight (an expert read once per step) would otherwise stall on each."""
    N, K = w.shape
    end = min(n1, N) * K
    for i in range(min(n0, N) * K, end, 64 // w.itemsize):
        prefetch(w, i)


# -- dense ---------------------------------------------------------------------------------------
@njit(parallel=True, cache=True, fastmath=REDUCE, error_model="numpy")
def matmul(out, x, w, scales, bias):
    """out[T,N] = (x[T,K] @ w[N,K]^T) * scales[N] + bias[N]
        w: weight [N,K];  scales: float32 [N] (int8) or empty;  bias: float32 [N] or empty

    Parallel over blocks of ROWS output rows. A block's weight rows are read from memory once
    and stay in L1 while every token uses them (two tokens per pass, so each widened weight vector
    feeds two FMAs), so a step streams each weight once whatever T; decode (T=1) is a GEMV bound
    by that stream. out must not alias x. No BLAS: f16/bf16/int8 weights would need a widened
    copy, and one kernel keeps one thread pool (Numba's) for COLIBRI_NUM_THREADS to govern."""
    T = x.shape[0]
    N = w.shape[0]
    for blk in prange((N + ROWS - 1) // ROWS):
        n0 = blk * ROWS
        prefetch_rows(w, n0 + AHEAD * ROWS, n0 + (AHEAD + 1) * ROWS)
        if n0 + ROWS <= N:
            for t in range(0, T - 1, 2):
                a0, a1, a2, a3, b0, b1, b2, b3 = dot4x2(w, n0, x[t], x[t + 1])
                store4(out, t, n0, a0, a1, a2, a3)
                store4(out, t + 1, n0, b0, b1, b2, b3)
            if T % 2:
                a0, a1, a2, a3 = dot4(w, n0, x[T - 1])
                store4(out, T - 1, n0, a0, a1, a2, a3)
        else:
            for n in range(n0, N):
                for t in range(T):
                    out[t, n] = dot1(w, n, x[t])
        if scales.shape[0] or bias.shape[0]:
            for t in range(T):
                for n in range(n0, min(n0 + ROWS, N)):
                    v = scaled(out[t, n], scales, n)
                    out[t, n] = v + bias[n] if bias.shape[0] else v


@njit(cache=True, error_model="numpy")
def embed(out, table, scales, ids):
    """out[t] = table[ids[t]] (* scales[ids[t]])     table: [V,H] stored weights or a float32 buffer,
    scales: float32 [V] (int8) or empty"""
    for t in range(ids.shape[0]):
        row = table[ids[t]]
        for h in range(out.shape[1]):
            out[t, h] = scaled(widen(row[h]), scales, ids[t])


@njit(cache=True, fastmath=REDUCE, error_model="numpy")
def rmsnorm(out, x, weight, eps):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight        x, out [R,D] (may alias), weight [D]"""
    R, D = x.shape
    epsf, Df = np.float32(eps), np.float32(D)
    for r in range(R):
        xr = x[r]
        ss = F0
        for d in range(D):
            ss += xr[d] * xr[d]
        inv = F1 / np.sqrt(ss / Df + epsf)
        for d in range(D):
            out[r, d] = xr[d] * inv * widen(weight[d])


@njit(cache=True, error_model="numpy")
def rope(out, x, positions, theta):
    """Rotate-half rotary embedding, x/out [T,heads,D] (may alias), angle a = p * f_i in float32:
        f_i = 1 / theta^(2i/D),  i < D/2
        out[..., i]       = x_i cos a - x_{i+D/2} sin a
        out[..., i + D/2] = x_{i+D/2} cos a + x_i sin a"""
    T, heads, D = x.shape
    half = D // 2
    thetaf, Df = np.float32(theta), np.float32(D)
    for t in range(T):
        p = np.float32(positions[t])
        for i in range(half):
            a = p * (F1 / thetaf ** (np.float32(2 * i) / Df))
            c, s = np.cos(a), np.sin(a)
            for h in range(heads):
                x1, x2 = x[t, h, i], x[t, h, i + half]
                out[t, h, i] = x1 * c - x2 * s
                out[t, h, i + half] = x2 * c + x1 * s


@njit(cache=True, error_model="numpy")
def add(out, a, b):
    """out[T,H] = a + b"""
    for t in range(out.shape[0]):
        for h in range(out.shape[1]):
            out[t, h] = a[t, h] + b[t, h]


@njit(cache=True, error_model="numpy")
def gated_add(out, a, b, gate):
    """out[t] = a[t] + sigmoid(gate[t,0]) * b[t] = a[t] + b[t] / (1 + exp(-gate[t,0]))"""
    for t in range(out.shape[0]):
        den = F1 + np.exp(-gate[t, 0])
        for h in range(out.shape[1]):
            out[t, h] = a[t, h] + b[t, h] / den


# -- attention -----------------------------------------------------------------------------------
@njit(cache=True)
def kv_write(k_cache, v_cache, k, v, slots):
    """k_cache[slots[t]] = k[t]; v_cache[slots[t]] = v[t]        caches [slots,Hkv,D], k, v [T,Hkv,D]"""
    for t in range(slots.shape[0]):
        s = slots[t]
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_cache[s, h, d] = k[t, h, d]
                v_cache[s, h, d] = v[t, h, d]


@njit(parallel=True, cache=True, fastmath=REDUCE, error_model="numpy")
def paged_attention(out, q, k_cache, v_cache, block_tables, seq_index, positions, block_size, scale):
    """out[t,h] = sum_j softmax_j(q[t,h] . K[slot(j), h//G] * scale) V[slot(j), h//G],  j = 0..p_t
        p_t = positions[t], slot(j) = block_tables[seq_index[t], j // B] * B + j % B, G = Hq / Hkv
    Parallel over (token, head). One pass with an online softmax in float32 (running max m, sum l,
    the output row as the accumulator, rescaled when m grows), so no score scratch is needed.
    out must not alias q."""
    T, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    scalef = np.float32(scale)
    for th in prange(T * Hq):
        t, h = th // Hq, th % Hq
        kvh = h // group
        table = block_tables[seq_index[t]]
        n = positions[t] + 1
        qv, acc = q[t, h], out[t, h]
        for d in range(D):
            acc[d] = F0
        m, l = np.float32(-np.inf), F0
        for blk in range((n + block_size - 1) // block_size):
            base = table[blk] * block_size
            for j in range(min(block_size, n - blk * block_size)):
                kr, vr = k_cache[base + j, kvh], v_cache[base + j, kvh]
                s = F0
                for d in range(D):
                    s += qv[d] * kr[d]
                s *= scalef
                if s > m:                       # new maximum: rescale what was summed so far
                    c = np.exp(m - s)
                    l *= c
                    for d in range(D):
                        acc[d] *= c
                    m = s
                p = np.exp(s - m)
                l += p
                for d in range(D):
                    acc[d] += p * vr[d]
        inv = F1 / l
        for d in range(D):
            acc[d] *= inv


# -- MoE -----------------------------------------------------------------------------------------
@njit(cache=True, error_model="numpy")
def route(out_ids, out_w, logits, gated, normalize):
    """logits [T,E] -> out_ids [T,k] int32, out_w [T,k] float32; p = softmax(logits[t]) in float32.
    topk:  the k largest, ties to the lower expert id; w = p (/ sum of the k p when normalize).
           Ranked by logit (softmax is monotone): selection by repeated arg-max with a strict >,
           so an equal later expert never displaces an earlier one.
    gated: k == E, ids = 0..E-1, w = p."""
    T, E = logits.shape
    k = out_ids.shape[1]
    for t in range(T):
        row = logits[t]
        top = row[0]
        for e in range(1, E):
            top = max(top, row[e])
        total = F0
        for e in range(E):
            total += np.exp(row[e] - top)
        if gated:
            for e in range(E):
                out_ids[t, e] = e
                out_w[t, e] = np.exp(row[e] - top) / total
            continue
        chosen = F0
        for j in range(k):
            best = -1
            for e in range(E):
                taken = False
                for i in range(j):
                    taken |= out_ids[t, i] == e
                if not taken and (best < 0 or row[e] > row[best]):
                    best = e
            out_ids[t, j] = best
            out_w[t, j] = np.exp(row[best] - top) / total
            chosen += out_w[t, j]
        if normalize:
            for j in range(k):
                out_w[t, j] /= chosen


@njit(cache=True)
def align(offsets, order, inverse, counts, active, ids):
    """Stable counting sort of assignments a = t*k + j by expert ids[a] (colibri_edge.routing.align):
        counts[e] = #{a : ids[a] = e},  offsets = [0, cumsum(counts)]  ([E+1])
        order[offsets[e] + r] = e's r-th assignment,  inverse[order[i]] = i
        active[:n] = experts with counts > 0, ascending; returns n.
    While filling, counts[e] counts down e's assignments still to place (row = end - remaining),
    so no cursor scratch is needed; it is restored at the end."""
    E = counts.shape[0]
    A = ids.shape[0]
    for e in range(E):
        counts[e] = 0
    for a in range(A):
        counts[ids[a]] += 1
    n_active = 0
    offsets[0] = 0
    for e in range(E):
        offsets[e + 1] = offsets[e] + counts[e]
        if counts[e] > 0:
            active[n_active] = e
            n_active += 1
    for a in range(A):
        e = ids[a]
        i = offsets[e + 1] - counts[e]
        counts[e] -= 1
        order[i] = a
        inverse[a] = i
    for e in range(E):
        counts[e] = offsets[e + 1] - offsets[e]
    return n_active


@njit(parallel=True, cache=True, fastmath=REDUCE, error_model="numpy")
def swiglu_gate_up(act, x, order, start, top_k, gate, up, gate_scales, up_scales):
    """act[r,i] = silu(gate[i] . x[t_r] * gs[i]) * (up[i] . x[t_r] * us[i]),  t_r = order[start + r] // top_k
        gate, up: weight [I,H];  gs, us: their float32 row scales [I] (int8) or empty;
        x [T,H];  act [R,I];  silu(g) = g / (1 + exp(-g))
    Parallel over blocks of ROWS intermediate rows; every token of the expert uses a block while it
    is in cache, so the expert's gate/up are read once per step."""
    R, I = act.shape
    for blk in prange((I + ROWS - 1) // ROWS):
        i0 = blk * ROWS
        prefetch_rows(gate, i0 + AHEAD * ROWS, i0 + (AHEAD + 1) * ROWS)
        prefetch_rows(up, i0 + AHEAD * ROWS, i0 + (AHEAD + 1) * ROWS)
        if i0 + ROWS <= I:
            for r in range(0, R - 1, 2):
                xa, xb = x[order[start + r] // top_k], x[order[start + r + 1] // top_k]
                g0, g1, g2, g3, h0, h1, h2, h3 = dot4x2(gate, i0, xa, xb)
                u0, u1, u2, u3, v0, v1, v2, v3 = dot4x2(up, i0, xa, xb)
                store_swiglu4(act, r, i0, g0, g1, g2, g3, u0, u1, u2, u3, gate_scales, up_scales)
                store_swiglu4(act, r + 1, i0, h0, h1, h2, h3, v0, v1, v2, v3, gate_scales, up_scales)
            if R % 2:
                xr = x[order[start + R - 1] // top_k]
                g0, g1, g2, g3 = dot4(gate, i0, xr)
                u0, u1, u2, u3 = dot4(up, i0, xr)
                store_swiglu4(act, R - 1, i0, g0, g1, g2, g3, u0, u1, u2, u3, gate_scales, up_scales)
        else:
            for r in range(R):
                xr = x[order[start + r] // top_k]
                for i in range(i0, I):
                    act[r, i] = silu_mul(scaled(dot1(gate, i, xr), gate_scales, i), scaled(dot1(up, i, xr), up_scales, i))


@njit(cache=True, error_model="numpy")
def combine(out, y, w, inverse):
    """out[t] += sum_j w[t,j] * y[inverse[t*k + j]]        out [T,H], y [T*k,H], w [T,k]"""
    T, k = w.shape
    for t in range(T):
        for h in range(out.shape[1]):
            s = F0
            for j in range(k):
                s += w[t, j] * y[inverse[t * k + j], h]
            out[t, h] += s
