"""The cpu backend as a whole: engine logits against the reference backend on converted tiny models,
weights left in the memmap, and a decode step that allocates nothing (Python heap and Numba NRT)."""
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from colibri_edge import ColibriError, Engine
from colibri_edge.backends import probe
from hf_models import CASES, convert_case

pytestmark = pytest.mark.skipif(not probe("cpu")[0], reason=f"cpu backend unavailable: {probe('cpu')[1]}")

# (case, stored weight type): every model shape once in float32, each smaller type on some of them
MODELS = [(c, None) for c in CASES] + [("mixtral", "float16"), ("qwen2_moe", "bfloat16"),
                                       ("qwen3_moe", "float16"), ("olmoe", "bfloat16"),
                                       ("mixtral_top1_tied", "int8"), ("qwen2_moe", "int8")]


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, np.abs(b).max())
    assert np.abs(a - b).max() <= tol * scale, f"max abs err {np.abs(a - b).max():.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("case,wd", MODELS, ids=[f"{c}-{w or 'float32'}" for c, w in MODELS])
def test_logits_match_reference(model_cache, case, wd):
    _, col = convert_case(model_cache, case, out_dtype=wd)
    V = json.load(open(os.path.join(col, "config.json")))["vocab_size"]
    rng = np.random.default_rng(7)
    ids = rng.integers(0, V, (2, 21)).astype(np.int32)             # two sequences in one step
    ragged = [rng.integers(0, V, n).astype(np.int32) for n in (5, 33)]
    with Engine.open(col, backend="reference", max_seq_len=64) as ref, \
            Engine.open(col, backend="cpu", max_seq_len=64, prefill_chunk=16) as cpu:
        close(cpu.infer(ids), ref.infer(ids), 1e-4)                  # prefill chunks of 16, then 5
        for got, want in zip(cpu.infer(ragged), ref.infer(ragged)):
            close(got, want, 1e-4)
        prompts = [list(ids[0, :7]), list(ids[1, :3])]
        assert cpu.generate_batch(prompts, max_new_tokens=6) == ref.generate_batch(prompts, max_new_tokens=6)


@pytest.mark.parametrize("wd", ["float16", "bfloat16"])
def test_widening_is_exact_for_every_bit_pattern(wd):
    """The in-kernel widening (fpext half / bf16 shift) equals colibri_edge.dtypes.widen on all
    65536 patterns: zeros, subnormals, infinities and NaNs included."""
    from colibri_edge.backends import create
    from colibri_edge.dtypes import STORAGE, widen
    be = create("cpu")
    raw = np.arange(65536, dtype=np.uint16).view(STORAGE[wd]).reshape(256, 256)
    out = be.alloc((256, 256))
    be.embed(out, be.upload(raw, wd), np.arange(256, dtype=np.int32))
    want = widen(raw, wd)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_int8_kernels_match_reference(rng):
    """int8 is not in test_kernels' list: matmul, embed, grouped_ffn and combine with row scales."""
    from colibri_edge.backends import create
    from colibri_edge.backends.base import FFN
    from colibri_edge.dtypes import quantize_rows
    ref, be = create("reference"), create("cpu")

    def both(w32):
        q, sc = quantize_rows(w32)
        return ref.upload(q, "int8", scales=sc), be.upload(q, "int8", scales=sc)

    for T, K, N in [(1, 37, 29), (7, 64, 33), (33, 19, 130)]:
        x = rng.standard_normal((T, K)).astype(np.float32)
        rw, bw = both(rng.standard_normal((N, K)).astype(np.float32))
        bias = rng.standard_normal(N).astype(np.float32)
        for b in (None, bias):
            want, got = np.zeros((T, N), np.float32), be.alloc((T, N))
            ref.matmul(want, x, rw, None if b is None else ref.upload(b))
            be.matmul(got, x, bw, None if b is None else be.upload(b))
            close(got, want, 1e-5)
        ids = rng.integers(0, N, T).astype(np.int32)
        want, got = np.zeros((T, K), np.float32), be.alloc((T, K))
        rt, bt = both(rng.standard_normal((N, K)).astype(np.float32))
        ref.embed(want, rt, ids)
        be.embed(got, bt, ids)
        close(got, want, 1e-6)
    E, H, I, k, T = 5, 29, 23, 2, 9
    mats = [[both(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1])) for s in [(I, H), (I, H), (H, I)]]
            for _ in range(E)]
    rex, bex = [FFN(*(m[0] for m in ms)) for ms in mats], [FFN(*(m[1] for m in ms)) for ms in mats]
    logits = rng.standard_normal((T, E)).astype(np.float32)
    ids, w = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    ref.route(ids, w, logits, k, "topk", True)
    x = rng.standard_normal((T, H)).astype(np.float32)
    rplan, bplan = ref.align(None, ids, T, E, k), be.align(be.alloc_plan(T * k, E), ids, T, E, k)
    ry, by = np.zeros((T * k, H), np.float32), be.alloc((T * k, H))
    ref.grouped_ffn(ry, x, rex, rplan, np.zeros((T * k, 2 * I), np.float32))
    be.grouped_ffn(by, x, bex, bplan, be.alloc((T * k, 2 * I)))
    want, got = np.zeros((T, H), np.float32), be.alloc((T, H))
    ref.combine(want, ry, w, rplan)
    be.combine(got, by, w, bplan)
    close(got, want, 1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 64])
