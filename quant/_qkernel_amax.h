/*
 * MODE_AMAX of quant/_qkernel.c: max |w| of a weight without decoding it (nvfp4's per-tensor global
 * scale, a fused group's shared one), row by row (amax_row, run on the row threads) or, for an
 * FP8 weight, over as few blocks as can hold the max (amax_fp8_pruned). Included by _qkernel.c
 * alone, after the SIMD parts; not a header of its own.
 */
#ifndef CVT_QKERNEL_AMAX_H
#define CVT_QKERNEL_AMAX_H

/* max of p[j] & 0x7f over len bytes: an FP8 span's largest magnitude code */
static uint8_t max_code(const uint8_t *p, int64_t len, int simd) {
    uint8_t mc = 0;
    int64_t j = 0;
#ifdef CVT_X86
    if (simd) mc = max_code_avx2(p, len, &j);
#endif
    (void)simd; /* elsewhere the byte max is auto-vectorized */
    for (; j < len; j++) {
        uint8_t c = p[j] & 0x7f;
        mc = c > mc ? c : mc;
    }
    return mc;
}

/* an FP8 span's max |w| from its largest magnitude code mc and block scale s (bf16(x * s) is
 * monotonic in x); 0 when it is not finite (a NaN code, or a product that overflows) */
static inline int code_amax(uint8_t mc, float s, float *v) {
    *v = fabsf(bf16_round(LUT[mc] * s));
    return mc != 0x7f && !not_finite(*v);
}

/* max |w| of row i without decoding it (MODE_AMAX: nvfp4's global scale, a fused group's):
 * e4m3fn and bf16 magnitudes order like their bit patterns (sign bit cleared), and
 * bf16(x * s) is monotonic in x for a fixed scale s, so each FP8 block's largest magnitude code
 * gives the block's max |w| exactly, as decoding every element would. Returns how many blocks
 * hold a non-finite value (a NaN code, or a product that is not finite: the caller only needs
 * whether any does). */
static int64_t amax_row(const cvt_qargs *a, int64_t i, float *out, int simd) {
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
            float v;
            if (!code_amax(max_code(row + b0, b1 - b0, simd), srow[b0 / a->bk], &v)) { bad++; continue; }
            m = v > m ? v : m;
        }
    }
    *out = m;
    return bad;
}

/* MODE_AMAX of an FP8 weight, reading as few blocks as it can: block b's max |w| is
 * |bf16(LUT[max code] * s_b)| <= bf16(448 * |s_b|) (448: the largest finite e4m3 magnitude), so
 * blocks are read in decreasing order of that bound, and reading stops at the first whose bound
 * does not exceed the max found -- exact, as no unread block can hold more. With block scales
 * chosen as the block's amax / 448 (DeepSeek's releases, and most FP8 ones), the block holding
 * the max comes first and the rest of the weight is not read: this pass had cost a full read of
 * every nvfp4 weight from memory before the quantize pass read it again. Reads at most
 * AMAX_BLOCKS blocks so (a weight whose scales do not track its codes then takes the full
 * threaded pass). A NaN code in a block read counts as non-finite (the caller needs whether any);
 * one in a block not read is refused by the quantize pass, which counts every element.
 * Returns 1 when it found the answer (*amax, *bad), 0 when the full pass must run. */
#define AMAX_BLOCKS 16
typedef struct { float ub; int32_t b; } amax_block_t;

static int by_bound_desc(const void *x, const void *y) {
    float u = ((const amax_block_t *)x)->ub, v = ((const amax_block_t *)y)->ub;
    int32_t p = ((const amax_block_t *)x)->b, q = ((const amax_block_t *)y)->b;
    return u > v ? -1 : (u < v ? 1 : (p > q) - (p < q)); /* ties by index: a fixed order */
}

static int amax_fp8_pruned(const cvt_qargs *a, int simd, float *amax, int64_t *bad) {
    int64_t n = a->n, k = a->k, rb = (n + a->bn - 1) / a->bn, cb = (k + a->bk - 1) / a->bk;
    if (rb * cb > (int64_t)1 << 30) return 0;
    amax_block_t *blk = (amax_block_t *)malloc(sizeof(amax_block_t) * (size_t)(rb * cb));
    if (!blk) return 0;
    for (int64_t r = 0; r < rb; r++)
        for (int64_t c = 0; c < cb; c++) {
            float ub = bf16_round(448.0f * fabsf(a->fp8_scale[r * a->s_cols + c]));
            if (!(ub <= 0x1p127f)) { free(blk); return 0; } /* a non-finite scale or bound: read everything */
            blk[r * cb + c] = (amax_block_t){ub, (int32_t)(r * cb + c)};
        }
    qsort(blk, (size_t)(rb * cb), sizeof(amax_block_t), by_bound_desc);
    float m = 0.0f;
    int64_t t = 0;
    for (; t < rb * cb && blk[t].ub > m; t++) {
        if (t == AMAX_BLOCKS) break;
        int64_t r = blk[t].b / cb, c = blk[t].b % cb;
        int64_t r1 = (r + 1) * a->bn < n ? (r + 1) * a->bn : n, c0 = c * a->bk, c1 = c0 + a->bk < k ? c0 + a->bk : k;
        uint8_t mc = 0;
        for (int64_t i = r * a->bn; i < r1; i++) {
            uint8_t x = max_code((const uint8_t *)a->src + i * k + c0, c1 - c0, simd);
            mc = x > mc ? x : mc;
        }
        float v;
        if (!code_amax(mc, a->fp8_scale[r * a->s_cols + c], &v)) { *bad = 1; break; }
        m = v > m ? v : m;
    }
    /* found: every block read or bounded by m, or a NaN code met; not: AMAX_BLOCKS read */
    int found = *bad || t == rb * cb || blk[t].ub <= m;
    free(blk);
    if (found) *amax = m;
    return found;
}

#endif
