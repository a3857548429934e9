"""Numba kernels of the cpu backend's LoRA updates (base.py: lora_update, lora_pre, lora_down).

Conventions as kernels.py: output first, the math quoted, float32 throughout. Every update is

    z = A x        (A [R, K], the rank-R projection: R dot products, kernels.fdot4 and its 2- and 4-token
                    forms, explicit vectors whose per-token sums do not depend on the tokens beside it)
    out += z B     (B as b_t [R, N], the scale folded in: kernels.faxpy8, an fma chain per element over
                    eight rows of b_t at a time, in explicit vectors, in the same order for every row)

so a row's arithmetic is the same whatever rows run beside it (batch invariance: a request's logits
do not depend on its neighbours'). R is a multiple of 8 (runtime/lora.py pads the factors with zeros).
Factors are float32 or float16 (as half bits, uint16: widen / fdot's widening), runtime/lora.py hold.

Work items: (tile, column chunk) pairs. A tile is up to TILE rows of one expert side by side (plan
order holds an expert's rows together), so each factor element loaded serves TILE rows: a 128-token
prefill's updates of one MoE layer of the benchmark model (8 experts, rank 16, float32 factors) on
the AVX-512 CI host, 2 threads: lora_pre 2.9 -> 2.55 ms, lora_down 1.03 -> 0.67 ms. A row cut in C
column chunks (C = threads / tiles) keeps every thread reading when a decode step has one or two rows;
each chunk recomputes its tile's z (R dot products, a fraction of the row's bytes).
"""
from numba import njit, prange

from .jitcache import drop_stale
from .kernels import TILE4, faxpy8, faxpy8x2, fdot4, fdot4x2, fdot4x4

TILE = 4 if TILE4 else 2          # rows per tile: fdot4x4's four tokens where 16 accumulators fit


@njit(inline="always")
def _tiles(tiles, rows, n):
    """tiles[m] .. tiles[m+1]-1: the m-th run of at most TILE rows of one expert (rows[:, 2]); returns
    the number of tiles."""
    m = 0
    j = 0
    while j < n:
        tiles[m] = j
        m += 1
        e = rows[j, 2]
        j += 1
        c = 1
        while j < n and c < TILE and rows[j, 2] == e:
            j += 1
            c += 1
    tiles[m] = n
    return m


@njit(inline="always")
def _proj(z, off, A, e, xa, xb, xc, xd, nt):
    """z[s, off + j] = A[e, j] . x_s for the tile's nt tokens x_0..x_3 = xa..xd (unused ones repeat
    xa), j < R"""
    R = A.shape[1]
    for j in range(0, R, 4):
        r0, r1, r2, r3 = A[e, j], A[e, j + 1], A[e, j + 2], A[e, j + 3]
        if nt == 1:
            s0, s1, s2, s3 = fdot4(r0, r1, r2, r3, xa)
            z[0, off + j], z[0, off + j + 1], z[0, off + j + 2], z[0, off + j + 3] = s0, s1, s2, s3
        elif nt == 2 or not TILE4:
            s = fdot4x2(r0, r1, r2, r3, xa, xb)
            for q in range(2):
                z[q, off + j], z[q, off + j + 1], z[q, off + j + 2], z[q, off + j + 3] = \
                    s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3]
        else:
            s = fdot4x4(r0, r1, r2, r3, xa, xb, xc, xd)
            for q in range(4):
                z[q, off + j], z[q, off + j + 1], z[q, off + j + 2], z[q, off + j + 3] = \
                    s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3]


@njit(inline="always")
def _up(out, c0, z, zo, b_t, e, lo, hi):
    """out[c0 + o] += sum_j z[zo + j] b_t[e, j, o] for o in lo..hi-1   (b_t [E, R, N]): eight rows of b_t at
    a time (eight streams: a cold 0.5 MB read 120 -> 100 us on the CI host), kernels.faxpy8"""
    for j in range(0, b_t.shape[1], 8):
        faxpy8(out, c0, z, zo + j, b_t[e, j], b_t[e, j + 1], b_t[e, j + 2], b_t[e, j + 3], b_t[e, j + 4], b_t[e, j + 5],
               b_t[e, j + 6], b_t[e, j + 7], lo, hi)


