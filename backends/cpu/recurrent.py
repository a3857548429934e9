"""Numba kernels of the cpu backend's recurrent mixers (base.py: causal_conv, delta_rule, gate_mul).

Conventions as kernels.py: output first, each docstring quotes the math, float32 throughout
(constants np.float32), REDUCE float flags, and no kernel allocates: row views only, every scratch
array comes from the backend (Backend._delta_scratch: allocated once per head shape).

A step's tokens are grouped by sequence: sequence s owns rows starts[s] .. starts[s+1]-1 at
consecutive positions and the state slot slots[s]; a sequence whose first token in the step is at
position 0 starts from a zero state and never reads its slot.

delta_rule runs a sequence of one token (decode) as the one-step recurrence, in place on the state
slot (two passes over S [dk, dv]); a longer one (prefill) in chunks of C = 16 tokens, the chunked
(WY / UT) form of reference.delta_rule_chunked: S is walked twice a chunk instead of twice a token,
each of its rows used by the chunk's tokens while it sits in L1.
"""
import numpy as np
from numba import njit, prange

from .jitcache import drop_stale
from .kernels import F0, F1, REDUCE, fetch_add

EPS_L2 = np.float32(1e-6)          # l2(x) = x / sqrt(sum(x^2) + 1e-6)
F20 = np.float32(20.0)
DELTA_CHUNK = 16                   # tokens per chunk of the chunked delta rule (the reference's)
GATE_BLOCK = 2048                  # gate_mul's elements per parallel iteration


# -- causal conv ---------------------------------------------------------------------------------
@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def causal_conv(out, x, weight, state, starts, slots, positions, silu, bias):
    """Depthwise causal conv1d + SiLU per sequence, its last K-1 inputs carried in state[slot]:
        out[t, c] = silu(y) (y when not silu: LFM2), plus bias[c] inside (Mamba-2's; empty: none),  y = sum_{i<K} weight[c, i] * u(m - K + 1 + i, c),  silu(y) = y / (1 + e^-y)
    with m = t - a the token's index in its sequence's rows a..b-1 (n = b - a tokens) and
        u(m, c) = x[a + m, c]                   m >= 0 (the step's tokens)
                  state[slot, K - 1 + m, c]     -K < m < 0 (the inputs before the step)
                  0                             -K < m < 0 when the sequence starts at position 0
    (as the reference: a sequence continued from p0 < K - 1 takes its state's rows for q < 0, which
    hold the zeros its first step wrote there).
    Afterwards state[slot, i, c] = u(n - K + 1 + i, c), i < K - 1: the K-1 inputs ending at its
    last token. Written in place in increasing i: row i takes old row n + i > i when it takes an
    old row at all, so every old value is read before it is overwritten.
        out, x [T, C] float32 (distinct); weight float32 [C, K]; state [slots, K-1, C];
        starts [S+1], slots [S], positions [T] int32
    Parallel over (sequence, channel); consecutive iterations are consecutive channels, so each
    thread walks a contiguous band of every row.
    Strict float arithmetic (no REDUCE flags): the K-term sum is in the order written whichever
    branch supplied u. With reassoc/contract, LLVM compiled the branches' versions of the loop with
    different fusions on an AVX-512 host, so a token whose inputs came from the state (a sequence
    resumed from a snapshot) rounded apart from the same token in one long prefill (Qwen3.5 and
    Granite 4.0-H logprobs 2e-7..2.5e-6 apart; test_prefix_cache's hybrid cases). K = 4 multiply-adds
    per output: nothing to vectorise, nothing lost."""
    S, C, K = slots.shape[0], x.shape[1], weight.shape[1]
    for sc in prange(S * C):
        s, c = sc // C, sc % C
        a, b = starts[s], starts[s + 1]
        if b <= a:
            continue
        n = b - a
        fresh = positions[a] == 0
        st = state[slots[s]]
        for m in range(n):
            y = F0
            for i in range(K):
                j = m - K + 1 + i                     # u's index
                if j >= 0:
                    u = x[a + j, c]
                elif fresh:
                    u = F0
                else:
                    u = st[K - 1 + j, c]
                y += weight[c, i] * u
            if bias.shape[0] > 0:
                y += bias[c]
            out[a + m, c] = y / (F1 + np.exp(-y)) if silu else y
        for i in range(K - 1):
            j = n - K + 1 + i
            if j >= 0:
                st[i, c] = x[a + j, c]
            elif fresh:
                st[i, c] = F0
            else:
                st[i, c] = st[K - 1 + j, c]           # old row n + i > i: not yet overwritten


