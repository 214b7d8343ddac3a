/*
 * The AVX-512F row pieces of quant/_qkernel.c: included by it alone (on x86-64), after
 * _qkernel_avx2.h (whose packers and helpers level 2 shares); not a header of its own. 16 lanes,
 * the same float32 operations as the scalar pieces; used when the CPU has AVX-512F and the caller
 * allows level 2.
 */
#ifndef CVT_QKERNEL_AVX512_H
#define CVT_QKERNEL_AVX512_H

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
    if (a->src_kind == SRC_BF16) {
        const uint8_t *row = (const uint8_t *)a->src + 2 * i * k;
        __mmask16 any = 0;
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
            /* finite unless a NaN code (caught by nan): |e4m3| <= 448 and fp8_scales_simd_ok's
             * |sc| < 2**100 keep every product below 2**109 */
            _mm512_storeu_ps(out + j, fp8x16(row + j, sc256, &nan));
        }
        for (; j < end; j++) {
            out[j] = bf16_round(LUT[row[j]] * sc);
            cnt += not_finite(out[j]);
        }
    }
    if (_mm256_movemask_epi8(nan)) return decode_scalar(a, i, out); /* a NaN code: the plain path */
    return cnt;
}

/* 16 floats widened and added pairwise: 8 doubles */
AVX512 static inline __m512d wide8(__m512 s) {
    return _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(s)),
                         _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1))));
}

/* float32 squares of d, widened: 8 doubles */
AVX512 static inline __m512d sq8(__m512 d) { return wide8(_mm512_mul_ps(d, d)); }

/* the row loops' SQNR sums (see SQ_SPAN): float32 squares of w (s) and of w - w_hat (e) added in
 * float32 lanes, widened into the double sums at each span's end */
typedef struct { __m512 s, e; __m512d sd, ed; } sums16_t;

AVX512 static inline void sums16_add(sums16_t *a, __m512 v, __m512 d, int64_t next) {
    a->s = _mm512_add_ps(a->s, _mm512_mul_ps(v, v));
    a->e = _mm512_add_ps(a->e, _mm512_mul_ps(d, d));
    if (next % SQ_SPAN == 0) {
        a->sd = _mm512_add_pd(a->sd, wide8(a->s));
        a->ed = _mm512_add_pd(a->ed, wide8(a->e));
        a->s = a->e = _mm512_setzero_ps();
    }
}

/* sum w^2 to *sig, returns sum (w - w_hat)^2 */
AVX512 static inline double sums16_end(sums16_t *a, double *sig) {
    *sig = _mm512_reduce_add_pd(_mm512_add_pd(a->sd, wide8(a->s)));
    return _mm512_reduce_add_pd(_mm512_add_pd(a->ed, wide8(a->e)));
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

/* a whole row of k = ng * g elements, g a multiple of 16 (see qint8). (A multiply-first fast path
 * that divided only vectors near a rounding boundary was slower here: on bf16 weights and scales
 * ~5% of int4 vectors have a quotient at or near a half-integer, and vdivps is fast on the AMD
 * EPYC measured: w4a16 g128 1.49 -> 1.84 GB/s, w8a8 1.70 -> 1.97 without it.) */
AVX512 static double qint_row_avx512(const float *w, int8_t *q, int64_t k, int64_t g, const float *sc,
                                     const float *off, int asym, float qmin, float qmax, double *sig) {
    const __m512 lo = _mm512_set1_ps(qmin), hi = _mm512_set1_ps(qmax);
    sums16_t acc = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t t = 0, j = 0; j < k; t++) {
        const __m512 vs = _mm512_set1_ps(sc[t]), vo = _mm512_set1_ps(off[t]);
        for (int64_t end = j + g; j < end; j += 16) {
            __m512 v = _mm512_loadu_ps(w + j), x = _mm512_div_ps(v, vs);
            if (asym) x = _mm512_add_ps(x, vo);
            __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
            sums16_add(&acc, v, _mm512_sub_ps(v, _mm512_mul_ps(_mm512_sub_ps(r, vo), vs)), j + 16);
        }
    }
    return sums16_end(&acc, sig);
}

/* E2M1 index of a = min(|x|, 6) (NaN kept) without compares against each threshold: with
 * y = 2a (a < 2), a (2 <= a < 4) or a / 2 (a >= 4) (exact), idx = rint(y) + 0, 2 or 4: e2m1_code's
 * thresholds are y's half-integers, and round-half-even ties down exactly at its strict ones
 * (0.25 1.25 2.5 5: y = 0.5 2.5 2.5 2.5) and up at its >= ones (0.75 1.75 3.5: y = 1.5 3.5 3.5);
 * a NaN gets 0, as the compares give it. */
AVX512 static inline __m512i e2m1_idx16(__m512 a) {
    __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_LT_OQ);
    __mmask16 big = _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_GE_OQ);
    __m512 f = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_set1_ps(1.0f), small, _mm512_set1_ps(2.0f)), big,
                                  _mm512_set1_ps(0.5f));
    __m512i off = _mm512_mask_mov_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(2), small, _mm512_setzero_si512()),
                                        big, _mm512_set1_epi32(4));
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(a, f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_add_epi32(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_cvttps_epi32(r), off);
}

/* a whole row, g a multiple of 16: group t uses mult[t]; w * (1 / mult) where that is w / mult
 * exactly (FP4_EXACT: mxfp4), else the division (see FP4_NEAR) */
AVX512 static double fp4_row_avx512(const float *w, uint8_t *c, int64_t k, int64_t g, const float *mult,
                                   const float *rcp, double *sig) {
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    const __m512 table = _mm512_castps256_ps512(_mm256_loadu_ps(E2M1)), six = _mm512_set1_ps(6.0f);
    sums16_t acc = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t t = 0, j = 0; j < k; t++) {
        int exact = fp4_kind(mult[t], rcp[t]) == FP4_EXACT;
        const __m512 vm = _mm512_set1_ps(mult[t]), vr = _mm512_set1_ps(rcp[t]);
        for (int64_t end = j + g; j < end; j += 16) {
            __m512 v = _mm512_loadu_ps(w + j);
            __m512 x = exact ? _mm512_mul_ps(v, vr) : _mm512_div_ps(v, vm);
            /* min(6, |x|): the clamp's code (a NaN stays a NaN: min returns its second operand) */
            __m512i idx = e2m1_idx16(_mm512_min_ps(six, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absm))));
            __m512i sgn = _mm512_srli_epi32(_mm512_castps_si512(x), 31);
            __m512i code = _mm512_or_si512(idx, _mm512_slli_epi32(sgn, 3));
            _mm_storeu_si128((__m128i *)(c + j), _mm512_cvtepi32_epi8(code));
            __m512 mag = _mm512_permutexvar_ps(idx, table);
            __m512 val = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mag), _mm512_slli_epi32(sgn, 31)));
            sums16_add(&acc, v, _mm512_sub_ps(v, _mm512_mul_ps(val, vm)), j + 16);
        }
    }
    return sums16_end(&acc, sig);
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

#endif
