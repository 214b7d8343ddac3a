/*
 * The AVX2 (+ F16C) row pieces of quant/_qkernel.c: included by it alone (on x86-64), after its
 * scalar pieces, types and fp4 helpers, which these use; not a header of its own. Each function
 * does the scalar piece's float32 operations on 8 lanes (so the same codes and scales; only the
 * SQNR sums' double additions come in another order) and carries its target attribute, so the
 * file builds without -mavx2; cvt_quantize checks the CPU at run time. _qkernel_avx512.h follows.
 */
#ifndef CVT_QKERNEL_AVX2_H
#define CVT_QKERNEL_AVX2_H

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
            /* finite unless a NaN code (caught by nan): |e4m3| <= 448 and fp8_scales_simd_ok's
             * |sc| < 2**100 keep every product below 2**109 */
            _mm256_storeu_ps(out + j, fp8x8(row + j, sc256, &nan));
        }
        for (; j < end; j++) {
            out[j] = bf16_round(LUT[row[j]] * sc);
            bad = _mm256_add_epi32(bad, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, not_finite(out[j]))); /* +1, not a mask */
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

/* 8 floats widened and added pairwise: 4 doubles */
AVX static inline __m256d wide4(__m256 s) {
    return _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)), _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)));
}

/* float32 squares of d, widened: 4 doubles */
AVX static inline __m256d sq4(__m256 d) { return wide4(_mm256_mul_ps(d, d)); }

/* the row loops' SQNR sums (see SQ_SPAN): float32 squares of w (s) and of w - w_hat (e) added in
 * float32 lanes, widened into the double sums at each span's end */
typedef struct { __m256 s, e; __m256d sd, ed; } sums8_t;

AVX static inline void sums8_add(sums8_t *a, __m256 v, __m256 d, int64_t next) {
    a->s = _mm256_add_ps(a->s, _mm256_mul_ps(v, v));
    a->e = _mm256_add_ps(a->e, _mm256_mul_ps(d, d));
    if (next % SQ_SPAN == 0) {
        a->sd = _mm256_add_pd(a->sd, wide4(a->s));
        a->ed = _mm256_add_pd(a->ed, wide4(a->e));
        a->s = a->e = _mm256_setzero_ps();
    }
}

/* sum w^2 to *sig, returns sum (w - w_hat)^2 */
AVX static inline double sums8_end(sums8_t *a, double *sig) {
    *sig = hsum4d(_mm256_add_pd(a->sd, wide4(a->s)));
    return hsum4d(_mm256_add_pd(a->ed, wide4(a->e)));
}

/* 8 lanes of q = clamp(rint(w / sc [+ off]), qmin, qmax) stored as int8; returns the float32
 * w - (q - off) * sc */
AVX static inline __m256 qint8(const float *w, int8_t *q, __m256 vs, __m256 vo, int asym, __m256 lo, __m256 hi) {
    __m256 v = _mm256_loadu_ps(w);
    __m256 x = _mm256_div_ps(v, vs);
    if (asym) x = _mm256_add_ps(x, vo);
    __m256 r = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
    __m256i r32 = _mm256_cvtps_epi32(r);
    __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r32), _mm256_extracti128_si256(r32, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(r16, r16));
    return _mm256_sub_ps(v, _mm256_mul_ps(_mm256_sub_ps(r, vo), vs));
}

AVX static double qint_avx2(const float *w, int8_t *q, int64_t len, float sc, float off, int asym, float qmin,
                            float qmax) {
    const __m256 vs = _mm256_set1_ps(sc), vo = _mm256_set1_ps(off), lo = _mm256_set1_ps(qmin),
                 hi = _mm256_set1_ps(qmax);
    __m256d acc = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) acc = _mm256_add_pd(acc, sq4(qint8(w + j, q + j, vs, vo, asym, lo, hi)));
    return hsum4d(acc) + qint_scalar(w + j, q + j, len - j, sc, off, asym, qmin, qmax);
}

/* a whole row of k = ng * g elements, g a multiple of 8: group t uses sc[t], off[t] */
AVX static double qint_row_avx2(const float *w, int8_t *q, int64_t k, int64_t g, const float *sc, const float *off,
                                int asym, float qmin, float qmax, double *sig) {
    const __m256 lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax);
    sums8_t acc = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (int64_t t = 0, j = 0; j < k; t++) {
        const __m256 vs = _mm256_set1_ps(sc[t]), vo = _mm256_set1_ps(off[t]);
        for (int64_t end = j + g; j < end; j += 8)
            sums8_add(&acc, _mm256_loadu_ps(w + j), qint8(w + j, q + j, vs, vo, asym, lo, hi), j + 8);
    }
    return sums8_end(&acc, sig);
}

