"""Numba kernels of the cpu backend's LoRA updates (base.py: lora_update, lora_pre, lora_down).

Conventions as kernels.py: output first, the math quoted, float32 throughout. A row's arithmetic is
the same whatever rows run beside it (batch invariance: a request's logits do not depend on its
neighbours'): every pass is an axpy loop in a fixed order, vectorised across the rank or the output
columns, never a reduction whose order could depend on the row count. A row of a few (a decode step)
and the others run on the thread pool (work items below).
"""
from numba import njit, prange

from .jitcache import drop_stale
from .kernels import F0

@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _down(z, x, a_t, e):
    """z[:R] = x @ a_t[e]   (x [K], a_t [E, K, R]): axpy over K, vectorised across R. The K rows are
    read as eight sequential streams (eighths of K side by side), as kernels.matmul reads a weight in
    several streams: one stream per core leaves most of the memory bandwidth unused."""
    K, R = a_t.shape[1], a_t.shape[2]
    q = K // 8
    for j in range(R):
        z[j] = F0
    for i in range(q):
        x0, x1, x2, x3 = x[i], x[i + q], x[i + 2 * q], x[i + 3 * q]
        x4, x5, x6, x7 = x[i + 4 * q], x[i + 5 * q], x[i + 6 * q], x[i + 7 * q]
        for j in range(R):
            z[j] += ((x0 * a_t[e, i, j] + x1 * a_t[e, i + q, j]) + (x2 * a_t[e, i + 2 * q, j] + x3 * a_t[e, i + 3 * q, j])
                     + (x4 * a_t[e, i + 4 * q, j] + x5 * a_t[e, i + 5 * q, j])
                     + (x6 * a_t[e, i + 6 * q, j] + x7 * a_t[e, i + 7 * q, j]))
    for i in range(8 * q, K):
        xi = x[i]
        for j in range(R):
            z[j] += xi * a_t[e, i, j]


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _up(out, c0, z, b_t, e, lo, hi):
    """out[c0 + o] += sum_j z[j] b_t[e, j, o] for o in lo..hi-1   (b_t [E, R, N]): eight rows of b_t at
    a time (eight streams: a cold 0.5 MB read 120 -> 100 us on the CI host), vectorised across the
    columns"""
    R = b_t.shape[1]
    R8 = R - R % 8
    for j in range(0, R8, 8):
        z0, z1, z2, z3 = z[j], z[j + 1], z[j + 2], z[j + 3]
        z4, z5, z6, z7 = z[j + 4], z[j + 5], z[j + 6], z[j + 7]
        for o in range(lo, hi):
            out[c0 + o] += ((z0 * b_t[e, j, o] + z1 * b_t[e, j + 1, o]) + (z2 * b_t[e, j + 2, o] + z3 * b_t[e, j + 3, o])
                            + ((z4 * b_t[e, j + 4, o] + z5 * b_t[e, j + 5, o])
                               + (z6 * b_t[e, j + 6, o] + z7 * b_t[e, j + 7, o])))
    for j in range(R8, R):
        zj = z[j]
        for o in range(lo, hi):
            out[c0 + o] += zj * b_t[e, j, o]


# Work items: (row, column chunk) pairs, C chunks a row, each item computing its row's z itself (the
# same arithmetic in every item: a row's result depends on neither C nor its neighbours). A decode
# step's one or two rows still use every thread (C = threads / rows), and so the memory bandwidth.

