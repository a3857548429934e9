"""The CUDA backend (backends/cuda).

Everywhere (no GPU needed): backend="cuda" without a GPU is COLIBRI_ERR_UNAVAILABLE, and every
kernel file compiles with NVRTC, the compiler CuPy uses at run time.
On a GPU (skipped with the reason otherwise; `make gpu-check` runs them, and so does the CPU
kernel emulator of toolchains/cuda/emu): the kernel paths test_kernels.py does not reach (tiled
and cuBLAS GEMMs, many experts, long plans, several streams, long contexts), the align worked
example on the device, error mapping, whole-model parity with transformers (fp32 within 1e-4 of
the largest logit; fp16 teacher-forced greedy agreement), and graph mode == stream mode with an
assertion that graphs really ran.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from colibri_edge import (Engine, ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_INVALID_ARGUMENT,
                          COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE)
from colibri_edge.backends import create, probe
from colibri_edge.backends.base import FFN
from colibri_edge.dtypes import narrow, quantize_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {b for b in os.environ.get("COLIBRI_REQUIRE_BACKENDS", "").split(",") if b}


@pytest.fixture
def gpu():
    """The CUDA backend's probe must pass (a GPU, or the emulator); skip with its reason otherwise."""
    ok, detail = probe("cuda")
    if not ok:
        if "cuda" in REQUIRED:
            pytest.fail(f"the cuda backend is required here (COLIBRI_REQUIRE_BACKENDS) but unavailable: {detail}")
        pytest.skip(f"needs an NVIDIA GPU: {detail}")
    return detail


def dev(be, host):
    buf = be.alloc(host.shape, host.dtype)
    be.upload_into(buf, np.ascontiguousarray(host))
    return buf


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, np.abs(want).max())
    err = np.abs(got - want).max()
    assert err <= tol * scale, f"max abs err {err:.3g} (scale {scale:.3g}, tol {tol:g})"


WEIGHT_TYPES = ("float32", "float16", "bfloat16", "int8")


def stored(w32, wd):
    """float32 [rows, cols] -> (stored array, scales or None) in weight type wd."""
    return quantize_rows(w32) if wd == "int8" else (narrow(w32, wd), None)


def upload(be, st, wd):
    return be.upload(st[0], wd) if st[1] is None else be.upload(st[0], wd, scales=st[1])


def enable_graph_decode(engine):
    """Decode steps through Backend.graph_step (until the scheduler does it itself)."""
    from colibri_edge.backends.cuda.backend import graph_decode_hook
    return graph_decode_hook(engine)


# -- no GPU needed ---------------------------------------------------------------------------------

def test_cuda_unavailable_without_gpu(tmp_path):
    ok, detail = probe("cuda")
    if ok:
        pytest.skip(f"a CUDA device is present ({detail}): this checks the machines without one")
    assert detail
    with pytest.raises(ColibriError) as e:
        create("cuda")
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE and "cuda" in e.value.message
    assert create("auto").name != "cuda"
    from colibri_edge import modeldir
    path = str(tmp_path / "m")
    _tiny_model(path, modeldir)
    with pytest.raises(ColibriError) as e:
        Engine.open(path, backend="cuda")
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE


def _tiny_model(path, modeldir):
    """A 1-layer Mixtral-shaped model dir written directly (no transformers needed)."""
    cfg = {"format_version": 1, "model_type": "mixtral", "num_hidden_layers": 1, "hidden_size": 16,
           "intermediate_size": 8, "moe_intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 8, "vocab_size": 11, "max_position_embeddings": 32, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "experts_per_layer": 2, "top_k": 1,
           "router_dtype": "float32", "router_mode": "topk", "norm_topk_prob": True,
           "shared_expert_intermediate_size": 0, "shared_expert_gate": False, "attention_bias": False,
           "attention_out_bias": False, "qk_norm": "none", "eos_token_ids": [], "weight_dtype": "float32",
           "layers": [{"layer_id": 0, "type": "moe", "moe_expert_start": 0, "moe_num_experts": 2}]}
    rng = np.random.default_rng(0)
    w = modeldir.ModelWriter(path, cfg)
    for name, (shape, dtype) in modeldir.expected_tensors(cfg).items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32), dtype)
    for j in range(2):
        w.add_expert(0, j, *(rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (8, 16), (16, 8))),
                     "float32")
    w.finish()


