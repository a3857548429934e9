"""What only the OpenCL backend has (its kernels, queues and whole models run in the shared suites,
test_kernels.py and test_parity.py): probing and platform listing, buffer views, options, error
mapping, and the Oclgrind check with a planted bug."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import REQUIRED, backend_available
from colibri_edge.errors import (ColibriError, COLIBRI_ERR_BACKEND, COLIBRI_ERR_OUT_OF_MEMORY,
                                 COLIBRI_ERR_UNAVAILABLE)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLCHAIN = os.path.join(ROOT, "toolchains", "opencl")


@pytest.fixture(scope="module")
def ocl():
    ok, detail = backend_available("opencl")
    if not ok:
        pytest.skip(f"backend opencl unavailable: {detail}")
    from colibri_edge.backends.opencl import platforms
    return platforms


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


def test_default_device_is_one_that_compiles(ocl, monkeypatch):
    """With CPU devices only, the default is the first whose compiler builds a kernel (pip's PoCL 3.0
    builds nothing on CPUs newer than its LLVM 14; Debian's PoCL beside it does); the device the
    backend opens here builds."""
    import pyopencl as cl
    from colibri_edge.backends.opencl import runtime as rt
    be = _be()
    assert rt._compiles(cl, be.dev)

    class Dev:
        type = cl.device_type.CPU

        def __init__(self, ok):
            self.ok = ok
    broken, working = Dev(False), Dev(True)
    monkeypatch.setattr(rt, "_all_devices", lambda cl: [(None, broken), (None, working)])
    monkeypatch.setattr(rt, "_compiles", lambda cl, d: d.ok)
    assert rt._pick_device(cl) is working
    assert rt._pick_device(cl, 0) is broken                     # asked for by index: taken as asked
    monkeypatch.setattr(rt, "_all_devices", lambda cl: [(None, broken)])
    assert rt._pick_device(cl) is broken                        # none builds: its build error says why


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
    from colibri_edge.model.dtypes import WEIGHT_DTYPES
    be = _be()
    assert set(be.weight_dtypes) == set(WEIGHT_DTYPES)      # every weight type and block format, lattice i-quants too
    be.upload(np.zeros((2, 66), np.uint8), "iq2_xxs", shape=(2, 256))     # a lattice format is taken
    for wd in ("q8_k", "iq5_xxs"):                   # ggml's Q8_K (no weight type) and an invented name: refused, named
        with pytest.raises(ColibriError) as e:
            be.upload(np.zeros((2, 292), np.uint8), wd, shape=(2, 256))
        assert e.value.code == COLIBRI_ERR_UNAVAILABLE and wd in e.value.message


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
        from colibri_edge.backends.opencl import runtime
        be.shared.program(cl, "dense.cl", f"{runtime.CL_STD} {runtime.DEFINES} -DWF16=0 -DCOLIBRI_HALF_MATH=1")
    assert e.value.code == COLIBRI_ERR_BACKEND and "dense.cl" in e.value.message


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
import numpy as np
from colibri_edge.backends.opencl import backend as ocl, runtime
PLANT = {plant!r}
if PLANT:       # rmsnorm's sum of squares reads one element past each row: past the buffer on the last
    orig = runtime.kernel_source
    good = "for (int i = l; i < D; i += L)\n        s += xr[i] * xr[i];"
    bad = "for (int i = l; i <= D; i += L)\n        s += xr[i] * xr[i];"
    def planted(name):
        src = orig(name)
        assert name != "dense.cl" or good in src
        return src.replace(good, bad)
    runtime.kernel_source = planted
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
    script.write_text(PLANTED.format(plant=plant))
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


def test_step_counts_launches_and_round_trips(ocl):
    """`colibri run --stats` prints what a step costs the host (issue 22): a decode step writes its
    inputs once and reads the logits once, nothing in between (the expert plan stays on the device),
    and a MoE layer is six launches (router, route, align, grouped gate/up, grouped down, combine)
    with q, k and v as one launch (baseline before: 80 launches, 5 reads on this model)."""
    from colibri_edge import Engine
    from colibri_edge.model.demo import SHIPPED
    with Engine.open(SHIPPED, backend="opencl") as eng:
        be = eng.backend
        names, launch = [], be._launch

        def spy(kernel_key, *a, **kw):
            names.append(kernel_key[1][1])
            return launch(kernel_key, *a, **kw)
        be._launch = spy
        eng.generate([1, 2, 3], max_new_tokens=6, ignore_eos=True)
        c = be.step_counts()
        moe = sum(1 for l in eng.config["layers"] if l["type"] != "dense")
        assert c["steps"] >= 5 and c["reads"] == 1 and c["writes"] == 1
        names.clear()
        eng.generate([4], max_new_tokens=1, ignore_eos=True)         # one step: T = 1
        assert names.count("ffn_gate_up_grouped") == names.count("ffn_down_grouped") == moe
        assert names.count("ffn_gate_up") == 0 and names.count("matmul3") == len(eng.config["layers"])
        per_moe = ["route", "align", "ffn_gate_up_grouped", "ffn_down_grouped", "combine"]
        assert sum(names.count(n) for n in per_moe) + moe == 6 * moe       # + the router's matmul
        assert f"{c['launches']:.0f} kernel launches" in be.describe()