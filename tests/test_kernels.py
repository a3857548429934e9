"""Every backend's kernels against the NumPy reference, on odd shapes (not multiples of any
work-group or SIMD width), one token and many, top-k 1 to 4, every weight type the backend runs."""
import numpy as np
import pytest

from colibri_edge.backends import create
from colibri_edge.backends.base import FFN
from colibri_edge.dtypes import narrow
from colibri_edge import routing

SHAPES = [(1, 37, 29), (7, 64, 33), (33, 19, 130)]   # (T, K, N)


def _pair(name, **kw):
    return create("reference"), create(name, **kw)


def dev(be, host):
    buf = be.alloc(host.shape, host.dtype)
    be.upload_into(buf, np.ascontiguousarray(host))
    return buf


def close(a, b, tol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, np.abs(a).max())
    assert np.abs(a - b).max() <= tol * scale, f"max abs err {np.abs(a - b).max():.3g} (scale {scale:.3g})"


def _weight_dtypes(be):
    return [d for d in ("float32", "float16", "bfloat16") if d in be.weight_dtypes]


@pytest.mark.parametrize("T,K,N", SHAPES)
def test_matmul(fast_backend_name, T, K, N, rng):
    ref, be = _pair(fast_backend_name)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w32 = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    for wd in _weight_dtypes(be):
        raw = narrow(w32, wd)
        for b in (None, bias):
            want = np.zeros((T, N), np.float32)
            ref.matmul(want, x, ref.upload(raw, wd), None if b is None else ref.upload(b))
            out = be.alloc((T, N))
            be.matmul(out, dev(be, x), be.upload(raw, wd), None if b is None else be.upload(b))
            close(be.download(out), want, 1e-5 if wd == "float32" else 2e-3)


@pytest.mark.parametrize("T", [1, 5, 70])
def test_embed_rmsnorm_add(fast_backend_name, T, rng):
    ref, be = _pair(fast_backend_name)
    V, H = 53, 45
    table = rng.standard_normal((V, H)).astype(np.float32)
    ids = rng.integers(0, V, T).astype(np.int32)
    for wd in _weight_dtypes(be):
        raw = narrow(table, wd)
        want = np.zeros((T, H), np.float32)
        ref.embed(want, ref.upload(raw, wd), ids)
        out = be.alloc((T, H))
        be.embed(out, be.upload(raw, wd), dev(be, ids))
        close(be.download(out), want)
    x = rng.standard_normal((T, H)).astype(np.float32) * 3
    g = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    want = np.zeros_like(x)
    ref.rmsnorm(want, x, ref.upload(g), 1e-6)
    out = be.alloc((T, H))
    be.rmsnorm(out, dev(be, x), be.upload(g), 1e-6)
    close(be.download(out), want)
    # in place, as the scheduler uses it for q/k norms
    xb = dev(be, x)
    be.rmsnorm(xb, xb, be.upload(g), 1e-6)
    close(be.download(xb), want)
    y = rng.standard_normal((T, H)).astype(np.float32)
    gate = rng.standard_normal((T, 1)).astype(np.float32)
    for gt in (None, gate):
        want = np.zeros_like(x)
        ref.add(want, x, y, gate=gt)
        out = be.alloc((T, H))
        be.add(out, dev(be, x), dev(be, y), gate=None if gt is None else dev(be, gt))
        close(be.download(out), want)


@pytest.mark.parametrize("T,heads,D", [(1, 3, 8), (9, 5, 24), (40, 2, 64)])
def test_rope(fast_backend_name, T, heads, D, rng):
    ref, be = _pair(fast_backend_name)
    x = rng.standard_normal((T, heads, D)).astype(np.float32)
    pos = rng.integers(0, 500, T).astype(np.int32)
    want = x.copy()
    ref.rope(want, want, pos, 10000.0)
    xb = dev(be, x)
    be.rope(xb, xb, dev(be, pos), 10000.0)
    close(be.download(xb), want, 1e-4)


