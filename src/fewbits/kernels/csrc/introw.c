/* y = x @ W.T for a few rows of x (generation's decode step: one row) and a weight W [N, K] held
 * as integer codes of 2 to 8 bits with per-group parameters: GGUF's blocks as fewbits holds them
 * (Q8_0, Q5_0, Q5_1, Q2_K ... Q6_K; Q4_0, Q4_1 and IQ4_NL go through lut4.c), read as stored.
 *
 *   W[n, k] = q[n, k] * s[n, g] + m[n, g]     (g = k / group; no m for symmetric formats)
 *
 * q: the code's integer value (signed codes are two's complement bit patterns), packed low-first
 *    into a stream of `bits`-wide fields, row after row (K * bits / 8 bytes a row, K a multiple
 *    of 16, so every 16 codes start on a byte).
 * s, m: each either a plain value per group (float32, float16 or bfloat16; [N or 1, groups]) or
 *    two-level, as GGUF's k-quants store them: a super-block value d (float32 / float16 /
 *    bfloat16 [N, supers], one per per_super groups) times the group's sub-code c (a packed
 *    stream of sub_bits-wide fields, [N, groups], signed or not), s = d * c in float32, and for
 *    minimums m = -(d * c): exactly QuantizedTensor.scale_values() / minimum_values().
 *
 * fb_introw_decode writes W's rows as float32 with dequantize()'s operations, bit for bit
 * (q * s, one rounding, then + m, one rounding). fb_introw_matmul multiplies x by those same
 * decoded weights, 16 at a time, and sums the products in float32 (fused multiply-adds, four
 * chains for one row of x): x @ W.T up to the order of the float32 sums, as any GEMM's; the
 * columns past x's kx are left out (no inf * 0 of a padding column).
 * The row's parameters are computed first (param_fill: two-level sub-codes of up to 7 bits 8 at a
 * time by one 64-bit read and BMI2's pdep, converted with AVX2; 8-bit ones as bytes).
 * Two builds of the matmul's loop, chosen by the compiler's target (-march=native):
 *   AVX-512 with VBMI (Ice Lake and later Xeons, AMD Zen 4): 16 codes a step, their bytes loaded
 *      with a mask, each code's two bytes placed in a 32-bit lane by one byte permute
 *      (vpermb), shifted up to the lane's top and back (arithmetic shift: sign-extended), converted
 *      and multiplied-added;
 *   otherwise scalar C (the same sums, one lane).
 * Rows of W are shared out over torch's OpenMP threads (four streams each, rowwalk.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rowwalk.h"
#include "threads.h"

#if defined(__F16C__) || defined(__AVX512F__) || defined(__BMI2__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define INTROW_VBMI 1
#define LANES 16
#else
#define INTROW_VBMI 0
#define LANES 1
#endif

#define P_F32 0
#define P_F16 1
#define P_BF16 2
#define INTROW_MAX_M 8

/* one parameter (scales or minimums) of every group */
typedef struct {
    const void *v;      /* plain: [rows, groups] values; two-level: [N, supers] super-block values */
    const uint8_t *sub; /* two-level: the packed sub-codes [N, groups]; NULL: plain */
    int64_t rows;       /* plain: N, or 1 for one row of values shared by every row */
    int64_t supers;     /* two-level: super-blocks a row */
    int64_t per_super;  /* two-level: groups a super-block */
    int32_t kind;       /* P_F32, P_F16, P_BF16 */
    int32_t sub_bits;   /* two-level: 1..8 */
    int32_t sub_signed; /* two-level: sub-codes are two's complement */
    int32_t negate;     /* two-level minimums: m = -(d * c) */
} IntParam;

