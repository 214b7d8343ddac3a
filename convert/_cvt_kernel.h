/*
 * What cvt's C kernels share: convert/_fp8kernel.c (FP8 -> BF16) and quant/_qkernel.c (fused RTN
 * quantization, which decodes FP8 sources the same way) include this header; each is built as its
 * own extension, so everything here is static. Listed as `depends` of both in pyproject.toml and
 * shipped as package data of cvt.convert (the sdist must hold it to build either kernel).
 *
 * - the e4m3fn decode table: LUT[c] is code c as float32 (exact; a quiet NaN for 0x7f / 0xff),
 *   filled once by pthread_once(&lut_once, init_lut) (first calls may race from several threads);
 * - bf16_rne: float32 -> bfloat16 bits, round to nearest even (NaN kept, quiet), torch's rounding;
 * - cpu_simd: AVX2 + F16C present at run time on x86, NEON on aarch64 (always), 0 elsewhere;
 *   cpu_avx512: AVX-512F too (x86 only);
 * - fp8_scales_simd_ok: the SIMD FP8 decode rescales by an exact 2**8, so it needs every block
 *   scale finite and below 2**100 in magnitude;
 * - run_jobs: the row blocks' fan-out over pthreads.
 */
#ifndef CVT_KERNEL_H
#define CVT_KERNEL_H

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CVT_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

static float LUT[256];
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

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
}

static inline uint16_t bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x0040u);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

#ifdef CVT_X86
static int cpu_simd(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
static inline int cpu_avx512(void) {
    __builtin_cpu_init();
    return cpu_simd() && __builtin_cpu_supports("avx512f");
}
#elif defined(__aarch64__)
static int cpu_simd(void) { return 1; } /* NEON: part of every AArch64 CPU */
static inline int cpu_avx512(void) { return 0; }
#else
static int cpu_simd(void) { return 0; }
static inline int cpu_avx512(void) { return 0; }
#endif

/* s: the `count` float32 block scales of an FP8 weight */
static int fp8_scales_simd_ok(const float *s, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (!(s[i] < 0x1p100f && s[i] > -0x1p100f)) return 0;
    return 1;
}

/* fn on each of the nt (1..64) jobs laid out `size` bytes apart: jobs 1.. on their own pthreads
 * (on this thread when one cannot start), job 0 on this thread; returns when all are done. */
static void run_jobs(void *(*fn)(void *), void *jobs, size_t size, int64_t nt) {
    pthread_t th[64];
    int joined[64] = {0};
    for (int64_t t = 1; t < nt; t++) {
        void *jb = (char *)jobs + (size_t)t * size;
        joined[t] = pthread_create(&th[t], NULL, fn, jb) == 0;
        if (!joined[t]) fn(jb); /* no thread: do it here */
    }
    fn(jobs);
    for (int64_t t = 1; t < nt; t++)
        if (joined[t]) pthread_join(th[t], NULL);
}

#endif
