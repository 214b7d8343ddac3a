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
 *   mx8 / mx4  msModelSlim's Ascend 950 MX blocks of 32 (`cvt.qtensor.mx`): se = se_lut[bf16(amax32)]
 *              (the table is the reference's own `shared_exponent` of every bf16 value, so its log2 and
 *              bf16 roundings are the reference's), mult = 2**se, v = w / mult; mx8: pe = max(e(|v|), -6),
 *              val = sign * floor(|v / 2**pe * 8| + 0.5) / 8 * 2**pe clamped to 448, stored e4m3; mx4:
 *              pe = clamp(e(|v| + 9.6e-7), 0, 2), val = sign * min(floor(|v| / 2**pe * 2 + 0.5) / 2 * 2**pe,
 *              6), stored E2M1 (sign from the product, as torch.sign(v) * ... gives). e(x): the binary
 *              exponent; where torch's floor(log2(x)) differs (x just under a power of two), the
 *              rounding lands on that power either way, so the values are the same.
 *
 * rint is round-half-even (torch.round). Packings (`cvt.quant.primitives`): int8 [n, k];
 * compressed-tensors int32 [n, ceil(k/8)] (value + 8, element i of 8 at bits 4i, zero padding);
 * Ascend int8 nibbles along k [n, k/2] or in output-row pairs [n/2, k] (even element low);
 * fp4 codes [n, k/2] (even element low).
 *
 * The SQNR sums sum(w^2) and sum((w - w_hat)^2), w_hat the dequantized value computed in float32
 * exactly as the schemes' `dequantize` does: float32 squares (so they underflow where the
 * reference's float32 dot products do) accumulated in double (the SIMD row loops: in float32 over
 * SQ_SPAN elements first), in another order than the reference's: the dB figures agree to a
 * tolerance, not bit for bit, and differ in their last digits between SIMD levels.
 *
 * Rows are split over `nthreads` pthreads; each thread keeps one or two decoded rows (k floats)
 * and their int8 codes, so temporaries stay a few rows whatever the weight's size. Non-finite
 * values are counted, not quantized: the caller refuses the weight (its outputs are garbage).
 * On x86-64 with AVX2 + F16C (checked at run time) the inner loops are vectorized with the same
 * operations, 8 lanes, or 16 with AVX-512F (`simd` 2, where the CPU has it), and on aarch64 with
 * NEON (`simd` 1: decode, group statistics and parameters, int and fp4 codes, sums, packing):
 * bit-identical codes and scales (the tests compare every level with the scalar path; NEON under
 * qemu, tests/kernels/neon_harness.c). Those pieces live in _qkernel_avx2.h, _qkernel_avx512.h
 * and _qkernel_neon.h, parts of this file included below (with _qkernel_amax.h, the global-scale
 * pass). The module init below only exists so that
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
enum { MODE_AMAX = 0, MODE_SYM = 1, MODE_ASYM = 2, MODE_NVFP4 = 3, MODE_MXFP4 = 4, MODE_MX8 = 5, MODE_MX4 = 6 };
enum { PACK_I8 = 0, PACK_CT32 = 1, PACK_NIB_K = 2, PACK_NIB_ROWS = 3, PACK_FP4 = 4, PACK_E4M3 = 5 };
#define IS_MX(mode) ((mode) == MODE_MX8 || (mode) == MODE_MX4)
#define MX_BAD_SE 0x7fff /* se_lut: a block max whose shared exponent E8M0 cannot hold */

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
    const int16_t *se_lut;  /* MODE_MX8 / MODE_MX4: shared exponent by the bf16 bits of a block's max */
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
        q[j] = r == r ? (int8_t)r : 0; /* NaN (a weight then refused): converting it is undefined */
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

/* msModelSlim's MX elements of one block (module comment): codes c, the squared error of w against
 * the dequantized val * mult. Bit tricks where libm calls would dominate: e(x) from the exponent
 * field (x >= 0 finite; a subnormal, below any pe the clamps allow, reads as the clamp), 2**pe as
 * bits (-6 <= pe <= 2 or 8), floor of a non-negative value below 2**31 as a truncating cast; v = w
 * times 1 / mult, the same correctly rounded value as w / mult for a power of two mult (FP4_EXACT). */
