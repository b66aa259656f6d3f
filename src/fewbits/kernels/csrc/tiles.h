/* AMX tiles (and their stand-in without AMX) for fewbits' C kernels. First, the tile state every
 * tile kernel needs (int8mm.c's int8 GEMM too): Linux's grant of the tile registers
 * (tiles_permitted) and the configuration of eight 16 x 64-byte tiles (tiles_begin / tiles_end):
 * FB_TILE_STATE where the compiler targets AMX on Linux. Then, FB_TILES where it targets
 * AVX512-BF16:
 *
 * the bfloat16 multiply that fewbits' weight-only batches share: y [M, N] float32 =
 * x [M, K] bfloat16 @ Wb.T, where Wb is the weight decoded to bfloat16 by its own kernel (lut4.c,
 * int8w.c) 32 rows at a time into a small buffer that stays in the core's caches and is
 * multiplied at once, so that no decoded weight ever goes to memory (the GEMM on decoded blocks
 * writes each block out and reads it back). On AMX tiles where the build has AMX-BF16 and Linux
 * grants the tiles (tiles_block), else with AVX512-BF16 dot products in zmm registers (dp_block).
 *
 * The arithmetic: every product of two bfloat16 numbers is exact in float32, and the products
 * are summed in float32 by TDPBF16PS or VDPBF16PS (round to nearest even, in pairs along k, in an
 * order of the hardware's own), which treat bfloat16 subnormal inputs as zero and flush subnormal
 * results to zero -- as oneDNN's bfloat16 GEMM does on these CPUs, which runs the same
 * instructions. The sums stay float32 (the bfloat16 GEMM's output would round them to bfloat16).
 *
 * Tile operands: A = 16 rows of the decoded weight (32 k each, its natural row-major layout), B =
 * x as pairs of k (row r of a B tile: the 16 rows of x's (k = 2r, 2r + 1) pairs), C [16 weight
 * rows][16 rows of x]; C is stored transposed into y. Eight tiles: two A (32 weight rows), two B
 * (32 rows of x), four C. dp_block reads the same x pairs and weight rows.
 *
 * The tile state is built only where the compiler targets AMX (-march=native on a CPU with it) on
 * Linux, whose kernel grants a process the tiles' register state on request (arch_prctl); a
 * kernel asks tiles_kind() (tiles_permitted()) before it takes the tiles. Include before any
 * system header (it needs syscall()). */
#ifndef FEWBITS_TILES_H
#define FEWBITS_TILES_H
#if defined(__AMX_TILE__) && defined(__linux__)
#define FB_TILE_STATE 1
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include "threads.h"
long syscall(long number, ...); /* <unistd.h> declares it only outside strict C99 */

/* whether this process may use the tile registers (asked of Linux once; call outside parallel
 * regions: the grant is for the whole process, its threads included) */
