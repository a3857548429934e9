"""The recurrent mixers' ops (base.py: causal_conv, delta_rule, gate_mul) on every backend against the
NumPy reference, and the reference's chunked delta rule against its token-by-token recurrence.

A step mixes sequences as the scheduler packs them: a prompt from position 0, a prefill chunk that
continues a sequence, decode tokens; shapes are odd (not multiples of any work-group or SIMD width),
key heads repeat to value heads, prompt lengths do not divide by the chunk."""
import numpy as np
import pytest

from colibri_edge.backends import create
from colibri_edge.backends.reference import backend as ref_backend

from helpers import KERNEL_VARIANTS, need as _need, pairs as _pairs
from helpers import backend_pair as backend, dev, kernel_close as close

# the kernel variants that reach these ops' code: the cpu's thread count (queues, streams, cuBLAS and
# the int8 activation path never touch them, so their variants would only repeat the default's run)
RECURRENT_VARIANTS = {"cpu": {v: o for v, o in KERNEL_VARIANTS["cpu"].items() if "int8_activations" not in o},
                      "opencl": {"": {}}, "cuda": {"": {}}}


@pytest.fixture(params=_pairs(RECURRENT_VARIANTS, ["cpu", "opencl", "cuda"]))
def kernel_backend(request):
    """(backend name, create() options) for every backend but the reference, in the variants above."""
    _need(request.param[0])
    return request.param


