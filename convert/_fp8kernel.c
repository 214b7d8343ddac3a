/*
 * FP8 (e4m3fn) block-scaled weight -> BF16, one pass over memory.
 *
 * out[i, j] = bf16_rne( float32(w[i, j]) * s[i / bn, j / bk] )
 *
 * exactly the official math: the e4m3 value is exact in float32 (a 256-entry table), the
 * product is one IEEE single multiply (x86-64 and aarch64 do not use excess precision),
 * and the conversion to bfloat16 rounds to nearest even. NaN codes (0x7f, 0xff) give a
 * quiet NaN with the input's sign, and are counted: cvt_dequant_fp8_block returns how many
 * outputs are NaN / Inf, so that a writer refuses the weight without a second pass over it (the
 * SIMD loops already spot NaN codes to redo their span in scalar, which counts). Partial edge
 * blocks need no special case: the scale index is a division.
 *
 * cvt_count_nonfinite counts the NaN / Inf elements of any float buffer (the writer's check of
 * tensors no kernel produced: copied source bytes, computed scales).
 *
 * Called through ctypes (see fp8.py); rows are split over `nthreads` pthreads. On x86-64 with
 * AVX2 + F16C, or AVX-512F (checked at run time; `CVT_KERNEL_SIMD` caps the level), and on
 * aarch64 with NEON the inner loop is vectorized, bit-identically. The module init below only
 * exists so that setuptools can build this as an importable extension.
 */
#ifndef CVT_NO_PYTHON
#include <Python.h>
#endif
#include "_cvt_kernel.h" /* LUT, bf16_rne, cpu_simd, fp8_scales_simd_ok, run_jobs */

typedef struct {
    const uint8_t *w;
    const float *s;
    uint16_t *out;
    int64_t k, s_cols, bn, bk, row0, row1;
    int simd; /* 0 scalar, 1 AVX2 + F16C (NEON on aarch64), 2 AVX-512F; SIMD needs every scale finite and < 2**100 */
    int64_t bad; /* out: the job's NaN / Inf outputs */
} job_t;

/* How many of the n elements of x have every bit of mask set (a NaN / Inf when mask is the
 * exponent field): counted in runs of 4096 into a narrow sum, which the compiler vectorizes
 * (one 64-bit sum per element ran 3-5x slower). */
#define COUNT_MASKED(T, ACC)                                                            \
    static int64_t count_masked_##T(const T *x, int64_t n, T m) {                        \
        int64_t bad = 0;                                                                 \
        for (int64_t i0 = 0; i0 < n; i0 += 4096) {                                       \
            int64_t e = i0 + 4096 < n ? i0 + 4096 : n;                                   \
            ACC b = 0;                                                                   \
            for (int64_t i = i0; i < e; i++) b += (x[i] & m) == m;                       \
            bad += b;                                                                    \
        }                                                                                \
        return bad;                                                                      \
    }
COUNT_MASKED(uint8_t, uint16_t)
COUNT_MASKED(uint16_t, uint16_t)
COUNT_MASKED(uint32_t, uint32_t)
COUNT_MASKED(uint64_t, uint32_t)

static void span_plain(const uint8_t *w, uint16_t *out, int64_t len, float sc) {
    for (int64_t c = 0; c < len; c++) out[c] = bf16_rne(LUT[w[c]] * sc);
}

/* span_plain, returning how many of the `len` outputs are NaN / Inf (bf16 exponent all ones): a
 * second loop over the span just written (in L1), which keeps the first as fast as before. */
static int64_t span_scalar(const uint8_t *w, uint16_t *out, int64_t len, float sc) {
    if (len <= 0) return 0;
    span_plain(w, out, len, sc);
    return count_masked_uint16_t(out, len, 0x7f80u);
}

#ifdef CVT_X86
/*
 * 8 elements at a time. e4m3 bits moved into float16 bits, ((c & 0x7f) << 7) | ((c & 0x80) << 8)
 * -- made in two operations: the code sign-extended to 16 bits and shifted left by 7 puts the sign
 * in bit 15 and the magnitude in bits 7-13, and clearing bit 14 (0xbf80) drops the sign's copy --
 * are exactly w * 2**-8 (subnormals included: both formats' subnormal steps line up), F16C
 * widens them to float32 exactly, and multiplying by s * 2**8 (an exact power-of-two rescale,
 * since s < 2**100) rounds the same real product w * s once, as the scalar path does. NaN codes
 * (0x7f, 0xff) do not survive the bit move, so a block that contains one is redone in scalar
 * (which counts it); finite codes give finite products here (s < 2**100). Returns the span's
 * NaN / Inf outputs, as span_scalar.
 */