/* E2M1 index of a = min(|x|, 6) as rint of y = 2a / a / a/2 plus 0 / 2 / 4 (NaN -> 0): see
 * e2m1_idx16 */
AVX static inline __m256i e2m1_idx8(__m256 a) {
    __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_LT_OQ), big = _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ);
    __m256 f = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(2.0f), small), _mm256_set1_ps(0.5f), big);
    __m256 off = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(2)), _mm256_setzero_ps(), small),
                                  _mm256_castsi256_ps(_mm256_set1_epi32(4)), big);
    __m256 r = _mm256_round_ps(_mm256_mul_ps(a, f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i idx = _mm256_add_epi32(_mm256_cvttps_epi32(r), _mm256_castps_si256(off));
    return _mm256_and_si256(idx, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_ORD_Q)));
}

/* 8 lanes of E2M1 codes of clamp(w / mult, -6, 6), as w * vr (vr = 1 / mult) where fp4_kind says
 * that is exact (see fp4_row_avx512), else divided; returns the float32 w - fp4 * mult */
AVX static inline __m256 fp48(const float *w, uint8_t *c, __m256 vm, __m256 vr, int exact) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), six = _mm256_set1_ps(6.0f);
    __m256 v = _mm256_loadu_ps(w);
    __m256 x = exact ? _mm256_mul_ps(v, vr) : _mm256_div_ps(v, vm);
    /* min(6, |x|): the clamp's code (a NaN stays a NaN: min returns its second operand) */
    __m256i idx = e2m1_idx8(_mm256_min_ps(six, _mm256_and_ps(x, absm)));
    __m256i sgn = _mm256_srli_epi32(_mm256_castps_si256(x), 31);
    __m256i code = _mm256_or_si256(idx, _mm256_slli_epi32(sgn, 3));
    __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64((__m128i *)c, _mm_packus_epi16(c16, c16));
    __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1), idx);
    __m256 val = _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(sgn, 31)));
    return _mm256_sub_ps(v, _mm256_mul_ps(val, vm));
}

AVX static double fp4_avx2(const float *w, uint8_t *c, int64_t len, float mult) {
    float r = 1.0f / mult;
    int exact = fp4_kind(mult, r) == FP4_EXACT;
    const __m256 vm = _mm256_set1_ps(mult), vr = _mm256_set1_ps(r);
    __m256d acc = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) acc = _mm256_add_pd(acc, sq4(fp48(w + j, c + j, vm, vr, exact)));
    return hsum4d(acc) + fp4_scalar(w + j, c + j, len - j, mult);
}

/* a whole row, g a multiple of 8: group t uses mult[t], rcp[t] = 1 / mult[t] */
AVX static double fp4_row_avx2(const float *w, uint8_t *c, int64_t k, int64_t g, const float *mult,
                               const float *rcp, double *sig) {
    sums8_t acc = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (int64_t t = 0, j = 0; j < k; t++) {
        int exact = fp4_kind(mult[t], rcp[t]) == FP4_EXACT;
        const __m256 vm = _mm256_set1_ps(mult[t]), vr = _mm256_set1_ps(rcp[t]);
        for (int64_t end = j + g; j < end; j += 8)
            sums8_add(&acc, _mm256_loadu_ps(w + j), fp48(w + j, c + j, vm, vr, exact), j + 8);
    }
    return sums8_end(&acc, sig);
}

/* per-group max |w| (minmax = 0) or min and max (minmax = 1) of a row, g a multiple of 8: exact
 * whatever the order, so the same numbers as the scalar loops */
AVX static inline __m256 op8(__m256 a, __m256 b, int mn) { return mn ? _mm256_min_ps(a, b) : _mm256_max_ps(a, b); }

/* lane t = the max (mn: min) of v[t]'s 8 lanes, for 8 vectors at once (as reduce16x16): halves,
 * pairs, lanes, then the lanes back in order */
