/* y [M, N] = x [M, K] @ W.T for an int8 weight-only layer, W[n, k] = q[n, k] * s[n] (int8 codes,
 * one float32 scale per output row: fewbits' int8 preset, per channel or per tensor), for the few
 * rows of decoding: each output is the sum of q * x over its row in float32 (every code is exact
 * as a float32; the products and sums rounded as any GEMM's, in an order of its own: 16 lanes
 * with AVX-512, 8 with AVX2, 1 otherwise), multiplied by s[n] once. That equals x @ dequantize().T
 * up to float32 rounding (a product per output instead of one per weight), within the same
 * bound. The activations stay float32 (torch's _weight_int8pack_mm, used before, takes them in
 * bfloat16).
 *
 * The codes are read once per call for all M <= INT8W_MAX_M rows of x, 16 (8) at a time widened to
 * int32 and converted to float32 once for all of them; rows of W are shared out over torch's
 * OpenMP threads. */
#include <stdint.h>
#include <stdlib.h>
#include "threads.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define INT8W_MAX_M 8
#define PREFETCH_AHEAD 4 /* rows of codes asked for ahead of the one being multiplied */

/* out[m] = sum_k q[k] * x[m * ldx + k] for m < M (M <= INT8W_MAX_M) */
static void row_sums(const int8_t *q, const float *x, int64_t ldx, int64_t M, int64_t K, float *out) {
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 acc[INT8W_MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k))));
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * ldx + k), acc[m]);
    }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    if (k < K) { /* the last K % 16 columns, masked */
        const __mmask16 lanes = (__mmask16)((1u << (K - k)) - 1);
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lanes, q + k)));
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(lanes, x + m * ldx + k), acc[m]);
        k = K;
    }
#endif
    for (int m = 0; m < M; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[INT8W_MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k))));
        for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * ldx + k), acc[m]);
    }
    for (int m = 0; m < M; m++) {
        float t[8];
        _mm256_storeu_ps(t, acc[m]);
        out[m] = ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
    }
#else
    for (int m = 0; m < M; m++) out[m] = 0.0f;
#endif
    for (; k < K; k++) /* the scalar build, and the vector builds' last columns */
        for (int m = 0; m < M; m++) out[m] += (float)q[k] * x[m * ldx + k];
}

/* y [M, N] (row-major) for x [M, K] float32 with row stride ldx >= K, q [N, K] int8 row-major,
 * s [N] float32. Returns 0, or -1 for bad arguments (M outside 0..INT8W_MAX_M). */
int32_t fb_int8w_matmul(const float *x, int64_t ldx, int64_t M, const int8_t *q, const float *s, int64_t N,
                        int64_t K, float *y) {
    if (M < 0 || M > INT8W_MAX_M || N < 0 || K <= 0 || ldx < K) return -1;
    if (M == 0) return 0;
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; n++) {
        if (n + PREFETCH_AHEAD < N) {
            const int8_t *p = q + (n + PREFETCH_AHEAD) * K;
            for (int64_t b = 0; b < K; b += 64) __builtin_prefetch(p + b);
        }
        float sums[INT8W_MAX_M];
        row_sums(q + n * K, x, ldx, M, K, sums);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = sums[m] * s[n];
    }
    return 0;
}

/* A weight's fixed arguments of fb_int8w_matmul for one row of x: fb_int8w_row(r, x, y) (three
 * arguments: from Python each argument costs a conversion) */
typedef struct {
    const int8_t *q;
    const float *s;
    int64_t N, K;
} Int8WRow;
int32_t fb_int8w_row(const Int8WRow *r, const float *x, float *y) {
    return fb_int8w_matmul(x, r->K, 1, r->q, r->s, r->N, r->K, y);
}

int32_t fb_int8w_max_rows(void) { return INT8W_MAX_M; }
