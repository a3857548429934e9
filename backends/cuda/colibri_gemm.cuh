// Colibri Edge CUDA kernels: the two GEMM tiles shared by dense matmuls and the grouped MoE FFN.
//
// Both compute, for a run of rows r < nrows of one weight matrix (one expert, one head), and a range
// of output columns:
//     MODE 0 (plain)  : out[row0 + r, c] = (A[arow(r)] . W0[c]) * S0[c]  (+ bias[c])
//     MODE 1 (GLU)    : out[row0 + r, c] = expert_act(kind, g + bias[c], u + bias1[c], alpha, limit),
//                       g = (A[arow(r)] . W0[c]) * S0[c], u = (A[arow(r)] . W1[c]) * S1[c]: SwiGLU
//                       silu(g) * u (ACT_SILU), gpt-oss's clamped SwiGLU, Gemma's GeGLU (bias / bias1
//                       null = 0)
//     arow(r) = gather ? gather[row0 + r] / gdiv : row0 + r        (token of a sorted MoE row)
//     S0/S1: int8 row scales [N], or null (= 1)
// shapes: A [*, K] fp32, W0/W1 [N, K] (fp32, fp16, bf16, int8 or a block format), bias [N] fp32 or null,
// out [*, N] fp32. The skinny tile takes the row strides of A and out (lda, ldo: K and N for whole
// rows; G*K and G*N for one head of [T, G, K] -> [T, G, N]); the tiled one takes contiguous rows.
// Accumulation is fp32 in both; weights are widened as they are read.
//
// skinny: 8 rows x 8 columns per 256-thread CTA, one warp per column streaming its weight row
//         once while the (<= 8) activation rows sit in shared memory. Decode-sized steps: the
//         weights are read once from DRAM, which is what bounds decode speed.
// tiled : 64 x 64 outputs per 256-thread CTA (4 x 4 per thread), K in steps of 16 through shared
//         memory. Prefill-sized steps: each weight element feeds 64 rows.
#pragma once
#include "colibri_common.cuh"
// the lattice i-quants' grids and KSIGNS: generated from quant.iq_grid / quant.KSIGNS (sources.py
// iq_grids_header; NVRTC and the emulator get it inlined by load_source, nvcc from toolchains/cuda's build
// folder), never a copy in this folder
#include "iq_grids.cuh"

// SK_ROWS (rows per skinny CTA = block size BM of a skinny MoE plan), SK_WARPS (columns per skinny
// CTA, 256 threads), TBM (rows per tiled CTA = BM of a tiled plan) and TBN (columns per tiled CTA)
// come from sources.py DEFINES: the host sizes grids and plans with the same numbers.
#define SK_KC 512      // K chunk of activation rows staged in shared memory (8 x 512 fp32 = 16 KiB)
#define TBK 16         // K step of the tiled loop

// two consecutive weights (2-byte aligned for int8, 4 for fp16/bf16, 8 for fp32: K even, aligned matrix starts)
CE_DEV void load2(const float* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 8);
    const float2 v = *reinterpret_cast<const float2*>(p);
    a = v.x; b = v.y;
}
CE_DEV void load2(const half_t* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 4);
    const unsigned int v = *reinterpret_cast<const unsigned int*>(p);
    a = h2f((half_t)(v & 0xffffu)); b = h2f((half_t)(v >> 16));
}

CE_DEV void load2(const bf16_t* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 4);
    const unsigned int v = *reinterpret_cast<const unsigned int*>(p);
    a = __int_as_float((int)(v << 16)); b = __int_as_float((int)(v & 0xffff0000u));
}

CE_DEV void load2(const i8_t* p, float& a, float& b) {
    CE_CHECK_ALIGNED(p, 2);
    const unsigned short v = *reinterpret_cast<const unsigned short*>(p);
    a = (float)(i8_t)(v & 0xffu); b = (float)(i8_t)(v >> 8);
}

