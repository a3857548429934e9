"""LLVM IR of the block formats (colibri_edge/quant.py has their definitions): how each block's bytes
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

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from colibri_edge.quant import BLOCK

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
    """<n x i8>: bit (shift0 + i) of the integer `word` for lane i (0 or 1)."""
    w = splat(builder, builder.zext(word, I64) if word.type.width < 64 else word, n)
    b = builder.lshr(w, cvec(I64, [shift0 + i for i in range(n)]))
    return builder.trunc(builder.and_(b, cvec(I64, [1] * n)), vec(I8, n))


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
        qs0 = 48 if fmt == "q5_k" else 16
        out = []
        for g in range(4):
            nib = nibbles(builder, builder.add(b, c64(qs0 + 32 * g)), 32)          # sub-blocks 2g, 2g+1
            for half in range(2):
                s = 2 * g + half
                q = builder.shuffle_vector(nib, nib, cvec(I32, range(32 * half, 32 * half + 32)))
                if fmt == "q5_k":                    # bit s of qh[j] is weight j's high bit
                    qh = load(builder, builder.add(b, c64(16)), vec(I8, 32))
                    hb = builder.and_(builder.lshr(qh, cvec(I8, [s] * 32)), cvec(I8, [1] * 32))
                    q = builder.or_(q, builder.shl(hb, cvec(I8, [4] * 32)))
                sc, m = scale_min_k4(builder, builder.add(b, c64(4)), s)
                out.append((builder.fmul(d, fl(sc)), builder.fneg(builder.fmul(dmin, fl(m))), uif(builder, q)))
        return out
    if fmt == "q6_k":
        d = f16(builder, builder.add(b, c64(208)))
        out = []
        for h in range(2):
            for p in range(4):
                lo = load(builder, builder.add(b, c64(64 * h + 32 * (p % 2))), vec(I8, 32))
                lo = builder.and_(builder.lshr(lo, cvec(I8, [4 * (p // 2)] * 32)), cvec(I8, [15] * 32))
                hi = load(builder, builder.add(b, c64(128 + 32 * h)), vec(I8, 32))
                hi = builder.and_(builder.lshr(hi, cvec(I8, [2 * p] * 32)), cvec(I8, [3] * 32))
                q = sif(builder, builder.sub(builder.or_(lo, builder.shl(hi, cvec(I8, [4] * 32))), cvec(I8, [32] * 32)))
                for k in range(2):                   # two scales of 16 per chunk of 32
                    sc = builder.sitofp(load(builder, builder.add(b, c64(192 + (128 * h + 32 * p + 16 * k) // 16)), I8), F32)
                    out.append((builder.fmul(d, sc), None, builder.shuffle_vector(q, q, cvec(I32, range(16 * k, 16 * k + 16)))))
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


def _chunk_fma(builder, acc, chunks, xaddr):
    """acc[t] += mult * (q . x_t[chunk]) + add * x_t[chunk], for each chunk and each token's x address."""
    off = 0
    for mult, add, q in chunks:
        n = q.type.count
        for t, xa in enumerate(xaddr):
            xv = load(builder, builder.add(xa, c64(4 * off)), vec(F32, n), align=4)
            a = builder.load(acc[t][n])
            a = builder.fadd(a, builder.fmul(builder.fmul(q, xv, flags=("fast",)), splat(builder, mult, n),
                                             flags=("fast",)), flags=("fast",))
            if add is not None:
                a = builder.fadd(a, builder.fmul(xv, splat(builder, add, n), flags=("fast",)), flags=("fast",))
            builder.store(a, acc[t][n])
        off += n


def _rowdot_codegen(ntok):
    def codegen(context, builder, sig, args):
        xs = args[2:2 + ntok]
        xbase = [data_ptr(context, builder, sig.args[2 + t], xs[t]) for t in range(ntok)]
        xoff = [builder.mul(i64(context, builder, sig, args, 2 + ntok + t), c64(4)) for t in range(ntok)]  # -> bytes
        acc = [{n: cgutils.alloca_once_value(builder, ir.Constant(vec(F32, n), [0.0] * n)) for n in (16, 32)}
               for _ in range(ntok)]

        def body(baddr, k):
            chunks = decode(fmt_of(sig.args[0]), builder, baddr)
            xaddr = [builder.add(builder.add(xbase[t], xoff[t]), builder.mul(k, c64(4))) for t in range(ntok)]
            _chunk_fma(builder, acc, chunks, xaddr)
        _row_loop(context, builder, sig, args, body)
        sums = [builder.fadd(reduce_add(builder, builder.load(a[32])), reduce_add(builder, builder.load(a[16])))
                for a in acc]
        if ntok == 1:
            return sums[0]
        return context.make_tuple(builder, sig.return_type, sums)
    return codegen


@intrinsic
def rowdot(typingctx, w, row, x, xoff):
    """w[row] . x[xoff : xoff + K]: one row of a block-format matrix against float32 activations."""
    if not fmt_of(w):
        return None
    return types.float32(w, row, x, xoff), _rowdot_codegen(1)


@intrinsic
def rowdot2(typingctx, w, row, xa, xb, xoffa, xoffb):
    """(w[row] . xa[xoffa:], w[row] . xb[xoffb:]): each block decoded once for two tokens."""
    if not fmt_of(w):
        return None
    return types.UniTuple(types.float32, 2)(w, row, xa, xb, xoffa, xoffb), _rowdot_codegen(2)


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