/* a weight's fixed arguments (fb_introw_row's, fb_introw_matmul's) */
typedef struct {
    const uint8_t *codes;
    const IntParam *s, *m; /* m NULL: no minimum */
    int64_t N, K, group, kx;
    int32_t bits, is_signed;
} IntRow;

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, f = h & 0x3FFu, bits;
    if (e == 0x1F) bits = sign | 0x7F800000u | (f << 13); /* inf, NaN (payload kept) */
    else if (e) bits = sign | ((e + 112) << 23) | (f << 13);
    else if (!f) bits = sign;
    else { /* subnormal: normalize */
        e = 113;
        while (!(f & 0x400u)) { f <<= 1; e--; }
        bits = sign | (e << 23) | ((f & 0x3FFu) << 13);
    }
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static inline float value_at(const void *v, int32_t kind, int64_t i) {
    if (kind == P_F32) return ((const float *)v)[i];
    const uint16_t h = ((const uint16_t *)v)[i];
#if defined(__F16C__)
    if (kind == P_F16) return _cvtsh_ss(h); /* exact, as half_to_float */
#else
    if (kind == P_F16) return half_to_float(h);
#endif
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* field i of a low-first stream of `bits`-wide fields (bits <= 8), as an integer */
static inline int32_t field(const uint8_t *p, int64_t i, int32_t bits, int32_t is_signed) {
    const int64_t bit = i * bits;
    const int sh = (int)(bit & 7);
    uint32_t w = p[bit >> 3];
    if (sh + bits > 8) w |= (uint32_t)p[(bit >> 3) + 1] << 8;
    const uint32_t u = (w >> sh) & ((1u << bits) - 1u);
    return is_signed && (u >> (bits - 1)) ? (int32_t)u - (1 << bits) : (int32_t)u;
}

/* the parameter of row n's group g: (float32) d * (float32) c, as scale_values() computes it */
static inline float param(const IntParam *p, int64_t n, int64_t groups, int64_t g) {
    if (!p->sub) return value_at(p->v, p->kind, (p->rows == 1 ? 0 : n * groups) + g);
    const float d = value_at(p->v, p->kind, n * p->supers + g / p->per_super);
    const float c = d * (float)field(p->sub, n * groups + g, p->sub_bits, p->sub_signed);
    return p->negate ? -c : c;
}

/* param(p, n, groups, g) for g in [g0, g1) into out[0 .. g1 - g0): the same values, each
 * super-block value converted once */
static void param_fill(const IntParam *p, int64_t n, int64_t groups, int64_t g0, int64_t g1, float *out) {
    if (!p->sub) {
        const int64_t base = (p->rows == 1 ? 0 : n * groups);
        if (p->kind == P_F32) memcpy(out, (const float *)p->v + base + g0, sizeof(float) * (size_t)(g1 - g0));
        else
            for (int64_t g = g0; g < g1; g++) out[g - g0] = value_at(p->v, p->kind, base + g);
        return;
    }
    const int32_t bits = p->sub_bits, sgn = p->sub_signed;
    const int64_t sub_bytes = (p->rows * groups * bits + 7) / 8; /* the stream's length */
    (void)sub_bytes;
    for (int64_t g = g0; g < g1;) {
        const int64_t sb = g / p->per_super, end = (sb + 1) * p->per_super < g1 ? (sb + 1) * p->per_super : g1;
        const float d = value_at(p->v, p->kind, n * p->supers + sb);
        float *o = out + (g - g0);
        const int64_t first = n * groups + g, cnt = end - g; /* this super-block's fields here */
        int64_t j = 0;
        if (bits == 8) { /* the bytes are the codes */
            const uint8_t *c8 = p->sub + first;
            if (sgn)
                for (; j < cnt; j++) o[j] = d * (float)(int8_t)c8[j];
            else
                for (; j < cnt; j++) o[j] = d * (float)c8[j];
        }
#if defined(__BMI2__)
        /* 8 fields of <= 7 bits from one 64-bit read within the stream, spread to bytes by pdep */
        if (bits <= 7) {
            const uint64_t mask = 0x0101010101010101ull * ((1u << bits) - 1u);
            const int32_t half = 1 << (bits - 1);
            for (; cnt - j >= 8; j += 8) {
                const int64_t bit = (first + j) * bits;
                if ((bit >> 3) + 8 > sub_bytes) break;
                uint64_t w;
                memcpy(&w, p->sub + (bit >> 3), 8);
                const uint64_t spread = _pdep_u64(w >> (bit & 7), mask);
#if defined(__AVX2__)
                __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)spread));
                if (sgn) v = _mm256_sub_epi32(_mm256_xor_si256(v, _mm256_set1_epi32(half)), _mm256_set1_epi32(half));
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(v)));
#else
                uint8_t c[8];
                memcpy(c, &spread, 8);
                for (int k = 0; k < 8; k++) o[j + k] = d * (float)(sgn ? ((int32_t)c[k] ^ half) - half : (int32_t)c[k]);