__attribute__((target("avx2,f16c"))) static int64_t span_simd(const uint8_t *w, uint16_t *out, int64_t len, float sc) {
    const __m256 vs = _mm256_set1_ps(sc * 256.0f);
    const __m128i bits = _mm_set1_epi16((short)0xbf80), magm = _mm_set1_epi16(0x3f80);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m128i nan = _mm_setzero_si128();
    int64_t c = 0;
    for (; c + 8 <= len; c += 8) {
        __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + c))), 7), bits);
        nan = _mm_or_si128(nan, _mm_cmpeq_epi16(_mm_and_si128(h, magm), magm)); /* magnitude 0x7f */
        __m256i b = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(h), vs));
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, half)), 16);
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(out + c), _mm256_castsi256_si128(p));
    }
    int64_t bad = span_scalar(w + c, out + c, len - c, sc);
    if (_mm_movemask_epi8(nan)) bad += span_scalar(w, out, c, sc);
    return bad;
}

/* 16 elements at a time with AVX-512F: span_simd's operations on 16 lanes (the same IEEE multiply
 * and integer rounding per element, so the same bits); the 32 -> 16 bit narrowing is exact (each
 * rounded lane is below 2**16). The rest (< 16) goes through span_simd. */
__attribute__((target("avx512f,avx2,f16c"))) static int64_t span_avx512(const uint8_t *w, uint16_t *out, int64_t len,
                                                                     float sc) {
    const __m512 vs = _mm512_set1_ps(sc * 256.0f);
    const __m256i bits = _mm256_set1_epi16((short)0xbf80), magm = _mm256_set1_epi16(0x3f80);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    __m256i nan = _mm256_setzero_si256();
    int64_t c = 0;
    for (; c + 16 <= len; c += 16) { /* span_simd's two-operation bit move */
        __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + c))), 7),
                                     bits);
        nan = _mm256_or_si256(nan, _mm256_cmpeq_epi16(_mm256_and_si256(h, magm), magm));
        __m512i b = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtph_ps(h), vs));
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, half)), 16);
        _mm256_storeu_si256((__m256i *)(out + c), _mm512_cvtepi32_epi16(r));
    }
    int64_t bad = span_simd(w + c, out + c, len - c, sc);
    if (_mm256_movemask_epi8(nan)) bad += span_scalar(w, out, c, sc);
    return bad;
}
#elif defined(__aarch64__)
/*
 * NEON (every AArch64 CPU has it): span_simd's bit move, 8 elements at a time; vcvt_f32_f16 widens
 * exactly and vmulq_f32 is one IEEE single multiply (Linux leaves FPCR's flush-to-zero off, so
 * subnormal products stay), then the same integer round to nearest even. NaN codes: redone in scalar.
 */
static int64_t span_simd(const uint8_t *w, uint16_t *out, int64_t len, float sc) {
    const float32x4_t vs = vdupq_n_f32(sc * 256.0f);
    const uint16x8_t bits = vdupq_n_u16(0xbf80), magm = vdupq_n_u16(0x3f80);
    const uint32x4_t one = vdupq_n_u32(1), half = vdupq_n_u32(0x7fff);
    uint16x8_t nan = vdupq_n_u16(0);
    int64_t c = 0;
    for (; c + 8 <= len; c += 8) { /* the x86 path's two-operation bit move */
        uint16x8_t h = vandq_u16(vreinterpretq_u16_s16(vshlq_n_s16(vmovl_s8(vld1_s8((const int8_t *)(w + c))), 7)), bits);
        nan = vorrq_u16(nan, vceqq_u16(vandq_u16(h, magm), magm));
        float32x4_t lo = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))), vs);
        float32x4_t hi = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h))), vs);
        uint32x4_t bl = vreinterpretq_u32_f32(lo), bh = vreinterpretq_u32_f32(hi);
        bl = vshrq_n_u32(vaddq_u32(bl, vaddq_u32(vandq_u32(vshrq_n_u32(bl, 16), one), half)), 16);
        bh = vshrq_n_u32(vaddq_u32(bh, vaddq_u32(vandq_u32(vshrq_n_u32(bh, 16), one), half)), 16);
        vst1q_u16(out + c, vcombine_u16(vmovn_u32(bl), vmovn_u32(bh)));
    }
    int64_t bad = span_scalar(w + c, out + c, len - c, sc);
    if (vmaxvq_u16(nan)) bad += span_scalar(w, out, c, sc);
    return bad;
}
static int64_t span_avx512(const uint8_t *w, uint16_t *out, int64_t len, float sc) { return span_simd(w, out, len, sc); }
#else
static int64_t span_simd(const uint8_t *w, uint16_t *out, int64_t len, float sc) { return span_scalar(w, out, len, sc); }
static int64_t span_avx512(const uint8_t *w, uint16_t *out, int64_t len, float sc) { return span_scalar(w, out, len, sc); }
#endif

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    int64_t bad = 0;
    for (int64_t i = j->row0; i < j->row1; i++) {
        const uint8_t *wr = j->w + i * j->k;
        uint16_t *orow = j->out + i * j->k;
        const float *srow = j->s + (i / j->bn) * j->s_cols;
        for (int64_t c0 = 0, b = 0; c0 < j->k; c0 += j->bk, b++) {
            int64_t len = c0 + j->bk < j->k ? j->bk : j->k - c0;
            if (j->simd == 2)
                bad += span_avx512(wr + c0, orow + c0, len, srow[b]);
            else if (j->simd)
                bad += span_simd(wr + c0, orow + c0, len, srow[b]);
            else
                span_plain(wr + c0, orow + c0, len, srow[b]);
        }
        if (!j->simd) bad += count_masked_uint16_t(orow, j->k, 0x7f80u); /* the row, once (in cache) */
    }
    j->bad = bad;
    return NULL;
}

