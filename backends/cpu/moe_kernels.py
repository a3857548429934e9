"""Numba kernels of the cpu backend's MoE layer: route, align, the grouped SwiGLU gate/up, combine.
Output first; each docstring quotes the math. The widening, dot products and the stream layout of
weight reads are kernels.py's (the down projection is kernels.matmul)."""
import numpy as np
from numba import njit, prange

from .jitcache import drop_stale
from .kernels import F0, F1, REDUCE, TILE4, activate, claim, dot1, fdot4, fdot4x2, fdot4x4, reset_claims, scaled


@njit(error_model="numpy", inline="always")
def store_swiglu(act, r, i, g, u, gate_scales, up_scales, ep):
    """act[r, i] = silu(g * gate_scales[i]) * (u * up_scales[i])   (empty scales = 1), or ep's
    clamped form with biases (kernels.expert_act)"""
    act[r, i] = activate(scaled(g, gate_scales, i), scaled(u, up_scales, i), r, i, ep)


@njit(error_model="numpy", inline="always")
def prob(row, e, sigmoid, top, total):
    """p_e: 1 / (1 + exp(-row[e])) (sigmoid), else softmax's exp(row[e] - top) / total"""
    return F1 / (F1 + np.exp(-row[e])) if sigmoid else np.exp(row[e] - top) / total


@njit(error_model="numpy", inline="always")
def mask_groups(c, E, groups):
    """Group-limited choice, groups = (n, keep, top), n groups of E/n consecutive experts:
        c[E + g] = score of group g = the sum of its `top` largest c, the largest first
        c[e] = -inf for the experts of every group ranked `keep` or lower, its rank the number of
               groups scoring more or as much with a lower id (ties to the lower group id)
    The top largest are taken in the order (c descending, id ascending): the next is the largest
    after the last taken (v, i), among c < v or c == v with a higher id, so equal c count each."""
    n, keep, top = groups
    size = E // n
    for g in range(n):
        score = F0
        v, i = np.float32(np.inf), -1
        for _ in range(top):
            b = -1
            for e in range(g * size, (g + 1) * size):
                if (c[e] < v or (c[e] == v and e > i)) and (b < 0 or c[e] > c[b]):
                    b = e
            v, i = c[b], b
            score += v
        c[E + g] = score
    for g in range(n):
        rank = 0
        for o in range(n):
            if c[E + o] > c[E + g] or (c[E + o] == c[E + g] and o < g):
                rank += 1
        if rank >= keep:
            for e in range(g * size, (g + 1) * size):
                c[e] = -np.inf


@njit(cache=True, error_model="numpy")
def route(out_ids, out_w, logits, gated, normalize, choice_bias, norm_min, expert_scale, sigmoid, groups,
          scaling, c):
    """logits [T,E] -> out_ids [T,k] int32, out_w [T,k] float32, in float32:
        p = softmax(logits[t]), or p_e = 1 / (1 + exp(-logits[t,e])) when sigmoid
        c = p + choice_bias (choice_bias [E], non-empty: the choice only), else p
        groups = (n, keep, top), n > 1: only the experts of the keep best of n groups stay in the
                 choice (mask_groups); n = 1: no groups
    topk:  ids = the k largest c, ties to the lower expert id: repeated arg-max with a strict >, so an
           equal later expert never displaces an earlier one, a chosen expert's c then -inf;
           w = p[ids] (/ max(sum of the k p, norm_min) when normalize) * scaling, then
           * expert_scale[id] (expert_scale [E], non-empty: Gemma 4)
    gated: k == E, ids = 0..E-1, w = p.
    c: float32 scratch [>= E + n], the choice scores then the group scores.
    Softmax's sum of exp(logit - max) is accumulated in float64 and rounded once: a float32 running
    sum drifts by E rounding errors (1.5e-6 of the sum for 64 experts near equal: NumPy's pairwise
    sum, the reference, does not)."""
    T, E = logits.shape
    k = out_ids.shape[1]
    biased = choice_bias.shape[0] > 0
    for t in range(T):
        row = logits[t]
        top = row[0]
        total = F1
        if not sigmoid:
            for e in range(1, E):
                top = max(top, row[e])
            acc = 0.0                          # float64: see the docstring
            for e in range(E):
                acc += np.exp(row[e] - top)
            total = np.float32(acc)
        if gated:
            for e in range(E):
                out_ids[t, e] = e
                out_w[t, e] = prob(row, e, sigmoid, top, total)
            continue
        for e in range(E):
            pe = prob(row, e, sigmoid, top, total)
            c[e] = pe + choice_bias[e] if biased else pe
        if groups[0] > 1:
            mask_groups(c, E, groups)
        chosen = F0
        for j in range(k):
            best = 0
            for e in range(1, E):
                if c[e] > c[best]:
                    best = e
            c[best] = -np.inf
            out_ids[t, j] = best
            out_w[t, j] = prob(row, best, sigmoid, top, total)
            chosen += out_w[t, j]
        if normalize:
            chosen = max(chosen, norm_min)
            for j in range(k):
                out_w[t, j] /= chosen
        for j in range(k):
            out_w[t, j] *= scaling
        if expert_scale.shape[0]:
            for j in range(k):
                out_w[t, j] *= expert_scale[out_ids[t, j]]


