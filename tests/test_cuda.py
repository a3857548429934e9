"""What only the CUDA backend has (its kernels and whole models run in the shared suites,
test_kernels.py, test_parity.py, test_generation.py, test_weight_types.py, on a GPU or the CPU kernel
emulator of toolchains/cuda/emu):

Everywhere (no GPU needed): backend="cuda" without a GPU is COLIBRI_ERR_UNAVAILABLE, and every
kernel file compiles with NVRTC, the compiler CuPy uses at run time.
On a GPU or the emulator (skipped with the reason otherwise; `make gpu-check` runs them): the block
list of the on-device align, error mapping and options, graph capture / replay / fallback, graph
mode against stream mode (COLIBRI_CUDA_GRAPHS / cuda_graphs) on a whole model, and the expert
counts of graph-replayed decode steps against the cpu backend's.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from colibri_edge import (Engine, ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_INVALID_ARGUMENT,
                          COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNAVAILABLE)
from colibri_edge.backends import create, probe
from colibri_edge.backends.base import plan_buffers

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
    from colibri_edge.model import modeldir
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
    """The text and options the backend gives cupy.RawModule compile with NVRTC (no GPU needed), to
    PTX with every kernel the backend looks up. `make -C toolchains/cuda nvrtc` (and gpu-check) builds
    NVRTC's cubins of every arch too; here the PTX only (moe.cu's cubins take ~50 s an arch; make test's
    nvcc step builds every arch's cubin from the same sources)."""
    chk = _nvrtc_check()
    try:
        chk.find_nvrtc()
    except FileNotFoundError as e:
        if "cuda" in REQUIRED:
            pytest.fail(str(e))
        pytest.skip(str(e))
    failures = chk.check(archs=(), verbose=False)
    assert not failures, "\n\n".join(failures)


# -- on a GPU --------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_align_block_list_on_device(gpu):
    """The plan's block list of moe_align's docstring example (BM = 2): expert 0's three rows take
    two blocks; no host copy of the counts is made (they stay on the device until asked for)."""
    be = create("cuda")
    bufs = {n: be.alloc(s, d) for n, (s, d) in plan_buffers(6, 4).items()}
    plan = be.align(bufs, dev(be, np.array([[2, 0], [0, 3], [2, 0]], np.int32)), 3, 4, 2, block_rows=2)
    assert plan.counts is None
    nb = int(be.download(plan.nblocks)[0])
    assert nb == 4 and nb <= plan.max_blocks
    assert be.download(plan.blocks)[:nb].tolist() == [[0, 0, 2], [0, 2, 3], [2, 3, 5], [3, 5, 6]]
    assert be.download(plan.order).tolist() == [1, 2, 5, 0, 4, 3]
    assert list(plan.experts_to_run()) == [0, 2, 3] and plan.counts.tolist() == [3, 0, 2, 1]


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
    assert be.graph_step("add", be.add, out, a, a) is True          # captured, then replayed
    assert be.mode == "graph" and be.graph_captures == 1
    assert be.download(out).tolist() == [[0, 2, 4], [6, 8, 10]]
    be.upload_into(a, np.ones((2, 3), np.float32))                  # new contents, same buffers
    assert be.graph_step("add", be.add, out, a, a) is True
    assert be.download(out).tolist() == [[2.0] * 3] * 2 and be.graph_replays == 2
    # a step that needs the host cannot be captured: it runs in stream mode, now and later
    assert be.graph_step("host", be.download, a) is False
    assert be.mode == "stream" and "host" in be.graph_failures
    assert be.graph_step("host", be.download, a) is False
    be.add(out, a, out)                                             # the stream is still fine
    assert be.download(out).tolist() == [[3.0] * 3] * 2
    plain = create("cuda", cuda_graphs=False)
    assert plain.graph_step("x", lambda: None) is False and plain.mode == "stream"