static inline int exp_field(float x) { return (int)((f2u(x) >> 23) & 0xffu) - 127; }
static inline float pow2f(int e) { return u2f((uint32_t)(e + 127) << 23); }
static inline float floor_pos(float x) { return (float)(int32_t)x; }
static inline float pow2_e8m0(int e) { return e == -127 ? u2f(0x00400000u) : pow2f(e); } /* -127 <= e <= 127 */

static double mx_scalar_sq(const float *w, uint8_t *c, int64_t len, float mult, int fp8, int f64) {
    double err = 0.0;
    float r = 1.0f / mult;
    for (int64_t j = 0; j < len; j++) {
        float v = w[j] * r, val;
        if (fp8) {
            int pe = exp_field(v); /* v == 0 and subnormals: -127, clamped as torch's -6 */
            pe = pe < -6 ? -6 : pe;
            float p2 = pow2f(pe);
            float a = v / p2 * 8.0f;
            float s = (float)((a > 0.0f) - (a < 0.0f));
            val = clampf(s * floor_pos(fabsf(a) + 0.5f) / 8.0f * p2, -448.0f, 448.0f);
            c[j] = e4m3_from_f32(val);
        } else {
            float b = fabsf(v);
            int pe = exp_field(b + 9.6e-7f);
            pe = pe < 0 ? 0 : (pe > 2 ? 2 : pe);
            float p2 = pow2f(pe);
            float m = floor_pos(b / p2 * 2.0f + 0.5f);
            float s = (float)((v > 0.0f) - (v < 0.0f));
            val = s * clampf(m / 2.0f * p2, -6.0f, 6.0f);
            c[j] = e2m1_code(val);
        }
        float d = w[j] - val * mult;
        err += SQ(d, f64);
    }
    return err;
}

/* ---- fp4 codes without a division ----------------------------------------------------------------
 * The SIMD fp4 loops only need e2m1_code(w / mult), and a vector division may be their largest cost.
 * FP4_EXACT: mult is a power of two whose reciprocal is a float (every mxfp4 multiplier 2**(e-127),
 *   e = 0..254: 1/mult = 2**(127-e) in [2**-127, 2**127]): w * (1/mult) and w / mult are the one
 *   correctly rounded value of the same real number (subnormal, overflowing and NaN results too).
 *   Every SIMD level multiplies these.
 * FP4_NEAR: 1/mult is a normal float: w * (1/mult) is within 3 * 2**-24 relative of w / mult (or
 *   both are below 2**-125, far under the first threshold), so the code is the same unless |x|
 *   lies within that of a threshold; NEON checks each vector against a generous 2**-17 |x| and
 *   divides the vectors where some lane is that near (or NaN). The x86 loops divide instead: on
 *   the AMD EPYC (Zen 4) measured, vdivps beat the multiply and check (AVX-512 nvfp4 1.20 vs
 *   1.09 GB/s, AVX2 0.90 vs 0.82); aarch64 cores divide 4 lanes several times slower than they
 *   multiply (not measured here: no aarch64 machine).
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

/* The SIMD row loops add their SQNR squares in float32 lanes over spans of SQ_SPAN elements of a
 * row (a multiple of 16), then widen each span's sums into double: double adds per element
 * (convert, add) cost ~30% of the fp4 row loop, and float32 over 256 elements (16 or 32 adds a
 * lane) keeps the sums within ~2e-6 relative (the reference's float32 dot products add 1M
 * elements at a time). A
 * float32 sum that overflows gives inf, and the caller redoes the weight with f64_squares, as
 * for one square that overflows. */
#define SQ_SPAN 256

#ifdef CVT_X86
#include "_qkernel_avx2.h"   /* AVX2 row pieces */
#include "_qkernel_avx512.h" /* AVX-512 row pieces */
#define PICK(name, simd) ((simd) ? name##_avx2 : name##_scalar)
#elif defined(__aarch64__)
#include "_qkernel_neon.h" /* NEON row pieces */
#define PICK(name, simd) ((simd) ? name##_neon : name##_scalar)
#else
#define PICK(name, simd) name##_scalar
#endif