// ---- ggml's block formats (colibri_edge/model/quant.py has the layouts and the NumPy definitions) -------
// A block-format matrix [N, K] is N rows of K / B blocks of NB bytes. Each format is a tag type; the
// kernels read weights in pairs (k even, both in one block and one group of 16: B is 32, 64 or 256), as
// they read fp16 pairs, decoded from the block's bytes in registers:
//   q8_0  d | q:i8[32]               d q            q4_0  d | qs[16]            d (nib - 8)
//   q4_1  d | m | qs[16]             d nib + m      q5_0  d | qh:u32 | qs[16]   d (nib | hb << 4) - 16 d
//   q5_1  d | m | qh | qs[16]        d q5 + m       mxfp4 e | qs[16]            2^(e-128) E2M1x2[nib]
//   q4_k  d | dmin | sc[12] | qs[128]          d sc_s nib - dmin m_s           (sub-block s of 32)
//   q5_k  d | dmin | sc[12] | qh[32] | qs[128] d sc_s (nib | hb << 4) - dmin m_s
//   q6_k  ql[128] | qh[64] | sc:i8[16] | d     d sc_(i/16) (q6 - 32)
//   q2_k  sc[16] | qs[64] | d | dmin           d (sc_s & 15) q2 - dmin (sc_s >> 4)   (sub-block s of 16)
//   q3_k  hmask[32] | qs[64] | sc[12] | d      d (sc6_s - 32) (q2 - 4 (1 - hb))
//   tq2_0 qs[64] | d                           d (q2 - 1)
//         (2-bit fields: half h of 128, part p of 32, weight j: (qs[32 h + j] >> 2 p) & 3; q3_k's hb
//         bit 4 h + p of hmask[j])
//   iq4_nl d | qs[16]                          d IQ4NL[nib]
//   iq4_xs d | sc_h:u16 | sc_l[4] | qs[128]    d (sc6_s - 32) IQ4NL[nib]   (sub-block s of 32, qs[16 s..])
//   tq1_0 qs[48] | qh[4] | d                   d (trit - 1), five trits a byte (quant.py tq1_0_trits)
//   nvfp4 d:ue4m3[4] | qs[32]   (B = 64)       UE4M3(d_s) / 2 E2M1x2[nib]  (sub-block s of 16, qs[8 s..])
//   the lattice i-quants (quant.py's table): a group of 8 weights (IQ3: 4) is one grid entry, signs apart:
//   iq2_xxs d | (grid[4] | signs:u32)[8]       d (0.5 + s) / 4 grid8 sign   (sub-block g of 32, s bits 28..31)
//   iq2_xs  d | qs:u16[32] | sc[8]             d (0.5 + s) / 4 grid8[q & 511] KSIGNS[q >> 9]  (s per 16)
//   iq2_s   d | qs[32] | signs[32] | qh[8] | sc[8]   d (0.5 + s) / 4 grid8[qs | 2 bits of qh << 8] sign
//   iq3_xxs d | qs[64] | (signs, s):u32[8]     d (0.5 + s) / 2 grid4[qs] sign
//   iq3_s   d | qs[64] | qh[8] | signs[32] | sc[4]   d (1 + 2 s) grid4[qs | bit of qh << 8] sign
//   iq1_s   d | qs[32] | qh:u16[8]             d (2 s + 1) (grid8[qs | 3 bits of qh << 8] +- 1/8)
//   iq1_m   qs[32] | qh[16] | sc:u16[4]        the same, s per 16, d the scales' top nibbles
// Bytes are read one at a time (blocks of 17, 18, 22 bytes leave no alignment to rely on).
struct q8_0_t {}; struct q4_0_t {}; struct q4_1_t {}; struct q5_0_t {}; struct q5_1_t {}; struct mxfp4_t {};
struct q4_k_t {}; struct q5_k_t {}; struct q6_k_t {};
struct q2_k_t {}; struct q3_k_t {}; struct iq4_nl_t {}; struct iq4_xs_t {}; struct tq1_0_t {}; struct tq2_0_t {};
struct nvfp4_t {};
struct iq2_xxs_t {}; struct iq2_xs_t {}; struct iq2_s_t {}; struct iq3_xxs_t {}; struct iq3_s_t {}; struct iq1_s_t {};
struct iq1_m_t {};
typedef unsigned char u8;
template <typename A, typename B> struct same_t { static constexpr bool value = false; };   // no <type_traits>
template <typename A> struct same_t<A, A> { static constexpr bool value = true; };

