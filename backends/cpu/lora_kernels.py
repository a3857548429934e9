"""Numba kernel of the cpu backend's LoRA update (base.py: lora_update).

Conventions as kernels.py: output first, the math quoted, float32 throughout. A row's arithmetic is
the same whatever rows run beside it (batch invariance: a request's logits do not depend on its
neighbours'): both passes are axpy loops in a fixed order, vectorised across the rank / the output
columns, never a reduction whose order could depend on the row count.
"""
from numba import njit, prange

from .jitcache import drop_stale
from .kernels import F0

PARALLEL_ROWS = 8          # rows from which the update runs on the thread pool (a decode step's few: serial)


@njit(nogil=True, cache=True, error_model="numpy")
def _row(out, x, a_t, b_t, z, t):
    """out[t] += (x[t] @ a_t) @ b_t   (a_t [K, R], b_t [R, N]; z [>= R] the row's scratch)"""
    K, R = a_t.shape
    N = b_t.shape[1]
    for j in range(R):
        z[j] = F0
    for i in range(K):
        xi = x[t, i]
        for j in range(R):
            z[j] += xi * a_t[i, j]
    for j in range(R):
        zj = z[j]
        for o in range(N):
            out[t, o] += zj * b_t[j, o]


@njit(nogil=True, cache=True, error_model="numpy")
def lora_update(out, x, a_t, b_t, r0, r1, z):
    """out[t] += (x[t] @ a_t) @ b_t for rows t in r0..r1-1, one after another; z [rows, >= R] scratch"""
    for t in range(r0, r1):
        _row(out, x, a_t, b_t, z[t], t)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def lora_update_par(out, x, a_t, b_t, r0, r1, z):
    """lora_update with the rows spread over the thread pool (the same per-row arithmetic)"""
    for t in prange(r0, r1):
        _row(out, x, a_t, b_t, z[t], t)


drop_stale(globals(), __file__.replace("lora_kernels.py", "kernels.py"))
