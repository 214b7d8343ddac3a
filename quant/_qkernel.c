/*
 * Fused RTN quantization: a BF16 or FP8 (e4m3fn, block scale_inv) weight [n, k] -> the packed
 * on-disk weight, its scales and the SQNR sums, in one pass over memory (`cvt.quant.qkernel`).
 *
 * Bit-identical to cvt's torch reference (`cvt.quant.schemes` + `cvt.quant.layouts` encoders):
 * the same float32 operations in the same order, one IEEE rounding each (x86-64 and aarch64
 * use no excess precision; built with -ffp-contract=off so nothing is fused into an FMA):
 *
 *   source     w = float(bf16)                        (BF16)
 *              w = float(bf16_rne(e4m3(c) * s[i/bn, j/bk]))   (FP8: dequantized to BF16 first,
 *                                                      as `cvt.convert.fp8.dequant_fp8_block`)
 *   int sym    scale = bf16(amax / qdiv), 0 -> 1;  q = clamp(rint(w / scale), qmin, qmax)
 *   int asym   lo = min(min w, 0), hi = max(max w, 0); s0 = (hi - lo) / (qmax - qmin), 0 -> 1;
 *              offset = clamp(rint(qmin - lo / s0), qmin, qmax) + 0.0;  scale = bf16(s0), 0 -> 1;
 *              q = clamp(rint(w / scale + offset), qmin, qmax)
 *   nvfp4      s = e4m3(min(amax16 / 6 * gs, 448)), 0 -> 0.125;  mult = float(s) / gs
 *   mxfp4      e = clamp(((bits(amax32) + 2**21) >> 23 & 255) - 2, 0, 254);  mult = 2**(e - 127)
 *   fp4 codes  x = clamp(w / mult, -6, 6); index by the E2M1 thresholds; sign bit = signbit(x)
 *
 * rint is round-half-even (torch.round). Packings (`cvt.quant.primitives`): int8 [n, k];
 * compressed-tensors int32 [n, ceil(k/8)] (value + 8, element i of 8 at bits 4i, zero padding);
 * Ascend int8 nibbles along k [n, k/2] or in output-row pairs [n/2, k] (even element low);
 * fp4 codes [n, k/2] (even element low).
 *
 * The SQNR sums sum(w^2) and sum((w - w_hat)^2), w_hat the dequantized value computed in float32
 * exactly as the schemes' `dequantize` does: float32 squares (so they underflow where the
 * reference's float32 dot products do) accumulated in double, in another order than the
 * reference's: the dB figures agree to a tolerance, not bit for bit.
 *
 * Rows are split over `nthreads` pthreads; each thread keeps one or two decoded rows (k floats)
 * and their int8 codes, so temporaries stay a few rows whatever the weight's size. Non-finite
 * values are counted, not quantized: the caller refuses the weight (its outputs are garbage).
 * On x86-64 with AVX2 + F16C (checked at run time) the inner loops are vectorized with the same
 * operations, 8 lanes, or 16 with AVX-512F (`simd` 2, where the CPU has it), and on aarch64 with
 * NEON (`simd` 1: decode, group statistics, int codes, sums): bit-identical codes and scales (the
 * tests compare every level with the scalar path; NEON under qemu, tests/kernels/neon_harness.c). The module init below only exists so that
 * setuptools can build this file as an importable extension; it is called through ctypes.
 */
#ifndef CVT_NO_PYTHON /* tests/kernels/neon_harness.c builds the kernel alone, for aarch64 under qemu */
#include <Python.h>
#endif
#include <stdlib.h>
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* GCC: -ffp-contract=off (pyproject.toml) */
#endif
#include "../convert/_cvt_kernel.h" /* LUT, bf16_rne, cpu_simd, fp8_scales_simd_ok, run_jobs */

enum { SRC_BF16 = 0, SRC_FP8 = 1 };
enum { MODE_AMAX = 0, MODE_SYM = 1, MODE_ASYM = 2, MODE_NVFP4 = 3, MODE_MXFP4 = 4 };
enum { PACK_I8 = 0, PACK_CT32 = 1, PACK_NIB_K = 2, PACK_NIB_ROWS = 3, PACK_FP4 = 4 };

/* Mirrors `cvt.quant.qkernel._Args` (ctypes.Structure): keep the field order in sync. */
typedef struct {
    const void *src;        /* [n, k]: bf16 bits (uint16) or e4m3fn codes (uint8) */
    const float *fp8_scale; /* [ceil(n/bn), s_cols] float32 (SRC_FP8) */
    void *q;                /* packed weight (see PACK_*) */
    float *scale;           /* [n, ng] float32 (int modes) */
    float *offset;          /* [n, ng] float32 (MODE_ASYM; zeros for MODE_SYM; or NULL) */
    uint8_t *scale8;        /* [n, ng] e4m3fn (nvfp4) / E8M0 (mxfp4) codes */
    double *sums;           /* out [2]: sum w^2, sum (w - w_hat)^2 */
    int64_t *nonfinite;     /* out [1]: count of NaN / Inf source values */
    float *amax;            /* out [1] (MODE_AMAX): max |w| */
    int64_t n, k, src_kind, s_cols, bn, bk;
    int64_t mode, group, qmin, qmax, pack;
    float qdiv, global_scale;
    int64_t nthreads, simd; /* simd: the highest level allowed (0 scalar, 1 AVX2 or NEON, 2 AVX-512) */
    int64_t f64_squares;    /* square in double (the caller's retry when a float32 square overflowed) */
    uint16_t *scale_bf16;   /* [n, ng] the int scales' bfloat16 bits too (or NULL) */
} cvt_qargs;

static const float E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> nearest-even bfloat16, back to float32 (NaN kept quiet; torch's rounding) */
static inline float bf16_round(float f) { return u2f((uint32_t)bf16_rne(f) << 16); }

/* c10's fp8e4m3fn_from_fp32_value: nearest even, >= 480 -> NaN (0x7f) */
static inline uint8_t e4m3_from_f32(float f) {
    uint32_t b = f2u(f), sign = b & 0x80000000u, r;
    b ^= sign;
    if (b >= (1087u << 20))
        r = 0x7f;
    else if (b < (121u << 23))
        r = (uint8_t)(f2u(u2f(b) + u2f(141u << 23)) - (141u << 23));
    else {
        uint32_t odd = (b >> 20) & 1u;
        b += ((uint32_t)(7 - 127) << 23) + 0x7ffffu;
        b += odd;
        r = (uint8_t)(b >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

static inline int not_finite(float f) { return (f2u(f) & 0x7f800000u) == 0x7f800000u; }
static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

static inline uint8_t e2m1_code(float x) {
    float a = fabsf(x);
    uint8_t idx = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                            (a > 5.0f));
    return (uint8_t)(idx | (signbit(x) ? 8 : 0));
}

/* ---- scalar row pieces ------------------------------------------------------------------------ */

static int64_t decode_scalar(const cvt_qargs *a, int64_t i, float *out) {
    int64_t k = a->k, bad = 0;
    if (a->src_kind == SRC_BF16) {
        const uint8_t *row = (const uint8_t *)a->src + 2 * i * k;
        for (int64_t j = 0; j < k; j++) {
            uint16_t h;
            memcpy(&h, row + 2 * j, 2);
            out[j] = u2f((uint32_t)h << 16);
            bad += not_finite(out[j]);
        }
    } else {
        const uint8_t *row = (const uint8_t *)a->src + i * k;
        const float *srow = a->fp8_scale + (i / a->bn) * a->s_cols;
        for (int64_t j = 0; j < k; j++) {
            out[j] = bf16_round(LUT[row[j]] * srow[j / a->bk]);
            bad += not_finite(out[j]);
        }
    }
    return bad;
}

static float amax_scalar(const float *w, int64_t len) {
    float m = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        float v = fabsf(w[j]);
        m = v > m ? v : m;
    }
    return m;
}

static void minmax_scalar(const float *w, int64_t len, float *mn, float *mx) {
    float lo = w[0], hi = w[0];
    for (int64_t j = 1; j < len; j++) {
        lo = w[j] < lo ? w[j] : lo;
        hi = w[j] > hi ? w[j] : hi;
    }
    *mn = lo;
    *mx = hi;
}

/* q = clamp(rint(w / sc [+ off]), qmin, qmax); returns sum (w - (q - off) * sc)^2 */
/* squares: float32 (as the reference's float32 dot products, underflow included), or double
 * (f64: the retry after a float32 square overflowed, as the reference redoes that in float64) */
#define SQ(d, f64) ((f64) ? (double)(d) * (double)(d) : (double)((d) * (d)))

static double qint_scalar_sq(const float *w, int8_t *q, int64_t len, float sc, float off, int asym, float qmin,
                             float qmax, int f64) {
    double err = 0.0;
    for (int64_t j = 0; j < len; j++) {
        float x = w[j] / sc;
        if (asym) x = x + off;
        float r = clampf(rintf(x), qmin, qmax);
        q[j] = (int8_t)r;
        float d = w[j] - (r - off) * sc;
        err += SQ(d, f64);
    }
    return err;
}

static double fp4_scalar_sq(const float *w, uint8_t *c, int64_t len, float mult, int f64) {
    double err = 0.0;
    for (int64_t j = 0; j < len; j++) {
        float x = clampf(w[j] / mult, -6.0f, 6.0f);
        uint8_t code = e2m1_code(x);
        c[j] = code;
        float v = (code & 8) ? -E2M1[code & 7] : E2M1[code & 7];
        float d = w[j] - v * mult;
        err += SQ(d, f64);
    }
    return err;
}

/* ---- fp4 codes without a division ----------------------------------------------------------------
 * The SIMD fp4 loops only need e2m1_code(w / mult), and a vector division is their largest cost.
 * FP4_EXACT: mult is a power of two whose reciprocal is a float (every mxfp4 multiplier 2**(e-127),
 *   e = 0..254: 1/mult = 2**(127-e) in [2**-127, 2**127]): w * (1/mult) and w / mult are the one
 *   correctly rounded value of the same real number (subnormal, overflowing and NaN results too).
 * FP4_NEAR: 1/mult is a normal float: w * (1/mult) is within 3 * 2**-24 relative of w / mult (or
 *   both are below 2**-125, far under the first threshold), so the code is the same unless |x|
 *   lies within that of a threshold; the loops check each vector against a generous
 *   2**-17 |x| and divide the vectors where some lane is that near (or NaN).
 * FP4_DIV: otherwise (zero, subnormal, huge or non-finite mult): divide. */
enum { FP4_DIV = 0, FP4_NEAR = 1, FP4_EXACT = 2 };

/* r: 1.0f / mult, as the parameter loops compute it */
static inline int fp4_kind(float mult, float r) {
    uint32_t m = f2u(mult) & 0x7fffffffu, e = m >> 23;
    float ar = fabsf(r);
    if (((m & 0x7fffffu) == 0 && e >= 1 && e <= 254) || m == 0x00400000u) return FP4_EXACT;
    return ar >= 0x1p-126f && ar <= 0x1p126f ? FP4_NEAR : FP4_DIV;
}

static double sumsq_scalar_sq(const float *w, int64_t len, int f64) {
    double s = 0.0;
    for (int64_t j = 0; j < len; j++) s += SQ(w[j], f64);
    return s;
}

static double qint_scalar(const float *w, int8_t *q, int64_t len, float sc, float off, int asym, float qmin,
                          float qmax) {
    return qint_scalar_sq(w, q, len, sc, off, asym, qmin, qmax, 0);
}
static double fp4_scalar(const float *w, uint8_t *c, int64_t len, float mult) {
    return fp4_scalar_sq(w, c, len, mult, 0);
}
static double sumsq_scalar(const float *w, int64_t len) { return sumsq_scalar_sq(w, len, 0); }

#ifdef CVT_X86
/* ---- AVX2 row pieces: the same float32 operations, 8 lanes at a time ---------------------------- */

#define AVX __attribute__((target("avx2,f16c")))

/* 8 bf16 results of e4m3 codes times sc, as float32 (see convert/_fp8kernel.c's span_simd:
 * e4m3 bits moved into float16 bits are w * 2**-8 exactly; sc256 = sc * 256 is exact when
 * sc < 2**100; one rounding of the product, then nearest-even to bfloat16). NaN codes are
 * flagged in *nan (the caller redoes the row in scalar). */
AVX static inline __m256 fp8x8(const uint8_t *p, __m256 sc256, __m128i *nan) {
    const __m128i magm = _mm_set1_epi16(0x3f80);
    /* sign-extended code << 7: the sign lands on bit 15, its copy on bit 14 is cleared */
    __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                              _mm_set1_epi16((short)0xbf80));
    *nan = _mm_or_si128(*nan, _mm_cmpeq_epi16(_mm_and_si128(h, magm), magm)); /* magnitude 0x7f */
    __m256i b = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(h), sc256));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

