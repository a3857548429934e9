"""Every backend's kernels against the NumPy reference: every op, every weight type the backend
declares (int8 included), in every variant of conftest.KERNEL_VARIANTS (threads, queues, streams,
cuBLAS on/off), on odd shapes (not multiples of any work-group, warp or SIMD width), one token and
many, shapes that reach each GEMM path (skinny / tiled / cuBLAS on CUDA, GEMV / blocked elsewhere),
top-k 1 to 8, up to 300 experts."""
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_edge.backends import create
from colibri_edge.backends.base import FFN, plan_buffers
from colibri_edge.model.dtypes import STORAGE, block_of, narrow, widen
from colibri_edge.backends import routing
from colibri_edge.model.quant import act_block, fake_quantized_activations
from helpers import backend_pair as backend, dev, kernel_close as close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (T, K, N): GEMV, blocks of 4, odd sizes, K past one shared-memory chunk, T > 32 (tiled / cuBLAS)
MATMUL_SHAPES = [(1, 37, 29), (7, 64, 33), (33, 19, 130), (8, 64, 40), (32, 130, 70), (5, 1100, 20),
                 (3, 1101, 9), (100, 19, 130), (70, 1030, 17)]
# (T, k, E, H, I): decode steps, odd sizes, one expert taking every token, >= 32 rows per expert
# (tiled), assignments past one align chunk over many experts
MOE_SHAPES = [(1, 1, 7, 29, 23), (1, 2, 7, 29, 23), (13, 3, 7, 29, 23), (13, 4, 7, 29, 23),
              (1, 8, 128, 64, 48), (3, 2, 8, 33, 17), (2, 2, 4, 600, 520), (300, 2, 4, 40, 24),
              (1100, 2, 300, 16, 10)]
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 3e-3, "int8": 1e-5}   # block formats: 1e-5 (same
# stored weights on both sides: only the order of float32 sums differs)


def stored(w32, wd):
    """float32 [rows, cols] -> (stored array, row scales or None, logical shape) in weight type wd."""
    from helpers import stored_weights
    q, sc = stored_weights(w32, wd)
    return q, sc, w32.shape


def upload(be, st, wd):
    return be.upload(st[0], wd, scales=st[1], shape=st[2])


def fit(wd, n):
    """n, rounded up to a whole number of the format's blocks (block formats need whole blocks)."""
    b = block_of(wd)
    return -(-n // b) * b


def int8_path(be, wd):
    """Does `be` run this block-format matmul with int8 activations (the cpu backend's default, for
    every row count)? Then the reference runs on the activations as that path quantises them
    (quant.py's emulation)."""
    return getattr(be, "int8_activations", False) and block_of(wd) > 1


def as_seen(be, wd, x):
    return fake_quantized_activations(x, act_block(wd)) if int8_path(be, wd) else x


def plan_bufs(be, A, E):
    return {n: be.alloc(s, d) for n, (s, d) in plan_buffers(A, E).items()}


@pytest.mark.parametrize("T,K,N", MATMUL_SHAPES)
def test_matmul(kernel_backend, T, K, N, rng):
    ref, be = backend(kernel_backend)
    bias = rng.standard_normal(N).astype(np.float32)
    cublas16 = be.name == "cuda" and be.use_cublas and T > 32
    for wd in be.weight_dtypes:
        Kw = fit(wd, K)
        x = rng.standard_normal((T, Kw)).astype(np.float32)
        st = stored(rng.standard_normal((N, Kw)).astype(np.float32), wd)
        for b in (None, bias):
            want = np.zeros((T, N), np.float32)
            ref.matmul(want, as_seen(be, wd, x), upload(ref, st, wd), None if b is None else ref.upload(b))
            out = be.alloc((T, N))
            be.matmul(out, dev(be, x), upload(be, st, wd), None if b is None else be.upload(b))
            close(be.download(out), want, 3e-3 if cublas16 and wd == "float16" else TOL.get(wd, 1e-5))


@pytest.mark.parametrize("T", [1, 5, 70])
def test_embed_rmsnorm_add(kernel_backend, T, rng):
    ref, be = backend(kernel_backend)
    V, H = 53, 45
    ids = rng.integers(0, V, T).astype(np.int32)
    for wd in be.weight_dtypes:
        st = stored(rng.standard_normal((V, fit(wd, H))).astype(np.float32), wd)
        want = np.zeros((T, fit(wd, H)), np.float32)
        ref.embed(want, upload(ref, st, wd), ids)
        out = be.alloc((T, fit(wd, H)))
        be.embed(out, upload(be, st, wd), dev(be, ids))
        close(be.download(out), want, 1e-6)
    x = rng.standard_normal((T, H)).astype(np.float32) * 3
    g = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    want = np.zeros_like(x)
    ref.rmsnorm(want, x, ref.upload(g), 1e-6)
    out = be.alloc((T, H))
    be.rmsnorm(out, dev(be, x), be.upload(g), 1e-6)
    close(be.download(out), want)
    xb = dev(be, x)                       # in place, as the scheduler runs q/k norms
    be.rmsnorm(xb, xb, be.upload(g), 1e-6)
    close(be.download(xb), want)
    rows = dev(be, x)                     # a gather from a plain float32 buffer (the logit rows)
    sel = be.alloc((3, H))
    be.embed(sel, rows, dev(be, np.array([T - 1, 0, T - 1], np.int32)))
    np.testing.assert_array_equal(be.download(sel), x[[T - 1, 0, T - 1]])
    y = rng.standard_normal((T, H)).astype(np.float32)
    gate = rng.standard_normal((T, 1)).astype(np.float32)
    for gt in (None, gate):
        want = np.zeros_like(x)
        ref.add(want, x, y, gate=gt)
        out = be.alloc((T, H))
        be.add(out, dev(be, x), dev(be, y), gate=None if gt is None else dev(be, gt))
        close(be.download(out), want)


@pytest.mark.parametrize("wd", ["float16", "bfloat16"])
def test_widening_is_exact_for_every_bit_pattern(kernel_backend, wd):
    """The in-kernel widening (fpext half / vload_half / cvt, bf16 shift) equals dtypes.widen on all
    65536 patterns: zeros, subnormals, infinities and NaNs included."""
    _, be = backend(kernel_backend)
    if wd not in be.weight_dtypes:
        pytest.skip(f"{be.name} does not declare {wd}")
    raw = np.arange(65536, dtype=np.uint16).view(STORAGE[wd]).reshape(256, 256)
    out = be.alloc((256, 256))
    be.embed(out, be.upload(raw, wd), dev(be, np.arange(256, dtype=np.int32)))
    got, want = be.download(out), widen(raw, wd)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("T,heads,D,theta", [(1, 3, 8, 1e4), (9, 5, 24, 1e4), (40, 2, 64, 1e4), (3, 8, 256, 1e6)])
def test_rope(kernel_backend, T, heads, D, theta, rng):
    ref, be = backend(kernel_backend)
    x = rng.standard_normal((T, heads, D)).astype(np.float32)
    pos = rng.integers(0, 512, T).astype(np.int32)
    want = x.copy()
    ref.rope(want, want, pos, theta)
    xb = dev(be, x)
    be.rope(xb, xb, dev(be, pos), theta)
    close(be.download(xb), want, 1e-4)


def test_rope_table(kernel_backend, rng):
    """A scaled rope's frequency table (YaRN, colibri_edge.runtime.rope) instead of theta's."""
    from colibri_edge.runtime.rope import inv_freq
    ref, be = backend(kernel_backend)
    D = 24
    table, _ = inv_freq(150000.0, D, dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32))
    assert not np.allclose(table, inv_freq(150000.0, D)[0])
    x = rng.standard_normal((5, 3, D)).astype(np.float32)
    pos = rng.integers(0, 512, 5).astype(np.int32)
    want = x.copy()
    ref.rope(want, want, pos, 150000.0, table)
    xb = dev(be, x)
    be.rope(xb, xb, dev(be, pos), 150000.0, table)
    close(be.download(xb), want, 1e-4)
    with_theta = x.copy()
    ref.rope(with_theta, with_theta, pos, 150000.0)
    assert np.abs(with_theta - want).max() > 1e-2      # the table is what was used


