/* y = x @ W.T for a weight W [N, K] held as 4-bit codes of a 16-value table with one float32
 * scale per group of K: W[n, k] = table[code[n, k]] * scale[n, k / group] (INT4 too: its
 * table is 0..7, -8..-1). For the
 * dequantize-on-the-fly path of fewbits' QuantLinear (NF4, MXFP4, NVFP4, FP4 ...): at small
 * batches the fused matmul reads the codes (8x fewer bytes than float32 weights) and never writes
 * the weight to memory; at larger batches blocks of rows are decoded, to float32 or to bfloat16,
 * for a GEMM.
 *
 * Asymmetric schemes too: with an integer zero point z and / or a float minimum m per group,
 * W = ((table[code] - z) * scale) + m, each step one float32 rounding as dequantize() does it;
 * the 16 values a group's codes can take are computed once per group and looked up.
 *
 * Codes are packed two per byte, low nibble first, row by row (row_bytes = K / 2). The low
 * nibbles are the weights at even k, the high ones at odd k, so the caller passes x split into
 * its even and odd columns and no shuffle of codes is needed. Each weight is table value times
 * scale, rounded to float32 once, exactly as QuantizedTensor.dequantize() computes it; the
 * products with x accumulate in float32 with fused multiply-adds, in an order of their own, as
 * any GEMM's (it depends on the vector width: 16 lanes with AVX-512, 8 with AVX2, 1 otherwise).
 *
 * One row of x with AVX-512 (generation's decode step) takes a path of its own (one_row below):
 * the codes read 128 weights at a time with no widening, and for groups of 16, 32 or 64 without
 * zero points or minimums (NVFP4, MX, NF4, Q4_0) table value times x summed over each 8 columns
 * of a group, then multiplied by the group's scale once: the same sum up to float32 rounding,
 * within the same bound (a row with an infinite or NaN scale multiplies each weight by it first,
 * as the decoded weight does); groups of 128 or more look up the scaled table, as everywhere else.
 * (Tried for it and not kept: the row on AMX tiles, for tables of bfloat16 numbers such as INT4's
 * -- x split into three bfloat16 parts (exact but for x so small that a part is a bfloat16
 * denormal, which the tiles read as zero), 16 or 32 weight rows decoded a 128-column chunk at
 * a time to bfloat16 with 4 word lookups and 3 shifts per 128 weights, TDPBF16PS summing each
 * group apart. On 4096 x 4096 int4 g128 at one thread it took 0.84-0.92 ms with the codes in L3
 * against this path's 0.65-0.72 ms (before the groups-of-128 loop in one_row, ~1.1x faster since),
 * and 1.5-1.7x this path's time from memory; even with every row's codes read from L1 (its best
 * case) 0.56 ms against 0.66: the decode to bfloat16, two bytes stored and tile-loaded per weight,
 * costs about what the lookups and multiply-adds here do.)
 *
 * Three builds of the same loops, chosen by the compiler's target (-march=native):
 *   AVX-512F   a step is 16 code bytes = 32 weights; widening is vpmovzxbd, the table lookup one
 *              vpermps of a 16-float register.
 *   AVX2+FMA   a step is 8 bytes = 16 weights; the 16-entry lookup is two 8-entry vpermps and a
 *              blend on bit 3 of the code.
 *   otherwise  scalar C.
 * (GCC's generic vector extensions were tried first: GCC 12 widens a byte vector to int32 lanes
 * one byte at a time through general registers, which made the fused matmul 7x slower than this.)
 * Rows of W are shared out over torch's OpenMP threads when built with -fopenmp.
 *
 * Batches on CPUs with AMX (fb_lut4_tile_matmul): blocks of 32 rows decoded to bfloat16 into a
 * buffer that stays in the caches and multiplied there on the tiles (tiles.h).
 */
#include "tiles.h" /* first: it declares what it needs of the system headers */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "threads.h"
#include "rowwalk.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define W 16 /* float lanes; a step is 2W weights */
typedef __m512 F;
static inline F f_zero(void) { return _mm512_setzero_ps(); }
static inline F f_set1(float v) { return _mm512_set1_ps(v); }
static inline F f_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void f_store(float *p, F v) { _mm512_storeu_ps(p, v); }
static inline F f_mul(F a, F b) { return _mm512_mul_ps(a, b); }
static inline F f_fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
static inline F f_add(F a, F b) { return _mm512_add_ps(a, b); }
static inline F f_sub(F a, F b) { return _mm512_sub_ps(a, b); }
static inline float f_sum(F v) { return _mm512_reduce_add_ps(v); }
typedef struct { F t; } Table;
static inline Table table_load(const float *t16) { Table t = {_mm512_loadu_ps(t16)}; return t; }
static inline Table table_scaled(Table t, float s) { Table r = {_mm512_mul_ps(t.t, _mm512_set1_ps(s))}; return r; }
static inline Table table_plus(Table t, float a) { Table r = {_mm512_add_ps(t.t, _mm512_set1_ps(a))}; return r; }
/* the table values of the 2W weights of code bytes p[0 .. W): lo = even k, hi = odd k (vpermps
 * reads the low 4 bits of each index: the high nibble needs no mask) */
static inline void decode_step(const uint8_t *p, Table t, F *lo, F *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(b, t.t);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t.t);
}
/* scales of a step whose weights 0..15 lie in group a and 16..31 in group b */
static inline F f_two(float a, float b) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b)); }
/* lo, hi back into k order: out[0 .. 2W) */
static inline void store_interleaved(float *out, F lo, F hi) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(out + W, _mm512_permutex2var_ps(lo, second, hi));
}
/* round to nearest even to bfloat16 (torch's float -> bfloat16 for numbers; NaN -> 0x7FC0):
 * the bfloat16 in the high half of each 32-bit lane, the low half garbage */
static inline __m512i bf16_high(F v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC00000));
}
/* lo (even k) and hi (odd k) as bfloat16 in k order: each 32-bit lane holds the pair (k, k + 1),
 * little-endian, so out[0 .. 2W) is one store */
static inline void store_interleaved_bf16(uint16_t *out, F lo, F hi) {
    const __m512i pairs = _mm512_or_si512(_mm512_srli_epi32(bf16_high(lo), 16),
                                          _mm512_and_si512(bf16_high(hi), _mm512_set1_epi32((int)0xFFFF0000u)));
    _mm512_storeu_si512((void *)out, pairs);
}
/* a scaled table's values as bfloat16, once per group: in the low half of each entry (for even k)
 * and in the high half (odd k), so that a step of codes decodes to bfloat16 pairs with two
 * lookups and an or */