AVX static inline __m256i exp_all_ones(__m256 v) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), e), e);
}

AVX static int64_t decode_avx2(const cvt_qargs *a, int64_t i, float *out) {
    int64_t k = a->k, j = 0;
    __m256i bad = _mm256_setzero_si256();
    if (a->src_kind == SRC_BF16) {
        const uint8_t *row = (const uint8_t *)a->src + 2 * i * k;
        for (; j + 8 <= k; j += 8) {
            __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * j)));
            __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
            bad = _mm256_sub_epi32(bad, exp_all_ones(v));
            _mm256_storeu_ps(out + j, v);
        }
        int64_t cnt = 0;
        for (; j < k; j++) {
            uint16_t h;
            memcpy(&h, row + 2 * j, 2);
            out[j] = u2f((uint32_t)h << 16);
            cnt += not_finite(out[j]);
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, bad);
        for (int t = 0; t < 8; t++) cnt += lanes[t];
        return cnt;
    }
    const uint8_t *row = (const uint8_t *)a->src + i * k;
    const float *srow = a->fp8_scale + (i / a->bn) * a->s_cols;
    __m128i nan = _mm_setzero_si128();
    for (int64_t c0 = 0, b = 0; c0 < k; c0 += a->bk, b++) {
        int64_t end = c0 + a->bk < k ? c0 + a->bk : k;
        float sc = srow[b];
        __m256 sc256 = _mm256_set1_ps(sc * 256.0f);
        for (j = c0; j + 8 <= end; j += 8) {
            __m256 v = fp8x8(row + j, sc256, &nan);
            bad = _mm256_sub_epi32(bad, exp_all_ones(v));
            _mm256_storeu_ps(out + j, v);
        }
        for (; j < end; j++) {
            out[j] = bf16_round(LUT[row[j]] * sc);
            bad = _mm256_sub_epi32(bad, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, not_finite(out[j])));
        }
    }
    if (_mm_movemask_epi8(nan)) return decode_scalar(a, i, out); /* a NaN code: the plain path */
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, bad);
    int64_t cnt = 0;
    for (int t = 0; t < 8; t++) cnt += lanes[t];
    return cnt;
}

AVX static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

AVX static inline float hmin8(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

AVX static inline double hsum4d(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* max |w| is exact whatever the order: the vector and scalar maxima are the same number */
AVX static float amax_avx2(const float *w, int64_t len) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(w + j), absm));
    float r = hmax8(m);
    for (; j < len; j++) {
        float v = fabsf(w[j]);
        r = v > r ? v : r;
    }
    return r;
}

AVX static void minmax_avx2(const float *w, int64_t len, float *mn, float *mx) {
    if (len < 8) {
        minmax_scalar(w, len, mn, mx);
        return;
    }
    __m256 lo = _mm256_loadu_ps(w), hi = lo;
    int64_t j = 8;
    for (; j + 8 <= len; j += 8) {
        __m256 v = _mm256_loadu_ps(w + j);
        lo = _mm256_min_ps(lo, v);
        hi = _mm256_max_ps(hi, v);
    }
    float l = hmin8(lo), h = hmax8(hi);
    for (; j < len; j++) {
        l = w[j] < l ? w[j] : l;
        h = w[j] > h ? w[j] : h;
    }
    *mn = l;
    *mx = h;
}

/* float32 squares of d, widened and added pairwise: 4 doubles */
AVX static inline __m256d sq4(__m256 d) {
    __m256 s = _mm256_mul_ps(d, d);
    return _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)), _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)));
}

/* 8 lanes of q = clamp(rint(w / sc [+ off]), qmin, qmax) stored as int8; returns the 4-double sum of
 * float32 (w - (q - off) * sc)^2 */
AVX static inline __m256d qint8(const float *w, int8_t *q, __m256 vs, __m256 vo, int asym, __m256 lo, __m256 hi) {
    __m256 v = _mm256_loadu_ps(w);
    __m256 x = _mm256_div_ps(v, vs);
    if (asym) x = _mm256_add_ps(x, vo);
    __m256 r = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
    __m256i r32 = _mm256_cvtps_epi32(r);
    __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r32), _mm256_extracti128_si256(r32, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(r16, r16));
    return sq4(_mm256_sub_ps(v, _mm256_mul_ps(_mm256_sub_ps(r, vo), vs)));
}

AVX static double qint_avx2(const float *w, int8_t *q, int64_t len, float sc, float off, int asym, float qmin,
                            float qmax) {
    const __m256 vs = _mm256_set1_ps(sc), vo = _mm256_set1_ps(off), lo = _mm256_set1_ps(qmin),
                 hi = _mm256_set1_ps(qmax);
    __m256d acc = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) acc = _mm256_add_pd(acc, qint8(w + j, q + j, vs, vo, asym, lo, hi));
    return hsum4d(acc) + qint_scalar(w + j, q + j, len - j, sc, off, asym, qmin, qmax);
}

/* a whole row of k = ng * g elements, g a multiple of 8: group t uses sc[t], off[t] */
AVX static double qint_row_avx2(const float *w, int8_t *q, int64_t k, int64_t g, const float *sc, const float *off,
                                int asym, float qmin, float qmax, double *sig) {
    const __m256 lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax);
    __m256d acc = _mm256_setzero_pd(), acc2 = _mm256_setzero_pd(); /* acc2: sum w^2 (sumsq's) */
    for (int64_t t = 0, j = 0; j < k; t++) {
        const __m256 vs = _mm256_set1_ps(sc[t]), vo = _mm256_set1_ps(off[t]);
        for (int64_t end = j + g; j < end; j += 8) {
            acc = _mm256_add_pd(acc, qint8(w + j, q + j, vs, vo, asym, lo, hi));
            acc2 = _mm256_add_pd(acc2, sq4(_mm256_loadu_ps(w + j)));
        }
    }
    *sig = hsum4d(acc2);
    return hsum4d(acc);
}

/* E2M1 index of a = min(|x|, 6) as rint of y = 2a / a / a/2 plus 0 / 2 / 4 (NaN -> 0): see
 * e2m1_idx16. *y, *r: y and rint(y), for fp4_safe8. */
AVX static inline __m256i e2m1_idx8(__m256 a, __m256 *y, __m256 *r) {
    __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_LT_OQ), big = _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ);
    __m256 f = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(2.0f), small), _mm256_set1_ps(0.5f), big);
    __m256 off = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(2)), _mm256_setzero_ps(), small),
                                  _mm256_castsi256_ps(_mm256_set1_epi32(4)), big);
    *y = _mm256_mul_ps(a, f);
    *r = _mm256_round_ps(*y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i idx = _mm256_add_epi32(_mm256_cvttps_epi32(*r), _mm256_castps_si256(off));
    return _mm256_and_si256(idx, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_ORD_Q)));
}

/* every lane of y more than 2**-17 y from a half-integer (see fp4_safe16) */
AVX static inline int fp4_safe8(__m256 y, __m256 r) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 gap = _mm256_sub_ps(_mm256_set1_ps(0.5f), _mm256_and_ps(_mm256_sub_ps(y, r), absm));
    return _mm256_movemask_ps(_mm256_cmp_ps(gap, _mm256_mul_ps(y, _mm256_set1_ps(0x1p-17f)), _CMP_GT_OQ)) == 0xff;
}

/* 8 lanes of E2M1 codes of clamp(w / mult, -6, 6), multiplying by vr = 1 / mult as fp4_kind's
 * kind allows (dividing a vector near a threshold); returns the 4-double sum of float32
 * (w - fp4 * mult)^2 */
