"""Numba kernels of the cpu backend for ggml's block formats (q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4,
q4_k, q5_k, q6_k). Output first; the block decoding is qir.py's (LLVM IR intrinsics).

Weights are [N, K / B] records (one per block) over the memmap's bytes, read as they stream and
dequantised in registers; nothing is dequantised into a copy of a matrix. Two paths:
  decode  (T <= 2 tokens): each row's blocks decoded once and dotted with every token (rowdot2),
          the thread's rows walked as four interleaved streams (as kernels.matmul);
  prefill (T > 2): four rows at a time dequantised into the thread's scratch [4, K] (in L1/L2),
          then every token against them with the float32 micro-kernel of kernels.py, so each weight
          is decoded once per call whatever T.
Decode has two activation paths. The default quantises the one or two activations to int8 per
block of 32 (quantize_act, as llama.cpp's vec_dot does) and takes each block's dot product in
integers (qir.rowdot4_q: vpmaddubsw/vpmaddwd on AVX2), so the float work is one FMA per 32 weights
and decode streams 4- to 6-bit weights at 2-5x the float path's GB/s, q8_0 at 0.9-1.5x (measured
per format by benchmarks/gemv_formats.py: README). The
float32-activation path (qmatmul's decode branch) stays for int8_activations=False; its arithmetic
differs from the int8 path by the activation rounding only, which quant.quantize_activations
emulates exactly in NumPy for the tests.
"""
import numpy as np
from numba import njit, prange

from colibri_edge import quant

from .jitcache import drop_stale
from .kernels import F0, F1, REDUCE, claim, dot4, dot4x2, reset_claims
from .qir import rowdeq, rowdot, rowdot2, rowdot4_q, rowdot4x2_q, rowdot_q

DIRECT_T = 2


@njit(error_model="numpy", inline="always")
def _store(out, t, n, v, bias):
    out[t, n] = v + bias[n] if bias.shape[0] else v


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


@njit(parallel=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qmatmul(out, x, w, bias, work, scratch):
    """out[T,N] = x[T,K] @ deq(w)[N,K]^T (+ bias[N])     w: [N, K/B] blocks; scratch: float32
    [threads, 4, >= K] (the prefill path's dequantised rows)"""
    T, K = x.shape
    N = w.shape[0]
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, N)
            if lo >= hi:
                break
            if T <= DIRECT_T:
                q = (hi - lo) // 4
                for i in range(lo, lo + 4 * q):
                    n = lo + (i - lo) // 4 + ((i - lo) % 4) * q       # rows n, n+q, n+2q, n+3q side by side
                    if T == 2:
                        a, b = rowdot2(w, n, x, x, 0, K)
                        _store(out, 0, n, a, bias)
                        _store(out, 1, n, b, bias)
                    else:
                        _store(out, 0, n, rowdot(w, n, x, 0), bias)
                for n in range(lo + 4 * q, hi):
                    for t in range(T):
                        _store(out, t, n, rowdot(w, n, x, t * K), bias)
                continue
            buf = scratch[c]
            S = buf.shape[1]                                   # >= K: the scratch is sized for the widest
            for n0 in range(lo, hi, 4):
                m = min(4, hi - n0)
                for j in range(m):
                    rowdeq(w, n0 + j, buf, j * S)
                r0, r1, r2, r3 = buf[0, :K], buf[1, :K], buf[2, :K], buf[3, :K]
                for t in range(0, T - 1, 2):
                    a0, a1, a2, a3, b0, b1, b2, b3 = dot4x2(r0, r1, r2, r3, x[t], x[t + 1])
                    _store4(out, t, n0, m, a0, a1, a2, a3, bias)
                    _store4(out, t + 1, n0, m, b0, b1, b2, b3, bias)
                if T % 2:
                    a0, a1, a2, a3 = dot4(r0, r1, r2, r3, x[T - 1])
                    _store4(out, T - 1, n0, m, a0, a1, a2, a3, bias)


@njit(cache=True, error_model="numpy")
def qembed(out, table, ids):
    """out[t] = deq(table[ids[t]])        table: [V, H/B] blocks"""
    H = out.shape[1]
    for t in range(ids.shape[0]):
        rowdeq(table, ids[t], out, t * H)


@njit(error_model="numpy", inline="always")
def _swiglu(g, u):
    return g / (F1 + np.exp(-g)) * u