typedef struct { F lo, hi; } BTable;
static inline BTable btable_of(Table scaled) {
    const __m512i h = bf16_high(scaled.t);
    BTable b = {_mm512_castsi512_ps(_mm512_srli_epi32(h, 16)),
                _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32((int)0xFFFF0000u)))};
    return b;
}
static inline void store_bf16_step(const uint8_t *p, BTable t, uint16_t *out) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i lo = _mm512_castps_si512(_mm512_permutexvar_ps(b, t.lo));
    const __m512i hi = _mm512_castps_si512(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t.hi));
    _mm512_storeu_si512((void *)out, _mm512_or_si512(lo, hi));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W 8
typedef __m256 F;
static inline F f_zero(void) { return _mm256_setzero_ps(); }
static inline F f_set1(float v) { return _mm256_set1_ps(v); }
static inline F f_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void f_store(float *p, F v) { _mm256_storeu_ps(p, v); }
static inline F f_mul(F a, F b) { return _mm256_mul_ps(a, b); }
static inline F f_fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
static inline F f_add(F a, F b) { return _mm256_add_ps(a, b); }
static inline F f_sub(F a, F b) { return _mm256_sub_ps(a, b); }
static inline float f_sum(F v) {
    float t[W];
    _mm256_storeu_ps(t, v);
    return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}
typedef struct { F lo, hi; } Table;
static inline Table table_load(const float *t16) { Table t = {_mm256_loadu_ps(t16), _mm256_loadu_ps(t16 + 8)}; return t; }
static inline Table table_scaled(Table t, float s) {
    const F v = _mm256_set1_ps(s);
    Table r = {_mm256_mul_ps(t.lo, v), _mm256_mul_ps(t.hi, v)};
    return r;
}
static inline Table table_plus(Table t, float a) {
    const F v = _mm256_set1_ps(a);
    Table r = {_mm256_add_ps(t.lo, v), _mm256_add_ps(t.hi, v)};
    return r;
}
/* entry i & 15 of the 16-entry table (vpermps reads bits 0-2, the blend bit 3; higher bits are
 * shifted out) */
static inline F lookup8(Table t, __m256i i) {
    const F a = _mm256_permutevar8x32_ps(t.lo, i), b = _mm256_permutevar8x32_ps(t.hi, i);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}
static inline void decode_step(const uint8_t *p, Table t, F *lo, F *hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = lookup8(t, b);
    *hi = lookup8(t, _mm256_srli_epi32(b, 4));
}
static inline F f_two(float a, float b) { (void)b; return _mm256_set1_ps(a); } /* a step never spans groups */
static inline void store_interleaved(float *out, F lo, F hi) {
    const F a = _mm256_unpacklo_ps(lo, hi), c = _mm256_unpackhi_ps(lo, hi);
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(a, c, 0x20));
    _mm256_storeu_ps(out + W, _mm256_permute2f128_ps(a, c, 0x31));
}
static inline __m256i bf16_high(F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline void store_interleaved_bf16(uint16_t *out, F lo, F hi) {
    const __m256i pairs = _mm256_or_si256(_mm256_srli_epi32(bf16_high(lo), 16),
                                          _mm256_and_si256(bf16_high(hi), _mm256_set1_epi32((int)0xFFFF0000u)));
    _mm256_storeu_si256((__m256i *)out, pairs);
}
typedef struct { Table lo, hi; } BTable;
static inline BTable btable_of(Table scaled) {
    const __m256i a = bf16_high(scaled.lo), c = bf16_high(scaled.hi);
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    BTable b = {{_mm256_castsi256_ps(_mm256_srli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_srli_epi32(c, 16))},
                {_mm256_castsi256_ps(_mm256_and_si256(a, top)), _mm256_castsi256_ps(_mm256_and_si256(c, top))}};
    return b;
}
static inline void store_bf16_step(const uint8_t *p, BTable t, uint16_t *out) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i lo = _mm256_castps_si256(lookup8(t.lo, b));
    const __m256i hi = _mm256_castps_si256(lookup8(t.hi, _mm256_srli_epi32(b, 4)));
    _mm256_storeu_si256((__m256i *)out, _mm256_or_si256(lo, hi));
}