AVX static inline __m256d fp48(const float *w, uint8_t *c, __m256 vm, __m256 vr, int kind) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), six = _mm256_set1_ps(6.0f);
    __m256 v = _mm256_loadu_ps(w), y, r;
    __m256 x = kind ? _mm256_mul_ps(v, vr) : _mm256_div_ps(v, vm);
    /* min(6, |x|): the clamp's code (a NaN stays a NaN: min returns its second operand) */
    __m256i idx = e2m1_idx8(_mm256_min_ps(six, _mm256_and_ps(x, absm)), &y, &r);
    if (kind == FP4_NEAR && !fp4_safe8(y, r)) {
        x = _mm256_div_ps(v, vm);
        idx = e2m1_idx8(_mm256_min_ps(six, _mm256_and_ps(x, absm)), &y, &r);
    }
    __m256i sgn = _mm256_srli_epi32(_mm256_castps_si256(x), 31);
    __m256i code = _mm256_or_si256(idx, _mm256_slli_epi32(sgn, 3));
    __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64((__m128i *)c, _mm_packus_epi16(c16, c16));
    __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1), idx);
    __m256 val = _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(sgn, 31)));
    return sq4(_mm256_sub_ps(v, _mm256_mul_ps(val, vm)));
}

AVX static double fp4_avx2(const float *w, uint8_t *c, int64_t len, float mult) {
    float r = 1.0f / mult;
    int kind = fp4_kind(mult, r);
    const __m256 vm = _mm256_set1_ps(mult), vr = _mm256_set1_ps(r);
    __m256d acc = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) acc = _mm256_add_pd(acc, fp48(w + j, c + j, vm, vr, kind));
    return hsum4d(acc) + fp4_scalar(w + j, c + j, len - j, mult);
}

/* a whole row, g a multiple of 8: group t uses mult[t], rcp[t] = 1 / mult[t] */
AVX static double fp4_row_avx2(const float *w, uint8_t *c, int64_t k, int64_t g, const float *mult,
                               const float *rcp, double *sig) {
    __m256d acc = _mm256_setzero_pd(), acc2 = _mm256_setzero_pd(); /* acc2: sum w^2 (sumsq's) */
    for (int64_t t = 0, j = 0; j < k; t++) {
        int kind = fp4_kind(mult[t], rcp[t]);
        const __m256 vm = _mm256_set1_ps(mult[t]), vr = _mm256_set1_ps(rcp[t]);
        for (int64_t end = j + g; j < end; j += 8) {
            acc = _mm256_add_pd(acc, fp48(w + j, c + j, vm, vr, kind));
            acc2 = _mm256_add_pd(acc2, sq4(_mm256_loadu_ps(w + j)));
        }
    }
    *sig = hsum4d(acc2);
    return hsum4d(acc);
}

/* per-group max |w| (minmax = 0) or min and max (minmax = 1) of a row, g a multiple of 8: exact
 * whatever the order, so the same numbers as the scalar loops */
AVX static void gstats_avx2(const float *w, int64_t k, int64_t g, int minmax, float *ga, float *gb) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t t = 0, j = 0; j < k; t++) {
        int64_t end = j + g;
        if (minmax) {
            __m256 lo = _mm256_loadu_ps(w + j), hi = lo;
            for (j += 8; j < end; j += 8) {
                __m256 v = _mm256_loadu_ps(w + j);
                lo = _mm256_min_ps(lo, v);
                hi = _mm256_max_ps(hi, v);
            }
            ga[t] = hmin8(lo);
            gb[t] = hmax8(hi);
        } else {
            __m256 m = _mm256_setzero_ps();
            for (; j < end; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(w + j), absm));
            ga[t] = hmax8(m);
        }
    }
}

/* ---- group parameters, 8 groups at a time (params_scalar's float32 operations in its order, as
 * params_avx512); returns how many groups it did (a multiple of 8) */

AVX static inline __m256i bf16_bits8(__m256 v) { /* bf16_rne; the NaN test is signed-safe: both sides < 2**31 */
    __m256i b = _mm256_castps_si256(v);
    __m256i rne = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                             _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)))), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rne, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)), nan);
}

AVX static inline __m256 clamp8(__m256 x, __m256 lo, __m256 hi) { /* clampf */
    x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

AVX static inline __m256i e4m3_8(__m256 f) { /* e4m3_from_f32 (b < 2**31 once the sign is off: signed compares) */
    __m256i b = _mm256_castps_si256(f), sign = _mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u));
    b = _mm256_xor_si256(b, sign);
    __m256i over = _mm256_cmpgt_epi32(b, _mm256_set1_epi32((1087 << 20) - 1));
    __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), b);
    __m256i magic = _mm256_set1_epi32(141 << 23);
    __m256i rs = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(magic))), magic);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 20), _mm256_set1_epi32(1));
    __m256i rn = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7ffffu))), odd);
    __m256i r = _mm256_blendv_epi8(_mm256_blendv_epi8(_mm256_srli_epi32(rn, 20), rs, sub), _mm256_set1_epi32(0x7f), over);
    return _mm256_and_si256(_mm256_or_si256(r, _mm256_srli_epi32(sign, 24)), _mm256_set1_epi32(0xff));
}

AVX static inline void store8_u8(uint8_t *p, __m256i v) { /* 8 lanes of 0..255 */
    __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(h, h));
}

AVX static int64_t params_avx2(const cvt_qargs *a, int64_t i, const float *ga, float *gb, float *sc, float *off) {
    int64_t ng = a->k / a->group, t = 0;
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), qdiv = _mm256_set1_ps(a->qdiv);
    const __m256 qmin = _mm256_set1_ps((float)a->qmin), qmax = _mm256_set1_ps((float)a->qmax);
    const __m256 gs = _mm256_set1_ps(a->global_scale);
    for (; t + 8 <= ng; t += 8) {
        int64_t o = i * ng + t;
        __m256 s, va = _mm256_loadu_ps(ga + t);
        if (a->mode == MODE_NVFP4) {
            s = clamp8(_mm256_mul_ps(_mm256_div_ps(va, _mm256_set1_ps(6.0f)), gs), _mm256_set1_ps(-448.0f),
                       _mm256_set1_ps(448.0f));
            __m256i code = e4m3_8(s);
            __m256 v = _mm256_i32gather_ps(LUT, code, 4);
            __m256 z = _mm256_cmp_ps(v, zero, _CMP_EQ_OQ); /* 0.125, the e4m3 eps */
            code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x20), _mm256_castps_si256(z));
            v = _mm256_blendv_ps(v, _mm256_set1_ps(0.125f), z);
            store8_u8(a->scale8 + o, code);
            s = _mm256_div_ps(v, gs);
            _mm256_storeu_ps(sc + t, s);
            _mm256_storeu_ps(gb + t, _mm256_div_ps(one, s));
            continue;
        }
        if (a->mode == MODE_MXFP4) {
            __m256i b = _mm256_castps_si256(va);
            __m256i e = _mm256_sub_epi32(
                _mm256_and_si256(_mm256_srli_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(1 << 21)), 23),
                                 _mm256_set1_epi32(0xff)), _mm256_set1_epi32(2));
            e = _mm256_min_epi32(_mm256_max_epi32(e, _mm256_setzero_si256()), _mm256_set1_epi32(254));
            store8_u8(a->scale8 + o, e);
            __m256i e0 = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
            s = _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000), e0));
            _mm256_storeu_ps(sc + t, s);
            _mm256_storeu_ps(gb + t, _mm256_div_ps(one, s));
            continue;
        }
        __m256 vo = zero;
        if (a->mode == MODE_SYM) {
            s = _mm256_div_ps(va, qdiv);
        } else { /* MODE_ASYM: lo = ga < 0 ? ga : 0, hi = gb > 0 ? gb : 0 */
            __m256 lo = _mm256_blendv_ps(zero, va, _mm256_cmp_ps(va, zero, _CMP_LT_OQ));
            __m256 vb = _mm256_loadu_ps(gb + t);
            __m256 hi = _mm256_blendv_ps(zero, vb, _mm256_cmp_ps(vb, zero, _CMP_GT_OQ));
            __m256 s0 = _mm256_div_ps(_mm256_sub_ps(hi, lo), qdiv);
            s0 = _mm256_blendv_ps(s0, one, _mm256_cmp_ps(s0, zero, _CMP_EQ_OQ));
            __m256 r = _mm256_round_ps(_mm256_sub_ps(qmin, _mm256_div_ps(lo, s0)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            vo = _mm256_add_ps(clamp8(r, qmin, qmax), zero);
            s = s0;
        }
        __m256i bits = bf16_bits8(s);
        s = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
        __m256 z = _mm256_cmp_ps(s, zero, _CMP_EQ_OQ);
        s = _mm256_blendv_ps(s, one, z);
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x3f80), _mm256_castps_si256(z));
        _mm256_storeu_ps(sc + t, s);
        _mm256_storeu_ps(off + t, vo);
        _mm256_storeu_ps(a->scale + o, s);
        if (a->scale_bf16)
            _mm_storeu_si128((__m128i *)(a->scale_bf16 + o),
                             _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
        if (a->offset) _mm256_storeu_ps(a->offset + o, vo);
    }
    return t;
}

/* ---- packing, 32 output bytes at a time (pack_row / pack_row_pair's bytes) ----------------------- */

/* out[j] = (q[2j] + bias) & 15 | ((q[2j+1] + bias) & 15) << 4 for j < pairs; returns the pairs done
 * (the caller packs the rest): within each 16-bit lane x = odd << 8 | even (nibbles),
 * x | x >> 4 holds the byte in its low half */
AVX static int64_t pack_nib_avx2(const int8_t *q, uint8_t *out, int64_t pairs, int8_t bias) {
    const __m256i b = _mm256_set1_epi8(bias), m = _mm256_set1_epi8(0x0f), lo = _mm256_set1_epi16(0xff);
    int64_t j = 0;
    for (; j + 32 <= pairs; j += 32) {
        __m256i x0 = _mm256_and_si256(_mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(q + 2 * j)), b), m);
        __m256i x1 = _mm256_and_si256(_mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(q + 2 * j + 32)), b), m);
        x0 = _mm256_and_si256(_mm256_or_si256(x0, _mm256_srli_epi16(x0, 4)), lo);
        x1 = _mm256_and_si256(_mm256_or_si256(x1, _mm256_srli_epi16(x1, 4)), lo);
        /* packus interleaves the 128-bit halves: put them back in order */
        _mm256_storeu_si256((__m256i *)(out + j), _mm256_permute4x64_epi64(_mm256_packus_epi16(x0, x1), 0xd8));
    }
    return j;
}