/* The SIMD level cvt_dequant_fp8_block runs at when the caller allows `allowed` (scales
 * permitting): 0 scalar, 1 AVX2 (NEON on aarch64), 2 AVX-512 (`cvt.convert.fp8.simd_in_use`). */
int cvt_fp8_simd_level(int64_t allowed) {
    if (allowed <= 0 || !cpu_simd()) return 0;
    return allowed >= 2 && cpu_avx512() ? 2 : 1;
}

/* w: [n, k] uint8 (e4m3fn bits); s: [ceil(n/bn), s_cols] float32; out: [n, k] uint16 (bf16 bits);
 * allow_simd: the highest SIMD level allowed (`cvt.extras.simd_level`). Returns the number of
 * NaN / Inf outputs (NaN codes; with every scale finite and 448 |s| within bfloat16, only those). */
int64_t cvt_dequant_fp8_block(const uint8_t *w, const float *s, uint16_t *out, int64_t n, int64_t k,
                          int64_t s_cols, int64_t bn, int64_t bk, int64_t nthreads, int64_t allow_simd) {
    pthread_once(&lut_once, init_lut);
    int simd = fp8_scales_simd_ok(s, ((n + bn - 1) / bn) * s_cols) ? cvt_fp8_simd_level(allow_simd) : 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (nthreads > n) nthreads = n > 0 ? n : 1;
    job_t jobs[64];
    int64_t per = (n + nthreads - 1) / nthreads;
    for (int64_t t = 0; t < nthreads; t++) {
        job_t jb = {w, s, out, k, s_cols, bn, bk, t * per, (t + 1) * per < n ? (t + 1) * per : n, simd, 0};
        jobs[t] = jb;
    }
    run_jobs(run, jobs, sizeof(job_t), nthreads);
    int64_t bad = 0;
    for (int64_t t = 0; t < nthreads; t++) bad += jobs[t].bad;
    return bad;
}

/* How many of the `n` elements of `size` bytes (1, 2, 4 or 8; little-endian) at `p` are NaN / Inf:
 * those whose bits under `mask` (the exponent field, plus the mantissa where all ones is the only
 * NaN, as e4m3fn's 0x7f) are all ones. One pass (count_masked_*); -1 for another size. */
int64_t cvt_count_nonfinite(const void *p, int64_t n, int64_t size, uint64_t mask) {
    switch (size) {
    case 1: return count_masked_uint8_t(p, n, (uint8_t)mask);
    case 2: return count_masked_uint16_t(p, n, (uint16_t)mask);
    case 4: return count_masked_uint32_t(p, n, (uint32_t)mask);
    case 8: return count_masked_uint64_t(p, n, mask);
    default: return -1;
    }
}

#ifndef CVT_NO_PYTHON /* tests/kernels/neon_harness.c builds the kernel alone, for aarch64 under qemu */
static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_fp8kernel",
                                    "FP8 block dequant kernel (called through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__fp8kernel(void) { return PyModule_Create(&moddef); }
#endif
