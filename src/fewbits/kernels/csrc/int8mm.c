/* int8 x int8 -> int32 GEMM on Intel AMX (TDPBSSD), with the rescale of training's int8 GEMMs
 * fused into its store: y[i, j] = (float(acc[i, j]) * da[i]) * db[j] (+ bias[j]), rounded once to
 * bfloat16 or float32 (or the raw int32 sums).
 *
 * Why: torch._int_mm runs oneDNN's old s8s8s32 GEMM API here, which does not use AMX and is no
 * faster than the bf16 GEMM (benchmarks/bench_train.py); oneDNN's AMX int8 matmul is reached from
 * torch only through prepacked weights, whose reorder costs more than the GEMM saves when both
 * operands are new at every call, as in training.
 *
 * Layout. A is [m, kp] int8 row-major (row stride lda bytes), m a multiple of 32 and kp of 64
 * (the caller pads with zeros: zeros add nothing). B is packed by fb_amx_pack_b from [n, k]
 * row-major into panels of 16 columns x 64 reduction values in AMX's VNNI order:
 * panel (nb, kb) holds 16 rows r of 64 bytes, byte 4c + j of row r = B[16 nb + c][64 kb + 4 r + j].
 * Each 32 x 32 output block is four 16 x 16 int32 tiles (the rescale and store of one block runs
 * while the tiles sum the next; plain stores: the result is read right after, and streamed stores
 * measured 1.3x slower into the freshly allocated outputs a GEMM writes); the sums are exact (int32, as
 * torch._int_mm's), so the result is bit for bit the torch reference in fewbits.kernels.int8.
 *
 * Built with the rest of csrc/ for -march=native: where the CPU has no AMX the GEMM reports so
 * (fb_amx_int8_ready() == 0) and fewbits keeps torch._int_mm; the quantizers and packers below
 * have AVX-512 paths and scalar C for other CPUs (tests/kernels/test_int8mm.py builds all). Linux grants a process AMX's
 * tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), which fb_amx_int8_ready makes (tiles.h).
 */
#include "tiles.h" /* first: the tile state (tiles_permitted, tiles_begin / tiles_end) */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FB_V512 1 /* the vector paths of the quantizers and packers */
#if defined(FB_TILE_STATE) && defined(__AMX_INT8__)
#define FB_AMX 1 /* the tile GEMM */
#endif
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

int fb_amx_int8_ready(void) {
#ifdef FB_AMX
    return tiles_permitted();
#else
    return 0;
#endif
}

/* Bytes fb_amx_pack_b writes for an [n, k] B: ceil(n / 32) * 2 panels of 16 columns (so whole
 * 32-column blocks), ceil(k / 64) reduction blocks, 1024 bytes each. */
/* panel (nb, kb) element by element, B[col][kk] at src[col * s_col + kk * s_k], zeros outside */
static void pack_panel(const int8_t *src, int64_t s_col, int64_t s_k, int64_t n, int64_t k, int64_t nb, int64_t kb,
                       int8_t *panel) {
    for (int c = 0; c < 16; c++) {
        const int64_t col = nb * 16 + c;
        for (int r = 0; r < 16; r++) {
            for (int j = 0; j < 4; j++) {
                const int64_t kk = kb * 64 + 4 * r + j;
                panel[r * 64 + 4 * c + j] = (col < n && kk < k) ? src[col * s_col + kk * s_k] : 0;
            }
        }
    }
}

int64_t fb_amx_packed_bytes(int64_t n, int64_t k) {
    return ((n + 31) / 32) * 2 * ((k + 63) / 64) * 1024;
}

void fb_amx_pack_b(const int8_t *b, int64_t n, int64_t k, int64_t ldb, int8_t *out) {
    const int64_t kb_n = (k + 63) / 64, nb_n = ((n + 31) / 32) * 2;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < nb_n; nb++) {
        for (int64_t kb = 0; kb < kb_n; kb++) {
            int8_t *panel = out + (nb * kb_n + kb) * 1024;
#ifdef FB_V512
            if (nb * 16 + 16 <= n && kb * 64 + 64 <= k && ldb % 4 == 0 && ldb / 4 < (1 << 26)) {
                /* a whole panel: row r gathers word r of each of the 16 columns' 64 values */
                const int32_t *base = (const int32_t *)(b + nb * 16 * ldb + kb * 64);
                const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                         11, 12, 13, 14, 15),
                                                       _mm512_set1_epi32((int32_t)(ldb / 4)));
                for (int r = 0; r < 16; r++)
                    _mm512_storeu_si512(panel + r * 64, _mm512_i32gather_epi32(idx, base + r, 4));
                continue;
            }