/* out[j] = q0[j] & 15 | (q1[j] & 15) << 4 for j < len; returns the elements done */
AVX static int64_t pack_rows_avx2(const int8_t *q0, const int8_t *q1, uint8_t *out, int64_t len) {
    const __m256i m = _mm256_set1_epi8(0x0f);
    int64_t j = 0;
    for (; j + 32 <= len; j += 32) {
        __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(q0 + j)), m);
        __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(q1 + j)), m);
        _mm256_storeu_si256((__m256i *)(out + j), _mm256_or_si256(a, _mm256_slli_epi16(b, 4))); /* b < 16: no carry */
    }
    return j;
}

AVX static double sumsq_avx2(const float *w, int64_t len) {
    __m256d acc = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m256 v = _mm256_loadu_ps(w + j);
        acc = _mm256_add_pd(acc, sq4(v));
    }
    return hsum4d(acc) + sumsq_scalar(w + j, len - j);
}

/* ---- AVX-512 row pieces: the AVX2 pieces' float32 operations, 16 lanes at a time ------------------
 * (the same IEEE operations per element, so the same codes and scales; only the SQNR sums' double
 * additions come in another order). Used when the CPU has AVX-512F and the caller allows level 2. */

#define AVX512 __attribute__((target("avx512f,avx2,f16c")))

AVX512 static inline __m512 fp8x16(const uint8_t *p, __m512 sc256, __m256i *nan) {
    const __m256i magm = _mm256_set1_epi16(0x3f80);
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                 _mm256_set1_epi16((short)0xbf80)); /* as fp8x8 */
    *nan = _mm256_or_si256(*nan, _mm256_cmpeq_epi16(_mm256_and_si256(h, magm), magm));
    __m512i b = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtph_ps(h), sc256));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

AVX512 static inline __mmask16 exp_all_ones16(__m512 v) {
    const __m512i e = _mm512_set1_epi32(0x7f800000);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), e), e);
}

/* the non-finite values of a decoded row: counted only when some vector had one (the weight is
 * then refused), not per vector */
static int64_t count_nonfinite(const float *out, int64_t k) {
    int64_t cnt = 0;
    for (int64_t j = 0; j < k; j++) cnt += not_finite(out[j]);
    return cnt;
}

AVX512 static int64_t decode_avx512(const cvt_qargs *a, int64_t i, float *out) {
    int64_t k = a->k, j = 0, cnt = 0;
    __mmask16 any = 0;
    if (a->src_kind == SRC_BF16) {
        const uint8_t *row = (const uint8_t *)a->src + 2 * i * k;
        for (; j + 16 <= k; j += 16) {
            __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * j)));
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
            any |= exp_all_ones16(v);
            _mm512_storeu_ps(out + j, v);
        }
        for (; j < k; j++) {
            uint16_t h;
            memcpy(&h, row + 2 * j, 2);
            out[j] = u2f((uint32_t)h << 16);
            cnt += not_finite(out[j]);
        }
        return any ? count_nonfinite(out, k) : cnt;
    }
    const uint8_t *row = (const uint8_t *)a->src + i * k;
    const float *srow = a->fp8_scale + (i / a->bn) * a->s_cols;
    __m256i nan = _mm256_setzero_si256();
    for (int64_t c0 = 0, b = 0; c0 < k; c0 += a->bk, b++) {
        int64_t end = c0 + a->bk < k ? c0 + a->bk : k;
        float sc = srow[b];
        __m512 sc256 = _mm512_set1_ps(sc * 256.0f);
        for (j = c0; j + 16 <= end; j += 16) {
            __m512 v = fp8x16(row + j, sc256, &nan);
            any |= exp_all_ones16(v);
            _mm512_storeu_ps(out + j, v);
        }
        for (; j < end; j++) {
            out[j] = bf16_round(LUT[row[j]] * sc);
            cnt += not_finite(out[j]);
        }
    }
    if (_mm256_movemask_epi8(nan)) return decode_scalar(a, i, out); /* a NaN code: the plain path */
    return any ? count_nonfinite(out, k) : cnt;
}

/* float32 squares of d, widened: 8 doubles */
AVX512 static inline __m512d sq8(__m512 d) {
    __m512 s = _mm512_mul_ps(d, d);
    return _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(s)),
                         _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1))));
}

AVX512 static inline __m512 op16(__m512 a, __m512 b, int mn) { return mn ? _mm512_min_ps(a, b) : _mm512_max_ps(a, b); }

/* lane t = the max (mn: min) of v[t]'s 16 lanes, for 16 vectors at once: four rounds of pairing
 * halves, quarters, pairs and lanes (one op per two vectors each) instead of one horizontal
 * reduction per vector; exact in any order, as max / min are */
AVX512 static inline __m512 reduce16x16(__m512 *v, int mn) {
    __m512 u[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* quarters (0 1 | 0 1) op (2 3 | 2 3): halves of v[2i], v[2i+1] */
        u[i] = op16(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee), mn);
    for (int i = 0; i < 4; i++) /* quarter j: 4 lanes of v[4i + j] */
        x[i] = op16(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd), mn);
    for (int i = 0; i < 2; i++) /* quarter j: 2 lanes of v[8i + j], 2 of v[8i + 4 + j] */
        y[i] = op16(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xee), mn);
    /* lane 4j + l: v[4l + j] */
    __m512 z = op16(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd), mn);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

/* per-group max |w| (minmax = 0) or min and max of a row, g a multiple of 16: small groups (16, 32:
 * one reduction per 16 or 32 elements is the loop's cost) 16 at a time through reduce16x16, the
 * rest one horizontal reduction each (larger groups keep more vectors than registers) */
AVX512 static void gstats_avx512(const float *w, int64_t k, int64_t g, int minmax, float *ga, float *gb) {
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    int64_t ng = k / g, t = 0;
    for (; g <= 32 && t + 16 <= ng; t += 16) {
        __m512 lo[16], hi[16];
        for (int u = 0; u < 16; u++) {
            const float *p = w + (t + u) * g;
            if (minmax) {
                lo[u] = hi[u] = _mm512_loadu_ps(p);
                for (int64_t j = 16; j < g; j += 16) {
                    __m512 v = _mm512_loadu_ps(p + j);
                    lo[u] = _mm512_min_ps(lo[u], v);
                    hi[u] = _mm512_max_ps(hi[u], v);
                }
            } else {
                hi[u] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p)), absm));
                for (int64_t j = 16; j < g; j += 16)
                    hi[u] = _mm512_max_ps(hi[u], _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p + j)), absm)));
            }
        }
        if (minmax) {
            _mm512_storeu_ps(ga + t, reduce16x16(lo, 1));
            _mm512_storeu_ps(gb + t, reduce16x16(hi, 0));
        } else {
            _mm512_storeu_ps(ga + t, reduce16x16(hi, 0));
        }
    }
    for (int64_t j = t * g; j < k; t++) {
        int64_t end = j + g;
        if (minmax) {
            __m512 lo = _mm512_loadu_ps(w + j), hi = lo;
            for (j += 16; j < end; j += 16) {
                __m512 v = _mm512_loadu_ps(w + j);
                lo = _mm512_min_ps(lo, v);
                hi = _mm512_max_ps(hi, v);
            }
            ga[t] = _mm512_reduce_min_ps(lo);
            gb[t] = _mm512_reduce_max_ps(hi);
        } else {
            __m512 m = _mm512_setzero_ps();
            for (; j < end; j += 16)
                m = _mm512_max_ps(m, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(w + j)), absm)));
            ga[t] = _mm512_reduce_max_ps(m);
        }
    }
}

AVX512 static double sumsq_avx512(const float *w, int64_t len) {
    __m512d acc = _mm512_setzero_pd();
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) acc = _mm512_add_pd(acc, sq8(_mm512_loadu_ps(w + j)));
    return _mm512_reduce_add_pd(acc) + sumsq_scalar(w + j, len - j);
}

/* a whole row of k = ng * g elements, g a multiple of 16 (see qint8).
 * Division is the loop's cost, and only rint(w / sc [+ off]) is kept: each 16 lanes are first
 * computed as w * (1 / sc), within 2**-22 relative of the exact quotient, and divided properly
 * only when some lane lies within a generous 2**-17 (|x| + |off| + 1) of a rounding boundary
 * (a half-integer), where the two could round apart; elsewhere both give the same integer. A
 * group whose reciprocal is not a normal float (subnormal or huge scales) always divides. */
AVX512 static double qint_row_avx512(const float *w, int8_t *q, int64_t k, int64_t g, const float *sc,
                                     const float *off, int asym, float qmin, float qmax, double *sig) {
    const __m512 lo = _mm512_set1_ps(qmin), hi = _mm512_set1_ps(qmax), half = _mm512_set1_ps(0.5f);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    __m512d acc = _mm512_setzero_pd(), acc2 = _mm512_setzero_pd(); /* acc2: sum w^2 (sumsq's) */
    for (int64_t t = 0, j = 0; j < k; t++) {
        const __m512 vs = _mm512_set1_ps(sc[t]), vo = _mm512_set1_ps(off[t]);
        float rs = 1.0f / sc[t];
        int fast = rs >= 0x1p-126f && rs <= 0x1p126f; /* sc > 0; false for NaN */
        const __m512 vr = _mm512_set1_ps(rs), slack = _mm512_set1_ps(fabsf(off[t]) + 1.0f),
                     eps = _mm512_set1_ps(0x1p-17f);
        for (int64_t end = j + g; j < end; j += 16) {
            __m512 v = _mm512_loadu_ps(w + j), x;
            if (fast) {
                x = _mm512_mul_ps(v, vr);
                if (asym) x = _mm512_add_ps(x, vo);
                __m512 edge = _mm512_add_ps(_mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), half);
                __m512 dist = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(x, edge)), absm));
                __m512 ax = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absm));
                __m512 tol = _mm512_mul_ps(_mm512_add_ps(ax, slack), eps);
                if (_mm512_cmp_ps_mask(dist, tol, _CMP_GT_OQ) != 0xffff) { /* near a boundary, or NaN */
                    x = _mm512_div_ps(v, vs);
                    if (asym) x = _mm512_add_ps(x, vo);
                }
            } else {
                x = _mm512_div_ps(v, vs);
                if (asym) x = _mm512_add_ps(x, vo);
            }
            __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
            acc2 = _mm512_add_pd(acc2, sq8(v));
            acc = _mm512_add_pd(acc, sq8(_mm512_sub_ps(v, _mm512_mul_ps(_mm512_sub_ps(r, vo), vs))));
        }
    }
    *sig = _mm512_reduce_add_pd(acc2);
    return _mm512_reduce_add_pd(acc);
}

