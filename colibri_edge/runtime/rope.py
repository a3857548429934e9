"""Rotary frequencies: the f_i table every backend's rope reads, and the factor a scaled rope puts on
the attention scores.

    default   f_i = theta^(-2i/D),  i < D/2
    yarn      (YaRN, arXiv 2309.00071; transformers' _compute_yarn_parameters)
              pos_i = theta^(2i/D);  extrapolated e_i = 1 / pos_i;  interpolated n_i = 1 / (factor pos_i)
              ramp over the dims low..high where a wavelength turns beta_fast .. beta_slow times in the
              original context L0:   dim(r) = D ln(L0 / (2 pi r)) / (2 ln theta)
              (floored / ceiled when truncate), low = max(dim(beta_fast), 0), high = min(dim(beta_slow), D-1)
              m_i = 1 - clamp((i - low) / (high - low), 0, 1);   f_i = n_i (1 - m_i) + e_i m_i
              cos and sin are multiplied by attention_factor (default 0.1 ln(factor) + 1, 1 when
              factor <= 1; mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given,
              mscale(s, m) = 0.1 m ln(s) + 1): q and k each carry it once, so the scores carry its square, which the
              engine folds into the softmax scale instead (the cache holds unscaled k).
    longrope  (LongRoPE, arXiv 2402.13753; Phi-3.5's) f_i = theta^(-2i/D) / ext_i, ext the short_factor list, or
              long_factor when the engine's context exceeds original_max_position_embeddings (llama.cpp's
              choice; transformers' PhiMoE keeps the short factors and switches only its mscale per call);
              attention factor short_mscale / long_mscale when given, else attention_factor, else
              sqrt(1 + ln(factor) / ln(L0)) (1 when factor <= 1), factor = max_position_embeddings / L0.
    llama3    (Llama 3.1 / 4; transformers' _compute_llama3_parameters) wavelength w_i = 2 pi / f_i: kept where
              w_i < L0 / high_freq_factor, divided by factor where w_i > L0 / low_freq_factor, between them
              (1 - s) f_i / factor + s f_i with s = (L0 / w_i - low_freq_factor) / (high - low); attention factor 1.
    freq_factors  f_i = theta^(-2i/D) / freq_factors_i, attention factor 1: llama.cpp's rope_freqs tensor, in which
              a GGUF file carries its scaling as per-pair divisors (Llama 3.1 / 4 files: their llama3 table).
"""
from __future__ import annotations

import math

import numpy as np

from ..model.validate import YARN_FIELDS  # noqa: F401  (the config's rope-scaling fields)



def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def mscale_all_dim(scaling: dict | None) -> float:
    """DeepSeek's YaRN softmax factor: mscale(factor, mscale_all_dim) when rope_scaling gives
    mscale_all_dim (transformers' yarn_apply_mscale; the scale is multiplied by its square), else 1."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return _mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))


def inv_freq(theta: float, D: int, scaling: dict | None = None, long: bool = False) -> tuple[np.ndarray, float]:
    """-> (f [D/2] float32, attention_factor). scaling: the config's rope_scaling (None: default); long:
    longrope's long factors (the engine's context is past the original one)."""
    pos = np.float32(theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D))
    if not scaling:
        return (np.float32(1.0) / pos).astype(np.float32), 1.0
    if scaling.get("rope_type") == "llama3":
        f = (np.float32(1.0) / pos).astype(np.float32)
        L0, factor = float(scaling["original_max_position_embeddings"]), float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = np.float32(2 * math.pi) / f
        g = np.where(wavelen > np.float32(L0 / lo), f / np.float32(factor), f).astype(np.float32)
        smooth = ((np.float32(L0) / wavelen - np.float32(lo)) / np.float32(hi - lo)).astype(np.float32)
        smoothed = (np.float32(1) - smooth) * g / np.float32(factor) + smooth * g
        medium = ~(wavelen < np.float32(L0 / hi)) & ~(wavelen > np.float32(L0 / lo))
        return np.where(medium, smoothed, g).astype(np.float32), 1.0
    if scaling.get("rope_type") == "freq_factors":
        ff = np.asarray(scaling["freq_factors"], np.float32)
        return (np.float32(1.0) / (ff * pos)).astype(np.float32), 1.0
    if scaling.get("rope_type") == "longrope":
        ext = np.asarray(scaling["long_factor" if long else "short_factor"], np.float32)
        af = scaling.get("long_mscale" if long else "short_mscale", scaling.get("attention_factor"))
        if af is None:
            factor = float(scaling.get("factor", 1.0))
            L0 = float(scaling["original_max_position_embeddings"])
            af = math.sqrt(1 + math.log(factor) / math.log(L0)) if factor > 1 else 1.0
        return (np.float32(1.0) / (ext * pos)).astype(np.float32), float(af)
    factor = float(scaling["factor"])
    af = scaling.get("attention_factor")
    if af is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
        af = _mscale(factor, float(scaling["mscale"])) / _mscale(factor, float(scaling["mscale_all_dim"]))
    af = _mscale(factor) if af is None else float(af)
    L0 = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rot):
        return D * math.log(L0 / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001                      # as transformers: no division by zero
    ramp = np.clip((np.arange(D // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp).astype(np.float32)                 # the extrapolated share
    extra, inter = np.float32(1) / pos, np.float32(1) / (np.float32(factor) * pos)
    return (inter * (np.float32(1) - keep) + extra * keep).astype(np.float32), af