def step(lengths, starts_at):
    """-> starts [S+1], positions [T] for sequences of `lengths` tokens starting at `starts_at`."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for n, p in zip(lengths, starts_at)]).astype(np.int32)
    return starts, pos


# (lengths, first positions): a prompt, a continued prefill chunk, decode tokens, a long prompt
STEPS = [([1], [0]), ([1, 1, 1], [5, 0, 2]), ([37, 5, 1], [0, 9, 30]), ([3, 1, 70], [1, 40, 0]),
         ([16, 17], [0, 16])]


@pytest.mark.parametrize("lengths,at", STEPS)
@pytest.mark.parametrize("C,K,silu,bias", [(37, 4, True, False), (8, 2, True, False), (130, 3, True, False),
                                           (37, 3, False, False), (130, 4, False, False), (37, 4, True, True)])
def test_causal_conv(kernel_backend, lengths, at, C, K, silu, bias, rng):
    """silu False: LFM2's short convolution (no activation); bias: Mamba-2's conv bias (inside the SiLU)."""
    ref, be = backend(kernel_backend)
    starts, pos = step(lengths, at)
    T, S = int(starts[-1]), len(lengths)
    nslots = S + 2
    slots = rng.permutation(nslots)[:S].astype(np.int32)
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    state = rng.standard_normal((nslots, K - 1, C)).astype(np.float32)   # slots of position-0 sequences: garbage
    bv = rng.standard_normal(C).astype(np.float32) if bias else np.zeros(C, np.float32)
    outs, states = [], []
    for b in (ref, be):
        out, st = b.alloc((T, C)), dev(b, state)
        b.causal_conv(out, dev(b, x), b.upload(w), st, dev(b, starts), dev(b, slots), dev(b, pos), silu,
                      b.upload(bv) if bias else None)
        outs.append(b.download(out))
        states.append(b.download(st))
    close(outs[1], outs[0], 1e-5)
    close(states[1], states[0], 1e-6)
    # the reference's own meaning: a sequence from position 0 is the zero-padded convolution
    s0 = lengths.index(max(lengths))
    if at[s0] == 0:
        a, n = starts[s0], lengths[s0]
        xp = np.concatenate([np.zeros((K - 1, C), np.float32), x[a:a + n]])
        y = np.stack([np.einsum("ic,ci->c", xp[j:j + K], w) for j in range(n)]) + bv
        close(outs[0][a:a + n], y / (1 + np.exp(-y)) if silu else y, 1e-5)


# (Hk, Hv, dk, dv, group): value head h reads key head (h // group) % Hk: grouped (group Hv / Hk), tiled (1)
HEADS = [(1, 1, 8, 8, 1), (2, 4, 16, 12, 2), (3, 6, 32, 20, 2), (3, 6, 16, 12, 1), (2, 2, 128, 128, 1)]


def delta_case(heads, lengths, at, rng):
    Hk, Hv, dk, dv = heads[:4]
    starts, pos = step(lengths, at)
    T, S = int(starts[-1]), len(lengths)
    nslots = S + 1
    slots = rng.permutation(nslots)[:S].astype(np.int32)
    qkv = rng.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(np.float32)
    a = rng.standard_normal((T, Hv)).astype(np.float32)
    b = (2 * rng.standard_normal((T, Hv))).astype(np.float32)
    a_neg = -np.exp(rng.uniform(-2, 1.5, Hv)).astype(np.float32)
    dt = rng.standard_normal(Hv).astype(np.float32)
    state = (0.3 * rng.standard_normal((nslots, Hv, dk, dv))).astype(np.float32)
    return starts, pos, slots, qkv, a, b, a_neg, dt, state


@pytest.mark.parametrize("lengths,at", STEPS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_delta_rule(kernel_backend, heads, lengths, at, rng):
    ref, be = backend(kernel_backend)
    Hk, Hv, dk, dv = heads[:4]
    starts, pos, slots, qkv, a, b, a_neg, dt, state = delta_case(heads, lengths, at, rng)
    T = qkv.shape[0]
    outs, states = [], []
    for bk in (ref, be):
        out, st = bk.alloc((T, Hv * dv)), dev(bk, state)
        bk.delta_rule(out, dev(bk, qkv), dev(bk, a), dev(bk, b), bk.upload(a_neg), bk.upload(dt), st,
                      dev(bk, starts), dev(bk, slots), dev(bk, pos), heads)
        outs.append(bk.download(out))
        states.append(bk.download(st))
    close(outs[1], outs[0], 1e-4)
    close(states[1], states[0], 1e-4)


@pytest.mark.parametrize("heads", [(2, 6, 16, 12, 3), (1, 1, 8, 8, 1)], ids=lambda h: "x".join(map(str, h)))
def test_stepwise_delta_rule_is_decode(kernel_backend, heads, rng):
    """stepwise (a verification of drafted tokens): sequences of 5, 1 and 17 tokens, one of them new,
    run token by token in one call: outputs and state equal the backend's own decode steps, one token
    per call, bit for bit on the batch-invariant backends (within its tolerance elsewhere), and the
    reference's recurrence."""
    ref, be = backend(kernel_backend)
    Hv, dv = heads[1], heads[3]
    starts, pos, slots, qkv, a, b, a_neg, dt, state = delta_case(heads, [5, 1, 17], [9, 3, 0], rng)
    T = qkv.shape[0]
    results = []
    for bk in (ref, be):
        out, st = bk.alloc((T, Hv * dv)), dev(bk, state)
        bk.delta_rule(out, dev(bk, qkv), dev(bk, a), dev(bk, b), bk.upload(a_neg), bk.upload(dt), st,
                      dev(bk, starts), dev(bk, slots), dev(bk, pos), heads, True)
        results.append((bk.download(out), bk.download(st)))
    # decode: token t of sequence s alone in its call, in order
    one_out, one_st = be.alloc((1, Hv * dv)), dev(be, state)
    steps = np.zeros((T, Hv * dv), np.float32)
    wa, wd = be.upload(a_neg), be.upload(dt)
    for s_ in range(len(slots)):
        for t in range(starts[s_], starts[s_ + 1]):
            be.delta_rule(one_out, dev(be, qkv[t:t + 1]), dev(be, a[t:t + 1]), dev(be, b[t:t + 1]), wa, wd, one_st,
                          dev(be, np.array([0, 1], np.int32)), dev(be, slots[s_:s_ + 1]), dev(be, pos[t:t + 1]), heads)
            steps[t] = be.download(one_out)[0]
    got_out, got_st = results[1]
    if kernel_backend[0] == "cpu":
        np.testing.assert_array_equal(got_out, steps)
        np.testing.assert_array_equal(got_st, be.download(one_st))
    else:
        close(got_out, steps, 1e-5)
        close(got_st, be.download(one_st), 1e-5)
    close(got_out, results[0][0], 1e-4)
    close(got_st, results[0][1], 1e-4)


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 33, 70])
@pytest.mark.parametrize("heads", [(1, 1, 8, 8, 1), (2, 6, 16, 12, 3), (2, 6, 16, 12, 1), (3, 3, 32, 20, 1)],
                         ids=lambda h: "x".join(map(str, h)))
