"""LLVM IR of the block formats (colibri_edge/model/quant.py has their definitions): how each block's bytes
become float32 vectors, written once, as Numba intrinsics the kernels of qkernels.py call.

Why IR: a block format's inner loop is short (32 or 256 weights) and sits inside the loop over blocks;
written as Numba loops, LLVM fully unrolls the inner one and then vectorises the outer loop across
blocks with gathers (measured: 0.4-2 GB/s). Written here with explicit vector types, a block is a few
wide loads, integer unpacking in registers and FMAs into vector accumulators that live across the
row (measured below, in qkernels.py's docstring). The IR is target-neutral: LLVM picks AVX2 on
x86-64 and NEON on ARM64.

A weight view's element type names its format: the cpu backend views a matrix's bytes [N, row_bytes]
as records [N, K / B] with a single field named after the format (np.dtype([("q4_k", "u1", (144,))])),
so Numba specialises every kernel per format, and the intrinsics below read the format from the type.

decode(fmt) yields, per block, chunks (mult, add, q) of 32 weights (16 for q6_k): w = mult * q + add,
mult and add float scalars (add may be None), q a <n x float> vector.
"""
from __future__ import annotations

import platform

from llvmlite import binding as llvm_binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from colibri_edge.model.quant import ACT256, BLOCK, IQ4NL

I8, I16, I32, I64, F32, HALF = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType(), \
    ir.HalfType()


def vec(t, n):
    return ir.VectorType(t, n)


def cvec(t, vals):
    return ir.Constant(vec(t, len(vals)), list(vals))


def c64(v):
    return ir.Constant(I64, v)


def fmt_of(aryty) -> str:
    """The block format a weight view's record type names (see the module docstring)."""
    dt = getattr(aryty, "dtype", None)
    if isinstance(dt, types.Record) and len(dt.fields) == 1:
        name = next(iter(dt.fields))
        if name in BLOCK:
            return name
    return ""


def data_ptr(context, builder, aryty, ary):
    return builder.ptrtoint(context.make_array(aryty)(context, builder, ary).data, I64)


def at(builder, addr, ty):
    return builder.inttoptr(addr, ty.as_pointer())


def load(builder, addr, ty, align=1):
    return builder.load(at(builder, addr, ty), align=align)


def splat(builder, s, n):
    v = builder.insert_element(ir.Constant(vec(s.type, n), ir.Undefined), s, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vec(s.type, n), ir.Undefined), cvec(I32, [0] * n))


def reduce_add(builder, v):
    name = f"llvm.vector.reduce.fadd.v{v.type.count}f32"
    fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(F32, [F32, v.type]), name)
    return builder.call(fn, [ir.Constant(F32, 0.0), v], fastmath=("reassoc",))


def f16(builder, addr):
    return builder.fpext(load(builder, addr, HALF), F32)


def u8(builder, addr):
    return load(builder, addr, I8)


def concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, cvec(I32, range(2 * n)))


def nibbles(builder, addr, n=16):
    """n bytes -> <2n x i8>: their low nibbles, then their high nibbles."""
    qs = load(builder, addr, vec(I8, n))
    return concat(builder, builder.and_(qs, cvec(I8, [15] * n)), builder.lshr(qs, cvec(I8, [4] * n)))