#else /* scalar */
#define W 1
typedef float F;
static inline F f_zero(void) { return 0.0f; }
static inline F f_set1(float v) { return v; }
static inline F f_load(const float *p) { return *p; }
static inline void f_store(float *p, F v) { *p = v; }
static inline F f_mul(F a, F b) { return a * b; }
static inline F f_fma(F a, F b, F c) { return fmaf(a, b, c); }
static inline F f_add(F a, F b) { return a + b; }
static inline F f_sub(F a, F b) { return a - b; }
static inline float f_sum(F v) { return v; }
typedef struct { float t[16]; } Table;
static inline Table table_load(const float *t16) { Table t; memcpy(t.t, t16, sizeof t.t); return t; }
static inline Table table_scaled(Table t, float s) {
    Table r;
    for (int i = 0; i < 16; i++) r.t[i] = t.t[i] * s;
    return r;
}
static inline Table table_plus(Table t, float a) {
    Table r;
    for (int i = 0; i < 16; i++) r.t[i] = t.t[i] + a;
    return r;
}
static inline void decode_step(const uint8_t *p, Table t, F *lo, F *hi) {
    *lo = t.t[p[0] & 15];
    *hi = t.t[p[0] >> 4];
}
static inline F f_two(float a, float b) { (void)b; return a; }
static inline void store_interleaved(float *out, F lo, F hi) { out[0] = lo; out[1] = hi; }
static inline uint16_t bf16_one(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if (v != v) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
static inline void store_interleaved_bf16(uint16_t *out, F lo, F hi) { out[0] = bf16_one(lo); out[1] = bf16_one(hi); }
typedef struct { uint16_t t[16]; } BTable;
static inline BTable btable_of(Table scaled) {
    BTable b;
    for (int i = 0; i < 16; i++) b.t[i] = bf16_one(scaled.t[i]);
    return b;
}
static inline void store_bf16_step(const uint8_t *p, BTable t, uint16_t *out) {
    out[0] = t.t[p[0] & 15];
    out[1] = t.t[p[0] >> 4];
}
#endif

#define STEP (2 * W) /* weights per step; code bytes per step: W */
#define PREFETCH_ROWS 4 /* the fused matmul asks for the codes of the row this far ahead */

/* A row's parameters per group: scales, and (NULL where the scheme has none) integer zero points
 * as float32 and float minimums. A weight is ((table[code] - zero point) * scale) + minimum,
 * each operation one float32 rounding, in QuantizedTensor.dequantize()'s order. */
typedef struct {
    const float *s, *z, *m;
} RowParams;
/* the 16 weights a code can stand for in group g */
static inline Table table_for(Table t, RowParams rp, int64_t g) {
    if (rp.z) t = table_plus(t, -rp.z[g]); /* v - z is v + (-z): the same rounding */
    t = table_scaled(t, rp.s[g]);
    if (rp.m) t = table_plus(t, rp.m[g]);
    return t;
}
#define MAX_M 8

/* Walks a row's steps with their scales and hands each step's decoded weights (lo: even k, hi:
 * odd k, each table value times its scale rounded to float32 once) to STEP_BODY(A), with j the
 * step's first code byte and A (0 or 1) alternating from step to step where it can, so that a
 * body may keep two sets of accumulators (a fused multiply-add takes 4 cycles, a step 3).
 * With group a multiple of STEP a step lies in one group: the table is multiplied by the group's
 * scale once (table[c] * s is the same float32 product per weight) and looked up already
 * scaled. Otherwise (group 16 or 48 ... with AVX-512's 32-weight steps) a step's first and second
 * 16 weights may lie in two groups, and the looked-up values are multiplied by a vector of the
 * two scales. */
#define DECODE_SCALED(j, ts) \
    F lo, hi;                \
    decode_step(row_ + (j), (ts), &lo, &hi);
/* the groups of a step's two halves (a division only for groups other than 16: NVFP4's 16 is
 * the one that matters, and a division per step would cost more than the step) */
#define GROUP_OF(k) (group_ == 16 ? (k) >> 4 : (k) / group_)
#define TWO(p, j) f_two((p)[GROUP_OF(2 * (j))], (p)[GROUP_OF(2 * (j) + 16)])
#define DECODE_MIXED(j)                                                                          \
    F lo, hi;                                                                                    \
    decode_step(row_ + (j), table_, &lo, &hi);                                                   \
    {                                                                                            \
        if (rp_.z) {                                                                             \
            const F z_ = TWO(rp_.z, j);                                                          \
            lo = f_sub(lo, z_);                                                                  \
            hi = f_sub(hi, z_);                                                                  \
        }                                                                                        \
        const F s_ = TWO(rp_.s, j);                                                              \
        lo = f_mul(lo, s_);                                                                      \
        hi = f_mul(hi, s_);                                                                      \
        if (rp_.m) {                                                                             \
            const F m_ = TWO(rp_.m, j);                                                          \
            lo = f_add(lo, m_);                                                                  \
            hi = f_add(hi, m_);                                                                  \
        }                                                                                        \
    }
/* NVFP4's groups of 16 with AVX-512 (no zero points, no minimums): a step's two groups' scales
 * are one vector (the first 16 weights' scale in lanes 0-7, the second's in 8-15: the order of
 * lo and hi), read from the row's scales as the steps walk them, without a division */
#if W == 16
#define G16_SCALES(p) _mm512_mask_broadcastss_ps(_mm512_set1_ps((p)[0]), 0xFF00, _mm_load_ss((p) + 1))
#define DECODE_G16(j, p)                                                                          \
    F lo, hi;                                                                                    \
    decode_step(row_ + (j), table_, &lo, &hi);                                                   \
    {                                                                                            \
        const F sv_ = G16_SCALES(p);                                                             \
        lo = f_mul(lo, sv_);                                                                     \
        hi = f_mul(hi, sv_);                                                                     \
    }
#define G16_BRANCH(STEP_BODY)                                                                    \
    if (group_ == 16 && !rp_.z && !rp_.m) {                                                      \
        const float *sp_ = rp_.s;                                                                \
        int64_t j = 0;                                                                           \
        for (; j + 2 * W <= half_; j += 2 * W, sp_ += 4) {                                       \
            { DECODE_G16(j, sp_) STEP_BODY(0, j) }                                               \
            { DECODE_G16(j + W, sp_ + 2) STEP_BODY(1, j + W) }                                   \
        }                                                                                        \
        if (j < half_) { DECODE_G16(j, sp_) STEP_BODY(0, j) }                                    \
    } else
#else
#define G16_BRANCH(STEP_BODY)
#endif
#define FOR_EACH_STEP(row, rp, table, half, group, STEP_BODY)                                     \
    do {                                                                                         \
        const uint8_t *row_ = (row);                                                             \
        const RowParams rp_ = (rp);                                                              \
        const Table table_ = (table);                                                            \
        const int64_t half_ = (half), group_ = (group), bytes_ = group_ / 2;                     \
        G16_BRANCH(STEP_BODY)                                                                    \
        if (group_ % (2 * STEP) == 0) { /* an even number of steps per group */                 \
            for (int64_t j0 = 0, g = 0; j0 < half_; j0 += bytes_, g++) {                         \
                const Table ts = table_for(table_, rp_, g);                                      \
                for (int64_t j = j0; j < j0 + bytes_; j += 2 * W) {                              \
                    { DECODE_SCALED(j, ts) STEP_BODY(0, j) }                                     \
                    { DECODE_SCALED(j + W, ts) STEP_BODY(1, j + W) }                             \
                }                                                                                \
            }                                                                                    \
        } else if (group_ == STEP) { /* one step per group: groups in pairs */                   \
            int64_t j = 0, g = 0;                                                                \
            for (; j + 2 * W <= half_; j += 2 * W, g += 2) {                                     \
                { DECODE_SCALED(j, table_for(table_, rp_, g)) STEP_BODY(0, j) }             \
                { DECODE_SCALED(j + W, table_for(table_, rp_, g + 1)) STEP_BODY(1, j + W) } \
            }                                                                                    \
            if (j < half_) { DECODE_SCALED(j, table_for(table_, rp_, g)) STEP_BODY(0, j) }  \
        } else if (group_ % STEP == 0) {                                                         \
            for (int64_t j0 = 0, g = 0; j0 < half_; j0 += bytes_, g++) {                         \
                const Table ts = table_for(table_, rp_, g);                                      \
                for (int64_t j = j0; j < j0 + bytes_; j += W) { DECODE_SCALED(j, ts) STEP_BODY(0, j) } \
            }                                                                                    \
        } else {                                                                                 \
            int64_t j = 0;                                                                       \
            for (; j + 2 * W <= half_; j += 2 * W) {                                             \
                { DECODE_MIXED(j) STEP_BODY(0, j) }                                              \
                { DECODE_MIXED(j + W) STEP_BODY(1, j + W) }                                      \
            }                                                                                    \
            if (j < half_) { DECODE_MIXED(j) STEP_BODY(0, j) }                                   \
        }                                                                                        \
    } while (0)

/* One output row n for MR rows of x (MR a compile-time constant: the accumulators stay in
 * registers); for each row of x two accumulators (even and odd k), in two sets where few rows
 * leave too few independent chains (up to TWO_SETS_MAX_MR rows: the registers hold them). */
#define TWO_SETS_MAX_MR (W > 8 ? 4 : 2)
#define ACCUMULATE(A, j)                                                                         \
    for (int m = 0; m < MR_; m++) {                                                              \
        const int a_ = MR_ <= TWO_SETS_MAX_MR ? (A) : 0;                                         \
        acc[a_][0][m] = f_fma(f_load(xe + m * half + (j)), lo, acc[a_][0][m]);                   \
        acc[a_][1][m] = f_fma(f_load(xo + m * half + (j)), hi, acc[a_][1][m]);                   \
    }
#define DEFINE_ROW(MR)                                                                           \
    static void row_##MR(const float *xe, const float *xo, const uint8_t *row, RowParams rp,       \
                         Table table, int64_t half, int64_t group, float *y, int64_t N,            \
                         int64_t n) {                                                            \
        enum { MR_ = MR };                                                                       \
        F acc[2][2][MR];                                                                         \
        for (int m = 0; m < MR; m++) acc[0][0][m] = acc[0][1][m] = acc[1][0][m] = acc[1][1][m] = f_zero(); \
        FOR_EACH_STEP(row, rp, table, half, group, ACCUMULATE);                                  \
        for (int m = 0; m < MR; m++)                                                             \
            y[m * N + n] = f_sum(f_add(f_add(acc[0][0][m], acc[0][1][m]), f_add(acc[1][0][m], acc[1][1][m]))); \
    }

