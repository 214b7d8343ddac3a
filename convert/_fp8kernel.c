/*
 * FP8 (e4m3fn) block-scaled weight -> BF16, one pass over memory.
 *
 * out[i, j] = bf16_rne( float32(w[i, j]) * s[i / bn, j / bk] )
 *
 * exactly the official math: the e4m3 value is exact in float32 (a 256-entry table), the
 * product is one IEEE single multiply (x86-64 and aarch64 do not use excess precision),
 * and the conversion to bfloat16 rounds to nearest even. NaN codes (0x7f, 0xff) give a
 * quiet NaN with the input's sign. Partial edge blocks need no special case: the scale
 * index is a division.
 *
 * Called through ctypes (see fp8.py); rows are split over `nthreads` pthreads. On x86-64 with
 * AVX2 + F16C (checked at run time) the inner loop is vectorized, bit-identically. The module
 * init below only exists so that setuptools can build this as an importable extension.
 */
#include <Python.h>
#include "_cvt_kernel.h" /* LUT, bf16_rne, cpu_simd, fp8_scales_simd_ok, run_jobs */

typedef struct {
    const uint8_t *w;
    const float *s;
    uint16_t *out;
    int64_t k, s_cols, bn, bk, row0, row1;
    int simd; /* AVX2 + F16C available and every scale finite and < 2**100 */
} job_t;

static void span_scalar(const uint8_t *w, uint16_t *out, int64_t len, float sc) {
    for (int64_t c = 0; c < len; c++) out[c] = bf16_rne(LUT[w[c]] * sc);
}

#ifdef CVT_X86
/*
 * 8 elements at a time. e4m3 bits moved into float16 bits, ((c & 0x7f) << 7) | ((c & 0x80) << 8),
 * are exactly w * 2**-8 (subnormals included: both formats' subnormal steps line up), F16C
 * widens them to float32 exactly, and multiplying by s * 2**8 (an exact power-of-two rescale,
 * since s < 2**100) rounds the same real product w * s once, as the scalar path does. NaN codes
 * (0x7f, 0xff) do not survive the bit move, so a block that contains one is redone in scalar.
 */
__attribute__((target("avx2,f16c"))) static void span_simd(const uint8_t *w, uint16_t *out, int64_t len, float sc) {
    const __m256 vs = _mm256_set1_ps(sc * 256.0f);
    const __m128i m7f = _mm_set1_epi16(0x7f), m80 = _mm_set1_epi16(0x80);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m128i nan = _mm_setzero_si128();
    int64_t c = 0;
    for (; c + 8 <= len; c += 8) {
        __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(w + c)));
        __m128i mag = _mm_and_si128(x, m7f);
        nan = _mm_or_si128(nan, _mm_cmpeq_epi16(mag, m7f));
        __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(x, m80), 8));
        __m256i b = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(h), vs));
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, half)), 16);
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(out + c), _mm256_castsi256_si128(p));
    }
    span_scalar(w + c, out + c, len - c, sc);
    if (_mm_movemask_epi8(nan)) span_scalar(w, out, c, sc);
}
#else
static void span_simd(const uint8_t *w, uint16_t *out, int64_t len, float sc) { span_scalar(w, out, len, sc); }
#endif

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t i = j->row0; i < j->row1; i++) {
        const uint8_t *wr = j->w + i * j->k;
        uint16_t *orow = j->out + i * j->k;
        const float *srow = j->s + (i / j->bn) * j->s_cols;
        for (int64_t c0 = 0, b = 0; c0 < j->k; c0 += j->bk, b++) {
            int64_t len = c0 + j->bk < j->k ? j->bk : j->k - c0;
            if (j->simd)
                span_simd(wr + c0, orow + c0, len, srow[b]);
            else
                span_scalar(wr + c0, orow + c0, len, srow[b]);
        }
    }
    return NULL;
}

/* w: [n, k] uint8 (e4m3fn bits); s: [ceil(n/bn), s_cols] float32; out: [n, k] uint16 (bf16 bits) */
int cvt_dequant_fp8_block(const uint8_t *w, const float *s, uint16_t *out, int64_t n, int64_t k,
                          int64_t s_cols, int64_t bn, int64_t bk, int64_t nthreads, int64_t allow_simd) {
    pthread_once(&lut_once, init_lut);
    int simd = allow_simd && cpu_simd() && fp8_scales_simd_ok(s, ((n + bn - 1) / bn) * s_cols);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (nthreads > n) nthreads = n > 0 ? n : 1;
    job_t jobs[64];
    int64_t per = (n + nthreads - 1) / nthreads;
    for (int64_t t = 0; t < nthreads; t++) {
        job_t jb = {w, s, out, k, s_cols, bn, bk, t * per, (t + 1) * per < n ? (t + 1) * per : n, simd};
        jobs[t] = jb;
    }
    run_jobs(run, jobs, sizeof(job_t), nthreads);
    return 0;
}

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_fp8kernel",
                                    "FP8 block dequant kernel (called through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__fp8kernel(void) { return PyModule_Create(&moddef); }