/* E2M1 index of a = min(|x|, 6) (NaN kept) without compares against each threshold: with
 * y = 2a (a < 2), a (2 <= a < 4) or a / 2 (a >= 4) (exact), idx = rint(y) + 0, 2 or 4: e2m1_code's
 * thresholds are y's half-integers, and round-half-even ties down exactly at its strict ones
 * (0.25 1.25 2.5 5: y = 0.5 2.5 2.5 2.5) and up at its >= ones (0.75 1.75 3.5: y = 1.5 3.5 3.5);
 * a NaN gets 0, as the compares give it. *y, *r: y and rint(y), for fp4_safe16. */
AVX512 static inline __m512i e2m1_idx16(__m512 a, __m512 *y, __m512 *r) {
    __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_LT_OQ);
    __mmask16 big = _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_GE_OQ);
    __m512 f = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_set1_ps(1.0f), small, _mm512_set1_ps(2.0f)), big,
                                  _mm512_set1_ps(0.5f));
    __m512i off = _mm512_mask_mov_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(2), small, _mm512_setzero_si512()),
                                        big, _mm512_set1_epi32(4));
    *y = _mm512_mul_ps(a, f);
    *r = _mm512_roundscale_ps(*y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_add_epi32(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_cvttps_epi32(*r), off);
}

/* every lane of y more than 2**-17 y from a half-integer (a threshold; false for NaN): a quotient
 * within 2**-22 relative of this one (FP4_NEAR) has the same E2M1 index */
AVX512 static inline int fp4_safe16(__m512 y, __m512 r) {
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    __m512 h = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(y, r)), absm));
    __m512 gap = _mm512_sub_ps(_mm512_set1_ps(0.5f), h);
    return _mm512_cmp_ps_mask(gap, _mm512_mul_ps(y, _mm512_set1_ps(0x1p-17f)), _CMP_GT_OQ) == 0xffff;
}

/* a whole row, g a multiple of 16: group t uses mult[t] (see fp48: multiply by 1 / mult where
 * fp4_kind allows, dividing the vectors near a threshold) */
AVX512 static double fp4_row_avx512(const float *w, uint8_t *c, int64_t k, int64_t g, const float *mult,
                                   const float *rcp, double *sig) {
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    const __m512 table = _mm512_castps256_ps512(_mm256_loadu_ps(E2M1)), six = _mm512_set1_ps(6.0f);
    __m512d acc = _mm512_setzero_pd(), acc2 = _mm512_setzero_pd(); /* acc2: sum w^2 (sumsq's) */
    for (int64_t t = 0, j = 0; j < k; t++) {
        int kind = fp4_kind(mult[t], rcp[t]);
        const __m512 vm = _mm512_set1_ps(mult[t]), vr = _mm512_set1_ps(rcp[t]);
        for (int64_t end = j + g; j < end; j += 16) {
            __m512 v = _mm512_loadu_ps(w + j), y, r;
            __m512 x = kind ? _mm512_mul_ps(v, vr) : _mm512_div_ps(v, vm);
            /* min(6, |x|): the clamp's code (a NaN stays a NaN: min returns its second operand) */
            __m512 a = _mm512_min_ps(six, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absm)));
            __m512i idx = e2m1_idx16(a, &y, &r);
            if (kind == FP4_NEAR && !fp4_safe16(y, r)) {
                x = _mm512_div_ps(v, vm);
                a = _mm512_min_ps(six, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absm)));
                idx = e2m1_idx16(a, &y, &r);
            }
            __m512i sgn = _mm512_srli_epi32(_mm512_castps_si512(x), 31);
            __m512i code = _mm512_or_si512(idx, _mm512_slli_epi32(sgn, 3));
            _mm_storeu_si128((__m128i *)(c + j), _mm512_cvtepi32_epi8(code));
            __m512 mag = _mm512_permutexvar_ps(idx, table);
            __m512 val = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mag), _mm512_slli_epi32(sgn, 31)));
            acc2 = _mm512_add_pd(acc2, sq8(v));
            acc = _mm512_add_pd(acc, sq8(_mm512_sub_ps(v, _mm512_mul_ps(val, vm))));
        }
    }
    *sig = _mm512_reduce_add_pd(acc2);
    return _mm512_reduce_add_pd(acc);
}

/* ---- group parameters, 16 groups at a time (params_scalar's float32 operations in its order, so
 * the same bits); returns how many groups it did (a multiple of 16), params_scalar does the rest */

/* bf16_round on 16 lanes: nearest even, a NaN kept quiet (bf16_rne) */
AVX512 static inline __m512i bf16_bits16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i rne = _mm512_srli_epi32(
        _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)))), 16);
    __mmask16 nan = _mm512_cmp_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000), _MM_CMPINT_NLE);
    return _mm512_mask_mov_epi32(rne, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
}

/* clampf(x, lo, hi) = x < lo ? lo : (x > hi ? hi : x) */
AVX512 static inline __m512 clamp16(__m512 x, __m512 lo, __m512 hi) {
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), hi);
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
}

/* e4m3_from_f32 on 16 lanes (its three cases as masks; the subnormal case's float add as it is) */
AVX512 static inline __m512i e4m3_16(__m512 f) {
    __m512i b = _mm512_castps_si512(f), sign = _mm512_and_si512(b, _mm512_set1_epi32((int)0x80000000u));
    b = _mm512_xor_si512(b, sign);
    __mmask16 over = _mm512_cmp_epu32_mask(b, _mm512_set1_epi32(1087 << 20), _MM_CMPINT_NLT);
    __mmask16 sub = _mm512_cmp_epu32_mask(b, _mm512_set1_epi32(121 << 23), _MM_CMPINT_LT);
    __m512i magic = _mm512_set1_epi32(141 << 23);
    __m512i rs = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(magic))), magic);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 20), _mm512_set1_epi32(1));
    __m512i rn = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7ffffu))), odd);
    rn = _mm512_srli_epi32(rn, 20);
    __m512i r = _mm512_mask_mov_epi32(_mm512_mask_mov_epi32(rn, sub, rs), over, _mm512_set1_epi32(0x7f));
    return _mm512_and_si512(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)), _mm512_set1_epi32(0xff));
}

AVX512 static int64_t params_avx512(const cvt_qargs *a, int64_t i, const float *ga, float *gb, float *sc, float *off) {
    int64_t ng = a->k / a->group, t = 0;
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f), qdiv = _mm512_set1_ps(a->qdiv);
    const __m512 qmin = _mm512_set1_ps((float)a->qmin), qmax = _mm512_set1_ps((float)a->qmax);
    const __m512 gs = _mm512_set1_ps(a->global_scale);
    for (; t + 16 <= ng; t += 16) {
        int64_t o = i * ng + t;
        __m512 s, va = _mm512_loadu_ps(ga + t);
        if (a->mode == MODE_NVFP4) {
            s = clamp16(_mm512_mul_ps(_mm512_div_ps(va, _mm512_set1_ps(6.0f)), gs), _mm512_set1_ps(-448.0f),
                        _mm512_set1_ps(448.0f));
            __m512i code = e4m3_16(s);
            __m512 v = _mm512_i32gather_ps(code, LUT, 4);
            __mmask16 z = _mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ); /* 0.125, the e4m3 eps */
            code = _mm512_mask_mov_epi32(code, z, _mm512_set1_epi32(0x20));
            v = _mm512_mask_mov_ps(v, z, _mm512_set1_ps(0.125f));
            _mm_storeu_si128((__m128i *)(a->scale8 + o), _mm512_cvtepi32_epi8(code));
            s = _mm512_div_ps(v, gs);
            _mm512_storeu_ps(sc + t, s);
            _mm512_storeu_ps(gb + t, _mm512_div_ps(one, s));
            continue;
        }
        if (a->mode == MODE_MXFP4) {
            __m512i b = _mm512_castps_si512(va);
            __m512i e = _mm512_sub_epi32(
                _mm512_and_si512(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(1 << 21)), 23),
                                 _mm512_set1_epi32(0xff)), _mm512_set1_epi32(2));
            e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_setzero_si512()), _mm512_set1_epi32(254));
            _mm_storeu_si128((__m128i *)(a->scale8 + o), _mm512_cvtepi32_epi8(e));
            __mmask16 e0 = _mm512_cmp_epi32_mask(e, _mm512_setzero_si512(), _MM_CMPINT_EQ);
            s = _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), e0, _mm512_set1_epi32(0x00400000)));
            _mm512_storeu_ps(sc + t, s);
            _mm512_storeu_ps(gb + t, _mm512_div_ps(one, s));
            continue;
        }
        __m512 vo = zero;
        if (a->mode == MODE_SYM) {
            s = _mm512_div_ps(va, qdiv);
        } else { /* MODE_ASYM: lo = min(ga, 0) as ga < 0 ? ga : 0, hi likewise */
            __m512 lo = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(va, zero, _CMP_LT_OQ), va);
            __m512 vb = _mm512_loadu_ps(gb + t);
            __m512 hi = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(vb, zero, _CMP_GT_OQ), vb);
            __m512 s0 = _mm512_div_ps(_mm512_sub_ps(hi, lo), qdiv);
            s0 = _mm512_mask_mov_ps(s0, _mm512_cmp_ps_mask(s0, zero, _CMP_EQ_OQ), one);
            __m512 r = _mm512_roundscale_ps(_mm512_sub_ps(qmin, _mm512_div_ps(lo, s0)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            vo = _mm512_add_ps(clamp16(r, qmin, qmax), zero);
            s = s0;
        }
        __m512i bits = bf16_bits16(s);
        s = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        __mmask16 z = _mm512_cmp_ps_mask(s, zero, _CMP_EQ_OQ);
        s = _mm512_mask_mov_ps(s, z, one);
        bits = _mm512_mask_mov_epi32(bits, z, _mm512_set1_epi32(0x3f80));
        _mm512_storeu_ps(sc + t, s);
        _mm512_storeu_ps(off + t, vo);
        _mm512_storeu_ps(a->scale + o, s);
        if (a->scale_bf16) _mm256_storeu_si256((__m256i *)(a->scale_bf16 + o), _mm512_cvtepi32_epi16(bits));
        if (a->offset) _mm512_storeu_ps(a->offset + o, vo);
    }
    return t;
}

