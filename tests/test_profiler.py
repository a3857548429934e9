"""Engine.open(profile=True) (runtime/profiler.py): every step timed by phase without changing what the
engine computes; each operation charged once (nested backend calls are not counted twice)."""
import pytest

from colibri_edge import Engine
from colibri_edge.model.demo import ensure_default_model
from colibri_edge.runtime.profiler import PHASES


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_profiled_steps_by_phase(backend):
    from helpers import need
    need(backend)
    with Engine.open(ensure_default_model()[0], backend=backend) as plain:
        want = list(plain.generate("Once upon a time", max_new_tokens=24, temperature=0.8, seed=1))
    with Engine.open(ensure_default_model()[0], backend=backend, profile=True) as eng:
        got = list(eng.generate("Once upon a time", max_new_tokens=24, temperature=0.8, seed=1))
        s = eng.profiler.summary()
        rows = list(eng.profiler.ring)
        assert eng.backend.matmul.__name__ == "timed"
    assert got == want
    assert s["steps"] == 24 and s["decode_steps"] == 23 and list(s["phases_ms"]) == list(PHASES)
    for r in rows:                        # per step the phases add up to the step's wall time exactly
        assert abs(sum(r[p] for p in PHASES) - r["step"]) < 1e-9 and all(r[p] >= 0 for p in PHASES)
        assert r["attention"] > 0 and r["experts"] > 0 and r["lm_head"] > 0
    assert eng.closed and eng.backend.matmul.__name__ != "timed"          # close() restored the backend