def _nvrtc_check():
    path = os.path.join(ROOT, "toolchains", "cuda", "nvrtc_check.py")
    spec = importlib.util.spec_from_file_location("colibri_nvrtc_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_kernel_compiles_with_nvrtc():
    """The text and options the backend gives cupy.RawModule compile with NVRTC (no GPU needed)."""
    chk = _nvrtc_check()
    try:
        chk.find_nvrtc()
    except FileNotFoundError as e:
        if "cuda" in REQUIRED:
            pytest.fail(str(e))
        pytest.skip(str(e))
    failures = chk.check(archs=("sm_80", "sm_90"), verbose=False)
    assert not failures, "\n\n".join(failures)


# -- on a GPU --------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_align_worked_example_on_device(gpu):
    be = create("cuda")
    ids = dev(be, np.array([[2, 0], [0, 3], [2, 0]], np.int32))
    plan = be.align(be.alloc_plan(6, 4), ids, 3, 4, 2)
    assert be.download(plan.offsets).tolist() == [0, 3, 3, 5, 6]
    assert be.download(plan.order).tolist() == [1, 2, 5, 0, 4, 3]
    assert be.download(plan.inverse).tolist() == [3, 0, 1, 5, 4, 2]
    assert np.asarray(plan.counts).tolist() == [3, 0, 2, 1]
    # the block list of the docstring's example (BM = 2): expert 0's three rows take two blocks
    plan2 = be.align(None, ids, 3, 4, 2, block_rows=2)
    nb = int(be.download(plan2.nblocks)[0])
    assert nb == 4 and nb <= plan2.max_blocks
    assert be.download(plan2.blocks)[:3 * nb].reshape(nb, 3).tolist() == [[0, 0, 2], [0, 2, 3], [2, 3, 5], [3, 5, 6]]
    # counts may stay on the device (no host round trip); the plan is the same
    lean = create("cuda", host_counts=False)
    p3 = lean.align(None, dev(lean, np.array([[2, 0], [0, 3], [2, 0]], np.int32)), 3, 4, 2)
    assert p3.counts is None and lean.download(p3.order).tolist() == [1, 2, 5, 0, 4, 3]


@pytest.mark.cuda
@pytest.mark.parametrize("T,K,N", [(8, 64, 40), (9, 37, 29), (32, 130, 70), (5, 1100, 20), (3, 1101, 9),
                                   (33, 64, 48), (100, 19, 130), (70, 1030, 17)])
@pytest.mark.parametrize("use_cublas", [False, True])
def test_matmul_paths(gpu, T, K, N, use_cublas, rng):
    """Every weight type through skinny (T <= 32: one and several row groups, odd and even K), tiled
    (T > 32 without cuBLAS, and always for bf16/int8) and cuBLAS (fp16 weights: fp16 tensor-core
    GEMM) against the reference."""
    ref, be = create("reference"), create("cuda", use_cublas=use_cublas)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w32 = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    for wd in WEIGHT_TYPES:
        st = stored(w32, wd)
        for b in (None, bias):
            want = np.zeros((T, N), np.float32)
            ref.matmul(want, x, upload(ref, st, wd), None if b is None else ref.upload(b))
            out = be.alloc((T, N))
            be.matmul(out, dev(be, x), upload(be, st, wd), None if b is None else be.upload(b))
            cublas16 = use_cublas and T > 32 and wd == "float16"
            close(be.download(out), want, 3e-3 if cublas16 else 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("T,k,E,H,I,streams", [
    (1, 8, 128, 64, 48, 1),      # a decode step over many experts (skinny, pair loads)
    (3, 2, 8, 33, 17, 3),        # odd sizes, experts split over 3 streams
    (2, 2, 4, 600, 520, 1),      # K above one shared-memory chunk in both GEMMs
    (300, 2, 4, 40, 24, 1),      # >= 32 rows per expert: tiled kernels
    (300, 2, 4, 40, 24, 2),
    (1100, 2, 300, 16, 10, 1),   # A = 2200 > one align chunk, 300 experts (several per align thread)
    (1100, 2, 6, 32, 16, 2),     # tiled, chunked align, two streams
])
def test_grouped_ffn_paths(gpu, T, k, E, H, I, streams, rng):
    ref, be = create("reference"), create("cuda", num_streams=streams)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    ref.route(rid, rw, logits, k, "topk", True)
    bid, bw = be.alloc((T, k), np.int32), be.alloc((T, k))
    if E <= 512:
        be.route(bid, bw, dev(be, logits), k, "topk", True)
        np.testing.assert_array_equal(be.download(bid), rid)
        close(be.download(bw), rw, 1e-6)
    for wd in WEIGHT_TYPES:
        mats = [[stored(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]), wd) for s in [(I, H), (I, H), (H, I)]]
                for _ in range(E)]
        rex = [FFN(*(upload(ref, m, wd) for m in ms)) for ms in mats]
        bex = [FFN(*(upload(be, m, wd) for m in ms)) for ms in mats]
        x = rng.standard_normal((T, H)).astype(np.float32)
        rplan = ref.align(None, rid, T, E, k)
        y = np.zeros((T * k, H), np.float32)
        ref.grouped_ffn(y, x, rex, rplan, np.zeros((T * k, 2 * I), np.float32))
        resid = rng.standard_normal((T, H)).astype(np.float32)
        want = resid.copy()
        ref.combine(want, y, rw, rplan)
        bplan = be.align(be.alloc_plan(T * k, E), dev(be, rid), T, E, k)
        np.testing.assert_array_equal(np.asarray(bplan.counts), rplan.counts)
        np.testing.assert_array_equal(be.download(bplan.order), rplan.order)
        np.testing.assert_array_equal(be.download(bplan.inverse), rplan.inverse)
        by = be.alloc((T * k, H))
        be.grouped_ffn(by, dev(be, x), bex, bplan, be.alloc((T * k, 2 * I)))
        close(be.download(by), y, 1e-5)
        out = dev(be, resid)
        be.combine(out, by, dev(be, rw), bplan)
        close(be.download(out), want, 1e-5)