#define PICK(name, simd) ((simd) ? name##_avx2 : name##_scalar)
#elif defined(__aarch64__)
/* ---- NEON row pieces (aarch64): the scalar pieces' float32 operations, 4 or 8 lanes at a time ----
 * vdivq_f32 / vmulq_f32 / vsubq_f32 round once each as IEEE single operations (Linux leaves FPCR's
 * flush-to-zero off; -ffp-contract=off keeps them unfused), vrndnq_f32 is rintf's nearest-even, and
 * max / min are exact: the same codes and scales; only the SQNR sums' double additions come in
 * another order. */

/* 8 bf16 results of e4m3 codes times sc, as float32 (the AVX2 fp8x8's bit move and rounding) */
static inline void fp8x8_neon(const uint8_t *p, float32x4_t sc256, uint16x8_t *nan, float32x4_t *lo,
                              float32x4_t *hi) {
    const uint16x8_t magm = vdupq_n_u16(0x3f80);
    const uint32x4_t one = vdupq_n_u32(1), half = vdupq_n_u32(0x7fff), top = vdupq_n_u32(0xffff0000u);
    /* sign-extended code << 7, bit 14 (the sign's copy) cleared: as fp8x8 */
    uint16x8_t h = vandq_u16(vreinterpretq_u16_s16(vshlq_n_s16(vmovl_s8(vld1_s8((const int8_t *)p)), 7)),
                             vdupq_n_u16(0xbf80));
    *nan = vorrq_u16(*nan, vceqq_u16(vandq_u16(h, magm), magm));
    uint32x4_t bl = vreinterpretq_u32_f32(vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))), sc256));
    uint32x4_t bh = vreinterpretq_u32_f32(vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h))), sc256));
    bl = vandq_u32(vaddq_u32(bl, vaddq_u32(vandq_u32(vshrq_n_u32(bl, 16), one), half)), top);
    bh = vandq_u32(vaddq_u32(bh, vaddq_u32(vandq_u32(vshrq_n_u32(bh, 16), one), half)), top);
    *lo = vreinterpretq_f32_u32(bl);
    *hi = vreinterpretq_f32_u32(bh);
}

/* lanes of v whose exponent is all ones (Inf / NaN), as 0 / -1 */
static inline int32x4_t exp_all_ones_neon(float32x4_t v) {
    const uint32x4_t e = vdupq_n_u32(0x7f800000u);
    return vreinterpretq_s32_u32(vceqq_u32(vandq_u32(vreinterpretq_u32_f32(v), e), e));
}

static int64_t decode_neon(const cvt_qargs *a, int64_t i, float *out) {
    int64_t k = a->k, j = 0, cnt = 0;
    int32x4_t bad = vdupq_n_s32(0);
    if (a->src_kind == SRC_BF16) {
        const uint8_t *row = (const uint8_t *)a->src + 2 * i * k;
        for (; j + 4 <= k; j += 4) {
            uint16_t h4[4];
            memcpy(h4, row + 2 * j, 8);
            float32x4_t v = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(h4), 16));
            bad = vsubq_s32(bad, exp_all_ones_neon(v));
            vst1q_f32(out + j, v);
        }
        for (; j < k; j++) {
            uint16_t h;
            memcpy(&h, row + 2 * j, 2);
            out[j] = u2f((uint32_t)h << 16);
            cnt += not_finite(out[j]);
        }
        return cnt + vaddvq_s32(bad);
    }
    const uint8_t *row = (const uint8_t *)a->src + i * k;
    const float *srow = a->fp8_scale + (i / a->bn) * a->s_cols;
    uint16x8_t nan = vdupq_n_u16(0);
    for (int64_t c0 = 0, b = 0; c0 < k; c0 += a->bk, b++) {
        int64_t end = c0 + a->bk < k ? c0 + a->bk : k;
        float sc = srow[b];
        float32x4_t sc256 = vdupq_n_f32(sc * 256.0f), lo, hi;
        for (j = c0; j + 8 <= end; j += 8) {
            fp8x8_neon(row + j, sc256, &nan, &lo, &hi);
            bad = vsubq_s32(bad, vaddq_s32(exp_all_ones_neon(lo), exp_all_ones_neon(hi)));
            vst1q_f32(out + j, lo);
            vst1q_f32(out + j + 4, hi);
        }
        for (; j < end; j++) {
            out[j] = bf16_round(LUT[row[j]] * sc);
            cnt += not_finite(out[j]);
        }
    }
    if (vmaxvq_u16(nan)) return decode_scalar(a, i, out); /* a NaN code: the plain path */
    return cnt + vaddvq_s32(bad);
}

static float amax_neon(const float *w, int64_t len) {
    float32x4_t m4 = vdupq_n_f32(0.0f);
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) m4 = vmaxq_f32(m4, vabsq_f32(vld1q_f32(w + j)));
    float m = vmaxvq_f32(m4), r = amax_scalar(w + j, len - j);
    return r > m ? r : m;
}

static void minmax_neon(const float *w, int64_t len, float *mn, float *mx) {
    if (len < 4) {
        minmax_scalar(w, len, mn, mx);
        return;
    }
    float32x4_t lo4 = vld1q_f32(w), hi4 = lo4;
    int64_t j = 4;
    for (; j + 4 <= len; j += 4) {
        float32x4_t v = vld1q_f32(w + j);
        lo4 = vminq_f32(lo4, v);
        hi4 = vmaxq_f32(hi4, v);
    }
    float lo = vminvq_f32(lo4), hi = vmaxvq_f32(hi4);
    for (; j < len; j++) {
        lo = w[j] < lo ? w[j] : lo;
        hi = w[j] > hi ? w[j] : hi;
    }
    *mn = lo; /* +-0 may come out as either sign: the callers clamp through 0 (min(lo, 0), max(hi, 0)) */
    *mx = hi;
}

static inline float64x2_t sq4_neon(float64x2_t acc, float32x4_t d) {
    float32x4_t s = vmulq_f32(d, d); /* float32 squares, as the scalar path's */
    return vaddq_f64(vaddq_f64(acc, vcvt_f64_f32(vget_low_f32(s))), vcvt_high_f64_f32(s));
}

static double qint_neon(const float *w, int8_t *q, int64_t len, float sc, float off, int asym, float qmin,
                        float qmax) {
    const float32x4_t vsc = vdupq_n_f32(sc), voff = vdupq_n_f32(off), lo = vdupq_n_f32(qmin), hi = vdupq_n_f32(qmax);
    float64x2_t acc = vdupq_n_f64(0.0);
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) {
        float32x4_t v = vld1q_f32(w + j), x = vdivq_f32(v, vsc);
        if (asym) x = vaddq_f32(x, voff);
        float32x4_t r = vminq_f32(vmaxq_f32(vrndnq_f32(x), lo), hi);
        int16x4_t q16 = vmovn_s32(vcvtq_s32_f32(r));
        int32_t packed = vget_lane_s32(vreinterpret_s32_s8(vmovn_s16(vcombine_s16(q16, q16))), 0);
        memcpy(q + j, &packed, 4);
        acc = sq4_neon(acc, vsubq_f32(v, vmulq_f32(vsubq_f32(r, voff), vsc)));
    }
    return vaddvq_f64(acc) + qint_scalar(w + j, q + j, len - j, sc, off, asym, qmin, qmax);
}

static double sumsq_neon(const float *w, int64_t len) {
    float64x2_t acc = vdupq_n_f64(0.0);
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) acc = sq4_neon(acc, vld1q_f32(w + j));
    return vaddvq_f64(acc) + sumsq_scalar(w + j, len - j);
}

/* E2M1 index of a = min(|x|, 6) as rint of y = 2a / a / a/2 plus 0 / 2 / 4, NaN -> 0 (see
 * e2m1_idx16); *y, *r for fp4_safe4 */
static inline uint32x4_t e2m1_idx4(float32x4_t a, float32x4_t *y, float32x4_t *r) {
    uint32x4_t small = vcltq_f32(a, vdupq_n_f32(2.0f)), big = vcgeq_f32(a, vdupq_n_f32(4.0f));
    float32x4_t f = vbslq_f32(small, vdupq_n_f32(2.0f), vbslq_f32(big, vdupq_n_f32(0.5f), vdupq_n_f32(1.0f)));
    uint32x4_t off = vbslq_u32(small, vdupq_n_u32(0), vbslq_u32(big, vdupq_n_u32(4), vdupq_n_u32(2)));
    *y = vmulq_f32(a, f);
    *r = vrndnq_f32(*y);
    return vandq_u32(vaddq_u32(vcvtq_u32_f32(*r), off), vceqq_f32(a, a));
}

/* every lane of y more than 2**-17 y from a half-integer (see fp4_safe16) */
static inline int fp4_safe4(float32x4_t y, float32x4_t r) {
    float32x4_t gap = vsubq_f32(vdupq_n_f32(0.5f), vabsq_f32(vsubq_f32(y, r)));
    return vminvq_u32(vcgtq_f32(gap, vmulq_f32(y, vdupq_n_f32(0x1p-17f)))) != 0;
}

/* E2M1 codes of clamp(w / mult, -6, 6), 4 lanes at a time, multiplying by 1 / mult as fp4_kind
 * allows (see fp48); returns sum of float32 (w - fp4 * mult)^2 */
