/* 4-bit integer weights x int8 activations in blocks of 32 (w4a8), the dot products of
 * llama.cpp's q4_0 x q8_0 kind: the activations of a row are quantized per block of 32 columns
 * (int8 codes xq, float32 scale sx per block, as fewbits.quant.quantize does; fb_w4a8_linear
 * does it with rowquant.c's quantizer), the weights hold 4-bit codes u per group of 32 with a
 * float scale s (and, for uint4 codes, a float minimum mn), and the products of codes are summed
 * exactly in int32 (AVX512-VNNI's vpdpbusd, AVX2's vpmaddubsw + vpmaddwd, or scalar C); only
 * the per-block rescale is float32.
 *
 * What it computes, exactly (the same operations in the vector and the scalar path, and in the
 * torch reference of tests/kernels/test_w4a8.py). Columns are taken 128 at a time (a chunk c:
 * 64 bytes of codes), in 16 lanes of 8 consecutive columns; lane l of chunk c covers columns
 * 128 c + 8 l .. + 7, which lie in block b = 4 c + l / 4. For output y[m, n]:
 *   I = sum over the lane's 8 columns of u * xq      (u = the nibble; XOR 8 for signed int4,
 *   S = sum over them of xq                            whose value is then u - 8: exact ints)
 *   J = I - 8 S (signed codes) or I (uint4 codes)
 *   acc[l] = acc[l] + (s[n, b] * sx[m, b]) * (float)J                 (each op one rounding)
 *   acc[l] = acc[l] + (mn[n, b] * sx[m, b]) * (float)S                (only with minimums)
 * over chunks in order; lanes past K add (0 * 0) * 0. Then y = ((a[l] + a[l + 8]) lanes, halved
 * again to 4, 2 and 1 lanes in the same way: r[l] + r[l + 4], r[l] + r[l + 2], r[0] + r[1].
 * Mathematically this is sum over columns of (xq * sx) * w with w = s * (u - 8) or s * u + mn,
 * i.e. F.linear(dequantized activations, dequantized weight), up to float32 rounding.
 *
 * Layout: codes [N, K / 2] bytes, low nibble first (column 2 j in the low half of byte j), K a
 * multiple of 32; scales and minimums [N, K / 32] in float32, float16 or bfloat16, read as stored
 * (exact conversions); xq [M, K] int8, sx [M, K / 32] float32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "rowwalk.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define W4_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define W4_AVX2 1 /* vpmaddubsw + vpmaddwd: the int16 pair sums (at most 2 x 15 x 128) cannot saturate */
#endif

#define CHUNK 128 /* columns per step */
#define LANES 16

enum { P_F32 = 0, P_F16 = 1, P_BF16 = 2 };

/* 2: AVX512-VNNI, 1: AVX2, 0: scalar C only */
int32_t fb_w4a8_vectorized(void) {
#if defined(W4_VNNI)
    return 2;
#elif defined(W4_AVX2)
    return 1;
#else
    return 0;
#endif
}

static float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float, exact (subnormals, infinities and NaNs included) */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
    if (e == 0x1F) return f32_of_bits(sign | 0x7F800000u | (f << 13));
    if (e == 0) { /* zero or subnormal: f * 2^-24, exact in float32 */
        const float v = (float)f * f32_of_bits(0x33800000u);
        return sign ? -v : v;
    }
    return f32_of_bits(sign | ((e + 112u) << 23) | (f << 13));
}