@pytest.mark.cuda
@pytest.mark.parametrize("streams", [1, 2])
def test_graph_and_stream_modes_agree(gpu, streams, model_cache, monkeypatch):
    """The same batch decoded in stream mode (cuda_graphs=False, and COLIBRI_CUDA_GRAPHS=0) and
    through captured graphs gives identical tokens; graph mode really ran (captures, replays,
    mode == "graph"), and the expert counts of the replayed decode steps equal the cpu backend's."""
    from hf_models import convert_case
    _, col = convert_case(model_cache, "qwen2_moe")     # MoE + shared expert + a dense layer
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(3, 101, size=n)) for n in (5, 9, 3)]
    kw = dict(num_streams=streams, max_batch=4, max_seq_len=64, disable_fp16=True)
    with Engine.open(col, backend="cuda", cuda_graphs=False, **kw) as eng:
        stream_out = eng.generate_batch(prompts, max_new_tokens=7)
        assert eng.backend.mode == "stream" and eng.backend.graph_replays == 0
    monkeypatch.setenv("COLIBRI_CUDA_GRAPHS", "0")
    with Engine.open(col, backend="cuda", **kw) as eng:
        assert eng.generate_batch(prompts, max_new_tokens=7) == stream_out and eng.backend.graph_replays == 0
    monkeypatch.delenv("COLIBRI_CUDA_GRAPHS")
    with Engine.open(col, backend="cuda", **kw) as eng:
        graph_out = eng.generate_batch(prompts, max_new_tokens=7)
        be = eng.backend
        assert be.graph_captures >= 1 and be.graph_replays >= be.graph_captures and not be.graph_failures, \
            be.describe()
        assert be.mode == "graph" and "mode=graph" in be.describe()
        captures, replays = be.graph_captures, be.graph_replays
        again = eng.generate_batch(prompts, max_new_tokens=7)    # the same shapes: replays only
        assert be.graph_captures == captures and be.graph_replays > replays
        counts = eng.expert_counts
    assert graph_out == stream_out == again
    from helpers import backend_available
    if backend_available("cpu")[0]:         # required in CI (toolchains/cuda/Makefile): fails there if missing
        with Engine.open(col, backend="cpu", max_batch=4, max_seq_len=64) as cpu:
            assert cpu.generate_batch(prompts, max_new_tokens=7) == stream_out
            cpu.generate_batch(prompts, max_new_tokens=7)
            np.testing.assert_array_equal(counts, cpu.expert_counts)


def test_gemv_formats_benchmark_checks_every_format(gpu, tmp_path):
    """gpu-check's per-format GEMV (toolchains/cuda/gemv_formats.py), small: every weight type the
    backend runs passes its check against the reference before it is timed, and gets a figure."""
    import json
    import subprocess
    import sys
    out = tmp_path / "gemv.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "toolchains/cuda/gemv_formats.py"), "--k", "256",
                        "--mib", "0.05", "--reps", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert set(r["formats"]) == set(create("cuda").weight_dtypes)
    assert all(v["rel_err"] < 1e-4 and v["us"] > 0 for v in r["formats"].values())


def test_slot_misses_are_staged_in_pinned_memory(gpu):
    """A slot miss is read into page-locked host memory (cudaHostAlloc through CuPy), which the copy to
    the device reads by DMA; the slot pool's results on cuda are test_slots.py's."""
    from colibri_edge import Engine
    from colibri_edge.model.demo import SHIPPED
    import cupy
    def pinned(a):                  # numpy.frombuffer's base: the exporter, or a memoryview of it
        owner = a.base.obj if isinstance(a.base, memoryview) else a.base
        return isinstance(owner, cupy.cuda.PinnedMemoryPointer)
    be = create("cuda")
    st = be.alloc_staging(1000)
    assert st.dtype == np.uint8 and st.shape == (1000,) and st.flags.writeable and pinned(st)
    with Engine.open(SHIPPED, backend="cuda", expert_slots=4) as eng:
        made, alloc = [], eng.backend.alloc_staging       # the pool asks on its first miss, per thread

        def spy(n):
            made.append(alloc(n))
            return made[-1]
        eng.backend.alloc_staging = spy
        eng.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True)
        assert eng.slot_stats["misses"] > 0 and made and all(pinned(a) for a in made)
