"""ggml's block formats (colibri_edge/model/quant.py) against gguf-py, the format's own Python package:
the reference dequantisation on random blocks of every type, the 32-block quantisers byte for byte,
and every quantiser's output read back by gguf. (The K-quant quantisers against llama.cpp's own, on
the same weights: `make bench`, benchmarks/quant_error.py.)"""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf extra is part of make test's install")
from gguf import GGMLQuantizationType as G  # noqa: E402

from colibri_edge.model import quant  # noqa: E402
from colibri_edge.model.dtypes import narrow, widen  # noqa: E402

TYPES = {"q8_0": G.Q8_0, "q4_0": G.Q4_0, "q4_1": G.Q4_1, "q5_0": G.Q5_0, "q5_1": G.Q5_1, "mxfp4": G.MXFP4,
         "q4_k": G.Q4_K, "q5_k": G.Q5_K, "q6_k": G.Q6_K}


def test_every_block_format_is_covered():
    assert set(TYPES) == set(quant.BLOCK)
    for fmt, t in TYPES.items():
        assert quant.BLOCK[fmt] == gguf.GGML_QUANT_SIZES[t], fmt


@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_dequantize_random_blocks_as_gguf(fmt, rng):
    """Random bytes are valid blocks of every format (a NaN scale gives NaNs in both)."""
    B, nb = quant.BLOCK[fmt]
    raw = rng.integers(0, 256, (7, 3 * nb), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(raw, TYPES[fmt])
        got = quant.dequantize(raw, fmt, 3 * B)
    assert got.shape == want.shape == (7, 3 * B)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"])
def test_32_block_quantisers_are_gguf_byte_for_byte(fmt, rng):
    x = (rng.standard_normal((33, 512)) * rng.uniform(0.01, 3, (33, 1))).astype(np.float32)
    x[3] = 0                                  # an all-zero row, and a zero block in another
    x[5, :32] = 0
    x[7, 40] = 50.0                           # an outlier
    want = gguf.quants.quantize(x, TYPES[fmt])
    np.testing.assert_array_equal(quant.quantize(x, fmt), want.reshape(33, -1))


@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_quantised_rows_read_back_by_gguf(fmt, rng):
    """narrow() -> bytes gguf decodes to what widen() decodes, close to the input."""
    B, _ = quant.BLOCK[fmt]
    x = rng.standard_normal((9, 2 * 256)).astype(np.float32)
    raw = narrow(x, fmt)
    ours = widen(raw, fmt)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, TYPES[fmt]))
    assert ours.shape == x.shape
    rms = np.sqrt(((ours - x) ** 2).mean() / (x ** 2).mean())
    assert 0 < rms < 0.2, rms


def _rms(x, fmt):
    return float(np.sqrt(((widen(narrow(x, fmt), fmt) - x) ** 2).mean() / (x ** 2).mean()))


def test_k_quants_beat_the_32_blocks_of_the_same_bits(rng):
    """The K-quants' fitted scales and mins: lower error than round-to-nearest of the same width
    (q4_k vs q4_1, q5_k vs q5_1), and more bits less error (q4 > q5 > q6 > q8)."""
    x = (rng.standard_normal((64, 1024)) * rng.uniform(0.2, 2, (64, 1))).astype(np.float32)
    e = {f: _rms(x, f) for f in TYPES}
    assert e["q4_k"] < e["q4_1"] < e["q4_0"]
    assert e["q5_k"] < e["q5_1"] < e["q5_0"]
    assert e["q4_k"] > e["q5_k"] > e["q6_k"] > e["q8_0"]


@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_quantise_refuses_partial_blocks(fmt):
    B, _ = quant.BLOCK[fmt]
    with pytest.raises(ValueError, match="multiple"):
        quant.quantize(np.zeros((2, B + 16), np.float32), fmt)