@pytest.mark.cuda
def test_embed_every_weight_type(gpu, rng):
    ref, be = create("reference"), create("cuda")
    table = rng.standard_normal((53, 46)).astype(np.float32)
    ids = rng.integers(0, 53, 9).astype(np.int32)
    for wd in WEIGHT_TYPES:
        st = stored(table, wd)
        want = np.zeros((9, 46), np.float32)
        ref.embed(want, upload(ref, st, wd), ids)
        out = be.alloc((9, 46))
        be.embed(out, upload(be, st, wd), dev(be, ids))
        close(be.download(out), want, 1e-6)


@pytest.mark.cuda
def test_route_many_experts_and_ties(gpu, rng):
    ref, be = create("reference"), create("cuda")
    T, E, k = 5, 300, 8
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[1, [7, 39, 40, 299]] = 6.0      # a tie within a lane (7, 39) and across lanes: in id order
    for normalize in (True, False):
        rid, rw = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
        ref.route(rid, rw, logits, k, "topk", normalize)
        bid, bw = be.alloc((T, k), np.int32), be.alloc((T, k))
        be.route(bid, bw, dev(be, logits), k, "topk", normalize)
        np.testing.assert_array_equal(be.download(bid), rid)
        assert be.download(bid)[1, :4].tolist() == [7, 39, 40, 299]
        close(be.download(bw), rw, 1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("Hq,Hkv,D,block", [(8, 2, 128, 16), (4, 4, 256, 5), (3, 1, 6, 1)])
def test_paged_attention_long(gpu, Hq, Hkv, D, block, rng):
    ref, be = create("reference"), create("cuda")
    nslots = 400
    nblocks = nslots // block
    perm = rng.permutation(nblocks).astype(np.int32)
    maxb = nblocks // 2
    tables = np.stack([perm[:maxb], perm[maxb:2 * maxb]]).astype(np.int32)
    seq = np.array([0, 0, 1], np.int32)
    pos = np.array([maxb * block - 2, maxb * block - 1, 150], np.int32)
    q = rng.standard_normal((3, Hq, D)).astype(np.float32)
    from test_kernels import fill_paged_cache
    rc, bc = fill_paged_cache(ref, be, tables, seq, pos, block, nslots, Hkv, D, rng)
    want = np.zeros_like(q)
    ref.paged_attention(want, q, rc, 0, tables, seq, pos, block, D ** -0.5)
    out = be.alloc(q.shape)
    be.paged_attention(out, dev(be, q), bc, 0, dev(be, tables), dev(be, seq), dev(be, pos), block, D ** -0.5)
    close(be.download(out), want, 1e-5)
    # rope at a wide head and far positions
    x = rng.standard_normal((3, Hq, D)).astype(np.float32)
    p = np.array([0, 300, 511], np.int32)
    rw_ = x.copy()
    ref.rope(rw_, rw_, p, 1e6)
    xb = dev(be, x)
    be.rope(xb, xb, dev(be, p), 1e6)
    close(be.download(xb), rw_, 1e-4)


@pytest.mark.cuda
def test_errors_and_options(gpu):
    be = create("cuda")
    with pytest.raises(ColibriError) as e:
        be.alloc((1 << 44,), np.float32)                     # 64 TiB
    assert e.value.code == COLIBRI_ERR_OUT_OF_MEMORY
    z = be.alloc((0, 4))
    with pytest.raises(ColibriError) as e:                    # an empty grid: a CUDA launch error
        be.add(z, z, z)
    assert e.value.code == COLIBRI_ERR_BACKEND and "CUDA error" in e.value.message
    x = dev(be, np.ones((2, 3), np.float32))                  # the backend still works afterwards
    be.add(x, x, x)
    assert be.download(x).tolist() == [[2.0] * 3] * 2
    with pytest.raises(ColibriError) as e:
        create("cuda", num_streams=0)
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT
    f32 = create("cuda", disable_fp16=True)                  # fp32 compute; fp16 weights stay compact
    assert f32.upload(np.ones((3, 4), np.float16), "float16").data.dtype == np.float16
    assert "fp32" in f32.describe() and "fp16" in create("cuda").describe()


@pytest.mark.cuda
def test_graph_step_capture_replay_and_fallback(gpu):
    be = create("cuda", num_streams=2)
    a = dev(be, np.arange(6, dtype=np.float32).reshape(2, 3))
    out = be.alloc((2, 3))
    assert be.graph_step("add", lambda: be.add(out, a, a)) is True       # captured, then replayed
    assert be.mode == "graph" and be.graph_captures == 1
    assert be.download(out).tolist() == [[0, 2, 4], [6, 8, 10]]
    be.upload_into(a, np.ones((2, 3), np.float32))                      # new contents, same buffers
    assert be.graph_step("add", lambda: be.add(out, a, a)) is True
    assert be.download(out).tolist() == [[2.0] * 3] * 2 and be.graph_replays == 2
    # a step that needs the host cannot be captured: it runs in stream mode, now and later
    assert be.graph_step("host", lambda: be.download(a)) is False
    assert be.mode == "stream" and "host" in be.graph_failures
    assert be.graph_step("host", lambda: be.download(a)) is False
    be.add(out, a, out)                                                 # the stream is still fine
    assert be.download(out).tolist() == [[3.0] * 3] * 2
    plain = create("cuda", graphs=False)
    assert plain.graph_step("x", lambda: None) is False and plain.mode == "stream"


# -- whole models ---------------------------------------------------------------------------------

def _hf():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import hf_models
    return hf_models


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["mixtral", "mixtral_top1_tied", "qwen2_moe", "qwen2_moe_norm", "qwen3_moe", "olmoe"])
def test_parity_fp32(gpu, case, model_cache):
    """fp32 (disable_fp16): every logit within 1e-4 of the largest, through one prefill step (cuBLAS
    for T > 32), small chunks (the skinny kernels, KV across chunks) and the emulator's tiled path."""
    hm = _hf()
    hf, col = hm.convert_case(model_cache, case)
    V = hm.CASES[case][1]["vocab_size"]
    ids = np.random.default_rng(11).integers(0, V, size=(2, 21))
    want = hm.hf_logits(hf, ids)
    scale = np.abs(want).max()
    for chunk in (256, 6):
        with Engine.open(col, backend="cuda", disable_fp16=1, prefill_chunk=chunk, max_seq_len=64) as eng:
            got = eng.infer(ids)
        err = np.abs(got - want).max() / scale
        assert err < 1e-4, f"{case} prefill_chunk={chunk}: rel err {err:.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_greedy_fp32_matches_transformers(gpu, case, model_cache):
    hm = _hf()
    hf, col = hm.convert_case(model_cache, case)
    prompt = list(np.random.default_rng(2).integers(3, hm.CASES[case][1]["vocab_size"], size=7))
    want = hm.hf_greedy(hf, prompt, 10)
    with Engine.open(col, backend="cuda", disable_fp16=1, max_seq_len=64) as eng:
        enable_graph_decode(eng)
        got = eng.generate(prompt, max_new_tokens=10)
        assert eng.backend.graph_replays > 0
    assert got == want[:len(got)] and len(got) >= 1


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "olmoe"])
def test_fp16_teacher_forced_greedy(gpu, case, model_cache):
    """An fp16 checkpoint in the default fp16 mode: at every position of a fixed sequence the greedy
    choice agrees with transformers (fp32 compute on the same fp16 weights)."""
    hm = _hf()
    hf, col = hm.convert_case(model_cache, case, dtype="float16")
    V = hm.CASES[case][1]["vocab_size"]
    ids = np.random.default_rng(5).integers(0, V, size=(1, 40))
    want = hm.hf_logits(hf, ids)[0]
    for chunk in (256, 8):               # cuBLAS fp16 GEMMs (T = 40) / our kernels
        with Engine.open(col, backend="cuda", prefill_chunk=chunk, max_seq_len=64) as eng:
            assert eng.config["weight_dtype"] == "float16" and not eng.backend.fp32
            got = eng.infer(ids)[0]
        agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
        err = np.abs(got - want).max() / np.abs(want).max()
        assert agree >= 0.95 and err < 2e-2, f"{case} chunk={chunk}: agreement {agree:.2f}, rel err {err:.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("streams", [1, 2])