AVX static inline __m256 reduce8x8(const __m256 *v, int mn) {
    __m256 u[4], x[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: 4 of v[2i], 4-7: 4 of v[2i+1] */
        u[i] = op8(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20), _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31), mn);
    for (int i = 0; i < 2; i++) /* 2 lanes each of v[4i], v[4i+2] | v[4i+1], v[4i+3] */
        x[i] = op8(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xee), mn);
    __m256 z = op8(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xdd), mn); /* v 0 2 4 6 1 3 5 7 */
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AVX static void gstats_avx2(const float *w, int64_t k, int64_t g, int minmax, float *ga, float *gb) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t ng = k / g, t0 = 0;
    for (; g <= 32 && t0 + 8 <= ng; t0 += 8) { /* small groups: 8 at a time through reduce8x8 */
        __m256 lo[8], hi[8];
        for (int u = 0; u < 8; u++) {
            const float *p = w + (t0 + u) * g;
            if (minmax) {
                lo[u] = hi[u] = _mm256_loadu_ps(p);
                for (int64_t j = 8; j < g; j += 8) {
                    __m256 v = _mm256_loadu_ps(p + j);
                    lo[u] = _mm256_min_ps(lo[u], v);
                    hi[u] = _mm256_max_ps(hi[u], v);
                }
            } else {
                hi[u] = _mm256_and_ps(_mm256_loadu_ps(p), absm);
                for (int64_t j = 8; j < g; j += 8) hi[u] = _mm256_max_ps(hi[u], _mm256_and_ps(_mm256_loadu_ps(p + j), absm));
            }
        }
        if (minmax) _mm256_storeu_ps(ga + t0, reduce8x8(lo, 1));
        _mm256_storeu_ps((minmax ? gb : ga) + t0, reduce8x8(hi, 0));
    }
    for (int64_t t = t0, j = t0 * g; j < k; t++) {
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

/* max of p[j] & 0x7f over the first *done bytes (e4m3 magnitudes order like their codes; the
 * caller takes the tail). The global-scale pass (amax_row, where amax_fp8_pruned cannot stop
 * early) streams a whole weight from memory: four accumulators keep several loads in flight. */
AVX static uint8_t max_code_avx2(const uint8_t *p, int64_t len, int64_t *done) {
    const __m256i m = _mm256_set1_epi8(0x7f);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
#define LD(o) _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + j + (o))), m)
    for (; j + 128 <= len; j += 128) {
        a0 = _mm256_max_epu8(a0, LD(0));
        a1 = _mm256_max_epu8(a1, LD(32));
        a2 = _mm256_max_epu8(a2, LD(64));
        a3 = _mm256_max_epu8(a3, LD(96));
    }
    for (; j + 32 <= len; j += 32) a0 = _mm256_max_epu8(a0, LD(0));
#undef LD
    *done = j;
    __m256i x = _mm256_max_epu8(_mm256_max_epu8(a0, a1), _mm256_max_epu8(a2, a3));
    __m128i y = _mm_max_epu8(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    y = _mm_max_epu8(y, _mm_srli_si128(y, 8));
    y = _mm_max_epu8(y, _mm_srli_si128(y, 4));
    y = _mm_max_epu8(y, _mm_srli_si128(y, 2));
    y = _mm_max_epu8(y, _mm_srli_si128(y, 1));
    return (uint8_t)_mm_cvtsi128_si32(y);
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


/* ---- msModelSlim's MX elements (mx_scalar_sq), 8 lanes ---------------------------------------------
 * The same values as the scalar's float32 operations, by fewer vector ones: v = w * (1 / mult) (exact,
 * mult a power of two), the element exponent from v's exponent field, every scaling by a power of two
 * one exact multiplication (no result is subnormal or overflows), floor(|a| + 0.5) as the truncating
 * conversion of that one rounded sum (non-negative). The clamp at the largest element (448, 6) is
 * taken on |v| first: every |v| above it rounds to a value above it in the scalar too, and the
 * largest element rounds to itself, so the value is the same and no code needs clamping after.
 * The code is made from the clamped exponent and that integer instead of from the value: E4M3
 * ((pe + 6) << 3) + r (subnormal at pe = -6, r < 8; r = 16 carries into the exponent); E2M1 m + 2 pe
 * (pe 0: m 0..4 = 0, 0.5 .. 2; pe 1: m 2..4 = 2, 3, 4; pe 2: m 2..3 = 4, 6). The sign, on the codes
 * of a block of 32 at once: negative exactly where v < 0 (a negative v that rounds to zero keeps it,
 * v = -0.0 does not), as the scalar's sign(x) * ... leaves it. The SQNR difference as
 * |w| - |w_hat| (w_hat = val * mult has w's sign or is zero, and rounding is symmetric: the same
 * square as w - w_hat). *neg: the lanes where v < 0. */
AVX static inline __m256 mx8_el(__m256 x, __m256 vm, __m256 vr, __m256 unused, __m256i *code, __m256i *neg) {
    (void)unused;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v = _mm256_mul_ps(x, vr), b = _mm256_min_ps(_mm256_and_ps(v, absm), _mm256_set1_ps(448.0f));
    /* max(e(|v|), -6) + 127 in the exponent field (b <= 448: pe <= 8) */
    __m256i ef = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(b), _mm256_set1_epi32(0x7f800000)),
                                  _mm256_set1_epi32(121 << 23));
    __m256 s8 = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(257 << 23), ef)); /* 2**(3-pe) */
    __m256i r = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(b, s8), _mm256_set1_ps(0.5f)));
    __m256 p2 = _mm256_castsi256_ps(_mm256_sub_epi32(ef, _mm256_set1_epi32(3 << 23))); /* 2**(pe-3) */
    __m256 mag = _mm256_mul_ps(_mm256_cvtepi32_ps(r), p2);
    *code = _mm256_add_epi32(_mm256_srli_epi32(_mm256_sub_epi32(ef, _mm256_set1_epi32(121 << 23)), 20), r);
    *neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_sub_ps(_mm256_and_ps(x, absm), _mm256_mul_ps(mag, vm));
}