#endif
            }
        }
#endif
        for (; j < cnt; j++) o[j] = d * (float)field(p->sub, first + j, bits, sgn);
        if (p->negate)
            for (j = 0; j < cnt; j++) o[j] = -o[j];
        g = end;
    }
}

static int param_ok(const IntParam *p, int64_t N, int64_t groups) {
    if (!p || !p->v || p->kind < P_F32 || p->kind > P_BF16) return 0;
    if (!p->sub) return p->rows == 1 || p->rows == N;
    return p->sub_bits >= 1 && p->sub_bits <= 8 && p->per_super >= 1 && p->supers == (groups + p->per_super - 1) / p->per_super;
}

static int shape_ok(const IntRow *r) {
    return r && r->codes && r->N >= 0 && r->K >= 0 && r->K % 16 == 0 && r->group >= 16 && r->group % 16 == 0 &&
           r->K % r->group == 0 && r->bits >= 2 && r->bits <= 8 && r->kx >= 0 && r->kx <= r->K &&
           param_ok(r->s, r->N, r->K / r->group) && (!r->m || param_ok(r->m, r->N, r->K / r->group));
}

/* Rows [r0, r1) of W as float32 [r1 - r0, K]: q * s, then + m (each one float32 rounding).
 * Returns 0, or -1 for arguments it refuses. */
int32_t fb_introw_decode(const IntRow *r, int64_t r0, int64_t r1, float *out) {
    if (!shape_ok(r) || r0 < 0 || r1 < r0 || r1 > r->N) return -1;
    const int64_t groups = r->K / r->group;
    for (int64_t n = r0; n < r1; n++) {
        float *o = out + (n - r0) * r->K;
        for (int64_t g = 0; g < groups; g++) {
            const float s = param(r->s, n, groups, g);
            const float m = r->m ? param(r->m, n, groups, g) : 0.0f;
            for (int64_t k = g * r->group; k < (g + 1) * r->group; k++) {
                const float w = (float)field(r->codes, n * r->K + k, r->bits, r->is_signed) * s;
                o[k] = r->m ? w + m : w;
            }
        }
    }
    return 0;
}

#if INTROW_VBMI
typedef struct {
    __m512i idx, shl, shr;
    __mmask16 load;
} Unpack;

static Unpack unpack_for(int32_t bits) {
    int8_t idx[64];
    int32_t shl[16];
    for (int i = 0; i < 16; i++) {
        const int bit = i * bits, byte = bit >> 3, sh = bit & 7;
        idx[4 * i] = (int8_t)byte;
        idx[4 * i + 1] = (int8_t)(byte + 1 < 16 ? byte + 1 : 15); /* any byte: shifted out where unused */
        idx[4 * i + 2] = idx[4 * i + 3] = 0; /* zeroed by the permute's mask */
        shl[i] = 32 - bits - sh;
    }
    Unpack u;
    u.idx = _mm512_loadu_si512((const void *)idx);
    u.shl = _mm512_loadu_si512((const void *)shl);
    u.shr = _mm512_set1_epi32(32 - bits);
    u.load = (__mmask16)((1u << (2 * bits)) - 1u); /* 16 codes: 2 * bits bytes */
    return u;
}