static inline int tiles_permitted(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
/* each thread before its first tile instruction: eight tiles of 16 rows of 64 bytes */
static inline void tiles_begin(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
/* each thread after its last: the tiles back to their initial state (oneDNN configures its own) */
static inline void tiles_end(void) { _tile_release(); }
#endif

/* FB_TILES where the compiler targets AVX512-BF16 (and -BW): the fused weight-only batch
 * multiply below, on AMX tiles where the build has them and Linux grants them (FB_AMX_TILES,
 * tiles_block), else with AVX512-BF16 dot products (dp_block: AMD Zen 4, Intel Cooper Lake),
 * the same arithmetic in zmm registers. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define FB_TILES 1
#if defined(FB_TILE_STATE) && defined(__AMX_BF16__)
#define FB_AMX_TILES 1
#endif
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#define TILE_ROWS 32 /* weight rows per block: two A tiles */

/* how the fused batch multiply runs here: 2 on AMX tiles, 1 with AVX512-BF16 dot products (call
 * outside parallel regions) */
static inline int tiles_kind(void) {
#if defined(FB_AMX_TILES)
    if (tiles_permitted()) return 2;
#endif
    return 1;
}

/* The B operand: xp [kp / 2][Mp] pairs, xp[r][m] = (x[m, 2r], x[m, 2r + 1]) for x [M, kx] (row
 * stride ldx elements) as bfloat16, zero for m >= M and k >= kx; kp = kx rounded up to 32, Mp = M
 * rounded up to 16. x is bfloat16 bit patterns, or float32 (x_f32) rounded here by vcvtneps2bf16:
 * to nearest even, float32 subnormals to zero (the bfloat16 subnormals x.to(torch.bfloat16) would
 * give read as zero in TDPBF16PS anyway; only a float32 subnormal that rounds up to the least
 * normal bfloat16, 2^-126, counts as zero where it would not), a NaN stays some NaN. Pairs
 * r0 .. r1 (the threads share them out): 16 rows of x at a time, each pair of theirs one gather
 * (two of float32) -- or, where 15 row strides pass a gather's 32-bit byte offsets, 16 loads. */
static inline void tiles_pack_x(const void *x, int x_f32, int64_t ldx, int64_t M, int64_t kx, int64_t Mp, uint32_t *xp,
                         int64_t r0, int64_t r1) {
    const int64_t full = kx / 2; /* pairs with both columns inside x */
    const int64_t esize = x_f32 ? 4 : 2;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int wide = esize * ldx > 0x7FFFFFFF / 15; /* offsets past int32: no gathers */
    const __m512i at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(wide ? 0 : (int)(esize * ldx))); /* bytes from row m0 */
    for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
        const int64_t mv = M - m0 < 16 ? (M - m0 > 0 ? M - m0 : 0) : 16;
        const __mmask16 rows = (__mmask16)((1u << mv) - 1);
        const char *xm = (const char *)x + esize * m0 * ldx;
        for (int64_t r = r0; r < r1; r++) {
            __m512i v = _mm512_setzero_si512();
            if (2 * r < kx && wide) {
                uint32_t t[16] = {0};
                float lo[16] = {0}, hi[16] = {0};
                for (int64_t m = 0; m < mv; m++) {
                    const char *p = xm + esize * (m * ldx + 2 * r);
                    if (!x_f32) {
                        t[m] = ((const uint16_t *)p)[0] | (r < full ? (uint32_t)((const uint16_t *)p)[1] << 16 : 0u);
                    } else {
                        lo[m] = ((const float *)p)[0];
                        hi[m] = r < full ? ((const float *)p)[1] : 0.0f;
                    }
                }
                if (!x_f32) {
                    v = _mm512_loadu_si512((const void *)t);
                } else {
                    const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(lo)));
                    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(hi)));
                    v = _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
                }
            } else if (2 * r < kx) {
                const char *p = xm + esize * 2 * r;
                if (!x_f32 && r < full) {
                    v = _mm512_mask_i32gather_epi32(v, rows, at, (const void *)p, 1);
                } else if (!x_f32) { /* the last column of an odd kx: its pair's second half zero */
                    uint32_t t[16] = {0};
                    for (int64_t m = 0; m < mv; m++) t[m] = ((const uint16_t *)p)[m * ldx];
                    v = _mm512_loadu_si512((const void *)t);
                } else {
                    const __m512 lo = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, at, (const void *)p, 1);
                    const __m512 hi = r < full ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, at, (const void *)(p + 4), 1)
                                               : _mm512_setzero_ps();
                    const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
                    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
                    v = _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
                }
            }
            _mm512_storeu_si512((void *)(xp + r * Mp + m0), v);
        }
    }
}

/* c [16 weight rows][16 rows of x] (one block's sums) into y[m, i0 + i] (row stride ldy) for
 * m = mb .. mb + 16 (< M) and i < nv - i0 (<= 16), times scale[i0 + i] where scale is not NULL */
static inline void store_block(const float *c, int64_t i0, int64_t nv, int64_t mb, int64_t M, float *y, int64_t ldy,
                               const float *scale) {
    const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
    const __mmask16 keep = nv - i0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nv - i0)) - 1);
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(keep, scale + i0) : _mm512_set1_ps(1.0f);
    for (int64_t j = 0; j < 16 && mb + j < M; j++) {
        __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)j)), c, 4);
        if (scale) v = _mm512_mul_ps(v, sv);
        _mm512_mask_storeu_ps(y + (mb + j) * ldy + i0, keep, v);
    }
}

/* weight rows i0 .. i0 + WR of the block against the rows of x in XV vectors of 16 from m0: the
 * sums into c[(i - i0) * 16 + j] per vector (WR, XV constants where inlined: the sums stay in
 * registers) */