AVX static inline __m256 mx4_el(__m256 x, __m256 vm, __m256 vr, __m256 unused, __m256i *code, __m256i *neg) {
    (void)unused;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v = _mm256_mul_ps(x, vr), b = _mm256_min_ps(_mm256_and_ps(v, absm), _mm256_set1_ps(6.0f));
    __m256i ef = _mm256_and_si256(_mm256_castps_si256(_mm256_add_ps(b, _mm256_set1_ps(9.6e-7f))), _mm256_set1_epi32(0x7f800000));
    ef = _mm256_max_epi32(ef, _mm256_set1_epi32(127 << 23)); /* pe 0..2 (b <= 6) */
    __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(255 << 23), ef)); /* 2**(1-pe) */
    __m256i m = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(b, s2), _mm256_set1_ps(0.5f)));
    __m256 p2 = _mm256_castsi256_ps(_mm256_sub_epi32(ef, _mm256_set1_epi32(1 << 23))); /* 2**(pe-1) */
    __m256 mag = _mm256_mul_ps(_mm256_cvtepi32_ps(m), p2);
    *code = _mm256_add_epi32(m, _mm256_srli_epi32(_mm256_sub_epi32(ef, _mm256_set1_epi32(127 << 23)), 22)); /* m + 2 pe */
    *neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_sub_ps(_mm256_and_ps(x, absm), _mm256_mul_ps(mag, vm));
}

/* The same elements without v (the common case: a block's shared exponent se in -117..16 for E4M3,
 * -106..16 for E2M1; other blocks take the functions above). There v = w * 2**-se is exact and zero
 * only where w is (w is bfloat16: no bit below 2**-133, so v keeps every bit down to 2**-149) and
 * every power of two below is a normal float, so each step is the one above scaled by 2**se, which
 * changes no rounding: the clamp at cmax = 448 * 2**se (6 * 2**se), the exponent field of
 * |w| (plus 9.6e-7 * 2**se, c) floored at cf = (121 + se) << 23 ((127 + se) << 23), the element
 * integer from |w| * 2**(3-pe-se) (2**(1-pe-se)), w_hat as that integer times 2**(pe+se-3)
 * (2**(pe+se-1)): two multiplications less a vector. */
AVX static inline __m256 mx8x_el(__m256 x, __m256 cmax, __m256 cf, __m256 unused, __m256i *code, __m256i *neg) {
    (void)unused;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 ax = _mm256_and_ps(x, absm), b = _mm256_min_ps(ax, cmax);
    __m256i ef = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(b), _mm256_set1_epi32(0x7f800000)), _mm256_castps_si256(cf));
    __m256 s8 = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(257 << 23), ef)); /* 2**(3-pe-se) */
    __m256i r = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(b, s8), _mm256_set1_ps(0.5f)));
    __m256 p2 = _mm256_castsi256_ps(_mm256_sub_epi32(ef, _mm256_set1_epi32(3 << 23))); /* 2**(pe+se-3) */
    *code = _mm256_add_epi32(_mm256_srli_epi32(_mm256_sub_epi32(ef, _mm256_castps_si256(cf)), 20), r);
    *neg = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_sub_ps(ax, _mm256_mul_ps(_mm256_cvtepi32_ps(r), p2));
}