CE_DEV float ld_f16(const u8* p) { return h2f((half_t)(p[0] | (p[1] << 8))); }
CE_DEV unsigned ld_u32(const u8* p) { return p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned)p[3] << 24); }
// e8m0 scale, halved (ggml_e8m0_to_fp32_half): 2^(e - 128), exact down to e = 0
CE_DEV float e8m0_half(unsigned e) { return __int_as_float((int)(e < 2 ? (0x00200000u << e) : ((e - 1u) << 23))); }
// doubled E2M1 value of a nibble: 0 1 2 3 4 6 8 12, bit 3 the sign
CE_DEV float e2m1x2(unsigned n) {
    const unsigned m = n & 7u;
    const float v = m < 4 ? (float)m : (float)((2u + (m & 1u)) << ((m >> 1) - 1u));
    return (n & 8u) ? -v : v;
}
// UE4M3 scale byte, halved (quant.py ue4m3_half): exponent e > 0 is the float with exponent field e + 119
// and mantissa m << 20, e = 0 is m 2^-10; 0 and 0x7f are 0. Exact for every byte
CE_DEV float ue4m3_half(unsigned x) {
    const unsigned e = (x >> 3) & 15u, m = x & 7u;
    const float v = e == 0u ? (float)m * 0.0009765625f : __int_as_float((int)(((e + 119u) << 23) | (m << 20)));
    return x == 0x7fu ? 0.f : v;
}
// kvalues_iq4nl[n] (quant.py IQ4NL), from two words of bytes: no table in memory
CE_DEV float iq4nl(unsigned n) {
    const unsigned long long w = n < 8u ? 0xf6eaddcfbfad9881ull : 0x7159453526190d01ull;
    return (float)(signed char)(unsigned char)(w >> (8u * (n & 7u)));
}
// trit n (< 5) of a tq1_0 byte b, minus 1: ((b 3^n mod 256) 3) >> 8, - 1
CE_DEV float trit(unsigned b, int n) {
    const unsigned p = (unsigned)(0x511b090301ull >> (8 * n)) & 255u;
    return (float)((int)((((b * p) & 255u) * 3u) >> 8) - 1);
}
// get_scale_min_k4: the 6-bit scale and min of sub-block s of a q4_k / q5_k block's 12 scale bytes
CE_DEV void scale_min_k4(const u8* sc, int s, float& d, float& m) {
    if (s < 4) { d = (float)(sc[s] & 63); m = (float)(sc[s + 4] & 63); }
    else {
        d = (float)((sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4));
        m = (float)((sc[s + 4] >> 4) | ((sc[s] >> 6) << 4));
    }
}

template <typename F> struct BlockFmt;
#define COLIBRI_BLOCK(TAG, B_, NB_) template <> struct BlockFmt<TAG> { static constexpr int B = B_, NB = NB_; };
COLIBRI_BLOCK(q8_0_t, 32, 34) COLIBRI_BLOCK(q4_0_t, 32, 18) COLIBRI_BLOCK(q4_1_t, 32, 20)
COLIBRI_BLOCK(q5_0_t, 32, 22) COLIBRI_BLOCK(q5_1_t, 32, 24) COLIBRI_BLOCK(mxfp4_t, 32, 17)
COLIBRI_BLOCK(q4_k_t, 256, 144) COLIBRI_BLOCK(q5_k_t, 256, 176) COLIBRI_BLOCK(q6_k_t, 256, 210)
COLIBRI_BLOCK(q2_k_t, 256, 84) COLIBRI_BLOCK(q3_k_t, 256, 110) COLIBRI_BLOCK(iq4_nl_t, 32, 18)
COLIBRI_BLOCK(iq4_xs_t, 256, 136) COLIBRI_BLOCK(tq1_0_t, 256, 54) COLIBRI_BLOCK(tq2_0_t, 256, 66)
COLIBRI_BLOCK(nvfp4_t, 64, 36) COLIBRI_BLOCK(iq2_xxs_t, 256, 66) COLIBRI_BLOCK(iq2_xs_t, 256, 74)
COLIBRI_BLOCK(iq2_s_t, 256, 82) COLIBRI_BLOCK(iq3_xxs_t, 256, 98) COLIBRI_BLOCK(iq3_s_t, 256, 110)
COLIBRI_BLOCK(iq1_s_t, 256, 50) COLIBRI_BLOCK(iq1_m_t, 256, 56)

