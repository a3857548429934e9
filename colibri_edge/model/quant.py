"""ggml's block formats, as llama.cpp and GGUF store them: the layouts, the reference dequantisation
(plain NumPy, written from the format definitions; the oracle of every backend's kernels) and our
own quantisers (llama.cpp's reference algorithms, no importance matrix).

A matrix [N, K] in a block format is N rows of K / B blocks, each block `nbytes` bytes, stored as
uint8 [N, K / B * nbytes]; a block of B weights:

  format  B    bytes  layout (little-endian)                        w[i] =
  q8_0    32   34     d:f16 | q:i8[32]                               d * q[i]
  q4_0    32   18     d:f16 | qs:u8[16]                              d * (nib(i) - 8)
  q4_1    32   20     d:f16 | m:f16 | qs:u8[16]                      d * nib(i) + m
  q5_0    32   22     d:f16 | qh:u32 | qs:u8[16]                     d * (nib(i) | hb(i) << 4) - 16 d
  q5_1    32   24     d:f16 | m:f16 | qh:u32 | qs:u8[16]             d * (nib(i) | hb(i) << 4) + m
  mxfp4   32   17     e:u8 | qs:u8[16]                               2^(e-128) * E2M1x2[nib(i)]
      nib(i) = qs[i] & 15 for i < 16, qs[i - 16] >> 4 after; hb(i) = bit i of qh
  q4_k    256  144    d:f16 | dmin:f16 | scales:u8[12] | qs:u8[128]  d sc_s * nib - dmin m_s  (8 sub-blocks of 32)
  q5_k    256  176    d:f16 | dmin:f16 | scales:u8[12] | qh:u8[32] | qs:u8[128]   d sc_s * (nib | hb << 4) - dmin m_s
  q6_k    256  210    ql:u8[128] | qh:u8[64] | scales:i8[16] | d:f16                 d sc_s * (q6 - 32)  (16 of 16)
      K-quant nibbles: group g of 64 weights reads qs[32 g .. 32 g + 31]: low nibbles are sub-block 2g,
      high nibbles sub-block 2g + 1; q5_k's high bit of sub-block s, weight j, is bit s of qh[j];
      the 6-bit scale and min of sub-block s are get_scale_min_k4 below. q6_k: half h (128 weights),
      part p (0..3) of 32, weight j: low 4 bits from ql[64 h + 32 (p % 2) + j] >> 4 (p // 2), high 2 bits
      (qh[32 h + j] >> 2 p) & 3, scale scales[(128 h + 32 p + j) // 16].
"""
from __future__ import annotations

import numpy as np

QK = 32
QK_K = 256
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
         "mxfp4": (32, 17), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
BLOCK_FORMATS = tuple(BLOCK)
E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)    # doubled e2m1 values


def row_bytes(fmt: str, K: int) -> int:
    B, nb = BLOCK[fmt]
    return K // B * nb