DEFINE_ROW(1)
DEFINE_ROW(2)
DEFINE_ROW(3)
DEFINE_ROW(4)
#if W > 8 /* AVX2 has 16 vector registers: more rows of x would spill; they run four at a time */
DEFINE_ROW(5)
DEFINE_ROW(6)
DEFINE_ROW(7)
DEFINE_ROW(8)
#define ROWS_PER_PASS 8
#else
#define ROWS_PER_PASS 4
#endif

static void row_any(const float *xe, const float *xo, const uint8_t *row, RowParams rp, Table table,
                    int64_t half, int64_t group, float *y, int64_t N, int64_t n, int64_t M) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
        const int64_t mr = M - m0 < ROWS_PER_PASS ? M - m0 : ROWS_PER_PASS;
        const float *e = xe + m0 * half, *o = xo + m0 * half;
        float *out = y + m0 * N;
        switch (mr) {
        case 1: row_1(e, o, row, rp, table, half, group, out, N, n); break;
        case 2: row_2(e, o, row, rp, table, half, group, out, N, n); break;
        case 3: row_3(e, o, row, rp, table, half, group, out, N, n); break;
#if W > 8
        case 4: row_4(e, o, row, rp, table, half, group, out, N, n); break;
        case 5: row_5(e, o, row, rp, table, half, group, out, N, n); break;
        case 6: row_6(e, o, row, rp, table, half, group, out, N, n); break;
        case 7: row_7(e, o, row, rp, table, half, group, out, N, n); break;
        default: row_8(e, o, row, rp, table, half, group, out, N, n); break;
#else
        default: row_4(e, o, row, rp, table, half, group, out, N, n); break;
#endif
        }
    }
}

static int shape_ok(int64_t K, int64_t group) {
    return K % 32 == 0 && group % 16 == 0 && group >= 16 && K % group == 0;
}