static inline __attribute__((always_inline)) void dp_rows(int WR, int XV, const uint32_t *wr, int64_t lw,
                                                          int64_t pairs, const uint32_t *xp, int64_t Mp, int64_t m0,
                                                          float c[2][256], int64_t i0) {
    __m512 acc[2][16];
    for (int v = 0; v < XV; v++)
        for (int i = 0; i < WR; i++) acc[v][i] = _mm512_setzero_ps();
    for (int64_t r = 0; r < pairs; r++) {
        __m512bh xv[2];
        for (int v = 0; v < XV; v++) xv[v] = (__m512bh)_mm512_loadu_si512((const void *)(xp + r * Mp + m0 + 16 * v));
        for (int i = 0; i < WR; i++) { /* weight row i's pair r, in every lane */
            const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)wr[i * lw + r]);
            for (int v = 0; v < XV; v++) acc[v][i] = _mm512_dpbf16_ps(acc[v][i], wv, xv[v]);
        }
    }
    for (int v = 0; v < XV; v++)
        for (int i = 0; i < WR; i++) _mm512_store_ps(c[v] + 16 * (i0 + i), acc[v][i]);
}
/* tiles_block's product with AVX512-BF16 dot products, for CPUs without AMX: 16 weight rows by 16
 * rows of x at a time (8 by 32 where 32 rows of x remain), each output's sum in a lane of its
 * own, to which VDPBF16PS adds the two exact products of each k pair in turn (float32, round to
 * nearest even, bfloat16 subnormal inputs read as zero and subnormal results flushed to zero, as
 * TDPBF16PS and oneDNN's bfloat16 GEMM on these CPUs), so each output is summed in k order by
 * one instruction stream. */
static inline void dp_block(const uint16_t *w, int64_t ldw, int64_t ksteps, const uint32_t *xp, int64_t Mp, int64_t M,
                            float *y, int64_t ldy, int64_t nv, const float *scale) {
    float c[2][256] __attribute__((aligned(64))); /* per 16 rows of x: [weight row][row of x] */
    const int64_t pairs = 16 * ksteps, lw = ldw / 2;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int two = M - m0 > 16;
        for (int64_t i0 = 0; i0 < nv; i0 += 16) {
            const uint32_t *wr = (const uint32_t *)(w + i0 * ldw);
            if (two) {
                dp_rows(8, 2, wr, lw, pairs, xp, Mp, m0, c, 0);
                dp_rows(8, 2, wr + 8 * lw, lw, pairs, xp, Mp, m0, c, 8);
            } else {
                dp_rows(16, 1, wr, lw, pairs, xp, Mp, m0, c, 0);
            }
            store_block(c[0], i0, nv, m0, M, y, ldy, scale);
            if (two) store_block(c[1], i0, nv, m0 + 16, M, y, ldy, scale);
        }
    }
}

#if defined(FB_AMX_TILES)
/* y[m, i] (row stride ldy) = sum over k < 32 ksteps of w[i, k] * x[m, k], for i < nv <= 32 and
 * m < M, times scale[i] where scale is not NULL (one float32 product): w the block's bfloat16
 * rows (row stride ldw >= 32 ksteps elements, TILE_ROWS rows, those from nv on zero), xp as
 * tiles_pack_x made it. Between tiles_begin() and tiles_end(). */
static inline void tiles_block(const uint16_t *w, int64_t ldw, int64_t ksteps, const uint32_t *xp, int64_t Mp, int64_t M,
                        float *y, int64_t ldy, int64_t nv, const float *scale) {
    float c[4][256] __attribute__((aligned(64))); /* C tiles: [weight row][row of x] */
    const int64_t wb = ldw * 2, xb = Mp * 4;
    const uint16_t *w1 = w + 16 * ldw;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const uint32_t *b = xp + m0;
        const int two = M - m0 > 16; /* a second B tile: rows m0 + 16 .. m0 + 31 of x */
        _tile_zero(4);
        _tile_zero(6);
        if (two) {
            _tile_zero(5);
            _tile_zero(7);
            for (int64_t s = 0; s < ksteps; s++) {
                _tile_loadd(0, w + 32 * s, wb);
                _tile_loadd(1, w1 + 32 * s, wb);
                _tile_loadd(2, b + 16 * s * Mp, xb);
                _tile_loadd(3, b + 16 * s * Mp + 16, xb);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
            _tile_stored(5, c[1], 64);
            _tile_stored(7, c[3], 64);
        } else {
            for (int64_t s = 0; s < ksteps; s++) {
                _tile_loadd(0, w + 32 * s, wb);
                _tile_loadd(1, w1 + 32 * s, wb);
                _tile_loadd(2, b + 16 * s * Mp, xb);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(6, 1, 2);
            }
        }
        _tile_stored(4, c[0], 64);
        _tile_stored(6, c[2], 64);
        /* C tile t holds weight rows 16 (t >> 1) .., rows of x m0 + 16 (t & 1) ..: each row of x's
         * 16 outputs are a column of it, gathered and stored into y */
        for (int t = 0; t < 4; t += two ? 1 : 2) {
            const int64_t i0 = 16 * (t >> 1), mb = m0 + 16 * (t & 1);
            if (i0 < nv) store_block(c[t], i0, nv, mb, M, y, ldy, scale);
        }
    }
}
#endif