#endif
            pack_panel(b, ldb, 1, n, k, nb, kb, panel);
        }
    }
}

#ifdef FB_AMX

/* the sums of one 32 x 32 block in tiles 0-3 (stored by store_tiles) */
static void block(const int8_t *a, int64_t lda, const int8_t *bp0, const int8_t *bp1, int64_t kb0, int64_t kb1,
                  int32_t part[4][16][16]) {
    if (part) { /* the sums of the reduction blocks before kb0 */
        _tile_loadd(0, part[0], 64);
        _tile_loadd(1, part[1], 64);
        _tile_loadd(2, part[2], 64);
        _tile_loadd(3, part[3], 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    const int8_t *a1 = a + 16 * lda;
    for (int64_t kb = kb0; kb < kb1; kb++) {
        _tile_loadd(4, a + kb * 64, lda);
        _tile_loadd(6, bp0 + kb * 1024, 64);
        _tile_loadd(5, a1 + kb * 64, lda);
        _tile_loadd(7, bp1 + kb * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
}

static void store_tiles(int32_t acc[4][16][16]) {
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
}

static void store(int32_t acc[4][16][16], int64_t i0, int64_t j0, int64_t m_out, int64_t n_out,
                  const float *da, const float *db, const float *bias, void *out, int64_t ldo, int kind) {
    for (int half = 0; half < 2; half++) {
        for (int r = 0; r < 16; r++) {
            const int64_t i = i0 + 16 * half + r;
            if (i >= m_out)
                return;
            const float sa = da ? da[i] : 1.0f;
            for (int side = 0; side < 2; side++) {
                const int64_t j = j0 + 16 * side;
                if (j >= n_out)
                    break;
                const int32_t *src = acc[2 * half + side][r];
                const int64_t w = n_out - j < 16 ? n_out - j : 16;
                const __mmask16 mk = (__mmask16)((1u << w) - 1u);
                if (kind == 2) {
                    _mm512_mask_storeu_epi32((int32_t *)out + i * ldo + j, mk, _mm512_loadu_si512(src));
                    continue;
                }
                __m512 y = _mm512_cvtepi32_ps(_mm512_loadu_si512(src));
                y = _mm512_mul_ps(y, _mm512_set1_ps(sa));
                if (db)
                    y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(mk, db + j));
                if (bias)
                    y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mk, bias + j));
                if (kind == 0) {
                    _mm512_mask_storeu_ps((float *)out + i * ldo + j, mk, y);
                } else { /* round to nearest even in the integer unit; NaN -> 0x7fc0 as torch */
                    const __m512i u = _mm512_castps_si512(y);
                    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
                    const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
                    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
                    uint16_t *dst = (uint16_t *)out + i * ldo + j;
                    _mm256_mask_storeu_epi16(dst, mk, _mm512_cvtepi32_epi16(r));
                }
            }
        }
    }
}
#endif

#if defined(FB_V512) && defined(__AVX512VNNI__)
#define FB_VNNI 1 /* the panels' VNNI kernels (no tiles: CPUs without AMX run them too) */
/* one row's outputs from a panel's 16 sums of xq + 128 (columns j on, n in all): y[j + c] =
 * (float(sums[c] - colsum128[j + c]) * sa) * db[j + c] (+ bias[j + c]) -- the float32 steps of
 * fb_amx_gemv_u8 and fb_vnni_gemm_u8 alike, so a row gives the same bits alone or in a batch */
static inline void vnni_store(__m512i sums, const int32_t *colsum128, float sa, const float *db, const float *bias,
                              int64_t j, int64_t n, float *y) {
    const int64_t w = n - j < 16 ? n - j : 16;
    const __mmask16 mk = (__mmask16)((1u << w) - 1u);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, _mm512_maskz_loadu_epi32(mk, colsum128 + j))),
                             _mm512_set1_ps(sa));
    if (db) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, db + j));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, bias + j));
    _mm512_mask_storeu_ps(y + j, mk, v);
}
#endif

/* 1 where fb_amx_gemv_u8 runs here beside the tile GEMM (AMX and VNNI in the build, the tile
 * state granted) */
int fb_amx_gemv_ready(void) {
#if defined(FB_AMX) && defined(FB_VNNI)
    return fb_amx_int8_ready();
#else
    return 0;
#endif
}

/* 1 where the VNNI kernels over the panels (fb_amx_gemv_u8, fb_vnni_gemm_u8) run here: AVX512-VNNI
 * in the build, tiles or not (AMD Zen 4, Intel Ice Lake) */
int fb_vnni_ready(void) {
#if defined(FB_VNNI)
    return 1;
#else
    return 0;
#endif
}