def _f16(b):            # uint8 [..., 2] -> float32 [...]
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs):       # uint8 [..., 16] -> [..., 32]: low nibbles first, then high
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def e8m0_half(e):
    """2^(e - 128) as float32, exactly (ggml_e8m0_to_fp32_half: the doubled E2M1 table halves it back)."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def get_scale_min_k4(scales):
    """uint8 [..., 12] -> (sc, m) uint8 [..., 8]: the 6-bit scales and mins of q4_k / q5_k."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def dequantize(raw: np.ndarray, fmt: str, K: int) -> np.ndarray:
    """uint8 [..., row_bytes] -> float32 [..., K]: the format's definition, in NumPy."""
    B, nb = BLOCK[fmt]
    lead = raw.shape[:-1]
    b = np.asarray(raw, np.uint8).reshape(-1, nb)
    if fmt == "q8_0":
        w = _f16(b[:, 0:2])[:, None] * b[:, 2:].view(np.int8).astype(np.float32)
    elif fmt == "q4_0":
        w = _f16(b[:, 0:2])[:, None] * (_nibbles(b[:, 2:]).astype(np.float32) - 8)
    elif fmt == "q4_1":
        w = _f16(b[:, 0:2])[:, None] * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b[:, 2:4])[:, None]
    elif fmt in ("q5_0", "q5_1"):
        o = 2 if fmt == "q5_0" else 4
        qh = b[:, o:o + 4].copy().view("<u4")[:, 0]
        hb = (qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        q = (_nibbles(b[:, o + 4:]) | (hb.astype(np.uint8) << 4)).astype(np.float32)
        d = _f16(b[:, 0:2])[:, None]
        w = d * (q - 16) if fmt == "q5_0" else d * q + _f16(b[:, 2:4])[:, None]
    elif fmt == "mxfp4":
        w = e8m0_half(b[:, 0])[:, None] * E2M1[_nibbles(b[:, 1:])]
    elif fmt in ("q4_k", "q5_k"):
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = get_scale_min_k4(b[:, 4:16])
        qs = b[:, -128:].reshape(-1, 4, 32)
        nib = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)          # [blocks, sub-block, 32]
        if fmt == "q5_k":
            qh = b[:, 16:48]
            nib = nib | ((((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4))
        w = (d * sc)[..., None] * nib.astype(np.float32) - (dmin * mn)[..., None]
    elif fmt == "q6_k":
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])[:, None]
        lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=2)
        hi = np.stack([(qh >> (2 * p)) & 3 for p in range(4)], axis=2)                 # [blocks, half, part, 32]
        q = ((lo | (hi << 4)).astype(np.float32) - 32).reshape(-1, 16, 16)
        w = (d * sc)[..., None] * q
    else:
        raise ValueError(f"unknown block format {fmt!r}")
    return w.reshape(*lead, K).astype(np.float32)


# -- quantisers (llama.cpp's reference algorithms, NumPy over every block at once) --------------------
def _nearest(x):
    return np.rint(x).astype(np.int32)        # nearest_int: round half to even


def _pack_f16(x):
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _qk32(x):            # float32 [N, K] -> [N * K / 32, 32] blocks
    return np.asarray(x, np.float32).reshape(-1, QK)


def quantize_q8_0(x):
    b = _qk32(x)
    amax = np.abs(b).max(axis=1)
    d = amax / 127
    iq = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = b * iq[:, None]
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)     # roundf: half away from 0
    return np.concatenate([_pack_f16(d), q.view(np.uint8)], axis=1)


def _signed_absmax(b):
    i = np.abs(b).argmax(axis=1)
    return b[np.arange(len(b)), i]


def _inv(d):
    return np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float32)


def _symmetric(b, nmax):
    """q = round(x / d) + nmax in 0..2 nmax - 1 with d = -absmax / nmax (the sign kept: ggml's)."""
    d = _signed_absmax(b) / -nmax
    q = np.clip(np.trunc(b * _inv(d)[:, None] + np.float32(nmax + 0.5)), 0, 2 * nmax - 1).astype(np.uint8)
    return d, q


def _asymmetric(b, top):
    """q = round((x - min) / d) in 0..top with d = (max - min) / top."""
    mn, mx = b.min(axis=1), b.max(axis=1)
    d = (mx - mn) / top
    return d, mn, np.clip(np.trunc((b - mn[:, None]) * _inv(d)[:, None] + np.float32(0.5)), 0, top).astype(np.uint8)


def _qh_bits(q):        # uint8 [blocks, 32] 5-bit values -> uint8 [blocks, 4]: bit i = bit 4 of q[i]
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _nib(q):            # 32 values -> 16 bytes: low nibbles the first half, high nibbles the second
    return (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)


def quantize_q4_0(x):
    d, q = _symmetric(_qk32(x), 8)
    return np.concatenate([_pack_f16(d), _nib(q)], axis=1)


def quantize_q4_1(x):
    d, mn, q = _asymmetric(_qk32(x), 15)
    return np.concatenate([_pack_f16(d), _pack_f16(mn), _nib(q)], axis=1)


def quantize_q5_0(x):
    d, q = _symmetric(_qk32(x), 16)
    return np.concatenate([_pack_f16(d), _qh_bits(q), _nib(q)], axis=1)


def quantize_q5_1(x):
    d, mn, q = _asymmetric(_qk32(x), 31)
    return np.concatenate([_pack_f16(d), _pack_f16(mn), _qh_bits(q), _nib(q)], axis=1)


