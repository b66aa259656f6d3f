/* Rounding of float32 values on a CPU, for fewbits.kernels.native_round: float formats of
 * floatround's scaled kind (fp8, fp6, fp4, fp16, ints ...), fixed kind (bf16, tf32) and pow2
 * kind (E8M0) in every mode, and codebooks of at most 16 values (NF4 ...) by thresholds
 * (nearest, up, down, toward zero) and stochastically. Each function is a C twin of
 * fewbits.kernels.floatround / lookupround (the Python there is the definition; the tests
 * compare these bit for bit): the same integer steps and the same float32 / float64 operations,
 * built with -ffp-contract=off and without -ffast-math, subnormals kept.
 *
 * The loops work on 16 values at a time with GCC/Clang vector extensions (AVX-512 registers where
 * the CPU has them: table lookups are one permute, vpermps); the last partial block runs through
 * the same code on a padded copy. Element i of the input draws the 32-bit random word
 * hash(seed, i) of fewbits.kernels.random, whatever the threading. OpenMP shares the blocks over
 * torch's threads when built with it. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec16.h"
typedef uint32_t vu __attribute__((vector_size(4 * L)));

static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline vi sel(vi mask, vi a, vi b) { return (a & mask) | (b & ~mask); }

/* whether any lane of v is nonzero */
static inline int any_set(vi v) {
#if defined(__AVX512F__)
    return _mm512_test_epi32_mask((__m512i)v, (__m512i)v) != 0;
#else
    const vi a = v | __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    const vi b = a | __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    const vi c = b | __builtin_shufflevector(b, b, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return (c[0] | c[1]) != 0;
#endif
}

static inline vu mix(vu h) {
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x5BD1E995u;
    h ^= h >> 16;
    return h;
}

/* fewbits.kernels.random.random_word_reference(seed_lo, seed_hi, index) for the 16 indices
 * i0 .. i0 + 15 (i0 a multiple of 16, so the block never straddles a multiple of 2^32) */
static inline vu random_words(uint32_t seed_lo, uint32_t seed_hi, int64_t i0) {
    vu idx = (vu)IOTA + (uint32_t)i0;
    vu h = mix(idx ^ seed_lo);
    return mix(h ^ (seed_hi ^ (uint32_t)((uint64_t)i0 >> 32)));
}

/* 1 where these kernels are built for 512-bit vectors (AVX-512): elsewhere compilers split the
 * 16-lane code into slow pieces (measured: ~0.1 G values/s with AVX2), and fewbits keeps the
 * compiled torch kernels */
int32_t fb_round32_vectorized(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#define INF_BITS 0x7F800000
#define NAN_BITS 0x7FC00000

/* Parameters of the scaled kernel and the finishing step, as floatround._static_params /
 * finish_spec give them (float32 domain); see fewbits.kernels.native_round.scaled_params. */
enum { P_M, P_MSUB, P_EMINB, P_CLAMP, P_MAXP, P_MAXN, P_OVFP, P_OVFN, P_INFP, P_INFN, P_SAT, P_SIGNED,
       P_NEGZERO, P_NEGRES, P_MINRES, P_COUNT };

/* floatround._finish on 16 values: overflow, infinities, NaN, the unsigned range, a missing zero
 * and the sign. rz: the lanes whose mode rounds toward zero (there overflow gives the largest
 * finite value whatever the policy). */
static inline vi finish(vi a, vi neg, vi r_bits, const int32_t *p, vi rz) {
    const vi top = sel(neg, (vi){0} + p[P_MAXN], (vi){0} + p[P_MAXP]);
    const vi ovf = sel(neg, (vi){0} + p[P_OVFN], (vi){0} + p[P_OVFP]);
    vi res = p[P_SAT] ? sel(r_bits < top, r_bits, top) : sel(r_bits > top, sel(rz, top, ovf), r_bits);
    const vi inf_out = sel(neg, (vi){0} + p[P_INFN], (vi){0} + p[P_INFP]);
    res = sel(a == INF_BITS, inf_out, res); /* saturating formats: inf_out is top already */
    const vi is_nan_in = a > INF_BITS;
    if (!p[P_SIGNED]) res = sel(neg & (res != 0) & ~is_nan_in, (vi){0} + p[P_NEGRES], res);
    res = sel(is_nan_in, (vi){0} + NAN_BITS, res);
    if (p[P_MINRES]) res = sel(res == 0, (vi){0} + p[P_MINRES], res);
    vi sign;
    if (p[P_SIGNED] && p[P_NEGZERO]) sign = neg;
    else if (p[P_SIGNED]) sign = neg & (res != 0);
    else sign = neg & (res > INF_BITS);
    return res | (sign & ((vi){0} + (int32_t)0x80000000));
}

/* Modes, in fewbits.formats.MODES order */
enum { NEAREST_EVEN, NEAREST_AWAY, TOWARD_ZERO, UP, DOWN, STOCHASTIC };

/* the lanes whose mode rounds toward zero (for _finish) */
static inline vi toward_zero_lanes(vi neg, const int mode) {
    if (mode == TOWARD_ZERO) return ~(vi){0};
    if (mode == UP) return neg;
    if (mode == DOWN) return ~neg;
    return (vi){0};
}

/* floatround._scaled_bits (formats whose smallest step is a normal float32 number: fp8, fp6,
 * fp4, fp16, ints ...): y = |x| / step exactly, rounded to an integer in the mode, times step */
static inline vi scaled_block(vi u, const int32_t *p, const int mode, vu r) {
    const vi neg = u < 0;
    const vi a = u & 0x7FFFFFFF;
    const vi a_cl = sel(a < p[P_CLAMP], a, (vi){0} + p[P_CLAMP]);
    const vi e = a_cl >> 23;
    const vi eq = sel(e >= p[P_EMINB], e - p[P_M], (vi){0} + (p[P_EMINB] - p[P_MSUB]));
    const vf step = (vf)(eq << 23);
    const vf inv_step = (vf)((254 - eq) << 23);
    const vf y = (vf)a_cl * inv_step;
    /* 0 <= y < 2^24 (|x| is clamped to 4x the format's range): floor is truncation */
    const vf fl = __builtin_convertvector(__builtin_convertvector(y, vi), vf);
    vf q;
    if (mode == NEAREST_EVEN) { /* below 2^23, adding and taking away 2^23 rounds half to even */
        const vf big = (vf){0} + 8388608.0f;
        q = (vf)sel((vi)(y < big), (vi)((y + big) - big), (vi)y);
    } else if (mode == NEAREST_AWAY) {
        q = fl + __builtin_convertvector((vi)(y - fl >= 0.5f) & 1, vf);
    } else if (mode == TOWARD_ZERO) {
        q = fl;
    } else if (mode == UP || mode == DOWN) {
        const vi away = mode == UP ? ~neg : neg;
        q = fl + __builtin_convertvector(away & (vi)(y != fl) & 1, vf);
    } else {
        const vu thr = __builtin_convertvector((y - fl) * 4294967296.0f, vu); /* < 2^32 */
        q = fl + __builtin_convertvector((vi)(r < thr) & 1, vf);
    }
    const vi r_bits = (vi)(q * step);
    return finish(a, neg, r_bits, p, toward_zero_lanes(neg, mode));
}

/* the increment of floatround._increment: whether the kept magnitude goes up one step, from the
 * k dropped bits `lower` (0 < k <= 23), as -1 / 0 */
static inline vi increment(vi lower, vi kept, vi k, vi neg, vi odd_ok, const int mode, vu r) {
    if (mode == TOWARD_ZERO) return (vi){0};
    if (mode == UP || mode == DOWN) return (lower != 0) & (mode == UP ? ~neg : neg);
    if (mode == STOCHASTIC) return (vi)(r < ((vu)lower << (vu)(32 - k)));
    const vi half = (1 << k) >> 1;
    if (mode == NEAREST_AWAY) return (lower >= half) & (lower != 0);
    return (lower > half) | ((lower == half) & (lower != 0) & ((kept & 1 & odd_ok) != 0));
}

/* floatround._fixed_bits (formats with float32's exponent range and subnormals: bf16, tf32 ...):
 * drop k = 23 - m mantissa bits of every value */
/* Round to nearest by one addition: a + half - 1 + tie_up carries into bit k exactly when the
 * dropped bits exceed half, or equal it and the tie goes up (the carry may run into the
 * exponent: the next binade, or past the largest value for _finish to see). */
static inline vi nearest_by_addition(vi a, vi k, vi tie_up) {
    return ((a + (((1 << k) >> 1) - 1) + (tie_up & 1)) >> k) << k;
}

static inline vi fixed_block(vi u, const int32_t *p, const int mode, vu r) {
    const vi neg = u < 0;
    const vi a = u & 0x7FFFFFFF;
    const vi k = (vi){0} + (23 - p[P_M]);
    const vi kept = a >> k;
    vi r_bits;
    if (mode == NEAREST_EVEN) r_bits = nearest_by_addition(a, k, kept);
    else if (mode == NEAREST_AWAY) r_bits = nearest_by_addition(a, k, ~(vi){0});
    else r_bits = (kept - increment(a & ((1 << k) - 1), kept, k, neg, ~(vi){0}, mode, r)) << k;
    return finish(a, neg, r_bits, p, toward_zero_lanes(neg, mode));
}

/* floatround._pow2_bits (E8M0 from float32: powers of two from 2^-127 up): normal inputs keep
 * their exponent (23 bits dropped), subnormal ones hold 2^-127 in their top mantissa bit (22
 * dropped); ties below 2^-126 stay (zero and 2^-127 both have even codes). P_M holds the parity
 * flip of the exponent codes. */
static inline vi pow2_block(vi u, const int32_t *p, const int mode, vu r) {
    const vi neg = u < 0;
    const vi a = u & 0x7FFFFFFF;
    const vi sub = (a >> 23) == 0; /* -1 or 0 */
    const vi k = 23 + sub;
    const vi kept = a >> k;
    vi r_bits;
    if (mode == NEAREST_EVEN) r_bits = nearest_by_addition(a, k, (kept ^ p[P_M]) & ~sub);
    else if (mode == NEAREST_AWAY) r_bits = nearest_by_addition(a, k, ~(vi){0});
    else r_bits = (kept - increment(a & ((1 << k) - 1), kept ^ p[P_M], k, neg, ~sub, mode, r)) << k;
    return finish(a, neg, r_bits, p, toward_zero_lanes(neg, mode));
}

enum { KIND_SCALED, KIND_FIXED, KIND_POW2 };

#define ROUND_LOOP(BLOCK, MODE)                                                                   \
    {                                                                                            \
        _Pragma("omp parallel for schedule(static)")                                             \
        for (int64_t i = 0; i < full; i += L) {                                                  \
            vi u;                                                                                \
            memcpy(&u, x + i, sizeof u);                                                         \
            const vi res = BLOCK(u, p, MODE, random_words(seed_lo, seed_hi, i));                \
            memcpy(out + i, &res, sizeof res);                                                   \
        }                                                                                        \
        if (full < n) {                                                                          \
            vi u = {0};                                                                          \
            memcpy(&u, x + full, (size_t)(n - full) * 4);                                        \
            const vi res = BLOCK(u, p, MODE, random_words(seed_lo, seed_hi, full));             \
            memcpy(out + full, &res, (size_t)(n - full) * 4);                                    \
        }                                                                                        \
    }

#define MODE_SWITCH(BLOCK)                                                                        \
    switch (mode) {                                                                              \
    case NEAREST_EVEN: ROUND_LOOP(BLOCK, NEAREST_EVEN) break;                                    \
    case NEAREST_AWAY: ROUND_LOOP(BLOCK, NEAREST_AWAY) break;                                    \
    case TOWARD_ZERO: ROUND_LOOP(BLOCK, TOWARD_ZERO) break;                                      \
    case UP: ROUND_LOOP(BLOCK, UP) break;                                                        \
    case DOWN: ROUND_LOOP(BLOCK, DOWN) break;                                                    \
    default: ROUND_LOOP(BLOCK, STOCHASTIC) break;                                                \
    }

/* floatround's kernel `kind` (0 scaled, 1 fixed, 2 pow2) then _finish, for float32 values in
 * mode `mode`; p: fewbits.kernels.native_round.float_params. Returns 0, or -1 for an unknown
 * kind or mode (nothing written). */
int32_t fb_round_float_f32(const float *x, float *out, int64_t n, const int32_t *p, int32_t kind,
                           int32_t mode, uint32_t seed_lo, uint32_t seed_hi) {
    const int64_t full = n / L * L;
    if (mode < NEAREST_EVEN || mode > STOCHASTIC) return -1;
    if (kind == KIND_FIXED && (p[P_M] < 0 || p[P_M] > 22)) return -1;
    if (kind == KIND_SCALED) MODE_SWITCH(scaled_block)
    else if (kind == KIND_FIXED) MODE_SWITCH(fixed_block)
    else if (kind == KIND_POW2) MODE_SWITCH(pow2_block)
    else return -1;
    return 0;
}

/* The ascending thresholds t[0..14] (unused ones +inf) as a branch-free binary search reads
 * them: step s compares x with t[c + s - 1], so each step's table is t shifted by s - 1. */
typedef struct { vf t4, t2, t1; float t8; } search_tables;

static void search_setup(vf t, search_tables *st) {
    for (int j = 0; j < 16; j++) {
        st->t4[j] = j + 3 < 16 ? t[j + 3] : __builtin_inff();
        st->t2[j] = j + 1 < 16 ? t[j + 1] : __builtin_inff();
        st->t1[j] = t[j];
    }
    st->t8 = t[7];
}

/* #{j: x > t[j]} (NaN counts none) */
static inline vi count_below(vf xv, const search_tables *st) {
#if defined(__AVX512F__)
    const __m512 x = (__m512)xv;
    __m512i c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, _mm512_set1_ps(st->t8), _CMP_GT_OQ),
                                       _mm512_set1_epi32(8));
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(c, (__m512)st->t4), _CMP_GT_OQ),
                              c, _mm512_set1_epi32(4));
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(c, (__m512)st->t2), _CMP_GT_OQ),
                              c, _mm512_set1_epi32(2));
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(c, (__m512)st->t1), _CMP_GT_OQ),
                              c, _mm512_set1_epi32(1));
    return (vi)c;