/* One row of activations against the packed B (fb_amx_pack_b's panels), for inference's decode
 * step, where a tile GEMM would pad the row to 32: y[j] = (float(acc[j]) * sa) * db[j] (+ bias[j])
 * for j < n, acc[j] = sum_k xq[k] * B[j][k] exact in int32 -- the same sums and the same float32
 * steps as fb_amx_gemm_s8's store, bit for bit. AVX512-VNNI's vpdpbusd multiplies unsigned by
 * signed bytes: xu holds xq + 128 (kp = k rounded up to 64 bytes; the panels' padding is zero, so
 * xu's padding adds nothing) and colsum128[j] = 128 * sum_k B[j][k] comes off each sum. Exact while
 * k <= 65536 (|sum| <= 255 * 128 * k < 2^31). The panels of 16 columns are shared out over torch's
 * OpenMP threads. Returns 0, or -1 where the build has no VNNI (nothing written). */
int fb_amx_gemv_u8(const uint8_t *xu, int64_t kp, const int8_t *bp, int64_t n, const int32_t *colsum128, float sa,
                   const float *db, const float *bias, float *y) {
#if defined(FB_VNNI)
    if (kp % 64 || kp > 65536 || n < 0) return -1;
    const int64_t kb_n = kp / 64, panels = (n + 15) / 16;
#pragma omp parallel for schedule(static) if (panels >= 16)
    for (int64_t nb = 0; nb < panels; nb++) {
        const int8_t *p = bp + nb * kb_n * 1024;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t kb = 0; kb < kb_n; kb++, p += 1024) {
            const int32_t *xw = (const int32_t *)(xu + 64 * kb); /* 16 words of 4 activations */
            __builtin_prefetch(p + 8 * 1024);
            __builtin_prefetch(p + 8 * 1024 + 512);
            for (int r = 0; r < 16; r += 4) {
                a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(xw[r]), _mm512_loadu_si512(p + 64 * r));
                a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(xw[r + 1]), _mm512_loadu_si512(p + 64 * r + 64));
                a2 = _mm512_dpbusd_epi32(a2, _mm512_set1_epi32(xw[r + 2]), _mm512_loadu_si512(p + 64 * r + 128));
                a3 = _mm512_dpbusd_epi32(a3, _mm512_set1_epi32(xw[r + 3]), _mm512_loadu_si512(p + 64 * r + 192));
            }
        }
        vnni_store(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)), colsum128, sa, db, bias,
                   16 * nb, n, y);
    }
    return 0;
#else
    (void)xu, (void)kp, (void)bp, (void)n, (void)colsum128, (void)sa, (void)db, (void)bias, (void)y;
    return -1;
#endif
}

#if defined(FB_VNNI)
/* MR rows of xu against NP panels from p (NP 1 or 2, the second kb_n * 1024 bytes on; columns j
 * on): the int32 sums of their 16 columns each, then vnni_store's float32 steps per row (MR,
 * NP constants where inlined: the sums stay in registers; two panels share each broadcast) */
static inline __attribute__((always_inline)) void vnni_rows(int MR, int NP, const uint8_t *xu, int64_t ldx,
                                                            int64_t kb_n, const int8_t *p, const int32_t *colsum128,
                                                            const float *sa, const float *db, const float *bias,
                                                            int64_t j, int64_t n, float *y, int64_t ldy) {
    __m512i acc[2][8];
    for (int q = 0; q < NP; q++)
        for (int i = 0; i < MR; i++) acc[q][i] = _mm512_setzero_si512();
    const int64_t next = kb_n * 1024;
    for (int64_t kb = 0; kb < kb_n; kb++, p += 1024) {
        for (int r = 0; r < 16; r++) {
            __m512i w[2];
            for (int q = 0; q < NP; q++) w[q] = _mm512_loadu_si512(p + q * next + 64 * r);
            for (int i = 0; i < MR; i++) { /* row i's 4 activations of panel row r, in every lane */
                const __m512i xv = _mm512_set1_epi32(((const int32_t *)(xu + i * ldx + 64 * kb))[r]);
                for (int q = 0; q < NP; q++) acc[q][i] = _mm512_dpbusd_epi32(acc[q][i], xv, w[q]);
            }
        }
    }
    for (int q = 0; q < NP; q++)
        for (int i = 0; i < MR; i++) vnni_store(acc[q][i], colsum128, sa[i], db, bias, j + 16 * q, n, y + i * ldy);
}
/* every row of xu against NP panels from panel nb */
static inline __attribute__((always_inline)) void vnni_panels(int NP, const uint8_t *xu, int64_t m, int64_t ldx,
                                                              int64_t kb_n, const int8_t *p, const int32_t *colsum128,
                                                              const float *sa, const float *db, const float *bias,
                                                              int64_t j, int64_t n, float *y, int64_t ldy) {
    int64_t i = 0;
#define VNNI_ROWS(MR) vnni_rows(MR, NP, xu + i * ldx, ldx, kb_n, p, colsum128, sa + i, db, bias, j, n, y + i * ldy, ldy)
    for (; i + 8 <= m; i += 8) VNNI_ROWS(8);
    switch (m - i) { /* the last rows, each count its own inlined block */
    case 7: VNNI_ROWS(7); break;
    case 6: VNNI_ROWS(6); break;
    case 5: VNNI_ROWS(5); break;
    case 4: VNNI_ROWS(4); break;
    case 3: VNNI_ROWS(3); break;
    case 2: VNNI_ROWS(2); break;
    case 1: VNNI_ROWS(1); break;
    default: break;
    }
#undef VNNI_ROWS
}
#endif

