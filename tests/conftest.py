"""Shared fixtures: the backends present, and the variants each backend's suites run with (the
tables and every helper a test uses live in helpers.py; no test imports another test file).

Every backend runs the same parametrized suites (test_kernels.py against the NumPy reference,
test_parity.py / test_weight_types.py / test_generation.py against transformers). What differs
per backend is only which variants reach its code paths, in the two tables below.
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))     # the tests' own helpers (hf_models); the package is installed
# what engines write to Colibri's cache (the learned hot set's heat files, GGUF conversions) goes to a
# directory of this test process, never the user's: one test's routing heat must not pin experts in
# another's engine (a test that wants the cache sets its own)
if "COLIBRI_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["COLIBRI_CACHE_DIR"] = tempfile.mkdtemp(prefix="colibri-test-cache-")

from helpers import ALL_BACKENDS, ENGINE_VARIANTS, KERNEL_VARIANTS, need as _need, pairs as _pairs  # noqa: E402

@pytest.fixture(params=ALL_BACKENDS)
def backend_name(request):
    _need(request.param)
    return request.param


@pytest.fixture(params=[b for b in ALL_BACKENDS if b != "reference"])
def fast_backend_name(request):
    """Backends tested against the NumPy reference."""
    _need(request.param)
    return request.param


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
