/* y = x @ W.T for a weight W [N, K] held as 4-bit codes of a 16-value table with one float32
 * scale per group of K: W[n, k] = table[code[n, k]] * scale[n, k / group]. For the
 * dequantize-on-the-fly path of fewbits' QuantLinear (NF4, MXFP4, NVFP4, FP4 ...) at small
 * batches, where decoding the weight into a float matrix and calling a GEMM moves 8x more bytes
 * than the codes.
 *
 * Codes are packed two per byte, low nibble first, row by row (row_bytes = K / 2). A step reads
 * 16 bytes = 32 weights: the low nibbles are the weights at even k, the high ones at odd k, so
 * the caller passes x split into its even and odd columns and no shuffle of codes is needed. The
 * table lookup is one permute of a 16-lane register (GCC/Clang vector extensions: vpermps on
 * AVX-512). Each weight is table value times scale, rounded to float32 once, exactly as
 * QuantizedTensor.dequantize() computes it; the products with x accumulate in float32 (fused
 * multiply-add where the CPU has it), in an order of their own, as any GEMM's. Rows of W are
 * shared out over OpenMP threads when built with -fopenmp.
 */
#include <stdint.h>
#include <string.h>

#include "vec16.h"
typedef uint8_t vb __attribute__((vector_size(L)));

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < L; l++) s += v[l];
    return s;
}

#define MAX_M 8

/* fused multiply-add in the accumulation only: every weight is still rounded once, before it
 * meets x (the decode product is not an addend) */
#if defined(__GNUC__) && !defined(__clang__)
#define ACCUMULATE __attribute__((optimize("fp-contract=fast")))
#else
#define ACCUMULATE
#endif

/* the scales of the 16 lanes of step j: lane l holds weights 2(j + l) and 2(j + l) + 1, in one
 * group when group >= 32; with groups of 16, lanes 0-7 lie in one group and 8-15 in the next */
static inline vf step_scales(const float *srow, int64_t j, int64_t group) {
    const int64_t k0 = 2 * j;
    if (group >= 32) return (vf){0} + srow[k0 / group];
    const vi first_half = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    vi s0 = (vi)((vf){0} + srow[k0 / 16]), s1 = (vi)((vf){0} + srow[k0 / 16 + 1]);
    return (vf)((s0 & first_half) | (s1 & ~first_half));
}

/* One output row n for MR rows of x (MR a compile-time constant: the accumulators stay in
 * registers). */