# -- gated delta rule ----------------------------------------------------------------------------
@njit(inline="always")
def softplus(y):
    """torch's softplus (beta 1, threshold 20): log(1 + e^y), y itself past 20."""
    return y if y > F20 else np.log1p(np.exp(y))


@njit(fastmath=REDUCE, error_model="numpy")
def inv_norm(row, o, d):
    """1 / sqrt(sum(row[o:o+d]^2) + 1e-6): l2's factor."""
    ss = F0
    for e in range(d):
        ss += row[o + e] * row[o + e]
    return F1 / np.sqrt(ss + EPS_L2)


@njit(fastmath=REDUCE, error_model="numpy", inline="always")
def axpy4(y, a0, x0, a1, x1, a2, x2, a3, x3):
    """y += a0 x0 + a1 x1 + a2 x2 + a3 x3   (rows [d]): four rows per pass over y, so each load and
    store of y carries four multiply-adds."""
    for e in range(y.shape[0]):
        y[e] += (a0 * x0[e] + a1 * x1[e]) + (a2 * x2[e] + a3 * x3[e])


@njit(fastmath=REDUCE, error_model="numpy", inline="always")
def axpy(y, a0, x0):
    """y += a0 x0"""
    for e in range(y.shape[0]):
        y[e] += a0 * x0[e]


@njit(fastmath=REDUCE, error_model="numpy", inline="always")
def scale(y, a):
    """y *= a"""
    for e in range(y.shape[0]):
        y[e] *= a


@njit(fastmath=REDUCE, error_model="numpy")
def delta_step(out, qkv, a, b, a_neg, dt_bias, St, t, h, qo, ko, vo, qscale, X):
    """One token t of value head h, in place on S = St [dk, dv] (the one-step recurrence):
        q = l2(q_t) * qscale,  k = l2(k_t),  beta = sigmoid(b[t, h]),  g = a_neg[h] softplus(a[t, h] + dt_bias[h])
        S = e^g S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q
    in two passes over S's rows, as
        X = S_old^T k,  o = S_old^T q                  (one pass, S's rows four at a time)
        delta = beta (v - e^g X),  o = e^g o + (k . q) delta
        S = e^g S_old + k delta^T                      (the second pass)
    o = out[t, h*dv : (h+1)*dv]; X [dv]: the worker's scratch (delta after the first pass). qo, ko,
    vo: the offsets of the head's q, k and v in qkv's row. Measured (one thread, dk = dv = 128, a
    shared 2-core AMD EPYC host): 3.3 us a head; three passes with o the only vector and no scratch
    (S_old^T k, then delta and the update, then S_new^T q) 4.6 us."""
    dk, dv = St.shape
    row = qkv[t]
    rq = inv_norm(row, qo, dk) * qscale
    rk = inv_norm(row, ko, dk)
    beta = F1 / (F1 + np.exp(-b[t, h]))
    eg = np.exp(a_neg[h] * softplus(a[t, h] + dt_bias[h]))
    o = out[t, h * dv:(h + 1) * dv]
    v = row[vo:vo + dv]
    o[:] = F0
    X[:] = F0
    kq = F0
    d4 = dk - dk % 4
    for i in range(0, d4, 4):                         # X = S_old^T k,  o = S_old^T q
        s0, s1, s2, s3 = St[i], St[i + 1], St[i + 2], St[i + 3]
        k0, k1, k2, k3 = row[ko + i] * rk, row[ko + i + 1] * rk, row[ko + i + 2] * rk, row[ko + i + 3] * rk
        q0, q1, q2, q3 = row[qo + i] * rq, row[qo + i + 1] * rq, row[qo + i + 2] * rq, row[qo + i + 3] * rq
        kq += (k0 * q0 + k1 * q1) + (k2 * q2 + k3 * q3)
        for e in range(dv):
            x0, x1, x2, x3 = s0[e], s1[e], s2[e], s3[e]
            X[e] += (k0 * x0 + k1 * x1) + (k2 * x2 + k3 * x3)
            o[e] += (q0 * x0 + q1 * x1) + (q2 * x2 + q3 * x3)
    for i in range(d4, dk):
        ki, qi = row[ko + i] * rk, row[qo + i] * rq
        kq += ki * qi
        axpy(X, ki, St[i])
        axpy(o, qi, St[i])
    for e in range(dv):                               # delta, and o = S_new^T q
        X[e] = beta * (v[e] - eg * X[e])
        o[e] = eg * o[e] + kq * X[e]
    for i in range(dk):                               # S = e^g S_old + k delta^T
        ki = row[ko + i] * rk
        s = St[i]
        for e in range(dv):
            s[e] = eg * s[e] + ki * X[e]