@njit(nogil=True, cache=True, error_model="numpy")
def _update_item(out, x, a_t, b_t, r0, z, w, C):
    t, c = r0 + w // C, w % C
    N = b_t.shape[2]
    _down(z[w], x[t], a_t, 0)
    _up(out[t], 0, z[w], b_t, 0, c * N // C, (c + 1) * N // C)


@njit(nogil=True, cache=True, error_model="numpy")
def lora_update(out, x, a_t, b_t, r0, r1, z, C):
    """out[t] += (x[t] @ a_t[0]) @ b_t[0] for rows t in r0..r1-1 (a_t [1, K, R], b_t [1, R, N]); z
    [items, >= R] scratch; on the calling thread"""
    for w in range((r1 - r0) * C):
        _update_item(out, x, a_t, b_t, r0, z, w, C)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def lora_update_par(out, x, a_t, b_t, r0, r1, z, C):
    """lora_update with the work items spread over the thread pool"""
    for w in prange((r1 - r0) * C):
        _update_item(out, x, a_t, b_t, r0, z, w, C)


@njit(nogil=True, cache=True, error_model="numpy")
def plan_rows(rows, order, A, k, tokad, idx, offsets):
    """The plan rows of adapter idx: rows[n] = (row p, its token t, its expert e) for every p < A whose
    token's adapter tokad[order[p] // k] is idx, in plan order; returns n."""
    n = 0
    e = 0
    for p in range(A):
        while offsets[e + 1] <= p:
            e += 1
        t = order[p] // k
        if tokad[t] == idx:
            rows[n, 0], rows[n, 1], rows[n, 2] = p, t, e
            n += 1
    return n


@njit(nogil=True, cache=True, error_model="numpy")
def _pre_item(pre, x, rows, ag, bg, au, bu, z, w, C):
    j, c = w // C, w % C
    p, t, e = rows[j, 0], rows[j, 1], rows[j, 2]
    R, I = ag.shape[2], bg.shape[2]
    lo, hi = c * I // C, (c + 1) * I // C
    zw = z[w]
    _down(zw, x[t], ag, e)
    _up(pre[p], 0, zw, bg, e, lo, hi)
    if au.shape[0]:
        _down(zw[R:], x[t], au, e)
        _up(pre[p], I, zw[R:], bu, e, lo, hi)
    else:                                   # up shares gate's A (au empty)
        _up(pre[p], I, zw, bu, e, lo, hi)


@njit(nogil=True, cache=True, error_model="numpy")
def lora_pre(pre, x, rows, n, ag, bg, au, bu, z, C):
    """pre[p, :I] += (x[t] @ ag[e]) @ bg[e],  pre[p, I:] += (x[t] @ au[e]) @ bu[e]  for
    (p, t, e) = rows[j], j < n (plan_rows; au empty: ag's projection for both); z [items, >= 2R] scratch"""
    for w in range(n * C):
        _pre_item(pre, x, rows, ag, bg, au, bu, z, w, C)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def lora_pre_par(pre, x, rows, n, ag, bg, au, bu, z, C):
    """lora_pre with the work items spread over the thread pool"""
    for w in prange(n * C):
        _pre_item(pre, x, rows, ag, bg, au, bu, z, w, C)


@njit(nogil=True, cache=True, error_model="numpy")
def _down_item(out, flat, rows, offsets, width, ad, bd, z, w, C):
    j, c = w // C, w % C
    I, N = ad.shape[1], bd.shape[2]
    p, e = rows[j, 0], rows[j, 2]
    o = offsets[e] * width + (p - offsets[e]) * I          # the row's activation in grouped_ffn's scratch
    _down(z[w], flat[o:o + I], ad, e)
    _up(out[p], 0, z[w], bd, e, c * N // C, (c + 1) * N // C)


@njit(nogil=True, cache=True, error_model="numpy")
def lora_down(out, flat, rows, n, offsets, width, ad, bd, z, C):
    """out[p] += (a @ ad[e]) @ bd[e]  for (p, t, e) = rows[j], j < n, a the row's activation in grouped_ffn's
    scratch (flat from offsets[e] * width, [count_e, I])"""
    for w in range(n * C):
        _down_item(out, flat, rows, offsets, width, ad, bd, z, w, C)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def lora_down_par(out, flat, rows, n, offsets, width, ad, bd, z, C):
    """lora_down with the work items spread over the thread pool"""
    for w in prange(n * C):
        _down_item(out, flat, rows, offsets, width, ad, bd, z, w, C)


drop_stale(globals(), __file__.replace("lora_kernels.py", "kernels.py"))