/* float16 and bfloat16 values read exactly as float32 */
static inline float from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (e == 0) {
        const float v = (float)man * 0x1p-24f; /* zero or subnormal: exact */
        memcpy(&u, &v, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((e + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

enum { P_F32 = 0, P_F16 = 1, P_BF16 = 2 }; /* the storage of a per-group parameter */
/* A weight's per-group parameters [N, groups] (zero points and minimums may be NULL); the scales
 * may instead be byte codes standing for scale_table[code] * scale_mul (one float32 product, as
 * fewbits computes NVFP4's E4M3 block scale times its tensor scale, or an MX E8M0 scale). */
typedef struct {
    const void *s, *z, *m;
    int32_t s_kind, z_kind, m_kind;
    const uint8_t *s_codes;
    const float *s_table;
    float s_mul;
} Params;

/* row n of a parameter as float32: the stored row itself, or converted into buf */
static inline const float *param_row(const void *p, int32_t kind, int64_t n, int64_t groups, float *buf) {
    if (!p) return NULL;
    if (kind == P_F32) return (const float *)p + n * groups;
    const uint16_t *h = (const uint16_t *)p + n * groups;
    int64_t g = 0;
#if defined(__F16C__)
    if (kind == P_F16) /* the hardware conversion: exact, as from_half */
        for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(buf + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
#endif
    for (; g < groups; g++) buf[g] = kind == P_F16 ? from_half(h[g]) : from_bf16(h[g]);
    return buf;
}
/* A call's coded scales: the 256 values table[code] * multiplier, each the one float32 product
 * row_params would compute per scale, once per call. With AVX512-VBMI also as 4 byte planes, so
 * that 64 codes are looked up with byte permutes (2 per plane and a blend on bit 7 of the code)
 * and put back together as floats by unpacks: 6x faster than 16-lane gathers, which made a row's
 * scales cost as much as its codes' arithmetic for NVFP4's groups of 16 (AMD Zen 4). */
typedef struct {
    float f[256];
#if defined(__AVX512VBMI__)
    uint8_t plane[4][256] __attribute__((aligned(64)));
#endif
} ScaleLut;
static void scale_lut_init(const Params *P, ScaleLut *L) {
    if (!P->s_codes) return;
    for (int i = 0; i < 256; i++) L->f[i] = P->s_table[i] * P->s_mul;
#if defined(__AVX512VBMI__)
    for (int i = 0; i < 256; i++) {
        uint32_t u;
        memcpy(&u, &L->f[i], 4);
        for (int b = 0; b < 4; b++) L->plane[b][i] = (uint8_t)(u >> (8 * b));
    }
#endif
}
#if defined(__AVX512VBMI__)
/* out[0 .. n) = L->f[c[0 .. n)], n <= 64. The codes are first put in the order the unpacks undo:
 * byte 16l + b of the permuted codes is code 16 (b / 4) + 4 l + b % 4, so that the dword unpacks
 * of the four planes give codes 0-15, 16-31, 32-47, 48-63 in order (l: the 128-bit lane). */
static inline void scale_lookup64(const ScaleLut *L, const uint8_t *c, int64_t n, float *out) {
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
        4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
        8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    const __mmask64 m = n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
    const __m512i idx = _mm512_permutexvar_epi8(_mm512_load_si512((const void *)order), _mm512_maskz_loadu_epi8(m, c));
    const __mmask64 high = _mm512_movepi8_mask(idx); /* codes 128-255: the planes' second half */
    __m512i b[4];
    for (int p = 0; p < 4; p++) {
        const uint8_t *t = L->plane[p];
        const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512((const void *)t), idx,
                                                    _mm512_load_si512((const void *)(t + 64)));
        const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512((const void *)(t + 128)), idx,
                                                    _mm512_load_si512((const void *)(t + 192)));
        b[p] = _mm512_mask_blend_epi8(high, lo, hi);
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i r[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                          _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
    for (int j = 0; j < 4 && 16 * j < n; j++) {
        const int64_t left = n - 16 * j;
        const __mmask16 sm = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        _mm512_mask_storeu_ps(out + 16 * j, sm, _mm512_castsi512_ps(r[j]));
    }
}
#endif
static inline RowParams row_params(const Params *P, const ScaleLut *L, int64_t n, int64_t groups, float *bs, float *bz,
                                   float *bm) {
    RowParams rp;
    if (P->s_codes) {
        const uint8_t *c = P->s_codes + n * groups;
#if defined(__AVX512VBMI__)
        for (int64_t g = 0; g < groups; g += 64) scale_lookup64(L, c + g, groups - g < 64 ? groups - g : 64, bs + g);
#else
        for (int64_t g = 0; g < groups; g++) bs[g] = L->f[c[g]];
#endif
        rp.s = bs;
    } else {
        rp.s = param_row(P->s, P->s_kind, n, groups, bs);
    }
    rp.z = param_row(P->z, P->z_kind, n, groups, bz);
    rp.m = param_row(P->m, P->m_kind, n, groups, bm);
    return rp;
}
/* ask for row n's codes (a few rows ahead of the one being multiplied): the hardware
 * prefetchers alone left the fused matmul waiting on memory, 2x slower than from the caches */
static inline void prefetch_row(const uint8_t *codes, int64_t half, int64_t n) {
    const uint8_t *c = codes + n * half;
    for (int64_t b = 0; b < half; b += 64) __builtin_prefetch(c + b);
}

static int params_ok(const Params *P) {
    const int kinds_ok = P->s_kind >= 0 && P->s_kind <= 2 && P->z_kind >= 0 && P->z_kind <= 2 && P->m_kind >= 0 &&
                         P->m_kind <= 2;
    return kinds_ok && (P->s || (P->s_codes && P->s_table));
}

#if W == 16
/* One row of x with AVX-512 (the decode step of generation): the codes are read 64 bytes (128
 * weights, a "chunk") at a time as 16 dwords, lane l holding the 8 nibbles of k = 8l .. 8l + 7;
 * nibble i is looked up after i shifts by 4 (vpermps reads an index's low 4 bits), so a chunk
 * costs 7 shifts and 8 lookups and no widening (the two-nibble step above: 4 widenings, 4 shifts,
 * 8 lookups), and x is laid out to match (x8: per chunk 8 vectors, vector i lane l =
 * x[128c + 8l + i], zero past kx and K).
 * Groups of a multiple of 128: a chunk lies in one group, whose scaled table is looked up: the
 * weights are dequantize()'s, as in the steps above.
 * Groups of 16, 32 or 64 (NVFP4, MX, NF4), without zero points or minimums: a lane's 8 weights
 * lie in one group, but a chunk's lanes in 8, 4 or 2; the table values times x are summed per
 * chunk and lane in float32 and multiplied by the lane's scale once (where the steps multiply
 * every weight by it): the same sum up to float32 rounding (a product per lane and chunk instead
 * of one per weight), within the fused matmul's bound, for 2 multiplications per chunk instead of 8.
 * A last partial chunk (the columns read not a multiple of 128) has its lanes past them masked
 * to zero. */
static int one_row_path(int64_t K, int64_t group, const Params *P) {
    return group % 128 == 0 || ((group == 16 || group == 32 || group == 64) && !P->z && !P->m);
}
/* The columns one_row reads: up to kx rounded up to a lane's 8 (the rest of the row is padding,
 * whose x is zero: its codes are not read, nor are the groups past it) */
static inline int64_t one_row_columns(int64_t kx, int64_t K) {
    const int64_t k8 = (kx + 7) / 8 * 8;
    return k8 < K ? k8 : K;
}
/* x8 [chunks * 128] from x [kx] (kx <= K): the chunks one_row reads, the columns past kx zero */
static void one_row_layout(const float *x, int64_t kx, int64_t K, float *x8) {
    const int64_t chunks = (one_row_columns(kx, K) + 127) / 128;
    for (int64_t c = 0; c < chunks; c++)
        for (int i = 0; i < 8; i++)
            for (int l = 0; l < 16; l++) {
                const int64_t k = 128 * c + 8 * l + i;
                x8[128 * c + 16 * i + l] = k < kx ? x[k] : 0.0f;
            }
}
/* nibble i of each lane of v looked up in t, lanes off in `lanes` zero */
#define NIBBLE(i, v, t, lanes) _mm512_maskz_permutexvar_ps((lanes), (i) ? _mm512_srli_epi32((v), 4 * (i)) : (v), (t))
/* sum over a chunk of table value times x, per lane, in two halves (p0: nibbles 0, 2, 4, 6) */
#define CHUNK_SUMS(v, xc, t, lanes, p0, p1)                                                       \
    F p0 = f_mul(NIBBLE(0, v, t, lanes), f_load(xc));                                            \
    F p1 = f_mul(NIBBLE(1, v, t, lanes), f_load((xc) + 16));                                     \
    p0 = f_fma(NIBBLE(2, v, t, lanes), f_load((xc) + 32), p0);                                   \
    p1 = f_fma(NIBBLE(3, v, t, lanes), f_load((xc) + 48), p1);                                   \
    p0 = f_fma(NIBBLE(4, v, t, lanes), f_load((xc) + 64), p0);                                   \
    p1 = f_fma(NIBBLE(5, v, t, lanes), f_load((xc) + 80), p1);                                   \
    p0 = f_fma(NIBBLE(6, v, t, lanes), f_load((xc) + 96), p0);                                   \
    p1 = f_fma(NIBBLE(7, v, t, lanes), f_load((xc) + 112), p1);
/* v as the compiler must take it: a register whose value it does not know. Without it GCC 12 may
 * shift a chunk's codes from memory, one load per nibble (it did so in builds where row_params
 * holds a call): 1.6x slower, from the caches too. */
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
/* the codes `ahead` bytes further on (a few rows ahead), one line per chunk */
#define PREFETCH_CHUNK(p, ahead) __builtin_prefetch((const char *)(p) + (ahead))
static float one_row(const float *x8, const uint8_t *row, RowParams rp, Table table, int64_t K, int64_t kx,
                     int64_t group, int64_t ahead) {
    const int64_t cols = one_row_columns(kx, K), full = cols / 128, rem = cols % 128;
    /* the last, partial chunk: its lanes from rem / 8 on are past the columns read (zero) */
    const __mmask16 last_lanes = (__mmask16)((1u << (rem / 8)) - 1);
    F a0 = f_zero(), a1 = f_zero(), a2 = f_zero(), a3 = f_zero();
    if (group % 128 == 0) { /* a chunk lies in one group: its scaled table */
        const int64_t per = group / 128;
        /* one accumulator per nibble: a chain of one fused multiply-add per chunk (with two,
         * the chains' latency bound the loop: 1.4x slower from the caches on AMD Zen 4) */
        F a4 = f_zero(), a5 = f_zero(), a6 = f_zero(), a7 = f_zero();
#define TABLE_CHUNK(c, lanes, ts)                                                                 \
    {                                                                                            \
        const uint8_t *p = row + 64 * (c);                                                       \
        PREFETCH_CHUNK(p, ahead);                                                                \
        __m512i v = _mm512_maskz_loadu_epi32((lanes), (const void *)p);                         \
        KEEP_IN_REGISTER(v);                                                                     \
        const float *xc = x8 + 128 * (c);                                                        \
        a0 = f_fma(NIBBLE(0, v, ts.t, lanes), f_load(xc), a0);                                   \
        a1 = f_fma(NIBBLE(1, v, ts.t, lanes), f_load(xc + 16), a1);                              \
        a2 = f_fma(NIBBLE(2, v, ts.t, lanes), f_load(xc + 32), a2);                              \
        a3 = f_fma(NIBBLE(3, v, ts.t, lanes), f_load(xc + 48), a3);                              \
        a4 = f_fma(NIBBLE(4, v, ts.t, lanes), f_load(xc + 64), a4);                              \
        a5 = f_fma(NIBBLE(5, v, ts.t, lanes), f_load(xc + 80), a5);                              \
        a6 = f_fma(NIBBLE(6, v, ts.t, lanes), f_load(xc + 96), a6);                              \
        a7 = f_fma(NIBBLE(7, v, ts.t, lanes), f_load(xc + 112), a7);                             \
    }
        int64_t c = 0, g = 0;
        if (per == 1 && !rp.z && !rp.m) {
            /* groups of 128 (INT4's): a chunk is a group, whose table is table_for's product, one
             * loop over the chunks two at a time (the loop below spent ~20 instructions a group
             * on its bounds and table_for's tests, on the ports the lookups use) */
            for (; c + 2 <= full; c += 2) {
                const Table t0 = table_scaled(table, rp.s[c]), t1 = table_scaled(table, rp.s[c + 1]);
                TABLE_CHUNK(c, 0xFFFF, t0)
                TABLE_CHUNK(c + 1, 0xFFFF, t1)
            }
            g = c;
        }
        for (; c + per <= full; c += per, g++) {
            const Table ts = table_for(table, rp, g);
            for (int64_t i = c; i < c + per; i++) TABLE_CHUNK(i, 0xFFFF, ts)
        }
        if (c < full || rem) {
            const Table ts = table_for(table, rp, g);
            for (; c < full; c++) TABLE_CHUNK(c, 0xFFFF, ts)
            if (rem) TABLE_CHUNK(c, last_lanes, ts)
        }
#undef TABLE_CHUNK
        return f_sum(f_add(f_add(f_add(a0, a4), f_add(a1, a5)), f_add(f_add(a2, a6), f_add(a3, a7))));
    }
    /* lane l's group within a chunk: l / (group / 8); a chunk's scales: per_chunk of them */
    const int shift = group == 16 ? 1 : group == 32 ? 2 : 3;
    const __m512i lane_group = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), shift);
    const int64_t per_chunk = 128 / group;
    const __mmask16 chunk_groups = (__mmask16)((1u << per_chunk) - 1);
#define SCALED_CHUNK(c, A, B, lanes, groups)                                                      \
    {                                                                                            \
        const uint8_t *p = row + 64 * (c);                                                       \
        PREFETCH_CHUNK(p, ahead);                                                                \
        __m512i v = _mm512_maskz_loadu_epi32((lanes), (const void *)p);                         \
        KEEP_IN_REGISTER(v);                                                                     \
        CHUNK_SUMS(v, x8 + 128 * (c), table.t, (lanes), p0, p1)                                  \
        const F sv = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps((groups), rp.s + (c) * per_chunk)); \
        A = f_fma(p0, sv, A);                                                                    \
        B = f_fma(p1, sv, B);                                                                    \
    }
/* a row with an infinite (or NaN) scale: every looked-up value times its lane's scale first, as
 * the decoded weight is (a zero table value times an infinite scale is NaN there, which the sum
 * times the scale would turn into an infinity) */
#define EXACT_CHUNK(c, A, B, lanes, groups)                                                       \
    {                                                                                            \
        const uint8_t *p = row + 64 * (c);                                                       \
        __m512i v = _mm512_maskz_loadu_epi32((lanes), (const void *)p);                         \
        KEEP_IN_REGISTER(v);                                                                     \
        const F sv = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps((groups), rp.s + (c) * per_chunk)); \
        const float *xc = x8 + 128 * (c);                                                        \
        for (int i = 0; i < 8; i += 2) {                                                         \
            A = f_fma(f_mul(NIBBLE(i, v, table.t, lanes), sv), f_load(xc + 16 * i), A);          \
            B = f_fma(f_mul(NIBBLE(i + 1, v, table.t, lanes), sv), f_load(xc + 16 * i + 16), B); \
        }                                                                                        \
    }
    const int64_t groups_read = (cols + group - 1) / group;
    __mmask16 finite = 0xFFFF;
    for (int64_t g = 0; g < groups_read; g += 16) {
        const __mmask16 m = groups_read - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups_read - g)) - 1);
        const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, rp.s + g));
        const __m512i e = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000));
        finite &= (__mmask16)(~_mm512_mask_cmpeq_epi32_mask(m, e, _mm512_set1_epi32(0x7F800000)));
    }
    int64_t c = 0;
    if (finite == 0xFFFF) {
        for (; c + 2 <= full; c += 2) {
            SCALED_CHUNK(c, a0, a1, 0xFFFF, chunk_groups)
            SCALED_CHUNK(c + 1, a2, a3, 0xFFFF, chunk_groups)
        }
        if (c < full) { SCALED_CHUNK(c, a0, a1, 0xFFFF, chunk_groups) c++; }
        if (rem) { /* the groups the last chunk's lanes lie in */
            const __mmask16 groups = (__mmask16)((1u << ((rem + group - 1) / group)) - 1);
            SCALED_CHUNK(c, a2, a3, last_lanes, groups)
        }
    } else {
        for (; c < full; c++) EXACT_CHUNK(c, a0, a1, 0xFFFF, chunk_groups)
        if (rem) {
            const __mmask16 groups = (__mmask16)((1u << ((rem + group - 1) / group)) - 1);
            EXACT_CHUNK(c, a2, a3, last_lanes, groups)
        }
    }