/* Rows of activations against the packed B, with VNNI dot products (CPUs without AMX: their
 * batches): fb_amx_gemv_u8 for each of the m rows of xu [m, kp] (row stride ldx; xq + 128 as
 * there), with the row's own scale sa[i], into y [m, n] (row stride ldy) -- the same exact int32
 * sums and the same float32 steps, so a row's bits are the same alone (fb_amx_gemv_u8) or in a
 * batch. Each thread takes whole pairs of panels of 16 columns (two panels, k bytes x 32, stay in
 * the caches while the rows pass over them, 8 at a time). Returns 0, or -1 where the build has no
 * VNNI or for arguments out of range (nothing written). */
int fb_vnni_gemm_u8(const uint8_t *xu, int64_t m, int64_t kp, int64_t ldx, const int8_t *bp, int64_t n,
                    const int32_t *colsum128, const float *sa, const float *db, const float *bias, float *y,
                    int64_t ldy) {
#if defined(FB_VNNI)
    if (kp % 64 || kp > 65536 || n < 0 || m < 0 || ldx < kp || ldy < n) return -1;
    const int64_t kb_n = kp / 64, panels = (n + 15) / 16, pairs = (panels + 1) / 2;
#pragma omp parallel for schedule(static) if (panels * m >= 64)
    for (int64_t pp = 0; pp < pairs; pp++) {
        const int64_t nb = 2 * pp;
        const int8_t *p = bp + nb * kb_n * 1024;
        if (nb + 1 < panels)
            vnni_panels(2, xu, m, ldx, kb_n, p, colsum128, sa, db, bias, 16 * nb, n, y, ldy);
        else
            vnni_panels(1, xu, m, ldx, kb_n, p, colsum128, sa, db, bias, 16 * nb, n, y, ldy);
    }
    return 0;
#else
    (void)xu, (void)m, (void)kp, (void)ldx, (void)bp, (void)n, (void)colsum128, (void)sa, (void)db, (void)bias;
    (void)y, (void)ldy;
    return -1;
#endif
}

/* rowquant.c's dynamic int8 quantizer (the arithmetic of fewbits.quant.quantize with an int8
 * absmax scheme and float32 scales) */
int64_t fb_row_int8_scales(const float *x, int64_t m, int64_t k, int64_t ld, float *scale, float *recip);
void fb_quantize_rows_int8(const float *x, int64_t m, int64_t k, int64_t ld, const float *recip,
                           int64_t recip_stride, uint8_t *q, int32_t offset);

/* A w8a8 weight's fixed arguments for fb_w8a8_amx_row (native.Int8Panels.row_call) */
typedef struct {
    const int8_t *bp;
    const int32_t *colsum128;
    const float *sw;
    int64_t n, k;
} W8A8Row;
/* y [n] for one contiguous float32 row x [k]: x quantized to int8 per token by rowquant.c's
 * quantizer (quantize()'s codes and float32 scale, as QuantLinear's general path quantizes it),
 * then fb_amx_gemv_u8 against the panels, without a bias: the general path's bits in one call.
 * Returns 0; -1 where the kernel cannot run here; -2 when its buffer cannot be allocated; -3 for
 * activations with a NaN or an infinity (which the general path refuses). */