@njit(cache=True, error_model="numpy")
def sparsemixer(out_ids, out_w, logits, thr):
    """Phi-3.5-MoE's inference router (base.Backend.sparsemixer): per token, twice: the best remaining
    expert i (ties to the lower id), its weight 1 / sum exp(s_e - s_i) over the remaining experts e not
    dropped, (s_i - s_e) / max(|s_e|, s_i) > thr dropping one (thr = 2 jitter; a NaN ratio keeps it)."""
    T, E = logits.shape
    for t in range(T):
        s = logits[t]
        first = -1
        for j in range(2):
            best, m = -1, np.float32(0)
            for e in range(E):
                if e != first and (best < 0 or s[e] > m):
                    best, m = e, s[e]
            tot = np.float32(0)
            for e in range(E):
                if e == first:
                    continue
                if not ((m - s[e]) / max(abs(s[e]), m) > thr):
                    tot += np.exp(s[e] - m)
            out_ids[t, j] = best
            out_w[t, j] = np.float32(1) / tot
            first = best


@njit(cache=True)
def align(offsets, order, inverse, counts, active, ids, tally):
    """Stable counting sort of assignments a = t*k + j by expert ids[a] (colibri_edge.backends.routing.align):
        counts[e] = #{a : ids[a] = e},  offsets = [0, cumsum(counts)]  ([E+1])
        order[offsets[e] + r] = e's r-th assignment,  inverse[order[i]] = i
        active[:n] = experts with counts > 0, ascending; returns n.
        tally[e] += counts[e] when tally is not empty (tokens routed, over the engine's life)
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
    if tally.shape[0]:
        for e in range(E):
            tally[e] += counts[e]
    return n_active


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def swiglu_gate_up(act, x, order, start, top_k, gate, up, gate_scales, up_scales, work, ep):
    """act[r,i] = silu(gate[i] . x[t_r] * gs[i]) * (up[i] . x[t_r] * us[i]),  t_r = order[start + r] // top_k
        gate, up: weight [I,H];  gs, us: their float32 row scales [I] (int8) or empty;
        x [T,H];  act [R,I];  silu(g) = g / (1 + exp(-g));  work: as in matmul
    Read as matmul reads a weight: each chunk of I it claims is split in two halves of h rows and
    takes rows i and i+h of gate and of up together: four sequential streams per core, four
    dot products per load of x. Every token of the expert uses the four rows while they are in
    L1, so the expert's gate/up are read once per step."""
    R, I = act.shape
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, I)
            if lo >= hi:
                break
            h = (hi - lo) // 2
            for i in range(lo, lo + h):
                j = i + h
                g0, g1, u0, u1 = gate[i], gate[j], up[i], up[j]
                r4 = R - R % 4 if TILE4 else 0
                for r in range(0, r4, 4):
                    xa, xb = x[order[start + r] // top_k], x[order[start + r + 1] // top_k]
                    xc, xd = x[order[start + r + 2] // top_k], x[order[start + r + 3] // top_k]
                    ga, gb, ua, ub, gc, gd, uc, ud, ge, gf, ue, uf, gg, gh, ug, uh = \
                        fdot4x4(g0, g1, u0, u1, xa, xb, xc, xd)
                    store_swiglu(act, r, i, ga, ua, gate_scales, up_scales, ep)
                    store_swiglu(act, r, j, gb, ub, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 1, i, gc, uc, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 1, j, gd, ud, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 2, i, ge, ue, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 2, j, gf, uf, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 3, i, gg, ug, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 3, j, gh, uh, gate_scales, up_scales, ep)
                for r in range(r4, R - 1, 2):
                    xa, xb = x[order[start + r] // top_k], x[order[start + r + 1] // top_k]
                    ga, gb, ua, ub, gc, gd, uc, ud = fdot4x2(g0, g1, u0, u1, xa, xb)
                    store_swiglu(act, r, i, ga, ua, gate_scales, up_scales, ep)
                    store_swiglu(act, r, j, gb, ub, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 1, i, gc, uc, gate_scales, up_scales, ep)
                    store_swiglu(act, r + 1, j, gd, ud, gate_scales, up_scales, ep)
                if (R - r4) % 2:
                    ga, gb, ua, ub = fdot4(g0, g1, u0, u1, x[order[start + R - 1] // top_k])
                    store_swiglu(act, R - 1, i, ga, ua, gate_scales, up_scales, ep)
                    store_swiglu(act, R - 1, j, gb, ub, gate_scales, up_scales, ep)
            for i in range(lo + 2 * h, hi):
                for r in range(R):
                    xr = x[order[start + r] // top_k]
                    store_swiglu(act, r, i, dot1(gate, i, xr), dot1(up, i, xr), gate_scales, up_scales, ep)


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


drop_stale(globals(), __file__.replace("moe_kernels.py", "kernels.py"))