static float param_at(const void *p, int32_t kind, int64_t i) {
    if (kind == P_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return kind == P_F16 ? half_to_float(h) : f32_of_bits((uint32_t)h << 16);
}

/* x's side, one row of activations, laid out per chunk for the weight rows to read */
typedef struct {
    int8_t *xe, *xo;   /* [chunks * 64]: the even and the odd columns, 0 past K */
    float *sx;         /* [chunks * 16]: sx of the lane's block, 0 past K */
    int32_t *neg8s;    /* [chunks * 16]: -8 S of the lane */
    float *s;          /* [chunks * 16]: S of the lane, as float (exact) */
} XRow;

static void prepare_row(const int8_t *xq, const float *sx, int64_t K, int64_t chunks, XRow r) {
    const int64_t blocks = K / 32;
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t j = 0; j < 64; j++) {
            const int64_t k = c * CHUNK + 2 * j;
            r.xe[c * 64 + j] = k < K ? xq[k] : 0;
            r.xo[c * 64 + j] = k + 1 < K ? xq[k + 1] : 0;
        }
        for (int64_t l = 0; l < LANES; l++) {
            const int64_t b = 4 * c + l / 4, k0 = c * CHUNK + 8 * l;
            int32_t sum = 0;
            for (int64_t t = 0; t < 8; t++)
                if (k0 + t < K) sum += xq[k0 + t];
            r.sx[c * LANES + l] = b < blocks ? sx[b] : 0.0f;
            r.neg8s[c * LANES + l] = -8 * sum;
            r.s[c * LANES + l] = (float)sum;
        }
    }
}

static float reduce_lanes(float *a) { /* the fixed tree of the header */
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] = a[l] + a[l + w];
    return a[0];
}

/* one weight row against one prepared x row, scalar C: the reference the vector path equals */
static float dot_scalar(const uint8_t *row, const void *s, const void *mn, int32_t s_kind, int32_t m_kind,
                        int32_t is_signed, int64_t K, int64_t chunks, const XRow *x) {
    const int64_t blocks = K / 32;
    float acc[LANES] = {0};
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t l = 0; l < LANES; l++) {
            const int64_t b = 4 * c + l / 4;
            int32_t isum = 0;
            for (int t = 0; t < 4; t++) { /* byte j = 4 l + t holds columns 2 j (low) and 2 j + 1 (high) */
                const int64_t j = 4 * l + t;
                const int64_t k = c * CHUNK + 2 * j;
                uint8_t v = k < K ? row[(c * CHUNK) / 2 + j] : 0;
                if (is_signed) v ^= 0x88;
                isum += (int32_t)(v & 0x0F) * x->xe[c * 64 + j] + (int32_t)(v >> 4) * x->xo[c * 64 + j];
            }
            if (is_signed) isum += x->neg8s[c * LANES + l];
            const float sb = b < blocks ? param_at(s, s_kind, b) : 0.0f;
            const float sxl = x->sx[c * LANES + l];
            acc[l] = acc[l] + (sb * sxl) * (float)isum;
            if (mn) {
                const float mb = b < blocks ? param_at(mn, m_kind, b) : 0.0f;
                acc[l] = acc[l] + (mb * sxl) * x->s[c * LANES + l];
            }
        }
    }
    return reduce_lanes(acc);
}

#ifdef W4_VNNI
/* 4 consecutive parameters (masked: `count` of them) as floats in lanes 0..3 */
static inline __m128 load4(const void *p, int32_t kind, int64_t b, int count) {
    const __mmask8 m = (__mmask8)((1u << count) - 1u);
    if (kind == P_F32) return _mm_maskz_loadu_ps(m, (const float *)p + b);
    const __m128i h = _mm_maskz_loadu_epi16(m, (const uint16_t *)p + b);
    if (kind == P_F16) return _mm_cvtph_ps(h);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

static inline float reduce16(__m512 a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

static inline __m128 load4_full(const void *p, int32_t kind, int64_t b) {
    if (kind == P_F32) return _mm_loadu_ps((const float *)p + b);
    const __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)p + b));
    if (kind == P_F16) return _mm_cvtph_ps(h);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

/* one chunk's codes (u in bytes: low and high nibbles) and the parameters of its 4 blocks spread
 * over the lanes: what every row of x reads */
typedef struct {
    __m512i lo, hi;
    __m512 sb, mb;
} Chunk;

static inline Chunk chunk_decode(__m512i v, __m128 s4, __m128 m4, int32_t is_signed, int has_min) {
    const __m512i lo_mask = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    if (is_signed) v = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x88)); /* past K: u = 8 against xq = 0 */
    Chunk ch;
    ch.lo = _mm512_and_si512(v, lo_mask);
    ch.hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
    ch.sb = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
    ch.mb = has_min ? _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(m4)) : _mm512_setzero_ps();
    return ch;
}

