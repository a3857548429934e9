"""Numba kernels of the cpu backend. Output first; each docstring quotes the math it implements.

Weights are read-only views of the model's memmap in their stored bits, widened to float32 inside
the inner loops (never copied, so experts never routed are never read):
    float32   as is
    float16   IEEE half bits viewed as uint16 -> LLVM `fpext half to float` (F16C vcvtph2ps on
              x86-64, fcvt on ARM64); Numba has no float16 arrays
    bfloat16  bits viewed as int16 -> zero-extend, shift left 16, bitcast to float
    int8      signed integer -> float; its float32 row scales (w[r] = q[r] * scales[r]) multiply
              each output once, after the dot product
The element type of the view picks the widening, so one source serves all four weight types and
each weight-reading kernel has one specialisation per weight type. Optional vectors (bias,
scales) are passed as empty arrays when absent, so absence costs no extra specialisation.

The KV cache (base.kv_parts) is read the same way: float32 rows as is, float16 rows as half bits
(uint16), q8_0 rows as int8 values with a half-bit scale per group (row_dot, row_axpy, dot4_rows,
axpy4_rows: overloaded on the scales, so float32 and float16 compile to the plain loops); kv_write_half
and kv_write_q8 round in integer arithmetic (f32_to_half_bits), the reference's bits exactly.

No kernel allocates: no array is created here, prange loops carry no cross-iteration reduction
(Numba would allocate per-thread reduction arrays), all scratch comes from the caller.

Float flags: REDUCE = {"reassoc", "contract"} lets LLVM split sums across SIMD lanes and fuse
multiply-adds (a dot product does not vectorise otherwise); no "nnan"/"ninf", so NaN and inf still
propagate and -inf works as the empty softmax maximum. Constants are np.float32 so nothing
silently promotes to float64.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import jitcache  # noqa: F401  -- before the first cache=True kernel: COLIBRI_KERNEL_CACHE's locator

REDUCE = {"reassoc", "contract"}
F0 = np.float32(0.0)
F1 = np.float32(1.0)


# -- widening stored weight bits to float32 ------------------------------------------------------
@intrinsic
def half_bits_to_f32(typingctx, bits):
    """uint16 holding IEEE half bits -> float32 (fpext: exact, vectorises to vcvtph2ps / fcvt)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def bf16_bits_to_f32(typingctx, bits):
    """int16 holding bfloat16 bits -> float32: the bits are the top half of a float32."""
    if bits != types.int16:
        return None

    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def f32_bits(typingctx, x):
    """float32 -> its IEEE bits as uint32 (a bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def cpu_pause(typingctx):
    """The x86-64 spin-wait hint (`pause`), as libgomp spins (backend.spincount times it)."""
    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True)
def pause_loop(n):
    """n pauses (x86-64 only)."""
    for _ in range(n):
        cpu_pause()


@njit(inline="always")
def f32_to_half_bits(x):
    """float32 -> IEEE half bits (uint16), rounded to nearest even, overflow to inf, subnormals kept:
    NumPy's conversion (npy_floatbits_to_halfbits), in integer arithmetic so that it needs no F16C
    instruction or runtime library call on any target (the KV cache's float16 and q8_0 scales)."""
    f = np.int64(f32_bits(x))
    sgn = (f & 0x80000000) >> 16
    fexp = f & 0x7F800000
    if fexp >= 0x47800000:                          # overflow, inf, NaN
        if fexp == 0x7F800000 and (f & 0x007FFFFF) != 0:
            h = 0x7C00 + ((f & 0x007FFFFF) >> 13)
            return np.uint16(sgn + (h if h != 0x7C00 else 0x7C01))
        return np.uint16(sgn + 0x7C00)
    if fexp <= 0x38000000:                          # a subnormal half or zero
        if fexp < 0x33000000:
            return np.uint16(sgn)
        e = fexp >> 23
        sig = (0x00800000 + (f & 0x007FFFFF)) >> (113 - e)
        if (sig & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            sig += 0x1000
        return np.uint16(sgn + (sig >> 13))
    sig = f & 0x007FFFFF
    if (sig & 0x3FFF) != 0x1000:
        sig += 0x1000
    return np.uint16(sgn + (sig >> 13) + ((fexp - 0x38000000) >> 13))


def widen(v):
    """Stored weight element -> float32 (compiled only; the element type picks the conversion)."""
    raise NotImplementedError("widen runs inside Numba kernels only")


@overload(widen, inline="always")
def _widen(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: half_bits_to_f32(v)
    if v == types.int16:
        return lambda v: bf16_bits_to_f32(v)
    if v == types.int8:
        return lambda v: np.float32(v)


@njit(inline="always")
def scaled(v, scales, n):
    """v * scales[n] for int8 rows; v when scales is empty (unquantised weights)."""
    return v * scales[n] if scales.shape[0] else v


# -- dot products (inlined into the kernels below) ----------------------------------------------
@njit(fastmath=REDUCE, error_model="numpy", inline="always")
def dot1(w, n, xr):
    """w[n] . xr   (w [N,K] stored weights, xr [K] float32)"""
    wn = w[n]
    acc = F0
    for k in range(xr.shape[0]):
        acc += widen(wn[k]) * xr[k]
    return acc


# -- four rows against one or two tokens, in explicit vectors (batch invariance) -------------------
# fdot4 and fdot4x2 spell out their arithmetic in LLVM IR: per (row, token) one <8 x float>
# accumulator, acc = fma(widen(w[k:k+8]), x[k:k+8], acc) for k = 0, 8, ... in order, a scalar chain
# for the last K % 8 elements, then the vector's sum plus the chain. A token's sums are therefore
# the same whether it runs alone (fdot4) or beside another (fdot4x2), whatever T: written as Numba
# loops with "reassoc", LLVM vectorised four sums and eight with different numbers of partial sums,
# so a row's result depended on how many tokens shared the call (~1e-6 of a logit). One chain per
# (row, token) is 4 (8) independent FMA chains, past the memory rate of a decode GEMV (float16:
# 16 bytes a cycle a core) and at full FMA rate for pairs.
def _host_vector_width() -> int:
    """Floats per accumulator: 16 where the CPU Numba compiles for has AVX-512 (zmm registers: a 4-token
    tile's 16 accumulators fit in 32 of them), else 8 (AVX2: 16 ymm registers hold a 2-token tile's
    8). Per host, fixed for the process, so a token's sums never depend on the batch."""
    try:
        import llvmlite.binding as llvm
        from numba.core import config
        name = (config.CPU_NAME or "host").lower()
        if name not in ("host", llvm.get_host_cpu_name().lower()):
            return 8                                # a named target (a bundle's): the portable width
        return 16 if llvm.get_host_cpu_features().get("avx512f") else 8
    except Exception:                               # noqa: BLE001  no feature query: the portable width
        return 8


VW = _host_vector_width()
TILE4 = VW == 16      # tokens in fours (fdot4x4) where the registers hold 16 accumulators
_STORED = {types.float32: (ir.FloatType(), 4), types.uint16: (ir.IntType(16), 2), types.int16: (ir.IntType(16), 2),
           types.int8: (ir.IntType(8), 1)}


def _widen_ir(builder, v, dt, n):
    """IR: stored weight bits v (<n x T>, or a scalar when n is 0) -> float32, as widen() does."""
    f32 = ir.FloatType() if n == 0 else ir.VectorType(ir.FloatType(), n)
    if dt == types.float32:
        return v
    if dt == types.uint16:
        return builder.fpext(builder.bitcast(v, ir.HalfType() if n == 0 else ir.VectorType(ir.HalfType(), n)), f32)
    if dt == types.int16:
        i32 = ir.IntType(32) if n == 0 else ir.VectorType(ir.IntType(32), n)
        sixteen = ir.Constant(i32, 16) if n == 0 else ir.Constant(i32, [16] * n)
        return builder.bitcast(builder.shl(builder.zext(v, i32), sixteen), f32)
    return builder.sitofp(v, f32)


def _fdot_codegen(ntok):
    def codegen(context, builder, sig, args):
        from .qir import _fn, c64, data_ptr, load, reduce_add
        W = VW
        f32, v8 = ir.FloatType(), ir.VectorType(ir.FloatType(), W)
        dt = sig.args[0].dtype
        ety, esz = _STORED[dt]
        rows = [data_ptr(context, builder, sig.args[r], args[r]) for r in range(4)]
        xs = [data_ptr(context, builder, sig.args[4 + t], args[4 + t]) for t in range(ntok)]
        K = builder.extract_value(context.make_array(sig.args[4])(context, builder, args[4]).shape, 0)
        K8 = builder.and_(K, c64(-W))
        fma8 = _fn(builder, f"llvm.fma.v{W}f32", v8, [v8, v8, v8])
        fma1 = _fn(builder, "llvm.fma.f32", f32, [f32, f32, f32])
        acc = [[cgutils.alloca_once_value(builder, ir.Constant(v8, [0.0] * W)) for _ in range(ntok)] for _ in range(4)]
        tail = [[cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(ntok)] for _ in range(4)]
        with cgutils.for_range_slice(builder, c64(0), K8, c64(W)) as (k, _):
            xv = [load(builder, builder.add(xs[t], builder.mul(k, c64(4))), v8, align=4) for t in range(ntok)]
            for r in range(4):
                w = _widen_ir(builder, load(builder, builder.add(rows[r], builder.mul(k, c64(esz))),
                                            ir.VectorType(ety, W), align=esz), dt, W)
                for t in range(ntok):
                    builder.store(builder.call(fma8, [w, xv[t], builder.load(acc[r][t])]), acc[r][t])
        with cgutils.for_range_slice(builder, K8, K, c64(1)) as (k, _):
            xv = [load(builder, builder.add(xs[t], builder.mul(k, c64(4))), f32, align=4) for t in range(ntok)]
            for r in range(4):
                w = _widen_ir(builder, load(builder, builder.add(rows[r], builder.mul(k, c64(esz))), ety, align=esz),
                              dt, 0)
                for t in range(ntok):
                    builder.store(builder.call(fma1, [w, xv[t], builder.load(tail[r][t])]), tail[r][t])
        sums = [builder.fadd(reduce_add(builder, builder.load(acc[r][t])), builder.load(tail[r][t]))
                for t in range(ntok) for r in range(4)]
        return context.make_tuple(builder, sig.return_type, sums)
    return codegen


def _fdot_types(rows, xs):
    """The rows: four 1-D contiguous arrays of one stored type; the tokens: 1-D contiguous float32."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in rows + xs):
        return False
    return rows[0].dtype in _STORED and all(a.dtype == rows[0].dtype for a in rows) and \
        all(a.dtype == types.float32 for a in xs)


@intrinsic
def fdot4(typingctx, r0, r1, r2, r3, xa):
    """(r_j . xa for j < 4): four weight rows [K] (stored types, see widen) against a float32 token [K]."""
    if not _fdot_types([r0, r1, r2, r3], [xa]):
        return None
    return types.UniTuple(types.float32, 4)(r0, r1, r2, r3, xa), _fdot_codegen(1)


@intrinsic
def fdot4x2(typingctx, r0, r1, r2, r3, xa, xb):
    """fdot4 for two tokens, each widened weight vector used twice: (r_j . xa for j < 4, r_j . xb for j < 4),
    each token's sums bit for bit fdot4's."""
    if not _fdot_types([r0, r1, r2, r3], [xa, xb]):
        return None
    return types.UniTuple(types.float32, 8)(r0, r1, r2, r3, xa, xb), _fdot_codegen(2)


@intrinsic
def fdot4x4(typingctx, r0, r1, r2, r3, xa, xb, xc, xd):
    """fdot4 for four tokens (hosts with TILE4): (r_j . xa, then xb, xc, xd for j < 4), each token's sums
    bit for bit fdot4's."""
    if not _fdot_types([r0, r1, r2, r3], [xa, xb, xc, xd]):
        return None
    return types.UniTuple(types.float32, 16)(r0, r1, r2, r3, xa, xb, xc, xd), _fdot_codegen(4)


# -- eight scaled rows added to one or two outputs, in explicit vectors (LoRA's up projection) -------
# out[o] = fma(b7[o], z7, ... fma(b1[o], z1, fma(b0[o], z0, out[o])))  for o in lo..hi-1: one fused
# chain per element in row order, in <VW x float> vectors and a scalar tail alike, so an element's
# result is the same in a vector lane or the tail (a chunk's bounds never change it), and the same
# for a row alone (faxpy8) or beside another (faxpy8x2, the b rows loaded once for both). Written as
# Numba loops the vectoriser gave up (eight rows and an output row whose overlap it cannot rule out):
# scalar code at 4.7 GFMA/s a core where this runs at the load rate.
def _faxpy_codegen(nout):
    """args: nout (out, c0) pairs, nout (z, zo) pairs, eight rows, lo, hi"""
    def codegen(context, builder, sig, args):
        from .qir import _fn, c64, data_ptr, load
        W = VW
        f32, vw = ir.FloatType(), ir.VectorType(ir.FloatType(), W)
        i64 = lambda i: context.cast(builder, args[i], sig.args[i], types.int64)     # noqa: E731
        b0 = 4 * nout
        dt = sig.args[b0].dtype
        ety, esz = _STORED[dt]
        outs = [builder.add(data_ptr(context, builder, sig.args[2 * q], args[2 * q]), builder.mul(i64(2 * q + 1), c64(4)))
                for q in range(nout)]
        zs = [builder.add(data_ptr(context, builder, sig.args[2 * nout + 2 * q], args[2 * nout + 2 * q]),
                          builder.mul(i64(2 * nout + 2 * q + 1), c64(4))) for q in range(nout)]
        rows = [data_ptr(context, builder, sig.args[b0 + j], args[b0 + j]) for j in range(8)]
        lo, hi = i64(b0 + 8), i64(b0 + 9)
        zval = [[load(builder, builder.add(zs[q], c64(4 * j)), f32, align=4) for j in range(8)] for q in range(nout)]
        mask = ir.Constant(ir.VectorType(ir.IntType(32), W), [0] * W)
        zvec = [[builder.shuffle_vector(builder.insert_element(ir.Constant(vw, ir.Undefined), zval[q][j],
                                                               ir.Constant(ir.IntType(32), 0)),
                                        ir.Constant(vw, ir.Undefined), mask) for j in range(8)] for q in range(nout)]
        fmaw = _fn(builder, f"llvm.fma.v{W}f32", vw, [vw, vw, vw])
        fma1 = _fn(builder, "llvm.fma.f32", f32, [f32, f32, f32])
        nv = builder.add(lo, builder.and_(builder.sub(hi, lo), c64(-W)))
        for vector, step, ty, fma in ((True, W, vw, fmaw), (False, 1, f32, fma1)):
            with cgutils.for_range_slice(builder, lo if vector else nv, nv if vector else hi, c64(step)) as (k, _):
                w = [_widen_ir(builder, load(builder, builder.add(rows[j], builder.mul(k, c64(esz))),
                                             ir.VectorType(ety, W) if vector else ety, align=esz), dt, W if vector else 0)
                     for j in range(8)]
                for q in range(nout):
                    ptr = builder.inttoptr(builder.add(outs[q], builder.mul(k, c64(4))), ty.as_pointer())
                    acc = builder.load(ptr, align=4)
                    for j in range(8):
                        acc = builder.call(fma, [w[j], zvec[q][j] if vector else zval[q][j], acc])
                    builder.store(acc, ptr, align=4)
        return context.get_dummy_value()
    return codegen


def _faxpy_types(outs, zs, rows, ints):
    return _fdot_types(rows, outs + zs) and all(isinstance(i, types.Integer) for i in ints)


@intrinsic
def faxpy8(typingctx, out, c0, z, zo, b0, b1, b2, b3, b4, b5, b6, b7, lo, hi):
    """out[c0 + o] += sum_j z[zo + j] b_j[o] for o in lo..hi-1, j < 8, one fma chain per element in j
    order (out, z: 1-D float32; b_j: 1-D rows of one stored type; the caller keeps indices in range)."""
    if not _faxpy_types([out], [z], [b0, b1, b2, b3, b4, b5, b6, b7], [c0, zo, lo, hi]):
        return None
    return types.void(out, c0, z, zo, b0, b1, b2, b3, b4, b5, b6, b7, lo, hi), _faxpy_codegen(1)


@intrinsic
def faxpy8x2(typingctx, oa, ca, ob, cb, za, zoa, zb, zob, b0, b1, b2, b3, b4, b5, b6, b7, lo, hi):
    """faxpy8 for two outputs (oa from ca with za from zoa, ob from cb with zb from zob), each widened b
    vector used twice; each output's elements bit for bit faxpy8's."""
    if not _faxpy_types([oa, ob], [za, zb], [b0, b1, b2, b3, b4, b5, b6, b7], [ca, cb, zoa, zob, lo, hi]):
        return None
    return (types.void(oa, ca, ob, cb, za, zoa, zb, zob, b0, b1, b2, b3, b4, b5, b6, b7, lo, hi),
            _faxpy_codegen(2))


@njit(inline="always")
def thread_rows(c, threads, N):
    """Rows [lo, hi) of N that part c of `threads` equal parts holds: one contiguous range each."""
    per = (N + threads - 1) // threads
    return min(N, c * per), min(N, (c + 1) * per)


# -- work claiming: what a running thread takes over from a descheduled or slower one ------------
# Each weight-reading kernel is `for c in prange(threads)`, one iteration a thread, and each thread
# claims chunks of rows until none are left: first the chunks of its own contiguous share (so on a
# quiet machine every thread streams the rows a static split would give it), then the next
# unclaimed chunk of another thread's share. A thread that the OS has descheduled, or a slower core,
# therefore holds up a region by at most the one chunk it is in, not by its whole share.
# work: int64 [threads, 8], the claim counters, one 64-byte line a thread (no false sharing).
CHUNK_ROWS = 64        # rows a chunk holds at least: 16 per stream of matmul's four (32 KB of f16 at K=1024)
CHUNKS_MAX = 8          # chunks a thread's share is cut into at most


@intrinsic
def fetch_add(typingctx, work, row):
    """old = work[row, 0]; work[row, 0] = old + 1, atomically (LLVM atomicrmw add, monotonic: a
    counter hands out each index once; the region's end is what orders the rows' writes)."""
    if not (isinstance(work, types.Array) and work.dtype == types.int64 and work.ndim == 2):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        r = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [r, context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(work, row), codegen


@njit(inline="always")
def reset_claims(work):
    """Every thread's counter to 0: run by the calling thread before the parallel loop."""
    for c in range(work.shape[0]):
        work[c, 0] = 0


@njit(inline="always")
def claim(work, c, N):
    """-> rows [lo, hi) of N for thread c to do next; lo == hi when every chunk is taken.
    Thread c's share (part c of threads) is cut into K = min(CHUNKS_MAX, N // (threads * CHUNK_ROWS))
    chunks, at least 1; c takes its own in order, then the next one of thread c+1, c+2, ..."""
    threads = work.shape[0]
    K = min(CHUNKS_MAX, max(1, N // (threads * CHUNK_ROWS)))
    for d in range(threads):
        o = c + d
        if o >= threads:
            o -= threads
        i = fetch_add(work, o)
        if i < K:
            return thread_rows(o * K + i, threads * K, N)
    return 0, 0


@njit(inline="always")
def store4(out, t, n, q, a0, a1, a2, a3):
    """out[t, n + j*q] = a_j,  j < 4   (the four streams' rows, see matmul)"""
    out[t, n] = a0
    out[t, n + q] = a1
    out[t, n + 2 * q] = a2
    out[t, n + 3 * q] = a3


# -- dense ---------------------------------------------------------------------------------------
@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def matmul(out, x, w, scales, bias, work):
    """out[T,N] = (x[T,K] @ w[N,K]^T) * scales[N] + bias[N]
        w: weight [N,K];  scales: float32 [N] (int8) or empty;  bias: float32 [N] or empty;
        work: int64 [threads, 8], the claim counters (claim: each thread takes chunks of rows,
        its own share's first, then what another thread has not started)
    How the weight is read decides the speed: decode (T = 1) is a GEMV bound by streaming w.
    Each chunk [lo, hi) is split in four quarters of q rows, walked side by side,
    rows n, n+q, n+2q, n+3q for n = lo..lo+q-1 (then the last (hi-lo) % 4 rows alone): four
    long sequential streams per core, which the hardware prefetcher follows across rows, and
    four dot products sharing each load of x. Measured on 2 Zen 4 cores, float16 expert
    matrices [2816,1024] from the memmap: 55 GB/s; rows one at a time 40 GB/s (one stream is too
    few misses in flight); four adjacent rows per block 21-28 GB/s (four 2 KB streams per block
    restart the prefetcher every block); 8 streams 40-44 GB/s; software prefetch hints on top of
    the 4 streams 32 GB/s, so there are none. The four rows stay in L1 while every token uses them,
    two tokens per pass, so each weight is read from memory once per call whatever T.
    out must not alias x. No BLAS: f16/bf16/int8 weights would need a widened copy, and one
    kernel keeps one thread pool (Numba's) for COLIBRI_NUM_THREADS to govern."""
    T = x.shape[0]
    N = w.shape[0]
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, N)
            if lo >= hi:
                break
            q = (hi - lo) // 4
            for n in range(lo, lo + q):
                r0, r1, r2, r3 = w[n], w[n + q], w[n + 2 * q], w[n + 3 * q]
                t4 = T - T % 4 if TILE4 else 0
                for t in range(0, t4, 4):
                    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = \
                        fdot4x4(r0, r1, r2, r3, x[t], x[t + 1], x[t + 2], x[t + 3])
                    store4(out, t, n, q, a0, a1, a2, a3)
                    store4(out, t + 1, n, q, b0, b1, b2, b3)
                    store4(out, t + 2, n, q, c0, c1, c2, c3)
                    store4(out, t + 3, n, q, d0, d1, d2, d3)
                for t in range(t4, T - 1, 2):
                    a0, a1, a2, a3, b0, b1, b2, b3 = fdot4x2(r0, r1, r2, r3, x[t], x[t + 1])
                    store4(out, t, n, q, a0, a1, a2, a3)
                    store4(out, t + 1, n, q, b0, b1, b2, b3)
                if (T - t4) % 2:
                    a0, a1, a2, a3 = fdot4(r0, r1, r2, r3, x[T - 1])
                    store4(out, T - 1, n, q, a0, a1, a2, a3)
            for n in range(lo + 4 * q, hi):           # the last (hi - lo) % 4 rows: dot1 whatever T
                for t in range(T):
                    out[t, n] = dot1(w, n, x[t])
            if scales.shape[0] or bias.shape[0]:
                for t in range(T):
                    for n in range(lo, hi):
                        v = scaled(out[t, n], scales, n)
                        out[t, n] = v + bias[n] if bias.shape[0] else v


@njit(inline="always")
def head_rows(out, x, g, w, lo, hi):
    """out[t, n] = w[n] . x[t, g] for rows lo <= n < hi of one head's w [N,K] (out [T,N], x [T,G,K]),
    read as matmul reads a chunk: four streams of q rows (n, n+q, n+2q, n+3q), the tokens in fours
    (TILE4) or pairs and a lone last one, then the last (hi - lo) % 4 rows with dot1 whatever T."""
    T = x.shape[0]
    q = (hi - lo) // 4
    for n in range(lo, lo + q):
        r0, r1, r2, r3 = w[n], w[n + q], w[n + 2 * q], w[n + 3 * q]
        t4 = T - T % 4 if TILE4 else 0
        for t in range(0, t4, 4):
            a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = \
                fdot4x4(r0, r1, r2, r3, x[t, g], x[t + 1, g], x[t + 2, g], x[t + 3, g])
            store4(out, t, n, q, a0, a1, a2, a3)
            store4(out, t + 1, n, q, b0, b1, b2, b3)
            store4(out, t + 2, n, q, c0, c1, c2, c3)
            store4(out, t + 3, n, q, d0, d1, d2, d3)
        for t in range(t4, T - 1, 2):
            a0, a1, a2, a3, b0, b1, b2, b3 = fdot4x2(r0, r1, r2, r3, x[t, g], x[t + 1, g])
            store4(out, t, n, q, a0, a1, a2, a3)
            store4(out, t + 1, n, q, b0, b1, b2, b3)
        if (T - t4) % 2:
            a0, a1, a2, a3 = fdot4(r0, r1, r2, r3, x[T - 1, g])
            store4(out, T - 1, n, q, a0, a1, a2, a3)
    for n in range(lo + 4 * q, hi):
        for t in range(T):
            out[t, n] = dot1(w, n, x[t, g])


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def head_matmul(out, x, w, work):
    """out[t,g,n] = sum_k x[t,g,k] * w[g,n,k]      out [T,G,N], x [T,G,K] float32, w [G,N,K] stored weights
    matmul for every head at once: the G*N rows (g, n) are claimed in chunks as one matrix's rows
    (work: as in matmul), a chunk is cut where a head ends, and each piece is read as matmul reads a
    chunk (head_rows), so each weight is read once per call and a token's sums never depend on the
    other tokens (the pieces depend on G, N and the thread count only). out must not alias x."""
    G, N = w.shape[0], w.shape[1]
    reset_claims(work)
    for c in prange(work.shape[0]):
        while True:
            lo, hi = claim(work, c, G * N)
            if lo >= hi:
                break
            for g in range(lo // N, (hi + N - 1) // N):
                head_rows(out[:, g], x, g, w[g], max(lo - g * N, 0), min(hi - g * N, N))


@njit(cache=True, error_model="numpy")
def embed(out, table, scales, ids):
    """out[t] = table[ids[t]] (* scales[ids[t]])     table: [V,H] stored weights or a float32 buffer,
    scales: float32 [V] (int8) or empty"""
    for t in range(ids.shape[0]):
        row = table[ids[t]]
        for h in range(out.shape[1]):
            out[t, h] = scaled(widen(row[h]), scales, ids[t])


@njit(cache=True, fastmath=REDUCE, error_model="numpy")
def rmsnorm(out, x, weight, eps):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight        x, out [R,D] (may alias), weight [D]"""
    R, D = x.shape
    epsf, Df = np.float32(eps), np.float32(D)
    for r in range(R):
        xr = x[r]
        ss = F0
        for d in range(D):
            ss += xr[d] * xr[d]
        inv = F1 / np.sqrt(ss / Df + epsf)
        for d in range(D):
            out[r, d] = xr[d] * inv * widen(weight[d])


@njit(cache=True, error_model="numpy")
def pos_scale(out, x, positions, floor_scale, attn_scale):
    """out[t] = x[t] * (log1p(floor((p_t + 1) / floor_scale)) * attn_scale + 1)   x, out [T, N] (may alias):
    Llama 4's attention temperature on its no-rope layers' queries"""
    T, N = x.shape
    for t in range(T):
        f = np.log1p(np.floor((np.float32(positions[t]) + F1) / floor_scale)) * attn_scale + F1
        for i in range(N):
            out[t, i] = x[t, i] * f


@njit(cache=True, error_model="numpy")
def layernorm(out, x, weight, bias, eps):
    """out[r] = (x[r] - mean) / sqrt(mean((x[r] - mean)^2) + eps) * weight + bias     x, out [R,D] (may
    alias), weight, bias [D] float32 (torch.nn.LayerNorm: Phi-3.5-MoE)"""
    R, D = x.shape
    epsf, Df = np.float32(eps), np.float32(D)
    for r in range(R):
        xr = x[r]
        s = F0
        for d in range(D):
            s += xr[d]
        mean = s / Df
        ss = F0
        for d in range(D):
            c = xr[d] - mean
            ss += c * c
        inv = F1 / np.sqrt(ss / Df + epsf)
        for d in range(D):
            out[r, d] = (xr[d] - mean) * inv * weight[d] + bias[d]


GELU_C = np.float32(np.sqrt(2.0 / np.pi))     # gelu_tanh's constants, as the reference rounds them
GELU_A = np.float32(0.044715)
F05 = np.float32(0.5)


@njit(error_model="numpy")
def silu_mul(g, u):
    """silu(g) * u = g / (1 + exp(-g)) * u: SwiGLU (expert_act's alpha == 0)."""
    return g / (F1 + np.exp(-g)) * u


@njit(error_model="numpy", inline="always")
def activate(g, u, r, i, ep):
    """expert_act(g, u, r, i, ep), SwiGLU without addends (pre empty, alpha 0) as silu_mul on two floats.
    expert_act takes ep (two arrays and two floats and pre) by value and is not inlined: a call per
    activation cost 8 us more per expert call at I = 384 (17.5 against 9.3 us, the wave-1 kernel's
    inline silu) -- the per-element epilogue, not the dot products, at decode. Same bits: one
    expression, in a function of its own (no float flags of the caller's)."""
    if ep[2] == F0 and ep[4].shape[0] == 0:
        return silu_mul(g, u)
    return expert_act(g, u, r, i, ep)


@njit(error_model="numpy")
def expert_act(g, u, r, i, ep):
    """The experts' activation of row r, column i; ep = (gate_bias, up_bias, alpha, limit, pre), empty
    biases = 0; pre [R, 2I] (empty: none) adds per row, first: g += pre[r, i], u += pre[r, I + i] (a
    LoRA update of gate and up: runtime/lora.py); then
        alpha == 0:  silu(g) * u = g / (1 + exp(-g)) * u                           (SwiGLU)
        alpha < 0:   g' = g + gb[i], u' = u + ub[i]:  gelu_tanh(g') * u'           (GeGLU; limit unused)
                     gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        alpha > 0:   g' = min(g + gb[i], limit), u' = clamp(u + ub[i], -limit, limit)  (gpt-oss):
                     (u' + 1) * g' / (1 + exp(-alpha g'))
    The sign of alpha encodes the kind, so every kernel keeps one signature (one compile) for all.
    A call, not inlined by Numba: inlined at its ~20 sites it tripled the kernels' compile time."""
    gb, ub, alpha, limit, pre = ep
    if pre.shape[0]:
        g += pre[r, i]
        u += pre[r, pre.shape[1] // 2 + i]
    if alpha == F0:
        return silu_mul(g, u)
    if gb.shape[0]:
        g += gb[i]
    if ub.shape[0]:
        u += ub[i]
    if alpha < F0:
        return F05 * g * (F1 + np.tanh(GELU_C * (g + GELU_A * g * g * g))) * u
    g = min(g, limit)
    u = min(max(u, -limit), limit)
    return (u + F1) * (g / (F1 + np.exp(-alpha * g)))


@njit(cache=True, error_model="numpy")
def rope(out, x, positions, inv_freq):
    """Rotate-half rotary embedding, x/out [T,heads,D] (may alias), angle a = p * f_i in float32:
        f_i = inv_freq[i], i < D/2 (theta^(-2i/D) as NumPy computes it, or a scaled rope's table)
        out[..., i]       = x_i cos a - x_{i+D/2} sin a
        out[..., i + D/2] = x_{i+D/2} cos a + x_i sin a"""
    T, heads, D = x.shape
    half = D // 2
    for t in range(T):
        p = np.float32(positions[t])
        for i in range(half):
            a = p * inv_freq[i]
            c, s = np.cos(a), np.sin(a)
            for h in range(heads):
                x1, x2 = x[t, h, i], x[t, h, i + half]
                out[t, h, i] = x1 * c - x2 * s
                out[t, h, i + half] = x2 * c + x1 * s


@njit(cache=True, error_model="numpy")
def add(out, a, b):
    """out[T,H] = a + b"""
    for t in range(out.shape[0]):
        for h in range(out.shape[1]):
            out[t, h] = a[t, h] + b[t, h]


@njit(cache=True, error_model="numpy")
def gated_add(out, a, b, gate):
    """out[t] = a[t] + sigmoid(gate[t,0]) * b[t] = a[t] + b[t] / (1 + exp(-gate[t,0]))"""
    for t in range(out.shape[0]):
        den = F1 + np.exp(-gate[t, 0])
        for h in range(out.shape[1]):
            out[t, h] = a[t, h] + b[t, h] / den


# -- attention -----------------------------------------------------------------------------------
@njit(cache=True)
def kv_write(k_cache, v_cache, k, v, slots):
    """k_cache[slots[t]] = k[t]; v_cache[slots[t]] = v[t]
        k_cache [slots,Hkv,Dk], k [T,Hkv,Dk];  v_cache [slots,Hkv,Dv], v [T,Hkv,Dv]  (Dk, Dv may differ:
        latent attention's latent C [slots,1,Dc] and rope key R [slots,1,Dr])"""
    for t in range(slots.shape[0]):
        s = slots[t]
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_cache[s, h, d] = k[t, h, d]
        for h in range(v.shape[1]):
            for d in range(v.shape[2]):
                v_cache[s, h, d] = v[t, h, d]


@njit(cache=True)
def kv_write_half(cache, x, slots):
    """cache[slots[t]] = half(x[t]): cache [slots,H,D] uint16 (half bits), x [T,H,D] float32; rounded to
    nearest even (f32_to_half_bits)."""
    for t in range(slots.shape[0]):
        s = slots[t]
        for h in range(x.shape[1]):
            for d in range(x.shape[2]):
                cache[s, h, d] = f32_to_half_bits(x[t, h, d])


F127 = np.float32(127.0)


@njit(cache=True)
def kv_write_q8(cache, scales, x, slots):
    """q8_0 rows (base.kv_parts; reference.quantize_q8_0): for each head row x[t,h] [D] and group g of
    G = D / scales.shape[2] values,
        d' = half(max|x_g| / 127),  q = round(x_g * (1 / d')) half away from zero, clamped to [-127, 127]
        (0 where d' is 0);  cache[slots[t], h, g*G:(g+1)*G] = q (int8),  scales[slots[t], h, g] = d'
    a non-finite value makes its group's q 0 and d' non-finite (it reads back non-finite). In float32,
    no fastmath: the reference's values bit for bit."""
    D = x.shape[2]
    G = D // scales.shape[2]
    for t in range(slots.shape[0]):
        s = slots[t]
        for h in range(x.shape[1]):
            for g in range(scales.shape[2]):
                amax = F0
                bad = False
                for d in range(g * G, (g + 1) * G):
                    a = abs(x[t, h, d])
                    if a > amax:
                        amax = a
                    elif not a <= amax:             # NaN
                        bad = True
                if bad:
                    amax = np.float32(np.nan)
                bits = f32_to_half_bits(amax / F127)
                dv = half_bits_to_f32(bits)
                inv = F1 / dv if dv != F0 else F0
                for d in range(g * G, (g + 1) * G):
                    v = x[t, h, d] * inv
                    if not abs(v) < np.float32(np.inf):
                        v = F0
                    r = min(np.floor(abs(np.float64(v)) + 0.5), 127.0)
                    cache[s, h, d] = np.int8(r if v >= F0 else -r)
                scales[s, h, g] = bits


# -- reading quantised cache rows (inlined into the attention kernels) -----------------------------
# A cache tensor reaches the kernels as its values (float32, float16 bits as uint16, or q8_0's int8)
# and q8_0's scales [rows, heads, groups] (half bits), or None for float32 and float16 (one group of
# scale 1). Each helper is overloaded on the scales' type, so without scales it compiles to the plain
# loop over the row (float32's arithmetic exactly as before kv_dtype) and with them to a loop per group.
def row_dot(qv, kr, scales, row, h):
    """qv . kr, the cache row kr (row `row`, head h) dequantised: with q8_0's scales each group's dot
    product in its int8 values, times the group's scale (compiled only)."""
    raise NotImplementedError("row_dot runs inside Numba kernels only")


def row_axpy(acc, p, vr, scales, row, h):
    """acc += p * vr, the cache row vr dequantised: with q8_0's scales p times each group's scale, times
    its int8 values (compiled only)."""
    raise NotImplementedError("row_axpy runs inside Numba kernels only")


def dot4_rows(qv, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
    """(qv . r_i for i < 4): four cache rows (at cache rows s_i, head h) dequantised as row_dot does
    (compiled only)."""
    raise NotImplementedError("dot4_rows runs inside Numba kernels only")


def axpy4_rows(acc, p0, p1, p2, p3, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
    """acc += (p0 r0 + p1 r1) + (p2 r2 + p3 r3), four cache rows dequantised (compiled only)."""
    raise NotImplementedError("axpy4_rows runs inside Numba kernels only")


def _plain(scales):
    return isinstance(scales, (types.NoneType, types.Omitted))


NEG_INF = np.float32(-np.inf)


@overload(row_dot, inline="always")
def _row_dot(qv, kr, scales, row, h):
    if _plain(scales):
        def plain(qv, kr, scales, row, h):
            s = F0
            for d in range(qv.shape[0]):
                s += qv[d] * widen(kr[d])
            return s
        return plain

    def grouped(qv, kr, scales, row, h):
        G = qv.shape[0] // scales.shape[2]
        s = F0
        for g in range(scales.shape[2]):
            qg, kg = qv[g * G:(g + 1) * G], kr[g * G:(g + 1) * G]
            a = F0
            for d in range(G):
                a += qg[d] * widen(kg[d])
            s += a * half_bits_to_f32(scales[row, h, g])
        return s
    return grouped


@overload(row_axpy, inline="always")
def _row_axpy(acc, p, vr, scales, row, h):
    if _plain(scales):
        def plain(acc, p, vr, scales, row, h):
            for d in range(acc.shape[0]):
                acc[d] += p * widen(vr[d])
        return plain

    def grouped(acc, p, vr, scales, row, h):
        G = acc.shape[0] // scales.shape[2]
        for g in range(scales.shape[2]):
            pg = p * half_bits_to_f32(scales[row, h, g])
            ag, vg = acc[g * G:(g + 1) * G], vr[g * G:(g + 1) * G]
            for d in range(G):
                ag[d] += pg * widen(vg[d])
    return grouped


@overload(dot4_rows)
def _dot4_rows(qv, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
    if _plain(scales):
        def plain(qv, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
            a0 = F0
            a1 = F0
            a2 = F0
            a3 = F0
            for d in range(qv.shape[0]):
                a0 += qv[d] * widen(r0[d])
                a1 += qv[d] * widen(r1[d])
                a2 += qv[d] * widen(r2[d])
                a3 += qv[d] * widen(r3[d])
            return a0, a1, a2, a3
        return plain

    def grouped(qv, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
        G = qv.shape[0] // scales.shape[2]
        a0 = F0
        a1 = F0
        a2 = F0
        a3 = F0
        for g in range(scales.shape[2]):
            lo, hi = g * G, (g + 1) * G
            qg, g0, g1, g2, g3 = qv[lo:hi], r0[lo:hi], r1[lo:hi], r2[lo:hi], r3[lo:hi]
            x0 = F0
            x1 = F0
            x2 = F0
            x3 = F0
            for d in range(G):
                x0 += qg[d] * widen(g0[d])
                x1 += qg[d] * widen(g1[d])
                x2 += qg[d] * widen(g2[d])
                x3 += qg[d] * widen(g3[d])
            a0 += x0 * half_bits_to_f32(scales[s0, h, g])
            a1 += x1 * half_bits_to_f32(scales[s1, h, g])
            a2 += x2 * half_bits_to_f32(scales[s2, h, g])
            a3 += x3 * half_bits_to_f32(scales[s3, h, g])
        return a0, a1, a2, a3
    return grouped


@overload(axpy4_rows, inline="always")
def _axpy4_rows(acc, p0, p1, p2, p3, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
    if _plain(scales):
        def plain(acc, p0, p1, p2, p3, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
            for d in range(acc.shape[0]):
                acc[d] += (p0 * widen(r0[d]) + p1 * widen(r1[d])) + (p2 * widen(r2[d]) + p3 * widen(r3[d]))
        return plain

    def grouped(acc, p0, p1, p2, p3, r0, r1, r2, r3, scales, s0, s1, s2, s3, h):
        G = acc.shape[0] // scales.shape[2]
        for g in range(scales.shape[2]):
            w0, w1 = p0 * half_bits_to_f32(scales[s0, h, g]), p1 * half_bits_to_f32(scales[s1, h, g])
            w2, w3 = p2 * half_bits_to_f32(scales[s2, h, g]), p3 * half_bits_to_f32(scales[s3, h, g])
            lo, hi = g * G, (g + 1) * G
            ag, g0, g1, g2, g3 = acc[lo:hi], r0[lo:hi], r1[lo:hi], r2[lo:hi], r3[lo:hi]
            for d in range(G):
                ag[d] += (w0 * widen(g0[d]) + w1 * widen(g1[d])) + (w2 * widen(g2[d]) + w3 * widen(g3[d]))
    return grouped


@njit(inline="always")
def softmax4(acc, m, l, a0, a1, a2, a3):
    """One step of the online softmax over four scores a_i (running max m, sum l, acc the weighted sum
    of value rows so far): where max a_i > m, acc and l are rescaled by exp(m - max) and m moves up;
    -> (m, l + sum p_i, p0, p1, p2, p3), p_i = exp(a_i - m), the value rows' weights."""
    top = max(max(a0, a1), max(a2, a3))
    if top > m:                         # new maximum: rescale what was summed so far
        c = np.exp(m - top)
        l *= c
        for d in range(acc.shape[0]):
            acc[d] *= c
        m = top
    p0, p1, p2, p3 = np.exp(a0 - m), np.exp(a1 - m), np.exp(a2 - m), np.exp(a3 - m)
    return m, l + ((p0 + p1) + (p2 + p3)), p0, p1, p2, p3


@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def paged_attention(out, q, k_cache, k_scales, v_cache, v_scales, block_tables, seq_index, positions, block_size,
                    scale, window, sinks):
    """out[t,h] = sum_j softmax_j(q[t,h] . K[slot(j), h//G] * scale) V[slot(j), h//G],  j = lo_t..p_t
        p_t = positions[t], lo_t = max(0, p_t - window + 1) (window 0: 0; window < 0: chunks of -window,
        lo_t = p_t - p_t mod -window),
        slot(j) = block_tables[seq_index[t], j // B] * B + j % B, G = Hq / Hkv
        sinks [Hq] (or empty): a logit per head in the softmax's denominator only
    The caches in their kv_dtype (base.kv_parts), each row dequantised as it is read: float32 [slots,Hkv,D]
    as is, float16 as half bits (uint16, widened), q8_0 int8 values with half-bit scales [slots,Hkv,D/g]
    (k_scales / v_scales; None otherwise): a group's dot product in its int8 values, times its scale
    (K); each group's p times its scale, times its values (V) (row_dot, row_axpy). Without scales the
    plain loops: float32's arithmetic unchanged.
    Parallel over (token, head). One pass with an online softmax in float32 (running max m, sum l,
    the output row as the accumulator, rescaled when m grows), so no score scratch is needed; a
    sink starts it at m = sink, l = 1 (its own term). Positions four at a time from lo_t, as
    latent_attention takes them (dot4_rows, then one max, one rescale check and one pass over the
    accumulator for the four, axpy4_rows); past p_t the four repeat row p_t with score -inf (weight 0).
    A query's arithmetic depends on its own lo_t and p_t only: the same alone, in a prefill chunk or
    beside other decodes. Measured (2-core AMX Xeon, 16 heads of 64 over 4 KV heads, float16 cache, a
    512-token prompt): 25.3 -> 16.9 ms a layer, the head-major order 1.45x of it (token-major, prange's
    equal ranges gave one thread the long causal rows), the four positions 1.08x. out must not alias q."""
    T, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    scalef = np.float32(scale)
    for ht in prange(T * Hq):
        h, t = ht // T, ht % T            # head-major: prange's equal ranges each hold every token of
        kvh = h // group                  # their heads, so causal prefill's long rows are shared out
        table = block_tables[seq_index[t]]
        n = positions[t] + 1
        lo = max(0, n - window) if window > 0 else (n - 1) - (n - 1) % -window if window < 0 else 0
        qv, acc = q[t, h], out[t, h]
        for d in range(D):
            acc[d] = F0
        m, l = np.float32(-np.inf), F0
        if sinks.shape[0] > 0:
            m, l = sinks[h], F1
        for j in range(lo, n, 4):
            s0, s1 = slot_of(table, j, block_size), slot_of(table, min(j + 1, n - 1), block_size)
            s2, s3 = slot_of(table, min(j + 2, n - 1), block_size), slot_of(table, min(j + 3, n - 1), block_size)
            a0, a1, a2, a3 = dot4_rows(qv, k_cache[s0, kvh], k_cache[s1, kvh], k_cache[s2, kvh], k_cache[s3, kvh],
                                       k_scales, s0, s1, s2, s3, kvh)
            a0 = a0 * scalef
            a1 = a1 * scalef if j + 1 < n else NEG_INF
            a2 = a2 * scalef if j + 2 < n else NEG_INF
            a3 = a3 * scalef if j + 3 < n else NEG_INF
            m, l, p0, p1, p2, p3 = softmax4(acc, m, l, a0, a1, a2, a3)
            axpy4_rows(acc, p0, p1, p2, p3, v_cache[s0, kvh], v_cache[s1, kvh], v_cache[s2, kvh], v_cache[s3, kvh],
                       v_scales, s0, s1, s2, s3, kvh)
        inv = F1 / l
        for d in range(D):
            acc[d] *= inv


@njit(inline="always")
def slot_of(table, j, block_size):
    """The cache row of position j: table[j // B] * B + j % B"""
    return table[j // block_size] * block_size + j % block_size



@njit(parallel=True, nogil=True, cache=True, fastmath=REDUCE, error_model="numpy")
def latent_attention(out, q, q_rope, c_cache, c_scales, r_cache, r_scales, block_tables, seq_index, positions,
                     block_size, scale, parts, ml):
    """out[t,h] = sum_j softmax_j(s_j) C[slot(j), 0],  j = 0..p_t
        s_j = scale * (q[t,h] . C[slot(j), 0] + q_rope[t,h] . R[slot(j), 0])
        p_t = positions[t], slot(j) = block_tables[seq_index[t], j // B] * B + j % B
        q, out [T,Hq,Dc], q_rope [T,Hq,Dr];  C [slots,1,Dc], R [slots,1,Dr]: one row per position,
        shared by every head, in their kv_dtype as paged_attention reads them (c_scales / r_scales: q8_0's
        half-bit scales, else None; dot4_rows, axpy4_rows);  ml float32 [>= T*Hq, 2]: scratch, each
        head's running (m, l)
    Parallel over (token, part): a token's heads cut into `parts` contiguous ranges (more than one
    when the tokens are fewer than the threads: decode). Positions outermost, four at a time, the
    part's heads inside: each cache row is read once per token and part, and each head's query row
    and accumulator once per four positions. Per head an online softmax in float32 as
    paged_attention's (running max m, sum l, out[t,h] the accumulator, rescaled when m grows), once per
    four scores; past the last position the four repeat row p_t with score -inf (weight 0). The
    arithmetic of a head is the same whatever the parts, so its result never depends on the batch
    (measured, 2-core AMD EPYC host, decode of one token, Hq 16, Dc 512, Dr 64, 4096 positions: 2.2-3.9
    ms; one position at a time 7-8 ms; one (token, head) per iteration as paged_attention, each row
    read per head, 3.4 ms). out must not alias q."""
    T, Hq, Dc = q.shape
    scalef = np.float32(scale)
    for tp in prange(T * parts):
        t = tp // parts
        h0, h1 = thread_rows(tp % parts, parts, Hq)
        table = block_tables[seq_index[t]]
        n = positions[t] + 1
        for h in range(h0, h1):
            acc = out[t, h]
            for d in range(Dc):
                acc[d] = F0
            ml[t * Hq + h, 0] = NEG_INF
            ml[t * Hq + h, 1] = F0
        for j in range(0, n, 4):
            s0, s1 = slot_of(table, j, block_size), slot_of(table, min(j + 1, n - 1), block_size)
            s2, s3 = slot_of(table, min(j + 2, n - 1), block_size), slot_of(table, min(j + 3, n - 1), block_size)
            c0, c1, c2, c3 = c_cache[s0, 0], c_cache[s1, 0], c_cache[s2, 0], c_cache[s3, 0]
            r0, r1, r2, r3 = r_cache[s0, 0], r_cache[s1, 0], r_cache[s2, 0], r_cache[s3, 0]
            for h in range(h0, h1):
                qv, qr, acc = q[t, h], q_rope[t, h], out[t, h]
                a0, a1, a2, a3 = dot4_rows(qv, c0, c1, c2, c3, c_scales, s0, s1, s2, s3, 0)
                b0, b1, b2, b3 = dot4_rows(qr, r0, r1, r2, r3, r_scales, s0, s1, s2, s3, 0)
                a0 = (a0 + b0) * scalef
                a1 = (a1 + b1) * scalef if j + 1 < n else NEG_INF
                a2 = (a2 + b2) * scalef if j + 2 < n else NEG_INF
                a3 = (a3 + b3) * scalef if j + 3 < n else NEG_INF
                m, l, p0, p1, p2, p3 = softmax4(acc, ml[t * Hq + h, 0], ml[t * Hq + h, 1], a0, a1, a2, a3)
                ml[t * Hq + h, 0], ml[t * Hq + h, 1] = m, l
                axpy4_rows(acc, p0, p1, p2, p3, c0, c1, c2, c3, c_scales, s0, s1, s2, s3, 0)
        for h in range(h0, h1):
            acc = out[t, h]
            inv = F1 / ml[t * Hq + h, 1]
            for d in range(Dc):
                acc[d] *= inv
