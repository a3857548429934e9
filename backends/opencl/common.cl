/* Colibri Edge OpenCL kernels: shared definitions (prepended to every .cl file by the host).
 *
 * OpenCL C 1.2 only: no doubles, nothing from 2.x. Every kernel takes its output first. A buffer
 * argument is a pair (pointer, element offset) so that the host's leading-dimension views
 * (`buf[:T]`, `buf[a:b]`) need no sub-buffers (whose offsets would have to be aligned to
 * CL_DEVICE_MEM_BASE_ADDR_ALIGN):
 *     ARG(float, out)   ->  __global float* out_b, const int out_o
 *     BIND(float, out)  ->  __global float* out = out_b + out_o;
 *
 * Compile-time switches (set by the host, see backend.py):
 *   WF16=1               matrices are stored as IEEE half and read with vload_half (no fp16
 *                        arithmetic: a `half*` pointer is legal in OpenCL C 1.2 without cl_khr_fp16)
 *   WBF16=1              matrices are stored as bfloat16 (ushort, the top half of a float32):
 *                        widened in-register, as_float(bits << 16)
 *   WI8=1                matrices are stored as int8 with a float32 scale per row, w[n, k] = q[n, k] * s[n]:
 *                        the dot product runs on q widened to float, the row's scale multiplies the
 *                        sum once (WSCALE); the scale vector is a kernel argument of every matrix
 *   WQ8_0, WQ4_0, WQ4_1, WQ5_0, WQ5_1, WMXFP4, WIQ4_NL (blocks of 32), WNVFP4 (blocks of 64), WQ4_K, WQ5_K,
 *   WQ6_K, WQ2_K, WQ3_K, WIQ4_XS, WTQ1_0, WTQ2_0, and the lattice i-quants WIQ2_XXS, WIQ2_XS, WIQ2_S, WIQ3_XXS,
 *   WIQ3_S, WIQ1_S, WIQ1_M (blocks of 256) = 1
 *                        matrices are ggml blocks (colibri_edge/model/quant.py has the layouts and the NumPy
 *                        definitions), bytes [N, K / WQB * WBYTES]. A row streams as chunks of 32 weights
 *                        decoded in registers (chunk_load): w = m q + add, q the chunk's small integers
 *                        (mxfp4, nvfp4: the doubled E2M1 values; iq4_nl, iq4_xs: the IQ4NL table's; the
 *                        lattice types: their grid's entries, signed; IQ1: 8 grid +- 1, m the scale / 8) as
 *                        eight float4, m one multiplier per 16 weights (two differ in q6_k, q2_k, q3_k,
 *                        nvfp4, iq2_xs, iq2_s, iq1_m), add one offset per 16 weights (q4_1, q5_1: the
 *                        block's min; q4_k, q5_k: -dmin m_s, the same for both halves; q2_k: -dmin (sc >> 4)
 *                        per 16, WADD16).
 *                        A chunk's dot is m0 (q . x)[0:16] + m1 (q . x)[16:32] + add sum(x) (WADD16:
 *                        add0 sum(x[0:16]) + add1 sum(x[16:32])): the integers meet the activations
 *                        unscaled (K % WQB == 0). The lattice grids and KSIGNS are __constant tables
 *                        IQ_GRID and IQ_KSIGNS that the host writes from quant.iq_grid / quant.KSIGNS
 *                        ahead of this file (runtime.py lattice_tables), each under its formats' switches
 *   WACT8=1              (block formats only) activations are int8 too, llama.cpp's arithmetic: the host
 *                        quantises each activation row per block of 32 or 256 (dense.cl quantize_act, quant.py
 *                        quantize_activations) into packed blocks of 40 bytes, q:i8[32] | dx:f32 | xs:f32
 *                        (xs = dx sum q), 10 floats a block, so a row of K is XLD(K) = K / 32 * 10 floats and
 *                        every kernel keeps its float* activation arguments. A chunk's dot is then
 *                        dx (m0 idot(q, qx)[0:16] + m1 idot(q, qx)[16:32]) + add xs: integer products
 *                        (WADD16: + dx (add0 sum(qx[0:16]) + add1 sum(qx[16:32])), the sums in integers)
 *   COLIBRI_IDOT=0|1|2   the 4 x int8 dot behind IDOT4: 1 cl_khr_integer_dot_product's dot(char4, char4)
 *                        (built with -cl-std=CL3.0, where its feature macro declares it; the portable one
 *                        otherwise), 2 cl_arm_integer_dot_product_int8's arm_dot, 0 a portable definition
 *                        of the same (PoCL and Oclgrind have neither); the host picks it from the device's
 *                        extensions
 *   COLIBRI_HALF_MATH=1  only when the device reports cl_khr_fp16 and COLIBRI_DISABLE_FP16 is unset:
 *                        weight x activation products in half, accumulation in float
 * Shared with the host, defined once there (runtime.py DEFINES) and passed to every build:
 *   ROWS_PER_ITEM        tokens (rows) one work-item of matmul4 / ffn_gate_up computes: the float4
 *                        lanes of dotw4, so it must be 4
 */