/* one row of x against a decoded chunk c: the header's operations, in its order */
static inline __m512 chunk_row(__m512 acc, const Chunk *ch, int32_t is_signed, int has_min, const XRow *x, int64_t c) {
    __m512i isum = is_signed ? _mm512_loadu_si512(x->neg8s + c * LANES) : _mm512_setzero_si512();
    isum = _mm512_dpbusd_epi32(isum, ch->lo, _mm512_loadu_si512(x->xe + c * 64));
    isum = _mm512_dpbusd_epi32(isum, ch->hi, _mm512_loadu_si512(x->xo + c * 64));
    const __m512 sxl = _mm512_loadu_ps(x->sx + c * LANES);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(ch->sb, sxl), _mm512_cvtepi32_ps(isum)));
    if (has_min)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(ch->mb, sxl), _mm512_loadu_ps(x->s + c * LANES)));
    return acc;
}

/* one weight row against MR rows of x (xs[0 .. MR)), each chunk decoded once for all of them;
 * out[r * N] = the dot product with row r. The parameter kinds, signedness, minimum and MR are
 * constants in each specialization below. */
static inline __attribute__((always_inline)) void dot_vnni_t(const uint8_t *row, const void *s, const void *mn,
                                                             int32_t s_kind, int32_t m_kind, int32_t is_signed,
                                                             int has_min, int64_t K, int64_t chunks, const XRow *xs,
                                                             const int MR, float *out, int64_t N) {
    const int64_t blocks = K / 32, full = K / CHUNK;
    __m512 acc[4];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const __m128 zero4 = _mm_setzero_ps();
    for (int64_t c = 0; c < full; c++) {
        const Chunk ch = chunk_decode(_mm512_loadu_si512(row + c * 64), load4_full(s, s_kind, 4 * c),
                                      has_min ? load4_full(mn, m_kind, 4 * c) : zero4, is_signed, has_min);
        for (int r = 0; r < MR; r++) acc[r] = chunk_row(acc[r], &ch, is_signed, has_min, &xs[r], c);
    }
    if (full < chunks) { /* the last 32, 64 or 96 columns */
        const int64_t c = full;
        const int bytes = (int)((K - c * CHUNK) / 2), count = (int)(blocks - 4 * c);
        const Chunk ch = chunk_decode(_mm512_maskz_loadu_epi8((((__mmask64)1 << bytes) - 1), row + c * 64),
                                      load4(s, s_kind, 4 * c, count),
                                      has_min ? load4(mn, m_kind, 4 * c, count) : zero4, is_signed, has_min);
        for (int r = 0; r < MR; r++) acc[r] = chunk_row(acc[r], &ch, is_signed, has_min, &xs[r], c);
    }
    for (int r = 0; r < MR; r++) out[r * N] = reduce16(acc[r]);
}

#define DOT_VNNI(SK, MK, SG, HM)                                                                              \
    static void dot_vnni_##SK##_##MK##_##SG##_##HM(const uint8_t *row, const void *s, const void *mn, int64_t K, \
                                                     int64_t chunks, const XRow *xs, int mr, float *out,       \
                                                     int64_t N) {                                              \
        switch (mr) {                                                                                         \
        case 1: dot_vnni_t(row, s, mn, SK, MK, SG, HM, K, chunks, xs, 1, out, N); break;                      \
        case 2: dot_vnni_t(row, s, mn, SK, MK, SG, HM, K, chunks, xs, 2, out, N); break;                      \
        case 3: dot_vnni_t(row, s, mn, SK, MK, SG, HM, K, chunks, xs, 3, out, N); break;                      \
        default: dot_vnni_t(row, s, mn, SK, MK, SG, HM, K, chunks, xs, 4, out, N); break;                     \
        }                                                                                                     \
    }