/* One weight's rows as bfloat16 for tiles_matmul: rows n0 .. n0 + nv (nv <= TILE_ROWS) of W into
 * wb (row stride ldw), each row's columns from kx up to kp zero (they meet x's zeros: a NaN
 * there must not reach the sums); `thread` picks the caller's scratch. */
typedef void (*TileDecode)(const void *ctx, int64_t n0, int64_t nv, int64_t kx, int64_t kp, uint16_t *wb,
                           int64_t ldw, int thread);

/* y [M, N] float32 = x [M, kx] (bfloat16 bit patterns, or float32 where x_f32; row stride ldx)
 * @ W.T, W decoded by decode(ctx, ...) TILE_ROWS rows at a time into each thread's buffer (row
 * stride ldw >= kx rounded up to 32, even), each block multiplied there at once (tiles_block on
 * the tiles where tiles_kind() is 2, else dp_block) and its outputs times scale[n] where scale is
 * not NULL. x is laid out first (tiles_pack_x), its pairs shared out over the threads; then blocks
 * of rows over torch's OpenMP threads, each output summed by one thread in one order whatever
 * their number. M, N, kx > 0. Returns 0, or -2 when its buffers cannot be allocated. */
static inline int32_t tiles_matmul(const void *x, int x_f32, int64_t ldx, int64_t kx, int64_t M, int64_t N,
                                   int64_t ldw, TileDecode decode, const void *ctx, const float *scale, float *y) {
    const int64_t ksteps = (kx + 31) / 32, kp = 32 * ksteps, Mp = (M + 15) / 16 * 16;
    /* rows of the buffer 64 bytes more apart than a multiple of 1 KiB: dp_block reads 16 rows at
     * once, which at 8 KiB apart (4096 columns) fell into one set of the L1 cache (2.4x slower) */
    ldw = ldw % 512 == 0 ? ldw + 32 : ldw;
    const int64_t threads = MAX_THREADS, nblocks = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int amx = tiles_kind() == 2;
    (void)amx; /* read only where the build has AMX */
    uint32_t *xp = malloc(sizeof(uint32_t) * (size_t)(kp / 2 * Mp));
    uint16_t *wbuf = malloc(sizeof(uint16_t) * (size_t)(threads * TILE_ROWS * ldw));
    if (!xp || !wbuf) {
        free(xp);
        free(wbuf);
        return -2;
    }
#pragma omp parallel if (nblocks > 1)
    {
        {
            const int64_t pairs = kp / 2, nt = TEAM_THREADS, t = THREAD_ID;
            tiles_pack_x(x, x_f32, ldx, M, kx, Mp, xp, pairs * t / nt, pairs * (t + 1) / nt);
        }
#pragma omp barrier
#if defined(FB_AMX_TILES)
        if (amx) tiles_begin();
#endif
        const int thread = THREAD_ID;
        uint16_t *wb = wbuf + (int64_t)thread * TILE_ROWS * ldw;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * TILE_ROWS, nv = N - n0 < TILE_ROWS ? N - n0 : TILE_ROWS;
            decode(ctx, n0, nv, kx, kp, wb, ldw, thread);
            for (int64_t i = nv; i < TILE_ROWS; i++) memset(wb + i * ldw, 0, sizeof(uint16_t) * (size_t)kp);
#if defined(FB_AMX_TILES)
            if (amx) {
                tiles_block(wb, ldw, ksteps, xp, Mp, M, y + n0, N, nv, scale ? scale + n0 : NULL);
                continue;
            }
#endif
            dp_block(wb, ldw, ksteps, xp, Mp, M, y + n0, N, nv, scale ? scale + n0 : NULL);
        }
#if defined(FB_AMX_TILES)
        if (amx) tiles_end();
#endif
    }
    free(xp);
    free(wbuf);
    return 0;
}
#endif
#endif