int fb_w8a8_amx_row(const W8A8Row *r, const float *x, float *y) {
    const int64_t kp = (r->k + 63) / 64 * 64;
    float scale, recip;
    if (fb_row_int8_scales(x, 1, r->k, r->k, &scale, &recip)) return -3;
    uint8_t stack[16384], *xu = kp <= (int64_t)sizeof stack ? stack : malloc((size_t)kp);
    if (!xu) return -2;
    fb_quantize_rows_int8(x, 1, r->k, r->k, &recip, 0, xu, 1);
    memset(xu + r->k, 128, (size_t)(kp - r->k)); /* x's zeros (the panels' padding is zero anyway) */
    const int rc = fb_amx_gemv_u8(xu, kp, r->bp, r->n, r->colsum128, scale, r->sw, NULL, y);
    if (xu != stack) free(xu);
    return rc;
}

/* out[i, j] for i < m_out, j < n_out (row stride ldo elements): kind 0 float32, 1 bfloat16,
 * 2 int32 sums (da, db, bias ignored). da / db / bias may be NULL (factor 1, no bias).
 * Returns 0, or -1 where AMX is not there (nothing written). */
int fb_amx_gemm_s8(const int8_t *a, int64_t m, int64_t kp, int64_t lda, const int8_t *bp, int64_t n,
                   const float *da, const float *db, const float *bias, int64_t m_out, int64_t n_out,
                   void *out, int64_t ldo, int kind) {
#ifdef FB_AMX
    if (!fb_amx_int8_ready() || m % 32 || kp % 64)
        return -1;
    const int64_t kb_n = kp / 64, nblocks = (n + 31) / 32, mblocks = m / 32;
    /* B panels of up to 8 blocks (256 columns) stay in L2 while every row block passes over them;
     * the reduction runs in chunks of 512 so that a row block's chunk of A (16 KB) stays in L1
     * across the 8 column blocks, their partial sums parked in `part` between chunks */
    enum { NGROUP = 8, KCHUNK = 8 };
#ifdef _OPENMP
    const int64_t nthreads = omp_get_max_threads();
#else
    const int64_t nthreads = 1;
#endif
    /* fewer row blocks than threads (inference's few rows): the column blocks one at a time are
     * what the threads share */
    const int64_t group = mblocks >= nthreads ? NGROUP : 1, ngroups = (nblocks + group - 1) / group;
#pragma omp parallel
    {
        tiles_begin();
        /* two buffers: the rescale of one block runs while the tile unit sums the next */
        int32_t acc[2][4][16][16] __attribute__((aligned(64)));
        int32_t part[NGROUP][4][16][16] __attribute__((aligned(64)));
        int64_t prev_i = -1, prev_j = 0;
        int cur = 0;
#pragma omp for schedule(static) collapse(2)
        for (int64_t gi = 0; gi < ngroups; gi++) {
            for (int64_t mb = 0; mb < mblocks; mb++) {
                const int64_t g0 = gi * group, g1 = g0 + group < nblocks ? g0 + group : nblocks;
                for (int64_t k0 = 0; k0 < kb_n; k0 += KCHUNK) {
                    const int64_t k1 = k0 + KCHUNK < kb_n ? k0 + KCHUNK : kb_n;
                    for (int64_t nb = g0; nb < g1; nb++) {
                        const int8_t *bp0 = bp + (2 * nb) * kb_n * 1024;
                        block(a + mb * 32 * lda, lda, bp0, bp0 + kb_n * 1024, k0, k1, k0 ? part[nb - g0] : NULL);
                        if (k1 < kb_n) {
                            store_tiles(part[nb - g0]);
                            continue;
                        }
                        if (prev_i >= 0)
                            store(acc[cur ^ 1], prev_i, prev_j, m_out, n_out, da, db, bias, out, ldo, kind);
                        store_tiles(acc[cur]);
                        prev_i = mb * 32;
                        prev_j = nb * 32;
                        cur ^= 1;
                    }
                }
            }
        }
        if (prev_i >= 0)
            store(acc[cur ^ 1], prev_i, prev_j, m_out, n_out, da, db, bias, out, ldo, kind);
        tiles_end();
    }
    return 0;
#else
    (void)a; (void)m; (void)kp; (void)lda; (void)bp; (void)n; (void)da; (void)db; (void)bias;
    (void)m_out; (void)n_out; (void)out; (void)ldo; (void)kind;
    return -1;
#endif
}

/* ------------------------------------------------------------------------------------------
 * int8 quantization of bfloat16 operands, one scale per row or per column, the arithmetic of
 * fewbits.kernels.int8.quantize_rows_int8 (nonfinite="keep") on the float32 values:
 *   amax = max |x| (NaN if the line holds a NaN, else inf if it holds an inf), scale = amax / 127,
 *   recip = 1 / scale (1 for a zero scale), q = clamp(round_half_even(x * recip), -128, 127),
 *   0 where that product is NaN (every element of a line that held NaN or inf).
 * |x| of a bfloat16 is its bits & 0x7fff, ordered as integers (NaN above 0x7f80, inf at it):
 * the amax is an integer max over 16-bit lanes, exact.
 * ------------------------------------------------------------------------------------------ */