#undef SCALED_CHUNK
#undef EXACT_CHUNK
    return f_sum(f_add(f_add(a0, a1), f_add(a2, a3)));
}
#endif

/* y [M, N] (row-major) = x @ W.T for x [M, kx] float32 with row stride x_stride, kx <= K (the
 * columns from kx on are read as zero).
 * codes: [N, K/2] bytes; table: 16 floats; group a multiple of 16; P: the per-group parameters.
 * x is taken MAX_M rows at a time, split into its even and odd columns (a copy of those rows),
 * and the codes read once per MAX_M rows. Returns 0, -1 for an unsupported shape, -2 when the
 * copy of x cannot be allocated. */
int32_t fb_lut4_matmul(const float *x, int64_t x_stride, int64_t kx, const uint8_t *codes, const Params *P,
                       const float *table16, int64_t M, int64_t N, int64_t K, int64_t group, float *y) {
    if (M < 0 || kx < 0 || kx > K || !shape_ok(K, group) || !params_ok(P)) return -1;
    const Table table = table_load(table16);
    const int64_t half = K / 2, groups = K / group;
    const int64_t rows = M < MAX_M ? M : MAX_M;
    float *split = malloc(sizeof(float) * (size_t)(2 * rows * half + 128)); /* the one-row layout: up to K + 96 */
    /* each thread's row of converted parameters (on the heap: rows may have millions of groups) */
    float *scratch = malloc(sizeof(float) * (size_t)(3 * groups * MAX_THREADS + 1));
    if (!split || !scratch) {
        free(split);
        free(scratch);
        return -2;
    }
    ScaleLut lut;
    scale_lut_init(P, &lut);
#if W == 16
    if (M == 1 && one_row_path(K, group, P)) {
        one_row_layout(x, kx, K, split); /* split holds K + 1 floats, x8 (K rounded up to 128) at most K + 96 */
#pragma omp parallel if (N >= 64)
        {
            float *bs = scratch + (int64_t)THREAD_ID * 3 * groups;
            const RowWalk w = row_walk(N, THREAD_ID, TEAM_THREADS); /* rowwalk.h: four streams of rows */
            for (int64_t i = 0; i < w.visits; i++) {
                const int64_t n = row_walk_row(&w, i);
                if (n < 0) continue;
                const RowParams rp = row_params(P, &lut, n, groups, bs, bs + groups, bs + 2 * groups);
                /* each chunk asks for the line ROW_PREFETCH_WEIGHTS on in its stream */
                const int64_t ahead = row_walk_ahead(n, row_walk_end(&w, i), half, ROW_PREFETCH_BYTES(4));
                y[n] = one_row(split, codes + n * half, rp, table, K, kx, group, ahead);
            }
        }
        M = 0; /* done */
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const int64_t mr = M - m0 < MAX_M ? M - m0 : MAX_M;
        float *xe = split, *xo = split + mr * half;
        for (int64_t m = 0; m < mr; m++) {
            const float *xr = x + (m0 + m) * x_stride;
            float *e = xe + m * half, *o = xo + m * half;
            int64_t k = 0;
            for (; k + 1 < kx; k += 2) {
                e[k / 2] = xr[k];
                o[k / 2] = xr[k + 1];
            }
            if (k < kx) { e[k / 2] = xr[k]; o[k / 2] = 0.0f; k += 2; }
            for (; k < K; k += 2) e[k / 2] = o[k / 2] = 0.0f;
        }
        float *yc = y + m0 * N;
        /* torch's own OpenMP threads (the process has one libgomp: torch's), as many as
         * torch.get_num_threads() says; one thread for a few rows */
#pragma omp parallel for schedule(static) if (N >= 64)
        for (int64_t n = 0; n < N; n++) {
            if (n + PREFETCH_ROWS < N) prefetch_row(codes, half, n + PREFETCH_ROWS);
            float *bs = scratch + (int64_t)THREAD_ID * 3 * groups;
            const RowParams rp = row_params(P, &lut, n, groups, bs, bs + groups, bs + 2 * groups);
            row_any(xe, xo, codes + n * half, rp, table, half, group, yc, N, n, mr);
        }
    }
    free(split);
    free(scratch);
    return 0;
}