#if ROWS_PER_ITEM != 4
#error "ROWS_PER_ITEM comes from runtime.py (-DROWS_PER_ITEM=4): the float4 lanes of dotw4"
#endif
#ifndef WF16
#define WF16 0
#endif
#ifndef WBF16
#define WBF16 0
#endif
#ifndef WI8
#define WI8 0
#endif
#ifndef WQ8_0
#define WQ8_0 0
#endif
#ifndef WQ4_0
#define WQ4_0 0
#endif
#ifndef WQ4_1
#define WQ4_1 0
#endif
#ifndef WQ5_0
#define WQ5_0 0
#endif
#ifndef WQ5_1
#define WQ5_1 0
#endif
#ifndef WMXFP4
#define WMXFP4 0
#endif
#ifndef WQ4_K
#define WQ4_K 0
#endif
#ifndef WQ5_K
#define WQ5_K 0
#endif
#ifndef WQ6_K
#define WQ6_K 0
#endif
#ifndef WQ2_K
#define WQ2_K 0
#endif
#ifndef WQ3_K
#define WQ3_K 0
#endif
#ifndef WIQ4_NL
#define WIQ4_NL 0
#endif
#ifndef WIQ4_XS
#define WIQ4_XS 0
#endif
#ifndef WTQ1_0
#define WTQ1_0 0
#endif
#ifndef WTQ2_0
#define WTQ2_0 0
#endif
#ifndef WNVFP4
#define WNVFP4 0
#endif
#ifndef WIQ2_XXS
#define WIQ2_XXS 0
#endif
#ifndef WIQ2_XS
#define WIQ2_XS 0
#endif
#ifndef WIQ2_S
#define WIQ2_S 0
#endif
#ifndef WIQ3_XXS
#define WIQ3_XXS 0
#endif
#ifndef WIQ3_S
#define WIQ3_S 0
#endif
#ifndef WIQ1_S
#define WIQ1_S 0
#endif
#ifndef WIQ1_M
#define WIQ1_M 0
#endif
#if WF16 + WBF16 + WI8 + WQ8_0 + WQ4_0 + WQ4_1 + WQ5_0 + WQ5_1 + WMXFP4 + WQ4_K + WQ5_K + WQ6_K + WQ2_K + WQ3_K \
    + WIQ4_NL + WIQ4_XS + WTQ1_0 + WTQ2_0 + WNVFP4 + WIQ2_XXS + WIQ2_XS + WIQ2_S + WIQ3_XXS + WIQ3_S + WIQ1_S \
    + WIQ1_M > 1
#error "the weight type switches (WF16, WBF16, WI8, WQ*, WMXFP4, WIQ*, WTQ*, WNVFP4) are exclusive"
#endif
#define WLATTICE (WIQ2_XXS || WIQ2_XS || WIQ2_S || WIQ3_XXS || WIQ3_S || WIQ1_S || WIQ1_M)
#define WBLOCK (WQ8_0 || WQ4_0 || WQ4_1 || WQ5_0 || WQ5_1 || WMXFP4 || WQ4_K || WQ5_K || WQ6_K || WQ2_K || WQ3_K \
                || WIQ4_NL || WIQ4_XS || WTQ1_0 || WTQ2_0 || WNVFP4 || WLATTICE)
#ifndef WACT8
#define WACT8 0
#endif
#if WACT8 && !WBLOCK
#error "WACT8 (int8 activations) goes with a block format"
#endif
#define XLD(K) (WACT8 ? (K) / 32 * 10 : (K))     /* floats in an activation row of K values */
#ifndef COLIBRI_IDOT
#define COLIBRI_IDOT 0
#endif
#if COLIBRI_IDOT == 1 && defined(__opencl_c_integer_dot_product_input_4x8bit)
#define IDOT4(a, b) dot((a), (b))
#elif COLIBRI_IDOT == 2
#pragma OPENCL EXTENSION cl_arm_integer_dot_product_int8 : enable
#define IDOT4(a, b) arm_dot((a), (b))
#else
inline int idot4(const char4 a, const char4 b)  /* the extensions' 4 x int8 dot, portably (scalar: */
{                                               /* convert_int4(char4) crashes Oclgrind 21.10's --uninitialized) */
    return ((int)a.x * (int)b.x + (int)a.y * (int)b.y) + ((int)a.z * (int)b.z + (int)a.w * (int)b.w);
}
#define IDOT4(a, b) idot4((a), (b))
#if defined(COLIBRI_REQUIRE_IDOT) && COLIBRI_IDOT      /* the offline check: the extension's dot, not this */
#error "COLIBRI_IDOT asks for an integer dot extension this compiler does not declare"
#endif
#endif
#ifndef COLIBRI_HALF_MATH
#define COLIBRI_HALF_MATH 0
#endif
#if COLIBRI_HALF_MATH && !WF16
#error "COLIBRI_HALF_MATH needs WF16 (half arithmetic is only used on half weights)"
#endif
#if COLIBRI_HALF_MATH
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#endif

#define ARG(T, n) __global T* n##_b, const int n##_o
#define CARG(T, n) __global const T* n##_b, const int n##_o
#define BIND(T, n) __global T* n = n##_b + n##_o
#define CBIND(T, n) __global const T* n = n##_b + n##_o

#if WF16
#define WTYPE half
#define LDW(p, i) vload_half((i), (p))
#elif WBF16
#define WTYPE ushort
#define LDW(p, i) as_float((uint)(p)[i] << 16)
#elif WI8
#define WTYPE char
#define LDW(p, i) ((float)(p)[i])
#elif WBLOCK
#define WTYPE uchar
#else
#define WTYPE float
#define LDW(p, i) ((p)[i])
#endif

#if WF16
#define LDW4(p, i) vload_half4(0, (p) + (i))
#elif WBF16
#define LDW4(p, i) as_float4(convert_uint4(vload4(0, (p) + (i))) << 16)
#elif WI8
#define LDW4(p, i) convert_float4(vload4(0, (p) + (i)))
#else
#define LDW4(p, i) vload4(0, (p) + (i))
#endif

