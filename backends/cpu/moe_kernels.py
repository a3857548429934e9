"""Numba kernels of the cpu backend's MoE layer: route, align, the grouped SwiGLU gate/up, combine.
Output first; each docstring quotes the math. The widening, dot products and the stream layout of
weight reads are kernels.py's (the down projection is kernels.matmul)."""
import numpy as np
from numba import njit, prange

from .jitcache import drop_stale
from .kernels import F0, F1, REDUCE, TILE4, claim, dot1, expert_act, fdot4, fdot4x2, fdot4x4, reset_claims, scaled


@njit(error_model="numpy", inline="always")
def store_swiglu(act, r, i, g, u, gate_scales, up_scales, ep):
    """act[r, i] = silu(g * gate_scales[i]) * (u * up_scales[i])   (empty scales = 1), or ep's
    clamped form with biases (kernels.expert_act)"""
    act[r, i] = expert_act(scaled(g, gate_scales, i), scaled(u, up_scales, i), i, ep)


@njit(cache=True, error_model="numpy")
def route(out_ids, out_w, logits, gated, normalize, choice_bias, norm_min, expert_scale):
    """logits [T,E] -> out_ids [T,k] int32, out_w [T,k] float32; p = softmax(logits[t]) in float32.
    topk:  the k largest, ties to the lower expert id; w = p (/ max(sum of the k p, norm_min) when
           normalize), then * expert_scale[id] (expert_scale [E], non-empty: Gemma 4). Without a
           choice bias ranked by logit (softmax is monotone); with one (choice_bias [E], non-empty)
           by p + choice_bias. Selection by repeated arg-max with a
           strict >, so an equal later expert never displaces an earlier one.
    gated: k == E, ids = 0..E-1, w = p."""
    T, E = logits.shape
    k = out_ids.shape[1]
    biased = choice_bias.shape[0] > 0
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
            best_s = F0
            for e in range(E):
                taken = False
                for i in range(j):
                    taken |= out_ids[t, i] == e
                s = np.exp(row[e] - top) / total + choice_bias[e] if biased else row[e]
                if not taken and (best < 0 or s > best_s):
                    best, best_s = e, s
            out_ids[t, j] = best
            out_w[t, j] = np.exp(row[best] - top) / total
            chosen += out_w[t, j]
        if normalize:
            chosen = max(chosen, norm_min)
            for j in range(k):
                out_w[t, j] /= chosen
        if expert_scale.shape[0]:
            for j in range(k):
                out_w[t, j] *= expert_scale[out_ids[t, j]]


@njit(cache=True)
def align(offsets, order, inverse, counts, active, ids, tally):
    """Stable counting sort of assignments a = t*k + j by expert ids[a] (colibri_edge.routing.align):
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