DOT_VNNI(0, 0, 1, 0)
DOT_VNNI(1, 0, 1, 0)
DOT_VNNI(2, 0, 1, 0)
DOT_VNNI(0, 0, 0, 1)
DOT_VNNI(1, 1, 0, 1)
DOT_VNNI(2, 2, 0, 1)
DOT_VNNI(0, 0, 0, 0)
DOT_VNNI(1, 0, 0, 0)
DOT_VNNI(2, 0, 0, 0)

#define VNNI_ROWS 4 /* rows of x per pass over a weight row */
typedef void (*DotFn)(const uint8_t *, const void *, const void *, int64_t, int64_t, const XRow *, int, float *,
                      int64_t);

/* the specialization for these arguments, or NULL (a mix of parameter kinds: the generic one) */
static DotFn dot_vnni_for(int32_t s_kind, int32_t m_kind, int32_t is_signed, int has_min) {
    if (is_signed && !has_min) {
        static const DotFn f[3] = {dot_vnni_0_0_1_0, dot_vnni_1_0_1_0, dot_vnni_2_0_1_0};
        return f[s_kind];
    }
    if (!is_signed && !has_min) {
        static const DotFn f[3] = {dot_vnni_0_0_0_0, dot_vnni_1_0_0_0, dot_vnni_2_0_0_0};
        return f[s_kind];
    }
    if (!is_signed && has_min && s_kind == m_kind) {
        static const DotFn f[3] = {dot_vnni_0_0_0_1, dot_vnni_1_1_0_1, dot_vnni_2_2_0_1};
        return f[s_kind];
    }
    return NULL;
}

static float dot_vnni(const uint8_t *row, const void *s, const void *mn, int32_t s_kind, int32_t m_kind,
                      int32_t is_signed, int64_t K, int64_t chunks, const XRow *x) {
    float out;
    dot_vnni_t(row, s, mn, s_kind, m_kind, is_signed, mn != NULL, K, chunks, x, 1, &out, 0);
    return out;
}
#endif

#ifdef W4_AVX2
static inline __m128 load4_avx2(const void *p, int32_t kind, int64_t b, int count) {
    if (count == 4) {
        if (kind == P_F32) return _mm_loadu_ps((const float *)p + b);
        const __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)p + b));
        if (kind == P_F16) return _mm_cvtph_ps(h);
        return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < count; i++) v[i] = param_at(p, kind, b + i);
    return _mm_loadu_ps(v);
}

/* the 8 int32 lane sums of 32 code bytes against 32 + 32 activation bytes */
static inline __m256i lanes_avx2(__m256i v, const int8_t *xe, const int8_t *xo, __m256i init) {
    const __m256i lo_mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i lo = _mm256_and_si256(v, lo_mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo_mask);
    const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xe));
    const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)xo));
    return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
}

static float dot_avx2(const uint8_t *row, const void *s, const void *mn, int32_t s_kind, int32_t m_kind,
                      int32_t is_signed, int64_t K, int64_t chunks, const XRow *x) {
    const int64_t blocks = K / 32;
    const __m256i flip = _mm256_set1_epi8((char)0x88);
    const __m256i idx_lo = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), idx_hi = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(); /* lanes 0..7 and 8..15 */
    uint8_t tail[64];
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t left = K - c * CHUNK;
        const uint8_t *src = row + c * 64;
        if (left < CHUNK) { /* the last 32, 64 or 96 columns: zeros after them */
            memset(tail, 0, sizeof tail);
            memcpy(tail, src, (size_t)(left / 2));
            src = tail;
        }
        __m256i v0 = _mm256_loadu_si256((const __m256i *)src), v1 = _mm256_loadu_si256((const __m256i *)(src + 32));
        if (is_signed) {
            v0 = _mm256_xor_si256(v0, flip);
            v1 = _mm256_xor_si256(v1, flip);
        }
        const __m256i z = _mm256_setzero_si256();
        const __m256i i0 = lanes_avx2(v0, x->xe + c * 64, x->xo + c * 64,
                                      is_signed ? _mm256_loadu_si256((const __m256i *)(x->neg8s + c * LANES)) : z);
        const __m256i i1 = lanes_avx2(v1, x->xe + c * 64 + 32, x->xo + c * 64 + 32,
                                      is_signed ? _mm256_loadu_si256((const __m256i *)(x->neg8s + c * LANES + 8)) : z);
        const int count = blocks - 4 * c >= 4 ? 4 : (int)(blocks - 4 * c);
        const __m256 s4 = _mm256_castps128_ps256(load4_avx2(s, s_kind, 4 * c, count));
        const __m256 sx0 = _mm256_loadu_ps(x->sx + c * LANES), sx1 = _mm256_loadu_ps(x->sx + c * LANES + 8);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(s4, idx_lo), sx0),
                                                 _mm256_cvtepi32_ps(i0)));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(s4, idx_hi), sx1),
                                                 _mm256_cvtepi32_ps(i1)));
        if (mn) {
            const __m256 m4 = _mm256_castps128_ps256(load4_avx2(mn, m_kind, 4 * c, count));
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(m4, idx_lo), sx0),
                                                     _mm256_loadu_ps(x->s + c * LANES)));
            acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(m4, idx_hi), sx1),
                                                     _mm256_loadu_ps(x->s + c * LANES + 8)));
        }
    }
    const __m256 h = _mm256_add_ps(acc0, acc1); /* a[l] + a[l + 8] */
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
#endif