def quantize_mxfp4(x):
    b = _qk32(x)
    amax = np.abs(b).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2 + 127, 0).astype(np.uint8)
    d = e8m0_half(e)
    err = np.abs(d[:, None, None] * E2M1[None, None, :] - b[:, :, None])
    q = err.argmin(axis=2).astype(np.uint8)                                  # the first of equal errors
    return np.concatenate([e[:, None], q[:, :16] | (q[:, 16:] << 4)], axis=1)


def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep):
    """ggml's make_qkx2_quants over sub-blocks x [S, n] with weights w [S, n]: an affine fit
    scale * L + min (min <= 0) searched over nstep + 1 candidate scales. -> (scale, -min, L)."""
    f32 = np.float32
    mn = np.minimum(x.min(axis=1), 0).astype(f32)
    mx = x.max(axis=1).astype(f32)
    sum_w, sum_x = w.sum(axis=1), (w * x).sum(axis=1)
    flat = mx == mn
    rng_ = np.where(flat, 1, mx - mn).astype(f32)
    iscale = (f32(nmax) / rng_).astype(f32)
    scale = (1 / iscale).astype(f32)
    L = np.clip(_nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = (w * (scale[:, None] * L + mn[:, None] - x) ** 2).sum(axis=1)
    for i in range(nstep + 1):
        isc = ((f32(rmin) + f32(rdelta) * f32(i) + f32(nmax)) / rng_).astype(f32)
        La = np.clip(_nearest(isc[:, None] * (x - mn[:, None])), 0, nmax).astype(f32)
        sl, sl2, sxl = (w * La).sum(axis=1), (w * La * La).sum(axis=1), (w * La * x).sum(axis=1)
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Ds = np.where(ok, D, 1)
        this_scale = (sum_w * sxl - sum_x * sl) / Ds
        this_min = (sl2 * sum_x - sl * sxl) / Ds
        pos = this_min > 0
        this_scale = np.where(pos, sxl / np.where(sl2 > 0, sl2, 1), this_scale)
        this_min = np.where(pos, 0, this_min)
        mad = (w * (this_scale[:, None] * La + this_min[:, None] - x) ** 2).sum(axis=1)
        better = ok & (mad < best) & ~flat
        L = np.where(better[:, None], La, L)
        best = np.where(better, mad, best)
        scale = np.where(better, this_scale, scale).astype(f32)
        mn = np.where(better, this_min, mn).astype(f32)
    scale = np.where(flat, 0, scale).astype(f32)
    L = np.where(flat[:, None], 0, L)
    return scale, (-mn).astype(f32), L


def _quantize_k(x, nbits):
    """q4_k / q5_k: 8 sub-blocks of 32 per 256, 6-bit scales and mins (quantize_row_q4_K_ref /
    quantize_row_q5_K_ref)."""
    f32 = np.float32
    b = np.asarray(x, f32).reshape(-1, 8, 32)
    nb = len(b)
    sub = b.reshape(-1, 32)
    av = np.sqrt((sub * sub).sum(axis=1) / 32)
    w = av[:, None] + np.abs(sub)
    nmax = 15 if nbits == 4 else 31
    scales, mins, _ = make_qkx2_quants(sub, w, nmax, -1.0 if nbits == 4 else -0.5, 0.1, 20 if nbits == 4 else 15)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_s = np.where(max_scale > 0, 63 / np.where(max_scale > 0, max_scale, 1), 0).astype(f32)
    inv_m = np.where(max_min > 0, 63 / np.where(max_min > 0, max_min, 1), 0).astype(f32)
    ls = np.minimum(63, _nearest(inv_s[:, None] * scales)).astype(np.uint8)
    lm = np.minimum(63, _nearest(inv_m[:, None] * mins)).astype(np.uint8)
    packed = np.zeros((nb, 12), np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 15) | ((lm[:, 4:8] & 15) << 4)
    d = (max_scale / 63).astype(np.float16).astype(f32)
    dmin = (max_min / 63).astype(np.float16).astype(f32)
    sc, m = get_scale_min_k4(packed)
    dd, dm = d[:, None] * sc.astype(f32), dmin[:, None] * m.astype(f32)
    q = np.where(dd[..., None] != 0, _nearest((b + dm[..., None]) / np.where(dd != 0, dd, 1)[..., None]), 0)
    q = np.clip(q, 0, nmax).astype(np.uint8)                                  # [blocks, 8, 32]
    qs = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)                        # [blocks, 4, 32]
    parts = [_pack_f16(d), _pack_f16(dmin), packed]
    if nbits == 5:
        parts.append(np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [qs.reshape(nb, 128)], axis=1)


