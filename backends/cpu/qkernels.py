"""Numba kernels of the cpu backend for ggml's block formats (q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4,
q4_k, q5_k, q6_k). Output first; the block decoding is qir.py's (LLVM IR intrinsics).

Weights are [N, K / B] records (one per block) over the memmap's bytes, read as they stream and
dequantised in registers; nothing is dequantised into a copy of a matrix. Two activation paths, each
taken for every row count, so that a row's result never depends on how many rows share the call
(batch invariance: a token alone and a token in a pair go through the same arithmetic):
  int8 (the default): the activations quantised to int8 per block of 32 (per 256 in front of
          quant.ACT256's super-block formats: qir.py's INT256) (quantize_act, as
          llama.cpp's vec_dot does) and each block's dot product taken in integers (qir.rowdot4x2_q:
          vpmaddubsw/vpmaddwd on AVX2), four rows side by side as four interleaved streams (as
          kernels.matmul), the tokens in pairs. The float work is one FMA per 32 weights, so decode
          streams 4- to 6-bit weights at 2-5x the float path's GB/s, q8_0 at 0.9-1.5x (measured per
          format by benchmarks/gemv_formats.py: README).
  float32 (int8_activations=False): four rows at a time dequantised into the thread's scratch
          [4, K] (in L1/L2), then every token against them with kernels.py's float32 micro-kernel.
The two differ by the activation rounding only, which quant.quantize_activations emulates exactly in
NumPy for the tests. The int8 path's prefill re-decodes each group of 256 weights for every four
tokens: measured 0.61x (q8_0) and 0.82x (q4_k_m) the float path's prefill tok/s on the bench model
(README, benchmarks/results/ab.md), the price of batch invariance until a kernel decodes a tile to
int8 once.
"""
import numpy as np
from numba import njit, prange

from colibri_edge.model import quant

from .jitcache import drop_stale
from .kernels import F0, F1, REDUCE, activate, claim, fdot4, fdot4x2, reset_claims
from .qir import PB, absmax_bits, act_block, pdot4_q, pdot4x2_q, pdot4x4_q, predecode4_q, quantize16, rowdeq, rowdot4_q, rowdot4x2_q, rowdot4x4_q, rowdot_q



@njit(error_model="numpy", inline="always")
def _store(out, t, n, v, bias):
    out[t, n] = v + bias[n] if bias.shape[0] else v


@njit(error_model="numpy", inline="always")
def _store4q(out, t, i, q, a0, a1, a2, a3, bias):
    """out[t, i + j*q] = a_j (+ bias), j < 4: the four streams' rows"""
    _store(out, t, i, a0, bias)
    _store(out, t, i + q, a1, bias)
    _store(out, t, i + 2 * q, a2, bias)
    _store(out, t, i + 3 * q, a3, bias)


@njit(error_model="numpy", inline="always")
def _store4(out, t, n0, m, a0, a1, a2, a3, bias):
    """out[t, n0 + j] = a_j (+ bias) for the m <= 4 rows of a group"""
    _store(out, t, n0, a0, bias)
    if m > 1:
        _store(out, t, n0 + 1, a1, bias)
    if m > 2:
        _store(out, t, n0 + 2, a2, bias)
    if m > 3:
        _store(out, t, n0 + 3, a3, bias)


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qmatmul(out, x, w, bias, work, scratch):
    """out[T,N] = x[T,K] @ deq(w)[N,K]^T (+ bias[N])     w: [N, K/B] blocks; scratch: float32
    [threads, 4, >= K] (the dequantised rows)
    The float32-activation path: four rows dequantised into the thread's scratch, then the tokens
    against them in pairs (kernels.fdot4x2; a lone token's sums are the same, kernels.fdot4)."""
    T, K = x.shape
    N = w.shape[0]
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, N)
            if lo >= hi:
                break
            buf = scratch[c]
            S = buf.shape[1]                                   # >= K: the scratch is sized for the widest
            for n0 in range(lo, hi, 4):
                m = min(4, hi - n0)
                for j in range(m):
                    rowdeq(w, n0 + j, buf, j * S)
                r0, r1, r2, r3 = buf[0, :K], buf[1, :K], buf[2, :K], buf[3, :K]
                for t in range(0, T - 1, 2):
                    a0, a1, a2, a3, b0, b1, b2, b3 = fdot4x2(r0, r1, r2, r3, x[t], x[t + 1])
                    _store4(out, t, n0, m, a0, a1, a2, a3, bias)
                    _store4(out, t + 1, n0, m, b0, b1, b2, b3, bias)
                if T % 2:
                    a0, a1, a2, a3 = fdot4(r0, r1, r2, r3, x[T - 1])
                    _store4(out, T - 1, n0, m, a0, a1, a2, a3, bias)