/* 16 codes at p (whole bytes) as float32 lanes: each code's two bytes placed in its 32-bit lane
 * (vpermb), shifted up to the lane's top and back (arithmetic shift: sign-extended); inlined with
 * the vectors in registers and is_signed a constant */
static inline __attribute__((always_inline)) __m512 unpack_const(const uint8_t *p, __m512i idx, __m512i shl,
                                                                  __m512i shr, __mmask16 load, const int is_signed) {
    const __m512i raw = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(load, (const void *)p));
    const __m512i up = _mm512_sllv_epi32(_mm512_maskz_permutexvar_epi8(0x3333333333333333ull, idx, raw), shl);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_srav_epi32(up, shr) : _mm512_srlv_epi32(up, shr));
}

static inline __m512 unpack16(const uint8_t *p, const Unpack *u, int32_t is_signed) {
    return unpack_const(p, u->idx, u->shl, u->shr, u->load, is_signed);
}

/* 16 decoded weights: q * s, then + m (each one float32 rounding, as dequantize()) */
static inline __attribute__((always_inline)) __m512 weights16(__m512 q, float s, float m, const int has_m) {
    const __m512 w = _mm512_mul_ps(q, _mm512_set1_ps(s));
    return has_m ? _mm512_add_ps(w, _mm512_set1_ps(m)) : w;
}

/* the lanes of chunk k..k+15 below kx (the rest: padding columns, left out) */
static inline __mmask16 live_lanes(int64_t k, int64_t kx) {
    return kx - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (kx - k)) - 1u);
}

/* chunks [c, full) of a row (multiples of 4 of them, every lane live) against one row of x,
 * into acc[0..3]; returns the first chunk not done. Inlined with constant is_signed, has_m and
 * gshift, each a loop of its own. */
static inline __attribute__((always_inline)) int64_t full_chunks(
    const uint8_t *row, const Unpack *u, const float *xp, const float *sb, const float *mb, int64_t c, int64_t c0,
    int64_t full, int64_t step_bytes, int64_t ahead, __m512 *acc, const int is_signed, const int has_m,
    const int gshift, const int eight) {
    __m512 B0 = acc[0], B1 = acc[1], B2 = acc[2], B3 = acc[3];
    const __m512i idx = u->idx, shl = u->shl, shr = u->shr;
    const __mmask16 load = u->load;
#define UNPACKED(c)                                                                                \
    (eight ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * (c))))) \
           : unpack_const(row + (c) * step_bytes, idx, shl, shr, load, is_signed))
#define WEIGHTS(c) weights16(UNPACKED(c), sb[((c) - c0) >> gshift], has_m ? mb[((c) - c0) >> gshift] : 0.0f, has_m)
    for (; c + 4 <= full; c += 4) {
        if (ahead) _mm_prefetch((const char *)(row + c * step_bytes + ahead), _MM_HINT_T0);
        B0 = _mm512_fmadd_ps(WEIGHTS(c), _mm512_loadu_ps(xp + 16 * c), B0);
        B1 = _mm512_fmadd_ps(WEIGHTS(c + 1), _mm512_loadu_ps(xp + 16 * c + 16), B1);
        B2 = _mm512_fmadd_ps(WEIGHTS(c + 2), _mm512_loadu_ps(xp + 16 * c + 32), B2);
        B3 = _mm512_fmadd_ps(WEIGHTS(c + 3), _mm512_loadu_ps(xp + 16 * c + 48), B3);
    }
#undef WEIGHTS
#undef UNPACKED
    acc[0] = B0, acc[1] = B1, acc[2] = B2, acc[3] = B3;
    return c;
}

/* chunk c (16 codes) of a row decoded, g its group among those whose parameters are in sb / mb */
#define DECODED(c, g) weights16(unpack16(row + (c) * step_bytes, u, is_signed), sb[g], has_m ? mb[g] : 0.0f, has_m)

/* row n of W against M rows of xp (each K floats, zero past kx) into y[i * N + n]: each chunk of
 * 16 weights decoded once (the row's parameters PARAM_CHUNK groups at a time), times x, summed
 * in four chains per row of x (one row) or one */