// byte j of a grid entry, as a signed value (IQ1's grid holds -1, 0, 1)
CE_DEV float grid_at(u64 e, int j) { return (float)(signed char)(u8)(e >> (8 * j)); }
// a grid value v with sign bit j of the sign byte s (set: negative)
CE_DEV float signed_at(float v, unsigned s, int j) { return ((s >> j) & 1u) ? -v : v; }

// weights k and k + 1 (k even) of a row of blocks
template <typename F>
CE_DEV void block_pair(const u8* row, int k, float& a, float& b) {
    constexpr int B = BlockFmt<F>::B, NB = BlockFmt<F>::NB;
    const u8* blk = row + (size_t)(k / B) * NB;
    const int i = k % B;
    if constexpr (same_t<F, q8_0_t>::value) {
        const float d = ld_f16(blk);
        a = d * (float)(signed char)blk[2 + i]; b = d * (float)(signed char)blk[3 + i];
    } else if constexpr (same_t<F, q4_0_t>::value || same_t<F, q4_1_t>::value ||
                         same_t<F, mxfp4_t>::value) {
        constexpr int o = same_t<F, q4_0_t>::value ? 2 : same_t<F, q4_1_t>::value ? 4 : 1;
        const int sh = i < 16 ? 0 : 4, j = i & 15;
        const unsigned na = (blk[o + j] >> sh) & 15u, nb = (blk[o + j + 1] >> sh) & 15u;
        if constexpr (same_t<F, mxfp4_t>::value) {
            const float s = e8m0_half(blk[0]);
            a = s * e2m1x2(na); b = s * e2m1x2(nb);
        } else if constexpr (same_t<F, q4_0_t>::value) {
            const float d = ld_f16(blk);
            a = d * ((float)na - 8.f); b = d * ((float)nb - 8.f);
        } else {
            const float d = ld_f16(blk), m = ld_f16(blk + 2);
            a = d * (float)na + m; b = d * (float)nb + m;
        }
    } else if constexpr (same_t<F, q5_0_t>::value || same_t<F, q5_1_t>::value) {
        constexpr int o = same_t<F, q5_0_t>::value ? 2 : 4;
        const unsigned qh = ld_u32(blk + o);
        const int sh = i < 16 ? 0 : 4, j = i & 15;
        const float qa = (float)(((blk[o + 4 + j] >> sh) & 15u) | (((qh >> i) & 1u) << 4));
        const float qb = (float)(((blk[o + 5 + j] >> sh) & 15u) | (((qh >> (i + 1)) & 1u) << 4));
        const float d = ld_f16(blk);
        if constexpr (same_t<F, q5_0_t>::value) { a = d * (qa - 16.f); b = d * (qb - 16.f); }
        else { const float m = ld_f16(blk + 2); a = d * qa + m; b = d * qb + m; }
    } else if constexpr (same_t<F, q4_k_t>::value || same_t<F, q5_k_t>::value) {
        const int s = i / 32, j = i % 32, sh = 4 * (s & 1);
        float sc, mn;
        scale_min_k4(blk + 4, s, sc, mn);
        const float d = ld_f16(blk) * sc, m = ld_f16(blk + 2) * mn;
        constexpr int oq = same_t<F, q4_k_t>::value ? 16 : 48;
        const u8* qs = blk + oq + 32 * (s / 2);
        unsigned qa = (qs[j] >> sh) & 15u, qb = (qs[j + 1] >> sh) & 15u;
        if constexpr (same_t<F, q5_k_t>::value) {
            qa |= ((blk[16 + j] >> s) & 1u) << 4;
            qb |= ((blk[17 + j] >> s) & 1u) << 4;
        }
        a = d * (float)qa - m; b = d * (float)qb - m;
    } else if constexpr (same_t<F, q6_k_t>::value) {  // q6_k: half h, part p of 32, weight j
        const int h = i / 128, r = i % 128, p = r / 32, j = r % 32;
        const u8* ql = blk + 64 * h + 32 * (p & 1);
        const u8* qh = blk + 128 + 32 * h;
        const int shl = 4 * (p >> 1), shh = 2 * p;
        const int qa = (int)(((ql[j] >> shl) & 15u) | (((qh[j] >> shh) & 3u) << 4)) - 32;
        const int qb = (int)(((ql[j + 1] >> shl) & 15u) | (((qh[j + 1] >> shh) & 3u) << 4)) - 32;
        const float d = ld_f16(blk + 208) * (float)(signed char)blk[192 + 8 * h + 2 * p + j / 16];
        a = d * (float)qa; b = d * (float)qb;
    } else if constexpr (same_t<F, q2_k_t>::value || same_t<F, q3_k_t>::value || same_t<F, tq2_0_t>::value) {
        // 2-bit fields: half h, part p of 32, weight j; sub-block s = i / 16 of 16
        const int h = i / 128, r = i % 128, p = r / 32, j = r % 32, s = i / 16;
        constexpr int oq = same_t<F, q2_k_t>::value ? 16 : same_t<F, q3_k_t>::value ? 32 : 0;
        const u8* qs = blk + oq + 32 * h;
        const int qa = (int)((qs[j] >> (2 * p)) & 3u), qb = (int)((qs[j + 1] >> (2 * p)) & 3u);
        if constexpr (same_t<F, q2_k_t>::value) {
            const unsigned sc = blk[s];
            const float d = ld_f16(blk + 80) * (float)(sc & 15u), m = ld_f16(blk + 82) * (float)(sc >> 4);
            a = d * (float)qa - m; b = d * (float)qb - m;
        } else if constexpr (same_t<F, q3_k_t>::value) {
            const int ha = (blk[j] >> (4 * h + p)) & 1, hb = (blk[j + 1] >> (4 * h + p)) & 1;
            const int lo = (blk[96 + s % 8] >> (4 * (s / 8))) & 15, hi = (blk[104 + s % 4] >> (2 * (s / 4))) & 3;
            const float d = ld_f16(blk + 108) * (float)((lo | (hi << 4)) - 32);
            a = d * (float)(qa - 4 * (1 - ha)); b = d * (float)(qb - 4 * (1 - hb));
        } else {
            const float d = ld_f16(blk + 64);
            a = d * (float)(qa - 1); b = d * (float)(qb - 1);
        }
    } else if constexpr (same_t<F, iq4_nl_t>::value || same_t<F, iq4_xs_t>::value) {
        // iq4_nl: the block's 32 weights; iq4_xs: sub-block s of 32, its nibbles at qs[16 s..]
        const int s = i / 32, j = i % 32, sh = j < 16 ? 0 : 4;
        constexpr int oq = same_t<F, iq4_nl_t>::value ? 2 : 8;
        const u8* qs = blk + oq + 16 * s;
        const float qa = iq4nl((qs[j & 15] >> sh) & 15u), qb = iq4nl((qs[(j & 15) + 1] >> sh) & 15u);
        float d = ld_f16(blk);
        if constexpr (same_t<F, iq4_xs_t>::value) {
            const unsigned sch = blk[2] | (blk[3] << 8);
            const int sc = (int)((blk[4 + s / 2] >> (4 * (s % 2))) & 15u) | (int)(((sch >> (2 * s)) & 3u) << 4);
            d *= (float)(sc - 32);
        }
        a = d * qa; b = d * qb;
    } else if constexpr (same_t<F, tq1_0_t>::value) {
        // weight 32 n + j (n < 5): trit n of qs[j]; 160 + 16 n + j: of qs[32 + j]; 240 + 4 n + j: of qh[j]
        const int n = i < 160 ? i / 32 : i < 240 ? (i - 160) / 16 : (i - 240) / 4;
        const int o = i < 160 ? i % 32 : i < 240 ? 32 + (i - 160) % 16 : 48 + (i - 240) % 4;
        const float d = ld_f16(blk + 52);
        a = d * trit(blk[o], n); b = d * trit(blk[o + 1], n);
    } else if constexpr (same_t<F, iq2_xxs_t>::value || same_t<F, iq3_xxs_t>::value) {
        // sub-block g of 32, group l of 8, weight j (even); sx: four 7-bit sign indices, s in bits 28..31
        const int g = i / 32, l = (i % 32) / 8, j = i % 8;
        constexpr bool two = same_t<F, iq2_xxs_t>::value;
        const unsigned sx = ld_u32(blk + (two ? 6 + 8 * g : 66 + 4 * g));
        const unsigned s = iq_ksigns[(sx >> (7 * l)) & 127u];
        const float d = ld_f16(blk) * (0.5f + (float)(sx >> 28)) * (two ? 0.25f : 0.5f);
        u64 e;
        if constexpr (two) e = iq2xxs_grid[blk[2 + 8 * g + l]] >> (8 * j);
        else e = iq3xxs_grid[blk[2 + 8 * g + 2 * l + j / 4]] >> (8 * (j % 4));
        a = d * signed_at(grid_at(e, 0), s, j); b = d * signed_at(grid_at(e, 1), s, j + 1);
    } else if constexpr (same_t<F, iq2_xs_t>::value || same_t<F, iq2_s_t>::value) {
        // group q of 8 (q < 32), weight j; scale per 16 (sub-block i / 16): a nibble of the last 8 bytes
        const int q = i / 8, j = i % 8, h = i / 16;
        u64 e;
        unsigned s;
        if constexpr (same_t<F, iq2_xs_t>::value) {
            const unsigned v = blk[2 + 2 * q] | (blk[3 + 2 * q] << 8);
            e = iq2xs_grid[v & 511u]; s = iq_ksigns[v >> 9];
        } else {
            e = iq2s_grid[blk[2 + q] | (((blk[66 + q / 4] >> (2 * (q % 4))) & 3u) << 8)]; s = blk[34 + q];
        }
        const unsigned sc = (blk[BlockFmt<F>::NB - 8 + h / 2] >> (4 * (h % 2))) & 15u;
        const float d = ld_f16(blk) * (0.5f + (float)sc) * 0.25f;
        a = d * signed_at(grid_at(e, j), s, j); b = d * signed_at(grid_at(e, j + 1), s, j + 1);
    } else if constexpr (same_t<F, iq3_s_t>::value) {
        // sub-block g of 32, grid entry k of 4 (a ninth index bit from qh[g]), weight j of its group of 8
        const int g = i / 32, k = (i % 32) / 4, j = i % 8;
        const u64 e = iq3s_grid[blk[2 + 8 * g + k] | (((blk[66 + g] >> k) & 1u) << 8)];
        const unsigned s = blk[74 + 4 * g + k / 2], sc = (blk[106 + g / 2] >> (4 * (g % 2))) & 15u;
        const float d = ld_f16(blk) * (float)(1u + 2u * sc);
        a = d * signed_at(grid_at(e, i % 4), s, j); b = d * signed_at(grid_at(e, i % 4 + 1), s, j + 1);
    } else if constexpr (same_t<F, iq1_s_t>::value || same_t<F, iq1_m_t>::value) {
        // group q of 8, weight j: d (2 s + 1) / 8 (8 grid +- 1), the integers exact
        const int q = i / 8, j = i % 8;
        unsigned idx, s;
        bool neg;
        float d;
        if constexpr (same_t<F, iq1_s_t>::value) {     // qh:u16 of sub-block q / 4: index bits 3 (q % 4) ..,
                                                       // s bits 12..14, the delta's sign bit 15
            const unsigned qh = blk[34 + 2 * (q / 4)] | (blk[35 + 2 * (q / 4)] << 8);
            idx = blk[2 + q] | (((qh >> (3 * (q % 4))) & 7u) << 8);
            s = (qh >> 12) & 7u; neg = (qh & 0x8000u) != 0u; d = ld_f16(blk);
        } else {                                       // nibble q of qh[16]: 3 index bits, the sign; s per 16
            const unsigned nib = (blk[32 + q / 2] >> (4 * (q % 2))) & 15u, h = (unsigned)i / 16u;
            idx = blk[q] | ((nib & 7u) << 8); neg = (nib & 8u) != 0u;
            unsigned sc[4], bits = 0;
            for (int t = 0; t < 4; ++t) {
                sc[t] = blk[48 + 2 * t] | (blk[49 + 2 * t] << 8);
                bits |= (sc[t] >> 12) << (4 * t);
            }
            s = (sc[h / 4] >> (3 * (h % 4))) & 7u; d = h2f((half_t)bits);
        }
        const u64 e = iq1s_grid[idx];
        const float m = d * (float)(2u * s + 1u) * 0.125f, dl = neg ? -1.f : 1.f;
        a = m * (8.f * grid_at(e, j) + dl); b = m * (8.f * grid_at(e, j + 1) + dl);
    } else {                                         // nvfp4: sub-block s of 16, weight r
        static_assert(same_t<F, nvfp4_t>::value, "a block tag without a decoder");
        const int s = i / 16, r = i % 16, sh = r < 8 ? 0 : 4;
        const u8* qs = blk + 4 + 8 * s + (r & 7);
        const float d = ue4m3_half(blk[s]);
        a = d * e2m1x2((qs[0] >> sh) & 15u); b = d * e2m1x2((qs[1] >> sh) & 15u);
    }
}

