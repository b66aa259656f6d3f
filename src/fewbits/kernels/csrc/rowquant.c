/* Fused row-wise int8 quantization of float32 activations, for fewbits' w8a8 Linear.
 *
 * Built on first use by fewbits.kernels.native with the machine's C compiler (-O3
 * -march=native -ffp-contract=off) and called through ctypes; fewbits falls back to torch
 * ops when no compiler is there. The torch reference is fewbits.quant.lowbit_ops
 * (quantize_rows_int8, eager branch); tests compare the two bit for bit.
 *
 * Each function reads its rows once (torch needs one pass per op: amax, amin, mul, round,
 * cast, offset), which is what makes dynamic activation quantization cheap beside the GEMM.
 * Single-threaded on purpose: the callers hand it activations of a few MB at most.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FB_AVX512 1
#endif

static int is_nonfinite(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return (b & 0x7f800000u) == 0x7f800000u;
}

/* amax[i] = max(max_j x[i, j], -min_j x[i, j]) over row i (row stride `ld` floats), for the
 * rows that hold only finite values. Returns the number of rows that hold NaN or inf; their
 * amax is unspecified. */
int64_t fb_row_absmax(const float *x, int64_t m, int64_t k, int64_t ld, float *amax) {
    int64_t bad = 0;
    for (int64_t i = 0; i < m; i++) {
        const float *r = x + i * ld;
        float mx = -INFINITY, mn = INFINITY;
        int nonfinite = 0;
        int64_t j = 0;
#ifdef FB_AVX512
        __m512 vmax = _mm512_set1_ps(-INFINITY), vmin = _mm512_set1_ps(INFINITY);
        __m512i vexp = _mm512_set1_epi32(0x7f800000), vor = _mm512_setzero_si512();
        for (; j + 16 <= k; j += 16) {
            __m512 v = _mm512_loadu_ps(r + j);
            vmax = _mm512_max_ps(vmax, v);
            vmin = _mm512_min_ps(vmin, v);
            /* a lane whose exponent bits are all ones is inf or NaN */
            __mmask16 e = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), vexp), vexp);
            vor = _mm512_mask_mov_epi32(vor, e, vexp);
        }
        mx = _mm512_reduce_max_ps(vmax);
        mn = _mm512_reduce_min_ps(vmin);
        nonfinite = _mm512_test_epi32_mask(vor, vor) != 0;
#endif
        for (; j < k; j++) {
            float v = r[j];
            nonfinite |= is_nonfinite(v);
            mx = v > mx ? v : mx;
            mn = v < mn ? v : mn;
        }
        if (nonfinite) {
            bad++;
            amax[i] = NAN;
        } else {
            amax[i] = mx > -mn ? mx : -mn;
        }
    }
    return bad;
}

/* The int8 scales of the finite rows with float32 scales: scale[i] = amax[i] / 127 and
 * recip[i] = 1 / scale[i] (1 for a zero scale), each one correctly rounded float32 operation,
 * as torch computes them. Returns the number of rows that hold NaN or inf. */
int64_t fb_row_int8_scales(const float *x, int64_t m, int64_t k, int64_t ld, float *scale, float *recip) {
    int64_t bad = fb_row_absmax(x, m, k, ld, scale);
    for (int64_t i = 0; i < m; i++) {
        float s = scale[i] / 127.0f;
        scale[i] = s;
        recip[i] = 1.0f / (s == 0.0f ? 1.0f : s);
    }
    return bad;
}

/* q[i, j] = clamp(round_half_even(x[i, j] * recip[i * recip_stride]), -128, 127), stored as
 * int8, or as uint8 q + 128 when `offset` (oneDNN's uint8 activations with zero point 128).
 * The product is rounded to float32 once, then to an integer; a NaN product (0 * inf, from a
 * subnormal scale) gives 0. q is dense [m, k]. */
void fb_quantize_rows_int8(const float *x, int64_t m, int64_t k, int64_t ld, const float *recip,
                           int64_t recip_stride, uint8_t *q, int32_t offset) {
    const int32_t add = offset ? 128 : 0;
    for (int64_t i = 0; i < m; i++) {
        const float *r = x + i * ld;
        uint8_t *o = q + i * k;
        const float rc = recip[i * recip_stride];
        int64_t j = 0;
#ifdef FB_AVX512
        const __m512 vr = _mm512_set1_ps(rc), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
        const __m512i vadd = _mm512_set1_epi32(add);
        for (; j + 16 <= k; j += 16) {
            __m512 v = _mm512_mul_ps(_mm512_loadu_ps(r + j), vr);
            /* max_ps(v, lo) returns lo for a NaN v: zero those lanes first */
            v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            __m512i n = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(o + j), _mm512_cvtepi32_epi8(_mm512_add_epi32(n, vadd)));
        }
#endif
        for (; j < k; j++) {
            float v = r[j] * rc;
            if (v != v) v = 0.0f;
            v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
            int32_t n = (int32_t)nearbyintf(v); /* the default rounding mode: nearest, ties even */
            o[j] = (uint8_t)(n + add);
        }
    }
}

/* y[i, j] = fma(y[i, j], sx[i], bias[j]) in place (one rounding, as torch.addcmul(bias, y, sx)
 * computes it on CPUs with FMA), or y[i, j] * sx[i] when bias is NULL. Row stride `ld`. */
void fb_scale_rows(float *y, int64_t m, int64_t n, int64_t ld, const float *sx, const float *bias) {
    for (int64_t i = 0; i < m; i++) {
        float *r = y + i * ld;
        const float s = sx[i];
        int64_t j = 0;
#ifdef FB_AVX512
        const __m512 vs = _mm512_set1_ps(s);
        if (bias) {
            for (; j + 16 <= n; j += 16)
                _mm512_storeu_ps(r + j, _mm512_fmadd_ps(_mm512_loadu_ps(r + j), vs, _mm512_loadu_ps(bias + j)));
        } else {
            for (; j + 16 <= n; j += 16)
                _mm512_storeu_ps(r + j, _mm512_mul_ps(_mm512_loadu_ps(r + j), vs));
        }
#endif
        if (bias) {
            for (; j < n; j++) r[j] = fmaf(r[j], s, bias[j]);
        } else {
            for (; j < n; j++) r[j] = r[j] * s;
        }
    }
}

/* Rows [r0, r1) of an int8 weight [N, K] as bfloat16, exactly (|q| <= 128 needs 8 bits of
 * significand): out[(n - r0) * K + k] = q[n, k], for a bf16 GEMM whose rows are scaled after.
 * Rows are shared out over torch's OpenMP threads for larger blocks. */
void fb_int8_rows_bf16(const int8_t *q, int64_t K, int64_t r0, int64_t r1, uint16_t *out) {
#pragma omp parallel for schedule(static) if (r1 - r0 >= 16)
    for (int64_t n = r0; n < r1; n++) {
        const int8_t *row = q + n * K;
        uint16_t *o = out + (n - r0) * K;
        int64_t k = 0;
#ifdef FB_AVX512
        for (; k + 16 <= K; k += 16) {
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k))));
            _mm256_storeu_si256((__m256i *)(o + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
        }
#endif
        for (; k < K; k++) {
            const float v = (float)row[k];
            uint32_t u;
            memcpy(&u, &v, 4);
            o[k] = (uint16_t)(u >> 16); /* exact: the low 16 bits are zero */
        }
    }
}