AVX static inline __m256 mx4x_el(__m256 x, __m256 cmax, __m256 cf, __m256 c, __m256i *code, __m256i *neg) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 ax = _mm256_and_ps(x, absm), b = _mm256_min_ps(ax, cmax);
    __m256i ef = _mm256_and_si256(_mm256_castps_si256(_mm256_add_ps(b, c)), _mm256_set1_epi32(0x7f800000));
    ef = _mm256_max_epi32(ef, _mm256_castps_si256(cf));
    __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(255 << 23), ef)); /* 2**(1-pe-se) */
    __m256i m = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(b, s2), _mm256_set1_ps(0.5f)));
    __m256 p2 = _mm256_castsi256_ps(_mm256_sub_epi32(ef, _mm256_set1_epi32(1 << 23))); /* 2**(pe+se-1) */
    *code = _mm256_add_epi32(m, _mm256_srli_epi32(_mm256_sub_epi32(ef, _mm256_castps_si256(cf)), 22));
    *neg = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_sub_ps(ax, _mm256_mul_ps(_mm256_cvtepi32_ps(m), p2));
}

/* params_scalar's MX groups, 8 at a time: the shared exponent looked up by each block max's bf16
 * bits (bf16_rne, NaN too), its E8M0 code (255 where E8M0 cannot hold it), 2**se into sc and
 * 2**-se into gb as bits (se = -127 or 127: the subnormal 2**-127; NaN for 255). Returns the
 * groups done; params_scalar does the rest. */
AVX static int64_t params_mx_avx2(const cvt_qargs *a, int64_t i, const float *ga, float *gb, float *sc) {
    int64_t ng = a->k / a->group, t = 0;
    const __m256i one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0x7fc00000), sub = _mm256_set1_epi32(0x00400000);
    for (; t + 8 <= ng; t += 8) {
        __m256i b = _mm256_castps_si256(_mm256_loadu_ps(ga + t));
        __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
        __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)),
                                                         _mm256_and_si256(_mm256_srli_epi32(b, 16), one)), 16);
        __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
        __m256i idx = _mm256_and_si256(_mm256_blendv_epi8(rne, quiet, isnan), _mm256_set1_epi32(0xffff));
        uint32_t ix[8];
        _mm256_storeu_si256((__m256i *)ix, idx);
        const int16_t *lut = a->se_lut;
        __m256i se = _mm256_setr_epi32(lut[ix[0]], lut[ix[1]], lut[ix[2]], lut[ix[3]], lut[ix[4]], lut[ix[5]], lut[ix[6]],
                                       lut[ix[7]]);
        __m256i bad = _mm256_cmpeq_epi32(se, _mm256_set1_epi32(MX_BAD_SE)), e = _mm256_add_epi32(se, _mm256_set1_epi32(127));
        store8_u8(a->scale8 + i * ng + t, _mm256_or_si256(e, _mm256_and_si256(bad, _mm256_set1_epi32(255))));
        __m256i m = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23), sub, _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
        __m256i r = _mm256_sub_epi32(_mm256_set1_epi32(254), e);
        r = _mm256_blendv_epi8(_mm256_slli_epi32(r, 23), sub, _mm256_cmpeq_epi32(r, _mm256_setzero_si256()));
        _mm256_storeu_si256((__m256i *)(sc + t), _mm256_blendv_epi8(m, nan, bad));
        _mm256_storeu_si256((__m256i *)(gb + t), _mm256_blendv_epi8(r, nan, bad));
    }
    return t;
}

/* the codes (0..127) and sign masks of 4 x 8 lanes, packed by pairs as made (packs_epi32 of lanes
 * 0-1 and 2-3) -> 32 bytes in order, the sign on bit `sbit` */