#else
    vi c = (vi)(xv > st->t8) & 8;
    c += (vi)(xv > lookup(st->t4, c)) & 4;
    c += (vi)(xv > lookup(st->t2, c)) & 2;
    c += (vi)(xv > lookup(st->t1, c)) & 1;
    return c;
#endif
}

/* lookupround._round_f32 on 16 values: value[#{j: x > th[j]}], NaN for NaN (t: the search
 * tables of the thresholds; table: the values, padded) */
static inline vf lut_block(vf xv, const search_tables *t, vf table) {
    const vi c = count_below(xv, t);
    const vi v = (vi)lookup(table, c);
    return (vf)sel(xv != xv, (vi){0} + NAN_BITS, v);
}

static void lut_setup(const float *th, int32_t nth, const float *values, vf *t, vf *table) {
    for (int j = 0; j < 16; j++) (*t)[j] = j < nth ? th[j] : __builtin_inff();
    for (int j = 0; j < 16; j++) (*table)[j] = values[j <= nth ? j : nth];
}

/* thresholds th (nth <= 15, ascending), values (nth + 1) */
void fb_round_lut_f32(const float *x, float *out, int64_t n, const float *th, int32_t nth,
                      const float *values) {
    vf th16, table;
    search_tables t;
    lut_setup(th, nth, values, &th16, &table);
    search_setup(th16, &t);
    const int64_t full = n / L * L;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < full; i += L) {
        vf xv;
        memcpy(&xv, x + i, sizeof xv);
        const vf r = lut_block(xv, &t, table);
        memcpy(out + i, &r, sizeof r);
    }
    if (full < n) {
        vf xv = {0};
        memcpy(&xv, x + full, (size_t)(n - full) * 4);
        const vf r = lut_block(xv, &t, table);
        memcpy(out + full, &r, (size_t)(n - full) * 4);
    }
}