def fill_paged_cache(ref, be, tables, seq, pos, block, nslots, Hkv, D, rng):
    """Both backends' caches holding the same random K/V history for every position up to each
    token's, through each sequence's block table. -> (reference cache, backend cache)."""
    rcache, bcache = ref.alloc_kv(1, nslots, Hkv, D), be.alloc_kv(1, nslots, Hkv, D)
    for s in np.unique(seq):
        n = int(pos[seq == s].max()) + 1
        j = np.arange(n)
        slots = (tables[s, j // block] * block + j % block).astype(np.int32)
        k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
        ref.kv_write(rcache, 0, k, v, slots)
        be.kv_write(bcache, 0, dev(be, k), dev(be, v), dev(be, slots))
    return rcache, bcache


@pytest.mark.parametrize("block", [1, 7, 16])
def test_paged_attention(fast_backend_name, block, rng):
    ref, be = _pair(fast_backend_name)
    Hq, Hkv, D, nslots = 6, 2, 20, 8 * 16
    # two sequences with scattered block tables; a prefill chunk of 5 for seq 0 and one decode for seq 1
    nblocks = nslots // block
    perm = rng.permutation(nblocks).astype(np.int32)
    maxb = nblocks // 2
    tables = np.stack([perm[:maxb], perm[maxb:2 * maxb]]).astype(np.int32)
    seq = np.array([0, 0, 0, 0, 0, 1], np.int32)
    pos = np.array([3, 4, 5, 6, 7, min(29, maxb * block - 1)], np.int32)
    T = len(seq)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    rcache, bcache = fill_paged_cache(ref, be, tables, seq, pos, block, nslots, Hkv, D, rng)
    want = np.zeros_like(q)
    ref.paged_attention(want, q, rcache, 0, tables, seq, pos, block, D ** -0.5)
    out = be.alloc((T, Hq, D))
    be.paged_attention(out, dev(be, q), bcache, 0, dev(be, tables), dev(be, seq), dev(be, pos), block, D ** -0.5)
    close(be.download(out), want, 1e-5)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [1, 13])
def test_route_align_ffn_combine(fast_backend_name, k, T, rng):
    ref, be = _pair(fast_backend_name)
    E, H, I = 7, 29, 23
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[0, 1] = logits[0, 4] = 9.0          # an exact tie: both backends must pick expert 1 first
    for mode, kk in (("topk", k), ("gated", E)):
        rid, rw = np.zeros((T, kk), np.int32), np.zeros((T, kk), np.float32)
        ref.route(rid, rw, logits, kk, mode, True)
        bid, bw = be.alloc((T, kk), np.int32), be.alloc((T, kk))
        be.route(bid, bw, dev(be, logits), kk, mode, True)
        np.testing.assert_array_equal(be.download(bid), rid)
        close(be.download(bw), rw, 1e-6)
    assert rid.shape[1] == E and (k < 2 or ref_first_tie_ok(logits, k))
    rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    ref.route(rid, rw, logits, k, "topk", False)
    for wd in _weight_dtypes(be):
        experts_host = [[narrow(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]), wd)
                         for s in [(I, H), (I, H), (H, I)]] for _ in range(E)]
        rex = [FFN(*(ref.upload(m, wd) for m in ms)) for ms in experts_host]
        bex = [FFN(*(be.upload(m, wd) for m in ms)) for ms in experts_host]
        x = rng.standard_normal((T, H)).astype(np.float32)
        rplan = ref.align(None, rid, T, E, k)
        y = np.zeros((T * k, H), np.float32)
        ref.grouped_ffn(y, x, rex, rplan, np.zeros((T * k, 2 * I), np.float32))
        resid = rng.standard_normal((T, H)).astype(np.float32)
        want = resid.copy()
        ref.combine(want, y, rw, rplan)
        bplan_bufs = be.alloc_plan(T * k, E) if hasattr(be, "alloc_plan") else None
        bplan = be.align(bplan_bufs, dev(be, rid), T, E, k)
        np.testing.assert_array_equal(np.asarray(bplan.counts), np.asarray(rplan.counts))
        by = be.alloc((T * k, H))
        be.grouped_ffn(by, dev(be, x), bex, bplan, be.alloc((T * k, 2 * I)))
        out = dev(be, resid)
        be.combine(out, by, dev(be, rw), bplan)
        close(be.download(out), want, 1e-5 if wd == "float32" else 3e-3)


def ref_first_tie_ok(logits, k):
    ids, _ = routing.route(logits, k)
    return ids[0, 0] == 1 and ids[0, 1] == 4


def test_align_worked_example():
    offsets, order, inverse = routing.align(np.array([[2, 0], [0, 3], [2, 0]], np.int32), 4)
    assert offsets.tolist() == [0, 3, 3, 5, 6]
    assert order.tolist() == [1, 2, 5, 0, 4, 3]
    assert inverse.tolist() == [3, 0, 1, 5, 4, 2]
