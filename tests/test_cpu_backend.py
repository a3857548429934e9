"""What only the cpu backend has (its kernels and whole models run in the shared suites,
test_kernels.py and test_parity.py): the stream layout of its GEMV over every thread split, weights
left in the memmap, the thread count, and a decode step that allocates nothing (Python heap and
Numba NRT)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from colibri_edge import ColibriError, Engine
from helpers import backend_available, peak_step_bytes
from hf_models import convert_case


@pytest.fixture(autouse=True)
def cpu_backend():
    ok, detail = backend_available("cpu")      # fails instead where CI requires the cpu backend
    if not ok:
        pytest.skip(f"cpu backend unavailable: {detail}")


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, np.abs(b).max())
    assert np.abs(a - b).max() <= tol * scale, f"max abs err {np.abs(a - b).max():.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 64])
def test_stream_layout_covers_every_row(threads, rng):
    """matmul and swiglu_gate_up read each thread's rows as 4 (gate/up: 2+2) interleaved streams
    plus a remainder: for every split of N among `threads` (ranges of 0..3 leftover rows, ranges
    shorter than the stream count, threads with no rows) every output equals the reference."""
    from colibri_edge.backends import create
    from colibri_edge.backends.cpu import kernels, moe_kernels
    ref = create("reference")
    none = np.zeros(0, np.float32)
    for N in (1, 3, 4, 7, 9, 10, 11, 40, 130):
        for T in (1, 2, 3):
            x = rng.standard_normal((T, 24)).astype(np.float32)
            w = rng.standard_normal((N, 24)).astype(np.float32)
            bias = rng.standard_normal(N).astype(np.float32)
            want = np.zeros((T, N), np.float32)
            ref.matmul(want, x, ref.upload(w), ref.upload(bias))
            got = np.full((T, N), np.nan, np.float32)
            kernels.matmul(got, x, w, none, bias, np.zeros((threads, 8), np.int64))
            close(got, want, 1e-5)
            gate, up = w, rng.standard_normal((N, 24)).astype(np.float32)
            order = np.arange(T, dtype=np.int32)[::-1].copy()      # rows in another order than tokens
            g, u = x[order] @ gate.T, x[order] @ up.T
            act = np.full((T, N), np.nan, np.float32)
            moe_kernels.swiglu_gate_up(act, x, order, 0, 1, gate, up, none, none, np.zeros((threads, 8), np.int64),
                                       (none, none, np.float32(0), np.float32(0), np.zeros((0, 0), np.float32)))
            close(act, g / (1 + np.exp(-g)) * u, 1e-5)


@pytest.mark.parametrize("int8_activations", [True, False])
def test_a_tokens_sums_do_not_depend_on_the_batch(int8_activations, rng):
    """Batch invariance at the kernels: in every weight type the cpu backend runs, a token's matmul
    row and its gate/up activations are bit for bit the same whether 1, 2, 3, 4, 5 or 9 tokens share
    the call and wherever it stands among them (a pair's first or second, or a lone last one), on
    rows that fill the four streams and on the leftover rows (N = 37; the expert's I = 256 rows)."""
    from colibri_edge.backends import create
    from colibri_edge.backends.base import FFN, Plan
    from helpers import stored_weights
    be = create("cpu", int8_activations=int8_activations, num_threads=2)
    N, K, I, Ts = 37, 512, 256, (1, 2, 3, 4, 5, 9)
    x = rng.standard_normal((max(Ts), K)).astype(np.float32)
    for wd in be.weight_dtypes:
        def up(w32):
            q, sc = stored_weights(w32, wd)
            return be.upload(q, wd, scales=sc, shape=w32.shape)
        W = up(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
        ffn = FFN(*(up(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1])) for s in [(I, K), (I, K), (K, I)]))
        outs, acts = {}, {}
        for T in Ts:
            o = be.alloc((T, N))
            be.matmul(o, x[:T].copy(), W)
            outs[T] = be.download(o)
            order = np.arange(T, dtype=np.int32)
            plan = Plan(np.array([0, T], np.int32), order, order.copy(), np.array([T], np.int32), T, 1,
                        np.array([0], np.int32), num_experts=1)
            act = be.alloc((T, I))
            be.grouped_ffn(be.alloc((T, K)), x[:T].copy(), [ffn], plan, act)
            acts[T] = be.download(act)
        for T in Ts:
            np.testing.assert_array_equal(outs[T], outs[max(Ts)][:T], err_msg=f"{wd} matmul T={T}")
            np.testing.assert_array_equal(acts[T], acts[max(Ts)][:T], err_msg=f"{wd} gate/up T={T}")


def test_weights_stay_in_the_memmap(model_cache):
    _, col = convert_case(model_cache, "qwen2_moe", out_dtype="bfloat16")
    with Engine.open(col, backend="cpu", max_seq_len=32) as eng:
        mm, prog = eng.model.mmap, eng.runner.program
        moe = prog.moe[0]
        for w in (prog.embed, prog.layers[0].mixer.wq, moe.experts[0].gate, moe.experts[-1].down):
            assert np.shares_memory(w.data, mm) and not w.data.flags.writeable


def test_num_threads(model_cache):
    import numba
    _, col = convert_case(model_cache, "mixtral")
    ids = np.arange(9, dtype=np.int32)
    with Engine.open(col, backend="cpu", max_seq_len=32) as a, \
            Engine.open(col, backend="cpu", max_seq_len=32, num_threads=1) as b:
        from colibri_edge.backends.cpu.cores import available_cores
        assert a.backend.num_threads == min(numba.config.NUMBA_NUM_THREADS, available_cores())
        assert b.backend.num_threads == 1 and b.backend.governor is None      # an explicit count is kept
        np.testing.assert_allclose(b.infer(ids), a.infer(ids), rtol=0, atol=1e-5)
        if a.backend.num_threads > 1:        # fewer threads than the most (the governor's choice) agree too
            a.backend.governor = None
            a.backend.threads = 1
            np.testing.assert_allclose(a.infer(ids), b.infer(ids), rtol=0, atol=1e-5)
    with pytest.raises(ColibriError, match="COLIBRI_NUM_THREADS"):
        Engine.open(col, backend="cpu", num_threads=numba.config.NUMBA_NUM_THREADS + 1)


def test_spin_is_a_time_not_a_count():
    """libgomp's spin count is set for ~40 us of pauses, whatever a pause takes on the host."""
    import platform
    from colibri_edge.backends.cpu import backend as cb
    assert cb.spincount(pause_ns=20.0) == 2000 and cb.spincount(pause_ns=10.0) == 4000
    assert cb.spincount(pause_ns=1000.0) == 500 and cb.spincount(pause_ns=0.5) == 20000     # clamped
    ns = cb.spin_pause_ns()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert 0.5 < ns < 1000, ns          # one pause timed: sub-ns means it compiled to nothing
        assert abs(cb.spincount() - cb.spincount(ns)) < 0.5 * cb.spincount(ns)      # timed again: near
    else:
        assert ns is None and cb.spincount() == cb.SPINCOUNT


def test_decode_step_allocates_nothing_python(model_cache):
    _, col = convert_case(model_cache, "qwen2_moe", out_dtype="float16")   # dense, moe and shared layers
    worst = peak_step_bytes(col)
    assert worst < 64 * 1024, f"a decode step peaked at {worst} bytes of Python/NumPy allocation"


NRT_CHECK = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, sys.argv[2])
    from numba.core.runtime import rtsys
    from helpers import greedy_runner as _greedy_runner
    from colibri_edge.backends.cpu import kernels, moe_kernels
    eng, step = _greedy_runner(sys.argv[1])
    # Numba wraps every NumPy array argument in a MemInfo when it unboxes it (one NRT alloc, freed
    # on return), arrays inside a tuple argument too (the experts' epilogue): count those, so any
    # allocation the kernels themselves made would show.
    unboxed = [0]
    def counting(fn):
        def call(*args):
            unboxed[0] += sum(isinstance(a, np.ndarray) for a in args)
            unboxed[0] += sum(isinstance(b, np.ndarray) for a in args if isinstance(a, tuple) for b in a)
            return fn(*args)
        return call
    for name in ("matmul", "embed", "rmsnorm", "rope", "add", "gated_add", "kv_write", "paged_attention"):
        setattr(kernels, name, counting(getattr(kernels, name)))
    for name in ("route", "align", "swiglu_gate_up", "combine"):
        setattr(moe_kernels, name, counting(getattr(moe_kernels, name)))
    step()
    unboxed[0] = 0
    before = rtsys.get_allocation_stats()
    for _ in range(32):
        step()
    after = rtsys.get_allocation_stats()
    print(unboxed[0], after.alloc - before.alloc, after.free - before.free,
          after.mi_alloc - before.mi_alloc, after.mi_free - before.mi_free)