static void prefetch_codes(const uint8_t *row, int64_t bytes) {
#if defined(__GNUC__)
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 3);
#else
    (void)row;
    (void)bytes;
#endif
}

/* y [M, N] float32 (row stride N): see the header. The VNNI path takes VNNI_ROWS rows of x per
 * pass over a weight row (each chunk of codes decoded once for them; the same operations per
 * output as one row at a time). s_kind / m_kind: 0 float32, 1 float16,
 * 2 bfloat16; mn NULL for none; is_signed: the codes are two's complement int4 (value u - 8 after
 * the XOR), else uint4 (value u). force_scalar: the scalar path even where VNNI is built (tests).
 * Returns 0, -1 for a bad shape or parameter kind, -2 when x's prepared copy cannot be allocated. */
int32_t fb_w4a8_matmul(const int8_t *xq, const float *sx, int64_t M, const uint8_t *codes, const void *s,
                       int32_t s_kind, const void *mn, int32_t m_kind, int32_t is_signed, int64_t N, int64_t K,
                       float *y, int32_t force_scalar) {
    if (M < 0 || N < 0 || K <= 0 || K % 32 || !s || s_kind < 0 || s_kind > 2 || (mn && (m_kind < 0 || m_kind > 2)))
        return -1;
    const int64_t chunks = (K + CHUNK - 1) / CHUNK, half = K / 2, blocks = K / 32;
    const size_t per_row = (size_t)chunks * (128 + LANES * 3 * 4);
    uint8_t *buf = malloc(per_row * (size_t)(M > 0 ? M : 1) + 64);
    if (!buf) return -2;
    XRow *rows = malloc(sizeof(XRow) * (size_t)(M > 0 ? M : 1));
    if (!rows) {
        free(buf);
        return -2;
    }
    uint8_t *p = buf;
    for (int64_t m = 0; m < M; m++) {
        XRow r;
        r.sx = (float *)p;
        r.neg8s = (int32_t *)(p + chunks * LANES * 4);
        r.s = (float *)(p + chunks * LANES * 8);
        r.xe = (int8_t *)(p + chunks * LANES * 12);
        r.xo = r.xe + chunks * 64;
        prepare_row(xq + m * K, sx + m * blocks, K, chunks, r);
        rows[m] = r;
        p += per_row;
    }
    int vector = 0;
#ifdef W4_VNNI
    vector = !force_scalar;
    const DotFn fast = dot_vnni_for(s_kind, m_kind, is_signed, mn != NULL);
#elif defined(W4_AVX2)
    vector = !force_scalar;
#else
    (void)force_scalar;
#endif
#pragma omp parallel if (N >= 64)
    {
        const RowWalk w = row_walk(N, THREAD_ID, TEAM_THREADS); /* rowwalk.h: four streams of rows */
        for (int64_t i = 0; i < w.visits; i++) {
            const int64_t n = row_walk_row(&w, i);
            if (n < 0) continue;
            const uint8_t *row = codes + n * half;
            const int64_t ahead = row_walk_ahead(n, row_walk_end(&w, i), half, ROW_PREFETCH_BYTES(4));
            if (ahead) prefetch_codes(row + ahead, half); /* a row of lines, ROW_PREFETCH_WEIGHTS on in its stream */
            const int64_t po = n * blocks; /* this row's parameters */
            const void *sn = s_kind == P_F32 ? (const void *)((const float *)s + po) : (const void *)((const uint16_t *)s + po);
            const void *mnn = !mn ? NULL : m_kind == P_F32 ? (const void *)((const float *)mn + po)
                                                            : (const void *)((const uint16_t *)mn + po);
#ifdef W4_VNNI
            if (vector && fast) { /* VNNI_ROWS rows of x per pass: each chunk of codes decoded once for them */
                for (int64_t m0 = 0; m0 < M; m0 += VNNI_ROWS)
                    fast(row, sn, mnn, K, chunks, &rows[m0], (int)(M - m0 < VNNI_ROWS ? M - m0 : VNNI_ROWS), y + m0 * N + n, N);
                continue;
            }
#endif
            for (int64_t m = 0; m < M; m++) {
#ifdef W4_VNNI
                if (vector) {
                    y[m * N + n] = dot_vnni(row, sn, mnn, s_kind, m_kind, is_signed, K, chunks, &rows[m]);
                    continue;
                }
#endif
#ifdef W4_AVX2
                if (vector) {
                    y[m * N + n] = dot_avx2(row, sn, mnn, s_kind, m_kind, is_signed, K, chunks, &rows[m]);
                    continue;
                }
#endif
                y[m * N + n] = dot_scalar(row, sn, mnn, s_kind, m_kind, is_signed, K, chunks, &rows[m]);
            }
        }
    }
    (void)vector;
    free(rows);
    free(buf);
    return 0;
}