/* WROW(w, n, K): row n of a matrix with K columns; LDWR(row, k): its element k as float */
#if WBLOCK
#if WQ8_0
#define WQB 32
#define WBYTES 34
#elif WQ4_0
#define WQB 32
#define WBYTES 18
#elif WQ4_1
#define WQB 32
#define WBYTES 20
#elif WQ5_0
#define WQB 32
#define WBYTES 22
#elif WQ5_1
#define WQB 32
#define WBYTES 24
#elif WMXFP4
#define WQB 32
#define WBYTES 17
#elif WQ4_K
#define WQB 256
#define WBYTES 144
#elif WQ5_K
#define WQB 256
#define WBYTES 176
#elif WQ6_K
#define WQB 256
#define WBYTES 210
#elif WQ2_K
#define WQB 256
#define WBYTES 84
#elif WQ3_K
#define WQB 256
#define WBYTES 110
#elif WIQ4_NL
#define WQB 32
#define WBYTES 18
#elif WIQ4_XS
#define WQB 256
#define WBYTES 136
#elif WTQ1_0
#define WQB 256
#define WBYTES 54
#elif WTQ2_0
#define WQB 256
#define WBYTES 66
#elif WIQ2_XXS
#define WQB 256
#define WBYTES 66
#elif WIQ2_XS
#define WQB 256
#define WBYTES 74
#elif WIQ2_S
#define WQB 256
#define WBYTES 82
#elif WIQ3_XXS
#define WQB 256
#define WBYTES 98
#elif WIQ3_S
#define WQB 256
#define WBYTES 110
#elif WIQ1_S
#define WQB 256
#define WBYTES 50
#elif WIQ1_M
#define WQB 256
#define WBYTES 56
#else
#define WQB 64
#define WBYTES 36
#endif
#define WHASADD (WQ4_1 || WQ5_1 || WQ4_K || WQ5_K)     /* chunks with an additive term, one a chunk (add.x) */
#define WADD16 WQ2_K                                   /* chunks with an additive term per 16 (add.x, add.y) */
#define WROW(w, n, K) ((w) + (size_t)(n) * ((K) / WQB) * WBYTES)

inline float ldh(__global const uchar* p)              /* a little-endian f16 at p (2-byte aligned) */
{
    return vload_half(0, (__global const half*)p);
}

#if WMXFP4 || WNVFP4
/* E2M1 values, doubled (quant.py E2M1): integers; the block's scale (mxfp4: 2^(e - 128), nvfp4: UE4M3 / 2)
 * halves them back */
__constant char E2M1X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline char4 e2m1x2(const uchar4 n)
{
    return (char4)(E2M1X2[n.x], E2M1X2[n.y], E2M1X2[n.z], E2M1X2[n.w]);
}
#endif
#if WNVFP4
/* a UE4M3 scale byte -> its value / 2 (quant.py ue4m3_half): exponent e > 0 is the float with exponent
 * field e + 119 and mantissa m << 20, e = 0 is m 2^-10; 0 and 0x7f are 0. Every value is exact */