static float bf16_amax_value(uint32_t bits) {
    float v;
    uint32_t u;
    if (bits > 0x7f80u)
        return NAN;
    u = bits << 16;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline int8_t q8(float v) {
    if (v != v)
        return 0;
    v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
    return (int8_t)(int32_t)nearbyintf(v);
}

/* Stochastic rounding (seed != NULL): q = clamp(floor(v + u), -128, 127) in float32, NaN -> 0, with
 * u = (w >> 8) * 2^-24 from the counter-based word w of the element's index in the logical
 * [lines, length] operand (fewbits.kernels.random: w = mix(mix(lo32(i) ^ s0) ^ s1 ^ hi32(i))). */
static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x5BD1E995u;
    return h ^ (h >> 16);
}

static inline uint32_t word_of(const uint32_t *seed, uint64_t i) {
    return mix32(mix32((uint32_t)i ^ seed[0]) ^ seed[1] ^ (uint32_t)(i >> 32));
}

static inline int8_t q8_sr(float v, uint32_t w) {
    if (v != v)
        return 0;
    float t = floorf(v + (float)(w >> 8) * 0x1p-24f);
    t = t < -128.0f ? -128.0f : (t > 127.0f ? 127.0f : t);
    return (int8_t)(int32_t)t;
}

static inline int8_t q8_any(float v, const uint32_t *seed, uint64_t i) {
    return seed ? q8_sr(v, word_of(seed, i)) : q8(v);
}

#ifdef FB_V512
/* 16 bfloat16 -> float32 times r, rounded, saturated, NaN -> 0: 16 int8 */
static inline __m128i q8x16(const uint16_t *p, __m512 r) {
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    v = _mm512_mul_ps(v, r);
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    return _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline __m512i mix32x16(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x7FEB352D));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x5BD1E995));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

/* q8x16 with stochastic rounding: the 16 elements' indices are base + lane * stride (< 2^32) */
static inline __m128i q8x16_sr(const uint16_t *p, __m512 r, const uint32_t *seed, uint32_t base, uint32_t stride) {
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    v = _mm512_mul_ps(v, r);
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int32_t)base), _mm512_mullo_epi32(lane, _mm512_set1_epi32((int32_t)stride)));
    __m512i w = mix32x16(_mm512_xor_si512(idx, _mm512_set1_epi32((int32_t)seed[0])));
    w = mix32x16(_mm512_xor_si512(w, _mm512_set1_epi32((int32_t)seed[1])));
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 8)), _mm512_set1_ps(0x1p-24f));
    v = _mm512_roundscale_ps(_mm512_add_ps(v, u), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
}
#endif

#ifdef FB_V512
/* four rounds of byte / word / dword / qword interleaves: register t then holds column
 * transpose_order()[t] of the 16 x 16 block (the order is found once, from a numbered block) */
