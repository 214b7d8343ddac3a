/*
 * The aarch64 NEON row pieces of quant/_qkernel.c: included by it alone, after its scalar pieces,
 * types and fp4 helpers, which these use; not a header of its own. Tested under qemu
 * (tests/kernels/neon_harness.c, tests/convert/test_neon_kernels.py).
 */
#ifndef CVT_QKERNEL_NEON_H
#define CVT_QKERNEL_NEON_H

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
            fp8x8_neon(row + j, sc256, &nan, &lo, &hi); /* finite unless a NaN code: see decode_avx2 */
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

/* ---- group parameters, 4 groups at a time (params_scalar's float32 operations in its order, as
 * params_avx512); returns how many groups it did (a multiple of 4) */

static inline uint32x4_t bf16_bits4(float32x4_t v) { /* bf16_rne */
    uint32x4_t b = vreinterpretq_u32_f32(v);
    uint32x4_t rne = vshrq_n_u32(vaddq_u32(b, vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1)))), 16);
    uint32x4_t nan = vcgtq_u32(vandq_u32(b, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u));
    return vbslq_u32(nan, vorrq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(0x40)), rne);
}

static inline float32x4_t clamp4(float32x4_t x, float32x4_t lo, float32x4_t hi) { /* clampf */
    x = vbslq_f32(vcgtq_f32(x, hi), hi, x);
    return vbslq_f32(vcltq_f32(x, lo), lo, x);
}

static inline uint32x4_t e4m3_4(float32x4_t f) { /* e4m3_from_f32, its three cases as masks */
    uint32x4_t b = vreinterpretq_u32_f32(f), sign = vandq_u32(b, vdupq_n_u32(0x80000000u));
    b = veorq_u32(b, sign);
    uint32x4_t over = vcgeq_u32(b, vdupq_n_u32(1087u << 20)), sub = vcltq_u32(b, vdupq_n_u32(121u << 23));
    uint32x4_t magic = vdupq_n_u32(141u << 23);
    uint32x4_t rs = vsubq_u32(vreinterpretq_u32_f32(vaddq_f32(vreinterpretq_f32_u32(b), vreinterpretq_f32_u32(magic))), magic);
    uint32x4_t odd = vandq_u32(vshrq_n_u32(b, 20), vdupq_n_u32(1));
    uint32x4_t rn = vshrq_n_u32(vaddq_u32(vaddq_u32(b, vdupq_n_u32(((uint32_t)(7 - 127) << 23) + 0x7ffffu)), odd), 20);
    uint32x4_t r = vbslq_u32(over, vdupq_n_u32(0x7f), vbslq_u32(sub, rs, rn));
    return vandq_u32(vorrq_u32(r, vshrq_n_u32(sign, 24)), vdupq_n_u32(0xff));
}

static inline void store4_u8(uint8_t *p, uint32x4_t v) { /* 4 lanes of 0..255 */
    uint16x4_t h = vmovn_u32(v);
    uint32_t packed = vget_lane_u32(vreinterpret_u32_u8(vmovn_u16(vcombine_u16(h, h))), 0);
    memcpy(p, &packed, 4);
}

static int64_t params_neon(const cvt_qargs *a, int64_t i, const float *ga, float *gb, float *sc, float *off) {
    int64_t ng = a->k / a->group, t = 0;
    const float32x4_t zero = vdupq_n_f32(0.0f), one = vdupq_n_f32(1.0f), qdiv = vdupq_n_f32(a->qdiv);
    const float32x4_t qmin = vdupq_n_f32((float)a->qmin), qmax = vdupq_n_f32((float)a->qmax);
    const float32x4_t gs = vdupq_n_f32(a->global_scale);
    for (; t + 4 <= ng; t += 4) {
        int64_t o = i * ng + t;
        float32x4_t s, va = vld1q_f32(ga + t);
        if (a->mode == MODE_NVFP4) {
            s = clamp4(vmulq_f32(vdivq_f32(va, vdupq_n_f32(6.0f)), gs), vdupq_n_f32(-448.0f), vdupq_n_f32(448.0f));
            uint32x4_t code = e4m3_4(s);
            float lut[4] = {LUT[vgetq_lane_u32(code, 0)], LUT[vgetq_lane_u32(code, 1)], LUT[vgetq_lane_u32(code, 2)],
                            LUT[vgetq_lane_u32(code, 3)]};
            float32x4_t v = vld1q_f32(lut);
            uint32x4_t z = vceqq_f32(v, zero); /* 0.125, the e4m3 eps */
            code = vbslq_u32(z, vdupq_n_u32(0x20), code);
            v = vbslq_f32(z, vdupq_n_f32(0.125f), v);
            store4_u8(a->scale8 + o, code);
            s = vdivq_f32(v, gs);
            vst1q_f32(sc + t, s);
            vst1q_f32(gb + t, vdivq_f32(one, s));
            continue;
        }
        if (a->mode == MODE_MXFP4) {
            int32x4_t e = vsubq_s32(vreinterpretq_s32_u32(vandq_u32(
                                        vshrq_n_u32(vaddq_u32(vreinterpretq_u32_f32(va), vdupq_n_u32(1u << 21)), 23),
                                        vdupq_n_u32(0xff))), vdupq_n_s32(2));
            e = vminq_s32(vmaxq_s32(e, vdupq_n_s32(0)), vdupq_n_s32(254));
            uint32x4_t eu = vreinterpretq_u32_s32(e);
            store4_u8(a->scale8 + o, eu);
            s = vreinterpretq_f32_u32(vbslq_u32(vceqq_u32(eu, vdupq_n_u32(0)), vdupq_n_u32(0x00400000u), vshlq_n_u32(eu, 23)));
            vst1q_f32(sc + t, s);
            vst1q_f32(gb + t, vdivq_f32(one, s));
            continue;
        }
        float32x4_t vo = zero;
        if (a->mode == MODE_SYM) {
            s = vdivq_f32(va, qdiv);
        } else { /* MODE_ASYM: lo = ga < 0 ? ga : 0, hi = gb > 0 ? gb : 0 */
            float32x4_t vb = vld1q_f32(gb + t);
            float32x4_t lo = vbslq_f32(vcltq_f32(va, zero), va, zero), hi = vbslq_f32(vcgtq_f32(vb, zero), vb, zero);
            float32x4_t s0 = vdivq_f32(vsubq_f32(hi, lo), qdiv);
            s0 = vbslq_f32(vceqq_f32(s0, zero), one, s0);
            float32x4_t r = vrndnq_f32(vsubq_f32(qmin, vdivq_f32(lo, s0)));
            vo = vaddq_f32(clamp4(r, qmin, qmax), zero);
            s = s0;
        }
        uint32x4_t bits = bf16_bits4(s);
        s = vreinterpretq_f32_u32(vshlq_n_u32(bits, 16));
        uint32x4_t z = vceqq_f32(s, zero);
        s = vbslq_f32(z, one, s);
        bits = vbslq_u32(z, vdupq_n_u32(0x3f80), bits);
        vst1q_f32(sc + t, s);
        vst1q_f32(off + t, vo);
        vst1q_f32(a->scale + o, s);
        if (a->scale_bf16) vst1_u16(a->scale_bf16 + o, vmovn_u32(bits));
        if (a->offset) vst1q_f32(a->offset + o, vo);
    }
    return t;
}

#endif