#define DEFINE_ROW(MR)                                                                           \
    static ACCUMULATE void row_##MR(const float *xe, const float *xo, const uint8_t *row,        \
                                    const float *srow, vf table, int64_t half, int64_t group,    \
                                    float *y, int64_t N, int64_t n) {                            \
        vf acc[MR];                                                                              \
        for (int m = 0; m < MR; m++) acc[m] = (vf){0};                                           \
        for (int64_t j = 0; j < half; j += L) {                                                  \
            vb bytes;                                                                            \
            memcpy(&bytes, row + j, sizeof bytes);                                               \
            vi b = __builtin_convertvector(bytes, vi);                                           \
            vf s = step_scales(srow, j, group);                                                  \
            vf lo = lookup(table, b & 15) * s, hi = lookup(table, b >> 4) * s;                   \
            for (int m = 0; m < MR; m++) {                                                       \
                vf e, o;                                                                         \
                memcpy(&e, xe + m * half + j, sizeof e);                                         \
                memcpy(&o, xo + m * half + j, sizeof o);                                         \
                acc[m] += e * lo;                                                                \
                acc[m] += o * hi;                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int m = 0; m < MR; m++) y[m * N + n] = hsum(acc[m]);                                \
    }

DEFINE_ROW(1)
DEFINE_ROW(2)
DEFINE_ROW(3)
DEFINE_ROW(4)
DEFINE_ROW(5)
DEFINE_ROW(6)
DEFINE_ROW(7)
DEFINE_ROW(8)

/* y[m, n] for n in [n0, n1), m < M <= MAX_M.
 * xe, xo: [M, K/2] float32, the even and odd columns of x (zero-padded to K).
 * codes: [N, K/2] bytes; table: 16 floats; group a multiple of 16.
 * The scales: float32 [N, K / group] in `scales`, or (scales NULL) coded as bytes [N, K / group]
 * in `scale_codes`, each standing for scale_table[code] * scale_mul (one float32 product, as
 * fewbits computes NVFP4's E4M3 block scale times its tensor scale, or an MX E8M0 scale).
 * Returns 0, or -1 for an unsupported shape. */
int32_t fb_lut4_matmul(const float *xe, const float *xo, const uint8_t *codes, const float *scales,
                       const uint8_t *scale_codes, const float *scale_table, float scale_mul,
                       const float *table16, int64_t M, int64_t N, int64_t K, int64_t group,
                       float *y, int64_t n0, int64_t n1) {
    if (M < 1 || M > MAX_M || K % 32 != 0 || group % 16 != 0 || group < 16 || K % group != 0) return -1;
    if (!scales && (!scale_codes || !scale_table)) return -1;
    vf table;
    memcpy(&table, table16, sizeof table);
    const int64_t half = K / 2, groups = K / group;
    /* torch's own OpenMP threads (the process has one libgomp: torch's), as many as
     * torch.get_num_threads() says; one thread for a few rows */
#pragma omp parallel for schedule(static) if (n1 - n0 >= 64)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = codes + n * half;
        float decoded[groups]; /* this row's scales, when they come coded */
        const float *srow = scales + n * groups;
        if (!scales) {
            for (int64_t g = 0; g < groups; g++) decoded[g] = scale_table[scale_codes[n * groups + g]] * scale_mul;
            srow = decoded;
        }
        switch (M) {
        case 1: row_1(xe, xo, row, srow, table, half, group, y, N, n); break;
        case 2: row_2(xe, xo, row, srow, table, half, group, y, N, n); break;
        case 3: row_3(xe, xo, row, srow, table, half, group, y, N, n); break;
        case 4: row_4(xe, xo, row, srow, table, half, group, y, N, n); break;
        case 5: row_5(xe, xo, row, srow, table, half, group, y, N, n); break;
        case 6: row_6(xe, xo, row, srow, table, half, group, y, N, n); break;
        case 7: row_7(xe, xo, row, srow, table, half, group, y, N, n); break;
        default: row_8(xe, xo, row, srow, table, half, group, y, N, n); break;
        }
    }
    return 0;
}

/* W rows [r0, r1) decoded to float32, out [(r1 - r0), K]: the same decode as fb_lut4_matmul
 * (table value times scale, one float32 rounding: exactly QuantizedTensor.dequantize()), for
 * batches large enough that a GEMM on decoded blocks wins. Scales as in fb_lut4_matmul.
 * Returns 0, or -1 for an unsupported shape. */
int32_t fb_lut4_decode(const uint8_t *codes, const float *scales, const uint8_t *scale_codes,
                       const float *scale_table, float scale_mul, const float *table16, int64_t K,
                       int64_t group, int64_t r0, int64_t r1, float *out) {
    if (K % 32 != 0 || group % 16 != 0 || group < 16 || K % group != 0) return -1;
    if (!scales && (!scale_codes || !scale_table)) return -1;
    vf table;
    memcpy(&table, table16, sizeof table);
    const int64_t half = K / 2, groups = K / group;
    const vi first = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const vi second = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#pragma omp parallel for schedule(static) if (r1 - r0 >= 16)
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *row = codes + n * half;
        float decoded[groups];
        const float *srow = scales + n * groups;
        if (!scales) {
            for (int64_t g = 0; g < groups; g++) decoded[g] = scale_table[scale_codes[n * groups + g]] * scale_mul;
            srow = decoded;
        }
        float *o = out + (n - r0) * K;
        for (int64_t j = 0; j < half; j += L) {
            vb bytes;
            memcpy(&bytes, row + j, sizeof bytes);
            vi b = __builtin_convertvector(bytes, vi);
            vf s = step_scales(srow, j, group);
            vf lo = lookup(table, b & 15) * s, hi = lookup(table, b >> 4) * s;
#if defined(__GNUC__) && !defined(__clang__)
            vf a = __builtin_shuffle(lo, hi, first), c = __builtin_shuffle(lo, hi, second);
#else
            vf a, c;
            for (int l = 0; l < L; l++) {
                a[l] = l % 2 ? hi[l / 2] : lo[l / 2];
                c[l] = l % 2 ? hi[8 + l / 2] : lo[8 + l / 2];
            }
#endif
            memcpy(o + 2 * j, &a, sizeof a);
            memcpy(o + 2 * j + L, &c, sizeof c);
        }
    }
    return 0;
}