#define PARAM_CHUNK 512
static void row_of(const IntRow *r, const Unpack *u, int64_t n, const float *xp, int64_t M, float *y,
                   int64_t ahead) {
    const int64_t groups = r->K / r->group, step_bytes = 2 * r->bits;
    const int64_t per_group = r->group / 16; /* chunks */
    const int gshift = per_group == 1 ? 0 : per_group == 2 ? 1 : per_group == 4 ? 2 : per_group == 8 ? 3 : -1;
    const int64_t chunks = (r->kx + 15) / 16;
    const uint8_t *row = r->codes + n * r->K * r->bits / 8;
    const int32_t is_signed = r->is_signed, has_m = r->m != NULL;
    float sb[PARAM_CHUNK], mb[PARAM_CHUNK];
    __m512 A[INTROW_MAX_M], B0 = _mm512_setzero_ps(), B1 = _mm512_setzero_ps(), B2 = _mm512_setzero_ps(),
                            B3 = _mm512_setzero_ps();
    for (int64_t i = 0; i < M; i++) A[i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 * per_group < chunks; g0 += PARAM_CHUNK) {
        const int64_t g1 = groups - g0 < PARAM_CHUNK ? groups : g0 + PARAM_CHUNK;
        const int64_t c0 = g0 * per_group, c1 = g1 * per_group < chunks ? g1 * per_group : chunks;
        const int64_t g_end = g0 + (c1 - c0 + per_group - 1) / per_group; /* the groups x reaches */
        param_fill(r->s, n, groups, g0, g_end, sb);
        if (has_m) param_fill(r->m, n, groups, g0, g_end, mb);
        int64_t c = c0;
        if (gshift < 0) { /* groups of 48, 80, ...: each chunk's group by division */
            for (; c < c1; c++) {
                const __m512 w = DECODED(c, (c - c0) / per_group);
                const __mmask16 live = live_lanes(16 * c, r->kx);
                for (int64_t i = 0; i < M; i++)
                    A[i] = _mm512_mask3_fmadd_ps(w, _mm512_loadu_ps(xp + i * r->K + 16 * c), A[i], live);
            }
        } else if (M == 1) {
            const int64_t full = c1 == chunks && r->kx % 16 ? c1 - 1 : c1; /* chunks with every lane live */
            __m512 acc[4] = {B0, B1, B2, B3};
            const int variant = is_signed * 4 + has_m * 2 + gshift;
            if (r->bits == 8 && is_signed && !has_m && gshift == 1) /* Q8_0: the bytes are the codes */
                c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 1, 0, 1, 1);
            else if (gshift <= 1) /* the GGUF blocks' groups of 16 and 32: loops with the choices made */
                switch (variant) {
                case 0: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 0, 0, 0, 0); break;
                case 1: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 0, 0, 1, 0); break;
                case 2: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 0, 1, 0, 0); break;
                case 3: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 0, 1, 1, 0); break;
                case 4: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 1, 0, 0, 0); break;
                case 5: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 1, 0, 1, 0); break;
                case 6: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 1, 1, 0, 0); break;
                default: c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, 1, 1, 1, 0); break;
                }
            else
                c = full_chunks(row, u, xp, sb, mb, c, c0, full, step_bytes, ahead, acc, is_signed, has_m, gshift, 0);
            B0 = acc[0], B1 = acc[1], B2 = acc[2], B3 = acc[3];
            for (; c < c1; c++)
                B0 = _mm512_mask3_fmadd_ps(DECODED(c, (c - c0) >> gshift), _mm512_loadu_ps(xp + 16 * c), B0, live_lanes(16 * c, r->kx));
        } else {
            for (; c < c1; c++) {
                const __m512 w = DECODED(c, (c - c0) >> gshift);
                const __mmask16 live = live_lanes(16 * c, r->kx);
                for (int64_t i = 0; i < M; i++)
                    A[i] = _mm512_mask3_fmadd_ps(w, _mm512_loadu_ps(xp + i * r->K + 16 * c), A[i], live);
            }
        }
    }
    A[0] = _mm512_add_ps(A[0], _mm512_add_ps(_mm512_add_ps(B0, B1), _mm512_add_ps(B2, B3)));
    for (int64_t i = 0; i < M; i++) y[i * r->N + n] = _mm512_reduce_add_ps(A[i]);
}
#undef DECODED
#else
typedef int Unpack;
static Unpack unpack_for(int32_t bits) { return bits; }

