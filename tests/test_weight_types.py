"""Reduced-precision weights on every backend that declares them, in each engine variant at the
backend's default precision (fp16 compute on CUDA and on OpenCL devices with cl_khr_fp16; prefill
chunks reaching cuBLAS / tiled / skinny kernels): logits within a stated tolerance
of transformers at float32, and teacher-forced greedy agreement (transformers' greedy continuation
fed back; Colibri's argmax must match at every position, excused only where transformers' top-2
margin is below ten times the measured logit error)."""
import numpy as np
import pytest

from colibri_edge import Engine
from colibri_edge.backends import backend_class
from hf_models import MODEL_TYPES, convert_case, hf_greedy, hf_logits

# max |logit error| / max |logit| against transformers at float32, per weight type. bfloat16 keeps 8
# mantissa bits; on these random test models a rounding can flip a near-tied router choice at one
# position, which moves that position's logits a lot: hence its loose bound (measured: up to 0.14).
TOLERANCE = {"float16": 5e-3, "bfloat16": 0.2, "int8": 0.2}
# int8's per-position error (1-3% of the largest logit, measured: per-row and per-32-block scales
# alike on these models) often exceeds a tenth of the top-2 margin, so few positions are clear-cut
MIN_CLEAR = {"float16": 1 / 3, "bfloat16": 1 / 3, "int8": 0.0}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("wd", sorted(TOLERANCE))
def test_teacher_forced_greedy(precision_variant, model_type, wd, model_cache):
    backend_name, opts = precision_variant
    if wd not in backend_class(backend_name).weight_dtypes:
        pytest.skip(f"{backend_name} does not declare {wd} weights (refused at open: test_parity.py)")
    from colibri_edge.model.convert import convert
    import os
    hf, _ = convert_case(model_cache, model_type)
    col = os.path.join(model_cache, f"col_{model_type}_{wd}")
    if not os.path.exists(os.path.join(col, "config.json")):
        convert(hf, col, dtype=wd, progress=False)
    prompt = [5, 17, 3, 42, 8, 11, 29]
    cont = hf_greedy(hf, prompt, 24)
    seq = np.array(prompt + cont)
    want = hf_logits(hf, seq[None])[0]
    with Engine.open(col, backend=backend_name, **opts) as eng:
        got = eng.infer(seq)[0]
    err = np.abs(got - want).max(axis=-1)                 # measured logit error at each position
    assert err.max() / np.abs(want).max() < TOLERANCE[wd], f"{wd}: rel err {err.max() / np.abs(want).max():.2e}"
    checked = 0
    for p in range(len(prompt) - 1, len(seq) - 1):
        top2 = np.sort(want[p])[-2:]
        if top2[1] - top2[0] < 10 * err[p]:
            continue                                       # excused: too close to call at this precision
        assert int(np.argmax(got[p])) == int(seq[p + 1]), f"position {p}: margin {top2[1] - top2[0]:.3g}, err {err[p]:.3g}"
        checked += 1
    assert checked >= int(MIN_CLEAR[wd] * len(cont)), f"only {checked} of {len(cont)} positions had a clear margin"