@njit(inline="always")
def _up2(oa, ob, c0, za, zb, zo, b_t, e, lo, hi):
    """_up for two rows at once (oa with za, ob with zb), each element of b_t loaded once for both;
    each row's arithmetic is _up's (kernels.faxpy8x2)"""
    for j in range(0, b_t.shape[1], 8):
        faxpy8x2(oa, c0, ob, c0, za, zo + j, zb, zo + j, b_t[e, j], b_t[e, j + 1], b_t[e, j + 2], b_t[e, j + 3], b_t[e, j + 4],
                 b_t[e, j + 5], b_t[e, j + 6], b_t[e, j + 7], lo, hi)


@njit(inline="always")
def _up_tile(out, prow, j0, nt, c0, z, off, b_t, e, lo, hi):
    """out[prow(j0 + s)][c0 + o] += z[s, off:off+R] b_t[e] for the tile's rows s < nt, two at a time"""
    s = 0
    while s + 1 < nt:
        _up2(out[prow[j0 + s, 0]], out[prow[j0 + s + 1, 0]], c0, z[s], z[s + 1], off, b_t, e, lo, hi)
        s += 2
    if s < nt:
        _up(out[prow[j0 + s, 0]], c0, z[s], off, b_t, e, lo, hi)


# -- linear layers: rows r0..r1-1 of x, one adapter ------------------------------------------------
@njit(nogil=True, cache=True, error_model="numpy")
def _update_item(out, x, a, b_t, r0, r1, z, w, C):
    m, c = w // C, w % C
    t0 = r0 + m * TILE
    nt = min(TILE, r1 - t0)
    N = b_t.shape[2]
    zw = z[w]
    xa = x[t0]
    xb = x[t0 + 1] if nt > 1 else xa
    xc = x[t0 + 2] if nt > 2 else xa
    xd = x[t0 + 3] if nt > 3 else xa
    _proj(zw, 0, a, 0, xa, xb, xc, xd, nt)
    lo, hi = c * N // C, (c + 1) * N // C
    s = 0
    while s + 1 < nt:
        _up2(out[t0 + s], out[t0 + s + 1], 0, zw[s], zw[s + 1], 0, b_t, 0, lo, hi)
        s += 2
    if s < nt:
        _up(out[t0 + s], 0, zw[s], 0, b_t, 0, lo, hi)