@njit(parallel=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qswiglu_gate_up(act, x, order, start, top_k, gate, up, work, scratch):
    """act[r,i] = silu(deq(gate)[i] . x[t_r]) * (deq(up)[i] . x[t_r]),  t_r = order[start + r] // top_k
        gate, up: [I, H/B] blocks (their formats may differ); act [R,I]; x [T,H];
        scratch: float32 [threads, 4, >= H]"""
    R, I = act.shape
    H = x.shape[1]
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, I)
            if lo >= hi:
                break
            if R <= DIRECT_T:
                ta = order[start] // top_k
                tb = order[start + R - 1] // top_k
                for i in range(lo, hi):
                    if R == 2:
                        g0, g1 = rowdot2(gate, i, x, x, ta * H, tb * H)
                        u0, u1 = rowdot2(up, i, x, x, ta * H, tb * H)
                        act[0, i] = _swiglu(g0, u0)
                        act[1, i] = _swiglu(g1, u1)
                    else:
                        act[0, i] = _swiglu(rowdot(gate, i, x, ta * H), rowdot(up, i, x, ta * H))
                continue
            buf = scratch[c]
            S = buf.shape[1]
            for i0 in range(lo, hi, 2):
                m = min(2, hi - i0)
                for j in range(m):
                    rowdeq(gate, i0 + j, buf, 2 * j * S)
                    rowdeq(up, i0 + j, buf, (2 * j + 1) * S)
                g0, u0, g1, u1 = buf[0, :H], buf[1, :H], buf[2, :H], buf[3, :H]
                for r in range(R):
                    a0, a1, a2, a3 = dot4(g0, u0, g1, u1, x[order[start + r] // top_k])
                    act[r, i0] = _swiglu(a0, a1)
                    if m == 2:
                        act[r, i0 + 1] = _swiglu(a2, a3)


# -- int8 activations (decode) ------------------------------------------------------------------
@njit(cache=True, error_model="numpy")
def quantize_act(qx, dx, xs, dst, x, src):
    """Row src of x [., K] -> row dst of qx [., >= K] (int8), dx, xs [., >= K / 32]: per block b of 32
        dx = max|x_b| / 127,  q = clip(rint(x_b * (1 / dx)), -127, 127),  xs = dx * sum(q)
    (dx = 0: q = 0). A non-finite x makes dx NaN, so what it feeds is NaN, never a finite guess."""
    K = x.shape[1]
    for b in range(K // 32):
        amax = F0
        bad = False
        for i in range(32):
            v = x[src, 32 * b + i]
            if not np.isfinite(v):
                bad = True
            a = abs(v)
            if a > amax:
                amax = a
        if bad:
            for i in range(32):
                qx[dst, 32 * b + i] = 0
            dx[dst, b] = np.float32(np.nan)
            xs[dst, b] = np.float32(np.nan)
            continue
        d = amax / np.float32(127.0)
        inv = F1 / d if d > F0 else F0
        s = 0
        for i in range(32):
            q = np.rint(x[src, 32 * b + i] * inv)
            q = min(max(q, np.float32(-127.0)), np.float32(127.0))
            qx[dst, 32 * b + i] = np.int8(q)
            s += np.int32(q)
        dx[dst, b] = d
        xs[dst, b] = d * np.float32(s)


@njit(parallel=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qmatmul_i8(out, x, w, bias, work, qx, dx, xs):
    """out[t,n] = deq(w)[n] . x[t] (+ bias[n]) for T <= 2 tokens, with x quantised to int8 per 32
    (quantize_act) and each block's dot product in integers (qir.rowdot_q). The rows as qmatmul's
    decode path walks them (four interleaved streams a thread)."""
    T, K = x.shape
    for t in range(T):
        quantize_act(qx, dx, xs, t, x, t)
    N = w.shape[0]
    S = qx.shape[1]
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, N)
            if lo >= hi:
                break
            q = (hi - lo) // 4
            for i in range(lo, lo + q):                 # rows i, i+q, i+2q, i+3q: four streams side by side
                if T == 2:
                    a0, b0, a1, b1, a2, b2, a3, b3 = rowdot4x2_q(w, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, 0, S)
                    _store(out, 1, i, b0, bias)
                    _store(out, 1, i + q, b1, bias)
                    _store(out, 1, i + 2 * q, b2, bias)
                    _store(out, 1, i + 3 * q, b3, bias)
                else:
                    a0, a1, a2, a3 = rowdot4_q(w, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, 0)
                _store(out, 0, i, a0, bias)
                _store(out, 0, i + q, a1, bias)
                _store(out, 0, i + 2 * q, a2, bias)
                _store(out, 0, i + 3 * q, a3, bias)
            for n in range(lo + 4 * q, hi):
                for t in range(T):
                    _store(out, t, n, rowdot_q(w, n, qx, dx, xs, t * S), bias)


@njit(parallel=True, cache=True, fastmath=REDUCE, error_model="numpy")
def qswiglu_gate_up_i8(act, x, order, start, top_k, gate, up, work, qx, dx, xs):
    """qswiglu_gate_up for R <= 2 rows with int8 activations (the rows' tokens quantised once),
    gate and up rows four at a time (qir.rowdot4_q)."""
    R, I = act.shape
    S = qx.shape[1]
    for r in range(R):
        quantize_act(qx, dx, xs, r, x, order[start + r] // top_k)
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, I)
            if lo >= hi:
                break
            q = (hi - lo) // 4
            for i in range(lo, lo + q):
                if R == 2:
                    g = rowdot4x2_q(gate, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, 0, S)
                    u = rowdot4x2_q(up, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, 0, S)
                    for j in range(4):
                        act[0, i + j * q] = _swiglu(g[2 * j], u[2 * j])
                        act[1, i + j * q] = _swiglu(g[2 * j + 1], u[2 * j + 1])
                else:
                    g = rowdot4_q(gate, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, 0)
                    u = rowdot4_q(up, i, i + q, i + 2 * q, i + 3 * q, qx, dx, xs, 0)
                    for j in range(4):
                        act[0, i + j * q] = _swiglu(g[j], u[j])
            for i in range(lo + 4 * q, hi):
                for r in range(R):
                    act[r, i] = _swiglu(rowdot_q(gate, i, qx, dx, xs, r * S), rowdot_q(up, i, qx, dx, xs, r * S))


drop_stale(globals(), __file__.replace("qkernels.py", "qir.py"), __file__.replace("qkernels.py", "kernels.py"),
           quant.__file__)