static void transpose16(__m128i r[16]) {
    __m128i t[16];
    for (int i = 0; i < 8; i++) {
        t[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        t[i + 8] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm_unpacklo_epi16(t[2 * i], t[2 * i + 1]);
        r[i + 8] = _mm_unpackhi_epi16(t[2 * i], t[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        t[i] = _mm_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[i + 8] = _mm_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm_unpacklo_epi64(t[2 * i], t[2 * i + 1]);
        r[i + 8] = _mm_unpackhi_epi64(t[2 * i], t[2 * i + 1]);
    }
}

static const int *transpose_order(void) {
    static int perm[16];
    static volatile int ready = 0;
    if (!ready) {
        __m128i r[16];
        int8_t rows[16][16], col[16];
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++)
                rows[i][j] = (int8_t)(16 * i + j);
        for (int i = 0; i < 16; i++)
            r[i] = _mm_loadu_si128((const __m128i *)rows[i]);
        transpose16(r);
        int p[16];
        for (int t = 0; t < 16; t++) {
            _mm_storeu_si128((__m128i *)col, r[t]);
            p[t] = (uint8_t)col[0] % 16; /* row 0 of column c holds c */
        }
        memcpy(perm, p, sizeof p);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        ready = 1;
    }
    return perm;
}
#endif

static void scale_of(uint32_t amax_bits, float *scale, float *recip) {
    const float s = bf16_amax_value(amax_bits) / 127.0f;
    *scale = s;
    *recip = 1.0f / (s == 0.0f ? 1.0f : s);
}

/* rows: q[i * ldq + j], scale[i] */
void fb_q8_rows_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ld, int8_t *q, int64_t ldq, float *scale,
                     const uint32_t *seed) {
    const int vec_sr = (uint64_t)m * (uint64_t)k < (1ull << 32); /* 32-bit lane indices */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *r = x + i * ld;
        int8_t *o = q + i * ldq;
        uint32_t mx = 0;
        int64_t j = 0;
#ifdef FB_V512
        __m512i vm = _mm512_setzero_si512();
        const __m512i mask = _mm512_set1_epi16(0x7fff);
        for (; j + 32 <= k; j += 32)
            vm = _mm512_max_epu16(vm, _mm512_and_si512(_mm512_loadu_si512(r + j), mask));
        uint16_t lanes[32];
        _mm512_storeu_si512(lanes, vm);
        for (int t = 0; t < 32; t++)
            mx = lanes[t] > mx ? lanes[t] : mx;
#endif
        for (; j < k; j++) {
            const uint32_t b = r[j] & 0x7fffu;
            mx = b > mx ? b : mx;
        }
        float s, rc;
        scale_of(mx, &s, &rc);
        scale[i] = s;
        j = 0;
#ifdef FB_V512
        const __m512 vr = _mm512_set1_ps(rc);
        if (!seed) {
            for (; j + 16 <= k; j += 16)
                _mm_storeu_si128((__m128i *)(o + j), q8x16(r + j, vr));
        } else if (vec_sr) {
            for (; j + 16 <= k; j += 16)
                _mm_storeu_si128((__m128i *)(o + j), q8x16_sr(r + j, vr, seed, (uint32_t)(i * k + j), 1));
        }
#endif
        for (; j < k; j++)
            o[j] = q8_any(bf16_to_f32(r[j]) * rc, seed, (uint64_t)(i * k + j));
    }
}

/* columns: scale[j] over the m rows of column j; q[i * ldq + j] (transposed == 0) or
 * q[j * ldq + i] (transposed != 0: the [k, m] transpose, rows of it contiguous).
 * work: k floats of scratch. */
void fb_q8_cols_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ld, int8_t *q, int64_t ldq,
                     int32_t transposed, float *scale, float *work, const uint32_t *seed) {
    /* the operand's lines are x's columns: element (i, j) of x is (j, i) of it, index j * m + i */
    const int vec_sr = (uint64_t)m * (uint64_t)k < (1ull << 32);
    /* pass 1: column amaxes, each thread its own range of columns */
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < k; j0 += 256) {
        const int64_t j1 = j0 + 256 < k ? j0 + 256 : k;
        uint16_t mx[256];
        memset(mx, 0, sizeof mx);
        for (int64_t i = 0; i < m; i++) {
            const uint16_t *r = x + i * ld;
            int64_t j = j0;
#ifdef FB_V512
            const __m512i mask = _mm512_set1_epi16(0x7fff);
            for (; j + 32 <= j1; j += 32) {
                __m512i cur = _mm512_loadu_si512(mx + (j - j0));
                cur = _mm512_max_epu16(cur, _mm512_and_si512(_mm512_loadu_si512(r + j), mask));
                _mm512_storeu_si512(mx + (j - j0), cur);
            }
#endif
            for (; j < j1; j++) {
                const uint16_t b = r[j] & 0x7fffu;
                mx[j - j0] = b > mx[j - j0] ? b : mx[j - j0];
            }
        }
        for (int64_t j = j0; j < j1; j++)
            scale_of(mx[j - j0], scale + j, work + j);
    }
    if (!transposed) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            const uint16_t *r = x + i * ld;
            int8_t *o = q + i * ldq;
            int64_t j = 0;
#ifdef FB_V512
            if (!seed) {
                for (; j + 16 <= k; j += 16)
                    _mm_storeu_si128((__m128i *)(o + j), q8x16(r + j, _mm512_loadu_ps(work + j)));
            } else if (vec_sr) {
                for (; j + 16 <= k; j += 16)
                    _mm_storeu_si128((__m128i *)(o + j), q8x16_sr(r + j, _mm512_loadu_ps(work + j), seed,
                                                                  (uint32_t)(j * m + i), (uint32_t)m));
            }
#endif
            for (; j < k; j++)
                o[j] = q8_any(bf16_to_f32(r[j]) * work[j], seed, (uint64_t)(j * m + i));
        }
        return;
    }
    /* transposed: blocks of 16 rows x 16 columns through a 16 x 16 byte transpose in registers */