@njit(nogil=True, cache=True, error_model="numpy")
def lora_update(out, x, a, b_t, r0, r1, z, C):
    """out[t] += (a[0] x[t]) @ b_t[0] for rows t in r0..r1-1 (a [1, R, K], b_t [1, R, N]), in tiles of
    TILE consecutive rows, each cut in C // tiles column chunks (C: the threads); z [>= max(tiles, C),
    TILE, >= R] scratch; on the calling thread"""
    m = (r1 - r0 + TILE - 1) // TILE
    C = max(1, C // m)
    for w in range(m * C):
        _update_item(out, x, a, b_t, r0, r1, z, w, C)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def lora_update_par(out, x, a, b_t, r0, r1, z, C):
    """lora_update with the work items spread over the thread pool"""
    m = (r1 - r0 + TILE - 1) // TILE
    C = max(1, C // m)
    for w in prange(m * C):
        _update_item(out, x, a, b_t, r0, r1, z, w, C)


# -- an FFN list's rows (plan rows of one adapter, grouped by expert) ----------------------------
@njit(nogil=True, cache=True, error_model="numpy")
def plan_rows(rows, starts, order, A, k, tokad, offsets):
    """Every adapter's plan rows, grouped by adapter: rows[starts[i]:starts[i+1]] = (row p, its token t,
    its expert e) for every p < A whose token's adapter tokad[order[p] // k] is i (-1: none), in plan
    order; starts [adapters + 1]."""
    n = starts.shape[0] - 1
    for i in range(n + 1):
        starts[i] = 0
    for p in range(A):
        i = tokad[order[p] // k]
        if i >= 0:
            starts[i + 1] += 1
    for i in range(n):
        starts[i + 1] += starts[i]
    e = 0
    for p in range(A):
        while offsets[e + 1] <= p:
            e += 1
        t = order[p] // k
        i = tokad[t]
        if i >= 0:
            j = starts[i]
            rows[j, 0], rows[j, 1], rows[j, 2] = p, t, e
            starts[i] = j + 1
    for i in range(n, 0, -1):           # starts[i] now holds where adapter i ends: shift back
        starts[i] = starts[i - 1]
    starts[0] = 0


@njit(inline="always")
def _item(tiles, rows, w, C):
    """work item w's (first row j0, rows nt, expert e, column chunk c)"""
    m = w // C
    j0 = tiles[m]
    return j0, tiles[m + 1] - j0, rows[j0, 2], w % C


@njit(nogil=True, cache=True, error_model="numpy")
def _pre_item(pre, x, rows, tiles, ag, bg, au, bu, z, w, C):
    j0, nt, e, c = _item(tiles, rows, w, C)
    R, I = ag.shape[1], bg.shape[2]
    lo, hi = c * I // C, (c + 1) * I // C
    zw = z[w]
    xa = x[rows[j0, 1]]
    xb = x[rows[j0 + 1, 1]] if nt > 1 else xa
    xc = x[rows[j0 + 2, 1]] if nt > 2 else xa
    xd = x[rows[j0 + 3, 1]] if nt > 3 else xa
    _proj(zw, 0, ag, e, xa, xb, xc, xd, nt)
    _up_tile(pre, rows, j0, nt, 0, zw, 0, bg, e, lo, hi)
    if au.shape[0]:
        _proj(zw, R, au, e, xa, xb, xc, xd, nt)
        _up_tile(pre, rows, j0, nt, I, zw, R, bu, e, lo, hi)
    else:                                   # up shares gate's A (au empty)
        _up_tile(pre, rows, j0, nt, I, zw, 0, bu, e, lo, hi)


@njit(nogil=True, cache=True, error_model="numpy")
def lora_pre(pre, x, rows, n, tiles, ag, bg, au, bu, z, C):
    """pre[p, :I] += (ag[e] x[t]) @ bg[e],  pre[p, I:] += (au[e] x[t]) @ bu[e]  for (p, t, e) = rows[j],
    j < n (an adapter's plan_rows; au empty: ag's projection for both); C as lora_update's; tiles
    [n + 1] and z [>= max(n, C), TILE, >= 2R] scratch"""
    m = _tiles(tiles, rows, n)
    C = max(1, C // m)
    for w in range(m * C):
        _pre_item(pre, x, rows, tiles, ag, bg, au, bu, z, w, C)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def lora_pre_par(pre, x, rows, n, tiles, ag, bg, au, bu, z, C):
    """lora_pre with the work items spread over the thread pool"""
    m = _tiles(tiles, rows, n)
    C = max(1, C // m)
    for w in prange(m * C):
        _pre_item(pre, x, rows, tiles, ag, bg, au, bu, z, w, C)


@njit(inline="always")
def _act(flat, rows, j, offsets, width, I):
    """plan row rows[j]'s activation in grouped_ffn's scratch (expert e's rows packed [n, I] from
    offsets[e] * width)"""
    p, e = rows[j, 0], rows[j, 2]
    o = offsets[e] * width + (p - offsets[e]) * I
    return flat[o:o + I]


@njit(nogil=True, cache=True, error_model="numpy")
def _down_item(out, flat, rows, tiles, offsets, width, ad, bd, z, w, C):
    j0, nt, e, c = _item(tiles, rows, w, C)
    I, N = ad.shape[2], bd.shape[2]
    zw = z[w]
    xa = _act(flat, rows, j0, offsets, width, I)
    xb = _act(flat, rows, j0 + 1, offsets, width, I) if nt > 1 else xa
    xc = _act(flat, rows, j0 + 2, offsets, width, I) if nt > 2 else xa
    xd = _act(flat, rows, j0 + 3, offsets, width, I) if nt > 3 else xa
    _proj(zw, 0, ad, e, xa, xb, xc, xd, nt)
    _up_tile(out, rows, j0, nt, 0, zw, 0, bd, e, c * N // C, (c + 1) * N // C)


@njit(nogil=True, cache=True, error_model="numpy")
def lora_down(out, flat, rows, n, tiles, offsets, width, ad, bd, z, C):
    """out[p] += (ad[e] a) @ bd[e]  for (p, t, e) = rows[j], j < n, a the row's activation in grouped_ffn's
    scratch (_act)"""
    m = _tiles(tiles, rows, n)
    C = max(1, C // m)
    for w in range(m * C):
        _down_item(out, flat, rows, tiles, offsets, width, ad, bd, z, w, C)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def lora_down_par(out, flat, rows, n, tiles, offsets, width, ad, bd, z, C):
    """lora_down with the work items spread over the thread pool"""
    m = _tiles(tiles, rows, n)
    C = max(1, C // m)
    for w in prange(m * C):
        _down_item(out, flat, rows, tiles, offsets, width, ad, bd, z, w, C)


drop_stale(globals(), __file__.replace("lora_kernels.py", "kernels.py"))