/* lookupround._pair_round_f32(mode="stochastic") on 16 values: the codebook values lo <= x < hi
 * around x (x > t[j] <=> x >= values[j + 1]); hi with probability (x - lo) / (hi - lo), in
 * float64, against the element's random word. The float64 part runs on two halves of 8 lanes
 * (one 512-bit register each: compilers split 16 doubles poorly). */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef double vd8 __attribute__((vector_size(64)));
typedef int64_t vl8 __attribute__((vector_size(64)));

/* -1 where word < floor(frac * 2^32), i.e. where word + 1 <= frac * 2^32 (word an integer;
 * frac * 2^32 is exact, below 2^32 + 1) */
static inline vi8 pick_half(vf8 x, vf8 lo, vf8 hi, vi8 above, vu8 word) {
    const vd8 x64 = __builtin_convertvector(x, vd8), lo64 = __builtin_convertvector(lo, vd8);
    const vd8 hi64 = __builtin_convertvector(hi, vd8);
    const vl8 take = __builtin_convertvector(above, vl8); /* above <=> hi != lo */
    const vd8 one = (vd8){0} + 1.0;
    const vd8 den = (vd8)(((vl8)(hi64 - lo64) & take) | ((vl8)one & ~take));
    const vd8 scaled = (x64 - lo64) / den * 4294967296.0;
    const vd8 w1 = __builtin_convertvector(word, vd8) + 1.0;
    return __builtin_convertvector((vl8)(w1 <= scaled) & take, vi8);
}