static void row_of(const IntRow *r, const Unpack *u, int64_t n, const float *xp, int64_t M, float *y,
                   int64_t ahead) {
    (void)u;
    (void)ahead;
    const int64_t groups = r->K / r->group;
    float A[INTROW_MAX_M];
    for (int64_t i = 0; i < M; i++) A[i] = 0.0f;
    for (int64_t k = 0; k < r->kx; k++) {
        const int64_t g = k / r->group;
        float w = (float)field(r->codes, n * r->K + k, r->bits, r->is_signed) * param(r->s, n, groups, g);
        if (r->m) w = w + param(r->m, n, groups, g);
        for (int64_t i = 0; i < M; i++) A[i] = fmaf(w, xp[i * r->K + k], A[i]);
    }
    for (int64_t i = 0; i < M; i++) y[i * r->N + n] = A[i];
}
#endif

/* y [M, N] = x [M, kx] (row stride x_stride) @ W.T, M <= INTROW_MAX_M rows at a time (the codes
 * read once per INTROW_MAX_M rows of x). Returns 0, -1 for arguments it refuses, -2 when its
 * copy of x cannot be allocated. */
int32_t fb_introw_matmul(const IntRow *r, const float *x, int64_t x_stride, int64_t M, float *y) {
    if (!shape_ok(r) || M < 0 || x_stride < r->kx) return -1;
    const int64_t K = r->K;
    const int64_t rows = M < INTROW_MAX_M ? M : INTROW_MAX_M;
    float *xp = malloc(sizeof(float) * (size_t)(rows * K + 1));
    if (!xp) return -2;
    const Unpack u = unpack_for(r->bits);
    const int64_t row_bytes = K * r->bits / 8;
    for (int64_t m0 = 0; m0 < M; m0 += INTROW_MAX_M) {
        const int64_t mr = M - m0 < INTROW_MAX_M ? M - m0 : INTROW_MAX_M;
        for (int64_t i = 0; i < mr; i++) { /* x padded with zeros to K */
            memcpy(xp + i * K, x + (m0 + i) * x_stride, sizeof(float) * (size_t)r->kx);
            memset(xp + i * K + r->kx, 0, sizeof(float) * (size_t)(K - r->kx));
        }
        float *yc = y + m0 * r->N;
#pragma omp parallel if (r->N >= 64)
        {
            const RowWalk w = row_walk(r->N, THREAD_ID, TEAM_THREADS);
            for (int64_t i = 0; i < w.visits; i++) {
                const int64_t n = row_walk_row(&w, i);
                if (n < 0) continue;
                const int64_t ahead = row_walk_ahead(n, row_walk_end(&w, i), row_bytes, ROW_PREFETCH_BYTES(r->bits));
                row_of(r, &u, n, xp, mr, yc, ahead);
            }
        }
    }
    free(xp);
    return 0;
}

/* one contiguous float32 row x [kx] -> y [N]: fb_introw_matmul's, in the three arguments of a
 * RowKernel (decode.c calls it for each projection of a decode step) */
int32_t fb_introw_row(const IntRow *r, const float *x, float *y) {
    return fb_introw_matmul(r, x, r ? r->kx : 0, 1, y);
}

/* 1 where this build unpacks 16 codes a step with AVX-512 VBMI, 0 where it runs scalar C */
int32_t fb_introw_vector(void) { return INTROW_VBMI; }