inline float ue4m3_half(const uint x)
{
    const uint e = (x >> 3) & 15u, mt = x & 7u;
    const float v = e == 0u ? (float)mt * 0.0009765625f : as_float(((e + 119u) << 23) | (mt << 20));
    return x == 0x7fu ? 0.0f : v;
}
#endif
#if WIQ4_NL || WIQ4_XS
/* kvalues_iq4nl (quant.py IQ4NL): the non-linear 4-bit code's values, all chars */
__constant char IQ4NLV[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
inline char4 iq4nl(const uchar4 n)
{
    return (char4)(IQ4NLV[n.x], IQ4NLV[n.y], IQ4NLV[n.z], IQ4NLV[n.w]);
}
#endif
#if WTQ1_0
/* trit n of four tq1_0 bytes b, minus 1, for p = 3^n: ((b p mod 256) 3) >> 8, - 1 */
inline char4 trits4(const uchar4 b, const uint p)
{
    const uint4 v = (convert_uint4(b) * p) & 255u;
    return convert_char4(as_int4((v * 3u) >> 8) - 1);
}
#endif

#if WLATTICE
#if !defined(IQ_GRID_ROWS)
#error "the lattice formats' tables come from the host (runtime.py lattice_tables): build kernel_source's text"
#endif
/* four grid values v with the sign bits s (bit j set: value j negated, j < 4): (v ^ m) - m, m = 0 or -1 */
inline char4 iq_sign4(const char4 v, const uint s)
{
    const char4 m = convert_char4(-as_int4(((uint4)(s) >> (uint4)(0u, 1u, 2u, 3u)) & 1u));
    return (v ^ m) - m;
}
/* an 8-wide grid entry as char8 (IQ2, IQ1: a ulong of 8 bytes, the first value the lowest byte) */
#define IQ_ROW8(idx) as_char8(IQ_GRID[idx])
#endif
#if WIQ1_M
/* the f16 with bits h (iq1_m's d, assembled from nibbles) as a float, exactly */
inline float f16_bits(const uint h)
{
    const uint e = (h >> 10) & 31u, mt = h & 1023u;
    const float v = e == 0u ? (float)mt * 5.9604644775390625e-8f                        /* mt 2^-24 */
                  : as_float((e == 31u ? 0x7f800000u : (e + 112u) << 23) | (mt << 13));
    return (h & 0x8000u) ? -v : v;
}
#endif

/* Chunk c (32 weights, c < WQB / 32) of the block at blk: wq[j] = the small integers q of weights
 * 4j .. 4j+3, and w = m.x q + add.x for weights 0..15, m.y q + add.y for 16..31 (the format table in
 * quant.py; add.x == add.y but in q2_k, WADD16); every format's q fits in a char (-32 .. 31; iq4_nl and
 * iq4_xs: -127 .. 113; iq2_*: -43 .. 43; iq3_*: -62 .. 62; iq1_*: -9 .. 9) */
inline void chunk_load_q(__global const uchar* blk, const int c, char4* wq, float2* m, float2* add)
{
#if WQ8_0                                   /* d | q:i8[32]                      w = d q */
    *m = (float2)(ldh(blk));
    *add = (float2)(0.0f);
    __global const char* q = (__global const char*)(blk + 2);
    for (int j = 0; j < 8; ++j)
        wq[j] = vload4(j, q);
#elif WQ4_0 || WQ4_1                        /* d (| min) | qs[16]                w = d nib (- 8 d | + min) */
    *m = (float2)(ldh(blk));
#if WQ4_1
    *add = (float2)(ldh(blk + 2));
    __global const uchar* qs = blk + 4;
    const char sub = 0;
#else
    *add = (float2)(0.0f);
    __global const uchar* qs = blk + 2;
    const char sub = 8;
#endif
    for (int j = 0; j < 4; ++j) {
        const uchar4 p = vload4(j, qs);
        wq[j] = as_char4(p & (uchar4)(15)) - (char4)(sub);          /* weights 4j .. 4j+3 */
        wq[j + 4] = as_char4(p >> (uchar4)(4)) - (char4)(sub);      /* weights 16+4j .. */
    }
#elif WQ5_0 || WQ5_1                        /* d (| min) | qh:u32 | qs[16]      w = d (nib | hb << 4) (- 16 d | + min) */
    *m = (float2)(ldh(blk));
#if WQ5_1
    *add = (float2)(ldh(blk + 2));
    __global const uchar* qhp = blk + 4;
    const int sub = 0;
#else
    *add = (float2)(0.0f);
    __global const uchar* qhp = blk + 2;
    const int sub = 16;
#endif
    const uint qh = (uint)qhp[0] | ((uint)qhp[1] << 8) | ((uint)qhp[2] << 16) | ((uint)qhp[3] << 24);
    for (int j = 0; j < 4; ++j) {
        const uint4 p = convert_uint4(vload4(j, qhp + 4));
        const uint4 bit = (uint4)(4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3);
        wq[j] = convert_char4(as_int4((p & 15u) | (((uint4)(qh) >> bit) & 1u) << 4) - sub);
        wq[j + 4] = convert_char4(as_int4((p >> 4) | (((uint4)(qh) >> (bit + 16u)) & 1u) << 4) - sub);
    }
#elif WMXFP4                                /* e:u8 | qs[16]                    w = 2^(e-128) E2M1x2[nib] */
    const uint e = blk[0];
    *m = (float2)(as_float(e < 2 ? (0x00200000u << e) : ((e - 1u) << 23)));
    *add = (float2)(0.0f);
    for (int j = 0; j < 4; ++j) {
        const uchar4 p = vload4(j, blk + 1);
        wq[j] = e2m1x2(p & (uchar4)(15));
        wq[j + 4] = e2m1x2(p >> (uchar4)(4));
    }
#elif WQ4_K || WQ5_K                        /* d | dmin | scales[12] | (qh[32] |) qs[128]   chunk = sub-block c */
    const float d = ldh(blk), dmin = ldh(blk + 2);
    __global const uchar* sc = blk + 4;
    int s, mn;                              /* get_scale_min_k4 */
    if (c < 4) {
        s = sc[c] & 63;
        mn = sc[c + 4] & 63;
    } else {
        s = (sc[c + 4] & 15) | ((sc[c - 4] >> 6) << 4);
        mn = (sc[c + 4] >> 4) | ((sc[c] >> 6) << 4);
    }
    *m = (float2)(d * (float)s);
    *add = (float2)(-dmin * (float)mn);
#if WQ5_K
    __global const uchar* qh = blk + 16;
    __global const uchar* qs = blk + 48 + 32 * (c >> 1);
#else
    __global const uchar* qs = blk + 16 + 32 * (c >> 1);
#endif
    const uint sh = (c & 1) ? 4u : 0u;      /* even sub-blocks: low nibbles of their 32 bytes */
    for (int j = 0; j < 8; ++j) {
        uint4 q = (convert_uint4(vload4(j, qs)) >> sh) & 15u;
#if WQ5_K
        q |= ((convert_uint4(vload4(j, qh)) >> (uint)c) & 1u) << 4;
#endif
        wq[j] = convert_char4(q);
    }
#elif WQ6_K                                 /* q6_k: ql[128] | qh[64] | scales:i8[16] | d;  chunk = half h, part p */
    const int h = c >> 2, p = c & 3;
    const float d = ldh(blk + 208);
    __global const char* scl = (__global const char*)(blk + 192);
    *m = (float2)(d * (float)scl[8 * h + 2 * p], d * (float)scl[8 * h + 2 * p + 1]);
    *add = (float2)(0.0f);
    __global const uchar* ql = blk + 64 * h + 32 * (p & 1);
    __global const uchar* qh = blk + 128 + 32 * h;
    const uint shl = 4u * (uint)(p >> 1), shh = 2u * (uint)p;
    for (int j = 0; j < 8; ++j) {
        const uint4 lo = (convert_uint4(vload4(j, ql)) >> shl) & 15u;
        const uint4 hi = (convert_uint4(vload4(j, qh)) >> shh) & 3u;
        wq[j] = convert_char4(as_int4(lo | (hi << 4)) - 32);
    }
#elif WQ2_K || WQ3_K || WTQ2_0              /* 2-bit fields: chunk = half h, part p; sub-blocks 2c, 2c + 1 of 16 */
    const int h = c >> 2, p = c & 3;
#if WQ2_K                                   /* scales[16] | qs[64] | d | dmin    w = d (sc & 15) q - dmin (sc >> 4) */
    const float d = ldh(blk + 80), dmin = ldh(blk + 82);
    const uint s0 = blk[2 * c], s1 = blk[2 * c + 1];
    *m = (float2)(d * (float)(s0 & 15u), d * (float)(s1 & 15u));
    *add = (float2)(-dmin * (float)(s0 >> 4), -dmin * (float)(s1 >> 4));
    __global const uchar* qs = blk + 16 + 32 * h;
#elif WQ3_K                                 /* hmask[32] | qs[64] | scales[12] | d  w = d (sc6 - 32) (q - 4 (1 - hb)) */
    const float d = ldh(blk + 108);
    /* sub-blocks s = 2c, 2c + 1: low 4 bits (scales[s % 8] >> 4 (s / 8)) & 15, high 2 bits
     * (scales[8 + s % 4] >> 2 (s / 4)) & 3; for s = 2c + k: s % 8 = 2 (c & 3) + k, s / 8 = c >> 2,
     * s % 4 = 2 (c & 1) + k, s / 4 = c >> 1 */
    const uint lsh = 4u * ((uint)c >> 2), hsh = 2u * ((uint)c >> 1);
    const uchar2 lo = vload2(c & 3, blk + 96), hi = vload2(c & 1, blk + 104);
    const int2 sc6 = as_int2(((convert_uint2(lo) >> lsh) & 15u) | (((convert_uint2(hi) >> hsh) & 3u) << 4)) - 32;
    *m = (float2)(d * (float)sc6.x, d * (float)sc6.y);
    *add = (float2)(0.0f);
    __global const uchar* qs = blk + 32 + 32 * h;
#else                                       /* tq2_0: qs[64] | d                  w = d (q - 1) */
    *m = (float2)(ldh(blk + 64));
    *add = (float2)(0.0f);
    __global const uchar* qs = blk + 32 * h;
#endif
    const uint sh = 2u * (uint)p;
    for (int j = 0; j < 8; ++j) {
        const int4 q = as_int4((convert_uint4(vload4(j, qs)) >> sh) & 3u);
#if WQ2_K
        wq[j] = convert_char4(q);
#elif WQ3_K                                 /* bit 4h + p of hmask[j] set: no -4 */
        const int4 hb = as_int4((convert_uint4(vload4(j, blk)) >> (uint)(4 * h + p)) & 1u);
        wq[j] = convert_char4(q - ((1 - hb) << 2));
#else
        wq[j] = convert_char4(q - 1);
#endif
    }
#elif WIQ4_NL                               /* d | qs[16]                         w = d IQ4NL[nib] */
    *m = (float2)(ldh(blk));
    *add = (float2)(0.0f);
    for (int j = 0; j < 4; ++j) {
        const uchar4 p = vload4(j, blk + 2);
        wq[j] = iq4nl(p & (uchar4)(15));
        wq[j + 4] = iq4nl(p >> (uchar4)(4));
    }
#elif WIQ4_XS                               /* d | scales_h:u16 | scales_l[4] | qs[128]; chunk = sub-block c */
    const uint sh16 = (uint)blk[2] | ((uint)blk[3] << 8);
    const int sc = (int)((((uint)blk[4 + (c >> 1)] >> (4u * (uint)(c & 1))) & 15u) |
                         (((sh16 >> (2u * (uint)c)) & 3u) << 4));
    *m = (float2)(ldh(blk) * (float)(sc - 32));
    *add = (float2)(0.0f);
    __global const uchar* qs = blk + 8 + 16 * c;    /* low nibbles the first 16 weights */
    for (int j = 0; j < 4; ++j) {
        const uchar4 p = vload4(j, qs);
        wq[j] = iq4nl(p & (uchar4)(15));
        wq[j + 4] = iq4nl(p >> (uchar4)(4));
    }
#elif WTQ1_0                                /* qs[48] | qh[4] | d;  w = d (trit - 1), five trits a byte */
    *m = (float2)(ldh(blk + 52));
    *add = (float2)(0.0f);
    if (c < 5) {                            /* weights 32 c + j: trit c of qs[j] */
        uint p = 1u;
        for (int n = 0; n < c; ++n)
            p *= 3u;
        for (int j = 0; j < 8; ++j)
            wq[j] = trits4(vload4(j, blk), p);
    } else if (c < 7) {                     /* 160 + 16 n + j: trit n of qs[32 + j]; this chunk: n = 2 (c - 5), + 1 */
        const uint p = c == 5 ? 1u : 9u;
        for (int j = 0; j < 4; ++j) {
            wq[j] = trits4(vload4(j, blk + 32), p);
            wq[j + 4] = trits4(vload4(j, blk + 32), 3u * p);
        }
    } else {                                /* trit 4 of qs[32 + j]; then 240 + 4 n + j: trit n of qh[j] */
        const uchar4 qh = vload4(0, blk + 48);
        for (int j = 0; j < 4; ++j)
            wq[j] = trits4(vload4(j, blk + 32), 81u);
        wq[4] = trits4(qh, 1u);
        wq[5] = trits4(qh, 3u);
        wq[6] = trits4(qh, 9u);
        wq[7] = trits4(qh, 27u);
    }
#elif WIQ2_XXS || WIQ3_XXS                  /* chunk = sub-block c: w = d (0.5 + s) / 4 (iq3_xxs: / 2) grid sign */
#if WIQ2_XXS                                /* d | (grid:u8[4] | signs:u32)[8] */
    __global const uchar* qs = blk + 2 + 8 * c;
    __global const uchar* sp = qs + 4;
#else                                       /* d | qs[64] | (signs, s):u32[8] */
    __global const uchar* qs = blk + 2 + 8 * c;
    __global const uchar* sp = blk + 66 + 4 * c;
#endif
    /* four 7-bit sign indices (bits 0, 7, 14, 21: KSIGNS adds the parity bit), s in bits 28..31 */
    const uint sx = (uint)sp[0] | ((uint)sp[1] << 8) | ((uint)sp[2] << 16) | ((uint)sp[3] << 24);
    *m = (float2)(ldh(blk) * (0.5f + (float)(sx >> 28)) * (WIQ2_XXS ? 0.25f : 0.5f));
    *add = (float2)(0.0f);
    for (int l = 0; l < 4; ++l) {           /* group l of 8 weights: wq[2l], wq[2l + 1] */
        const uint s = IQ_KSIGNS[(sx >> (7u * (uint)l)) & 127u];
#if WIQ2_XXS
        const char8 v = IQ_ROW8(qs[l]);
        wq[2 * l] = iq_sign4(v.lo, s);
        wq[2 * l + 1] = iq_sign4(v.hi, s >> 4);
#else                                       /* two grid entries of 4 */
        wq[2 * l] = iq_sign4(as_char4(IQ_GRID[qs[2 * l]]), s);
        wq[2 * l + 1] = iq_sign4(as_char4(IQ_GRID[qs[2 * l + 1]]), s >> 4);
#endif
    }
#elif WIQ2_XS || WIQ2_S                     /* chunk = groups 4c .. 4c + 3; w = d (0.5 + s) / 4 grid sign, s per 16 */
    const float d = ldh(blk);
    const uint sc = blk[WBYTES - 8 + c];    /* the low nibble weights 0..15, the high 16..31 */
    *m = (float2)(d * (0.5f + (float)(sc & 15u)) * 0.25f, d * (0.5f + (float)(sc >> 4)) * 0.25f);
    *add = (float2)(0.0f);
    for (int l = 0; l < 4; ++l) {
        const int i = 4 * c + l;
#if WIQ2_XS                                 /* d | qs:u16[32] | scales[8]: grid[q & 511], KSIGNS[q >> 9] */
        const uint q = (uint)blk[2 + 2 * i] | ((uint)blk[3 + 2 * i] << 8);
        const uint idx = q & 511u, s = IQ_KSIGNS[q >> 9];
#else                                       /* d | qs[32] | signs[32] | qh[8] | scales[8]: 2 index bits from qh */
        const uint idx = (uint)blk[2 + i] | ((((uint)blk[66 + c] >> (2u * (uint)l)) & 3u) << 8);
        const uint s = blk[34 + i];
#endif
        const char8 v = IQ_ROW8(idx);
        wq[2 * l] = iq_sign4(v.lo, s);
        wq[2 * l + 1] = iq_sign4(v.hi, s >> 4);
    }
#elif WIQ3_S                                /* d | qs[64] | qh[8] | signs[32] | scales[4]; chunk = sub-block c */
    const uint qh = blk[66 + c];            /* bit k: the ninth index bit of grid entry k */
    const uint sc = ((uint)blk[106 + (c >> 1)] >> (4u * (uint)(c & 1))) & 15u;
    *m = (float2)(ldh(blk) * (float)(1u + 2u * sc));
    *add = (float2)(0.0f);
    __global const uchar* qs = blk + 2 + 8 * c;
    for (int l = 0; l < 4; ++l) {
        const uint s = blk[74 + 4 * c + l], k = 2u * (uint)l;
        wq[2 * l] = iq_sign4(as_char4(IQ_GRID[(uint)qs[k] | (((qh >> k) & 1u) << 8)]), s);
        wq[2 * l + 1] = iq_sign4(as_char4(IQ_GRID[(uint)qs[k + 1] | (((qh >> (k + 1u)) & 1u) << 8)]), s >> 4);
    }
#elif WIQ1_S || WIQ1_M                      /* w = d (2 s + 1) (grid +- 1/8) = m (8 grid +- 1), m = d (2 s + 1) / 8 */
#if WIQ1_S                                  /* d | qs[32] | qh:u16[8]; chunk = sub-block c, its qh: index bits */
                                            /* 3l .. 3l + 2 of group l, s bits 12..14, the delta's sign bit 15 */
    const uint qh = (uint)blk[34 + 2 * c] | ((uint)blk[35 + 2 * c] << 8);
    *m = (float2)(ldh(blk) * (float)(2u * ((qh >> 12) & 7u) + 1u) * 0.125f);
    __global const uchar* qs = blk + 2 + 4 * c;
#else                                       /* qs[32] | qh[16] | scales:u16[4]; d's 16 bits the scales' top nibbles */
    const uint s0 = (uint)blk[48] | ((uint)blk[49] << 8), s1 = (uint)blk[50] | ((uint)blk[51] << 8);
    const uint s2 = (uint)blk[52] | ((uint)blk[53] << 8), s3 = (uint)blk[54] | ((uint)blk[55] << 8);
    const float d = f16_bits((s0 >> 12) | ((s1 >> 12) << 4) | ((s2 >> 12) << 8) | ((s3 >> 12) << 12));
    /* per 16 k = 2c, 2c + 1: 3 bits at 3 (k % 4) of scales[k / 4] */
    const uint sw = (uint)blk[48 + 2 * (c >> 1)] | ((uint)blk[49 + 2 * (c >> 1)] << 8), sh = 6u * (uint)(c & 1);
    *m = (float2)(d * (float)(2u * ((sw >> sh) & 7u) + 1u) * 0.125f,
                  d * (float)(2u * ((sw >> (sh + 3u)) & 7u) + 1u) * 0.125f);
    __global const uchar* qs = blk + 4 * c;
#endif
    *add = (float2)(0.0f);
    for (int l = 0; l < 4; ++l) {
#if WIQ1_S
        const uint idx = (uint)qs[l] | (((qh >> (3u * (uint)l)) & 7u) << 8);
        const char dl = (qh & 0x8000u) ? (char)(-1) : (char)(1);
#else                                       /* group i = 4c + l: nibble i of qh[16]: 3 index bits, the sign */
        const uint nib = ((uint)blk[32 + 2 * c + (l >> 1)] >> (4u * (uint)(l & 1))) & 15u;
        const uint idx = (uint)qs[l] | ((nib & 7u) << 8);
        const char dl = (nib & 8u) ? (char)(-1) : (char)(1);
#endif
        const char8 v = IQ_ROW8(idx) * (char8)(8) + (char8)(dl);
        wq[2 * l] = v.lo;
        wq[2 * l + 1] = v.hi;
    }
#else                                       /* nvfp4: d:ue4m3[4] | qs[32]; chunk = sub-blocks 2c, 2c + 1 of 16 */
    *m = (float2)(ue4m3_half(blk[2 * c]), ue4m3_half(blk[2 * c + 1]));
    *add = (float2)(0.0f);
    __global const uchar* qs = blk + 4 + 16 * c;    /* a sub-block's 8 bytes: low nibbles its first 8 weights */
    for (int k = 0; k < 2; ++k) {
        const uchar4 a = vload4(2 * k, qs), b = vload4(2 * k + 1, qs);
        wq[4 * k] = e2m1x2(a & (uchar4)(15));
        wq[4 * k + 1] = e2m1x2(b & (uchar4)(15));
        wq[4 * k + 2] = e2m1x2(a >> (uchar4)(4));
        wq[4 * k + 3] = e2m1x2(b >> (uchar4)(4));
    }
#endif
}

/* the same chunk as floats: wq[j] = q of weights 4j .. 4j+3 */
inline void chunk_load(__global const uchar* blk, const int c, float4* wq, float2* m, float2* add)
{
    char4 q[8];
    chunk_load_q(blk, c, q, m, add);
    for (int j = 0; j < 8; ++j)
        wq[j] = convert_float4(q[j]);
}

inline float ldw_block(__global const uchar* row, const int k)
{
    float4 wq[8];
    float2 m, add;
    const int i = k % 32;
    chunk_load(row + (size_t)(k / WQB) * WBYTES, (k % WQB) / 32, wq, &m, &add);
    float q = 0.0f;                          /* wq's element i, by a one-hot dot: no dynamic index */
    for (int j = 0; j < 8; ++j)
        q += dot(wq[j], convert_float4((int4)(4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3) == (int4)(i)) * -1.0f);
    return (i < 16 ? m.x : m.y) * q + (i < 16 ? add.x : add.y);
}
#define LDWR(row, k) ldw_block((row), (k))
#else
#define WROW(w, n, K) ((w) + (size_t)(n) * (K))
#define LDWR(row, k) LDW((row), (k))
#endif

/* the row scale of an int8 matrix (s: its float32 scales [N]); 1 for the float types, s unread */
#if WI8
#define WSCALE(s, n) ((s)[n])
#else
#define WSCALE(s, n) 1.0f
#endif

#if COLIBRI_HALF_MATH
/* w . x with half products and float accumulation (2x the arithmetic rate on Mali) */
inline float hdot4(const half4 w, const float4 x)
{
    const half4 pr = w * convert_half4(x);
    return ((float)pr.x + (float)pr.y) + ((float)pr.z + (float)pr.w);
}
#define WVEC4 half4
#define WLOAD4(p, i) vload4(0, (p) + (i))
#define WDOT4(wv, xv) hdot4((wv), (xv))
#else
#define WVEC4 float4
#define WLOAD4(p, i) LDW4((p), (i))
#define WDOT4(wv, xv) dot((wv), (xv))
#endif

#if WBLOCK && WACT8

/* sum_k w[k] * x[k], k < K: w a row of blocks, x a row of packed int8 activation blocks (XLD) */
inline float dotw(__global const uchar* w, __global const float* x, const int K)
{
    float acc = 0.0f;
    char4 wq[8];
    float2 m, add;
    for (int c = 0; c < K / 32; ++c) {
        chunk_load_q(w + (size_t)(c / (WQB / 32)) * WBYTES, c % (WQB / 32), wq, &m, &add);
        __global const float* xb = x + 10 * c;
        __global const char* xq = (__global const char*)xb;
        int s0 = 0, s1 = 0;
        for (int j = 0; j < 4; ++j) {
            s0 += IDOT4(wq[j], vload4(j, xq));
            s1 += IDOT4(wq[j + 4], vload4(j + 4, xq));
        }
        acc += xb[8] * (m.x * (float)s0 + m.y * (float)s1);
#if WHASADD
        acc += add.x * xb[9];
#elif WADD16                                /* the activations' sums per 16, in integers, times dx */
        const char4 one = (char4)(1);
        int t0 = 0, t1 = 0;
        for (int j = 0; j < 4; ++j) {
            t0 += IDOT4(one, vload4(j, xq));
            t1 += IDOT4(one, vload4(j + 4, xq));
        }
        acc += xb[8] * (add.x * (float)t0 + add.y * (float)t1);
#endif
    }
    return acc;
}

/* the same row of blocks against four packed activation rows: each chunk decoded once */
inline float4 dotw4(__global const uchar* w, __global const float* x0, __global const float* x1,
                    __global const float* x2, __global const float* x3, const int K)
{
    float4 acc = (float4)(0.0f);
    char4 wq[8];
    float2 m, add;
    for (int c = 0; c < K / 32; ++c) {
        chunk_load_q(w + (size_t)(c / (WQB / 32)) * WBYTES, c % (WQB / 32), wq, &m, &add);
        const int o = 10 * c;
        __global const char* q0 = (__global const char*)(x0 + o);
        __global const char* q1 = (__global const char*)(x1 + o);
        __global const char* q2 = (__global const char*)(x2 + o);
        __global const char* q3 = (__global const char*)(x3 + o);
        int4 s0 = (int4)(0), s1 = (int4)(0);
        for (int j = 0; j < 4; ++j) {
            s0 += (int4)(IDOT4(wq[j], vload4(j, q0)), IDOT4(wq[j], vload4(j, q1)), IDOT4(wq[j], vload4(j, q2)),
                         IDOT4(wq[j], vload4(j, q3)));
            s1 += (int4)(IDOT4(wq[j + 4], vload4(j + 4, q0)), IDOT4(wq[j + 4], vload4(j + 4, q1)),
                         IDOT4(wq[j + 4], vload4(j + 4, q2)), IDOT4(wq[j + 4], vload4(j + 4, q3)));
        }
        const float4 dx = (float4)(x0[o + 8], x1[o + 8], x2[o + 8], x3[o + 8]);
        acc += dx * (m.x * convert_float4(s0) + m.y * convert_float4(s1));
#if WHASADD
        acc += add.x * (float4)(x0[o + 9], x1[o + 9], x2[o + 9], x3[o + 9]);
#elif WADD16
        const char4 one = (char4)(1);
        int4 t0 = (int4)(0), t1 = (int4)(0);
        for (int j = 0; j < 4; ++j) {
            t0 += (int4)(IDOT4(one, vload4(j, q0)), IDOT4(one, vload4(j, q1)), IDOT4(one, vload4(j, q2)),
                         IDOT4(one, vload4(j, q3)));
            t1 += (int4)(IDOT4(one, vload4(j + 4, q0)), IDOT4(one, vload4(j + 4, q1)), IDOT4(one, vload4(j + 4, q2)),
                         IDOT4(one, vload4(j + 4, q3)));
        }
        acc += dx * (add.x * convert_float4(t0) + add.y * convert_float4(t1));
#endif
    }
    return acc;
}

#elif WBLOCK

/* sum_k w[k] * x[k], k < K (w: a row of blocks) */
inline float dotw(__global const uchar* w, __global const float* x, const int K)
{
    float acc = 0.0f;
    float4 wq[8];
    float2 m, add;
    for (int c = 0; c < K / 32; ++c) {
        chunk_load(w + (size_t)(c / (WQB / 32)) * WBYTES, c % (WQB / 32), wq, &m, &add);
        __global const float* xc = x + 32 * c;
        float s0 = 0.0f, s1 = 0.0f;
        for (int j = 0; j < 4; ++j) {
            s0 += dot(wq[j], vload4(j, xc));
            s1 += dot(wq[j + 4], vload4(j + 4, xc));
        }
        acc += m.x * s0 + m.y * s1;
#if WHASADD
        float sx = 0.0f;
        for (int j = 0; j < 8; ++j)
            sx += dot(vload4(j, xc), (float4)(1.0f));
        acc += add.x * sx;
#elif WADD16
        float sx0 = 0.0f, sx1 = 0.0f;
        for (int j = 0; j < 4; ++j) {
            sx0 += dot(vload4(j, xc), (float4)(1.0f));
            sx1 += dot(vload4(j + 4, xc), (float4)(1.0f));
        }
        acc += add.x * sx0 + add.y * sx1;
#endif
    }
    return acc;
}

/* the same row of blocks against four activation rows: each chunk decoded once */
inline float4 dotw4(__global const uchar* w, __global const float* x0, __global const float* x1,
                    __global const float* x2, __global const float* x3, const int K)
{
    float4 acc = (float4)(0.0f);
    float4 wq[8];
    float2 m, add;
    for (int c = 0; c < K / 32; ++c) {
        chunk_load(w + (size_t)(c / (WQB / 32)) * WBYTES, c % (WQB / 32), wq, &m, &add);
        const int o = 32 * c;
        float4 s0 = (float4)(0.0f), s1 = (float4)(0.0f);
        for (int j = 0; j < 4; ++j) {
            s0.x += dot(wq[j], vload4(j, x0 + o));
            s0.y += dot(wq[j], vload4(j, x1 + o));
            s0.z += dot(wq[j], vload4(j, x2 + o));
            s0.w += dot(wq[j], vload4(j, x3 + o));
            s1.x += dot(wq[j + 4], vload4(j + 4, x0 + o));
            s1.y += dot(wq[j + 4], vload4(j + 4, x1 + o));
            s1.z += dot(wq[j + 4], vload4(j + 4, x2 + o));
            s1.w += dot(wq[j + 4], vload4(j + 4, x3 + o));
        }
        acc += m.x * s0 + m.y * s1;
#if WHASADD
        const float4 one = (float4)(1.0f);
        float4 sx = (float4)(0.0f);
        for (int j = 0; j < 8; ++j) {
            sx.x += dot(vload4(j, x0 + o), one);
            sx.y += dot(vload4(j, x1 + o), one);
            sx.z += dot(vload4(j, x2 + o), one);
            sx.w += dot(vload4(j, x3 + o), one);
        }
        acc += add.x * sx;
#elif WADD16
        const float4 one = (float4)(1.0f);
        float4 sx0 = (float4)(0.0f), sx1 = (float4)(0.0f);
        for (int j = 0; j < 4; ++j) {
            sx0.x += dot(vload4(j, x0 + o), one);
            sx0.y += dot(vload4(j, x1 + o), one);
            sx0.z += dot(vload4(j, x2 + o), one);
            sx0.w += dot(vload4(j, x3 + o), one);
            sx1.x += dot(vload4(j + 4, x0 + o), one);
            sx1.y += dot(vload4(j + 4, x1 + o), one);
            sx1.z += dot(vload4(j + 4, x2 + o), one);
            sx1.w += dot(vload4(j + 4, x3 + o), one);
        }
        acc += add.x * sx0 + add.y * sx1;
#endif
    }
    return acc;
}
#else
/* sum_k w[k] * x[k], k < K */
inline float dotw(__global const WTYPE* w, __global const float* x, const int K)
{
    float acc = 0.0f;
    int k = 0;
    for (; k + 4 <= K; k += 4)
        acc += WDOT4(WLOAD4(w, k), vload4(0, x + k));
    for (; k < K; ++k)
        acc += LDW(w, k) * x[k];
    return acc;
}

/* the same weight row against four activation rows: each weight is loaded once */
inline float4 dotw4(__global const WTYPE* w, __global const float* x0, __global const float* x1,
                    __global const float* x2, __global const float* x3, const int K)
{
    float4 acc = (float4)(0.0f);
    int k = 0;
    for (; k + 4 <= K; k += 4) {
        const WVEC4 wv = WLOAD4(w, k);
        acc.x += WDOT4(wv, vload4(0, x0 + k));
        acc.y += WDOT4(wv, vload4(0, x1 + k));
        acc.z += WDOT4(wv, vload4(0, x2 + k));
        acc.w += WDOT4(wv, vload4(0, x3 + k));
    }
    for (; k < K; ++k) {
        const float wk = LDW(w, k);
        acc.x += wk * x0[k];
        acc.y += wk * x1[k];
        acc.z += wk * x2[k];
        acc.w += wk * x3[k];
    }
    return acc;
}
#endif