AVX static inline void store32_signed(uint8_t *p, __m256i c01, __m256i c23, __m256i n01, __m256i n23, int sbit) {
    __m256i b = _mm256_packus_epi16(c01, c23), s = _mm256_packs_epi16(n01, n23); /* s: 0 / -1 */
    b = _mm256_or_si256(b, _mm256_and_si256(s, _mm256_set1_epi8((char)sbit)));
    _mm256_storeu_si256((__m256i *)p, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* a whole row of k = ng * 32 elements: block t's multiplier mult[t], its reciprocal rcp[t] (exact),
 * its E8M0 code e8[t] (se + 127); the sums as sums8_add adds them, vector after vector (a span ends
 * only after a block's last), in local accumulators (registers: through sums8_t GCC keeps them on
 * the stack, a store and a load on their dependency chain), each vector's added as soon as made
 * and its codes packed by pairs (few registers live) */
#define MX_SQ(x, d)                                                                                                \
    (s = _mm256_add_ps(s, _mm256_mul_ps(x, x)), e = _mm256_add_ps(e, _mm256_mul_ps(d, d)))
#define MX_GROUP(el, sbit)                                                                                         \
    do {                                                                                                           \
        __m256i ca, na, cb, nb, c01, n01;                                                                          \
        __m256 x = _mm256_loadu_ps(w + j), d = el(x, kp, kq, kr, &ca, &na);                                        \
        MX_SQ(x, d);                                                                                               \
        x = _mm256_loadu_ps(w + j + 8), d = el(x, kp, kq, kr, &cb, &nb), MX_SQ(x, d);                              \
        c01 = _mm256_packs_epi32(ca, cb), n01 = _mm256_packs_epi32(na, nb);                                        \
        x = _mm256_loadu_ps(w + j + 16), d = el(x, kp, kq, kr, &ca, &na), MX_SQ(x, d);                             \
        x = _mm256_loadu_ps(w + j + 24), d = el(x, kp, kq, kr, &cb, &nb), MX_SQ(x, d);                             \
        store32_signed(c + j, c01, _mm256_packs_epi32(ca, cb), n01, _mm256_packs_epi32(na, nb), sbit);             \
    } while (0)
/* setx: the fast path's constants (kp, kq, kr) of block t, whose shared exponent is se */
#define MX_ROW_AVX2(name, el, elx, sbit, se_lo, setx)                                                              \
    AVX static double name(const float *w, uint8_t *c, int64_t k, const float *mult, const float *rcp,              \
                           const uint8_t *e8, double *sig) {                                                       \
        __m256 s = _mm256_setzero_ps(), e = s;                                                                     \
        __m256d sd = _mm256_setzero_pd(), ed = sd;                                                                 \
        for (int64_t t = 0, j = 0; j < k; t++, j += 32) {                                                          \
            int se = (int)e8[t] - 127;                                                                             \
            if (se >= (se_lo) && se <= 16) {                                                                       \
                const float m = mult[t];                                                                           \
                setx;                                                                                              \
                MX_GROUP(elx, sbit);                                                                               \
            } else {                                                                                               \
                const __m256 kp = _mm256_set1_ps(mult[t]), kq = _mm256_set1_ps(rcp[t]), kr = kp;                   \
                MX_GROUP(el, sbit);                                                                                \
            }                                                                                                      \
            if ((j + 32) % SQ_SPAN == 0) {                                                                         \
                sd = _mm256_add_pd(sd, wide4(s)), ed = _mm256_add_pd(ed, wide4(e));                                \
                s = e = _mm256_setzero_ps();                                                                       \
            }                                                                                                      \
        }                                                                                                          \
        *sig = hsum4d(_mm256_add_pd(sd, wide4(s)));                                                                \
        return hsum4d(_mm256_add_pd(ed, wide4(e)));                                                                \
    }
#define CF(base) _mm256_castsi256_ps(_mm256_set1_epi32(((base) + se) << 23))
MX_ROW_AVX2(mx8_row_avx2, mx8_el, mx8x_el, 0x80, -117,
            const __m256 kp = _mm256_set1_ps(448.0f * m); const __m256 kq = CF(121); const __m256 kr = kp)
MX_ROW_AVX2(mx4_row_avx2, mx4_el, mx4x_el, 0x08, -106,
            const __m256 kp = _mm256_set1_ps(6.0f * m); const __m256 kq = CF(127); const __m256 kr = _mm256_set1_ps(9.6e-7f * m))
#undef CF
#undef MX_ROW_AVX2
#undef MX_GROUP
#undef MX_SQ

#endif