@njit(cache=True, error_model="numpy")
def qembed(out, table, ids):
    """out[t] = deq(table[ids[t]])        table: [V, H/B] blocks"""
    H = out.shape[1]
    for t in range(ids.shape[0]):
        rowdeq(table, ids[t], out, t * H)


@njit(error_model="numpy", inline="always")
def _swiglu(g, u, r, i, ep):
    """row r, column i's activation: kernels.activate (SwiGLU, or expert_act's clamped form with biases)"""
    return activate(g, u, r, i, ep)


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qswiglu_gate_up(act, x, order, start, top_k, gate, up, work, scratch, ep):
    """act[r,i] = silu(deq(gate)[i] . x[t_r]) * (deq(up)[i] . x[t_r]),  t_r = order[start + r] // top_k
        gate, up: [I, H/B] blocks (their formats may differ); act [R,I]; x [T,H];
        scratch: float32 [threads, 4, >= H]
    The float32-activation path: two rows of gate and of up dequantised into the thread's scratch,
    then each row's token by kernels.fdot4."""
    R, I = act.shape
    H = x.shape[1]
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, I)
            if lo >= hi:
                break
            buf = scratch[c]
            S = buf.shape[1]
            for i0 in range(lo, hi, 2):
                m = min(2, hi - i0)
                for j in range(m):
                    rowdeq(gate, i0 + j, buf, 2 * j * S)
                    rowdeq(up, i0 + j, buf, (2 * j + 1) * S)
                g0, u0, g1, u1 = buf[0, :H], buf[1, :H], buf[2, :H], buf[3, :H]
                for r in range(R):
                    a0, a1, a2, a3 = fdot4(g0, u0, g1, u1, x[order[start + r] // top_k])
                    act[r, i0] = _swiglu(a0, a1, r, i0, ep)
                    if m == 2:
                        act[r, i0 + 1] = _swiglu(a2, a3, r, i0 + 1, ep)


# -- int8 activations (decode) ------------------------------------------------------------------
@njit(cache=True, error_model="numpy")
def quantize_act(qx, dx, xs, dst, x, src, blk):
    """Row src of x [., K] -> row dst of qx [., >= K] (int8), dx, xs [., >= K / 32]: per block b of blk
    (32, or 256 in front of the formats of quant.ACT256: qir.act_block)
        dx = max|x_b| / 127,  q = clip(rint(x_b * (1 / dx)), -127, 127),
    dx stored for each 32 of the block (dx = 0: q = 0), and per 32 xs = dx * sum(q) -- or, per 256,
    in xs's bytes the int16 sums of q per 16 (K / 16 of them: what the super-block formats' offsets
    and mins take, qir._int_group; llama.cpp's Q8_K bsums). A non-finite x makes dx NaN, so what it
    feeds is NaN, never a finite guess.
    Vectors of 16 (qir.absmax_bits: max|x| on the floats' bits, the same order for finite values and
    every non-finite one at or above 0x7f800000; qir.quantize16): as Numba loops this stayed scalar,
    2.2 ns an element, 7% of a prefill step (an expert's tokens quantised for gate/up and again for down).
    x's and qx's rows are each contiguous (x may be a row slice of a wider buffer)."""
    K = x.shape[1]
    xs16 = xs.view(np.int16)
    db = dx.view(np.int32)
    xrow, qrow = src * (x.strides[0] // 4), dst * qx.strides[0]      # element offsets of the rows
    for b in range(K // blk):
        m = absmax_bits(x, xrow + blk * b, blk)
        db[dst, (blk * b) // 32] = m                    # the bits of max|x|, read back as a float
        amax = dx[dst, (blk * b) // 32]
        bad = m >= 0x7F800000
        d = np.float32(np.nan) if bad else amax / np.float32(127.0)
        inv = F1 / d if d > F0 else F0
        s0 = 0
        for j in range(blk // 16):
            k = blk * b + 16 * j
            if bad:
                s = 0
                for i in range(16):
                    qx[dst, k + i] = 0
            else:
                s = quantize16(qx, qrow + k, x, xrow + k, inv)
            if blk == 256:
                xs16[dst, k // 16] = np.int16(s)
            elif j % 2:
                xs[dst, k // 32] = d * np.float32(s0 + s)
            s0 = s
            dx[dst, k // 32] = d


# At prefill (8 or more tokens) a row quad of an INT256 format is decoded once into the thread's scratch
# (qir.predecode4_q) and every four tokens take it from there (qir.pdot4x4_q): the same sums, bit for bit.
PREDECODE = 8


@njit(error_model="numpy", inline="always")
def _predecoding(w, T, scratch, quads):
    """Whether T tokens take w's rows predecoded: an INT256 format, PREDECODE tokens or more, and room
    in a thread's scratch for `quads` row quads of w's groups (PB bytes a row and group)."""
    return act_block(w) == 256 and T >= PREDECODE and \
        scratch.shape[1] * scratch.shape[2] * 4 >= quads * 4 * PB * w.shape[1]


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qmatmul_i8(out, x, w, bias, work, qx, dx, xs, scratch):
    """out[t,n] = deq(w)[n] . x[t] (+ bias[n]), with x quantised to int8 per 32 or 256 (quantize_act) and
    each block's dot product in integers (qir.rowdot4x2_q).
        qx int8 [>= T, >= K], dx, xs float32 [>= T, >= K / 32]: rows 0..T-1 take the activations
        scratch: float32 [threads, 4, >= K] (its bytes hold a predecoded row quad: qir.predecode4_q)
    Rows as kernels.matmul walks them (four interleaved streams a thread), the tokens four at a time
    (rowdot4x4_q, or pdot4x4_q on the quad predecoded once where PREDECODE tokens or more share it),
    then a pair (rowdot4x2_q) and an odd last one alone (rowdot4_q): every token's sums bit for bit
    those it gets alone, the same arithmetic per token (batch invariance); the last (hi - lo) % 4 rows
    of a chunk by rowdot_q, token by token."""
    T, K = x.shape
    blk = act_block(w)
    for t in range(T):                  # serial: a parallel region costs more than a decode row's work
        quantize_act(qx, dx, xs, t, x, t, blk)
    N = w.shape[0]
    S = qx.shape[1]
    pre = _predecoding(w, T, scratch, 1)
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, N)
            if lo >= hi:
                break
            buf = scratch[c]
            q = (hi - lo) // 4
            for i in range(lo, lo + q):                 # rows i, i+q, i+2q, i+3q: four streams side by side
                T4 = T - T % 4
                if pre:
                    predecode4_q(w, i, i + q, i + 2 * q, i + 3 * q, buf, 0)
                for t in range(0, T4, 4):              # prefill: each group decoded once for four tokens
                    if pre:
                        v = pdot4x4_q(w, buf, 0, qx, dx, xs, t * S, (t + 1) * S, (t + 2) * S, (t + 3) * S)
                    else:
                        v = rowdot4x4_q(w, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, t * S, (t + 1) * S,
                                        (t + 2) * S, (t + 3) * S)
                    for u in range(4):
                        _store4q(out, t + u, i, q, v[u], v[4 + u], v[8 + u], v[12 + u], bias)
                if T - T4 >= 2:
                    t = T4
                    if pre:
                        a0, b0, a1, b1, a2, b2, a3, b3 = pdot4x2_q(w, buf, 0, qx, dx, xs, t * S, (t + 1) * S)
                    else:
                        a0, b0, a1, b1, a2, b2, a3, b3 = rowdot4x2_q(w, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs,
                                                                     t * S, (t + 1) * S)
                    _store4q(out, t, i, q, a0, a1, a2, a3, bias)
                    _store4q(out, t + 1, i, q, b0, b1, b2, b3, bias)
                if T % 2:
                    if pre:
                        a0, a1, a2, a3 = pdot4_q(w, buf, 0, qx, dx, xs, (T - 1) * S)
                    else:
                        a0, a1, a2, a3 = rowdot4_q(w, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, (T - 1) * S)
                    _store4q(out, T - 1, i, q, a0, a1, a2, a3, bias)
            for n in range(lo + 4 * q, hi):
                for t in range(T):
                    _store(out, t, n, rowdot_q(w, n, qx, dx, xs, t * S), bias)


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qswiglu_gate_up_i8(act, x, order, start, top_k, gate, up, work, qx, dx, xs, scratch, ep):
    """qswiglu_gate_up with int8 activations (the R rows' tokens quantised once into qx rows 0..R-1),
    gate and up rows four at a time, the rows' tokens four at a time, then a pair and an odd last one
    alone (as qmatmul_i8, predecoding the gate and up quads into scratch float32 [threads, 6, >= H]
    at PREDECODE tokens or more: batch invariant)."""
    R, I = act.shape
    S = qx.shape[1]
    blk = act_block(gate)                # the backend calls this with act_block(up) the same
    for r in range(R):
        quantize_act(qx, dx, xs, r, x, order[start + r] // top_k, blk)
    pre = _predecoding(gate, R, scratch, 2) and _predecoding(up, R, scratch, 2)
    ub = PB * 4 * (x.shape[1] // 256)     # the up quad's bytes after the gate quad's
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, I)
            if lo >= hi:
                break
            buf = scratch[c]
            q = (hi - lo) // 4
            R4 = R - R % 4
            for i in range(lo, lo + q):
                if pre:
                    predecode4_q(gate, i, i + q, i + 2 * q, i + 3 * q, buf, 0)
                    predecode4_q(up, i, i + q, i + 2 * q, i + 3 * q, buf, ub)
                for r in range(0, R4, 4):
                    if pre:
                        g = pdot4x4_q(gate, buf, 0, qx, dx, xs, r * S, (r + 1) * S, (r + 2) * S, (r + 3) * S)
                        u = pdot4x4_q(up, buf, ub, qx, dx, xs, r * S, (r + 1) * S, (r + 2) * S, (r + 3) * S)
                    else:
                        g = rowdot4x4_q(gate, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, r * S, (r + 1) * S,
                                        (r + 2) * S, (r + 3) * S)
                        u = rowdot4x4_q(up, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, r * S, (r + 1) * S,
                                        (r + 2) * S, (r + 3) * S)
                    for j in range(4):
                        for v in range(4):
                            act[r + v, i + j * q] = _swiglu(g[4 * j + v], u[4 * j + v], r + v, i + j * q, ep)
                if R - R4 >= 2:
                    r = R4
                    if pre:
                        g = pdot4x2_q(gate, buf, 0, qx, dx, xs, r * S, (r + 1) * S)
                        u = pdot4x2_q(up, buf, ub, qx, dx, xs, r * S, (r + 1) * S)
                    else:
                        g = rowdot4x2_q(gate, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, r * S, (r + 1) * S)
                        u = rowdot4x2_q(up, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, r * S, (r + 1) * S)
                    for j in range(4):
                        act[r, i + j * q] = _swiglu(g[2 * j], u[2 * j], r, i + j * q, ep)
                        act[r + 1, i + j * q] = _swiglu(g[2 * j + 1], u[2 * j + 1], r + 1, i + j * q, ep)
                if R % 2:
                    if pre:
                        g = pdot4_q(gate, buf, 0, qx, dx, xs, (R - 1) * S)
                        u = pdot4_q(up, buf, ub, qx, dx, xs, (R - 1) * S)
                    else:
                        g = rowdot4_q(gate, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, (R - 1) * S)
                        u = rowdot4_q(up, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, (R - 1) * S)
                    for j in range(4):
                        act[R - 1, i + j * q] = _swiglu(g[j], u[j], R - 1, i + j * q, ep)
            for i in range(lo + 4 * q, hi):
                for r in range(R):
                    act[r, i] = _swiglu(rowdot_q(gate, i, qx, dx, xs, r * S), rowdot_q(up, i, qx, dx, xs, r * S), r, i,
                                        ep)


drop_stale(globals(), __file__.replace("qkernels.py", "qir.py"), __file__.replace("qkernels.py", "kernels.py"),
           quant.__file__)