def quantize_q4_k(x):
    return _quantize_k(x, 4)


def quantize_q5_k(x):
    return _quantize_k(x, 5)


def make_qx_quants(x, nmax):
    """ggml's make_qx_quants with rmse_type 1 (weights x^2) over sub-blocks x [S, n]: a symmetric fit
    searched over 19 candidate scales around -nmax / max. -> scale [S]."""
    f32 = np.float32
    ax = np.abs(x)
    imax = ax.argmax(axis=1)
    mx = x[np.arange(len(x)), imax]
    tiny = ax.max(axis=1) < 1e-15
    mxs = np.where(tiny, 1, mx).astype(f32)
    w = x * x

    def fit(iscale):
        l = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1).astype(f32)
        return (w * x * l).sum(axis=1), (w * l * l).sum(axis=1)
    sumlx, suml2 = fit((-f32(nmax) / mxs).astype(f32))
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0).astype(f32)
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        slx, sl2 = fit((-(f32(nmax) + f32(0.1) * f32(i)) / mxs).astype(f32))
        better = (sl2 > 0) & (slx * slx > best * sl2)
        scale = np.where(better, slx / np.where(sl2 > 0, sl2, 1), scale).astype(f32)
        best = np.where(better, scale * slx, best)
    return np.where(tiny, 0, scale).astype(f32)


def quantize_q6_k(x):
    f32 = np.float32
    b = np.asarray(x, f32).reshape(-1, 16, 16)
    nb = len(b)
    scales = make_qx_quants(b.reshape(-1, 16), 32).reshape(nb, 16)
    amax_i = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(nb), amax_i]
    iscale = np.where(max_scale != 0, -128 / np.where(max_scale != 0, max_scale, 1), 0).astype(f32)
    d = np.where(max_scale != 0, 1 / np.where(iscale != 0, iscale, 1), 0).astype(np.float16).astype(f32)
    sc = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(np.int8)
    dd = d[:, None] * sc.astype(f32)
    q = np.where(dd[..., None] != 0, _nearest(b / np.where(dd != 0, dd, 1)[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)       # [blocks, half, part, 32]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=2)                                               # [blocks, half, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), _pack_f16(d)], axis=1)


QUANTIZERS = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q4_1": quantize_q4_1, "q5_0": quantize_q5_0,
              "q5_1": quantize_q5_1, "mxfp4": quantize_mxfp4, "q4_k": quantize_q4_k, "q5_k": quantize_q5_k,
              "q6_k": quantize_q6_k}


def quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [N, K] -> uint8 [N, row_bytes(fmt, K)] (K a multiple of the format's block)."""
    x = np.asarray(x, np.float32)
    N, K = x.shape
    B, _ = BLOCK[fmt]
    if K % B:
        raise ValueError(f"rows of {K} are not a multiple of {fmt}'s block of {B}")
    return QUANTIZERS[fmt](x).reshape(N, row_bytes(fmt, K))


def quantize_activations(x: np.ndarray):
    """The cpu backend's int8 activations (backends/cpu/qkernels.quantize_act), defined here in NumPy
    as the emulation its kernels are checked against: per block of 32 of each row
        dx = max|x| / 127,  q = clip(rint(x * (1 / dx)), -127, 127)  (dx = 0: q = 0),  xs = dx * sum(q).
    float32 [T, K] (K % 32 == 0) -> (q int8 [T, K], dx float32 [T, K/32], xs float32 [T, K/32])."""
    x = np.asarray(x, np.float32)
    T, K = x.shape
    b = x.reshape(T, K // 32, 32)
    dx = (np.abs(b).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    inv = np.where(dx > 0, np.float32(1.0) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int8)
    xs = (dx * q.sum(axis=-1, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return q.reshape(T, K), dx, xs


def fake_quantized_activations(x: np.ndarray) -> np.ndarray:
    """x as the int8 path sees it: q * dx, float32."""
    q, dx, _ = quantize_activations(x)
    T, K = q.shape
    return (q.reshape(T, K // 32, 32).astype(np.float32) * dx[..., None]).reshape(T, K)
