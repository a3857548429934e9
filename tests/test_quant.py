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
         "q4_k": G.Q4_K, "q5_k": G.Q5_K, "q6_k": G.Q6_K, "q2_k": G.Q2_K, "q3_k": G.Q3_K, "iq4_nl": G.IQ4_NL,
         "iq4_xs": G.IQ4_XS, "tq1_0": G.TQ1_0, "tq2_0": G.TQ2_0, "nvfp4": G.NVFP4, "iq2_xxs": G.IQ2_XXS,
         "iq2_xs": G.IQ2_XS, "iq2_s": G.IQ2_S, "iq3_xxs": G.IQ3_XXS, "iq3_s": G.IQ3_S, "iq1_s": G.IQ1_S, "iq1_m": G.IQ1_M}
WRITABLE = sorted(quant.QUANTIZERS)             # the lattice i-quants have no quantiser (llama.cpp's needs an imatrix)


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


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "tq1_0", "tq2_0"])
def test_32_block_quantisers_are_gguf_byte_for_byte(fmt, rng):
    """The quantisers gguf-py has (the 32-blocks and the ternary types), byte for byte."""
    x = (rng.standard_normal((33, 512)) * rng.uniform(0.01, 3, (33, 1))).astype(np.float32)
    x[3] = 0                                  # an all-zero row, and a zero block in another
    x[5, :32] = 0
    x[7, 40] = 50.0                           # an outlier
    want = gguf.quants.quantize(x, TYPES[fmt])
    np.testing.assert_array_equal(quant.quantize(x, fmt), want.reshape(33, -1))


@pytest.mark.parametrize("fmt", WRITABLE)
def test_quantised_rows_read_back_by_gguf(fmt, rng):
    """narrow() -> bytes gguf decodes to what widen() decodes, close to the input."""
    B, _ = quant.BLOCK[fmt]
    x = rng.standard_normal((9, 2 * 256)).astype(np.float32)
    raw = narrow(x, fmt)
    ours = widen(raw, fmt)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, TYPES[fmt]))
    assert ours.shape == x.shape
    rms = np.sqrt(((ours - x) ** 2).mean() / (x ** 2).mean())
    assert 0 < rms < {"q2_k": 0.35, "tq1_0": 0.85, "tq2_0": 0.85}.get(fmt, 0.2), rms     # ternary: {-d, 0, d}


def _rms(x, fmt):
    return float(np.sqrt(((widen(narrow(x, fmt), fmt) - x) ** 2).mean() / (x ** 2).mean()))


def test_k_quants_beat_the_32_blocks_of_the_same_bits(rng):
    """The K-quants' fitted scales and mins: lower error than round-to-nearest of the same width
    (q4_k vs q4_1, q5_k vs q5_1), and more bits less error (q4 > q5 > q6 > q8)."""
    x = (rng.standard_normal((64, 1024)) * rng.uniform(0.2, 2, (64, 1))).astype(np.float32)
    e = {f: _rms(x, f) for f in WRITABLE}
    assert e["q4_k"] < e["q4_1"] < e["q4_0"]
    assert e["q5_k"] < e["q5_1"] < e["q5_0"]
    assert e["q4_k"] > e["q5_k"] > e["q6_k"] > e["q8_0"]
    assert e["q2_k"] > e["q3_k"] > e["q4_k"]
    assert e["iq4_nl"] < e["q4_0"] and e["iq4_xs"] < e["q4_0"]    # the non-linear levels fit a bell better
    assert e["nvfp4"] < e["mxfp4"]                                  # a scale per 16, not per 32


def test_lattice_grids_and_signs_are_gguf_s():
    """The i-quants' tables (iq_grids.npz, written by toolchains/gguf/iq_grids.py) entry for entry as
    gguf-py holds them, so every grid index decodes as gguf-py decodes it; KSIGNS as gguf-py's."""
    from gguf import quants as Q
    for name, cls in {"iq2xxs": Q.IQ2_XXS, "iq2xs": Q.IQ2_XS, "iq2s": Q.IQ2_S, "iq3xxs": Q.IQ3_XXS, "iq3s": Q.IQ3_S,
                      "iq1s": Q.IQ1_S}.items():
        cls.init_grid()
        np.testing.assert_array_equal(quant.iq_grid(name).astype(np.float32), np.asarray(cls.grid).reshape(cls.grid_shape))
    np.testing.assert_array_equal(quant.KSIGNS, np.frombuffer(Q.IQ2_XXS.ksigns, np.uint8))


def test_iq4_levels_are_nearest_ties_upward():
    """best_index_iq4nl: the nearest IQ4NL level, a midpoint going to the larger (ggml's best_index_int8)."""
    lv = quant.IQ4NL.astype(np.float32)
    v = np.concatenate([lv, (lv[:-1] + lv[1:]) / 2, lv[:-1] + 0.25, [-1e9, 1e9]]).astype(np.float32)
    d = np.abs(lv.astype(np.float64)[None, :] - v.astype(np.float64)[:, None])
    want = np.array([np.flatnonzero(r == r.min()).max() for r in d])
    np.testing.assert_array_equal(quant.best_index_iq4nl(v), want)


def test_ue4m3_as_gguf(rng):
    """The NVFP4 scale byte: every byte decodes as gguf-py does, and encoding matches gguf-py's
    fp32_to_ue4m3 (ggml's) over the whole range, subnormals and saturation included."""
    b = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(quant.ue4m3_half(b), gguf.quants.NVFP4.ue4m3_to_fp32(b).astype(np.float32))
    v = np.concatenate([rng.uniform(0, 500, 4000), rng.uniform(0, 0.02, 1000), [0, 448, 1e6]]).astype(np.float32)
    np.testing.assert_array_equal(quant.ue4m3(v), gguf.quants.NVFP4.fp32_to_ue4m3(v))


@pytest.mark.parametrize("fmt", WRITABLE)
def test_quantise_refuses_partial_blocks(fmt):
    B, _ = quant.BLOCK[fmt]
    with pytest.raises(ValueError, match="multiple"):
        quant.quantize(np.zeros((2, B + 16), np.float32), fmt)
