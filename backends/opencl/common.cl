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
 *   WQ8_0=1, WQ4_0=1     matrices are ggml blocks of 32 (colibri_edge/quant.py), bytes [N, K / 32 * WBYTES]:
 *                        q8_0 = d:f16 | q:i8[32], w = d q;  q4_0 = d:f16 | qs:u8[16], w = d (nib - 8),
 *                        nib(i) = qs[i] & 15 for i < 16, qs[i - 16] >> 4 after. Decoded in registers as
 *                        the row streams: one float multiply by d per block of 32 (K % 32 == 0)
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
#if WF16 + WBF16 + WI8 + WQ8_0 + WQ4_0 > 1
#error "WF16, WBF16, WI8, WQ8_0 and WQ4_0 are exclusive"
#endif
#define WBLOCK (WQ8_0 || WQ4_0)
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
#define WBYTES (WQ8_0 ? 34 : 18)
#define WROW(w, n, K) ((w) + (size_t)(n) * ((K) / 32) * WBYTES)
inline float ldw_block(__global const uchar* row, const int k)
{
    __global const uchar* blk = row + (size_t)(k / 32) * WBYTES;
    const float d = vload_half(0, (__global const half*)blk);
    const int j = k % 32;
#if WQ8_0
    return d * (float)((__global const char*)(blk + 2))[j];
#else
    const uchar q = blk[2 + (j & 15)];
    return d * (float)((j < 16 ? (q & 15) : (q >> 4)) - 8);
#endif
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

#if WBLOCK

/* the 32 weights of one block, unscaled, as eight float4 (q8_0: q; q4_0: nib - 8) */
inline void block_load(__global const uchar* blk, float4* wq)
{
#if WQ8_0
    __global const char* q = (__global const char*)(blk + 2);
    for (int j = 0; j < 8; ++j)
        wq[j] = convert_float4(vload4(j, q));
#else
    for (int j = 0; j < 4; ++j) {
        const uchar4 p = vload4(j, blk + 2);
        wq[j] = convert_float4(p & (uchar4)(15)) - 8.0f;          /* weights 4j .. 4j+3 */
        wq[j + 4] = convert_float4(p >> (uchar4)(4)) - 8.0f;      /* weights 16+4j .. */
    }
#endif
}

/* sum_k w[k] * x[k], k < K (w: a row of blocks) */
inline float dotw(__global const uchar* w, __global const float* x, const int K)
{
    float acc = 0.0f;
    float4 wq[8];
    for (int b = 0; b < K / 32; ++b) {
        __global const uchar* blk = w + (size_t)b * WBYTES;
        block_load(blk, wq);
        __global const float* xb = x + 32 * b;
        float s = 0.0f;
        for (int j = 0; j < 8; ++j)
            s += dot(wq[j], vload4(j, xb));
        acc += vload_half(0, (__global const half*)blk) * s;
    }
    return acc;
}

/* the same row of blocks against four activation rows: each block decoded once */
inline float4 dotw4(__global const uchar* w, __global const float* x0, __global const float* x1,
                    __global const float* x2, __global const float* x3, const int K)
{
    float4 acc = (float4)(0.0f);
    float4 wq[8];
    for (int b = 0; b < K / 32; ++b) {
        __global const uchar* blk = w + (size_t)b * WBYTES;
        block_load(blk, wq);
        const int o = 32 * b;
        float4 s = (float4)(0.0f);
        for (int j = 0; j < 8; ++j) {
            s.x += dot(wq[j], vload4(j, x0 + o));
            s.y += dot(wq[j], vload4(j, x1 + o));
            s.z += dot(wq[j], vload4(j, x2 + o));
            s.w += dot(wq[j], vload4(j, x3 + o));
        }
        acc += vload_half(0, (__global const half*)blk) * s;
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