def test_stream_layout_covers_every_row(threads, rng):
    """matmul and swiglu_gate_up read each thread's rows as 4 (gate/up: 2+2) interleaved streams
    plus a remainder: for every split of N among `threads` (ranges of 0..3 leftover rows, ranges
    shorter than the stream count, threads with no rows) every output equals the reference."""
    from colibri_edge.backends import create
    from colibri_edge.backends.cpu import kernels
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
            kernels.matmul(got, x, w, none, bias, threads)
            close(got, want, 1e-5)
            gate, up = w, rng.standard_normal((N, 24)).astype(np.float32)
            order = np.arange(T, dtype=np.int32)[::-1].copy()      # rows in another order than tokens
            g, u = x[order] @ gate.T, x[order] @ up.T
            act = np.full((T, N), np.nan, np.float32)
            kernels.swiglu_gate_up(act, x, order, 0, 1, gate, up, none, none, threads)
            close(act, g / (1 + np.exp(-g)) * u, 1e-5)


def test_weights_stay_in_the_memmap(model_cache):
    _, col = convert_case(model_cache, "qwen2_moe", out_dtype="bfloat16")
    with Engine.open(col, backend="cpu", max_seq_len=32) as eng:
        mm = eng.model.mmap
        layer = next(lw for lw in eng.runner.layers if lw["type"] != "dense")
        for w in (eng.runner.embed, layer["attn.wq"], layer["experts"][0].gate, layer["experts"][-1].down):
            assert np.shares_memory(w.data, mm) and not w.data.flags.writeable


def test_num_threads(model_cache):
    import numba
    _, col = convert_case(model_cache, "mixtral")
    ids = np.arange(9, dtype=np.int32)
    with Engine.open(col, backend="cpu", max_seq_len=32) as a, \
            Engine.open(col, backend="cpu", max_seq_len=32, num_threads=1) as b:
        assert b.backend.num_threads == 1 and a.backend.num_threads == numba.config.NUMBA_NUM_THREADS
        np.testing.assert_allclose(b.infer(ids), a.infer(ids), rtol=0, atol=1e-5)
    with pytest.raises(ColibriError, match="COLIBRI_NUM_THREADS"):
        Engine.open(col, backend="cpu", num_threads=numba.config.NUMBA_NUM_THREADS + 1)


def _greedy_runner(col, prompt_len=11, warmup=4):
    """An engine's runner with one sequence prefilled and `warmup` decode steps done;
    returns (engine, step) where step() runs one more greedy decode step."""
    eng = Engine.open(col, backend="cpu", max_seq_len=128, max_batch=2)
    r = eng.runner
    seq = r.new_sequence(1)
    prompt = list(range(3, 3 + prompt_len))
    r.reserve(seq, len(prompt))
    state = {"logits": r.step([(seq, prompt)])}

    def step():
        tok = int(state["logits"][-1].argmax())
        r.reserve(seq, 1)
        state["logits"] = r.step([(seq, [tok])])

    for _ in range(warmup):
        step()
    return eng, step


def test_decode_step_allocates_nothing_python(model_cache):
    _, col = convert_case(model_cache, "qwen2_moe", out_dtype="float16")   # dense, moe and shared layers
    eng, step = _greedy_runner(col)
    tracemalloc.start()
    try:
        worst = 0
        for _ in range(32):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            step()
            worst = max(worst, tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
        eng.close()
    assert worst < 64 * 1024, f"a decode step peaked at {worst} bytes of Python/NumPy allocation"


NRT_CHECK = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, sys.argv[2])
    from numba.core.runtime import rtsys
    from test_cpu_backend import _greedy_runner
    from colibri_edge.backends.cpu import kernels
    eng, step = _greedy_runner(sys.argv[1])
    # Numba wraps every NumPy array argument in a MemInfo when it unboxes it (one NRT alloc, freed
    # on return): count those, so any allocation the kernels themselves made would show.
    unboxed = [0]
    def counting(fn):
        def call(*args):
            unboxed[0] += sum(isinstance(a, np.ndarray) for a in args)
            return fn(*args)
        return call
    for name in ("matmul", "embed", "rmsnorm", "rope", "add", "gated_add", "kv_write", "paged_attention",
                 "route", "align", "swiglu_gate_up", "combine"):
        setattr(kernels, name, counting(getattr(kernels, name)))
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(script), col, os.path.dirname(os.path.abspath(__file__))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    unboxed, alloc, free, mi_alloc, mi_free = map(int, res.stdout.split()[-5:])
    assert unboxed > 0
    assert alloc == free == mi_alloc == mi_free == unboxed, \
        f"NRT over 32 decode steps: {alloc} allocs, {free} frees, {mi_alloc}/{mi_free} meminfos; " \
        f"{unboxed} array arguments unboxed"
