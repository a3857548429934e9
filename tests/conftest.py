import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import colibri_edge  # noqa: E402,F401  (maps backends/ when run from source)
from colibri_edge.backends import probe  # noqa: E402

# Backends the machine is expected to have: a missing one fails instead of skipping, so a broken
# install can never pass as "skipped" in CI (.ci/run sets this).
REQUIRED = {b for b in os.environ.get("COLIBRI_REQUIRE_BACKENDS", "").split(",") if b}
ALL_BACKENDS = ("reference", "cpu", "opencl", "cuda")


def backend_available(name):
    ok, detail = probe(name)
    if not ok and name in REQUIRED:
        pytest.fail(f"backend {name} is required here (COLIBRI_REQUIRE_BACKENDS) but unavailable: {detail}")
    return ok, detail


@pytest.fixture(params=ALL_BACKENDS)
def backend_name(request):
    ok, detail = backend_available(request.param)
    if not ok:
        pytest.skip(f"backend {request.param} unavailable: {detail}")
    return request.param


@pytest.fixture(params=[b for b in ALL_BACKENDS if b != "reference"])
def fast_backend_name(request):
    """Backends tested against the NumPy reference."""
    ok, detail = backend_available(request.param)
    if not ok:
        pytest.skip(f"backend {request.param} unavailable: {detail}")
    return request.param


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