// WFmt<WT>: how the kernels address a matrix of storage WT: row(W, n, K), pair(row, k, a, b) (k even),
// one(row, k). Plain element types index elements; the block tags index bytes.
template <typename WT, typename = void> struct WFmt {
    typedef WT store;
    static CE_DEV const WT* row(const WT* W, int n, int K) { return W + (size_t)n * K; }
    static CE_DEV void pair(const WT* r, int k, float& a, float& b) { load2(r + k, a, b); }
    static CE_DEV float one(const WT* r, int k) { return to_f32(r[k]); }
};
template <typename WT> struct WFmt<WT, decltype((void)BlockFmt<WT>::B)> {
    typedef u8 store;
    static CE_DEV const u8* row(const u8* W, int n, int K) {
        return W + (size_t)n * (K / BlockFmt<WT>::B) * BlockFmt<WT>::NB;
    }
    static CE_DEV void pair(const u8* r, int k, float& a, float& b) { block_pair<WT>(r, k, a, b); }
    static CE_DEV float one(const u8* r, int k) {
        float a, b;
        block_pair<WT>(r, k & ~1, a, b);
        return (k & 1) ? b : a;
    }
};
template <typename WT> using WStore = typename WFmt<WT>::store;

template <typename WT, int MODE>
static __device__ void skinny_tile(float* CE_RESTRICT out, const float* CE_RESTRICT A, const int* gather, int gdiv,
                                   int row0, int nrows, const WStore<WT>* W0, const WStore<WT>* W1, const float* S0,
                                   const float* S1, const float* bias, int N, int K, int lda, int ldo,
                                   int colbase, const float* bias1 = nullptr, int kind = ACT_SILU,
                                   float alpha = 0.f, float limit = 0.f) {
    typedef WFmt<WT> F;
    __shared__ float xs[SK_ROWS][SK_KC];
    __shared__ int arow[SK_ROWS];
    const int tid = threadIdx.x, lane = tid & 31;
    const int col = colbase + (tid >> 5);
    const bool active = col < N;                     // uniform within a warp
    if (tid < SK_ROWS) arow[tid] = tid < nrows ? (gather ? gather[row0 + tid] / gdiv : row0 + tid) : 0;
    const WStore<WT>* w0 = F::row(W0, active ? col : 0, K);
    const WStore<WT>* w1 = MODE == 1 ? F::row(W1, active ? col : 0, K) : w0;
    float acc0[SK_ROWS], acc1[SK_ROWS];
#pragma unroll
    for (int r = 0; r < SK_ROWS; ++r) { acc0[r] = 0.f; acc1[r] = 0.f; }

    for (int k0 = 0; k0 < K; k0 += SK_KC) {
        const int kc = min(SK_KC, K - k0);
        __syncthreads();                             // the previous chunk is consumed; arow is visible
        for (int r = 0; r < nrows; ++r) {
            const float* a = A + (size_t)arow[r] * lda + k0;
            for (int kk = tid; kk < kc; kk += blockDim.x) xs[r][kk] = a[kk];
        }
        __syncthreads();
        if (!active) continue;
        if ((K & 1) == 0) {                          // kc is even too: pairs of weights per lane
            for (int kk = 2 * lane; kk < kc; kk += 64) {
                float g0, g1, u0 = 0.f, u1 = 0.f;
                F::pair(w0, k0 + kk, g0, g1);
                if (MODE == 1) F::pair(w1, k0 + kk, u0, u1);
#pragma unroll
                for (int r = 0; r < SK_ROWS; ++r) {
                    if (r < nrows) {
                        const float xa = xs[r][kk], xb = xs[r][kk + 1];
                        acc0[r] += xa * g0 + xb * g1;
                        if (MODE == 1) acc1[r] += xa * u0 + xb * u1;
                    }
                }
            }
        } else {
            for (int kk = lane; kk < kc; kk += 32) {
                const float g = F::one(w0, k0 + kk);
                const float u = MODE == 1 ? F::one(w1, k0 + kk) : 0.f;
#pragma unroll
                for (int r = 0; r < SK_ROWS; ++r) {
                    if (r < nrows) {
                        acc0[r] += xs[r][kk] * g;
                        if (MODE == 1) acc1[r] += xs[r][kk] * u;
                    }
                }
            }
        }
    }
    if (!active) return;                             // whole warps leave; no barrier follows
#pragma unroll
    for (int r = 0; r < SK_ROWS; ++r) {
        if (r < nrows) {                             // nrows is uniform in the CTA
            float s0 = warp_sum(acc0[r]);
            float s1 = MODE == 1 ? warp_sum(acc1[r]) : 0.f;
            if (lane == 0) {
                if (S0) s0 *= S0[col];
                if (MODE == 1 && S1) s1 *= S1[col];
                float v;
                if (MODE == 1) v = expert_act(kind, bias ? s0 + bias[col] : s0, bias1 ? s1 + bias1[col] : s1, alpha,
                                                limit);
                else v = bias ? s0 + bias[col] : s0;
                out[(size_t)(row0 + r) * ldo + col] = v;
            }
        }
    }
}