def test_graph_and_stream_modes_agree(gpu, streams, model_cache):
    """The same batch decoded in stream mode and through captured graphs gives identical tokens;
    graph mode really ran (captures, replays, mode == "graph")."""
    hm = _hf()
    hf, col = hm.convert_case(model_cache, "qwen2_moe")     # MoE + shared expert + a dense layer
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(3, 101, size=n)) for n in (5, 9, 3)]
    with Engine.open(col, backend="cuda", num_streams=streams, max_batch=4, max_seq_len=64) as eng:
        stream_out = eng.generate_batch(prompts, max_new_tokens=7)
        assert eng.backend.mode == "stream" and eng.backend.graph_replays == 0
    with Engine.open(col, backend="cuda", num_streams=streams, max_batch=4, max_seq_len=64) as eng:
        enable_graph_decode(eng)
        graph_out = eng.generate_batch(prompts, max_new_tokens=7)
        be = eng.backend
        assert be.graph_captures >= 1 and be.graph_replays >= be.graph_captures and not be.graph_failures, \
            be.describe()
        assert be.mode == "graph" and "mode=graph" in be.describe()
        captures, replays = be.graph_captures, be.graph_replays
        again = eng.generate_batch(prompts, max_new_tokens=7)    # the same shapes: replays only
        assert be.graph_captures == captures and be.graph_replays > replays
    assert graph_out == stream_out == again
