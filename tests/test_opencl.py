"""The OpenCL backend beyond the shared kernel suite (tests/test_kernels.py runs it too):
probing, views, queues, error mapping, whole models against transformers, and the Oclgrind check."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REQUIRED, backend_available
from colibri_edge.errors import (ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_OUT_OF_MEMORY,
                                 COLIBRI_ERR_UNAVAILABLE)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLCHAIN = os.path.join(ROOT, "toolchains", "opencl")


@pytest.fixture(scope="module")
def ocl():
    ok, detail = backend_available("opencl")
    if not ok:
        pytest.skip(f"backend opencl unavailable: {detail}")
    from colibri_edge.backends.opencl import backend
    return backend


def _be(**kw):
    from colibri_edge.backends import create
    return create("opencl", **kw)


def _dev(be, host):
    buf = be.alloc(host.shape, host.dtype)
    be.upload_into(buf, np.ascontiguousarray(host))
    return buf


# -- probing -----------------------------------------------------------------------------------------
def test_probe_and_describe(ocl):
    import pyopencl as cl
    ok, detail = ocl.probe(for_auto=False)
    assert ok and detail
    rows = ocl.describe_platforms()
    assert rows and {"platform", "device", "device_version", "compute_units", "global_mem_bytes", "fp16"} <= set(rows[0])
    assert ocl.format_platforms(rows).count("\n") == len(rows) - 1
    devs = ocl._all_devices(cl)
    ok_auto, detail_auto = ocl.probe(for_auto=True)
    if all(d.type & cl.device_type.CPU for _, d in devs):      # PoCL only: auto must never take it
        assert not ok_auto and "CPU" in detail_auto
        from colibri_edge.backends import create
        assert create("auto").name != "opencl"
    else:
        assert ok_auto


def test_no_platform_hint_and_unavailable(ocl, monkeypatch):
    monkeypatch.setattr(ocl, "_platforms", lambda cl: [])
    ok, detail = ocl.probe()
    assert not ok and "pocl-binary-distribution" in detail and "pocl-opencl-icd" in detail and "Mali" in detail
    assert ocl.describe_platforms() == []
    from colibri_edge.backends import create
    with pytest.raises(ColibriError) as e:
        create("opencl")
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE


# -- memory and views --------------------------------------------------------------------------------
def test_views_slices_and_reshape(ocl, rng):
    be = _be()
    x = rng.standard_normal((9, 12)).astype(np.float32)
    xb = _dev(be, x)
    v = xb[3:7]                                  # a view with an offset
    np.testing.assert_array_equal(be.download(v), x[3:7])
    np.testing.assert_array_equal(be.download(v.reshape(4, 3, 4)), x[3:7].reshape(4, 3, 4))
    w = rng.standard_normal((5, 12)).astype(np.float32)
    out = be.alloc((9, 5))
    be.matmul(out[2:6], v, be.upload(w))        # kernels take (buffer, offset) pairs: views at any row
    got = be.download(out)
    np.testing.assert_allclose(got[2:6], x[3:7] @ w.T, rtol=1e-5, atol=1e-5)
    assert not got[:2].any() and not got[6:].any()
    be.upload_into(xb[1:2], np.full((1, 12), 7, np.float32))
    assert (be.download(xb)[1] == 7).all() and (be.download(xb)[0] == x[0]).all()
    ids = _dev(be, np.array([4, 0, 4], np.int32))
    sel = be.alloc((3, 12))
    be.embed(sel, xb, ids)                       # row gather from a plain float32 buffer
    np.testing.assert_array_equal(be.download(sel), be.download(xb)[[4, 0, 4]])
    assert be.alloc((4, 3), np.int32).dtype == np.int32 and not be.download(be.alloc((4, 3), np.int32)).any()


def test_options(ocl):
    be = _be(disable_fp16=True, num_streams=3)
    assert not be.half_math and len(be.queues) == 3
    assert ("cl_khr_fp16" in be.dev.extensions) == be.fp16_device
    assert _be().half_math == be.fp16_device     # half arithmetic only where the device has it
    with pytest.raises(ColibriError):
        _be(num_streams=0)
    with pytest.raises(ColibriError) as e:
        _be().upload(np.zeros((2, 2), np.int8), "int8")
    assert e.value.code == COLIBRI_ERR_UNAVAILABLE


# -- errors ------------------------------------------------------------------------------------------
def test_error_mapping(ocl):
    be = _be()
    k = be._kernel("dense.cl", "add")
    a = be.alloc((8,))
    with pytest.raises(ColibriError) as e:         # a work-group larger than the device allows
        be._launch(k, (8,), (be.max_wg * 2,), a, a, a, a, 0, 8, 8)
    assert e.value.code == COLIBRI_ERR_BACKEND
    assert "CL_INVALID_WORK_GROUP_SIZE" in e.value.message and "add" in e.value.message
    with pytest.raises(ColibriError) as e:         # more than the device's largest allocation
        be.alloc((int(be.dev.max_mem_alloc_size) // 4 + 1024,))
    assert e.value.code in (COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_BACKEND) and "OpenCL error CL_" in e.value.message
    import pyopencl as cl
    with pytest.raises(ColibriError) as e:         # a kernel that does not compile
        be.shared.program(cl, "dense.cl", ocl.CL_STD + " -DWF16=0 -DCOLIBRI_HALF_MATH=1")
    assert e.value.code == COLIBRI_ERR_BACKEND and "dense.cl" in e.value.message


# -- queues ------------------------------------------------------------------------------------------
def test_results_do_not_depend_on_queues(ocl, rng):
    from colibri_edge.backends.base import FFN
    T, E, k, H, I = 21, 9, 3, 37, 29
    logits = rng.standard_normal((T, E)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    mats = [[rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in [(I, H), (I, H), (H, I)]]
            for _ in range(E)]
    outs = []
    for n in (1, 2, 4):
        be = _be(num_streams=n)
        ex = [FFN(*(be.upload(m) for m in ms)) for ms in mats]
        ids, w = be.alloc((T, k), np.int32), be.alloc((T, k))
        be.route(ids, w, _dev(be, logits), k, "topk", True)
        plan = be.align(be.alloc_plan(T * k, E), ids, T, E, k)
        y = be.alloc((T * k, H))
        be.grouped_ffn(y, _dev(be, x), ex, plan, be.alloc((T * k, 2 * I)))
        out = _dev(be, x)
        be.combine(out, y, w, plan)
        outs.append(be.download(out))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


# -- whole models ------------------------------------------------------------------------------------
def _cases():
    from hf_models import CASES
    return list(CASES)


def _ids(V, n, seed):
    return np.random.default_rng(seed).integers(0, V, n).astype(np.int32)


def _expert_trace(engine):
    trace = {}

    def obs(layer, ids, weights):
        trace.setdefault(layer, []).append(np.array(engine.backend.download(ids)))
    engine.runner.observers.append(obs)
    return trace


@pytest.mark.parametrize("case", _cases())
def test_model_matches_transformers(ocl, case, model_cache):
    pytest.importorskip("transformers")
    from hf_models import convert_case, hf_logits
    from colibri_edge import Engine
    hf, col = convert_case(model_cache, case)
    with Engine.open(col, backend="reference") as ref:
        V = ref.config["vocab_size"]
        ids = np.stack([_ids(V, 13, 1), _ids(V, 13, 2)])
        ref_trace = _expert_trace(ref)
        ref.infer(ids)
    want = hf_logits(hf, ids)
    with Engine.open(col, backend="opencl", prefill_chunk=8, kv_block_size=4) as eng:
        trace = _expert_trace(eng)
        got = eng.infer(ids)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-4, f"{case}: max error {err:.3g} relative to max |logit|"
    # the same experts for every token and layer (prefill chunks differ, so compare concatenated)
    assert trace.keys() == ref_trace.keys()
    for layer in trace:
        np.testing.assert_array_equal(np.concatenate(trace[layer]), np.concatenate(ref_trace[layer]),
                                      err_msg=f"{case} layer {layer}: expert ids differ from the reference")


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "olmoe"])
def test_decode_matches_prefill_with_streams(ocl, case, model_cache):
    """Paged decode (one token per step, several sequences) gives the logits of a full prefill,
    with 1 or 3 queues."""
    pytest.importorskip("transformers")
    from hf_models import convert_case
    from colibri_edge import Engine
    _, col = convert_case(model_cache, case)
    with Engine.open(col, backend="opencl", kv_block_size=3) as eng:
        V = eng.config["vocab_size"]
        prompts = [_ids(V, 5, 3).tolist(), _ids(V, 2, 4).tolist()]
        gens = eng.generate_batch(prompts, max_new_tokens=6)
        full = eng.infer([np.array(p + g[:-1]) for p, g in zip(prompts, gens)])
        for p, g, logits in zip(prompts, gens, full):
            assert np.argmax(logits[len(p) - 1:], axis=-1).tolist() == g
    with Engine.open(col, backend="opencl", kv_block_size=3, num_streams=3) as eng3:
        gens3 = eng3.generate_batch(prompts, max_new_tokens=6)
        full3 = eng3.infer([np.array(p + g[:-1]) for p, g in zip(prompts, gens)])
    assert gens3 == gens
    for a, b in zip(full, full3):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", _cases())
def test_float16_teacher_forced_greedy(ocl, case, model_cache):
    pytest.importorskip("transformers")
    from hf_models import convert_case, hf_greedy, hf_logits
    from colibri_edge import Engine
    hf, col = convert_case(model_cache, case, out_dtype="float16")
    with Engine.open(col, backend="opencl") as eng:
        assert eng.config["weight_dtype"] == "float16"
        V = eng.config["vocab_size"]
        prompt = _ids(V, 6, 5).tolist()
        cont = hf_greedy(hf, prompt, 12)
        seq = np.array(prompt + cont, np.int32)
        got = eng.infer(seq)[0]
    want = hf_logits(hf, seq[None])[0]
    err = float(np.abs(got - want).max())
    checked = 0
    for i in range(len(prompt) - 1, len(seq) - 1):
        top2 = np.sort(want[i])[-2:]
        if top2[1] - top2[0] < 10 * err:
            continue                                  # too close to call at this precision
        assert int(np.argmax(got[i])) == int(np.argmax(want[i])) == int(seq[i + 1]), f"{case}: position {i}"
        checked += 1
    assert checked >= 1, f"{case}: every position excused (logit error {err:.3g})"


# -- Oclgrind ----------------------------------------------------------------------------------------
def _oclgrind_or_skip():
    if shutil.which("oclgrind") is None:
        if "opencl" in REQUIRED:
            pytest.fail("oclgrind is required with the opencl backend (`make -C toolchains/opencl setup`)")
        pytest.skip("oclgrind not installed (`make -C toolchains/opencl setup`)")
    sys.path.insert(0, TOOLCHAIN)
    import oclgrind_check
    return oclgrind_check


PLANTED = r'''
import sys
sys.path.insert(0, {root!r})
import numpy as np
import colibri_edge
from colibri_edge.backends.opencl import backend as ocl
PLANT = {plant!r}
if PLANT:       # rmsnorm's sum of squares reads one element past each row: past the buffer on the last
    orig = ocl.kernel_source
    good = "for (int i = l; i < D; i += L)\n        s += xr[i] * xr[i];"
    bad = "for (int i = l; i <= D; i += L)\n        s += xr[i] * xr[i];"
    def planted(name):
        src = orig(name)
        assert name != "dense.cl" or good in src
        return src.replace(good, bad)
    ocl.kernel_source = planted
be = ocl.Backend()
print("COLIBRI_OCLGRIND_PLATFORM=" + be.dev.platform.name.strip())
x = be.alloc((3, 20))
be.upload_into(x, np.random.default_rng(0).standard_normal((3, 20)).astype(np.float32))
out = be.alloc((3, 20))
be.rmsnorm(out, x, be.upload(np.ones(20, np.float32)), 1e-6)
be.synchronize()
print(be.download(out)[0, :2])
'''


@pytest.mark.parametrize("plant", [False, True])
def test_oclgrind_check_catches_planted_out_of_bounds(ocl, plant, tmp_path):
    oc = _oclgrind_or_skip()
    script = tmp_path / "kernel.py"
    script.write_text(PLANTED.format(root=ROOT, plant=plant))
    ok, report, out = oc.run_checked([sys.executable, str(script)], str(tmp_path / "oclgrind.log"), timeout=600)
    if plant:
        assert not ok and "out-of-bounds" in report and "rmsnorm" in report, report
    else:
        assert ok, report
    # the command-line form exits non-zero on the planted kernel
    if plant:
        p = subprocess.run([sys.executable, os.path.join(TOOLCHAIN, "oclgrind_check.py"), "run", "--",
                            sys.executable, str(script)], capture_output=True, text=True, timeout=600)
        assert p.returncode == 1 and "out-of-bounds" in p.stdout


def test_oclgrind_log_scanner():
    sys.path.insert(0, TOOLCHAIN)
    import oclgrind_check as oc
    log = ("\nInvalid read of size 4 at global memory address 0x2000000000040\n\tKernel: shift\n\tEntity: x\n\n"
           "Read-write data race at local memory address 0x1000000000004\n\tKernel: racy\n\n"
           "Uninitialized value written to global memory address 0x3\n\tKernel: u\n\n"
           "Work-group divergence detected (barrier)\n\tKernel: w\n")
    cats = [c for c, _, _ in oc.scan_log(log)]
    assert cats == ["out-of-bounds", "data-race", "uninitialized", "other"]
    assert oc.scan_log("") == []