static double fp4_neon(const float *w, uint8_t *c, int64_t len, float mult) {
    float rc = 1.0f / mult;
    int kind = fp4_kind(mult, rc);
    const float32x4_t vm = vdupq_n_f32(mult), vr = vdupq_n_f32(rc), six = vdupq_n_f32(6.0f);
    const uint8x16x2_t table = {{vld1q_u8((const uint8_t *)E2M1), vld1q_u8((const uint8_t *)E2M1 + 16)}};
    const uint8x16_t bytes = vreinterpretq_u8_u32(vdupq_n_u32(0x03020100u));
    float64x2_t acc = vdupq_n_f64(0.0);
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) {
        float32x4_t v = vld1q_f32(w + j), y, r;
        float32x4_t x = kind ? vmulq_f32(v, vr) : vdivq_f32(v, vm);
        uint32x4_t idx = e2m1_idx4(vminq_f32(six, vabsq_f32(x)), &y, &r); /* vminq keeps a NaN */
        if (kind == FP4_NEAR && !fp4_safe4(y, r)) {
            x = vdivq_f32(v, vm);
            idx = e2m1_idx4(vminq_f32(six, vabsq_f32(x)), &y, &r);
        }
        uint32x4_t sgn = vshrq_n_u32(vreinterpretq_u32_f32(x), 31);
        uint16x4_t c16 = vmovn_u32(vorrq_u32(idx, vshlq_n_u32(sgn, 3)));
        uint32_t packed = vget_lane_u32(vreinterpret_u32_u8(vmovn_u16(vcombine_u16(c16, c16))), 0);
        memcpy(c + j, &packed, 4);
        /* E2M1[idx]: bytes 4 idx .. 4 idx + 3 of the table */
        uint8x16_t at = vaddq_u8(vreinterpretq_u8_u32(vmulq_n_u32(idx, 0x04040404u)), bytes);
        uint32x4_t mag = vreinterpretq_u32_u8(vqtbl2q_u8(table, at));
        float32x4_t val = vreinterpretq_f32_u32(veorq_u32(mag, vshlq_n_u32(sgn, 31)));
        acc = sq4_neon(acc, vsubq_f32(v, vmulq_f32(val, vm)));
    }
    return vaddvq_f64(acc) + fp4_scalar(w + j, c + j, len - j, mult);
}

/* pack_nib_avx2 / pack_rows_avx2's bytes, 16 at a time: vld2q splits even and odd elements,
 * vsli puts the odd nibble above the even one */
static int64_t pack_nib_neon(const int8_t *q, uint8_t *out, int64_t pairs, int8_t bias) {
    const uint8x16_t b = vdupq_n_u8((uint8_t)bias), m = vdupq_n_u8(0x0f);
    int64_t j = 0;
    for (; j + 16 <= pairs; j += 16) {
        uint8x16x2_t p = vld2q_u8((const uint8_t *)q + 2 * j);
        vst1q_u8(out + j, vsliq_n_u8(vandq_u8(vaddq_u8(p.val[0], b), m), vaddq_u8(p.val[1], b), 4));
    }
    return j;
}

static int64_t pack_rows_neon(const int8_t *q0, const int8_t *q1, uint8_t *out, int64_t len) {
    const uint8x16_t m = vdupq_n_u8(0x0f);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16)
        vst1q_u8(out + j, vsliq_n_u8(vandq_u8(vld1q_u8((const uint8_t *)q0 + j), m), vld1q_u8((const uint8_t *)q1 + j), 4));
    return j;
}

#define PICK(name, simd) ((simd) ? name##_neon : name##_scalar)
#else
#define PICK(name, simd) name##_scalar
#endif

/* ---- one row: decode, group statistics, quantize, error sums ---------------------------------- */

typedef struct {
    const cvt_qargs *a;
    int64_t row0, row1;
    int simd;
    float *wbuf;     /* 2 rows of k floats */
    float *gbuf;     /* 4 x k floats: per-group statistics and parameters of one row */
    int8_t *qbuf;    /* 2 rows of k codes */
    double sig, err; /* partial sums */
    int64_t bad;
    float amax;
    int failed;
} job_t;

/* group t0.. of row i's parameters from their statistics ga (max |w|, or min) and gb (max; asym):
 * int scales sc and offsets off, or fp4 multipliers sc and their reciprocals (in gb); the scale
 * outputs written. The scalar reference of params_avx512. */
static void params_scalar(const cvt_qargs *a, int64_t i, int64_t t0, const float *ga, float *gb, float *sc,
                          float *off) {
    int64_t ng = a->k / a->group;
    int asym = a->mode == MODE_ASYM, fp4 = a->mode == MODE_NVFP4 || a->mode == MODE_MXFP4;
    float qmin = (float)a->qmin, qmax = (float)a->qmax;
    for (int64_t t = t0; t < ng; t++) {
        int64_t o = i * ng + t;
        if (a->mode == MODE_SYM) {
            sc[t] = bf16_round(ga[t] / a->qdiv);
            if (sc[t] == 0.0f) sc[t] = 1.0f;
            off[t] = 0.0f;
        } else if (asym) {
            float lo = ga[t] < 0.0f ? ga[t] : 0.0f, hi = gb[t] > 0.0f ? gb[t] : 0.0f;
            float s0 = (hi - lo) / a->qdiv;
            if (s0 == 0.0f) s0 = 1.0f;
            off[t] = clampf(rintf(qmin - lo / s0), qmin, qmax) + 0.0f;
            sc[t] = bf16_round(s0);
            if (sc[t] == 0.0f) sc[t] = 1.0f;
        } else if (a->mode == MODE_NVFP4) {
            float s = clampf((ga[t] / 6.0f) * a->global_scale, -448.0f, 448.0f);
            uint8_t code = e4m3_from_f32(s);
            if (LUT[code] == 0.0f) code = 0x20; /* 0.125, the e4m3 eps */
            a->scale8[o] = code;
            sc[t] = LUT[code] / a->global_scale;
            gb[t] = 1.0f / sc[t]; /* for the SIMD loops (fp4_kind) */
        } else { /* MODE_MXFP4 */
            uint32_t bits = f2u(ga[t]);
            int64_t e = (int64_t)(((bits + (1u << 21)) >> 23) & 0xffu) - 2;
            e = e < 0 ? 0 : (e > 254 ? 254 : e);
            a->scale8[o] = (uint8_t)e;
            sc[t] = u2f(e == 0 ? 0x00400000u : (uint32_t)e << 23);
            gb[t] = 1.0f / sc[t];
        }
        if (!fp4) {
            a->scale[o] = sc[t];
            if (a->scale_bf16) a->scale_bf16[o] = (uint16_t)(f2u(sc[t]) >> 16); /* a bf16 value */
            if (a->offset) a->offset[o] = off[t];
        }
    }
}

/* quantize row i (decoded in w) into codes q (int8 values, or fp4 codes), scales to row i's slots.
 * Two phases: each group's statistics and scale (scalar formulas, outputs written), then the
 * elements -- per group, or in one loop over the row when SIMD runs and g is a multiple of 8. */
static void quantize_row(job_t *jb, int64_t i, const float *w, int8_t *q) {
    const cvt_qargs *a = jb->a;
    int64_t k = a->k, g = a->group, ng = k / g;
    int simd = jb->simd, f64 = (int)a->f64_squares, row = simd && !f64 && g % 8 == 0;
    int row512 = simd == 2 && !f64 && g % 16 == 0; /* 16-lane pieces where the groups fit them */
#ifndef CVT_X86
    (void)row, (void)row512; /* whole-row pieces are x86's; NEON works group by group (PICK) */
#endif
    int asym = a->mode == MODE_ASYM, fp4 = a->mode == MODE_NVFP4 || a->mode == MODE_MXFP4;
    float qmin = (float)a->qmin, qmax = (float)a->qmax;
    float *ga = jb->gbuf, *gb = ga + ng, *sc = gb + ng, *off = sc + ng; /* sc: the fp4 multipliers too */
#ifdef CVT_X86
    if (row512)
        gstats_avx512(w, k, g, asym, ga, gb);
    else if (row)
        gstats_avx2(w, k, g, asym, ga, gb);
    else
#endif
        for (int64_t t = 0; t < ng; t++) {
            if (asym)
                PICK(minmax, simd)(w + t * g, g, ga + t, gb + t);
            else
                ga[t] = PICK(amax, simd)(w + t * g, g);
        }
    int64_t t0 = 0; /* groups whose parameters the SIMD loops computed */
#ifdef CVT_X86
    if (simd == 2) t0 = params_avx512(a, i, ga, gb, sc, off);
    else if (simd) t0 = params_avx2(a, i, ga, gb, sc, off);
#endif
    params_scalar(a, i, t0, ga, gb, sc, off);
    double err = 0.0;
#ifdef CVT_X86
    if (row) { /* the whole-row loops add up sum w^2 too, in the same pass */
        double sig = 0.0;
        if (row512)
            jb->err += fp4 ? fp4_row_avx512(w, (uint8_t *)q, k, g, sc, gb, &sig)
                           : qint_row_avx512(w, q, k, g, sc, off, asym, qmin, qmax, &sig);
        else
            jb->err += fp4 ? fp4_row_avx2(w, (uint8_t *)q, k, g, sc, gb, &sig)
                           : qint_row_avx2(w, q, k, g, sc, off, asym, qmin, qmax, &sig);
        jb->sig += sig;
        return;
    }
#endif
    for (int64_t t = 0; t < ng; t++) {
        const float *wg = w + t * g;
        int8_t *qg = q + t * g;
        if (fp4)
            err += f64 ? fp4_scalar_sq(wg, (uint8_t *)qg, g, sc[t], 1) : PICK(fp4, simd)(wg, (uint8_t *)qg, g, sc[t]);
        else
            err += f64 ? qint_scalar_sq(wg, qg, g, sc[t], off[t], asym, qmin, qmax, 1)
                       : PICK(qint, simd)(wg, qg, g, sc[t], off[t], asym, qmin, qmax);
    }
    jb->err += err;
#ifdef CVT_X86
    if (simd == 2 && !f64) {
        jb->sig += sumsq_avx512(w, k);
        return;
    }
#endif
    jb->sig += f64 ? sumsq_scalar_sq(w, k, 1) : PICK(sumsq, simd)(w, k);
}

/* the packers' SIMD part (0 where there is none): the pairs / elements it did */
static int64_t pack_nib_simd(int simd, const int8_t *q, uint8_t *out, int64_t pairs, int8_t bias) {
#ifdef CVT_X86
    if (simd) return pack_nib_avx2(q, out, pairs, bias);
#elif defined(__aarch64__)
    if (simd) return pack_nib_neon(q, out, pairs, bias);
#endif
    (void)simd, (void)q, (void)out, (void)pairs, (void)bias;
    return 0;
}

static int64_t pack_rows_simd(int simd, const int8_t *q0, const int8_t *q1, uint8_t *out, int64_t len) {
#ifdef CVT_X86
    if (simd) return pack_rows_avx2(q0, q1, out, len);
#elif defined(__aarch64__)
    if (simd) return pack_rows_neon(q0, q1, out, len);
#endif
    (void)simd, (void)q0, (void)q1, (void)out, (void)len;
    return 0;
}