/* A weight's fixed arguments of fb_lut4_matmul, for fb_lut4_row: y [N] = x [kx] @ W.T with three
 * arguments (from Python each argument costs a conversion: fb_lut4_matmul's eleven took longer
 * than the matmul of a small layer's row). */
typedef struct {
    const uint8_t *codes;
    const Params *P;
    const float *table;
    int64_t N, K, group, kx;
} Lut4Row;
int32_t fb_lut4_row(const Lut4Row *r, const float *x, float *y) {
    return fb_lut4_matmul(x, r->kx, r->kx, r->codes, r->P, r->table, 1, r->N, r->K, r->group, y);
}

/* W rows [r0, r1) decoded, out [(r1 - r0), K]: the same decode as fb_lut4_matmul (exactly
 * QuantizedTensor.dequantize()'s float32 operations, see RowParams), for batches large
 * enough that a GEMM on decoded blocks wins. out_bf16 = 0: float32 out; 1: uint16 bfloat16 bit
 * patterns, each float32 weight rounded to nearest even (what .to(torch.bfloat16) of the float32
 * weight gives for numbers; every NaN becomes 0x7FC0). Parameters as in fb_lut4_matmul. Returns 0, or
 * -1 for an unsupported shape, -2 when its scratch cannot be allocated. */
/* row n of W decoded into out (K values): float32, or bfloat16 bit patterns (out_bf16) */
static void decode_row(const uint8_t *codes, RowParams rp, Table table, int64_t K, int64_t group, int64_t n,
                       void *out, int32_t out_bf16) {
    const int64_t half = K / 2;
    const uint8_t *row = codes + n * half;
    if (out_bf16) {
        uint16_t *o = (uint16_t *)out;
        if (group % STEP == 0) { /* the group's table rounded to bfloat16 once, looked up as such */
            for (int64_t j0 = 0, g = 0; j0 < half; j0 += group / 2, g++) {
                const BTable bt = btable_of(table_for(table, rp, g));
                for (int64_t j = j0; j < j0 + group / 2; j += W) store_bf16_step(row + j, bt, o + 2 * j);
            }
        } else {
#define STORE_BF16(A, j) store_interleaved_bf16(o + 2 * (j), lo, hi);
            FOR_EACH_STEP(row, rp, table, half, group, STORE_BF16);
        }
    } else {
        float *o = (float *)out;
#define STORE_F32(A, j) store_interleaved(o + 2 * (j), lo, hi);
        FOR_EACH_STEP(row, rp, table, half, group, STORE_F32);
    }
}

int32_t fb_lut4_decode(const uint8_t *codes, const Params *P, const float *table16, int64_t K,
                       int64_t group, int64_t r0, int64_t r1, void *out, int32_t out_bf16) {
    if (!shape_ok(K, group) || !params_ok(P)) return -1;
    const Table table = table_load(table16);
    const int64_t groups = K / group;
    float *scratch = malloc(sizeof(float) * (size_t)(3 * groups * MAX_THREADS + 1));
    if (!scratch) return -2;
    ScaleLut lut;
    scale_lut_init(P, &lut);
#pragma omp parallel for schedule(static) if (r1 - r0 >= 16)
    for (int64_t n = r0; n < r1; n++) {
        float *bs = scratch + (int64_t)THREAD_ID * 3 * groups;
        const RowParams rp = row_params(P, &lut, n, groups, bs, bs + groups, bs + 2 * groups);
        void *o = out_bf16 ? (void *)((uint16_t *)out + (n - r0) * K) : (void *)((float *)out + (n - r0) * K);
        decode_row(codes, rp, table, K, group, n, o, out_bf16);
    }
    free(scratch);
    return 0;
}