/* the float64 decision for 16 lanes (kept out of line: it is rarely needed) */
__attribute__((noinline)) static vi pick_exact(vf xv, vf lo, vf nxt, vu r) {
    const vi above = (xv > lo) & (nxt != lo);
    const vf hi = (vf)sel(above, (vi)nxt, (vi)lo);
#define LOW(v) __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
#define HIGH(v) __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
    const vi8 p0 = pick_half(LOW(xv), LOW(lo), LOW(hi), LOW(above), LOW(r));
    const vi8 p1 = pick_half(HIGH(xv), HIGH(lo), HIGH(hi), HIGH(above), HIGH(r));
#undef LOW
#undef HIGH
    return __builtin_shufflevector(p0, p1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* The float64 decision is exact but slow; most lanes are decided by a float32 estimate first:
 * est = (x - lo) * inv[c], inv[c] = float32(2^32 / (values[c + 1] - values[c])) (0 past the last
 * value), is within 4 * 2^-24 * 2^32 = 1024 of frac * 2^32 when every operand is a normal
 * float32 (checked per codebook: lut_sr_tables), float32(word) within 128 of the word and
 * est - word within 256 of its exact value. Lanes with |est - word| >= MARGIN are decided by
 * it: word + 1 <= frac * 2^32 there exactly when est - word >= MARGIN (x below lo, at the last
 * value, inf and NaN give est <= 0 or NaN: no). A block holding any other lane (about 2 in 10^6)
 * takes the float64 path for all its lanes. */
#define MARGIN 4096.0f

static inline vf lut_sr_block(vf xv, const search_tables *t, vf table, vf next, vf inv, int32_t fast, vu r) {
    const vi c_lo = count_below(xv, t);
    const vf lo = lookup(table, c_lo);
    vi pick;
    if (__builtin_expect(fast, 1)) {
        const vf d = (xv - lo) * lookup(inv, c_lo) - __builtin_convertvector(r, vf);
        pick = (vi)(d >= MARGIN);
        const vi unsure = (vi)((vf)((vi)d & 0x7FFFFFFF) < MARGIN); /* |d| < MARGIN */
        if (__builtin_expect(any_set(unsure), 0)) pick = pick_exact(xv, lo, lookup(next, c_lo), r);
    } else {
        pick = pick_exact(xv, lo, lookup(next, c_lo), r);
    }
    const vi code = c_lo - pick;
    const vi v = (vi)lookup(table, code);
    return (vf)sel(xv != xv, (vi){0} + NAN_BITS, v);
}

/* the tables of the stochastic kernel: next[c] = values[min(c + 1, nth)], inv as above; returns
 * whether the estimate's error bound holds for this codebook (every interval and scaled
 * reciprocal a normal float32) */
static int32_t lut_sr_tables(const float *values, int32_t nth, vf *next, vf *inv) {
    int32_t ok = 1;
    for (int j = 0; j < 16; j++) {
        (*next)[j] = values[j < nth ? j + 1 : nth];
        (*inv)[j] = 0.0f;
        if (j >= nth) continue;
        const double w = (double)values[j + 1] - (double)values[j];
        const double rw = 1.0 / w;
        const float rf = (float)rw;
        if (!(w >= 1.1754943508222875e-38 && w <= 1e37 && rf >= 1.1754943508222875e-38f && rf <= 1e28f)) ok = 0;
        (*inv)[j] = rf * 4294967296.0f;
    }
    return ok;
}

void fb_round_lut_sr_f32(const float *x, float *out, int64_t n, const float *th_down, int32_t nth,
                         const float *values, uint32_t seed_lo, uint32_t seed_hi) {
    vf th16, table, next, inv;
    search_tables t;
    lut_setup(th_down, nth, values, &th16, &table);
    search_setup(th16, &t);
    const int32_t fast = lut_sr_tables(values, nth, &next, &inv);
    const int64_t full = n / L * L;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < full; i += L) {
        vf xv;
        memcpy(&xv, x + i, sizeof xv);
        const vf r = lut_sr_block(xv, &t, table, next, inv, fast, random_words(seed_lo, seed_hi, i));
        memcpy(out + i, &r, sizeof r);
    }
    if (full < n) {
        vf xv = {0};
        memcpy(&xv, x + full, (size_t)(n - full) * 4);
        const vf r = lut_sr_block(xv, &t, table, next, inv, fast, random_words(seed_lo, seed_hi, full));
        memcpy(out + full, &r, (size_t)(n - full) * 4);
    }
}