/* compressed-tensors int32 words are little-endian (x86-64, aarch64): element i of 8 at bits 4i
 * is byte i / 2's nibble i % 2, so the SIMD byte packer writes their full pairs */
static void pack_row(const cvt_qargs *a, int64_t i, const int8_t *q, int simd) {
    int64_t k = a->k;
    if (a->pack == PACK_I8) {
        memcpy((int8_t *)a->q + i * k, q, (size_t)k);
    } else if (a->pack == PACK_CT32) {
        int64_t words = (k + 7) / 8;
        uint32_t *out = (uint32_t *)a->q + i * words;
        int64_t full = pack_nib_simd(simd, q, (uint8_t *)out, k / 2, 8) / 4; /* whole words done */
        for (int64_t w = full; w < k / 8; w++) {
            const int8_t *p = q + 8 * w;
            uint32_t v = 0;
            for (int b = 0; b < 8; b++) v |= (uint32_t)((p[b] + 8) & 0xf) << (4 * b);
            out[w] = v;
        }
        if (k / 8 < words) {
            int64_t last = k / 8;
            uint32_t v = 0;
            for (int64_t b = 0; 8 * last + b < k; b++) v |= (uint32_t)((q[8 * last + b] + 8) & 0xf) << (4 * b);
            out[last] = v;
        }
    } else if (a->pack == PACK_NIB_K || a->pack == PACK_FP4) {
        uint8_t *out = (uint8_t *)a->q + i * (k / 2);
        for (int64_t j = pack_nib_simd(simd, q, out, k / 2, 0); j < k / 2; j++)
            out[j] = (uint8_t)(((uint8_t)q[2 * j] & 0xf) | (((uint8_t)q[2 * j + 1] & 0xf) << 4));
    }
}

static void pack_row_pair(const cvt_qargs *a, int64_t i, const int8_t *q0, const int8_t *q1, int simd) {
    int64_t k = a->k;
    uint8_t *out = (uint8_t *)a->q + (i / 2) * k;
    for (int64_t j = pack_rows_simd(simd, q0, q1, out, k); j < k; j++)
        out[j] = (uint8_t)(((uint8_t)q0[j] & 0xf) | (((uint8_t)q1[j] & 0xf) << 4));
}

/* max |w| of row i without decoding it (MODE_AMAX: nvfp4's global scale, a fused group's):
 * e4m3fn and bf16 magnitudes order like their bit patterns (sign bit cleared), and
 * bf16(x * s) is monotonic in x for a fixed scale s, so each FP8 block's largest magnitude code
 * gives the block's max |w| exactly, as decoding every element would. Returns how many blocks
 * hold a non-finite value (a NaN code, or a product that is not finite: the caller only needs
 * whether any does). */
static int64_t amax_row(const cvt_qargs *a, int64_t i, float *out) {
    int64_t k = a->k, bad = 0;
    float m = 0.0f;
    if (a->src_kind == SRC_BF16) {
        const uint8_t *row = (const uint8_t *)a->src + 2 * i * k;
        uint16_t mx = 0;
        for (int64_t j = 0; j < k; j++) {
            uint16_t h;
            memcpy(&h, row + 2 * j, 2);
            h &= 0x7fff;
            mx = h > mx ? h : mx;
        }
        if (mx >= 0x7f80) bad = 1; /* an Inf or a NaN */
        else m = u2f((uint32_t)mx << 16);
    } else {
        const uint8_t *row = (const uint8_t *)a->src + i * k;
        const float *srow = a->fp8_scale + (i / a->bn) * a->s_cols;
        for (int64_t b0 = 0; b0 < k; b0 += a->bk) {
            int64_t b1 = b0 + a->bk < k ? b0 + a->bk : k;
            uint8_t mc = 0;
            for (int64_t j = b0; j < b1; j++) {
                uint8_t c = row[j] & 0x7f;
                mc = c > mc ? c : mc;
            }
            float v = fabsf(bf16_round(LUT[mc] * srow[b0 / a->bk]));
            if (mc == 0x7f || not_finite(v)) { bad++; continue; }
            m = v > m ? v : m;
        }
    }
    *out = m;
    return bad;
}

static int64_t decode(job_t *jb, int64_t i, float *out) {
#ifdef CVT_X86
    if (jb->simd == 2) return decode_avx512(jb->a, i, out);
    if (jb->simd) return decode_avx2(jb->a, i, out);
#elif defined(__aarch64__)
    if (jb->simd) return decode_neon(jb->a, i, out);
#endif
    return decode_scalar(jb->a, i, out);
}

static void *run(void *arg) {
    job_t *jb = (job_t *)arg;
    const cvt_qargs *a = jb->a;
    int64_t k = a->k;
    if (a->mode == MODE_AMAX) {
        float m = 0.0f;
        for (int64_t i = jb->row0; i < jb->row1; i++) {
            float r;
            jb->bad += amax_row(a, i, &r);
            m = r > m ? r : m;
        }
        jb->amax = m;
        return NULL;
    }
    if (a->pack == PACK_NIB_ROWS) {
        for (int64_t i = jb->row0; i + 1 < jb->row1; i += 2) {
            jb->bad += decode(jb, i, jb->wbuf) + decode(jb, i + 1, jb->wbuf + k);
            quantize_row(jb, i, jb->wbuf, jb->qbuf);
            quantize_row(jb, i + 1, jb->wbuf + k, jb->qbuf + k);
            pack_row_pair(a, i, jb->qbuf, jb->qbuf + k, jb->simd);
        }
        return NULL;
    }
    for (int64_t i = jb->row0; i < jb->row1; i++) {
        jb->bad += decode(jb, i, jb->wbuf);
        int8_t *q = a->pack == PACK_I8 ? (int8_t *)a->q + i * k : jb->qbuf;
        quantize_row(jb, i, jb->wbuf, q);
        if (a->pack != PACK_I8) pack_row(a, i, q, jb->simd);
    }
    return NULL;
}

/* The SIMD level cvt_quantize runs at when the caller allows `allowed` (scales permitting):
 * 0 scalar, 1 AVX2, 2 AVX-512 (`cvt.quant.qkernel.simd_in_use`). */
int cvt_simd_level(int64_t allowed) {
    if (allowed <= 0 || !cpu_simd()) return 0;
    return allowed >= 2 && cpu_avx512() ? 2 : 1;
}

/* Returns 0, or -1 on bad arguments, -2 when out of memory. See cvt_qargs for the buffers. */
int cvt_quantize(const cvt_qargs *a) {
    pthread_once(&lut_once, init_lut);
    int64_t n = a->n, k = a->k;
    if (n < 0 || k <= 0 || a->group <= 0 || k % a->group) return -1;
    if (a->mode < MODE_AMAX || a->mode > MODE_MXFP4 || a->pack < PACK_I8 || a->pack > PACK_FP4) return -1;
    if (a->src_kind == SRC_FP8 && (a->bn <= 0 || a->bk <= 0 || a->s_cols < (k + a->bk - 1) / a->bk)) return -1;
    if ((a->pack == PACK_NIB_ROWS && n % 2) || ((a->pack == PACK_NIB_K || a->pack == PACK_FP4) && k % 2)) return -1;
    /* SIMD level: 0 scalar, 1 AVX2, 2 AVX-512; the caller's a->simd is the highest it allows */
    int simd = a->simd > 0 && cpu_simd() &&
               (a->src_kind != SRC_FP8 || fp8_scales_simd_ok(a->fp8_scale, ((n + a->bn - 1) / a->bn) * a->s_cols));
    if (simd && a->simd >= 2 && cpu_avx512()) simd = 2;
    int64_t nt = a->nthreads < 1 ? 1 : (a->nthreads > 64 ? 64 : a->nthreads);
    int64_t unit = a->pack == PACK_NIB_ROWS ? 2 : 1, units = (n + unit - 1) / unit;
    if (nt > units) nt = units > 0 ? units : 1;
    int64_t per = (units + nt - 1) / nt * unit;
    job_t jobs[64];
    int failed = 0;
    for (int64_t t = 0; t < nt; t++) {
        job_t jb = {a, t * per < n ? t * per : n, (t + 1) * per < n ? (t + 1) * per : n, simd, NULL, NULL, NULL,
                    0.0, 0.0, 0, 0.0f, 0};
        jb.wbuf = (float *)malloc(sizeof(float) * 2 * (size_t)k);
        jb.gbuf = (float *)malloc(sizeof(float) * 4 * (size_t)k);
        jb.qbuf = (int8_t *)malloc(2 * (size_t)k);
        if (!jb.wbuf || !jb.gbuf || !jb.qbuf) failed = 1;
        jobs[t] = jb;
    }
    if (!failed) run_jobs(run, jobs, sizeof(job_t), nt);
    double sig = 0.0, err = 0.0;
    int64_t bad = 0;
    float m = 0.0f;
    for (int64_t t = 0; t < nt; t++) {
        sig += jobs[t].sig;
        err += jobs[t].err;
        bad += jobs[t].bad;
        m = jobs[t].amax > m ? jobs[t].amax : m;
        free(jobs[t].wbuf);
        free(jobs[t].gbuf);
        free(jobs[t].qbuf);
    }
    if (failed) return -2;
    if (a->sums) {
        a->sums[0] = sig;
        a->sums[1] = err;
    }
    if (a->nonfinite) *a->nonfinite = bad;
    if (a->amax) *a->amax = m;
    return 0;
}

/* compressed-tensors zero points: offsets float32 [n, ng] (integers -8..7) -> int32 [ceil(n/8), ng],
 * value + 8 of row 8w + i at bits 4i of word (w, t), zero nibbles past row n
 * (`cvt.quant.primitives.pack_int4_ct(offset, dim=0)`) */
void cvt_pack_zero_points(const float *offset, uint32_t *out, int64_t n, int64_t ng) {
    for (int64_t w = 0; w < (n + 7) / 8; w++)
        for (int64_t t = 0; t < ng; t++) {
            uint32_t v = 0;
            for (int64_t i = 0; i < 8 && 8 * w + i < n; i++)
                v |= (uint32_t)(((int)offset[(8 * w + i) * ng + t] + 8) & 0xf) << (4 * i);
            out[w * ng + t] = v;
        }
}

#ifndef CVT_NO_PYTHON
static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_qkernel",
                                    "fused RTN quantization kernels (called through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__qkernel(void) { return PyModule_Create(&moddef); }
#endif