#if defined(FB_TILES)
/* The tiles' own decode (AVX512-BF16 and -BW, which every CPU with AMX has): a group's scaled
 * table (table_for: dequantize()'s float32 weights) rounded to bfloat16 by the hardware's
 * conversion, vcvtneps2bf16 (round to nearest even as fb_lut4_decode does, except that a float32
 * subnormal becomes zero -- TDPBF16PS reads bfloat16 subnormals as zero anyway -- and a NaN stays
 * some NaN), 16 words in one register; a step of 16 code bytes is 32 word lookups (vpermw), each
 * byte's low nibble the low word of its pair and the high nibble the high word, in k order as
 * stored. For groups of 16 a step's two groups' tables share the register (words 0-15, 16-31),
 * the second 8 bytes' indices offset by 16. Returns 0 (nothing written) for other groups. */
static inline __m512i tiles_table(Table t) {
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t.t));
}
static inline void tiles_step(const uint8_t *p, __m512i tb, __m512i offset, uint16_t *out) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    /* (d | d << 12) & 0x000F000F: the low nibble in the low word, the high one in the high word */
    const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    _mm512_storeu_si512((void *)out, _mm512_permutexvar_epi16(_mm512_or_si512(idx, offset), tb));
}
static int decode_row_tiles(const uint8_t *codes, RowParams rp, Table table, int64_t K, int64_t group, int64_t n,
                            uint16_t *o) {
    const int64_t half = K / 2;
    const uint8_t *row = codes + n * half;
    if (group % 32 == 0) {
        const __m512i none = _mm512_setzero_si512();
        for (int64_t j0 = 0, g = 0; j0 < half; j0 += group / 2, g++) {
            const __m512i tb = tiles_table(table_for(table, rp, g));
            for (int64_t j = j0; j < j0 + group / 2; j += 16) tiles_step(row + j, tb, none, o + 2 * j);
        }
        return 1;
    }
    if (group == 16) {
        const __m512i second = _mm512_maskz_set1_epi32(0xFF00, 0x00100010);
        for (int64_t j = 0, g = 0; j < half; j += 16, g += 2) {
            const __m512i tb = _mm512_inserti64x4(tiles_table(table_for(table, rp, g)),
                                                  (__m256i)_mm512_cvtneps_pbh(table_for(table, rp, g + 1).t), 1);
            tiles_step(row + j, tb, second, o + 2 * j);
        }
        return 1;
    }
    return 0;
}
#endif

/* How fb_lut4_tile_matmul (and int8w.c's, built alike) runs here: 2 on AMX tiles, 1 with
 * AVX512-BF16 dot products (tiles.h's dp_block), 0 not at all (a build without AVX512-BF16) */
int32_t fb_tiles(void) {
#if defined(FB_TILES)
    return tiles_kind();
#else
    return 0;
#endif
}

#if defined(FB_TILES)
/* a lut4 weight for tiles_matmul: its rows decoded to bfloat16 (decode_row_tiles where the groups
 * allow, else decode_row), each thread's row of converted parameters in scratch */
typedef struct {
    const uint8_t *codes;
    const Params *P;
    const ScaleLut *lut;
    Table table;
    int64_t K, group, groups;
    float *scratch;
} Lut4Tiles;
static void lut4_tile_rows(const void *ctx, int64_t n0, int64_t nv, int64_t kx, int64_t kp, uint16_t *wb, int64_t ldw,
                           int thread) {
    const Lut4Tiles *c = (const Lut4Tiles *)ctx;
    float *bs = c->scratch + (int64_t)thread * 3 * c->groups;
    for (int64_t i = 0; i < nv; i++) {
        uint16_t *o = wb + i * ldw;
        const RowParams rp = row_params(c->P, c->lut, n0 + i, c->groups, bs, bs + c->groups, bs + 2 * c->groups);
        if (!decode_row_tiles(c->codes, rp, c->table, c->K, c->group, n0 + i, o))
            decode_row(c->codes, rp, c->table, c->K, c->group, n0 + i, o, 1);
        memset(o + kx, 0, sizeof(uint16_t) * (size_t)(kp - kx));
    }
}
#endif

/* y [M, N] float32 = x [M, kx] @ bf16(W).T, x bfloat16 bit patterns or float32 (x_f32: rounded
 * to bfloat16 in the call, see tiles_pack_x), row stride ldx, kx <= K (W's columns from kx on are
 * not read), on AMX tiles or with AVX512-BF16 dot products (tiles.h): the rows of W decoded 32
 * at a time to bfloat16 -- bf16 of dequantize()'s float32 weight, rounded as fb_lut4_decode does
 * or, for groups of 16 and of a multiple of 32, by the hardware's conversion (decode_row_tiles) --
 * into each thread's buffer and multiplied there with float32 sums (TDPBF16PS or VDPBF16PS). Blocks of rows are shared out over torch's
 * OpenMP threads; each output is summed by one thread in one order whatever their number.
 * Returns 0; -1 for an unsupported shape; -2 when its buffers cannot be allocated; -3 in a build
 * without AVX512-BF16. */
int32_t fb_lut4_tile_matmul(const void *x, int32_t x_f32, int64_t ldx, int64_t kx, const uint8_t *codes,
                            const Params *P, const float *table16, int64_t M, int64_t N, int64_t K, int64_t group,
                            float *y) {
    if (M < 0 || N < 0 || kx < 0 || kx > K || ldx < kx || !shape_ok(K, group) || !params_ok(P)) return -1;
#if !defined(FB_TILES)
    (void)x, (void)x_f32, (void)codes, (void)table16, (void)y;
    return -3;
#else
    if (M == 0 || N == 0) return 0;
    if (kx == 0) {
        memset(y, 0, sizeof(float) * (size_t)(M * N));
        return 0;
    }
    const int64_t groups = K / group;
    float *scratch = malloc(sizeof(float) * (size_t)(3 * groups * MAX_THREADS + 1));
    if (!scratch) return -2;
    ScaleLut lut;
    scale_lut_init(P, &lut);
    const Lut4Tiles ctx = {codes, P, &lut, table_load(table16), K, group, groups, scratch};
    const int32_t rc = tiles_matmul(x, x_f32, ldx, kx, M, N, K, lut4_tile_rows, &ctx, NULL, y);
    free(scratch);
    return rc;
#endif
}

/* fb_lut4_tile_matmul for M contiguous float32 rows of x [M, r->kx], with a weight's fixed
 * arguments (Lut4Row, as fb_lut4_row takes them): a batch's call from Python in four arguments */
int32_t fb_lut4_tiles(const Lut4Row *r, const float *x, int64_t M, float *y) {
    return fb_lut4_tile_matmul(x, 1, r->kx, r->kx, r->codes, r->P, r->table, M, r->N, r->K, r->group, y);
}
