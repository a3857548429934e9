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
  q2_k    256  84     scales:u8[16] | qs:u8[64] | d:f16 | dmin:f16   d (sc_s & 15) q2 - dmin (sc_s >> 4)  (16 of 16)
  q3_k    256  110    hmask:u8[32] | qs:u8[64] | scales:u8[12] | d:f16   d (sc6_s - 32) (q2 - 4 (1 - hb))
      2-bit fields (q2_k, q3_k, tq2_0): half h (128 weights), part p (0..3), weight j < 32 reads
      (qs[32 h + j] >> 2 p) & 3; q3_k's high bit of that weight is bit 4 h + p of hmask[j] (set: no -4);
      q3_k's 6-bit scale s: low 4 bits (scales[s % 8] >> 4 (s // 8)) & 15, high 2 bits
      (scales[8 + s % 4] >> 2 (s // 4)) & 3.
  iq4_nl  32   18     d:f16 | qs:u8[16]                              d * IQ4NL[nib(i)]
  iq4_xs  256  136    d:f16 | scales_h:u16 | scales_l:u8[4] | qs:u8[128]   d (sc6_s - 32) IQ4NL[nib]  (8 of 32)
      sub-block s: 6-bit scale (scales_l[s // 2] >> 4 (s % 2)) & 15 | ((scales_h >> 2 s) & 3) << 4; its
      weights nib(i) of qs[16 s .. 16 s + 15] (low nibbles the first 16).
  tq2_0   256  66     qs:u8[64] | d:f16                              d * (q2 - 1)
  tq1_0   256  54     qs:u8[48] | qh:u8[4] | d:f16                   d * (trit - 1)
      five trits a byte, base 3, most significant first, stored as ceil(v * 256 / 243): trit n of byte b
      is ((b * 3^n mod 256) * 3) >> 8. Weight 32 n + j: trit n of qs[j] (j < 32); 160 + 16 n + j: trit n
      of qs[32 + j]; 240 + 4 n + j: trit n (< 4) of qh[j].
  nvfp4   64   36     d:u8[4] (ue4m3) | qs:u8[32]                    UE4M3(d_s) / 2 * E2M1x2[nib]  (4 of 16)
      sub-block s: its 16 weights nib(i) of qs[8 s .. 8 s + 7]; UE4M3 x: exponent (x >> 3) & 15, mantissa
      x & 7, bias 7, subnormal below exponent 1; 0 and 0x7f decode to 0.
  The lattice types (i-quants): groups of 8 (IQ2, IQ1) or 4 (IQ3) weights are one entry of a grid
  (iq_grid: iq_grids.npz, toolchains/gguf), signs apart; s_g a sub-block's 4-bit scale (3-bit for IQ1):
  iq2_xxs 256  66     d:f16 | (grid:u8[4] | signs:u32)[8]            d (0.5 + s) / 4 * grid8 * sign  (8 of 32)
      the u32 of sub-block g: four 7-bit sign indices (bits 0, 7, 14, 21; KSIGNS adds the parity bit)
      for its four groups, s in bits 28..31
  iq2_xs  256  74     d:f16 | qs:u16[32] | scales:u8[8]              grid8[q & 511], signs KSIGNS[q >> 9] (16 of 16)
  iq2_s   256  82     d:f16 | qs:u8[32] | signs:u8[32] | qh:u8[8] | scales:u8[8]   grid8[qs | 2 bits of qh << 8]
  iq3_xxs 256  98     d:f16 | qs:u8[64] | (signs, s):u32[8]           d (0.5 + s) / 2 * grid4[qs] * sign  (8 of 32)
  iq3_s   256  110    d:f16 | qs:u8[64] | qh:u8[8] | signs:u8[32] | scales:u8[4]   d (1 + 2 s) grid4[qs | bit << 8]
  iq1_s   256  50     d:f16 | qs:u8[32] | qh:u16[8]                  d (2 s + 1) (grid8[qs | 3 bits of qh << 8] +- 1/8)
  iq1_m   256  56     qs:u8[32] | qh:u8[16] | scales:u16[4]          the same, s per 16; d's 16 bits are the
      top nibbles of the four scales; qh's nibble per group: 3 index bits and the delta's sign
"""
from __future__ import annotations

import numpy as np

QK = 32
QK_K = 256
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
         "mxfp4": (32, 17), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
         "q2_k": (256, 84), "q3_k": (256, 110), "iq4_nl": (32, 18), "iq4_xs": (256, 136), "tq1_0": (256, 54),
         "tq2_0": (256, 66), "nvfp4": (64, 36), "iq2_xxs": (256, 66), "iq2_xs": (256, 74), "iq2_s": (256, 82),
         "iq3_xxs": (256, 98), "iq3_s": (256, 110), "iq1_s": (256, 50), "iq1_m": (256, 56)}
BLOCK_FORMATS = tuple(BLOCK)
E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)    # doubled e2m1 values
IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)  # kvalues_iq4nl


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


# KSIGNS[i]: the 7 sign bits i of an i-quant group of 8 and an eighth bit making the count of set bits even
KSIGNS = np.array([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], np.uint8)
_GRIDS = {}


def iq_grid(name: str) -> np.ndarray:
    """A lattice grid: iq2xxs, iq2xs, iq2s [n, 8] u8; iq3xxs, iq3s [n, 4] u8; iq1s [2048, 8] i8."""
    if not _GRIDS:
        import os
        with np.load(os.path.join(os.path.dirname(__file__), "iq_grids.npz")) as z:
            _GRIDS.update({k: z[k] for k in z.files})
    return _GRIDS[name]


def _sign_bits(b):
    """uint8 [...] -> float32 [..., 8]: -1 where bit j is set, else 1."""
    return np.where((b[..., None] >> np.arange(8, dtype=np.uint8)) & 1, np.float32(-1), np.float32(1))


def _u32(b):
    return np.ascontiguousarray(b).view("<u4")


def _u16(b):
    return np.ascontiguousarray(b).view("<u2")


def _iq_dequantize(b, fmt):
    """The lattice types (module docstring) -> float32 [blocks, 256]."""
    n = len(b)
    f32 = np.float32
    if fmt in ("iq2_xxs", "iq3_xxs"):
        d = _f16(b[:, 0:2])[:, None]
        if fmt == "iq2_xxs":
            aux = _u32(b[:, 2:66]).reshape(n, 8, 2)
            idx, sx = aux[..., 0].copy().view(np.uint8).reshape(n, 8, 4), aux[..., 1]
            grid, mul = iq_grid("iq2xxs")[idx].reshape(n, 8, 4, 8), f32(0.25)
        else:
            idx, sx = b[:, 2:66].reshape(n, 8, 8), _u32(b[:, 66:98])
            grid, mul = iq_grid("iq3xxs")[idx].reshape(n, 8, 4, 8), f32(0.5)
        db = (d * (f32(0.5) + (sx >> 28).astype(f32)) * mul)[..., None, None]
        signs = KSIGNS[(sx[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127]
        return (db * grid.astype(f32) * _sign_bits(signs)).reshape(n, 256)
    if fmt in ("iq2_xs", "iq2_s"):
        d = _f16(b[:, 0:2])[:, None]
        sc = b[:, -8:]
        scales = np.stack([sc & 15, sc >> 4], axis=-1).reshape(n, 16).astype(f32)
        db = (d * (f32(0.5) + scales) * f32(0.25))[..., None, None]                    # [n, 16, 1, 1]
        if fmt == "iq2_xs":
            q = _u16(b[:, 2:66])
            idx, signs = q & 511, KSIGNS[q >> 9]
            grid = iq_grid("iq2xs")[idx]
        else:
            qh = b[:, 66:74]
            hi = (qh[..., None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
            idx = b[:, 2:34].astype(np.uint16) | (hi.reshape(n, 32).astype(np.uint16) << 8)
            signs, grid = b[:, 34:66], iq_grid("iq2s")[idx]
        return (db * grid.reshape(n, 16, 2, 8).astype(f32) * _sign_bits(signs).reshape(n, 16, 2, 8)).reshape(n, 256)
    if fmt == "iq3_s":
        d = _f16(b[:, 0:2])[:, None]
        sc = b[:, 106:110]
        scales = np.stack([sc & 15, sc >> 4], axis=-1).reshape(n, 8).astype(f32)
        db = (d * (1 + 2 * scales))[..., None, None]
        hb = (b[:, 66:74][..., None] >> np.arange(8, dtype=np.uint8)) & 1
        idx = b[:, 2:66].astype(np.uint16) | (hb.reshape(n, 64).astype(np.uint16) << 8)
        grid = iq_grid("iq3s")[idx].reshape(n, 8, 4, 8).astype(f32)
        return (db * grid * _sign_bits(b[:, 74:106]).reshape(n, 8, 4, 8)).reshape(n, 256)
    if fmt == "iq1_s":
        d = _f16(b[:, 0:2])[:, None]
        qh = _u16(b[:, 34:50])                                                          # [n, 8]
        dl = (d * (2 * ((qh >> 12) & 7) + 1).astype(f32))[..., None, None]
        delta = np.where(qh & 0x8000, f32(-0.125), f32(0.125))[..., None, None]
        idx = b[:, 2:34].astype(np.uint16) | ((((qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) << 8)
                                              .reshape(n, 32))
        grid = iq_grid("iq1s")[idx].reshape(n, 8, 4, 8).astype(f32)
        return (dl * (grid + delta)).reshape(n, 256)
    if fmt == "iq1_m":
        sc = _u16(b[:, 48:56])                                                          # [n, 4]
        d = (((sc >> 12) << np.array([0, 4, 8, 12], np.uint16)).sum(axis=1).astype(np.uint16)
             .view(np.float16).astype(f32))[:, None]
        s3 = ((sc[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(n, 16)
        dl = (d * (2 * s3 + 1).astype(f32)).reshape(n, 8, 2, 1, 1)
        nib = np.stack([b[:, 32:48] & 15, b[:, 32:48] >> 4], axis=-1).reshape(n, 32)
        idx = b[:, 0:32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
        delta = np.where(nib & 8, f32(-0.125), f32(0.125)).reshape(n, 8, 2, 2, 1)
        grid = iq_grid("iq1s")[idx].reshape(n, 8, 2, 2, 8).astype(f32)
        return (dl * (grid + delta)).reshape(n, 256)
    raise ValueError(fmt)


def ue4m3_half(x):
    """UE4M3 scale bytes -> float32 value / 2 (ggml_ue4m3_to_fp32 under the doubled-E2M1 convention):
    (1 + m / 8) 2^(e - 7) for e > 0, m 2^-9 for e = 0; 0 and 0x7f are 0. Every value is exact."""
    x = np.asarray(x, np.uint8)
    e = ((x >> 3) & 15).astype(np.int32)
    m = (x & 7).astype(np.float32)
    v = np.where(e == 0, m * np.float32(2.0 ** -9), (1 + m / 8) * np.exp2(e - 7).astype(np.float32))
    return np.where((x == 0) | (x == 0x7F), 0, v * np.float32(0.5)).astype(np.float32)


def _crumbs(qs):
    """uint8 [blocks, 32 m] -> [blocks, 128 m]: the 2-bit fields of half h, part p, weight j at
    128 h + 32 p + j (q2_k, q3_k, tq2_0)."""
    q = qs.reshape(len(qs), -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    return (q & 3).reshape(len(qs), -1)


def q3_k_scales(sc):
    """uint8 [..., 12] -> int8 [..., 16]: q3_k's 6-bit scales, minus 32."""
    s = np.arange(16)
    lo = (sc[..., s % 8] >> (4 * (s // 8)).astype(np.uint8)) & 15
    hi = (sc[..., 8 + s % 4] >> (2 * (s // 4)).astype(np.uint8)) & 3
    return ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)


def iq4_xs_scales(b):
    """iq4_xs blocks uint8 [blocks, 136] -> int8 [blocks, 8]: the 6-bit sub-block scales, minus 32."""
    s = np.arange(8)
    h = b[:, 2:4].copy().view("<u2")
    lo = (b[:, 4 + s // 2] >> (4 * (s % 2)).astype(np.uint8)) & 15
    hi = ((h >> (2 * s).astype(np.uint16)) & 3).astype(np.uint8)
    return ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)


def tq1_0_trits(b):
    """tq1_0 blocks uint8 [blocks, 54] -> int8 [blocks, 256]: the trits minus 1, in weight order."""
    p3 = lambda n: np.array([3 ** i for i in range(n)], np.uint8)[None, :, None]        # noqa: E731
    parts = [b[:, None, 0:32] * p3(5), b[:, None, 32:48] * p3(5), b[:, None, 48:52] * p3(4)]
    q = np.concatenate([p.reshape(len(b), -1) for p in parts], axis=1)                  # uint8 products wrap
    return ((q.astype(np.uint16) * 3) >> 8).astype(np.int8) - 1


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
    elif fmt == "q2_k":
        d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
        dl, ml = d * (b[:, :16] & 15).astype(np.float32), dmin * (b[:, :16] >> 4).astype(np.float32)
        w = dl[..., None] * _crumbs(b[:, 16:80]).reshape(-1, 16, 16).astype(np.float32) - ml[..., None]
    elif fmt == "q3_k":
        hb = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1           # [blocks, 4h + p, 32]
        q = _crumbs(b[:, 32:96]).astype(np.int8) - ((1 - hb.reshape(len(b), -1)) << 2).astype(np.int8)
        dl = _f16(b[:, 108:110])[:, None] * q3_k_scales(b[:, 96:108]).astype(np.float32)
        w = dl[..., None] * q.reshape(-1, 16, 16).astype(np.float32)
    elif fmt == "iq4_nl":
        w = _f16(b[:, 0:2])[:, None] * IQ4NL[_nibbles(b[:, 2:])].astype(np.float32)
    elif fmt == "iq4_xs":
        dl = _f16(b[:, 0:2])[:, None] * iq4_xs_scales(b).astype(np.float32)
        w = dl[..., None] * IQ4NL[_nibbles(b[:, 8:].reshape(-1, 8, 16))].astype(np.float32)
    elif fmt == "tq2_0":
        w = _f16(b[:, 64:66])[:, None] * (_crumbs(b[:, :64]).astype(np.float32) - 1)
    elif fmt == "tq1_0":
        w = _f16(b[:, 52:54])[:, None] * tq1_0_trits(b).astype(np.float32)
    elif fmt == "nvfp4":
        w = ue4m3_half(b[:, :4])[..., None] * E2M1[_nibbles(b[:, 4:].reshape(-1, 4, 8))]
    elif fmt.startswith("iq") and fmt not in ("iq4_nl", "iq4_xs"):
        w = _iq_dequantize(b, fmt)
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


def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad=False):
    """ggml's make_qkx2_quants over sub-blocks x [S, n] with weights w [S, n]: an affine fit
    scale * L + min (min <= 0) searched over nstep + 1 candidate scales, the error weighted squares
    (or absolute values: use_mad). -> (scale, -min, L)."""
    err = np.abs if use_mad else np.square
    f32 = np.float32
    mn = np.minimum(x.min(axis=1), 0).astype(f32)
    mx = x.max(axis=1).astype(f32)
    sum_w, sum_x = w.sum(axis=1), (w * x).sum(axis=1)
    flat = mx == mn
    rng_ = np.where(flat, 1, mx - mn).astype(f32)
    iscale = (f32(nmax) / rng_).astype(f32)
    scale = (1 / iscale).astype(f32)
    L = np.clip(_nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = (w * err(scale[:, None] * L + mn[:, None] - x)).sum(axis=1)
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
        mad = (w * err(this_scale[:, None] * La + this_min[:, None] - x)).sum(axis=1)
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


def _pack_crumbs(L):
    """uint8 [blocks, 128 m] 2-bit values -> [blocks, 32 m] bytes (_crumbs' inverse)."""
    q = L.reshape(len(L), -1, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    return np.bitwise_or.reduce(q, axis=2).reshape(len(L), -1)


def quantize_q2_k(x):
    """quantize_row_q2_K_ref: 16 sub-blocks of 16, each an affine fit of 2-bit values (make_qkx2_quants,
    weights |x|, absolute error), scales and mins to 4 bits against the block's largest."""
    f32 = np.float32
    b = np.asarray(x, f32).reshape(-1, 16, 16)
    nb = len(b)
    sub = b.reshape(-1, 16)
    scales, mins, L = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins, L = scales.reshape(nb, 16), mins.reshape(nb, 16), L.reshape(nb, 16, 16)
    max_scale, max_min = np.maximum(scales.max(axis=1), 0), np.maximum(mins.max(axis=1), 0)
    inv_s = (f32(15) / np.where(max_scale > 0, max_scale, 1)).astype(f32)
    inv_m = (f32(15) / np.where(max_min > 0, max_min, 1)).astype(f32)
    ls = np.where(max_scale[:, None] > 0, _nearest(inv_s[:, None] * scales), 0)
    lm = np.where(max_min[:, None] > 0, _nearest(inv_m[:, None] * mins), 0)
    sc = ((ls & 15) | ((lm & 15) << 4)).astype(np.uint8)        # (l << 4) into a byte: ggml's truncation
    d = np.where(max_scale > 0, max_scale / f32(15), 0).astype(np.float16)
    dmin = np.where(max_min > 0, max_min / f32(15), 0).astype(np.float16)
    dl = d.astype(f32)[:, None] * (sc & 15).astype(f32)
    dm = dmin.astype(f32)[:, None] * (sc >> 4).astype(f32)
    q = _nearest((b + dm[..., None]) / np.where(dl != 0, dl, 1)[..., None])
    L = np.where(dl[..., None] != 0, np.clip(q, 0, 3), L).astype(np.uint8)      # a zero scale keeps the fit's
    return np.concatenate([sc, _pack_crumbs(L.reshape(nb, 256)), _pack_f16(d), _pack_f16(dmin)], axis=1)


def make_q3_quants(x, nmax):
    """ggml's make_q3_quants with do_rmse over sub-blocks x [S, n]: L in [-nmax, nmax - 1] from
    -nmax / max, then five passes moving single values while the weighted (x^2) fit improves.
    -> (scale [S], L int [S, n] + nmax)."""
    f32 = np.float32
    S, n = x.shape
    ax = np.abs(x)
    mx = x[np.arange(S), ax.argmax(axis=1)]
    zero = ax.max(axis=1) < f32(1e-15)
    iscale = (-f32(nmax) / np.where(zero, 1, mx)).astype(f32)
    L = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)
    w = (x * x).astype(f32)
    sumlx = (w * x * L).sum(axis=1, dtype=f32)
    suml2 = (w * L * L).sum(axis=1, dtype=f32)
    for _ in range(5):
        changed = np.zeros(S, bool)
        for i in range(n):
            wi, xi, li = w[:, i], x[:, i], L[:, i].astype(f32)
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = np.clip(_nearest(xi * sl2 / np.where(slx > 0, slx, 1)), -nmax, nmax - 1)
            nslx, nsl2 = slx + wi * xi * new, sl2 + wi * new * new
            take = (slx > 0) & (new != L[:, i]) & (nsl2 > 0) & (nslx * nslx * suml2 > sumlx * sumlx * nsl2)
            L[:, i] = np.where(take, new, L[:, i])
            sumlx, suml2 = np.where(take, nslx, sumlx).astype(f32), np.where(take, nsl2, suml2).astype(f32)
            changed |= take
        if not changed.any():
            break
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0).astype(f32)
    return np.where(zero, 0, scale).astype(f32), np.where(zero[:, None], 0, L + nmax)


def quantize_q3_k(x):
    """quantize_row_q3_K_ref: 16 sub-blocks of 16, symmetric 3-bit values (make_q3_quants), 6-bit
    signed scales against the block's largest; the high bit of each value in hmask."""
    f32 = np.float32
    b = np.asarray(x, f32).reshape(-1, 16, 16)
    nb = len(b)
    scales, _ = make_q3_quants(b.reshape(-1, 16), 4)
    scales = scales.reshape(nb, 16)
    max_scale = scales[np.arange(nb), np.abs(scales).argmax(axis=1)]
    iscale = (f32(-32) / np.where(max_scale != 0, max_scale, 1)).astype(f32)
    l = (np.clip(_nearest(iscale[:, None] * scales), -32, 31) + 32).astype(np.uint8)
    l = np.where(max_scale[:, None] != 0, l, 0).astype(np.uint8)
    packed = np.zeros((nb, 12), np.uint8)
    packed[:, 0:8] = (l[:, 0:8] & 15) | ((l[:, 8:16] & 15) << 4)
    for j in range(16):
        packed[:, 8 + j % 4] |= (l[:, j] >> 4) << (2 * (j // 4))
    d = np.where(max_scale != 0, 1 / iscale, 0).astype(np.float16)
    dl = d.astype(f32)[:, None] * q3_k_scales(packed).astype(f32)
    q = np.clip(_nearest(b / np.where(dl != 0, dl, 1)[..., None]), -4, 3) + 4
    q = np.where(dl[..., None] != 0, q, 0).astype(np.uint8).reshape(nb, 256)    # ggml leaves L at 0 there
    hb = q > 3
    hmask = np.bitwise_or.reduce(hb.reshape(nb, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None],
                                 axis=1)
    return np.concatenate([hmask, _pack_crumbs(np.where(hb, q - 4, q).astype(np.uint8)), packed, _pack_f16(d)], axis=1)


def best_index_iq4nl(v):
    """ggml's best_index_int8 over IQ4NL: the nearest value's index, ties to the larger."""
    mid2 = (IQ4NL[:-1].astype(np.int32) + IQ4NL[1:]).astype(np.float32)          # 2 x the midpoints
    v2 = np.asarray(v, np.float32)
    return ((v2 + v2)[..., None] >= mid2).sum(axis=-1).astype(np.uint8)


def _iq4_fit(b, ntry=7):
    """quantize_row_iq4_nl_impl's per-32 search without an importance matrix (weights x^2): d from
    -max / -127, refitted by least squares, then 2 ntry + 1 nearby scales tried. b [S, 32] -> d [S]."""
    f32 = np.float32
    S = len(b)
    ax = np.abs(b)
    mx = b[np.arange(S), ax.argmax(axis=1)]
    zero = ax.max(axis=1) < f32(1e-15)
    mxs = np.where(zero, 1, mx).astype(f32)
    w = b * b
    v0 = f32(IQ4NL[0])

    def fit(idv):
        q = IQ4NL[best_index_iq4nl(idv[:, None] * b)].astype(f32)
        return (w * q * b).sum(axis=1, dtype=f32), (w * q * q).sum(axis=1, dtype=f32)
    sqx, sq2 = fit((f32(1) / (-mxs / v0)).astype(f32))
    d = np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, 1), 0).astype(f32)
    best = d * sqx
    for itry in range(-ntry, ntry + 1):
        sqx, sq2 = fit(((f32(itry) + v0) / mxs).astype(f32))
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = np.where(better, sqx / np.where(sq2 > 0, sq2, 1), d).astype(f32)
        best = np.where(better, d * sqx, best).astype(f32)
    return np.where(zero, 0, d).astype(f32)


def _iq4_pack(b, idl):
    """values of b [S, 32] at 1 / scale idl [S] -> 16 bytes each (low nibbles the first 16)."""
    L = best_index_iq4nl(idl[:, None] * b)
    return L[:, :16] | (L[:, 16:] << 4)


def quantize_iq4_nl(x):
    """quantize_iq4_nl (ntry 7, no importance matrix): the fitted scale as f16, values the nearest
    IQ4NL levels at the unrounded scale."""
    b = _qk32(x)
    d = _iq4_fit(b)
    idl = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float32)
    return np.concatenate([_pack_f16(d), _iq4_pack(b, idl)], axis=1)


def quantize_iq4_xs(x):
    """quantize_iq4_xs (no importance matrix): per-32 fitted scales to 6 signed bits against the
    block's largest, d = -max / 32, values at each sub-block's rounded scale."""
    f32 = np.float32
    b = np.asarray(x, f32).reshape(-1, 8, 32)
    nb = len(b)
    sc = _iq4_fit(b.reshape(-1, 32)).reshape(nb, 8)
    max_scale = sc[np.arange(nb), np.abs(sc).argmax(axis=1)]
    d = (-max_scale / f32(32)).astype(f32)
    idv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(f32)
    l = np.clip(_nearest(idv[:, None] * sc), -32, 31)
    dl = (d[:, None] * l).astype(f32)
    idl = np.where(dl != 0, 1 / np.where(dl != 0, dl, 1), 0).astype(f32)
    qs = _iq4_pack(b.reshape(-1, 32), idl.reshape(-1)).reshape(nb, 128)
    u = (l + 32).astype(np.uint16)
    scales_l = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    scales_h = np.bitwise_or.reduce((u >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")
    return np.concatenate([_pack_f16(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], axis=1)


def _ternary(x):
    """TQ1_0 / TQ2_0's rounding: d = max|x| per 256, q = roundf(x / d) + 1 in 0..2."""
    b = np.asarray(x, np.float32).reshape(-1, 256)
    d = np.abs(b).max(axis=1)
    v = b * _inv(d)[:, None]
    return d, (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5)) + 1).astype(np.uint8)


def quantize_tq2_0(x):
    d, q = _ternary(x)
    return np.concatenate([_pack_crumbs(q), _pack_f16(d)], axis=1)


def quantize_tq1_0(x):
    """five trits a byte (tq1_0_trits' inverse): v = sum q_n 3^(4 - n), stored as ceil(v * 256 / 243)."""
    d, q = _ternary(x)
    nb = len(q)
    p = lambda k: np.array([3 ** (k - 1 - i) for i in range(k)], np.uint16)[None, :, None]     # noqa: E731
    v = np.concatenate([(q[:, None, :160].reshape(nb, 5, 32) * p(5)).sum(axis=1),
                        (q[:, 160:240].reshape(nb, 5, 16) * p(5)).sum(axis=1),
                        (q[:, 240:].reshape(nb, 4, 4) * p(4)).sum(axis=1) * 3], axis=1).astype(np.uint16)
    return np.concatenate([((v * 256 + 242) // 243).astype(np.uint8), _pack_f16(d)], axis=1)


def ue4m3(x):
    """float32 >= 0 -> the UE4M3 byte (ggml_fp32_to_ue4m3): round half up on the mantissa's first
    dropped bit, subnormals below 2^-6, saturating at 0x7e (448)."""
    x = np.clip(np.asarray(x, np.float32), 0, 448).astype(np.float32)
    bits = x.view(np.uint32)
    e = ((bits >> 23) & 255).astype(np.int32) - 127 + 7
    man = ((bits >> 20) & 7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    e, man = np.where(man > 7, e + 1, e), np.where(man > 7, 0, man)
    normal = np.where(e >= 15, 0x7E, (np.clip(e, 0, 15) << 3) | man)
    sub = np.clip((x * np.float32(512) + np.float32(0.5)).astype(np.int32), 0, 7)
    e0 = ((bits >> 23) & 255).astype(np.int32) - 127 + 7
    return np.where(x <= 0, 0, np.where(e0 <= 0, sub, np.where(e0 >= 15, 0x7E, normal))).astype(np.uint8)


def quantize_nvfp4(x):
    """quantize_row_nvfp4_ref: per 16 a UE4M3 scale of max|x| / 6, values the nearest E2M1 (the
    first of equal errors)."""
    b = np.asarray(x, np.float32).reshape(-1, 4, 16)
    nb = len(b)
    e = ue4m3(np.abs(b).max(axis=2) / np.float32(6))
    d = ue4m3_half(e)
    err = np.abs(d[..., None, None] * E2M1[None, None, None, :] - b[..., None])
    q = err.argmin(axis=-1).astype(np.uint8)                                  # [blocks, 4, 16]
    return np.concatenate([e, (q[..., :8] | (q[..., 8:] << 4)).reshape(nb, 32)], axis=1)


QUANTIZERS = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q4_1": quantize_q4_1, "q5_0": quantize_q5_0,
              "q5_1": quantize_q5_1, "mxfp4": quantize_mxfp4, "q4_k": quantize_q4_k, "q5_k": quantize_q5_k,
              "q6_k": quantize_q6_k, "q2_k": quantize_q2_k, "q3_k": quantize_q3_k, "iq4_nl": quantize_iq4_nl,
              "iq4_xs": quantize_iq4_xs, "tq1_0": quantize_tq1_0, "tq2_0": quantize_tq2_0, "nvfp4": quantize_nvfp4}


def quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [N, K] -> uint8 [N, row_bytes(fmt, K)] (K a multiple of the format's block)."""
    x = np.asarray(x, np.float32)
    N, K = x.shape
    B, _ = BLOCK[fmt]
    if K % B:
        raise ValueError(f"rows of {K} are not a multiple of {fmt}'s block of {B}")
    return QUANTIZERS[fmt](x).reshape(N, row_bytes(fmt, K))


# The formats whose int8-activation dots take the activations quantised per 256 (one scale for a
# super-block, as llama.cpp's Q8_K): their sub-block scales are small integers times one float, so a
# super-block's dot is an int32 sum and one float multiply-add (backends/cpu/qir.py, INT256). Every
# other block format per 32.
ACT256 = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")


def act_block(fmt: str) -> int:
    """How many activations share one int8 scale in front of a matrix of fmt: 256 or 32."""
    return 256 if fmt in ACT256 else 32


def quantize_activations(x: np.ndarray, block: int = 32):
    """The int8 activations (backends/cpu/qkernels.quantize_act, opencl's dense.cl quantize_act),
    defined here in NumPy as the emulation their kernels are checked against: per block of `block`
    (32, or 256 in front of the ACT256 formats) of each row
        dx = max|x| / 127,  q = clip(rint(x * (1 / dx)), -127, 127)  (dx = 0: q = 0),
    and per 32 xs = dx * sum(q) (dx repeated for each 32 of a block of 256: the kernels' layout).
    float32 [T, K] (K % block == 0) -> (q int8 [T, K], dx float32 [T, K/32], xs float32 [T, K/32])."""
    x = np.asarray(x, np.float32)
    T, K = x.shape
    b = x.reshape(T, K // block, block)
    dx = (np.abs(b).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    inv = np.where(dx > 0, np.float32(1.0) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int8).reshape(T, K // 32, 32)
    dx = np.repeat(dx, block // 32, axis=1)
    xs = (dx * q.sum(axis=-1, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return q.reshape(T, K), dx, xs


def fake_quantized_activations(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x as the int8 path sees it: q * dx, float32 (block: act_block of the matrix it feeds)."""
    q, dx, _ = quantize_activations(x, block)
    T, K = q.shape
    return (q.reshape(T, K // 32, 32).astype(np.float32) * dx[..., None]).reshape(T, K)