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
 * Called through ctypes (see fp8.py); rows are split over `nthreads` pthreads. The module
 * init below only exists so that setuptools can build this as an importable extension.
 */
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

static float LUT[256];
static int lut_ready = 0;

static void init_lut(void) {
    for (int c = 0; c < 256; c++) {
        int sign = c >> 7, e = (c >> 3) & 15, m = c & 7;
        float v;
        if (e == 15 && m == 7)
            v = NAN;
        else if (e == 0)
            v = ldexpf((float)m / 8.0f, -6);
        else
            v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
        LUT[c] = sign ? -v : v;
    }
    lut_ready = 1;
}

static inline uint16_t bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x0040u);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

typedef struct {
    const uint8_t *w;
    const float *s;
    uint16_t *out;
    int64_t k, s_cols, bn, bk, row0, row1;
} job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t i = j->row0; i < j->row1; i++) {
        const uint8_t *wr = j->w + i * j->k;
        uint16_t *orow = j->out + i * j->k;
        const float *srow = j->s + (i / j->bn) * j->s_cols;
        for (int64_t c0 = 0, b = 0; c0 < j->k; c0 += j->bk, b++) {
            const float sc = srow[b];
            int64_t c1 = c0 + j->bk < j->k ? c0 + j->bk : j->k;
            for (int64_t c = c0; c < c1; c++) orow[c] = bf16_rne(LUT[wr[c]] * sc);
        }
    }
    return NULL;
}

/* w: [n, k] uint8 (e4m3fn bits); s: [ceil(n/bn), s_cols] float32; out: [n, k] uint16 (bf16 bits) */
int cvt_dequant_fp8_block(const uint8_t *w, const float *s, uint16_t *out, int64_t n, int64_t k,
                          int64_t s_cols, int64_t bn, int64_t bk, int64_t nthreads) {
    if (!lut_ready) init_lut();
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (nthreads > n) nthreads = n > 0 ? n : 1;
    pthread_t th[64];
    int joined[64];
    job_t jobs[64];
    int64_t per = (n + nthreads - 1) / nthreads;
    for (int64_t t = 0; t < nthreads; t++) {
        job_t jb = {w, s, out, k, s_cols, bn, bk, t * per, (t + 1) * per < n ? (t + 1) * per : n};
        jobs[t] = jb;
    }
    for (int64_t t = 1; t < nthreads; t++) {
        joined[t] = pthread_create(&th[t], NULL, run, &jobs[t]) == 0;
        if (!joined[t]) run(&jobs[t]); /* no thread: do it here */
    }
    run(&jobs[0]);
    for (int64_t t = 1; t < nthreads; t++)
        if (joined[t]) pthread_join(th[t], NULL);
    return 0;
}

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_fp8kernel",
                                    "FP8 block dequant kernel (called through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__fp8kernel(void) { return PyModule_Create(&moddef); }