def bits(builder, word, n, shift0=0):
    """<n x i8>: bit (shift0 + i) of the integer `word` for lane i (0 or 1). Each lane takes its byte
    of the word (one byte shuffle, little-endian) and tests its bit: a few byte-wide vector ops, where
    shifting the word splatted over 64-bit lanes took 32 lanes' worth (q5_0 / q5_1 ran 3x slower)."""
    nb = word.type.width // 8
    by = builder.bitcast(word, vec(I8, nb))
    ex = builder.shuffle_vector(by, ir.Constant(vec(I8, nb), ir.Undefined),
                                cvec(I32, [(shift0 + i) // 8 for i in range(n)]))
    hit = builder.and_(ex, cvec(I8, [1 << ((shift0 + i) % 8) for i in range(n)]))
    return builder.zext(builder.icmp_unsigned("!=", hit, cvec(I8, [0] * n)), vec(I8, n))


def sif(builder, q):
    return builder.sitofp(q, vec(F32, q.type.count))


def uif(builder, q):
    return builder.uitofp(q, vec(F32, q.type.count))


def e2m1x2(builder, nib):
    """<n x i8> E2M1 codes -> <n x float> of the doubled values (0, 1, 2, 3, 4, 6, 8, 12, negated
    with bit 3): v = i for i < 4, else (2 + (i & 1)) << ((i >> 1) - 1)."""
    n = nib.type.count
    i = builder.and_(nib, cvec(I8, [7] * n))
    big = builder.shl(builder.add(cvec(I8, [2] * n), builder.and_(i, cvec(I8, [1] * n))),
                      builder.sub(builder.lshr(i, cvec(I8, [1] * n)), cvec(I8, [1] * n)))
    mag = builder.select(builder.icmp_unsigned("<", i, cvec(I8, [4] * n)), i, big)
    v = uif(builder, mag)
    neg = builder.icmp_unsigned("!=", builder.and_(nib, cvec(I8, [8] * n)), cvec(I8, [0] * n))
    return builder.select(neg, builder.fneg(v), v)


def scale_min_k4(builder, base, j):
    """get_scale_min_k4(j, scales at base) -> (sc, m) as i32 (j a Python int, 0..7)."""
    q = lambda k: builder.zext(u8(builder, builder.add(base, c64(k))), I32)        # noqa: E731
    if j < 4:
        return builder.and_(q(j), ir.Constant(I32, 63)), builder.and_(q(j + 4), ir.Constant(I32, 63))
    sc = builder.or_(builder.and_(q(j + 4), ir.Constant(I32, 15)), builder.shl(builder.lshr(q(j - 4), ir.Constant(I32, 6)),
                                                                                ir.Constant(I32, 4)))
    m = builder.or_(builder.lshr(q(j + 4), ir.Constant(I32, 4)), builder.shl(builder.lshr(q(j), ir.Constant(I32, 6)),
                                                                             ir.Constant(I32, 4)))
    return sc, m


def k_chunk(fmt, builder, b, s):
    """q4_k / q5_k block at b: the unsigned values (<32 x i8>) of sub-block s (0..7): the low (s even)
    or high nibbles of qs[32 (s // 2) ..], with q5_k's fifth bit, bit s of qh[j], for weight j."""
    nib = nibbles(builder, builder.add(b, c64((48 if fmt == "q5_k" else 16) + 32 * (s // 2))), 32)
    q = builder.shuffle_vector(nib, nib, cvec(I32, range(32 * (s % 2), 32 * (s % 2) + 32)))
    if fmt == "q5_k":
        qh = load(builder, builder.add(b, c64(16)), vec(I8, 32))
        hb = builder.and_(builder.lshr(qh, cvec(I8, [s] * 32)), cvec(I8, [1] * 32))
        q = builder.or_(q, builder.shl(hb, cvec(I8, [4] * 32)))
    return q


def q6_k_chunk(builder, b, h, p, stored=False):
    """q6_k block at b: the signed 6-bit values (q - 32, <32 x i8>; stored: q, 0..63) of chunk p (0..3)
    of half h (0, 1): low 4 bits from ql[64 h + 32 (p % 2)] (nibble p // 2), high 2 bits from
    qh[128 + 32 h] (bits 2p)."""
    lo = load(builder, builder.add(b, c64(64 * h + 32 * (p % 2))), vec(I8, 32))
    lo = builder.and_(builder.lshr(lo, cvec(I8, [4 * (p // 2)] * 32)), cvec(I8, [15] * 32))
    hi = load(builder, builder.add(b, c64(128 + 32 * h)), vec(I8, 32))
    hi = builder.and_(builder.lshr(hi, cvec(I8, [2 * p] * 32)), cvec(I8, [3] * 32))
    q = builder.or_(lo, builder.shl(hi, cvec(I8, [4] * 32)))
    return q if stored else builder.sub(q, cvec(I8, [32] * 32))


def q6_k_scale(builder, b, h, p, j):
    """q6_k block at b: the int8 scale (as float) of weights 16 j .. 16 j + 15 of chunk p of half h."""
    return builder.sitofp(load(builder, builder.add(b, c64(192 + (128 * h + 32 * p + 16 * j) // 16)), I8), F32)


def crumbs(builder, addr, p):
    """<32 x i8>: the 2-bit fields (bits 2p, 2p + 1) of the 32 bytes at addr (q2_k, q3_k, tq2_0: part p
    of a half)."""
    return builder.and_(builder.lshr(load(builder, addr, vec(I8, 32)), cvec(I8, [2 * p] * 32)), cvec(I8, [3] * 32))


ON_AARCH64 = platform.machine().lower() in ("aarch64", "arm64")


def tbl16(builder, vals, idx):
    """<16k x i8> indices 0..15 -> vals[idx]: one NEON tbl per 16 lanes (baseline ARMv8 Advanced SIMD)."""
    n, v16 = idx.type.count, vec(I8, 16)
    tbl = _fn(builder, "llvm.aarch64.neon.tbl1.v16i8", v16, [v16, v16])
    table = cvec(I8, [v & 255 for v in vals])
    parts = [builder.call(tbl, [table, builder.shuffle_vector(idx, idx, cvec(I32, range(16 * h, 16 * h + 16)))])
             for h in range(n // 16)]
    while len(parts) > 1:
        parts = [concat(builder, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def lookup16(builder, values, idx):
    """<n x i8> indices 0..15 -> <n x i8> values[idx] (a 16-entry int8 table): one vpshufb on AVX2,
    NEON tbl on ARM64 (a select chain was 15 compares and blends a vector), a select chain elsewhere."""
    n = idx.type.count
    vals = [int(v) for v in values]
    if HAS_AVX2 and n == 32:
        table = cvec(I8, [v & 255 for v in vals] * 2)
        return builder.call(_fn(builder, "llvm.x86.avx2.pshuf.b", vec(I8, 32), [vec(I8, 32), vec(I8, 32)]), [table, idx])
    if ON_AARCH64 and n % 16 == 0:
        return tbl16(builder, vals, idx)
    out = cvec(I8, [vals[0] & 255] * n)
    for i in range(1, 16):
        out = builder.select(builder.icmp_unsigned("==", idx, cvec(I8, [i] * n)), cvec(I8, [vals[i] & 255] * n), out)
    return out


IQ4NL_VALUES = tuple(int(v) for v in IQ4NL)
E2M1X2_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def q2_k_scales(builder, b, s):
    """q2_k block at b, sub-block s (0..15): (d (sc & 15), -dmin (sc >> 4)) as floats."""
    sc = builder.zext(u8(builder, builder.add(b, c64(s))), I32)
    d, dmin = f16(builder, builder.add(b, c64(80))), f16(builder, builder.add(b, c64(82)))
    m = builder.fmul(d, builder.uitofp(builder.and_(sc, ir.Constant(I32, 15)), F32))
    return m, builder.fneg(builder.fmul(dmin, builder.uitofp(builder.lshr(sc, ir.Constant(I32, 4)), F32)))


def q3_k_chunk(builder, b, h, p, stored=False):
    """q3_k block at b: the signed values (q2 - 4 (1 - hb), <32 x i8>) of part p of half h; stored:
    q2 + 4 hb (0..7), the value plus 4."""
    q = crumbs(builder, builder.add(b, c64(32 + 32 * h)), p)
    hm = load(builder, b, vec(I8, 32))
    hb = builder.and_(builder.lshr(hm, cvec(I8, [4 * h + p] * 32)), cvec(I8, [1] * 32))
    if stored:
        return builder.or_(q, builder.shl(hb, cvec(I8, [2] * 32)))
    return builder.sub(q, builder.shl(builder.xor(hb, cvec(I8, [1] * 32)), cvec(I8, [2] * 32)))


def q3_k_scale(builder, b, s):
    """q3_k block at b: d (sc6_s - 32) as a float, s = 0..15."""
    lo = builder.and_(builder.lshr(builder.zext(u8(builder, builder.add(b, c64(96 + s % 8))), I32),
                                   ir.Constant(I32, 4 * (s // 8))), ir.Constant(I32, 15))
    hi = builder.and_(builder.lshr(builder.zext(u8(builder, builder.add(b, c64(104 + s % 4))), I32),
                                   ir.Constant(I32, 2 * (s // 4))), ir.Constant(I32, 3))
    sc = builder.sub(builder.or_(lo, builder.shl(hi, ir.Constant(I32, 4))), ir.Constant(I32, 32))
    return builder.fmul(f16(builder, builder.add(b, c64(108))), builder.sitofp(sc, F32))


def iq4_xs_scale(builder, b, s):
    """iq4_xs block at b: d (sc6_s - 32) as a float, s = 0..7."""
    lo = builder.and_(builder.lshr(builder.zext(u8(builder, builder.add(b, c64(4 + s // 2))), I32),
                                   ir.Constant(I32, 4 * (s % 2))), ir.Constant(I32, 15))
    hi = builder.and_(builder.lshr(builder.zext(load(builder, builder.add(b, c64(2)), I16), I32),
                                   ir.Constant(I32, 2 * s)), ir.Constant(I32, 3))
    sc = builder.sub(builder.or_(lo, builder.shl(hi, ir.Constant(I32, 4))), ir.Constant(I32, 32))
    return builder.fmul(f16(builder, b), builder.sitofp(sc, F32))


def trits(builder, v, pw):
    """<n x i8> bytes v, <n x i8> powers of 3 pw -> the trits minus 1: ((v pw mod 256) 3) >> 8, - 1."""
    n = v.type.count
    t = builder.mul(builder.zext(builder.mul(v, pw), vec(I16, n)), cvec(I16, [3] * n))
    return builder.sub(builder.trunc(builder.lshr(t, cvec(I16, [8] * n)), vec(I8, n)), cvec(I8, [1] * n))


def tq1_0_chunk(builder, b, c):
    """tq1_0 block at b: the signed values (<32 x i8>) of weights 32 c .. 32 c + 31."""
    if c < 5:                                   # trit c of qs[0..31]
        return trits(builder, load(builder, b, vec(I8, 32)), cvec(I8, [3 ** c] * 32))
    lo = load(builder, builder.add(b, c64(32)), vec(I8, 16))
    if c < 7:                                   # trits 2 (c - 5), 2 (c - 5) + 1 of qs[32..47]
        n = 2 * (c - 5)
        return trits(builder, concat(builder, lo, lo), cvec(I8, [3 ** n] * 16 + [3 ** (n + 1)] * 16))
    qh = load(builder, builder.add(b, c64(48)), vec(I8, 4))  # trit 4 of qs[32..47], then trits n of qh[j]
    qh16 = builder.shuffle_vector(qh, qh, cvec(I32, [i % 4 for i in range(16)]))
    return trits(builder, concat(builder, lo, qh16), cvec(I8, [81] * 16 + [3 ** (i // 4) for i in range(16)]))


def ue4m3_half_ir(builder, x):
    """a UE4M3 byte (i8) -> its value / 2 as a float (quant.ue4m3_half): exponent e > 0 gives the float
    with exponent field e + 119 and mantissa m << 20, e = 0 gives m 2^-10; 0x7f gives 0."""
    x = builder.zext(x, I32)
    e = builder.and_(builder.lshr(x, ir.Constant(I32, 3)), ir.Constant(I32, 15))
    m = builder.and_(x, ir.Constant(I32, 7))
    normal = builder.bitcast(builder.or_(builder.shl(builder.add(e, ir.Constant(I32, 119)), ir.Constant(I32, 23)),
                                         builder.shl(m, ir.Constant(I32, 20))), F32)
    sub = builder.fmul(builder.uitofp(m, F32), ir.Constant(F32, 2.0 ** -10))
    v = builder.select(builder.icmp_unsigned("==", e, ir.Constant(I32, 0)), sub, normal)
    return builder.select(builder.icmp_unsigned("==", x, ir.Constant(I32, 0x7F)), ir.Constant(F32, 0.0), v)


def nvfp4_chunk(builder, b, c):
    """nvfp4 block at b: the doubled E2M1 values (<32 x i8>) of sub-blocks 2c, 2c + 1 (each 8 bytes:
    low nibbles the first 8 weights)."""
    nib = nibbles(builder, builder.add(b, c64(4 + 16 * c)), 16)        # lows of 16 bytes, then highs
    nib = builder.shuffle_vector(nib, nib, cvec(I32, list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16))
                                                + list(range(24, 32))))
    return lookup16(builder, E2M1X2_VALUES, nib)


# -- the lattice types (i-quants): grid entries from constant tables -------------------------------
IQ_FORMATS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")


def _table(builder, name, rows, width):
    """A module-internal constant table of rows packed little-endian into i(8 width) integers."""
    g = builder.module.globals.get(name)
    if g is None:
        ety = ir.IntType(8 * width)
        vals = [int.from_bytes(bytes(int(v) & 255 for v in r), "little") for r in rows]
        aty = ir.ArrayType(ety, len(vals))
        g = ir.GlobalVariable(builder.module, aty, name=name)
        g.global_constant = True
        g.linkage = "internal"
        g.initializer = ir.Constant(aty, vals)
    return g


def _grid_row(builder, name, idx):
    """Row idx (i32) of lattice grid `name` (quant.iq_grid) as <8 x i8> or <4 x i8>."""
    from colibri_edge.model.quant import iq_grid
    grid = iq_grid(name)
    w = grid.shape[1]
    g = _table(builder, f"colibri_grid_{name}", grid, w)
    v = builder.load(builder.gep(g, [ir.Constant(I32, 0), idx], inbounds=True), align=w)
    return builder.bitcast(v, vec(I8, w))


def _ksigns(builder, i):
    from colibri_edge.model.quant import KSIGNS
    g = _table(builder, "colibri_ksigns", [[v] for v in KSIGNS], 1)
    return builder.load(builder.gep(g, [ir.Constant(I32, 0), i], inbounds=True))


def _signed(builder, v, sbyte):
    """<8 x i8> magnitudes v, an i8 of sign bits (bit j: weight j negative) -> the signed values."""
    neg = builder.icmp_unsigned("!=", bits(builder, sbyte, 8), cvec(I8, [0] * 8))
    return builder.select(neg, builder.sub(cvec(I8, [0] * 8), v), v)


def _cat(builder, parts):
    """Vectors of equal length -> their concatenation."""
    while len(parts) > 1:
        parts = [concat(builder, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def _i32(builder, v):
    return builder.zext(v, I32) if v.type.width < 32 else v


def _nib(builder, byte_addr, hi):
    """The low (hi = 0) or high nibble of the byte at byte_addr, as i32."""
    v = builder.zext(u8(builder, byte_addr), I32)
    return builder.and_(builder.lshr(v, ir.Constant(I32, 4 * hi)), ir.Constant(I32, 15))


def iq_chunks(fmt, builder, b):
    """An i-quant block at b as 8 chunks of 32: [(q <32 x i8> signed, m1, m2)], w = m q with m1 for
    weights 0-15 and m2 (None: m1) for 16-31. IQ1's q is 8 (grid +- 1/8), m the scale / 8: integers,
    exactly (every value and product here is exact in float32)."""
    k32 = lambda v: ir.Constant(I32, v)                                           # noqa: E731
    fk = lambda v: ir.Constant(F32, v)                                            # noqa: E731
    fl = lambda v: builder.uitofp(v, F32)                                         # noqa: E731
    at_ = lambda o: builder.add(b, c64(o))                                        # noqa: E731
    out = []
    if fmt in ("iq2_xxs", "iq3_xxs"):
        d = f16(builder, b)
        for g in range(8):
            if fmt == "iq2_xxs":
                sx = load(builder, at_(2 + 8 * g + 4), I32)
                rows = [_grid_row(builder, "iq2xxs", _i32(builder, u8(builder, at_(2 + 8 * g + l)))) for l in range(4)]
            else:
                sx = load(builder, at_(66 + 4 * g), I32)
                r4 = [_grid_row(builder, "iq3xxs", _i32(builder, u8(builder, at_(2 + 8 * g + k)))) for k in range(8)]
                rows = [concat(builder, r4[2 * l], r4[2 * l + 1]) for l in range(4)]
            q = _cat(builder, [_signed(builder, rows[l], _ksigns(builder, builder.and_(builder.lshr(sx, k32(7 * l)),
                                                                                     k32(127)))) for l in range(4)])
            s = fl(builder.lshr(sx, k32(28)))
            m = builder.fmul(builder.fmul(d, builder.fadd(fk(0.5), s)), fk(0.25 if fmt == "iq2_xxs" else 0.5))
            out.append((q, m, None))
        return out
    if fmt in ("iq2_xs", "iq2_s"):
        d = f16(builder, b)
        sc_at = 66 if fmt == "iq2_xs" else 74
        for c in range(8):
            parts = []
            for l in range(4):
                i = 4 * c + l
                if fmt == "iq2_xs":
                    qv = builder.zext(load(builder, at_(2 + 2 * i), I16), I32)
                    idx, sb = builder.and_(qv, k32(511)), _ksigns(builder, builder.lshr(qv, k32(9)))
                    parts.append(_signed(builder, _grid_row(builder, "iq2xs", idx), sb))
                else:
                    hi = builder.and_(builder.lshr(builder.zext(u8(builder, at_(66 + i // 4)), I32), k32(2 * (i % 4))), k32(3))
                    idx = builder.or_(_i32(builder, u8(builder, at_(2 + i))), builder.shl(hi, k32(8)))
                    parts.append(_signed(builder, _grid_row(builder, "iq2s", idx), u8(builder, at_(34 + i))))
            ms = [builder.fmul(builder.fmul(d, builder.fadd(fk(0.5), builder.uitofp(_nib(builder, at_(sc_at + c), h), F32))),
                               fk(0.25)) for h in range(2)]
            out.append((_cat(builder, parts), ms[0], ms[1]))
        return out
    if fmt == "iq3_s":
        d = f16(builder, b)
        for g in range(8):
            qh = _i32(builder, u8(builder, at_(66 + g)))
            r4 = []
            for k in range(8):
                idx = builder.or_(_i32(builder, u8(builder, at_(2 + 8 * g + k))),
                                  builder.shl(builder.and_(builder.lshr(qh, k32(k)), k32(1)), k32(8)))
                r4.append(_grid_row(builder, "iq3s", idx))
            q = _cat(builder, [_signed(builder, concat(builder, r4[2 * l], r4[2 * l + 1]), u8(builder, at_(74 + 4 * g + l)))
                               for l in range(4)])
            s = builder.uitofp(_nib(builder, at_(106 + g // 2), g % 2), F32)
            out.append((q, builder.fmul(d, builder.fadd(fk(1.0), builder.fmul(fk(2.0), s))), None))
        return out
    if fmt in ("iq1_s", "iq1_m"):
        if fmt == "iq1_s":
            d = f16(builder, b)
        else:
            sc = [builder.zext(load(builder, at_(48 + 2 * j), I16), I32) for j in range(4)]
            bits16 = sc[0]
            bits16 = builder.lshr(sc[0], k32(12))
            for j in range(1, 4):
                bits16 = builder.or_(bits16, builder.shl(builder.lshr(sc[j], k32(12)), k32(4 * j)))
            d = builder.fpext(builder.bitcast(builder.trunc(bits16, I16), HALF), F32)
        for g in range(8):
            parts, ms = [], []
            if fmt == "iq1_s":
                qh = builder.zext(load(builder, at_(34 + 2 * g), I16), I32)
                neg = builder.icmp_unsigned("!=", builder.and_(qh, k32(0x8000)), k32(0))
                s = builder.and_(builder.lshr(qh, k32(12)), k32(7))
                m = builder.fmul(builder.fmul(d, fl(builder.add(builder.shl(s, k32(1)), k32(1)))), fk(0.125))
                ms = [m, None]
            for l in range(4):
                i = 4 * g + l
                if fmt == "iq1_s":
                    hi = builder.and_(builder.lshr(qh, k32(3 * l)), k32(7))
                    idx = builder.or_(_i32(builder, u8(builder, at_(2 + i))), builder.shl(hi, k32(8)))
                    n_ = neg
                else:
                    nib = _nib(builder, at_(32 + i // 2), i % 2)
                    idx = builder.or_(_i32(builder, u8(builder, at_(i))), builder.shl(builder.and_(nib, k32(7)), k32(8)))
                    n_ = builder.icmp_unsigned("!=", builder.and_(nib, k32(8)), k32(0))
                row = builder.mul(_grid_row(builder, "iq1s", idx), cvec(I8, [8] * 8))
                parts.append(builder.add(row, builder.select(n_, cvec(I8, [255] * 8), cvec(I8, [1] * 8))))
            if fmt == "iq1_m":
                for h in range(2):
                    k = 2 * g + h
                    s = builder.and_(builder.lshr(sc[k // 4], k32(3 * (k % 4))), k32(7))
                    ms.append(builder.fmul(builder.fmul(d, fl(builder.add(builder.shl(s, k32(1)), k32(1)))), fk(0.125)))
            out.append((_cat(builder, parts), ms[0], ms[1]))
        return out
    raise ValueError(fmt)


def halves(builder, q):
    """<32 x T> -> its two <16 x T> halves."""
    return [builder.shuffle_vector(q, q, cvec(I32, range(16 * k, 16 * k + 16))) for k in range(2)]


def decode(fmt, builder, b):
    """The chunks of the block whose bytes start at address b (i64): [(mult, add, q)], in weight order."""
    fl = lambda v: builder.uitofp(v, F32)                                           # noqa: E731
    if fmt == "q8_0":
        return [(f16(builder, b), None, sif(builder, load(builder, builder.add(b, c64(2)), vec(I8, 32))))]
    if fmt == "q4_0":
        q = builder.sub(nibbles(builder, builder.add(b, c64(2))), cvec(I8, [8] * 32))
        return [(f16(builder, b), None, sif(builder, q))]
    if fmt == "q4_1":
        return [(f16(builder, b), f16(builder, builder.add(b, c64(2))), uif(builder, nibbles(builder, builder.add(b, c64(4)))))]
    if fmt in ("q5_0", "q5_1"):
        o = 2 if fmt == "q5_0" else 4
        qh = load(builder, builder.add(b, c64(o)), I32)
        q = builder.or_(nibbles(builder, builder.add(b, c64(o + 4))), builder.shl(bits(builder, qh, 32), cvec(I8, [4] * 32)))
        if fmt == "q5_0":
            return [(f16(builder, b), None, sif(builder, builder.sub(q, cvec(I8, [16] * 32))))]
        return [(f16(builder, b), f16(builder, builder.add(b, c64(2))), uif(builder, q))]
    if fmt == "mxfp4":
        e = builder.zext(u8(builder, b), I32)           # 2^(e - 128): e8m0_half, exact for every e
        small = builder.shl(ir.Constant(I32, 0x00200000), e)
        normal = builder.shl(builder.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23))
        d = builder.bitcast(builder.select(builder.icmp_unsigned("<", e, ir.Constant(I32, 2)), small, normal), F32)
        return [(d, None, e2m1x2(builder, nibbles(builder, builder.add(b, c64(1)))))]
    if fmt in ("q4_k", "q5_k"):
        d, dmin = f16(builder, b), f16(builder, builder.add(b, c64(2)))
        out = []
        for s in range(8):
            q = k_chunk(fmt, builder, b, s)
            sc, m = scale_min_k4(builder, builder.add(b, c64(4)), s)
            out.append((builder.fmul(d, fl(sc)), builder.fneg(builder.fmul(dmin, fl(m))), uif(builder, q)))
        return out
    if fmt == "q6_k":
        d = f16(builder, builder.add(b, c64(208)))
        out = []
        for h in range(2):
            for p in range(4):
                q = sif(builder, q6_k_chunk(builder, b, h, p))
                for k in range(2):                   # two scales of 16 per chunk of 32
                    sc = q6_k_scale(builder, b, h, p, k)
                    out.append((builder.fmul(d, sc), None, builder.shuffle_vector(q, q, cvec(I32, range(16 * k, 16 * k + 16)))))
        return out
    if fmt in ("q2_k", "q3_k"):                 # per 16: half h, part p, half-chunk k: sub-block 8h + 2p + k
        out = []
        for h in range(2):
            for p in range(4):
                if fmt == "q2_k":
                    q = uif(builder, crumbs(builder, builder.add(b, c64(16 + 32 * h)), p))
                else:
                    q = sif(builder, q3_k_chunk(builder, b, h, p))
                for k, qk in enumerate(halves(builder, q)):
                    s = 8 * h + 2 * p + k
                    mult, add = q2_k_scales(builder, b, s) if fmt == "q2_k" else (q3_k_scale(builder, b, s), None)
                    out.append((mult, add, qk))
        return out
    if fmt == "iq4_nl":
        return [(f16(builder, b), None, sif(builder, lookup16(builder, IQ4NL_VALUES, nibbles(builder, builder.add(b, c64(2))))))]
    if fmt == "iq4_xs":
        return [(iq4_xs_scale(builder, b, s), None,
                 sif(builder, lookup16(builder, IQ4NL_VALUES, nibbles(builder, builder.add(b, c64(8 + 16 * s))))))
                for s in range(8)]
    if fmt == "tq2_0":
        d = f16(builder, builder.add(b, c64(64)))
        return [(d, None, sif(builder, builder.sub(crumbs(builder, builder.add(b, c64(32 * h)), p), cvec(I8, [1] * 32))))
                for h in range(2) for p in range(4)]
    if fmt == "tq1_0":
        d = f16(builder, builder.add(b, c64(52)))
        return [(d, None, sif(builder, tq1_0_chunk(builder, b, c))) for c in range(8)]
    if fmt == "nvfp4":
        out = []
        for c in range(2):
            for k, qk in enumerate(halves(builder, sif(builder, nvfp4_chunk(builder, b, c)))):
                out.append((ue4m3_half_ir(builder, u8(builder, builder.add(b, c64(2 * c + k)))), None, qk))
        return out
    if fmt in IQ_FORMATS:
        out = []
        for q, m1, m2 in iq_chunks(fmt, builder, b):
            if m2 is None:
                out.append((m1, None, sif(builder, q)))
            else:
                out += [(m, None, qk) for m, qk in zip((m1, m2), halves(builder, sif(builder, q)))]
        return out
    raise ValueError(fmt)


def i64(context, builder, sig, args, i):
    """Integer argument i as i64."""
    return context.cast(builder, args[i], sig.args[i], types.int64)


def _row_loop(context, builder, sig, args, body):
    """Calls body(block_address, weight_index) for every block of one row. args: (w, row, x...)."""
    w, row = args[0], i64(context, builder, sig, args, 1)
    fmt = fmt_of(sig.args[0])
    B, nb = BLOCK[fmt]
    wbase = data_ptr(context, builder, sig.args[0], w)
    aryty = sig.args[0]
    nblocks = context.make_array(aryty)(context, builder, w).shape
    nblk = builder.extract_value(nblocks, 1)
    start = builder.add(wbase, builder.mul(row, builder.mul(nblk, c64(nb))))
    with cgutils.for_range(builder, nblk) as loop:
        body(builder.add(start, builder.mul(loop.index, c64(nb))), builder.mul(loop.index, c64(B)))
    return fmt


@intrinsic
def rowdeq(typingctx, w, row, out, ooff):
    """out[ooff : ooff + K] = the row w[row] dequantised to float32."""
    if not fmt_of(w):
        return None
    sig = types.void(w, row, out, ooff)

    def codegen(context, builder, sig, args):
        obase = builder.add(data_ptr(context, builder, sig.args[2], args[2]),
                            builder.mul(i64(context, builder, sig, args, 3), c64(4)))

        def body(baddr, k):
            off = 0
            for mult, add, q in decode(fmt_of(sig.args[0]), builder, baddr):
                n = q.type.count
                v = builder.fmul(q, splat(builder, mult, n))          # no contraction: quant.dequantize's
                if add is not None:                                       # rounding, exactly
                    v = builder.fadd(v, splat(builder, add, n))
                builder.store(v, at(builder, builder.add(obase, builder.mul(builder.add(k, c64(off)), c64(4))),
                                    vec(F32, n)), align=4)
                off += n
        _row_loop(context, builder, sig, args, body)
        return context.get_dummy_value()
    return sig, codegen


# -- int8 activations: integer dot products -------------------------------------------------------
# The activation row is quantised per block of 32 (qkernels.quantize_act; per 256 for INT256, below): q = rint(x / dx) in
# [-127, 127] (int8), dx = max|x| / 127, xs = dx * sum(q). A weight block decodes to integer chunks
# of 32, w = m q_w (+ add); then per chunk
#     w . x  ~=  m dx (q_w . q)  +  add xs
# with q_w . q exact in int32. On AVX2: vpmaddubsw (unsigned weight bytes x signed activation
# bytes, 32 products a instruction; signed weights through the sign trick |w|, sign(q, w)), then
# vpmaddwd against ones; with AVX-VNNI or AVX-512 VNNI one vpdpbusd does both (the four products of
# a lane summed into int32); elsewhere the generic form (both widened, products added in fours:
# smull/smlal on NEON). The float work is one multiply-add per 32 weights. Products never saturate
# vpmaddubsw's int16: |q_w| <= 128 (q8_0's -128; 63 for the other formats) and |q| <= 127, so a pair
# is at most 32512 < 2^15: every variant's int32 lanes are the same, and so are the logits.

# The x86 variants follow the CPU Numba compiles for, not only the host: a bundle's kernels built for a
# named CPU (NUMBA_CPU_NAME, serving/launch.py) must not call an instruction that CPU lacks. The host
# (unnamed, or named by its own name): its features. Another x86 name: AVX2 where the name is one of
# the AVX2 generations below, and never VNNI (a bundle's portable kernels). ARM64: sdot (the dot
# product extension, ARMv8.2+, optional before v8.4) where the target has it -- the host: its features;
# a named CPU: the names below, whose LLVM definitions have it (test_kernels checks each one against
# LLVM) -- and the generic IR otherwise (LLVM's smull/sshll/zip shuffles: ~45 instructions a chunk,
# where two sdot do it). NUMBA_CPU_FEATURES' "+dotprod" / "-dotprod" overrides either.
_AVX2_CPUS = ("haswell", "broadwell", "skylake", "skylake-avx512", "cascadelake", "cooperlake", "cannonlake",
              "icelake-client", "icelake-server", "tigerlake", "rocketlake", "alderlake", "raptorlake",
              "meteorlake", "sapphirerapids", "emeraldrapids", "graniterapids", "x86-64-v3", "x86-64-v4",
              "znver1", "znver2", "znver3", "znver4", "znver5")
_DOTPROD_CPUS = ("cortex-a55", "cortex-a75", "cortex-a76", "cortex-a76ae", "cortex-a77", "cortex-a78",
                 "cortex-a78c", "cortex-a510", "cortex-a710", "cortex-a715", "cortex-x1", "cortex-x2", "cortex-x3",
                 "neoverse-n1", "neoverse-n2", "neoverse-v1", "neoverse-v2", "apple-m1", "apple-m2", "ampere1")


def _aarch64_dotprod(name: str, host: str, feats, cpu_features: str) -> bool:
    """Whether the aarch64 CPU Numba compiles for has sdot/udot (see above)."""
    flags = (cpu_features or "").replace(" ", "").split(",")
    if "+dotprod" in flags:
        return True
    if "-dotprod" in flags:
        return False
    if name in ("host", host):
        return bool(feats.get("dotprod"))
    return name in _DOTPROD_CPUS


def _target_features() -> dict:
    """The x86 features the kernels may use: {"avx2": bool, "vnni": bool} for the CPU Numba compiles for."""
    from llvmlite import binding
    from numba.core import config
    try:
        host = binding.get_host_cpu_name().lower()
        feats = binding.get_host_cpu_features()
    except RuntimeError:            # features unknown on this host
        return {"avx2": False, "vnni": False, "vnni512": False, "sdot": False, "prefetch": False}
    name = (config.CPU_NAME or "host").lower()
    if platform.machine().lower() in ("aarch64", "arm64"):
        return {"avx2": False, "vnni": False, "vnni512": False, "prefetch": False,
                "sdot": _aarch64_dotprod(name, host, feats, config.CPU_FEATURES)}
    if name not in ("host", host):
        return {"avx2": name in _AVX2_CPUS and bool(feats.get("avx2")), "vnni": False, "vnni512": False,
                "sdot": False, "prefetch": False}
    avx2 = bool(feats.get("avx2"))
    vnni512 = avx2 and all(feats.get(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vnni"))
    vnni = avx2 and (bool(feats.get("avxvnni")) or vnni512)
    amd = host.startswith(("znver", "bdver", "btver", "amdfam"))
    return {"avx2": avx2, "vnni": vnni, "vnni512": vnni512, "sdot": False, "prefetch": avx2 and not amd}


_FEATURES = _target_features()
HAS_AVX2 = _FEATURES["avx2"]
HAS_VNNI = _FEATURES["vnni"]     # vpdpbusd on 256-bit vectors: AVX-VNNI (VEX) or AVX-512 VNNI + VL (EVEX)
HAS_VNNI512 = _FEATURES["vnni512"]   # and on 512-bit ones: two 32-weight chunks an instruction
HAS_SDOT = _FEATURES["sdot"]     # aarch64 sdot: lane j += the 4 s8 x s8 products of bytes 4j..4j+3
INT8_DOT = ("vpdpbusd (AVX-512 VNNI, two chunks a zmm)" if HAS_VNNI512 else "vpdpbusd (AVX-VNNI)" if HAS_VNNI
            else "vpmaddubsw + vpmaddwd (AVX2)" if HAS_AVX2 else "sdot (NEON dot product)" if HAS_SDOT
            else "generic (widened multiplies)")


def _fn(builder, name, ret, argtys):
    return builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(ret, argtys), name)


_ASM_PARSER = []       # numba initialises LLVM's target and asm printer, not its parser: once, on first use


def vnni_asm(builder, op, acc, a, b):
    """acc + op(a, b) for op vpdpwssd / vpdpbusd (<n x i32> operands, n = 8 or 16) as inline asm. The
    intrinsic is not kept: LLVM rewrites vpdpwssd(acc, a, b) as vpmaddwd + vpaddd and fuses back only
    the last add of each chain it reassociates, so pdot4x4_q's super-block ran 56 vpmaddwd + 56 vpaddd
    beside 16 vpdpwssd (310 vector uops for 4096 mult-adds; 254 with every one fused)."""
    if not _ASM_PARSER:
        _ASM_PARSER.append(llvm_binding.initialize_native_asmparser())
    ty = acc.type
    fn = ir.InlineAsm(ir.FunctionType(ty, [ty, ty, ty]), f"{op} $3, $2, $0", "=v,0,v,v")
    return builder.call(fn, [acc, a, b])


def e2m1x2_i8(builder, nib):
    """<n x i8> E2M1 codes -> <n x i8> doubled values (as e2m1x2, integers in [-12, 12]): one
    vpshufb table lookup on AVX2, arithmetic elsewhere."""
    n = nib.type.count
    if HAS_AVX2 and n == 32:
        table = cvec(I8, [int(v) & 255 for v in (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)] * 2)
        return builder.call(_fn(builder, "llvm.x86.avx2.pshuf.b", vec(I8, 32), [vec(I8, 32), vec(I8, 32)]), [table, nib])
    if ON_AARCH64 and n % 16 == 0:
        return tbl16(builder, E2M1X2_VALUES, nib)
    i = builder.and_(nib, cvec(I8, [7] * n))
    big = builder.shl(builder.add(cvec(I8, [2] * n), builder.and_(i, cvec(I8, [1] * n))),
                      builder.sub(builder.lshr(i, cvec(I8, [1] * n)), cvec(I8, [1] * n)))
    mag = builder.select(builder.icmp_unsigned("<", i, cvec(I8, [4] * n)), i, big)
    neg = builder.icmp_unsigned("!=", builder.and_(nib, cvec(I8, [8] * n)), cvec(I8, [0] * n))
    return builder.select(neg, builder.sub(cvec(I8, [0] * n), mag), mag)


def decode_int(fmt, builder, b):
    """The block at address b as integer chunks of 32 weights: [(q, signed, m1, m2, add)] with
    w = m q + add: q <32 x i8> (signed, or unsigned values < 128), m1 the float multiplier of the
    chunk (m2, when not None, of its last 16 weights: q6_k's scales are per 16), add a float or None.
    q4_0 / q5_0's offsets (-8, -16) go with the activation sums: add = -8 d."""
    fl = lambda v: builder.uitofp(v, F32)                                           # noqa: E731
    k = lambda v: ir.Constant(F32, v)                                               # noqa: E731
    if fmt == "q8_0":
        return [(load(builder, builder.add(b, c64(2)), vec(I8, 32)), True, f16(builder, b), None, None)]
    if fmt == "q4_0":
        d = f16(builder, b)
        return [(nibbles(builder, builder.add(b, c64(2))), False, d, None, builder.fmul(d, k(-8.0)))]
    if fmt == "q4_1":
        return [(nibbles(builder, builder.add(b, c64(4))), False, f16(builder, b), None,
                 f16(builder, builder.add(b, c64(2))))]
    if fmt in ("q5_0", "q5_1"):
        o = 2 if fmt == "q5_0" else 4
        qh = load(builder, builder.add(b, c64(o)), I32)
        q = builder.or_(nibbles(builder, builder.add(b, c64(o + 4))), builder.shl(bits(builder, qh, 32), cvec(I8, [4] * 32)))
        d = f16(builder, b)
        return [(q, False, d, None, builder.fmul(d, k(-16.0)) if fmt == "q5_0" else f16(builder, builder.add(b, c64(2))))]
    if fmt == "mxfp4":
        e = builder.zext(u8(builder, b), I32)
        small = builder.shl(ir.Constant(I32, 0x00200000), e)
        normal = builder.shl(builder.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23))
        d = builder.bitcast(builder.select(builder.icmp_unsigned("<", e, ir.Constant(I32, 2)), small, normal), F32)
        return [(e2m1x2_i8(builder, nibbles(builder, builder.add(b, c64(1)))), True, d, None, None)]
    if fmt in ("q4_k", "q5_k"):
        d, dmin = f16(builder, b), f16(builder, builder.add(b, c64(2)))
        out = []
        for s in range(8):
            sc, m = scale_min_k4(builder, builder.add(b, c64(4)), s)
            out.append((k_chunk(fmt, builder, b, s), False, builder.fmul(d, fl(sc)), None,
                        builder.fneg(builder.fmul(dmin, fl(m)))))
        return out
    if fmt == "q6_k":
        d = f16(builder, builder.add(b, c64(208)))
        out = []
        for h in range(2):
            for p in range(4):
                q = q6_k_chunk(builder, b, h, p)
                sc = [q6_k_scale(builder, b, h, p, j) for j in range(2)]
                out.append((q, True, builder.fmul(d, sc[0]), builder.fmul(d, sc[1]), None))
        return out
    if fmt in ("q2_k", "q3_k"):
        out = []
        for h in range(2):
            for p in range(4):
                s = 8 * h + 2 * p
                if fmt == "q2_k":                # the mins per 16: add is a pair (see _rowdot_int_codegen)
                    (m1, a1), (m2, a2) = q2_k_scales(builder, b, s), q2_k_scales(builder, b, s + 1)
                    out.append((crumbs(builder, builder.add(b, c64(16 + 32 * h)), p), False, m1, m2, (a1, a2)))
                else:
                    out.append((q3_k_chunk(builder, b, h, p), True, q3_k_scale(builder, b, s),
                                q3_k_scale(builder, b, s + 1), None))
        return out
    if fmt == "iq4_nl":
        return [(lookup16(builder, IQ4NL_VALUES, nibbles(builder, builder.add(b, c64(2)))), True, f16(builder, b), None, None)]
    if fmt == "iq4_xs":
        return [(lookup16(builder, IQ4NL_VALUES, nibbles(builder, builder.add(b, c64(8 + 16 * s)))), True,
                 iq4_xs_scale(builder, b, s), None, None) for s in range(8)]
    if fmt == "tq2_0":
        d = f16(builder, builder.add(b, c64(64)))
        return [(builder.sub(crumbs(builder, builder.add(b, c64(32 * h)), p), cvec(I8, [1] * 32)), True, d, None, None)
                for h in range(2) for p in range(4)]
    if fmt == "tq1_0":
        d = f16(builder, builder.add(b, c64(52)))
        return [(tq1_0_chunk(builder, b, c), True, d, None, None) for c in range(8)]
    if fmt == "nvfp4":
        return [(nvfp4_chunk(builder, b, c), True, ue4m3_half_ir(builder, u8(builder, builder.add(b, c64(2 * c)))),
                 ue4m3_half_ir(builder, u8(builder, builder.add(b, c64(2 * c + 1)))), None) for c in range(2)]
    if fmt in IQ_FORMATS:
        return [(q, True, m1, m2, None) for q, m1, m2 in iq_chunks(fmt, builder, b)]
    raise ValueError(fmt)


def dot8(builder, q, signed, x):
    """<32 x i8> weights q, activations x -> <8 x i32> partial sums of q . x, lane j holding the
    products of elements 4j .. 4j + 3 (so lanes 0-3 are the first 16 weights). Every variant gives
    the same exact int32 lanes: vpmaddubsw's int16 pair sums never saturate here (above)."""
    if HAS_AVX2:
        v32 = vec(I8, 32)
        if signed:                                   # |q| . sign(x, q): the unsigned operand comes first
            x = builder.call(_fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32]), [x, q])
            q = builder.call(_fn(builder, "llvm.abs.v32i8", v32, [v32, ir.IntType(1)]), [q, ir.Constant(ir.IntType(1), 0)])
        if HAS_VNNI:                                 # one instruction: lane j += sum of 4 u8 x s8 products
            v8 = vec(I32, 8)
            return builder.call(_fn(builder, "llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8]),
                                [cvec(I32, [0] * 8), builder.bitcast(q, v8), builder.bitcast(x, v8)])
        p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [v32, v32]), [q, x])
        return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16), vec(I16, 16)]),
                            [p16, cvec(I16, [1] * 16)])
    if HAS_SDOT:        # two sdot, 16 bytes each: the unsigned weights are < 128, the same as int8
        v16, v4 = vec(I8, 16), vec(I32, 4)
        sdot = _fn(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", v4, [v4, v16, v16])
        half = lambda v, h: builder.shuffle_vector(v, v, cvec(I32, range(16 * h, 16 * h + 16)))  # noqa: E731
        lo, hi = (builder.call(sdot, [cvec(I32, [0] * 4), half(q, h), half(x, h)]) for h in (0, 1))
        return builder.shuffle_vector(lo, hi, cvec(I32, range(8)))
    w = (builder.sext if signed else builder.zext)(q, vec(I32, 32))
    p = builder.mul(w, builder.sext(x, vec(I32, 32)))
    four = lambda j: builder.shuffle_vector(p, p, cvec(I32, range(j, 32, 4)))        # noqa: E731
    return builder.add(builder.add(four(0), four(1)), builder.add(four(2), four(3)))


def dot16(builder, q, signed, x):
    """<64 x i8> weights q (two chunks of 32), activations x -> <16 x i32>: dot8 of each chunk side
    by side (lanes 0-7 the first chunk's, 8-15 the second's), by one 512-bit vpdpbusd. AVX-512 has no
    vpsignb: the signed weights' sign goes onto x by a select (where q is 0 the product is 0 anyway)."""
    v64, v16 = vec(I8, 64), vec(I32, 16)
    if signed:
        x = builder.select(builder.icmp_signed("<", q, cvec(I8, [0] * 64)), builder.sub(cvec(I8, [0] * 64), x), x)
        q = builder.call(_fn(builder, "llvm.abs.v64i8", v64, [v64, ir.IntType(1)]), [q, ir.Constant(ir.IntType(1), 0)])
    return builder.call(_fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16]),
                        [cvec(I32, [0] * 16), builder.bitcast(q, v16), builder.bitcast(x, v16)])


def _fma8(builder, acc, s8, m1, m2, dx):
    """acc + float(s8) * (m dx): one multiplier, or m1 for lanes 0-3 and m2 for lanes 4-7."""
    fast = ("fast",)
    a = splat(builder, builder.fmul(m1, dx), 8)
    if m2 is not None:
        a = builder.shuffle_vector(a, splat(builder, builder.fmul(m2, dx), 8), cvec(I32, [0] * 4 + [8] * 4))
    return builder.fadd(acc, builder.fmul(builder.sitofp(s8, vec(F32, 8)), a, flags=fast), flags=fast)


def _rowdot_int_codegen(ntok):
    """args: (w, row, qx, dx, xs, xoff_0 .. xoff_{ntok-1}); qx int8, dx / xs float32, contiguous; the
    activation of token t starts at element xoff_t of qx (its scales at xoff_t / 32 of dx and xs)."""
    def codegen(context, builder, sig, args):
        qb, db, sb = (data_ptr(context, builder, sig.args[i], args[i]) for i in (2, 3, 4))
        xo = [i64(context, builder, sig, args, 5 + t) for t in range(ntok)]
        xaddr = [builder.add(qb, o) for o in xo]
        dofs = [builder.mul(builder.lshr(o, c64(5)), c64(4)) for o in xo]
        acc = [cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 8), [0.0] * 8)) for _ in range(ntok)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(ntok)]
        fast = ("fast",)

        fmt = fmt_of(sig.args[0])

        def body(baddr, k):
            for ci, (q, signed, m1, m2, add) in enumerate(decode_int(fmt, builder, baddr)):
                kk = builder.add(k, c64(32 * ci))
                j4 = builder.mul(builder.lshr(kk, c64(5)), c64(4))
                for t in range(ntok):
                    s8 = dot8(builder, q, signed, load(builder, builder.add(xaddr[t], kk), vec(I8, 32)))
                    dx = load(builder, builder.add(builder.add(db, dofs[t]), j4), F32, align=4)
                    builder.store(_fma8(builder, builder.load(acc[t]), s8, m1, m2, dx), acc[t])
                    if isinstance(add, tuple):         # per-16 additive terms times the activations' sums
                        s1 = dot8(builder, cvec(I8, [1] * 32), False, load(builder, builder.add(xaddr[t], kk), vec(I8, 32)))
                        builder.store(_fma8(builder, builder.load(acc[t]), s1, add[0], add[1], dx), acc[t])
                    elif add is not None:
                        if fmt in INT256:       # xs holds the per-16 int16 sums there (quantize_act): dx sum(q)
                            xs = builder.fmul(dx, builder.sitofp(_hsum_i32(builder, dot8(
                                builder, cvec(I8, [1] * 32), False, load(builder, builder.add(xaddr[t], kk), vec(I8, 32)))), F32))
                        else:
                            xs = load(builder, builder.add(builder.add(sb, dofs[t]), j4), F32, align=4)
                        builder.store(builder.fadd(builder.load(accs[t]), builder.fmul(add, xs, flags=fast), flags=fast),
                                      accs[t])
        _row_loop(context, builder, sig, args, body)
        sums = [builder.fadd(reduce_add(builder, builder.load(acc[t])), builder.load(accs[t])) for t in range(ntok)]
        return sums[0] if ntok == 1 else context.make_tuple(builder, sig.return_type, sums)
    return codegen


@intrinsic
def rowdot_q(typingctx, w, row, qx, dx, xs, xoff):
    """w[row] . x_t for the int8-quantised activation at element xoff of qx (see above)."""
    if not fmt_of(w):
        return None
    return types.float32(w, row, qx, dx, xs, xoff), _rowdot_int_codegen(1)


# -- four rows at a time, 256 weights a step -------------------------------------------------------
# The GEMV of the int8 path: four rows side by side (as kernels.matmul's four streams), so each
# activation chunk is loaded once for four rows, and a group of 256 weights (eight 32-blocks, or one
# K-quant super-block) has its eight block multipliers built as one vector: the eight f16 scales of
# the 32-blocks gathered and widened by one vcvtph2ps, a K-quant's 6-bit scales unpacked as three
# 32-bit words (ggml's kmask trick), then multiplied by the eight activation scales in one go. A
# block's float work is then one lane broadcast and one FMA.

def _gather_f16(builder, g, nb, off):
    """<8 x float> of the f16 at byte `off` of each of the 8 blocks of nb bytes from address g."""
    v = ir.Constant(vec(HALF, 8), ir.Undefined)
    for i in range(8):
        v = builder.insert_element(v, load(builder, builder.add(g, c64(i * nb + off)), HALF), ir.Constant(I32, i))
    return builder.fpext(v, vec(F32, 8))


def _k4_scales(builder, base):
    """The 12 bytes of q4_k / q5_k scales at base -> (sc, m) as <8 x float> (get_scale_min_k4 for
    j = 0..7)."""
    sc, m = _k4_scales_i8(builder, base)
    return builder.uitofp(sc, vec(F32, 8)), builder.uitofp(m, vec(F32, 8))


def _k4_scales_i8(builder, base):
    """The 12 bytes of q4_k / q5_k scales at base -> (sc, m) as <8 x i8> (get_scale_min_k4 for
    j = 0..7, computed on three 32-bit words: ggml's kmask trick)."""
    w = [load(builder, builder.add(base, c64(4 * i)), I32) for i in range(3)]
    k = lambda v: ir.Constant(I32, v)                                                   # noqa: E731
    m1, m2, m3 = k(0x3f3f3f3f), k(0x0f0f0f0f), k(0x03030303)
    u3 = builder.or_(builder.and_(builder.lshr(w[2], k(4)), m2), builder.shl(builder.and_(builder.lshr(w[1], k(6)), m3), k(4)))
    u2 = builder.and_(w[1], m1)
    u1 = builder.or_(builder.and_(w[2], m2), builder.shl(builder.and_(builder.lshr(w[0], k(6)), m3), k(4)))
    u0 = builder.and_(w[0], m1)
    words = lambda a, b: builder.bitcast(builder.insert_element(builder.insert_element(      # noqa: E731
        ir.Constant(vec(I32, 2), ir.Undefined), a, k(0)), b, k(1)), vec(I8, 8))
    return words(u0, u1), words(u2, u3)


def group_int(fmt, builder, g):
    """The group of 256 weights at address g: (chunks, mult, add): chunks 8 (q, signed); mult the
    chunks' weight multipliers, <8 x float> (PER16: <16 x float>, one per 16 weights); add <8 x float>
    of the chunks' additive terms (q2_k: <16 x float>, per 16), or None."""
    B, nb = BLOCK[fmt]
    if fmt not in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q4_k", "q5_k", "q6_k"):
        return group_int_any(fmt, builder, g)
    if B == 32:
        chunks = [decode_int(fmt, builder, builder.add(g, c64(i * nb)))[0][:2] for i in range(8)]
        if fmt == "mxfp4":
            e = ir.Constant(vec(I32, 8), ir.Undefined)
            for i in range(8):
                e = builder.insert_element(e, builder.zext(u8(builder, builder.add(g, c64(i * nb))), I32),
                                           ir.Constant(I32, i))
            small = builder.shl(cvec(I32, [0x00200000] * 8), e)
            normal = builder.shl(builder.sub(e, cvec(I32, [1] * 8)), cvec(I32, [23] * 8))
            mult = builder.bitcast(builder.select(builder.icmp_unsigned("<", e, cvec(I32, [2] * 8)), small, normal),
                                   vec(F32, 8))
            return chunks, mult, None
        d = _gather_f16(builder, g, nb, 0)
        if fmt in ("q4_1", "q5_1"):
            return chunks, d, _gather_f16(builder, g, nb, 2)
        if fmt in ("q4_0", "q5_0"):                     # the offset as an additive term (decode_int)
            return chunks, d, builder.fmul(d, splat(builder, ir.Constant(F32, -8.0 if fmt == "q4_0" else -16.0), 8))
        return chunks, d, None
    chunks = [c[:2] for c in decode_int(fmt, builder, g)]
    if fmt in ("q4_k", "q5_k"):
        d, dmin = f16(builder, g), f16(builder, builder.add(g, c64(2)))
        sc, m = _k4_scales(builder, builder.add(g, c64(4)))
        return chunks, builder.fmul(sc, splat(builder, d, 8)), builder.fmul(m, splat(builder, builder.fneg(dmin), 8))
    if fmt == "q6_k":
        d = f16(builder, builder.add(g, c64(208)))
        sc = builder.sitofp(load(builder, builder.add(g, c64(192)), vec(I8, 16)), vec(F32, 16))
        return chunks, builder.fmul(sc, splat(builder, d, 16)), None
    raise ValueError(fmt)


PER16 = ("q6_k", "q2_k", "q3_k", "nvfp4", "iq2_xs", "iq2_s", "iq1_m")       # formats with a multiplier per 16 weights


def _lanes(builder, vals):
    """floats -> <len(vals) x float>"""
    v = ir.Constant(vec(F32, len(vals)), ir.Undefined)
    for i, x in enumerate(vals):
        v = builder.insert_element(v, x, ir.Constant(I32, i))
    return v


def _shr_and(builder, v, shifts, mask):
    """(v >> shifts) & mask, lane by lane (v, shifts: vectors of one integer type)."""
    n, t = v.type.count, v.type.element
    return builder.and_(builder.lshr(v, ir.Constant(vec(t, n), list(shifts))), ir.Constant(vec(t, n), [mask] * n))


def _splat_load(builder, addr, ty, n):
    return splat(builder, load(builder, addr, ty), n)


def _iq4_xs_sc(builder, g):
    """iq4_xs group at g: its 8 scales, <8 x i8>: (4 bits of scales_l | 2 bits of scales_h << 4) - 32."""
    sh = lambda v, a: builder.shuffle_vector(v, v, cvec(I32, a))                       # noqa: E731
    lo = _shr_and(builder, sh(load(builder, builder.add(g, c64(4)), vec(I8, 4)), [i // 2 for i in range(8)]),
                  [4 * (i % 2) for i in range(8)], 15)
    hi = builder.trunc(_shr_and(builder, _splat_load(builder, builder.add(g, c64(2)), I16, 8), [2 * i for i in range(8)], 3),
                       vec(I8, 8))
    return builder.sub(builder.or_(lo, builder.shl(hi, cvec(I8, [4] * 8))), cvec(I8, [32] * 8))


def _q3_k_sc(builder, g):
    """q3_k group at g: its 16 scales, <16 x i8>: (low 4 bits | high 2 bits << 4) - 32."""
    sh = lambda v, a: builder.shuffle_vector(v, v, cvec(I32, a))                       # noqa: E731
    lo = _shr_and(builder, sh(load(builder, builder.add(g, c64(96)), vec(I8, 8)), [s % 8 for s in range(16)]),
                  [4 * (s // 8) for s in range(16)], 15)
    hi = _shr_and(builder, sh(load(builder, builder.add(g, c64(104)), vec(I8, 4)), [s % 4 for s in range(16)]),
                  [2 * (s // 4) for s in range(16)], 3)
    return builder.sub(builder.or_(lo, builder.shl(hi, cvec(I8, [4] * 16))), cvec(I8, [32] * 16))


# -- activations per 256: the sub-block scales in integers ---------------------------------------------
# For the super-block formats whose sub-block scales are small integers times one float (INT256), the
# activations are quantised per 256 instead of per 32 (quant.act_block: llama.cpp's Q8_K does the same
# for its K-quant and IQ dots): one activation scale for the whole group, so a group's
#     sum_j (d sc_j dx) (q_w . q)_j  =  (d dx) sum_j sc_j (q_w . q)_j
# is an int32 sum (sc_j (q_w . q)_j exact: |q_w| <= 127, |q| <= 127, |sc| <= 127) and one float
# multiply-add per 256 weights and token, where the per-32 form took a conversion, a lane broadcast
# and a multiply-add per 32. On AVX2, vpmaddubsw's int16 pair sums times the scales by vpmaddwd (the
# instruction that multiplied them by ones before), with VNNI accumulated by vpdpwssd; elsewhere the
# int32 lanes of dot8 times the scales. The activations' per-16 sums (quantize_act keeps them, as
# Q8_K's bsums) take what is not a product of stored values: q3_k's and q6_k's values are read as
# stored, unsigned (q + 4, q + 32: no sign trick on every chunk), the offset coming back as
# - off sum_i sc_i bs_i, and the K-quant mins as one vpmaddwd of the mins against the sums (q2_k's
# took a float FMA per 16 before). Every variant's int32 lanes are the same numbers (exact), so a
# token's logits do not depend on the tile or the ISA. Measured on the AVX-512 host (2 threads, 4 tokens
# in cache, G multiply-adds/s, per 32 -> per 256): q4_k 96 -> 104, q6_k 67 -> 102, q3_k 67 -> 108, q2_k
# 60 -> 106, iq4_xs 80 -> 78; decode, one token against 160 cold 2816 x 1024 matrices (GB/s): q3_k 10.2
# -> 19.5, q6_k 23.3 -> 26.8, q4_k and iq4_xs the same (26.8 / 20.6: q4_k at 90% of the 29.7 GB/s probe).
INT256 = ACT256


@intrinsic
def act_block(typingctx, w):
    """quant.act_block of a weight view's format, a compile-time constant: 256 or 32."""
    if not fmt_of(w):
        return None
    return types.int64(w), lambda context, builder, sig, args: c64(256 if fmt_of(sig.args[0]) in INT256 else 32)


def group_iscales(fmt, builder, g):
    """The group of 256 weights at g: (chunks, sc, d, off, mins, dmin): chunks 8 (q, signed), sc the
    integer sub-block scales as <8 x i16> (per 32) or <16 x i16> (PER16), d the float that multiplies
    them, off the offset the chunks' stored values carry (q3_k 4, q6_k 32: their unsigned values, no
    sign trick), mins the per-16 integer mins (<16 x i16>) and dmin their float multiplier, or None:
        w = d sc (q - off) - dmin m."""
    chunks = [c[:2] for c in decode_int(fmt, builder, g)]
    if fmt in ("q3_k", "q6_k"):
        chunks = [(q3_k_chunk(builder, g, h, p, stored=True) if fmt == "q3_k" else
                   q6_k_chunk(builder, g, h, p, stored=True), False) for h in range(2) for p in range(4)]
    sc, d, mins, dmin = _iscales(fmt, builder, g)
    return chunks, sc, d, {"q3_k": 4, "q6_k": 32}.get(fmt, 0), mins, dmin


def _iscales(fmt, builder, g):
    """group_iscales' (sc, d, mins, dmin)."""
    at_ = lambda o: builder.add(g, c64(o))                                             # noqa: E731
    sx = lambda v: builder.sext(v, vec(I16, v.type.count))                              # noqa: E731
    zx = lambda v: builder.zext(v, vec(I16, v.type.count))                              # noqa: E731
    if fmt in ("q4_k", "q5_k"):              # the 8 mins, each for its 32 weights' two 16s
        sc, m = _k4_scales_i8(builder, at_(4))
        m16 = builder.shuffle_vector(m, m, cvec(I32, [i // 2 for i in range(16)]))
        return zx(sc), f16(builder, g), zx(m16), f16(builder, at_(2))
    if fmt == "q6_k":
        return sx(load(builder, at_(192), vec(I8, 16))), f16(builder, at_(208)), None, None
    if fmt == "q3_k":
        return sx(_q3_k_sc(builder, g)), f16(builder, at_(108)), None, None
    if fmt == "iq4_xs":
        return sx(_iq4_xs_sc(builder, g)), f16(builder, g), None, None
    if fmt == "q2_k":
        sc = load(builder, g, vec(I8, 16))
        return (zx(builder.and_(sc, cvec(I8, [15] * 16))), f16(builder, at_(80)),
                zx(builder.lshr(sc, cvec(I8, [4] * 16))), f16(builder, at_(82)))
    raise ValueError(fmt)


def madd16(builder, a, b):
    """<16 x i16> a, b -> <8 x i32>: a[2j] b[2j] + a[2j+1] b[2j+1] (vpmaddwd on AVX2; exact: no lane
    here reaches 2^15 x 2^15)."""
    if HAS_AVX2:
        return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16), vec(I16, 16)]), [a, b])
    p = builder.mul(builder.sext(a, vec(I32, 16)), builder.sext(b, vec(I32, 16)))
    return builder.add(builder.shuffle_vector(p, p, cvec(I32, range(0, 16, 2))),
                       builder.shuffle_vector(p, p, cvec(I32, range(1, 16, 2))))


def madd32(builder, a, b):
    """madd16 of 512-bit vectors: <32 x i16> a, b -> <16 x i32> (vpmaddwd zmm; AVX-512 BW only)."""
    return builder.call(_fn(builder, "llvm.x86.avx512.pmaddw.d.512", vec(I32, 16), [vec(I16, 32), vec(I16, 32)]), [a, b])


def _sc_lanes(builder, sc, chunks):
    """The scales of the chunks as int16 lanes of vpmaddubsw's pair sums, 16 a chunk (lane i of a
    chunk: its weights 2i, 2i + 1; per-16 scales: lanes 0-7 its first 16 weights)."""
    per16 = sc.type.count == 16
    lanes = [2 * ch + j // 8 if per16 else ch for ch in chunks for j in range(16)]
    return builder.shuffle_vector(sc, sc, cvec(I32, lanes))


def sdot8(builder, acc, q, signed, x, sc16):
    """acc (<8 x i32>) + dot8(q, x) lanes times their scales: sc16 <16 x i16> holds the scale of each
    pair of weights (_sc_lanes), lane j of dot8 covering pairs 2j, 2j + 1 (equal scales)."""
    if HAS_AVX2:
        v32, v8 = vec(I8, 32), vec(I32, 8)
        if signed:
            x = builder.call(_fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32]), [x, q])
            q = builder.call(_fn(builder, "llvm.abs.v32i8", v32, [v32, ir.IntType(1)]), [q, ir.Constant(ir.IntType(1), 0)])
        p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [v32, v32]), [q, x])
        if HAS_VNNI:                     # acc += p16 . sc16 in pairs, one instruction
            return builder.call(_fn(builder, "llvm.x86.avx512.vpdpwssd.256", v8, [v8, v8, v8]),
                                [acc, builder.bitcast(p16, v8), builder.bitcast(sc16, v8)])
        return builder.add(acc, builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", v8, [vec(I16, 16), vec(I16, 16)]),
                                             [p16, sc16]))
    s32 = builder.sext(builder.shuffle_vector(sc16, sc16, cvec(I32, range(0, 16, 2))), vec(I32, 8))
    return builder.add(acc, builder.mul(dot8(builder, q, signed, x), s32))


def sdot16(builder, acc, q, signed, x, sc32):
    """The 512-bit sdot8 of a chunk pair (dot16's lanes): acc <16 x i32>, sc32 <32 x i16>."""
    v64, v16 = vec(I8, 64), vec(I32, 16)
    if signed:
        x = builder.select(builder.icmp_signed("<", q, cvec(I8, [0] * 64)), builder.sub(cvec(I8, [0] * 64), x), x)
        q = builder.call(_fn(builder, "llvm.abs.v64i8", v64, [v64, ir.IntType(1)]), [q, ir.Constant(ir.IntType(1), 0)])
    p16 = builder.call(_fn(builder, "llvm.x86.avx512.pmaddubs.w.512", vec(I16, 32), [v64, v64]), [q, x])
    return vnni_asm(builder, "vpdpwssd", acc, builder.bitcast(p16, v16), builder.bitcast(sc32, v16))


def group_scales(fmt, builder, g):
    """A group's multipliers as one vector, built with vector ops (scalar scale extraction in the
    block loop lets LLVM vectorise the loop across groups with gathers: iq4_xs ran 4x slower), or None
    where group_int_any's lanes of decode_int's scalars are used. -> (mult, add) like group_int."""
    fl = lambda v: builder.sitofp(v, vec(F32, v.type.count))                          # noqa: E731
    sh = lambda v, a: builder.shuffle_vector(v, v, cvec(I32, a))                       # noqa: E731
    if fmt == "iq4_xs":
        return builder.fmul(splat(builder, f16(builder, g), 8), fl(_iq4_xs_sc(builder, g))), None
    uf = lambda v: builder.uitofp(v, vec(F32, v.type.count))                           # noqa: E731
    fk = lambda v, n: cvec(F32, [v] * n)                                               # noqa: E731
    at_ = lambda o: builder.add(g, c64(o))                                             # noqa: E731
    if fmt == "q3_k":
        return builder.fmul(splat(builder, f16(builder, at_(108)), 16), fl(_q3_k_sc(builder, g))), None
    if fmt == "q2_k":                     # 16 x (d (sc & 15), -dmin (sc >> 4))
        sc = load(builder, g, vec(I8, 16))
        m = builder.fmul(splat(builder, f16(builder, at_(80)), 16), uf(builder.and_(sc, cvec(I8, [15] * 16))))
        a = builder.fmul(splat(builder, f16(builder, at_(82)), 16), uf(builder.lshr(sc, cvec(I8, [4] * 16))))
        return m, builder.fneg(a)
    if fmt == "nvfp4":                    # 4 blocks x 4 UE4M3 bytes, decoded as ue4m3_half_ir, 16 lanes
        b4 = [load(builder, at_(36 * i), vec(I8, 4)) for i in range(4)]
        x = builder.zext(_cat(builder, b4), vec(I32, 16))
        e = _shr_and(builder, x, [3] * 16, 15)
        mm = builder.and_(x, cvec(I32, [7] * 16))
        normal = builder.bitcast(builder.or_(builder.shl(builder.add(e, cvec(I32, [119] * 16)), cvec(I32, [23] * 16)),
                                             builder.shl(mm, cvec(I32, [20] * 16))), vec(F32, 16))
        sub = builder.fmul(uf(mm), fk(2.0 ** -10, 16))
        v = builder.select(builder.icmp_unsigned("==", e, cvec(I32, [0] * 16)), sub, normal)
        return builder.select(builder.icmp_unsigned("==", x, cvec(I32, [0x7F] * 16)), fk(0.0, 16), v), None
    if fmt in ("iq2_xs", "iq2_s", "iq3_s"):   # 4-bit scales, two a byte
        n = 8 if fmt == "iq3_s" else 16
        s4 = _shr_and(builder, sh(load(builder, at_({"iq2_xs": 66, "iq2_s": 74, "iq3_s": 106}[fmt]), vec(I8, n // 2)),
                                  [i // 2 for i in range(n)]), [4 * (i % 2) for i in range(n)], 15)
        d = splat(builder, f16(builder, g), n)
        if fmt == "iq3_s":
            return builder.fmul(d, builder.fadd(fk(1.0, n), builder.fmul(fk(2.0, n), uf(s4)))), None
        return builder.fmul(builder.fmul(d, builder.fadd(fk(0.5, n), uf(s4))), fk(0.25, n)), None
    if fmt in ("iq2_xxs", "iq3_xxs"):     # the scale in bits 28..31 of each sub-block's sign word
        if fmt == "iq2_xxs":
            w = sh(load(builder, at_(2), vec(I32, 16)), [2 * i + 1 for i in range(8)])
        else:
            w = load(builder, at_(66), vec(I32, 8))
        s = uf(builder.lshr(w, cvec(I32, [28] * 8)))
        d = splat(builder, f16(builder, g), 8)
        return builder.fmul(builder.fmul(d, builder.fadd(fk(0.5, 8), s)), fk(0.25 if fmt == "iq2_xxs" else 0.5, 8)), None
    if fmt in ("iq1_s", "iq1_m"):         # d (2 s + 1) / 8: per 32 (iq1_s) or per 16 (iq1_m)
        if fmt == "iq1_s":
            s = _shr_and(builder, builder.zext(load(builder, at_(34), vec(I16, 8)), vec(I32, 8)), [12] * 8, 7)
            d = f16(builder, g)
        else:
            w4 = builder.zext(load(builder, at_(48), vec(I16, 4)), vec(I32, 4))
            s = _shr_and(builder, sh(w4, [k // 4 for k in range(16)]), [3 * (k % 4) for k in range(16)], 7)
            top = builder.lshr(w4, cvec(I32, [12] * 4))
            bits16 = builder.extract_element(top, ir.Constant(I32, 0))
            for j in range(1, 4):
                bits16 = builder.or_(bits16, builder.shl(builder.extract_element(top, ir.Constant(I32, j)),
                                                         ir.Constant(I32, 4 * j)))
            d = builder.fpext(builder.bitcast(builder.trunc(bits16, I16), HALF), F32)
        n = s.type.count
        two1 = uf(builder.add(builder.shl(s, cvec(I32, [1] * n)), cvec(I32, [1] * n)))
        return builder.fmul(builder.fmul(splat(builder, d, n), two1), fk(0.125, n)), None
    return None


def group_int_any(fmt, builder, g):
    """group_int for the formats without a hand-gathered form: the multipliers (and additive terms)
    of decode_int's eight chunks put into lanes, per 16 where the format has them (PER16); q2_k's
    per-16 mins as a <16 x float> add (times the activations' per-16 sums, _rowdot4_int_codegen)."""
    B, nb = BLOCK[fmt]
    parts = [c for i in range(256 // B) for c in decode_int(fmt, builder, builder.add(g, c64(i * nb)))]
    chunks = [c[:2] for c in parts]
    vs = group_scales(fmt, builder, g)
    if vs is not None:
        return (chunks,) + vs
    if fmt in PER16:
        mult = _lanes(builder, [m for c in parts for m in (c[2], c[3])])
    else:
        mult = _lanes(builder, [c[2] for c in parts])
    adds = [c[4] for c in parts]
    if all(a is None for a in adds):
        return chunks, mult, None
    if isinstance(adds[0], tuple):
        return chunks, mult, _lanes(builder, [a for pair in adds for a in pair])
    return chunks, mult, _lanes(builder, adds)


# Software prefetch: each of the four rows' next bytes, PREFETCH ahead of the group being decoded
# (prefetch never faults, so the hints past a row's end are harmless). Decode reads each expert
# matrix once, cold, and at one token the kernel's arithmetic and the memory's latency did not
# overlap: measured on the AVX-512 Xeon host (2 threads, 160 distinct 2816 x 1024 matrices in turn,
# 2026-12-07), q4_k 23.5 -> 28.4 GB/s, iq4_xs 18.2 -> 20.6, q6_k 22.9 -> 24.6, q8_0 level (30.5,
# at the probe's bandwidth); whole-model decode (benchmark model, batch 1) q4_0 +17-20%, q8_0 +16%,
# q4_k_m +13%, q3_k_m +7-13%; 512 bytes ahead gained less, 2048 the same as 1024. Tiles of one and two
# tokens only (decode, an expert's few tokens): a prefill's four-token tiles pass over each row quad
# once per four tokens and find it in the cache after the first. Measured: hints in the four-token
# tiles too left decode the same (q8_0 99-103 tok/s, q4_k_m 130-139, both ways, against 86-88 and
# 104-117 with no hints) and moved prefill by -9% to +11% (within this shared host's noise).
# Only where measured: Intel x86 hosts. The float path's four streams measured much slower with
# hints on Zen 4 (kernels.matmul: 32 against 55 GB/s), so AMD hosts, ARM64 and named (bundle) CPUs
# keep the hardware prefetcher alone until measured there.
PREFETCH = 1024 if _FEATURES["prefetch"] else 0


def _int_group(builder, acc, grp, dx, xq, bs, wide):
    """*acc (<8 x float>) += the group's w . x for one token: grp = group_iscales(...), dx <8 x float>
    the group's one activation scale in every lane (INT256), xq the token's 8 chunks (<32 x i8>), or
    with wide (AVX-512) its 4 chunk pairs (<64 x i8>), bs its 16 per-16 sums (<16 x i16>):
        (d dx) float(sum_j sc_j (q . x)_j - off sum_i sc_i bs_i)  -  (dmin dx) float(sum_i m_i bs_i)
    the sums in int32 (exact); the float ops contracted only (FMAs), never reassociated: a token's sums
    the same in every tile."""
    chunks, isc, dw, off, mins, dmin = grp
    if wide:                    # chunk pairs, then the two halves' int32 lanes added (exact)
        s16 = ir.Constant(vec(I32, 16), [0] * 16)
        for c in range(4):
            (q0, sg), (q1, _) = chunks[2 * c], chunks[2 * c + 1]
            s16 = sdot16(builder, s16, _cat(builder, [q0, q1]), sg, xq[c], _sc_lanes(builder, isc, [2 * c, 2 * c + 1]))
        s8 = builder.add(builder.shuffle_vector(s16, s16, cvec(I32, range(8))),
                         builder.shuffle_vector(s16, s16, cvec(I32, range(8, 16))))
    else:                       # even and odd chunks in two chains, then added (exact)
        se = so = ir.Constant(vec(I32, 8), [0] * 8)
        for c, (q, sg) in enumerate(chunks):
            if c % 2:
                so = sdot8(builder, so, q, sg, xq[c], _sc_lanes(builder, isc, [c]))
            else:
                se = sdot8(builder, se, q, sg, xq[c], _sc_lanes(builder, isc, [c]))
        s8 = builder.add(se, so)
    if off:                     # the stored values' offset: - off sc_i bs_i, per 16
        s8 = builder.add(s8, madd16(builder, bs, builder.mul(isc, cvec(I16, [-off] * 16))))
    ct = ("contract",)
    a = builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(s8, vec(F32, 8)),
                                                     builder.fmul(splat(builder, dw, 8), dx), flags=ct), flags=ct)
    if mins is not None:
        mn = builder.sitofp(madd16(builder, bs, mins), vec(F32, 8))
        a = builder.fsub(a, builder.fmul(mn, builder.fmul(splat(builder, dmin, 8), dx), flags=ct), flags=ct)
    builder.store(a, acc)


def _float_group(builder, acc, acco, chunks, mult, q6, dx, xq, wide):
    """*acc += each chunk's float(q_w . q) times its multiplier (mult, per 32 or per 16 with q6) times
    its activation scale (dx <8 x float>), one multiply-add a chunk. wide (AVX-512, 2-4 tokens): a
    chunk pair a <16 x float> (lanes 0-7 chunk 2c's sums, 8-15 chunk 2c+1's: the same order in every
    tile); acco (a lone token on AVX-512): the odd chunks' accumulator (<8 x float>)."""
    fast = ("fast",)
    if q6:                      # per-16 multipliers times their block's activation scale
        m = builder.fmul(mult, builder.shuffle_vector(dx, dx, cvec(I32, [i // 2 for i in range(16)])))
    else:
        m = builder.fmul(mult, dx)
    a = builder.load(acc)
    if wide:
        for c in range(4):
            (q0, sg), (q1, _) = chunks[2 * c], chunks[2 * c + 1]
            s16 = builder.sitofp(dot16(builder, _cat(builder, [q0, q1]), sg, xq[c]), vec(F32, 16))
            lanes = ([4 * c + i // 4 for i in range(16)] if q6 else [2 * c] * 8 + [2 * c + 1] * 8)
            a = builder.fadd(a, builder.fmul(s16, builder.shuffle_vector(m, m, cvec(I32, lanes)), flags=fast), flags=fast)
    else:
        ao = builder.load(acco) if acco is not None else None
        for c, (q, signed) in enumerate(chunks):
            s8 = builder.sitofp(dot8(builder, q, signed, xq[c]), vec(F32, 8))
            lanes = [2 * c] * 4 + [2 * c + 1] * 4 if q6 else [c] * 8
            p = builder.fmul(s8, builder.shuffle_vector(m, m, cvec(I32, lanes)), flags=fast)
            if acco is not None and c % 2:
                ao = builder.fadd(ao, p, flags=fast)
            else:
                a = builder.fadd(a, p, flags=fast)
        if acco is not None:
            builder.store(ao, acco)
    builder.store(a, acc)


def _rowdot4_int_codegen(ntok):
    """args: (w, n0, n1, n2, n3, qx, dx, xs, xoff_0 .. xoff_{ntok-1}) -> 4 * ntok sums, row-major
    (row r, token t at r * ntok + t)."""
    def codegen(context, builder, sig, args):
        fmt = fmt_of(sig.args[0])
        B, nb = BLOCK[fmt]
        gb = nb * (256 // B)                                   # bytes of a group of 256 weights
        fast = ("fast",)
        w = args[0]
        rows = [i64(context, builder, sig, args, 1 + r) for r in range(4)]
        qb, db, sb = (data_ptr(context, builder, sig.args[i], args[i]) for i in (5, 6, 7))
        xo = [i64(context, builder, sig, args, 8 + t) for t in range(ntok)]
        xaddr = [builder.add(qb, o) for o in xo]
        daddr = [builder.add(db, builder.mul(builder.lshr(o, c64(5)), c64(4))) for o in xo]
        saddr = [builder.add(sb, builder.mul(builder.lshr(o, c64(5)), c64(4))) for o in xo]
        wbase = data_ptr(context, builder, sig.args[0], w)
        nblk = builder.extract_value(context.make_array(sig.args[0])(context, builder, w).shape, 1)
        rstart = [builder.add(wbase, builder.mul(r, builder.mul(nblk, c64(nb)))) for r in rows]
        ngroups = builder.udiv(builder.mul(nblk, c64(B)), c64(256))
        q6 = fmt in PER16
        ig = fmt in INT256                                    # activations per 256: integer scales (above)
        add16 = fmt == "q2_k" and not ig                      # per-16 additive terms (the mins), in floats
        zero = ir.Constant(vec(F32, 8), [0.0] * 8)
        # PAIRED (AVX-512 VNNI): even and odd chunks in separate lanes; tiles of 2 and 4 tokens take a
        # chunk pair a zmm (<16 x float> accumulators, lanes 0-7 the even chunks'), a lone token two
        # ymm accumulators (even, odd): measured in cache, zmm pairs are 1.2-1.45x ymm VNNI at 4
        # tokens but 0.85x at one (q4_k, q4_0, iq4_xs: the nibbles decode into ymm halves), so a lone
        # token keeps ymm (level with ymm VNNI, within the host's noise). Both
        # shapes do the same FMAs in the same lanes and end by even + odd, then the 8 lanes' sum: a
        # token's logits are the same alone and in a tile.
        wide = HAS_VNNI512 and ntok > 1
        split = HAS_VNNI512 and ntok == 1
        acc = [[cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 16), [0.0] * 16) if wide and not ig else zero)
                for _ in range(ntok)] for _ in range(4)]
        acco = [[cgutils.alloca_once_value(builder, zero) for _ in range(ntok)] for _ in range(4)] \
            if split and not ig else None
        acca = [[cgutils.alloca_once_value(builder, zero) for _ in range(ntok)] for _ in range(4)]
        acc16 = [[cgutils.alloca_once_value(builder, zero) for _ in range(ntok)] for _ in range(4)]
        with cgutils.for_range(builder, ngroups) as loop:
            g = loop.index
            k = builder.mul(g, c64(256))                        # weight index of the group
            dx = [load(builder, builder.add(daddr[t], builder.mul(g, c64(32))), vec(F32, 8), align=4)
                  for t in range(ntok)]
            xs = [load(builder, builder.add(saddr[t], builder.mul(g, c64(32))), vec(F32, 8), align=4)
                  for t in range(ntok)]
            x8 = [[load(builder, builder.add(xaddr[t], builder.add(k, c64(32 * c))), vec(I8, 32)) for c in range(8)]
                  for t in range(ntok)]
            if wide:            # the same bytes as chunk pairs (one zmm load each)
                x64 = [[load(builder, builder.add(xaddr[t], builder.add(k, c64(64 * c))), vec(I8, 64)) for c in range(4)]
                       for t in range(ntok)]
            if ig:              # each token's one activation scale of the group, in every lane, and its
                #                 per-16 sums (int16, where the float xs of a 32-block format are: quantize_act)
                dxs = [builder.shuffle_vector(dx[t], dx[t], cvec(I32, [0] * 8)) for t in range(ntok)]
                bs = [load(builder, builder.add(saddr[t], builder.mul(g, c64(32))), vec(I16, 16), align=2)
                      for t in range(ntok)]
            if add16:           # each token's per-16 sums of its int8 activations, shared by the four rows
                ones = cvec(I8, [1] * 32)
                xsum = [[builder.sitofp(dot8(builder, ones, False, x8[t][c]), vec(F32, 8)) for c in range(8)]
                        for t in range(ntok)]
            for r in range(4):
                if PREFETCH and ntok <= 2:      # the group PREFETCH bytes ahead, a hint a line
                    ga = builder.add(rstart[r], builder.mul(g, c64(gb)))
                    for o in range(0, gb, 64):
                        builder.call(_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
                                     [at(builder, builder.add(ga, c64(PREFETCH + o)), I8), ir.Constant(I32, 0),
                                      ir.Constant(I32, 3), ir.Constant(I32, 1)])
                gaddr = builder.add(rstart[r], builder.mul(g, c64(gb)))
                if ig:
                    grp = group_iscales(fmt, builder, gaddr)
                    for t in range(ntok):
                        _int_group(builder, acc[r][t], grp, dxs[t], x64[t] if wide else x8[t], bs[t], wide)
                    continue
                chunks, mult, add = group_int(fmt, builder, gaddr)
                for t in range(ntok):
                    _float_group(builder, acc[r][t], acco[r][t] if split else None, chunks, mult, q6, dx[t],
                                 x64[t] if wide else x8[t], wide)
                    if add16:           # its own chain, no reassociation: the same sums in every tile shape
                        am = builder.fmul(add, builder.shuffle_vector(dx[t], dx[t], cvec(I32, [i // 2 for i in range(16)])))
                        m16 = builder.load(acc16[r][t])
                        for c in range(8):
                            m16 = builder.fadd(m16, builder.fmul(xsum[t][c], builder.shuffle_vector(
                                am, am, cvec(I32, [2 * c] * 4 + [2 * c + 1] * 4))))
                        builder.store(m16, acc16[r][t])
                    if add is not None and not add16:
                        builder.store(builder.fadd(builder.load(acca[r][t]), builder.fmul(add, xs[t], flags=fast),
                                                   flags=fast), acca[r][t])
        tails = [[cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(ntok)] for _ in range(4)]
        if B < 256:                     # the blocks past the last whole group (256-block rows are whole groups)
            with cgutils.for_range_slice(builder, builder.mul(ngroups, c64(256 // B)), nblk, c64(1)) as (bi, _):
                for r in range(4):
                    for ci, (q, signed, m1, m2, add) in enumerate(
                            decode_int(fmt, builder, builder.add(rstart[r], builder.mul(bi, c64(nb))))):
                        kk = builder.add(builder.mul(bi, c64(B)), c64(32 * ci))
                        j4 = builder.mul(builder.lshr(kk, c64(5)), c64(4))
                        for t in range(ntok):
                            p = dot8(builder, q, signed, load(builder, builder.add(xaddr[t], kk), vec(I8, 32)))
                            dxs = load(builder, builder.add(daddr[t], j4), F32, align=4)
                            if m2 is None:
                                v = builder.fmul(builder.fmul(m1, dxs), builder.sitofp(_hsum_i32(builder, p), F32))
                            else:       # per-16 multipliers: lanes 0-3 the first 16 weights
                                lo, hi = (builder.sitofp(_hsum_i32(builder, builder.shuffle_vector(
                                    p, p, cvec(I32, range(4 * h, 4 * h + 4)))), F32) for h in range(2))
                                v = builder.fadd(builder.fmul(builder.fmul(m1, dxs), lo), builder.fmul(builder.fmul(m2, dxs), hi))
                            if add is not None:
                                xss = load(builder, builder.add(saddr[t], j4), F32, align=4)
                                v = builder.fadd(v, builder.fmul(add, xss))
                            builder.store(builder.fadd(builder.load(tails[r][t]), v), tails[r][t])
        sums = []
        for r in range(4):
            for t in range(ntok):
                a = builder.load(acc[r][t])
                if ig:
                    pass
                elif wide:              # even + odd chunks' lanes, as the split accumulators below
                    a = builder.fadd(builder.shuffle_vector(a, a, cvec(I32, range(8))),
                                     builder.shuffle_vector(a, a, cvec(I32, range(8, 16))), flags=fast)
                elif split:
                    a = builder.fadd(a, builder.load(acco[r][t]), flags=fast)
                s = builder.fadd(reduce_add(builder, a), reduce_add(builder, builder.load(acca[r][t])))
                if add16:
                    s = builder.fadd(s, reduce_add(builder, builder.load(acc16[r][t])))
                sums.append(builder.fadd(s, builder.load(tails[r][t])))
        return context.make_tuple(builder, sig.return_type, sums)
    return codegen


def _hsum_i32(builder, v):
    return builder.call(_fn(builder, f"llvm.vector.reduce.add.v{v.type.count}i32", I32, [v.type]), [v])


@intrinsic
def rowdot4_q(typingctx, w, n0, n1, n2, n3, qx, dx, xs, xoff):
    """(w[n_r] . x for r < 4): rows n0..n3 against the int8-quantised activation at element xoff."""
    if not fmt_of(w):
        return None
    return types.UniTuple(types.float32, 4)(w, n0, n1, n2, n3, qx, dx, xs, xoff), _rowdot4_int_codegen(1)


@intrinsic
def rowdot4x2_q(typingctx, w, n0, n1, n2, n3, qx, dx, xs, xoffa, xoffb):
    """rowdot4_q for two activations: (row 0 tok a, row 0 tok b, row 1 tok a, ...)."""
    if not fmt_of(w):
        return None
    return (types.UniTuple(types.float32, 8)(w, n0, n1, n2, n3, qx, dx, xs, xoffa, xoffb),
            _rowdot4_int_codegen(2))


@intrinsic
def rowdot4x4_q(typingctx, w, n0, n1, n2, n3, qx, dx, xs, xo0, xo1, xo2, xo3):
    """rowdot4_q for four activations (prefill): each group of 256 weights decoded once for four
    tokens, row-major (row 0 tok 0..3, row 1 ...); each token's sums bit for bit rowdot4_q's."""
    if not fmt_of(w):
        return None
    return (types.UniTuple(types.float32, 16)(w, n0, n1, n2, n3, qx, dx, xs, xo0, xo1, xo2, xo3),
            _rowdot4_int_codegen(4))


# -- prefill: a row quad's groups decoded once for all its tokens ---------------------------------------
# rowdot4x4_q decodes each group of four rows again for every four tokens: at prefill, where an expert
# sees 8-64 tokens, the decode (nibble unpacking, the sub-block scales' bit fields) was a third of the
# tile's instructions (measured on q4_k's AVX-512 tile: ~650 instructions a group for 16 (row, token)
# pairs, ~140 of them decode). predecode4_q writes the quad's groups once, as the integers the dot
# takes, into the thread's scratch (PB bytes a row and group, [group][row]):
#     q      u8/i8 [256]   the 8 chunks' values (group_iscales' chunks: unsigned as stored, or signed)
#     lanes  i16   [8][16] at 256: each chunk's scales as vpmaddubsw's pair sums take them (_sc_lanes)
#     sc     i16   [16]    at 512: the integer sub-block scales (8 or 16 of them)
#     mins   i16   [16]    at 544: the per-16 integer mins (q4_k, q5_k, q2_k)
#     d, dmin f32          at 576, 580
#     signs  i64   [8]     at 640 (signed formats: iq4_xs): chunk c's sign bits twice (bit i and 32 + i:
#                          weight i < 0), and q holds |q|: the tile negates the activations by mask
# and pdot4x4_q takes the tokens two at a time in a zmm ([token a's chunk | token b's chunk], the row's
# chunk and scale lanes broadcast to both halves from memory), so each int32 lane ends holding what
# _int_group's chunk pairs hold after their halves are added: no shuffles, no scale permutes, and the
# pair's float update straight on the accumulator. Then each (row, token)'s float update as _int_group
# does it. The int32 lanes are exact sums, so every order gives the same numbers, and the float ops are
# _int_group's own: a token's sums are bit for bit rowdot4_q's (batch invariance). A super-block of 4
# rows x 4 tokens: 254 -> ~190 vector uops (the int part 128 vpmaddubsw + vpdpwssd).
PB = 704


def _pd_fields(fmt):
    """(signed, has_mins, scales per group) of an INT256 format's decoded groups."""
    return fmt == "iq4_xs", fmt in ("q4_k", "q5_k", "q2_k"), 16 if fmt in PER16 else 8


@intrinsic
def predecode4_q(typingctx, w, n0, n1, n2, n3, buf, boff):
    """Rows n0..n3 of w (an INT256 format) decoded into buf's bytes from boff (PB a row and group, [group][row]):
    what pdot4x4_q reads. Other formats: nothing written (their kernels do not call it)."""
    if not fmt_of(w):
        return None

    def codegen(context, builder, sig, args):
        fmt = fmt_of(sig.args[0])
        if fmt not in INT256:
            return context.get_dummy_value()
        B, nb = BLOCK[fmt]
        signed, has_mins, nsc = _pd_fields(fmt)
        w = args[0]
        rows = [i64(context, builder, sig, args, 1 + r) for r in range(4)]
        base = builder.add(data_ptr(context, builder, sig.args[5], args[5]), i64(context, builder, sig, args, 6))
        wbase = data_ptr(context, builder, sig.args[0], w)
        nblk = builder.extract_value(context.make_array(sig.args[0])(context, builder, w).shape, 1)
        rstart = [builder.add(wbase, builder.mul(r, builder.mul(nblk, c64(nb)))) for r in rows]
        with cgutils.for_range(builder, nblk) as loop:          # B == 256: a block is a group
            g = loop.index
            for r in range(4):
                chunks, isc, dw, off, mins, dmin = group_iscales(fmt, builder, builder.add(rstart[r], builder.mul(g, c64(nb))))
                assert all(s == signed for _, s in chunks) and isc.type.count == nsc and (mins is not None) == has_mins
                o = builder.add(base, builder.mul(builder.add(builder.mul(g, c64(4)), c64(r)), c64(PB)))
                for c, (q, _) in enumerate(chunks):
                    if signed:
                        neg = builder.zext(builder.bitcast(builder.icmp_signed("<", q, cvec(I8, [0] * 32)), I32),
                                           ir.IntType(64))
                        builder.store(builder.or_(neg, builder.shl(neg, c64(32))),
                                      at(builder, builder.add(o, c64(640 + 8 * c)), ir.IntType(64)), align=1)
                        q = builder.call(_fn(builder, "llvm.abs.v32i8", q.type, [q.type, ir.IntType(1)]),
                                         [q, ir.Constant(ir.IntType(1), 0)])
                    builder.store(q, at(builder, builder.add(o, c64(32 * c)), q.type), align=1)
                    lanes = _sc_lanes(builder, isc, [c])
                    builder.store(lanes, at(builder, builder.add(o, c64(256 + 32 * c)), lanes.type), align=1)
                builder.store(isc, at(builder, builder.add(o, c64(512)), isc.type), align=1)
                if has_mins:
                    builder.store(mins, at(builder, builder.add(o, c64(544)), mins.type), align=1)
                    builder.store(dmin, at(builder, builder.add(o, c64(580)), F32), align=1)
                builder.store(dw, at(builder, builder.add(o, c64(576)), F32), align=1)
        return context.get_dummy_value()
    return types.void(w, n0, n1, n2, n3, buf, boff), codegen


def _negate(builder, row, c, n, x):
    """x (n chunks from chunk c, <32 n x i8>) negated where the predecoded row's weights are < 0 (their
    sign bits at 640: a signed format's q is stored as |q|)."""
    bits = [builder.trunc(load(builder, builder.add(row, c64(640 + 8 * (c + i))), ir.IntType(64), align=1), I32)
            for i in range(n)]
    neg = _cat(builder, [builder.bitcast(b, vec(ir.IntType(1), 32)) for b in bits])
    return builder.select(neg, builder.sub(cvec(I8, [0] * (32 * n)), x), x)


def _pdot_codegen(ntok):
    """args: (w, buf, boff, qx, dx, xs, xo_0 .. xo_{ntok-1}) -> 4 ntok sums, row-major (row r, token t at
    ntok r + t)."""
    def codegen(context, builder, sig, args):
        fmt = fmt_of(sig.args[0])
        zero = ir.Constant(vec(F32, 8), [0.0] * 8)
        if fmt not in INT256:
            return context.make_tuple(builder, sig.return_type, [ir.Constant(F32, 0.0)] * (4 * ntok))
        signed, has_mins, nsc = _pd_fields(fmt)
        off = {"q3_k": 4, "q6_k": 32}.get(fmt, 0)
        w = args[0]
        ngroups = builder.extract_value(context.make_array(sig.args[0])(context, builder, w).shape, 1)
        base = builder.add(data_ptr(context, builder, sig.args[1], args[1]), i64(context, builder, sig, args, 2))
        qb, db, sb = (data_ptr(context, builder, sig.args[i], args[i]) for i in (3, 4, 5))
        xo = [i64(context, builder, sig, args, 6 + t) for t in range(ntok)]
        xaddr = [builder.add(qb, o) for o in xo]
        daddr = [builder.add(db, builder.mul(builder.lshr(o, c64(5)), c64(4))) for o in xo]
        saddr = [builder.add(sb, builder.mul(builder.lshr(o, c64(5)), c64(4))) for o in xo]
        wide = HAS_VNNI512
        pairs = ntok // 2 if wide else 0
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(ntok)] for _ in range(4)]
        acc2 = [[cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 16), [0.0] * 16)) for _ in range(pairs)]
                for _ in range(4)]
        ct = ("contract",)
        with cgutils.for_range(builder, ngroups) as loop:
            g = loop.index
            k = builder.mul(g, c64(256))
            dxs = []
            bs = []
            for t in range(ntok):
                dx = load(builder, builder.add(daddr[t], builder.mul(g, c64(32))), vec(F32, 8), align=4)
                dxs.append(builder.shuffle_vector(dx, dx, cvec(I32, [0] * 8)))
                bs.append(load(builder, builder.add(saddr[t], builder.mul(g, c64(32))), vec(I16, 16), align=2))
            if wide:                # two tokens' scales (8 lanes each) and per-16 sums side by side
                dx2 = [builder.shuffle_vector(dxs[2 * p], dxs[2 * p + 1], cvec(I32, range(16))) for p in range(pairs)]
                bs2 = [_cat(builder, [bs[2 * p], bs[2 * p + 1]]) for p in range(pairs)]
            row = [builder.add(base, builder.mul(builder.add(builder.mul(g, c64(4)), c64(r)), c64(PB))) for r in range(4)]
            isc = [load(builder, builder.add(row[r], c64(512)), vec(I16, nsc), align=2) for r in range(4)]
            # the integer sums: chunk outer, so a chunk's activations and one row's chunk are what the
            # registers hold beside the accumulators
            if wide:
                z16 = ir.Constant(vec(I32, 16), [0] * 16)
                sp = [[z16] * pairs for _ in range(4)]         # token pairs: [a's 8 lanes | b's 8 lanes]
                s = [[z16] * ntok for _ in range(4)]           # a lone token: chunk pairs, halves added below
                for c in range(8):
                    xp = [_cat(builder, [load(builder, builder.add(xaddr[t], builder.add(k, c64(32 * c))), vec(I8, 32))
                                         for t in (2 * p, 2 * p + 1)]) for p in range(pairs)]
                    for r in range(4):
                        q = load(builder, builder.add(row[r], c64(32 * c)), vec(I8, 32))
                        sc = load(builder, builder.add(row[r], c64(256 + 32 * c)), vec(I16, 16), align=2)
                        q2, sc2 = _cat(builder, [q, q]), _cat(builder, [sc, sc])
                        if signed:      # |q| stored: the activations negated where q < 0 (one masked op)
                            neg = builder.bitcast(load(builder, builder.add(row[r], c64(640 + 8 * c)), ir.IntType(64),
                                                       align=1), vec(ir.IntType(1), 64))
                            sp[r] = [sdot16(builder, sp[r][p], q2, False,
                                            builder.select(neg, builder.sub(cvec(I8, [0] * 64), xp[p]), xp[p]), sc2)
                                     for p in range(pairs)]
                        else:
                            sp[r] = [sdot16(builder, sp[r][p], q2, False, xp[p], sc2) for p in range(pairs)]
                for c in range(4) if ntok % 2 else ():
                    xq = {t: load(builder, builder.add(xaddr[t], builder.add(k, c64(64 * c))), vec(I8, 64))
                          for t in range(2 * pairs, ntok)}
                    for r in range(4):
                        q = load(builder, builder.add(row[r], c64(64 * c)), vec(I8, 64))
                        sc = load(builder, builder.add(row[r], c64(256 + 64 * c)), vec(I16, 32), align=2)
                        for t in xq:
                            s[r][t] = sdot16(builder, s[r][t], q, False, _negate(builder, row[r], 2 * c, 2, xq[t])
                                             if signed else xq[t], sc)
            else:
                s8 = [[ir.Constant(vec(I32, 8), [0] * 8)] * ntok for _ in range(4)]
                for c in range(8):
                    xq = [load(builder, builder.add(xaddr[t], builder.add(k, c64(32 * c))), vec(I8, 32)) for t in range(ntok)]
                    for r in range(4):
                        q = load(builder, builder.add(row[r], c64(32 * c)), vec(I8, 32))
                        sc = load(builder, builder.add(row[r], c64(256 + 32 * c)), vec(I16, 16), align=2)
                        s8[r] = [sdot8(builder, s8[r][t], q, False, _negate(builder, row[r], c, 1, xq[t]) if signed else xq[t],
                                       sc) for t in range(ntok)]
            # the float update per (row, token): _int_group's ops, in its order, lane for lane; on AVX-512 two
            # tokens' 8 lanes a zmm (the same IEEE operation in each lane: a token's sums unchanged)
            for r in range(4):
                dw = load(builder, builder.add(row[r], c64(576)), F32, align=4)
                if has_mins:
                    mins = load(builder, builder.add(row[r], c64(544)), vec(I16, 16), align=2)
                    dmin = load(builder, builder.add(row[r], c64(580)), F32, align=4)
                if off:
                    offsc = builder.mul(isc[r], cvec(I16, [-off] * 16))
                for p in range(pairs):
                    v = sp[r][p]
                    if off:
                        v = builder.add(v, madd32(builder, bs2[p], _cat(builder, [offsc, offsc])))
                    a = builder.fadd(builder.load(acc2[r][p]), builder.fmul(
                        builder.sitofp(v, vec(F32, 16)), builder.fmul(splat(builder, dw, 16), dx2[p]), flags=ct), flags=ct)
                    if has_mins:
                        mn = builder.sitofp(madd32(builder, bs2[p], _cat(builder, [mins, mins])), vec(F32, 16))
                        a = builder.fsub(a, builder.fmul(mn, builder.fmul(splat(builder, dmin, 16), dx2[p]), flags=ct), flags=ct)
                    builder.store(a, acc2[r][p])
                for t in range(2 * pairs, ntok):       # a lone token (or every token, AVX2): ymm
                    v = s8[r][t] if not wide else builder.add(builder.shuffle_vector(s[r][t], s[r][t], cvec(I32, range(8))),
                                                             builder.shuffle_vector(s[r][t], s[r][t], cvec(I32, range(8, 16))))
                    if off:
                        v = builder.add(v, madd16(builder, bs[t], offsc))
                    a = builder.fadd(builder.load(acc[r][t]), builder.fmul(
                        builder.sitofp(v, vec(F32, 8)), builder.fmul(splat(builder, dw, 8), dxs[t]), flags=ct), flags=ct)
                    if has_mins:
                        mn = builder.sitofp(madd16(builder, bs[t], mins), vec(F32, 8))
                        a = builder.fsub(a, builder.fmul(mn, builder.fmul(splat(builder, dmin, 8), dxs[t]), flags=ct), flags=ct)
                    builder.store(a, acc[r][t])
        if wide:                    # the zmm accumulators' halves: each token's 8 lanes
            for r in range(4):
                for p in range(pairs):
                    a = builder.load(acc2[r][p])
                    for h in range(2):
                        builder.store(builder.shuffle_vector(a, a, cvec(I32, range(8 * h, 8 * h + 8))), acc[r][2 * p + h])
        sums = []
        for r in range(4):
            for t in range(ntok):      # rowdot4_q's end: + the (zero) float-path lanes and tail, as there
                s = builder.fadd(reduce_add(builder, builder.load(acc[r][t])), reduce_add(builder, zero))
                sums.append(builder.fadd(s, ir.Constant(F32, 0.0)))
        return context.make_tuple(builder, sig.return_type, sums)
    return codegen


@intrinsic
def pdot4_q(typingctx, w, buf, boff, qx, dx, xs, xo):
    """pdot4x4_q for one token: rowdot4_q's four sums, bit for bit."""
    if not fmt_of(w):
        return None
    return types.UniTuple(types.float32, 4)(w, buf, boff, qx, dx, xs, xo), _pdot_codegen(1)


@intrinsic
def pdot4x2_q(typingctx, w, buf, boff, qx, dx, xs, xoa, xob):
    """pdot4x4_q for two tokens: rowdot4x2_q's eight sums, bit for bit."""
    if not fmt_of(w):
        return None
    return types.UniTuple(types.float32, 8)(w, buf, boff, qx, dx, xs, xoa, xob), _pdot_codegen(2)


@intrinsic
def pdot4x4_q(typingctx, w, buf, boff, qx, dx, xs, xo0, xo1, xo2, xo3):
    """rowdot4x4_q of the quad predecode4_q wrote into buf at boff (w gives the format and the group
    count): four tokens' sums, row-major, each bit for bit rowdot4_q's. Other formats: zeros (their
    kernels do not call it)."""
    if not fmt_of(w):
        return None
    return types.UniTuple(types.float32, 16)(w, buf, boff, qx, dx, xs, xo0, xo1, xo2, xo3), _pdot_codegen(4)


# -- the activations' int8 quantisation (qkernels.quantize_act), 16 at a time -------------------------
# Written as Numba loops these stayed scalar (index wrap-around checks and a float max reduction the
# vectoriser does not take without fast-math): 2.2 ns an element, 7% of a prefill step. Here: one
# <16 x float> a step.
@intrinsic
def absmax_bits(typingctx, x, off, n):
    """max over x.flat[off : off + n] (n a multiple of 16) of |x|'s bits as int32 (x float32, C-contiguous):
    for finite values the same order as |x|, and >= 0x7f800000 where any value is not finite."""
    def codegen(context, builder, sig, args):
        base = builder.add(data_ptr(context, builder, sig.args[0], args[0]),
                           builder.mul(i64(context, builder, sig, args, 1), c64(4)))
        n = i64(context, builder, sig, args, 2)
        m = cgutils.alloca_once_value(builder, ir.Constant(vec(I32, 16), [0] * 16))
        with cgutils.for_range(builder, builder.udiv(n, c64(16))) as loop:
            v = load(builder, builder.add(base, builder.mul(loop.index, c64(64))), vec(I32, 16), align=4)
            v = builder.and_(v, cvec(I32, [0x7FFFFFFF] * 16))
            builder.store(builder.call(_fn(builder, "llvm.umax.v16i32", vec(I32, 16), [vec(I32, 16)] * 2),
                                       [builder.load(m), v]), m)
        return builder.call(_fn(builder, "llvm.vector.reduce.umax.v16i32", I32, [vec(I32, 16)]), [builder.load(m)])
    return types.int32(x, off, n), codegen


@intrinsic
def quantize16(typingctx, qx, qoff, x, xoff, inv):
    """qx.flat[qoff : qoff + 16] = clip(rint(x.flat[xoff : xoff + 16] * inv), -127, 127) as int8 (x finite);
    returns their int32 sum."""
    def codegen(context, builder, sig, args):
        qa = builder.add(data_ptr(context, builder, sig.args[0], args[0]), i64(context, builder, sig, args, 1))
        xa = builder.add(data_ptr(context, builder, sig.args[2], args[2]),
                         builder.mul(i64(context, builder, sig, args, 3), c64(4)))
        v = builder.fmul(load(builder, xa, vec(F32, 16), align=4), splat(builder, args[4], 16))
        v = builder.call(_fn(builder, "llvm.rint.v16f32", vec(F32, 16), [vec(F32, 16)]), [v])
        v = builder.call(_fn(builder, "llvm.maxnum.v16f32", vec(F32, 16), [vec(F32, 16)] * 2), [v, cvec(F32, [-127.0] * 16)])
        v = builder.call(_fn(builder, "llvm.minnum.v16f32", vec(F32, 16), [vec(F32, 16)] * 2), [v, cvec(F32, [127.0] * 16)])
        q = builder.fptosi(v, vec(I32, 16))
        builder.store(builder.trunc(q, vec(I8, 16)), at(builder, qa, vec(I8, 16)), align=1)
        return builder.call(_fn(builder, "llvm.vector.reduce.add.v16i32", I32, [vec(I32, 16)]), [q])
    return types.int32(qx, qoff, x, xoff, types.float32), codegen