""")


def test_decode_step_allocates_nothing_numba(model_cache, tmp_path):
    _, col = convert_case(model_cache, "qwen2_moe", out_dtype="bfloat16")
    script = tmp_path / "nrt_check.py"
    script.write_text(NRT_CHECK)
    env = {**os.environ, "NUMBA_NRT_STATS": "1"}
    res = subprocess.run([sys.executable, str(script), col, os.path.dirname(os.path.abspath(__file__))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    unboxed, alloc, free, mi_alloc, mi_free = map(int, res.stdout.split()[-5:])
    assert unboxed > 0
    assert alloc == free == mi_alloc == mi_free == unboxed, \
        f"NRT over 32 decode steps: {alloc} allocs, {free} frees, {mi_alloc}/{mi_free} meminfos; " \
        f"{unboxed} array arguments unboxed"


def test_numba_cache_follows_the_files_a_kernel_inlines(tmp_path):
    """Numba's disk cache checks only the kernel's own file: after an edit of the file it inlines code
    from (qir.py for qkernels.py), jitcache.drop_stale must make the next process recompile, not
    serve the old machine code."""
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "dep.py").write_text("from numba import njit\n@njit(inline='always')\ndef f(x):\n    return x + 1\n")
    (pkg / "kern.py").write_text(textwrap.dedent("""
        from numba import njit
        from colibri_edge.backends.cpu.jitcache import drop_stale
        from .dep import f
        @njit(cache=True)
        def g(x):
            return f(x) * 10
        drop_stale(globals(), __file__.replace("kern.py", "dep.py"))
    """))
    run = [sys.executable, "-c", "from kpkg.kern import g; print(g(1))"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("NUMBA_CACHE_DIR", None)
    first = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.strip()
    (pkg / "dep.py").write_text("from numba import njit\n@njit(inline='always')\ndef f(x):\n    return x + 2\n")
    second = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert (first, second) == ("20", "30")
    assert (pkg / "__pycache__" / "kern.py.deps").is_file()


@pytest.mark.parametrize("blk", [32, 256])
def test_quantize_act_is_the_emulation(blk, rng):
    """The cpu kernels' int8 activations (qkernels.quantize_act, 16 at a time in qir's vectors) equal
    quant.quantize_activations bit for bit: q, dx, and per 32 xs (per 256: the int16 sums per 16 in
    xs's bytes), rows taken from a wider buffer and written at another row; a block holding a
    non-finite value gets dx NaN and q 0 there, its neighbours untouched."""
    from colibri_edge.backends.cpu import qkernels as Q
    from colibri_edge.model.quant import quantize_activations
    T, K = 3, 1024
    wide = (rng.standard_normal((T, K + 64)) * rng.choice([1e-3, 1.0, 40.0], (T, 1))).astype(np.float32)
    wide[1, :300] = 0.0                                             # zero blocks: dx 0, q 0
    wide[2, 260] = np.inf
    wide[2, 700] = np.nan
    x = wide[:, :K]
    qx, dx, xs = np.zeros((T + 1, K), np.int8), np.zeros((T + 1, K // 32), np.float32), np.zeros((T + 1, K // 32), np.float32)
    for t in range(T):
        Q.quantize_act(qx, dx, xs, t + 1, x, t, blk)
    fin = np.where(np.isfinite(x), x, 0).astype(np.float32)
    q, d, s = quantize_activations(fin, blk)
    bad = ~np.isfinite(x).reshape(T, K // blk, blk).all(axis=-1).repeat(blk // 32, axis=1)        # [T, K / 32]
    assert bad[2].sum() == 2 * blk // 32 and not bad[:2].any()
    np.testing.assert_array_equal(np.isnan(dx[1:]), bad)
    np.testing.assert_array_equal(dx[1:][~bad], d[~bad])
    np.testing.assert_array_equal(qx[1:].reshape(T, K // 32, 32)[bad], 0)
    np.testing.assert_array_equal(qx[1:].reshape(T, K // 32, 32)[~bad], q.reshape(T, K // 32, 32)[~bad])
    if blk == 32:
        np.testing.assert_array_equal(xs[1:][~bad], s[~bad])
    else:
        sums16 = q.reshape(T, K // 16, 16).sum(axis=-1, dtype=np.int32).astype(np.int16)
        np.testing.assert_array_equal(xs[1:].view(np.int16)[:, :K // 16][~bad.repeat(2, axis=1)],
                                      sums16[~bad.repeat(2, axis=1)])
    assert not qx[0].any() and not dx[0].any()                        # row 0 never written