#include "_qkernel_amax.h" /* MODE_AMAX: max |w| without decoding */

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
        } else if (IS_MX(a->mode)) {
            int se = a->se_lut[bf16_rne(ga[t])];
            a->scale8[o] = se == MX_BAD_SE ? 255 : (uint8_t)(se + 127);
            /* 2**se and 2**-se (ldexpf's values and 1.0f / 2**se's; se = -127 or 127 gives the subnormal
             * 2**-127); NaN: the sums say so, the caller refuses */
            sc[t] = se == MX_BAD_SE ? NAN : pow2_e8m0(se);
            gb[t] = se == MX_BAD_SE ? NAN : pow2_e8m0(-se); /* for the SIMD row loops */
        } else { /* MODE_MXFP4 */
            uint32_t bits = f2u(ga[t]);
            int64_t e = (int64_t)(((bits + (1u << 21)) >> 23) & 0xffu) - 2;
            e = e < 0 ? 0 : (e > 254 ? 254 : e);
            a->scale8[o] = (uint8_t)e;
            sc[t] = u2f(e == 0 ? 0x00400000u : (uint32_t)e << 23);
            gb[t] = 1.0f / sc[t];
        }
        if (!fp4 && !IS_MX(a->mode)) {
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
    int mx = IS_MX(a->mode);
#ifdef CVT_X86
    if (simd == 2 && !mx) t0 = params_avx512(a, i, ga, gb, sc, off);
    else if (simd && !mx) t0 = params_avx2(a, i, ga, gb, sc, off);
    else if (simd) t0 = params_mx_avx2(a, i, ga, gb, sc);
#elif defined(__aarch64__)
    if (simd && !mx) t0 = params_neon(a, i, ga, gb, sc, off);
#endif
    params_scalar(a, i, t0, ga, gb, sc, off);
    double err = 0.0;
    if (mx) { /* AVX2 row pieces on x86-64 (AVX-512 machines too), else scalar; the squares of w as below */
#ifdef CVT_X86
        if (simd && !f64) {
            double sig = 0.0;
            jb->err += (a->mode == MODE_MX8 ? mx8_row_avx2 : mx4_row_avx2)(w, (uint8_t *)q, k, sc, gb,
                                                                          a->scale8 + i * ng, &sig);
            jb->sig += sig;
            return;
        }
#endif
        for (int64_t t = 0; t < ng; t++)
            err += mx_scalar_sq(w + t * g, (uint8_t *)q + t * g, g, sc[t], a->mode == MODE_MX8, f64);
        jb->err += err;
        jb->sig += f64 ? sumsq_scalar_sq(w, k, 1) : PICK(sumsq, simd)(w, k);
        return;
    }
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
    if (a->pack == PACK_I8 || a->pack == PACK_E4M3) {
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
            jb->bad += amax_row(a, i, &r, jb->simd);
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
        int direct = a->pack == PACK_I8 || a->pack == PACK_E4M3; /* one code byte per element */
        int8_t *q = direct ? (int8_t *)a->q + i * k : jb->qbuf;
        quantize_row(jb, i, jb->wbuf, q);
        if (!direct) pack_row(a, i, q, jb->simd);
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
    if (a->mode < MODE_AMAX || a->mode > MODE_MX4 || a->pack < PACK_I8 || a->pack > PACK_E4M3) return -1;
    if (IS_MX(a->mode) && (!a->se_lut || a->group != 32 || (a->pack == PACK_E4M3) != (a->mode == MODE_MX8))) return -1;
    if (a->src_kind == SRC_FP8 && (a->bn <= 0 || a->bk <= 0 || a->s_cols < (k + a->bk - 1) / a->bk)) return -1;
    if ((a->pack == PACK_NIB_ROWS && n % 2) || ((a->pack == PACK_NIB_K || a->pack == PACK_FP4) && k % 2)) return -1;
    /* SIMD level: 0 scalar, 1 AVX2, 2 AVX-512; the caller's a->simd is the highest it allows */
    int simd = a->simd > 0 && cpu_simd() &&
               (a->src_kind != SRC_FP8 || fp8_scales_simd_ok(a->fp8_scale, ((n + a->bn - 1) / a->bn) * a->s_cols));
    if (simd && a->simd >= 2 && cpu_avx512()) simd = 2;
    if (a->mode == MODE_AMAX && a->src_kind == SRC_FP8) {
        float m = 0.0f;
        int64_t bad = 0;
        if (amax_fp8_pruned(a, simd, &m, &bad)) {
            if (a->nonfinite) *a->nonfinite = bad;
            if (a->amax) *a->amax = m;
            return 0;
        }
    }
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
