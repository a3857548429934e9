"""Shared fixtures: the backends present, and the variants each backend's suites run with.

Every backend runs the same parametrized suites (test_kernels.py against the NumPy reference,
test_parity.py / test_weight_types.py / test_generation.py against transformers). What differs
per backend is only which variants reach its code paths, in the two tables below.
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))     # the tests' own helpers (hf_models); the package is installed

from colibri_edge.backends import probe  # noqa: E402

# Backends the machine is expected to have: a missing one fails instead of skipping, so a broken
# install can never pass as "skipped" in CI (.ci/run sets this).
REQUIRED = {b for b in os.environ.get("COLIBRI_REQUIRE_BACKENDS", "").split(",") if b}
ALL_BACKENDS = ("reference", "cpu", "opencl", "cuda")

# Backend options of the kernel suite (create(name, **options)): each variant reaches another path.
KERNEL_VARIANTS = {
    "cpu": {"": {}, "1thread": {"num_threads": 1}, "f32act": {"int8_activations": False}},
    "opencl": {"": {}, "3queues": {"num_streams": 3}},
    "cuda": {"": {}, "3streams": {"num_streams": 3}, "nocublas": {"use_cublas": False}},
}
# Engine.open options of the whole-model suites: prefill chunks that reach each matmul path
# (GEMV / blocked / tiled or cuBLAS sized steps), block sizes, and queue or stream counts.
# fp32 compute everywhere (disable_fp16) where the backend has an fp16 mode: parity is at 1e-4.
ENGINE_VARIANTS = {
    "reference": {"": {}},
    "cpu": {"": {}, "chunk5": {"prefill_chunk": 5, "kv_block_size": 3}},
    "opencl": {"": {"disable_fp16": True}, "chunk8-3queues": {"disable_fp16": True, "prefill_chunk": 8,
                                                                 "kv_block_size": 4, "num_streams": 3}},
    "cuda": {"": {"disable_fp16": True}, "chunk6": {"disable_fp16": True, "prefill_chunk": 6},
             "2streams": {"disable_fp16": True, "num_streams": 2}},
}


def backend_available(name):
    ok, detail = probe(name)
    if not ok and name in REQUIRED:
        pytest.fail(f"backend {name} is required here (COLIBRI_REQUIRE_BACKENDS) but unavailable: {detail}")
    return ok, detail


def _need(name):
    ok, detail = backend_available(name)
    if not ok:
        pytest.skip(f"backend {name} unavailable: {detail}")


@pytest.fixture(params=ALL_BACKENDS)
def backend_name(request):
    _need(request.param)
    return request.param


@pytest.fixture(params=[b for b in ALL_BACKENDS if b != "reference"])
def fast_backend_name(request):
    """Backends tested against the NumPy reference."""
    _need(request.param)
    return request.param


def _pairs(table, names):
    return [pytest.param((b, opts), id=f"{b}-{v}" if v else b) for b in names for v, opts in table[b].items()]


@pytest.fixture(params=_pairs(KERNEL_VARIANTS, [b for b in ALL_BACKENDS if b != "reference"]))
def kernel_backend(request):
    """(backend name, create() options) for every backend but the reference, in every kernel variant."""
    _need(request.param[0])
    return request.param


@pytest.fixture(params=_pairs(ENGINE_VARIANTS, ALL_BACKENDS))
def engine_variant(request):
    """(backend name, Engine.open options) for every backend, in every whole-model variant."""
    _need(request.param[0])
    return request.param


def _default_precision(opts):
    return {k: v for k, v in opts.items() if k != "disable_fp16"}


@pytest.fixture(params=[pytest.param((b, _default_precision(o)), id=i.id) for i in _pairs(ENGINE_VARIANTS, ALL_BACKENDS)
                        for b, o in [i.values[0]]])
def precision_variant(request):
    """engine_variant in the backend's default precision (fp16 compute where it has one): how the
    reduced-precision suites (test_weight_types.py) run."""
    _need(request.param[0])
    return request.param


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def fp32(name) -> dict:
    """Engine.open options for float32 compute on `name` (backends with an fp16 mode take disable_fp16)."""
    from colibri_edge.backends import backend_class
    return {"disable_fp16": True} if "disable_fp16" in backend_class(name).OPTIONS else {}


# The cpu backend decodes block formats with int8 activations by default (llama.cpp's arithmetic:
# activation quantisation error on purpose, checked exactly against a NumPy emulation in
# test_kernels.py); whole-model parity at float32 tolerance runs with it off, and the default is
# held to the error int8 activations make.
INT8_ACTIVATION_TOL = 0.05            # median over positions of |logit error| / |logits| (L2): measured
# 0.3-2% on the test models; a top-k expert choice that flips at one position (the activations'
# rounding moved a router logit past another) gives that position 30-50%, hence the median


def activation_runs(name, opts, tol):
    """[(Engine.open options, tolerance)] for a whole model in block formats on backend `name`."""
    from colibri_edge.backends import backend_class
    if "int8_activations" in backend_class(name).OPTIONS:
        return [({**opts, "int8_activations": False}, tol), ({**opts, "int8_activations": True}, INT8_ACTIVATION_TOL)]
    return [(opts, tol)]


def close(got, want, tol) -> bool:
    """Logits agree: within tol of max |logit| everywhere (float32 tolerances), or for the int8
    tolerance the median position within it (L2) and the same argmax at 80% of positions."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if tol < INT8_ACTIVATION_TOL:
        return float(np.abs(got - want).max() / np.abs(want).max()) < tol
    per = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    return float(np.median(per)) < tol and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