def test_chunked_delta_rule_is_the_recurrence(heads, n, rng):
    """The reference's chunked form (chunks of 16; lengths that do not divide by it, key heads
    repeating to value heads) against its token-by-token recurrence, outputs and final state."""
    starts, pos, slots, qkv, a, b, a_neg, dt, state = delta_case(heads, [n], [0], rng)
    q, k, v, g, beta = ref_backend.delta_inputs(qkv, a, b, a_neg, dt, heads)
    S0 = state[0].copy()
    S1, S2 = S0.copy(), S0.copy()
    o1 = ref_backend.delta_rule_recurrent(q, k, v, g, beta, S1)
    o2 = ref_backend.delta_rule_chunked(q, k, v, g, beta, S2, 16)
    close(o2, o1, 1e-5)
    close(S2, S1, 1e-5)
    assert np.abs(o1).max() > 1e-3                       # a non-trivial case


def test_tiled_value_heads_are_grouped_heads_reordered(rng):
    """llama.cpp's tiled value-head order (group 1: value head j * Hk + k reads key head k) is the grouped
    order (value head k * r + j) with the value heads' inputs, state and outputs permuted alike."""
    ref = create("reference")
    Hk, Hv, dk, dv = 2, 6, 8, 4
    r = Hv // Hk
    starts, pos, slots, qkv, a, b, a_neg, dt, state = delta_case((Hk, Hv, dk, dv, r), [9], [3], rng)
    perm = np.arange(Hv).reshape(Hk, r).T.reshape(-1)      # tiled head i holds grouped head perm[i]
    vq = qkv[:, 2 * Hk * dk:].reshape(-1, Hv, dv)
    tq = np.concatenate([qkv[:, :2 * Hk * dk], vq[:, perm].reshape(len(qkv), -1)], axis=1)
    outs = []
    for heads, x, aa, bb, an, d, st in (((Hk, Hv, dk, dv, r), qkv, a, b, a_neg, dt, state.copy()),
                                        ((Hk, Hv, dk, dv, 1), tq, a[:, perm], b[:, perm], a_neg[perm], dt[perm],
                                         state[:, perm].copy())):
        out = np.zeros((9, Hv * dv), np.float32)
        ref.delta_rule(out, x, aa, bb, ref.upload(an), ref.upload(d), st, starts, slots, pos, heads)
        outs.append((out.reshape(9, Hv, dv), st))
    close(outs[1][0], outs[0][0][:, perm], 1e-6)
    close(outs[1][1], outs[0][1][:, perm], 1e-6)


def test_delta_rule_pieces_equal_the_whole(rng):
    """One sequence's 40 tokens as one prefill, as pieces of 7 / 1 / 32, or token by token: the same
    outputs and state (the state carries across steps)."""
    ref = create("reference")
    heads = (2, 4, 16, 8, 2)
    _, _, _, qkv, a, b, a_neg, dt, state = delta_case(heads, [40], [0], rng)
    wa, wd = ref.upload(a_neg), ref.upload(dt)
    results = []
    for cuts in ([40], [7, 1, 32], [1] * 40):
        st = state.copy()
        out = np.zeros((40, heads[1] * heads[3]), np.float32)
        p = 0
        for n in cuts:
            ref.delta_rule(out[p:p + n], qkv[p:p + n], a[p:p + n], b[p:p + n], wa, wd, st,
                           np.array([0, n], np.int32), np.array([1], np.int32), np.arange(p, p + n, dtype=np.int32),
                           heads)
            p += n
        results.append((out, st[1].copy()))
    for out, s in results[1:]:
        close(out, results[0][0], 1e-5)
        close(s, results[0][1], 1e-5)


@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (70, 130)])
def test_gate_mul(kernel_backend, shape, rng):
    ref, be = backend(kernel_backend)
    x = rng.standard_normal(shape).astype(np.float32)
    g = (3 * rng.standard_normal(shape)).astype(np.float32)
    for act in ("silu", "sigmoid", "none"):
        want = x * {"silu": g / (1 + np.exp(-g)), "sigmoid": 1 / (1 + np.exp(-g)), "none": g}[act]
        out = be.alloc(shape)
        be.gate_mul(out, dev(be, x), dev(be, g), act)
        close(be.download(out), want, 1e-6)
        xb = dev(be, x)                                  # in place
        be.gate_mul(xb, xb, dev(be, g), act)
        close(be.download(xb), want, 1e-6)
        r = ref.alloc(shape)
        ref.gate_mul(r, x, g, act)
        close(r, want, 1e-6)