/* rowquant.c's dynamic int8 quantizer (the arithmetic of fewbits.quant.quantize with an int8
 * absmax scheme and float32 scales: scale = amax / 127, q = round_half_even(x * (1 / scale))) */
int64_t fb_row_int8_scales(const float *x, int64_t m, int64_t k, int64_t ld, float *scale, float *recip);
void fb_quantize_rows_int8(const float *x, int64_t m, int64_t k, int64_t ld, const float *recip,
                           int64_t recip_stride, uint8_t *q, int32_t offset);

/* x's rows quantized per block of 32 columns: codes xq [M, K] and scales sx [M, K / 32] in one
 * allocation (*xq; free it), or -2 when it cannot be had; else the count of NaN / inf values
 * (then the codes mean nothing). */
static int64_t quantize_blocks(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t **xq, float **sx) {
    const int64_t blocks = K / 32;
    float *scales = malloc(sizeof(float) * (size_t)(2 * M * blocks + 1));
    int8_t *codes = malloc((size_t)(M * K + 1));
    if (!scales || !codes) {
        free(scales);
        free(codes);
        return -2;
    }
    float *recip = scales + M * blocks;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        bad += fb_row_int8_scales(x + m * ldx, blocks, 32, 32, scales + m * blocks, recip + m * blocks);
        fb_quantize_rows_int8(x + m * ldx, blocks, 32, 32, recip + m * blocks, 1, (uint8_t *)(codes + m * K), 0);
    }
    *xq = codes;
    *sx = scales;
    return bad;
}

/* fb_w4a8_matmul on float32 activations x [M, K] (row stride ldx), quantized here per block of
 * 32 columns with float32 scales, exactly as fewbits.quant.quantize(x, int8 group-32 absmax
 * scheme) does. Returns as fb_w4a8_matmul, and -3 (nothing written) where x holds NaN or inf,
 * which such a quantization cannot represent. */