def fill_paged_cache(ref, be, tables, seq, pos, block, nslots, Hkv, D, rng):
    """Both backends' caches (K, V) holding the same random history for every position up to each
    token's, through each sequence's block table. -> ((rK, rV), (bK, bV))."""
    rK, rV = np.zeros((nslots, Hkv, D), np.float32), np.zeros((nslots, Hkv, D), np.float32)
    bK, bV = be.alloc((nslots, Hkv, D)), be.alloc((nslots, Hkv, D))
    for s in np.unique(seq):
        n = int(pos[seq == s].max()) + 1
        j = np.arange(n)
        slots = (tables[s, j // block] * block + j % block).astype(np.int32)
        k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
        ref.kv_write(rK, rV, k, v, slots)
        be.kv_write(bK, bV, dev(be, k), dev(be, v), dev(be, slots))
    return (rK, rV), (bK, bV)


@pytest.mark.parametrize("Hq,Hkv,D,block,nslots", [(6, 2, 20, 1, 128), (6, 2, 20, 7, 128), (6, 2, 20, 16, 128),
                                                   (8, 2, 128, 16, 400), (4, 4, 256, 5, 400), (3, 1, 6, 1, 400)])
def test_paged_attention(kernel_backend, Hq, Hkv, D, block, nslots, rng):
    """Two sequences with scattered block tables: a prefill chunk of one and decode of the other,
    up to the tables' last position."""
    ref, be = backend(kernel_backend)
    nblocks = nslots // block
    perm = rng.permutation(nblocks).astype(np.int32)
    maxb = nblocks // 2
    tables = np.stack([perm[:maxb], perm[maxb:2 * maxb]]).astype(np.int32)
    last = maxb * block - 1
    seq = np.array([0, 0, 0, 0, 0, 1], np.int32)
    pos = np.array([last - 4, last - 3, last - 2, last - 1, last, min(29, last)], np.int32)
    T = len(seq)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    (rK, rV), (bK, bV) = fill_paged_cache(ref, be, tables, seq, pos, block, nslots, Hkv, D, rng)
    want = np.zeros_like(q)
    ref.paged_attention(want, q, rK, rV, tables, seq, pos, block, D ** -0.5)
    out = be.alloc((T, Hq, D))
    be.paged_attention(out, dev(be, q), bK, bV, dev(be, tables), dev(be, seq), dev(be, pos), block, D ** -0.5)
    close(be.download(out), want, 1e-5)


@pytest.mark.parametrize("window,block,sinks", [(5, 7, True), (1, 1, False), (16, 4, True), (300, 16, True),
                                                (0, 5, True), (-5, 7, False), (-16, 4, True), (-3, 1, False)])
def test_paged_attention_window_and_sinks(kernel_backend, window, block, sinks, rng):
    """A sliding window (positions p-W+1..p) with the blocks below every token's window returned
    (their table entries -1: a kernel that read one would fail), and per-head sink logits; a negative
    window is Llama 4's chunked attention (positions p - p mod C..p, C = -window), each token equal to
    the reference's sliding window of its own p mod C + 1 positions."""
    ref, be = backend(kernel_backend)
    Hq, Hkv, D, nslots = 6, 2, 20, 400
    nblocks = nslots // block
    perm = rng.permutation(nblocks).astype(np.int32)
    maxb = nblocks // 2
    tables = np.stack([perm[:maxb], perm[maxb:2 * maxb]]).astype(np.int32)
    last = maxb * block - 1
    seq = np.array([0, 0, 0, 0, 1], np.int32)
    pos = np.array([last - 3, last - 2, last - 1, last, min(29, last)], np.int32)
    T = len(seq)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    (rK, rV), (bK, bV) = fill_paged_cache(ref, be, tables, seq, pos, block, nslots, Hkv, D, rng)
    whole = tables.copy()
    if window:
        for s in (0, 1):
            p0 = int(pos[seq == s].min())
            lo = max(0, p0 - window + 1) if window > 0 else p0 - p0 % -window
            tables[s, :lo // block] = -1
    hs = (2.0 * rng.standard_normal(Hq)).astype(np.float32)
    sk = be.upload(hs) if sinks else None
    want = np.zeros_like(q)
    ref.paged_attention(want, q, rK, rV, tables, seq, pos, block, D ** -0.5, window, ref.upload(hs) if sinks else None)
    out = be.alloc((T, Hq, D))
    be.paged_attention(out, dev(be, q), bK, bV, dev(be, tables), dev(be, seq), dev(be, pos), block, D ** -0.5,
                       window, sk)
    close(be.download(out), want, 1e-5)
    full = np.zeros_like(q)
    ref.paged_attention(full, q, rK, rV, whole, seq, pos, block, D ** -0.5)
    if window and window < 30 or sinks:
        assert np.abs(full - want).max() > 1e-3         # the window / the sinks changed the result
    if window < 0:                                      # a chunk is the window back to its start
        for t in range(T):
            one = np.zeros_like(q[t:t + 1])
            ref.paged_attention(one, q[t:t + 1], rK, rV, whole, seq[t:t + 1], pos[t:t + 1], block, D ** -0.5,
                                int(pos[t]) % -window + 1, ref.upload(hs) if sinks else None)
            close(want[t:t + 1], one, 1e-6)


@pytest.mark.parametrize("T,N", [(1, 24), (7, 300), (70, 33)])
def test_pos_scale(kernel_backend, T, N, rng):
    """Llama 4's attention temperature: each row times log1p(floor((p + 1) / floor_scale)) * attn_scale + 1,
    against the reference and against transformers' own formula (in torch), in place too; positions
    across several floor steps."""
    import torch
    ref, be = backend(kernel_backend)
    x = rng.standard_normal((T, N)).astype(np.float32)
    pos = rng.integers(0, 5000, T).astype(np.int32)
    want = np.zeros_like(x)
    ref.pos_scale(want, x, pos, 8.0, 0.1)
    f = torch.log1p(torch.floor((torch.from_numpy(pos).float() + 1.0) / 8)) * 0.1 + 1.0
    close(want, (torch.from_numpy(x) * f[:, None]).numpy(), 1e-6)
    out = be.alloc((T, N))
    be.pos_scale(out, dev(be, x), dev(be, pos), 8.0, 0.1)
    close(be.download(out), want, 1e-6)
    xb = dev(be, x)
    be.pos_scale(xb, xb, dev(be, pos), 8.0, 0.1)
    close(be.download(xb), want, 1e-6)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_ties_and_many_experts(kernel_backend, normalize, rng):
    """Exact ties go to the lower expert id, within a SIMD lane or warp and across them."""
    ref, be = backend(kernel_backend)
    for T, E, k in ((13, 7, 4), (5, 300, 8)):
        logits = rng.standard_normal((T, E)).astype(np.float32)
        logits[0, 1] = logits[0, 4] = 9.0
        if E > 40:
            logits[1, [7, 39, 40, 299]] = 6.0
        for mode, kk in (("topk", k), ("gated", E)) if E < 40 else (("topk", k),):
            rid, rw = np.zeros((T, kk), np.int32), np.zeros((T, kk), np.float32)
            ref.route(rid, rw, logits, kk, mode, normalize)
            bid, bw = be.alloc((T, kk), np.int32), be.alloc((T, kk))
            be.route(bid, bw, dev(be, logits), kk, mode, normalize)
            np.testing.assert_array_equal(be.download(bid), rid)
            close(be.download(bw), rw, 1e-6)
            if mode == "topk":
                assert rid[0, :2].tolist() == [1, 4] and (E < 40 or rid[1, :4].tolist() == [7, 39, 40, 299])


@pytest.mark.parametrize("T,D", [(1, 45), (5, 300), (70, 64)])
def test_layernorm(kernel_backend, T, D, rng):
    """LayerNorm with bias (Phi-3.5-MoE) against the reference and against torch's meaning (mean and biased
    variance), in place too; rows off zero mean so that the centring matters."""
    ref, be = backend(kernel_backend)
    x = (rng.standard_normal((T, D)) * 3 + 2).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    b = (0.3 * rng.standard_normal(D)).astype(np.float32)
    want = np.zeros_like(x)
    ref.layernorm(want, x, ref.upload(g), ref.upload(b), 1e-5)
    x64 = x.astype(np.float64)
    c = x64 - x64.mean(-1, keepdims=True)
    close(want, c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + b, 1e-5)
    out = be.alloc((T, D))
    be.layernorm(out, dev(be, x), be.upload(g), be.upload(b), 1e-5)
    close(be.download(out), want, 1e-5)
    xb = dev(be, x)
    be.layernorm(xb, xb, be.upload(g), be.upload(b), 1e-5)
    close(be.download(xb), want, 1e-5)


def test_sparsemixer(kernel_backend, rng):
    """Phi-3.5-MoE's inference router against the reference, and the reference against transformers'
    sparsemixer itself (training off): scores spread so that some experts fall within the 2 jitter band
    and some outside, exact ties at the maximum (the lower id first), E of 2, 16 and 37."""
    import torch
    from transformers.models.phimoe.modeling_phimoe import sparsemixer
    ref, be = backend(kernel_backend)
    for T, E in ((9, 16), (4, 2), (33, 37)):
        logits = (rng.standard_normal((T, E)) * rng.choice([0.01, 0.5, 3.0], size=(T, 1))).astype(np.float32)
        logits[0, 3 % E] = logits[0, 1] = np.abs(logits[0]).max() + 1     # a tie at the top
        if T > 4:
            logits[1] = 0.0                                                # 0 / 0: every expert kept
        for jitter in (0.01, 0.3):
            rid, rw = np.zeros((T, 2), np.int32), np.zeros((T, 2), np.float32)
            ref.sparsemixer(rid, rw, logits, jitter)
            w, ids = sparsemixer(torch.from_numpy(logits), jitter_eps=jitter, training=False)
            np.testing.assert_array_equal(rid, ids.numpy())
            close(rw, w.numpy(), 1e-6)
            bid, bw = be.alloc((T, 2), np.int32), be.alloc((T, 2))
            be.sparsemixer(bid, bw, dev(be, logits), jitter)
            np.testing.assert_array_equal(be.download(bid), rid)
            close(be.download(bw), rw, 1e-6)
        assert rid[0, :2].tolist() == [1, 3 % E] or E == 2


@pytest.mark.parametrize("norm_min", [0.0, 1e-12, 1.5])
def test_route_choice_bias_and_norm_min(kernel_backend, norm_min, rng):
    """ERNIE-4.5's router: the choice by p + choice_bias, the weights p of the chosen, renormalised by
    max(sum, norm_min); a bias that reorders the experts, exact score ties to the lower id, E over a
    warp (300) and under one SIMD row (7)."""
    ref, be = backend(kernel_backend)
    for T, E, k in ((11, 7, 3), (4, 300, 8)):
        logits = rng.standard_normal((T, E)).astype(np.float32)
        bias = (0.5 * rng.standard_normal(E)).astype(np.float32)
        logits[0, 2] = logits[0, 5] = 7.0            # equal p and equal bias: an exact score tie
        bias[2] = bias[5] = 3.0                      # above every other p + bias
        rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
        ref.route(rid, rw, logits, k, "topk", True, ref.upload(bias), norm_min)
        bid, bw = be.alloc((T, k), np.int32), be.alloc((T, k))
        be.route(bid, bw, dev(be, logits), k, "topk", True, be.upload(bias), norm_min)
        np.testing.assert_array_equal(be.download(bid), rid)
        close(be.download(bw), rw, 1e-6)
        p = routing.softmax(logits)
        order = np.argsort(-(p + bias), axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(rid, order)                  # the choice is by p + bias ...
        w = np.take_along_axis(p, order, -1)                       # ... the weights are p
        np.testing.assert_allclose(rw, w / np.maximum(w.sum(-1, keepdims=True), norm_min), rtol=1e-6)
        assert rid[0, 0] == 2 and rid[0, 1] == 5
        plain = np.zeros((T, k), np.int32)
        ref.route(plain, np.zeros((T, k), np.float32), logits, k, "topk", True)
        assert (plain != rid).any(), "the bias changed no choice: the test proves nothing"


def test_align_worked_example(kernel_backend):
    """routing.align's docstring example, on the device: offsets, order, inverse, the counts and the
    per-expert tally added to."""
    _, be = backend(kernel_backend)
    offsets, order, inverse = routing.align(np.array([[2, 0], [0, 3], [2, 0]], np.int32), 4)
    assert offsets.tolist() == [0, 3, 3, 5, 6]
    assert order.tolist() == [1, 2, 5, 0, 4, 3]
    assert inverse.tolist() == [3, 0, 1, 5, 4, 2]
    tally = dev(be, np.array([10, 0, 0, 1], np.int32))
    plan = be.align(plan_bufs(be, 6, 4), dev(be, np.array([[2, 0], [0, 3], [2, 0]], np.int32)), 3, 4, 2, tally)
    assert be.download(plan.offsets).tolist() == [0, 3, 3, 5, 6]
    assert be.download(plan.order).tolist() == [1, 2, 5, 0, 4, 3]
    assert be.download(plan.inverse).tolist() == [3, 0, 1, 5, 4, 2]
    assert list(plan.experts_to_run()) == [0, 2, 3]
    assert be.download(tally).tolist() == [13, 0, 2, 2]


@pytest.mark.parametrize("T,k,E,H,I", MOE_SHAPES)
def test_route_align_ffn_combine(kernel_backend, T, k, E, H, I, rng):
    """The MoE layer as the scheduler runs it: route, align, grouped SwiGLU of the chosen experts,
    combine into the residual, for every weight type."""
    ref, be = backend(kernel_backend)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    ref.route(rid, rw, logits, k, "topk", True)
    bid, bw = be.alloc((T, k), np.int32), be.alloc((T, k))
    be.route(bid, bw, dev(be, logits), k, "topk", True)
    np.testing.assert_array_equal(be.download(bid), rid)
    rplan = ref.align(None, rid, T, E, k)
    for wd in be.weight_dtypes:
        opts = kernel_backend[1]
        variant = opts and "int8_activations" not in opts           # threads, queues, streams, cuBLAS
        if (T * E > 20000 or E > 16) and (wd not in ("float32", "float16", "q4_0", "q4_k") or
                                          wd in ("q4_0", "q4_k") and variant or
                                          wd == "q4_k" and T * E > 20000) or \
                H * I > 100000 and variant and wd not in ("float32", "float16", "bfloat16", "int8"):
            continue                 # the long plans and many experts once per kind of path, not per format
            #                          (the wide 600 x 520 experts: every block format in the default variant
            #                          and with float activations, not again in the others: 27 s a variant
            #                          on the CUDA emulator, for the 22 block formats)
            #                          (block formats not again in the variants of threads, queues, streams or
            #                          cuBLAS: those change nothing in how blocks are decoded); the long plan
            #                          not in q4_k, whose 256-wide super-blocks make its 300 experts 16 x 16
            #                          times larger (71 of the CUDA emulator's 107 s): q4_0 takes that plan
            #                          through the block path, and 128 experts take q4_k's
        Hw, Iw = fit(wd, H), fit(wd, I)
        mats = [[stored(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]), wd) for s in [(Iw, Hw), (Iw, Hw),
                                                                                              (Hw, Iw)]]
                for _ in range(E)]
        rex = [FFN(*(upload(ref, m, wd) for m in ms)) for ms in mats]
        bex = [FFN(*(upload(be, m, wd) for m in ms)) for ms in mats]
        x = rng.standard_normal((T, Hw)).astype(np.float32)
        bplan = be.align(plan_bufs(be, T * k, E), bid, T, E, k)
        np.testing.assert_array_equal(be.download(bplan.order), rplan.order)
        np.testing.assert_array_equal(be.download(bplan.inverse), rplan.inverse)
        np.testing.assert_array_equal(bplan.experts_to_run(), np.flatnonzero(rplan.counts))
        by, act = be.alloc((T * k, Hw)), be.alloc((T * k, Iw))
        be.grouped_ffn(by, dev(be, x), bex, bplan, act)
        y = np.zeros((T * k, Hw), np.float32)
        if int8_path(be, wd):
            y = ffn_as_seen(be, wd, x, mats, rplan, k, be.download(act))
        else:
            ref.grouped_ffn(y, x, rex, rplan, None)
        resid = rng.standard_normal((T, Hw)).astype(np.float32)
        want = resid.copy()
        ref.combine(want, y, rw, rplan)
        close(be.download(by), y, TOL.get(wd, 1e-5))
        out = dev(be, resid)
        be.combine(out, by, dev(be, rw), bplan)
        close(be.download(out), want, TOL.get(wd, 1e-5))


def ffn_as_seen(be, wd, x, mats, plan, k, act):
    """grouped_ffn in NumPy (float64) with each expert's inputs quantised to int8 as the int8 path
    quantises them. The gate/up activations are checked against the backend's (act: its scratch,
    [T*k, I] in plan order), and the down projection then takes the backend's own: an activation
    within float32 rounding of a quantisation step's midpoint may round either way, and at a few
    hundred rows one does."""
    y = np.zeros((len(plan.order), x.shape[1]))
    for e, (g, u, d) in enumerate(mats):
        a, b = int(plan.offsets[e]), int(plan.offsets[e + 1])
        if a == b:
            continue
        X = as_seen(be, wd, x[plan.order[a:b] // k])
        G, U, D = (widen(m[0], wd).astype(np.float64) for m in (g, u, d))
        h = X @ G.T
        h = (h / (1 + np.exp(-h)) * (X @ U.T)).astype(np.float32)
        close(act[a:b], h, 1e-5)
        y[a:b] = as_seen(be, wd, act[a:b]) @ D.T
    return y.astype(np.float32)


@pytest.mark.parametrize("gate_fmt,up_fmt", [("q4_k", "q6_k"), ("q4_k", "q8_0"), ("q8_0", "iq4_xs")])
def test_gate_and_up_of_different_formats(gate_fmt, up_fmt, rng):
    """An expert whose gate and up are stored in different formats (an unsloth-style mixed file): on the
    cpu backend's int8 path one quantised x serves both where their activation blocks agree (per 256
    for q4_k and q6_k), and where they differ (q4_k / iq4_xs per 256, q8_0 per 32) the pair takes float
    activations (the down projection its own int8 ones): each checked against NumPy on the stored
    weights with the activations as that path rounds them."""
    ref, be = backend(("cpu", {}))
    T, k, E, H, I = 6, 2, 3, 256, 256
    rid = np.stack([np.arange(T) % E, (np.arange(T) + 1) % E], axis=1).astype(np.int32)
    plan = ref.align(None, rid, T, E, k)
    fmts = (gate_fmt, up_fmt, "q8_0")
    mats = [[stored(rng.standard_normal(sh).astype(np.float32) / 16, f) for f, sh in zip(fmts, [(I, H), (I, H), (H, I)])]
            for _ in range(E)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    bex = [FFN(*(upload(be, m, f) for m, f in zip(ms, fmts))) for ms in mats]
    by, act = be.alloc((T * k, H)), be.alloc((T * k, I))
    be.grouped_ffn(by, dev(be, x), bex, be.align(plan_bufs(be, T * k, E), dev(be, rid),
                                                 T, E, k), act)
    got_act = be.download(act)
    shared = act_block(gate_fmt) == act_block(up_fmt)
    y = np.zeros((T * k, H))
    for e, ms in enumerate(mats):
        a, b = int(plan.offsets[e]), int(plan.offsets[e + 1])
        X = x[plan.order[a:b] // k]
        X = fake_quantized_activations(X, act_block(gate_fmt)).astype(np.float64) if shared else X.astype(np.float64)
        G, U, D = (widen(m[0], f).astype(np.float64) for m, f in zip(ms, fmts))
        h = X @ G.T
        close(got_act[a:b], h / (1 + np.exp(-h)) * (X @ U.T), 1e-5)
        y[a:b] = fake_quantized_activations(got_act[a:b], 32) @ D.T
    close(be.download(by), y, 1e-5)


def test_int8_activation_dots_are_exact(rng):
    """Where every value is dyadic (power-of-two scales, integer activations over 2^3), the int8
    path's float arithmetic is exact too, so the cpu backend (and opencl's int8 activations, integer
    dots by the portable IDOT4 on PoCL) must equal the emulation bit for bit:
    integer dots, the scales applied per block, the additive terms (q4_0/q5_0 offsets, q4_1/q5_1
    and K-quant mins), for 1 to 5 and 9 tokens (pairs, four-token tiles, and an odd last token beside the zero row), whole
    groups of 256 and tail blocks."""
    from helpers import backend_available
    int8_dots_exact(rng, [create("cpu")] + ([create("opencl", int8_activations=True)]
                                            if backend_available("opencl") else []))


# One format per branch of qir.dot8 and its callers: signed bytes (q8_0, with -128), unsigned
# nibbles with an offset (q4_0), K-quant mins (q4_k), per-16 multipliers (q6_k), per-16 mins and the
# activation sums (q2_k), a lookup table (iq4_xs, mxfp4: vpshufb), a lattice grid (iq2_xxs).
DOT_BRANCHES = ("q8_0", "q4_0", "q4_k", "q6_k", "q2_k", "iq4_xs", "mxfp4", "iq2_xxs")


def test_int8_dots_are_exact_in_the_avx2_variant_too(tmp_path):
    """On a host with VNNI the kernels take vpdpbusd (qir.INT8_DOT); the AVX2 variant (vpmaddubsw +
    vpmaddwd), which a bundle's kernels for a named AVX2 CPU use, must equal the same emulation bit
    for bit: the exactness test again in a process whose kernels are compiled for haswell (its own
    kernel cache), over one format per branch of the integer dot. (An AVX2-only host runs that
    variant in the test above; the ARM64 variants, sdot and generic, run bit for bit under qemu in
    toolchains/aarch64/check.py.)"""
    from colibri_edge.backends.cpu import qir
    if not qir.HAS_VNNI:
        pytest.skip(f"this host's int8 dots are {qir.INT8_DOT}: test_int8_activation_dots_are_exact ran them")
    code = ("import sys, numpy as np; sys.path.insert(0, 'tests'); import test_kernels as t; "
            "from colibri_edge.backends import create; from colibri_edge.backends.cpu import qir; "
            "assert qir.INT8_DOT.endswith('(AVX2)'), qir.INT8_DOT; "
            f"t.int8_dots_exact(np.random.default_rng(7), [create('cpu')], {DOT_BRANCHES!r}); print('exact')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="", COLIBRI_KERNEL_CACHE=str(tmp_path / "kc"))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stdout.split()[-1:] == ["exact"], p.stdout[-2000:] + p.stderr[-4000:]


def int8_dot_cases(rng, fmt):
    """Dyadic int8-path cases of one block format: (K, T, raw [13, row bytes], x [T, K], want [T, 13]),
    want the NumPy emulation's result, itself checked equal to the exact float64 product (so every
    variant of the integer dot must give it bit for bit). Power-of-two scales, integer activations
    over 2^3; K: whole groups of 256 and tail blocks; T: 1, 2, 5 and 9 tokens (9: the prefill tiles of a
    predecoded row quad, qkernels.PREDECODE)."""
    from colibri_edge.model import quant
    ref = create("reference")
    B, nb = quant.BLOCK[fmt]
    for K in ((256, 512) if B == 256 else (256, 96, 544) if B == 32 else (256, 192, 576)):
        N = 13
        raw = rng.integers(0, 256, (N, K // B, nb), dtype=np.uint8)
        scale_at = {"q6_k": [208], "q4_k": [0, 2], "q5_k": [0, 2], "q4_1": [0, 2], "q5_1": [0, 2], "q2_k": [80, 82],
                    "q3_k": [108], "tq2_0": [64], "tq1_0": [52]}.get(fmt, [0])
        for off in scale_at:
            if fmt == "mxfp4":
                raw[..., 0] = 125                             # 2^-3
            elif fmt == "nvfp4":
                raw[..., 0:4] = 0x30                          # UE4M3 2^-1, halved: 2^-2
            elif fmt == "iq1_m":                              # d's nibbles atop the four scales: 2^-6
                for at, nib in zip((49, 51, 53, 55), (0, 0, 4, 2)):
                    raw[..., at] = (raw[..., at] & 15) | (nib << 4)
            else:
                raw[..., off:off + 2] = np.frombuffer(np.float16(2.0 ** -6).tobytes(), np.uint8)
        raw = raw.reshape(N, -1)
        for T in (1, 2, 5, 9):
            x = rng.integers(-127, 128, (T, K)).astype(np.float32)
            x.reshape(T, -1, 32)[:, :, 0] = 127                  # dx = 127 / 127 * 2^-3 exactly
            x *= np.float32(2.0 ** -3)
            want = np.zeros((T, N), np.float32)
            xq = fake_quantized_activations(x, act_block(fmt))
            ref.matmul(want, xq, ref.upload(raw, fmt, shape=(N, K)))
            exact = xq.astype(np.float64) @ widen(raw, fmt).astype(np.float64).T
            assert np.array_equal(want, exact.astype(np.float32)), fmt
            yield K, T, raw, x, want


def int8_dots_exact(rng, bes, formats=None):
    from colibri_edge.model import quant
    for be, fmt in [(be, fmt) for be in bes for fmt in quant.BLOCK if fmt in be.weight_dtypes
                    and (formats is None or fmt in formats)]:
        for K, T, raw, x, want in int8_dot_cases(rng, fmt):
            N = raw.shape[0]
            out = be.alloc((T, N))
            be.matmul(out, be.to_device(x, "float32"), be.upload(raw, fmt, shape=(N, K)))
            np.testing.assert_array_equal(be.download(out), want, err_msg=f"{be.name} {fmt} K={K} T={T}")


def test_results_do_not_depend_on_queues(rng):
    """Several queues / streams split a layer's experts: the results are bit-identical to one."""
    from helpers import backend_available
    from colibri_edge.backends import backend_class
    ran = 0
    for name in ("opencl", "cuda"):
        if not backend_available(name)[0] or "num_streams" not in backend_class(name).OPTIONS:
            continue
        T, E, k, H, I = 21, 9, 3, 37, 29
        logits = rng.standard_normal((T, E)).astype(np.float32)
        x = rng.standard_normal((T, H)).astype(np.float32)
        mats = [[rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in [(I, H), (I, H), (H, I)]]
                for _ in range(E)]
        outs = []
        for n in (1, 2, 4):
            be = create(name, num_streams=n)
            ex = [FFN(*(be.upload(m) for m in ms)) for ms in mats]
            ids, w = be.alloc((T, k), np.int32), be.alloc((T, k))
            be.route(ids, w, dev(be, logits), k, "topk", True)
            plan = be.align(plan_bufs(be, T * k, E), ids, T, E, k)
            y = be.alloc((T * k, H))
            be.grouped_ffn(y, dev(be, x), ex, plan, be.alloc((T * k, I)))
            out = dev(be, x)
            be.combine(out, y, w, plan)
            outs.append(be.download(out))
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        ran += 1
    if not ran:
        pytest.skip("no backend with queues or streams here")


@pytest.mark.parametrize("T", [1, 6, 70])
def test_scale_and_softcap(kernel_backend, T, rng):
    """scale: out = factor x (Gemma's embedding scale and layer scalar), in place too; with a cap, the
    soft-capped cap tanh(factor x / cap) (final logit soft-capping), values far past the cap saturating;
    factor 0 zeroes a finite buffer."""
    ref, be = backend(kernel_backend)
    N = 37
    x = (rng.standard_normal((T, N)) * 20).astype(np.float32)
    x[0, :3] = [500.0, -500.0, 0.0]
    for factor, cap in ((1.7, 0.0), (0.5, 0.0), (1.0, 30.0), (2.5, 7.0)):
        want = np.zeros_like(x)
        ref.scale(want, x, factor, cap)
        if cap:
            np.testing.assert_allclose(want, cap * np.tanh(factor * x.astype(np.float64) / cap), rtol=1e-5, atol=1e-5)
            assert np.abs(want).max() <= cap and np.abs(want[0, :2]).min() > 0.999 * cap
        else:
            np.testing.assert_array_equal(want, x * np.float32(factor))
        out = be.alloc((T, N))
        be.scale(out, dev(be, x), factor, cap)
        close(be.download(out), want, 1e-6)
        xb = dev(be, x)
        be.scale(xb, xb, factor, cap)
        close(be.download(xb), want, 1e-6)
    xb = dev(be, x)
    be.scale(xb, xb, 0.0)
    assert not be.download(xb).any()


def test_route_expert_scale(kernel_backend, rng):
    """Gemma 4's router: softmax, top-k, renormalised, then each weight times its expert's scale
    (per_expert_scale); the choice is unchanged by the scale. E under a SIMD row and over a warp."""
    ref, be = backend(kernel_backend)
    for T, E, k in ((9, 7, 2), (5, 128, 8), (3, 300, 1)):
        logits = rng.standard_normal((T, E)).astype(np.float32)
        es = (0.5 + rng.random(E)).astype(np.float32)
        rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
        ref.route(rid, rw, logits, k, "topk", True, None, 0.0, ref.upload(es))
        pid, pw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
        ref.route(pid, pw, logits, k, "topk", True)
        np.testing.assert_array_equal(rid, pid)
        np.testing.assert_allclose(rw, pw * es[pid], rtol=1e-6)
        bid, bw = be.alloc((T, k), np.int32), be.alloc((T, k))
        be.route(bid, bw, dev(be, logits), k, "topk", True, None, 0.0, be.upload(es))
        np.testing.assert_array_equal(be.download(bid), rid)
        close(be.download(bw), rw, 1e-6)


@pytest.mark.parametrize("T,k,E,H,I", [(1, 1, 5, 29, 23), (1, 2, 7, 64, 48), (13, 3, 7, 29, 23), (70, 2, 4, 40, 24)])
def test_grouped_ffn_gelu_tanh(kernel_backend, T, k, E, H, I, rng):
    """GeGLU experts (Gemma: gelu_tanh(gate) * up) through grouped_ffn for every weight type, with and
    without expert biases, and the 1-expert plan a dense MLP runs through."""
    from colibri_edge.backends.base import Act
    ref, be = backend(kernel_backend)
    assert "gelu_tanh" in be.ffn_activations
    logits = rng.standard_normal((T, E)).astype(np.float32)
    rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    ref.route(rid, rw, logits, k, "topk", True)
    rplan = ref.align(None, rid, T, E, k)
    for wd in be.weight_dtypes:
        if kernel_backend[1] and wd not in ("float32", "float16", "q8_0", "q4_k", "mxfp4"):
            continue             # the option variants (threads, queues, streams, cuBLAS, float32 activations)
            #                      change no block decoder: one 32-block, one K-quant and MXFP4 there
        Hw, Iw = fit(wd, H), fit(wd, I)
        mats = [[stored(2 * rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]), wd)
                 for s in [(Iw, Hw), (Iw, Hw), (Hw, Iw)]] for _ in range(E)]
        x = rng.standard_normal((T, Hw)).astype(np.float32)
        biases = [rng.standard_normal(s).astype(np.float32) for s in [(E, Iw), (E, Iw), (E, Hw)]]
        for with_bias in (False, True):
            ra, ba = (Act("gelu_tanh", 0.0, 0.0, *([b.upload(v) for v in biases] if with_bias else [])) for b in (ref, be))
            rex = [FFN(*(upload(ref, m, wd) for m in ms)) for ms in mats]
            bex = [FFN(*(upload(be, m, wd) for m in ms)) for ms in mats]
            y = np.zeros((T * k, Hw), np.float32)
            ref.grouped_ffn(y, as_seen(be, wd, x), rex, rplan, np.zeros((T * k, Iw), np.float32), ra)
            bplan = be.align(plan_bufs(be, T * k, E), dev(be, rid), T, E, k)
            by, act = be.alloc((T * k, Hw)), be.alloc((T * k, Iw))
            be.grouped_ffn(by, dev(be, x), bex, bplan, act, ba)
            # int8 activations quantise x (emulated) and the act (not: per 256 its steps are up to 8x coarser)
            tol = (2e-2 if act_block(wd) == 32 else 4e-2) if int8_path(be, wd) else TOL.get(wd, 1e-5)
            close(be.download(by), y, tol)
        # the dense MLP's plan: every token to expert 0
        zeros = np.zeros((T, 1), np.int32)
        rp = ref.align(None, zeros, T, 1, 1)
        y = np.zeros((T, Hw), np.float32)
        ref.grouped_ffn(y, as_seen(be, wd, x), rex[:1], rp, np.zeros((T, Iw), np.float32), Act("gelu_tanh"))
        bp = be.align(plan_bufs(be, T, 1), dev(be, zeros), T, 1, 1)
        by, act = be.alloc((T, Hw)), be.alloc((T, Iw))
        be.grouped_ffn(by, dev(be, x), bex[:1], bp, act, Act("gelu_tanh"))
        close(be.download(by), y, (2e-2 if act_block(wd) == 32 else 4e-2) if int8_path(be, wd) else TOL.get(wd, 1e-5))


HEAD_WEIGHTS = ("float32", "float16", "bfloat16")


@pytest.mark.parametrize("T,G,N,K", [(1, 3, 37, 29), (7, 16, 64, 20), (33, 5, 130, 19), (2, 16, 512, 128),
                                     (3, 4, 96, 512)])
def test_head_matmul(kernel_backend, T, G, N, K, rng):
    """Latent attention's per-head up-projections: out[t,g] = w[g] @ x[t,g] for every float weight
    type; one token (decode) and many, odd sizes, the absorbed key (K = qk_nope) and value (K =
    kv_lora_rank) shapes of DeepSeek-V2-Lite."""
    ref, be = backend(kernel_backend)
    x = rng.standard_normal((T, G, K)).astype(np.float32)
    w32 = (rng.standard_normal((G, N, K)) / np.sqrt(K)).astype(np.float32)
    for wd in HEAD_WEIGHTS:
        st = narrow(w32, wd)
        want = np.zeros((T, G, N), np.float32)
        ref.head_matmul(want, x, ref.upload(st, wd))
        np.testing.assert_allclose(want, np.einsum("tgk,gnk->tgn", x, widen(st, wd)), rtol=1e-4, atol=1e-4)
        out = be.alloc((T, G, N))
        be.head_matmul(out, dev(be, x), be.upload(st, wd))
        close(be.download(out), want, 1e-5)


@pytest.mark.parametrize("Hq,Dc,Dr,block,nslots", [(16, 512, 64, 16, 256), (3, 37, 6, 1, 96), (5, 20, 4, 7, 140),
                                                   (20, 130, 64, 5, 200), (1, 8, 2, 3, 60)])
def test_latent_attention(kernel_backend, Hq, Dc, Dr, block, nslots, rng):
    """Latent attention through block tables: the latent c and rope key r of every position written
    by kv_write (two tensors of different widths), two sequences with scattered tables (a prefill
    chunk of one and decode of the other, up to the tables' last position), every head reading the
    one shared cache row."""
    ref, be = backend(kernel_backend)
    nblocks = nslots // block
    perm = rng.permutation(nblocks).astype(np.int32)
    maxb = nblocks // 2
    tables = np.stack([perm[:maxb], perm[maxb:2 * maxb]]).astype(np.int32)
    last = maxb * block - 1
    seq = np.array([0, 0, 0, 0, 1], np.int32)
    pos = np.array([last - 3, last - 2, last - 1, last, min(17, last)], np.int32)
    T = len(seq)
    rC, rR = np.zeros((nslots, 1, Dc), np.float32), np.zeros((nslots, 1, Dr), np.float32)
    bC, bR = be.alloc((nslots, 1, Dc)), be.alloc((nslots, 1, Dr))
    for s in (0, 1):
        n = int(pos[seq == s].max()) + 1
        j = np.arange(n)
        slots = (tables[s, j // block] * block + j % block).astype(np.int32)
        c = rng.standard_normal((n, 1, Dc)).astype(np.float32)
        r = rng.standard_normal((n, 1, Dr)).astype(np.float32)
        ref.kv_write(rC, rR, c, r, slots)
        be.kv_write(bC, bR, dev(be, c), dev(be, r), dev(be, slots))
    np.testing.assert_array_equal(be.download(bC), rC)
    np.testing.assert_array_equal(be.download(bR), rR)
    q = rng.standard_normal((T, Hq, Dc)).astype(np.float32)
    qr = rng.standard_normal((T, Hq, Dr)).astype(np.float32)
    scale = (Dc + Dr) ** -0.5
    want = np.zeros_like(q)
    ref.latent_attention(want, q, qr, rC, rR, tables, seq, pos, block, scale)
    t = 4                                          # one token, by hand: softmax over its positions
    j = np.arange(pos[t] + 1)
    sl = tables[seq[t], j // block] * block + j % block
    sc = (q[t] @ rC[sl, 0].T + qr[t] @ rR[sl, 0].T) * scale
    p = np.exp(sc - sc.max(-1, keepdims=True))
    np.testing.assert_allclose(want[t], (p / p.sum(-1, keepdims=True)) @ rC[sl, 0], rtol=1e-4, atol=1e-5)
    out = be.alloc((T, Hq, Dc))
    be.latent_attention(out, dev(be, q), dev(be, qr), bC, bR, dev(be, tables), dev(be, seq), dev(be, pos), block,
                        scale)
    close(be.download(out), want, 1e-5)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_groups_sigmoid_scaling(kernel_backend, score, rng):
    """DeepSeek / GLM routers: softmax or sigmoid scores, a choice-only bias, group-limited top-k (a
    group scored by its maximum or the sum of its top two; groups tied in score kept by the lower id),
    weights renormalised or not, times routed_scaling_factor. E under a SIMD row, 64 and over a warp."""
    ref, be = backend(kernel_backend)
    for T, E, k, groups, bias, normalize in ((9, 8, 1, (4, 2, 2), True, True), (7, 64, 6, (8, 3, 2), True, True),
                                             (6, 64, 6, (8, 3, 1), False, False), (5, 300, 8, (10, 3, 2), True, True),
                                             (4, 16, 4, None, True, False), (3, 12, 3, (4, 4, 1), False, True)):
        logits = rng.standard_normal((T, E)).astype(np.float32)
        cb = (0.1 * rng.standard_normal(E)).astype(np.float32) if bias else None
        g = E // groups[0] if groups else E // 2
        logits[0, :] = -4.0                         # token 0: groups 0 and 1 tie exactly (same scores),
        logits[0, 0] = 3.0                          # experts 0 and g too: 0 goes first
        logits[0, g:2 * g] = logits[0, :g]
        if cb is not None:
            cb[g:2 * g] = cb[:g]
        scaling = 2.5
        rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
        ref.route(rid, rw, logits, k, "topk", normalize, None if cb is None else ref.upload(cb),
                  1e-20 if normalize else 0.0, None, score, groups, scaling)
        bid, bw = be.alloc((T, k), np.int32), be.alloc((T, k))
        be.route(bid, bw, dev(be, logits), k, "topk", normalize, None if cb is None else be.upload(cb),
                 1e-20 if normalize else 0.0, None, score, groups, scaling)
        np.testing.assert_array_equal(be.download(bid), rid)
        close(be.download(bw), rw, 1e-6)
        p = routing.softmax(logits) if score == "softmax" else 1 / (1 + np.exp(-logits.astype(np.float64)))
        w = np.take_along_axis(p, rid, -1)
        want = scaling * (w / w.sum(-1, keepdims=True) if normalize else w)
        np.testing.assert_allclose(rw, want, rtol=1e-5)          # the weights are p, not the biased choice
        if groups and groups[0] > 1:
            n, keep, top = groups
            c = p + (0 if cb is None else cb)
            gs = -np.sort(-c.reshape(T, n, g), -1)[..., :top].sum(-1)
            kept = np.argsort(-gs, -1, kind="stable")[:, :keep]
            assert all(set(rid[t] // g) <= set(kept[t]) for t in range(T))   # only kept groups' experts
            assert 0 in rid[0]
            free = np.zeros((T, k), np.int32)
            ref.route(free, np.zeros((T, k), np.float32), logits, k, "topk", normalize,
                      None if cb is None else ref.upload(cb), 0.0, None, score, None, scaling)
            if keep < n and k > 1:
                assert (free != rid).any(), "the groups changed no choice: the test proves nothing"


_SDOT_IR = """
import sys
from llvmlite import binding as llvm, ir
from colibri_edge.backends.cpu import qir
qir.HAS_AVX2, qir.HAS_VNNI, qir.HAS_SDOT, qir.ON_AARCH64 = False, False, True, True
m = ir.Module()
m.triple = "aarch64-unknown-linux-gnu"
v32 = ir.VectorType(ir.IntType(8), 32)
f = ir.Function(m, ir.FunctionType(ir.VectorType(ir.IntType(32), 8), [v32, v32]), "dot8")
b = ir.IRBuilder(f.append_basic_block())
b.ret(qir.dot8(b, qir.lookup16(b, qir.IQ4NL_VALUES, f.args[0]), True, f.args[1]))
llvm.initialize_all_targets()
llvm.initialize_all_asmprinters()
mod = llvm.parse_assembly(str(m))
for cpu in sys.argv[1:]:
    asm = llvm.Target.from_triple(m.triple).create_target_machine(cpu=cpu, opt=2).emit_assembly(mod)
    body = [ln.split()[0] for ln in asm.splitlines() if ln.startswith("\\t") and not ln.strip().startswith(".")]
    print(cpu, body.count("sdot"), body.count("tbl"), len(body), flush=True)
"""


def test_aarch64_sdot_variant_compiles_for_each_named_cpu():
    """The aarch64 int8 dot (qir.dot8 with sdot, lookup16 with tbl) as LLVM compiles it for every CPU
    name qir._DOTPROD_CPUS trusts to have the dot product extension: two sdot and two tbl a chunk,
    nothing widened. 'generic' (ARMv8.0, no dotprod) must make LLVM refuse the sdot: the kernels
    use it only for the named CPUs and hosts that have it (LLVM aborts the process otherwise). The
    variant's results are checked bit for bit under qemu by the aarch64 check (toolchains/aarch64)."""
    from colibri_edge.backends.cpu import qir
    cpus = list(qir._DOTPROD_CPUS)
    p = subprocess.run([sys.executable, "-c", _SDOT_IR, *cpus], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [ln.split() for ln in p.stdout.splitlines()]
    assert [r[0] for r in rows] == cpus
    for cpu, n_sdot, n_tbl, n in rows:
        assert (int(n_sdot), int(n_tbl)) == (2, 2) and int(n) < 16, (cpu, n_sdot, n_tbl, n)
    g = subprocess.run([sys.executable, "-c", _SDOT_IR, "generic"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert g.returncode != 0 and "Cannot select" in g.stderr, g.stdout + g.stderr[-2000:]