#ifdef FB_V512
    if (m % 64 == 0 && k % 16 == 0 && (!seed || vec_sr)) {
        /* 64 rows at a time, so that each column's codes go out as a whole 64-byte line */
        const int *perm = transpose_order();
#pragma omp parallel for schedule(static)
        for (int64_t i0 = 0; i0 < m; i0 += 64) {
            int8_t buf[16][64] __attribute__((aligned(64)));
            for (int64_t j0 = 0; j0 < k; j0 += 16) {
                const __m512 vr = _mm512_loadu_ps(work + j0);
                for (int sub = 0; sub < 4; sub++) {
                    __m128i r[16];
                    for (int t = 0; t < 16; t++) {
                        const int64_t i = i0 + 16 * sub + t;
                        r[t] = seed ? q8x16_sr(x + i * ld + j0, vr, seed, (uint32_t)(j0 * m + i), (uint32_t)m)
                                    : q8x16(x + i * ld + j0, vr);
                    }
                    transpose16(r);
                    for (int t = 0; t < 16; t++)
                        _mm_store_si128((__m128i *)(buf[perm[t]] + 16 * sub), r[t]);
                }
                for (int c = 0; c < 16; c++)
                    _mm512_storeu_si512(q + (j0 + c) * ldq + i0, _mm512_load_si512(buf[c]));
            }
        }
        return;
    }
#endif
    const int64_t iblocks = (m + 63) / 64;
#pragma omp parallel for schedule(static)
    for (int64_t ib = 0; ib < iblocks; ib++) {
        const int64_t i0 = ib * 64, i1 = i0 + 64 < m ? i0 + 64 : m;
        int8_t buf[16][64];
        for (int64_t j0 = 0; j0 < k; j0 += 16) {
            const int64_t w = k - j0 < 16 ? k - j0 : 16;
            for (int64_t i = i0; i < i1; i++) {
                const uint16_t *r = x + i * ld + j0;
                int8_t v[16];
#ifdef FB_V512
                if (w == 16 && !seed) {
                    _mm_storeu_si128((__m128i *)v, q8x16(r, _mm512_loadu_ps(work + j0)));
                } else
#endif
                {
                    for (int64_t c = 0; c < w; c++)
                        v[c] = q8_any(bf16_to_f32(r[c]) * work[j0 + c], seed, (uint64_t)((j0 + c) * m + i));
                }
                for (int64_t c = 0; c < w; c++)
                    buf[c][i - i0] = v[c];
            }
            for (int64_t c = 0; c < w; c++)
                memcpy(q + (j0 + c) * ldq + i0, buf[c], (size_t)(i1 - i0));
        }
    }
}

/* fb_amx_pack_b's panels from B^T: bt [k, n] row-major (row stride ldbt), i.e. B[c][kk] = bt[kk][c] */
void fb_amx_pack_bt(const int8_t *bt, int64_t k, int64_t n, int64_t ldbt, int8_t *out) {
    const int64_t kb_n = (k + 63) / 64, nb_n = ((n + 31) / 32) * 2;
    /* reduction blocks outside: each 64 rows of bt are read once, line by line */
#pragma omp parallel for schedule(static)
    for (int64_t kb = 0; kb < kb_n; kb++) {
        for (int64_t nb = 0; nb < nb_n; nb++) {
            int8_t *panel = out + (nb * kb_n + kb) * 1024;
#ifdef FB_V512
            if (nb * 16 + 16 <= n && kb * 64 + 64 <= k) {
                for (int r = 0; r < 16; r++) {
                    const int8_t *s = bt + (kb * 64 + 4 * r) * ldbt + nb * 16;
                    const __m128i s0 = _mm_loadu_si128((const __m128i *)s);
                    const __m128i s1 = _mm_loadu_si128((const __m128i *)(s + ldbt));
                    const __m128i s2 = _mm_loadu_si128((const __m128i *)(s + 2 * ldbt));
                    const __m128i s3 = _mm_loadu_si128((const __m128i *)(s + 3 * ldbt));
                    const __m128i t0 = _mm_unpacklo_epi8(s0, s1), t1 = _mm_unpackhi_epi8(s0, s1);
                    const __m128i t2 = _mm_unpacklo_epi8(s2, s3), t3 = _mm_unpackhi_epi8(s2, s3);
                    int8_t *o = panel + r * 64;
                    _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi16(t0, t2));
                    _mm_storeu_si128((__m128i *)(o + 16), _mm_unpackhi_epi16(t0, t2));
                    _mm_storeu_si128((__m128i *)(o + 32), _mm_unpacklo_epi16(t1, t3));
                    _mm_storeu_si128((__m128i *)(o + 48), _mm_unpackhi_epi16(t1, t3));
                }
                continue;
            }
#endif
            pack_panel(bt, 1, ldbt, n, k, nb, kb, panel);
        }
    }
}