int32_t fb_w4a8_linear(const float *x, int64_t ldx, int64_t M, const uint8_t *codes, const void *s, int32_t s_kind,
                       const void *mn, int32_t m_kind, int32_t is_signed, int64_t N, int64_t K, float *y) {
    if (M < 0 || K <= 0 || K % 32 || ldx < K) return -1;
    int8_t *xq;
    float *sx;
    const int64_t bad = quantize_blocks(x, ldx, M, K, &xq, &sx);
    if (bad == -2) return -2;
    const int32_t rc = bad ? -3 : fb_w4a8_matmul(xq, sx, M, codes, s, s_kind, mn, m_kind, is_signed, N, K, y, 0);
    free(xq);
    free(sx);
    return rc;
}

/* A weight's fixed arguments of fb_w4a8_linear, for fb_w4a8_row: y [N] = one row x [K], three
 * arguments (as lut4.c's fb_lut4_row: from Python each argument costs a conversion). */
typedef struct {
    const uint8_t *codes;
    const void *s, *mn;
    int64_t s_kind, m_kind, is_signed, N, K;
} W4A8Row;
int32_t fb_w4a8_row(const W4A8Row *r, const float *x, float *y) {
    return fb_w4a8_linear(x, r->K, 1, r->codes, r->s, (int32_t)r->s_kind, r->mn, (int32_t)r->m_kind,
                          (int32_t)r->is_signed, r->N, r->K, y);
}

/* The activations as fb_w4a8_linear quantizes them, dequantized: out [M, K] (dense) = xq * sx,
 * one float32 product each -- fewbits.quant.quantize(x, int8 group-32 absmax scheme)
 * .dequantize() -- in float32 (out_bf16 = 0) or rounded to bfloat16, nearest even (1: uint16
 * bit patterns, what .to(torch.bfloat16) of that float32 gives), for batches that multiply them
 * as floats. A row at a time: quantized into a buffer of the thread's, then dequantized (no
 * [M, K] buffer of codes). Returns 0, -1 for a bad shape, -2 when its scratch cannot be
 * allocated, -3 where x holds NaN or inf (out then means nothing). */
#define DQ_STACK_K 16384 /* rows up to this long use buffers on the stack */
int32_t fb_w4a8_dequantized_x(const float *x, int64_t ldx, int64_t M, int64_t K, void *out, int32_t out_bf16) {
    if (M < 0 || K <= 0 || K % 32 || ldx < K) return -1;
    const int64_t blocks = K / 32;
    int8_t *heap_q = NULL;
    float *heap_s = NULL;
    if (K > DQ_STACK_K) { /* one row's buffers per thread */
        heap_q = malloc((size_t)(K * MAX_THREADS + 1));
        heap_s = malloc(sizeof(float) * (size_t)(2 * blocks * MAX_THREADS + 1));
        if (!heap_q || !heap_s) {
            free(heap_q);
            free(heap_s);
            return -2;
        }
    }
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        int8_t stack_q[K > DQ_STACK_K ? 1 : K];
        float stack_s[K > DQ_STACK_K ? 1 : 2 * blocks];
        int8_t *q = heap_q ? heap_q + (int64_t)THREAD_ID * K : stack_q;
        float *sc = heap_s ? heap_s + (int64_t)THREAD_ID * 2 * blocks : stack_s;
        const int64_t b = fb_row_int8_scales(x + m * ldx, blocks, 32, 32, sc, sc + blocks);
        bad += b;
        if (b) continue;
        fb_quantize_rows_int8(x + m * ldx, blocks, 32, 32, sc + blocks, 1, (uint8_t *)q, 0);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + m * K;
            for (int64_t k = 0; k < K; k++) {
                const float v = (float)q[k] * sc[k / 32]; /* finite: x was */
                uint32_t u;
                memcpy(&u, &v, 4);
                o[k] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            }
        } else {
            float *o = (float *)out + m * K;
            for (int64_t k = 0; k < K; k++) o[k] = (float)q[k] * sc[k / 32];
        }
    }
    free(heap_q);
    free(heap_s);
    return bad ? -3 : 0;
}