template <typename WT, int MODE>
static __device__ void tiled_tile(float* CE_RESTRICT out, const float* CE_RESTRICT A, const int* gather, int gdiv,
                                  int row0, int nrows, const WStore<WT>* W0, const WStore<WT>* W1, const float* S0,
                                  const float* S1, const float* bias, int N, int K, int colbase,
                                  const float* bias1 = nullptr, int kind = ACT_SILU, float alpha = 0.f,
                                   float limit = 0.f) {
    typedef WFmt<WT> F;
    __shared__ float As[TBK][TBM + 4];
    __shared__ float Bs0[TBK][TBN + 4];
    __shared__ float Bs1[TBK][TBN + 4];
    __shared__ int arow[TBM];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    if (tid < TBM) arow[tid] = tid < nrows ? (gather ? gather[row0 + tid] / gdiv : row0 + tid) : -1;
    float acc0[4][4], acc1[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) { acc0[i][j] = 0.f; acc1[i][j] = 0.f; }

    for (int k0 = 0; k0 < K; k0 += TBK) {
        __syncthreads();                             // previous tile consumed; arow is visible
#pragma unroll
        for (int i = 0; i < 4; ++i) {                // 64 x 16 elements of A and of each W, 4 per thread
            const int e = tid + 256 * i, r = e >> 4, kk = e & 15, k = k0 + kk;
            const int ar = arow[r];
            As[kk][r] = (ar >= 0 && k < K) ? A[(size_t)ar * K + k] : 0.f;
            const int c = colbase + r;               // here r indexes the 64 columns
            const bool ok = c < N && k < K;
            Bs0[kk][r] = ok ? F::one(F::row(W0, c, K), k) : 0.f;
            if (MODE == 1) Bs1[kk][r] = ok ? F::one(F::row(W1, c, K), k) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TBK; ++kk) {
            float a[4], b0[4], b1[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                b0[j] = Bs0[kk][tx + 16 * j];
                b1[j] = MODE == 1 ? Bs1[kk][tx + 16 * j] : 0.f;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc0[i][j] += a[i] * b0[j];
                    if (MODE == 1) acc1[i][j] += a[i] * b1[j];
                }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = ty + 16 * i;
        if (r >= nrows) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = colbase + tx + 16 * j;
            if (c >= N) continue;
            const float g = S0 ? acc0[i][j] * S0[c] : acc0[i][j];
            float v;
            if (MODE == 1) {
                const float u = S1 ? acc1[i][j] * S1[c] : acc1[i][j];
                v = expert_act(kind, bias ? g + bias[c] : g, bias1 ? u + bias1[c] : u, alpha, limit);
            } else v = bias ? g + bias[c] : g;
            out[(size_t)(row0 + r) * N + c] = v;
        }
    }
}