@njit(fastmath=REDUCE, error_model="numpy")
def delta_chunks(out, qkv, a, b, a_neg, dt_bias, St, r0, r1, h, qo, ko, vo, qscale, Q, K, W, U, A, M, G, B):
    """Tokens r0..r1-1 of value head h in chunks of C (the last may be shorter), S = St [dk, dv] in
    place (reference.delta_rule_chunked). Per chunk of n tokens (i, j < n; the per-token terms as
    delta_step's), with G_i = g_0 + .. + g_i the cumulative log decay and D[i, j] = e^(G_i - G_j), j <= i:
        A = strictly_lower((beta k) k^T * D),  M = lower(q k^T * D)                        [n, n]
        U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k e^G)    forward substitution:
            U_i = beta_i v_i - sum_{j<i} A_ij U_j,  W_i = beta_i e^G_i k_i - sum_{j<i} A_ij W_j
        v' = U - W S;  out = (q e^G) S + M v'
        S  = e^(G_last) S + (k e^(G_last - G))^T v'
    The three [n, dk] x [dk, dv]-sized products walk S row by row, each row meeting all n tokens
    while it is in L1: v' and (q e^G) S together, four rows of S at a time, then the update, four
    tokens at a time (four multiply-adds per load and store of what is updated). Scratch (one
    worker's): Q, K, W [C, dk]; U [C, dv] (U, then v'); A, M [C, C]; G, B [C]. Measured (one thread,
    dk = dv = 128, 512 tokens, a shared 2-core AMD EPYC host): about 1.6-2 ms a head; one S row at a
    time 2.9 ms; 2-D indexing (out[t, ho + e]) instead of row views 10 ms."""
    dk, dv = St.shape
    C = G.shape[0]
    ho = h * dv
    an, dtb = a_neg[h], dt_bias[h]
    dk4 = dk - dk % 4
    for t0 in range(r0, r1, C):
        n = min(C, r1 - t0)
        n4 = n - n % 4
        # the chunk's q, k (l2-normed), beta and cumulative log decay G
        gs = F0
        for i in range(n):
            row = qkv[t0 + i]
            rq = inv_norm(row, qo, dk) * qscale
            rk = inv_norm(row, ko, dk)
            q, k = Q[i], K[i]
            for e in range(dk):
                q[e] = row[qo + e] * rq
                k[e] = row[ko + e] * rk
            B[i] = F1 / (F1 + np.exp(-b[t0 + i, h]))
            gs += an * softplus(a[t0 + i, h] + dtb)
            G[i] = gs
        # A[i, j] = beta_i (k_i . k_j) D_ij (j < i),  M[i, j] = (q_i . k_j) D_ij (j <= i)
        for i in range(n):
            qi, ki = Q[i], K[i]
            for j in range(i + 1):
                kj = K[j]
                kk = F0
                qk = F0
                for e in range(dk):
                    kk += ki[e] * kj[e]
                    qk += qi[e] * kj[e]
                d = np.exp(G[i] - G[j])
                A[i, j] = B[i] * kk * d
                M[i, j] = qk * d
        # U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k e^G), row by row
        for i in range(n):
            bi = B[i]
            bg = bi * np.exp(G[i])
            v = qkv[t0 + i, vo:vo + dv]
            u, w, k = U[i], W[i], K[i]
            for e in range(dv):
                u[e] = bi * v[e]
            for e in range(dk):
                w[e] = bg * k[e]
            for j in range(i):
                axpy(u, -A[i, j], U[j])
                axpy(w, -A[i, j], W[j])
        # v' = U - W S  and  out = (q e^G) S, S's rows four at a time (Q's rows scaled by e^G first)
        for i in range(n):
            scale(Q[i], np.exp(G[i]))
            out[t0 + i, ho:ho + dv] = F0
        for l in range(0, dk4, 4):
            s0, s1, s2, s3 = St[l], St[l + 1], St[l + 2], St[l + 3]
            for i in range(n):
                w0, w1, w2, w3 = W[i, l], W[i, l + 1], W[i, l + 2], W[i, l + 3]
                q0, q1, q2, q3 = Q[i, l], Q[i, l + 1], Q[i, l + 2], Q[i, l + 3]
                u = U[i]
                o = out[t0 + i, ho:ho + dv]
                for e in range(dv):
                    x0, x1, x2, x3 = s0[e], s1[e], s2[e], s3[e]
                    u[e] -= (w0 * x0 + w1 * x1) + (w2 * x2 + w3 * x3)
                    o[e] += (q0 * x0 + q1 * x1) + (q2 * x2 + q3 * x3)
        for l in range(dk4, dk):
            s = St[l]
            for i in range(n):
                axpy(U[i], -W[i, l], s)
                axpy(out[t0 + i, ho:ho + dv], Q[i, l], s)
        # out += M v'
        for i in range(n):
            o = out[t0 + i, ho:ho + dv]
            for j in range(i + 1):
                axpy(o, M[i, j], U[j])
        # S = e^(G_last) S + (k e^(G_last - G))^T v', tokens four at a time (K's rows scaled first)
        gl = G[n - 1]
        for i in range(n):
            scale(K[i], np.exp(gl - G[i]))
        egl = np.exp(gl)
        for l in range(dk):
            s = St[l]
            scale(s, egl)
            for i in range(0, n4, 4):
                axpy4(s, K[i, l], U[i], K[i + 1, l], U[i + 1], K[i + 2, l], U[i + 2], K[i + 3, l], U[i + 3])
            for i in range(n4, n):
                axpy(s, K[i, l], U[i])


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def delta_rule(out, qkv, a, b, a_neg, dt_bias, state, starts, slots, positions, Hk, group, stepwise, work, nw, ck, cv,
               cc, cg):
    """The gated delta rule (base.delta_rule) over every (sequence, value head) pair:
        q = l2(q part) / sqrt(dk),  k = l2(k part) (key head (h // group) % Hk),  v: value head h
        beta = sigmoid(b),  g = a_neg[h] softplus(a + dt_bias[h])
        S = e^g S;  S += k (beta (v - S^T k))^T;  out[t, h] = S^T q
    S = state[slot, h] [dk, dv], in place: zeroed first when the sequence starts at position 0, else
    continued. One token, or every token when stepwise (a verification of drafted tokens: decode's
    arithmetic): delta_step (its scratch vector X: cv[c, 0]); more: delta_chunks on worker c's
    scratch ck[c] = (Q, K, W) [3, C, dk], cv[c] = U [C, dv], cc[c] = (A, M) [2, C, C], cg[c] = (G, beta) [2, C].
        qkv [T, 2*Hk*dk + Hv*dv]; a, b [T, Hv]; a_neg, dt_bias float32 [Hv]; out [T, Hv*dv];
        state [slots, Hv, dk, dv]; starts [S+1], slots [S], positions [T] int32
    Parallel: nw workers (one per thread, nw <= ck.shape[0]) each take the next unstarted pair from
    one atomic counter (work[0, 0]), so a thread that is slower or descheduled, or holds a longer
    sequence's pair, delays the step by at most one pair."""
    Hv, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    P = slots.shape[0] * Hv
    qscale = np.float32(dk ** -0.5)
    work[0, 0] = 0
    for c in prange(nw):
        while True:
            p = fetch_add(work, 0)
            if p >= P:
                break
            s, h = p // Hv, p % Hv
            r0, r1 = starts[s], starts[s + 1]
            if r1 <= r0:
                continue
            St = state[slots[s], h]
            if positions[r0] == 0:                    # a new sequence: S = 0, its slot unread
                St[:, :] = F0
            kh = (h // group) % Hk
            qo, ko, vo = kh * dk, (Hk + kh) * dk, 2 * Hk * dk + h * dv
            if r1 - r0 == 1 or stepwise:
                for t in range(r0, r1):
                    delta_step(out, qkv, a, b, a_neg, dt_bias, St, t, h, qo, ko, vo, qscale, cv[c, 0])
            else:
                delta_chunks(out, qkv, a, b, a_neg, dt_bias, St, r0, r1, h, qo, ko, vo, qscale,
                             ck[c, 0], ck[c, 1], ck[c, 2], cv[c], cc[c, 0], cc[c, 1], cg[c, 0], cg[c, 1])


# -- Mamba-2's selective state space ---------------------------------------------------------------
@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def ssm_scan(out, xbc, dt, a_neg, d_skip, dt_bias, state, starts, slots, positions, nh, P, G, N):
    """Mamba-2's selective state space (base.ssm_scan), token by token in prefill and decode alike:
        d = softplus(dt[t, h] + dt_bias[h]);  S[p, :] = e^(d a_neg[h]) S[p, :] + d x[p] B
        out[t, h P + p] = S[p, :] . C + d_skip[h] x[p]
    Parallel over (sequence, head, head dim p): each owns the state row S[h, p, :] (N floats) in the slot
    and walks its sequence's tokens."""
    S = slots.shape[0]
    di, rep = nh * P, nh // G
    for shp in prange(S * nh * P):
        s, hp = shp // (nh * P), shp % (nh * P)
        h, p = hp // P, hp % P
        a, b = starts[s], starts[s + 1]
        if b <= a:
            continue
        row = state[slots[s], h, p]
        if positions[a] == 0:
            for n in range(N):
                row[n] = F0
        g = h // rep
        b0, c0 = di + g * N, di + G * N + g * N
        for t in range(a, b):
            v = dt[t, h] + dt_bias[h]
            dv = v if v > F20 else np.log1p(np.exp(v))
            dA = np.exp(dv * a_neg[h])
            xv = xbc[t, hp]
            y = F0
            for n in range(N):
                row[n] = row[n] * dA + (dv * xbc[t, b0 + n]) * xv
                y += row[n] * xbc[t, c0 + n]
            out[t, hp] = y + d_skip[h] * xv


# -- output gates --------------------------------------------------------------------------------
@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def gate_mul(out, x, gate, mode):
    """out = x * act(gate), elementwise over [R, N] (out may alias x), by mode (backend.GATE_MODES):
        1 silu:  x * (gate / (1 + e^-gate))      0 sigmoid:  x / (1 + e^-gate)      2 none:  x * gate
    Parallel over (row, block of GATE_BLOCK columns), so one decode row splits across threads too."""
    R, N = x.shape
    nb = (N + GATE_BLOCK - 1) // GATE_BLOCK
    for rb in prange(R * nb):
        r, lo = rb // nb, (rb % nb) * GATE_BLOCK
        for n in range(lo, min(N, lo + GATE_BLOCK)):
            g = gate[r, n]
            if mode == 1:
                out[r, n] = x[r, n] * (g / (F1 + np.exp(-g)))
            elif mode == 2:
                out[r, n] = x[r, n] * g
            else:
                out[r, n] = x[r, n] / (F1 + np.exp(-g))


drop_stale(globals(), __file__.replace("recurrent.py", "kernels.py"))