# (nh, P, G, N): heads of P dims, G groups of B and C, a state of N (Granite 4.0-H: 1 group)
SSM_HEADS = [(2, 4, 1, 8), (4, 6, 2, 5), (3, 16, 3, 32), (1, 8, 1, 128)]


def ssm_case(heads, lengths, at, rng):
    nh, P, G, N = heads
    starts, pos = step(lengths, at)
    T, S = int(starts[-1]), len(lengths)
    nslots = S + 1
    slots = rng.permutation(nslots)[:S].astype(np.int32)
    xbc = rng.standard_normal((T, nh * P + 2 * G * N)).astype(np.float32)
    dt = (2 * rng.standard_normal((T, nh))).astype(np.float32)
    dt[0, 0] = 25.0                                       # softplus past its threshold
    a_neg = -np.exp(rng.uniform(-2, 1.5, nh)).astype(np.float32)
    d_skip, dt_bias = rng.standard_normal(nh).astype(np.float32), rng.standard_normal(nh).astype(np.float32)
    state = (0.3 * rng.standard_normal((nslots, nh, P, N))).astype(np.float32)
    return starts, pos, slots, xbc, dt, a_neg, d_skip, dt_bias, state


@pytest.mark.parametrize("lengths,at", STEPS)
@pytest.mark.parametrize("heads", SSM_HEADS, ids=lambda h: "x".join(map(str, h)))
def test_ssm_scan(kernel_backend, heads, lengths, at, rng):
    """Mamba-2's scan (Granite 4.0-H) on every backend against the reference: sequences from position 0
    (a garbage slot never read), continued ones, decode tokens; outputs and the states left behind."""
    ref, be = backend(kernel_backend)
    starts, pos, slots, xbc, dt, a_neg, d_skip, dt_bias, state = ssm_case(heads, lengths, at, rng)
    nh, P = heads[:2]
    T = int(starts[-1])
    results = []
    for b in (ref, be):
        out, st = b.alloc((T, nh * P)), dev(b, state)
        b.ssm_scan(out, dev(b, xbc), dev(b, dt), b.upload(a_neg), b.upload(d_skip), b.upload(dt_bias), st,
                   dev(b, starts), dev(b, slots), dev(b, pos), heads)
        results.append((b.download(out), b.download(st)))
    close(results[1][0], results[0][0], 1e-4)
    close(results[1][1], results[0][1], 1e-4)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("heads", SSM_HEADS[:3], ids=lambda h: "x".join(map(str, h)))
def test_chunked_ssm_is_the_recurrence(heads, n, rng):
    """The reference's chunked (SSD) scan against its token-by-token recurrence and against a plain NumPy
    loop of the definition in float64, on lengths that do not divide the chunk (16), from a non-zero state."""
    from colibri_edge.backends.reference.backend import ssm_chunked, ssm_inputs, ssm_recurrent
    starts, pos, slots, xbc, dt, a_neg, d_skip, dt_bias, state = ssm_case(heads, [n], [3], rng)
    x, B, C, d, la = ssm_inputs(xbc, dt, a_neg, dt_bias, heads)
    S1, S2 = state[0].copy(), state[0].copy()
    y1 = ssm_recurrent(x, B, C, d, la, d_skip, S1)
    y2 = ssm_chunked(x, B, C, d, la, d_skip, S2, 16)
    close(y2, y1, 1e-4)
    close(S2, S1, 1e-4)
    S = state[0].astype(np.float64)
    for t in range(n):                                    # the definition, one head dim at a time
        for h in range(heads[0]):
            dv = float(d[t, h])
            S[h] = np.exp(dv * float(a_neg[h])) * S[h] + dv * np.outer(x[t, h], B[t, h])
            np.testing.assert_allclose(y1[t, h], S[h] @ C[t, h] + d_skip[h] * x[t, h], rtol=2e-4, atol=2e-4)
