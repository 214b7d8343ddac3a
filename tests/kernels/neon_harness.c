/*
 * Runs one of cvt's C kernels alone (no Python), so that their aarch64 NEON paths can be tested on
 * an x86 machine: tests/convert/test_neon_kernels.py builds this file with aarch64-linux-gnu-gcc
 * (-DHARNESS_FP8 or -DHARNESS_QUANT, -static) and runs it under qemu-aarch64 at SIMD level 0
 * (scalar) and 1 (NEON), comparing both with the torch reference.
 *
 *   harness-fp8   N K BN BK SIMD W S OUT
 *       W: [N, K] e4m3 codes; S: [ceil(N/BN), ceil(K/BK)] float32; OUT: [N, K] bf16 bits;
 *       prints the level and the kernel's non-finite count
 *   harness-quant N K SRC BN BK MODE GROUP QMIN QMAX PACK QDIV GS SIMD W S OUT
 *       W: BF16 bits (SRC 0) or e4m3 codes (SRC 1); S: the FP8 block scale (any file for BF16);
 *       writes OUT.q, OUT.scale, OUT.offset, OUT.scale8, OUT.scale_bf16 (the cvt_qargs buffers)
 *       and OUT.sums (2 doubles); prints the non-finite count, the level and (MODE 0, the
 *       global-scale pass) max |w| as a C99 hex float
 * Files are raw little-endian arrays. Exit 2 on bad arguments or I/O errors.
 */
#define CVT_NO_PYTHON 1
#include <stdio.h>
#include <stdlib.h>
#if defined(HARNESS_FP8)
#include "../../convert/_fp8kernel.c"
#elif defined(HARNESS_QUANT)
#include "../../quant/_qkernel.c"
#else
#error "build with -DHARNESS_FP8 or -DHARNESS_QUANT"
#endif

static void *slurp(const char *path, size_t want) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    void *buf = malloc(want ? want : 1);
    if (!buf || fread(buf, 1, want, f) != want) { fprintf(stderr, "%s: short read\n", path); exit(2); }
    fclose(f);
    return buf;
}

static void spill(const char *path, const char *suffix, const void *buf, size_t n) {
    char name[4096];
    snprintf(name, sizeof name, "%s%s", path, suffix);
    FILE *f = fopen(name, "wb");
    if (!f || fwrite(buf, 1, n, f) != n) { perror(name); exit(2); }
    fclose(f);
}

int main(int argc, char **argv) {
#if defined(HARNESS_FP8)
    if (argc != 9) { fprintf(stderr, "usage: N K BN BK SIMD W S OUT\n"); return 2; }
    int64_t n = atoll(argv[1]), k = atoll(argv[2]), bn = atoll(argv[3]), bk = atoll(argv[4]), simd = atoll(argv[5]);
    int64_t sr = (n + bn - 1) / bn, sc = (k + bk - 1) / bk;
    uint8_t *w = slurp(argv[6], (size_t)(n * k));
    float *s = slurp(argv[7], sizeof(float) * (size_t)(sr * sc));
    uint16_t *out = malloc(2 * (size_t)(n * k) + 2);
    long long bad = (long long)cvt_dequant_fp8_block(w, s, out, n, k, sc, bn, bk, 3, simd);
    spill(argv[8], "", out, 2 * (size_t)(n * k));
    printf("level %d\n", cvt_fp8_simd_level(simd));
    printf("nonfinite %lld\n", bad);
#else
    if (argc != 17) { fprintf(stderr, "usage: N K SRC BN BK MODE GROUP QMIN QMAX PACK QDIV GS SIMD W S OUT\n"); return 2; }
    cvt_qargs a;
    memset(&a, 0, sizeof a);
    a.n = atoll(argv[1]), a.k = atoll(argv[2]), a.src_kind = atoll(argv[3]), a.bn = atoll(argv[4]);
    a.bk = atoll(argv[5]), a.mode = atoll(argv[6]), a.group = atoll(argv[7]), a.qmin = atoll(argv[8]);
    a.qmax = atoll(argv[9]), a.pack = atoll(argv[10]), a.qdiv = (float)atof(argv[11]);
    a.global_scale = (float)atof(argv[12]), a.simd = atoll(argv[13]), a.nthreads = 3;
    int64_t n = a.n, k = a.k, ng = k / (a.group > 0 ? a.group : 1);
    a.src = slurp(argv[14], (size_t)(n * k * (a.src_kind == SRC_BF16 ? 2 : 1)));
    if (a.src_kind == SRC_FP8) {
        a.s_cols = (k + a.bk - 1) / a.bk;
        a.fp8_scale = slurp(argv[15], sizeof(float) * (size_t)(((n + a.bn - 1) / a.bn) * a.s_cols));
    }
    size_t qbytes = a.pack == PACK_I8 ? (size_t)(n * k) : a.pack == PACK_CT32 ? (size_t)(n * ((k + 7) / 8) * 4)
                                                                            : (size_t)(n * k / 2);
    double sums[2] = {0, 0};
    int64_t bad = 0;
    float amax = 0.0f;
    a.q = calloc(qbytes + 1, 1), a.scale = calloc((size_t)(n * ng) + 1, 4), a.offset = calloc((size_t)(n * ng) + 1, 4);
    a.scale8 = calloc((size_t)(n * ng) + 1, 1), a.sums = sums, a.nonfinite = &bad;
    a.scale_bf16 = calloc((size_t)(n * ng) + 1, 2), a.amax = &amax;
    int rc = cvt_quantize(&a);
    if (rc) { fprintf(stderr, "cvt_quantize: rc %d\n", rc); return 2; }
    spill(argv[16], ".q", a.q, qbytes);
    spill(argv[16], ".scale", a.scale, 4 * (size_t)(n * ng));
    spill(argv[16], ".offset", a.offset, 4 * (size_t)(n * ng));
    spill(argv[16], ".scale8", a.scale8, (size_t)(n * ng));
    spill(argv[16], ".scale_bf16", a.scale_bf16, 2 * (size_t)(n * ng));
    spill(argv[16], ".sums", sums, sizeof sums);
    printf("nonfinite %lld level %d amax %a\n", (long long)bad, cvt_simd_level(a.simd), (double)amax);
#endif
    return 0;
}
