"""Numba kernels of the cpu backend for ggml's block formats (q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4,
q4_k, q5_k, q6_k). Output first; the block decoding is qir.py's (LLVM IR intrinsics).

Weights are [N, K / B] records (one per block) over the memmap's bytes, read as they stream and
dequantised in registers; nothing is dequantised into a copy of a matrix. Two paths:
  decode  (T <= 2 tokens): each row's blocks decoded once and dotted with every token (rowdot2),
          the thread's rows walked as four interleaved streams (as kernels.matmul);
  prefill (T > 2): four rows at a time dequantised into the thread's scratch [4, K] (in L1/L2),
          then every token against them with the float32 micro-kernel of kernels.py, so each weight
          is decoded once per call whatever T.
Activations stay float32 (no int8 quantisation of x): see the backend's docs for why.
"""
import numpy as np
from numba import njit, prange

from .kernels import F1, REDUCE, dot4, dot4x2, thread_rows
from .qir import rowdeq, rowdot, rowdot2

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
def qmatmul(out, x, w, bias, threads, scratch):
    """out[T,N] = x[T,K] @ deq(w)[N,K]^T (+ bias[N])     w: [N, K/B] blocks; scratch: float32
    [threads, 4, >= K] (the prefill path's dequantised rows)"""
    T, K = x.shape
    N = w.shape[0]
    for c in prange(threads):
        lo, hi = thread_rows(c, threads, N)
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
def qswiglu_gate_up(act, x, order, start, top_k, gate, up, threads, scratch):
    """act[r,i] = silu(deq(gate)[i] . x[t_r]) * (deq(up)[i] . x[t_r]),  t_r = order[start + r] // top_k
        gate, up: [I, H/B] blocks (their formats may differ); act [R,I]; x [T,H];
        scratch: float32 [threads, 4, >= H]"""
    R, I = act.shape
    H = x.shape[1]
    for c in prange(threads):
        lo, hi = thread_rows(c, threads, I)
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
