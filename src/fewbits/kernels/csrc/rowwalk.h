/* The order in which a thread of a parallel region walks its share of a weight's rows, for the
 * matrix-vector products of decoding (one or a few rows of x against every row of W, whose codes
 * come from memory at each call).
 *
 * A thread's rows [lo, hi) = [N t / T, N (t + 1) / T) (a contiguous share, as schedule(static)
 * gives) are cut into ROW_STREAMS runs of consecutive rows, and the thread takes a row from each
 * run in turn: rows lo, lo + q, lo + 2q, lo + 3q, lo + 1, lo + q + 1, ... (q = the run's rows).
 * So ROW_STREAMS streams of codes are read at once, a row at a time, far apart in memory. One core's hardware prefetchers follow
 * each stream within its 4 KiB page; with one stream at a time one core took the codes from
 * memory at ~7-8 GB/s (Xeon, 34 MB of int4 codes), below a plain read of them (~10 GB/s).
 * benchmarks/bench_row_streams.py, weights from memory, Xeon: four streams 1.07-1.20x one stream
 * on 4 x 4096^2 (int4, nf4, w4a8, int8; 1 and 2 threads), eight 1.02-1.14x.
 * Each row's own arithmetic is unchanged: the results are the same bits in any order.
 *
 * Software prefetch within a stream: ROW_PREFETCH_WEIGHTS weights ahead of the one being read (1
 * KiB of 4-bit codes, 2 KiB of int8: the same time ahead for kernels that take about the same
 * time per weight; int8 codes 1 KiB ahead were 10% slower from the caches), never past the
 * stream's last row (its next bytes are another stream's, already on their way). */
#ifndef FEWBITS_ROWWALK_H
#define FEWBITS_ROWWALK_H
#include <stdint.h>

#ifndef ROW_STREAMS /* (both may be set with -D, to measure others) */
#define ROW_STREAMS 4
#endif
#ifndef ROW_PREFETCH_WEIGHTS
#define ROW_PREFETCH_WEIGHTS 2048
#endif
#define ROW_PREFETCH_BYTES(bits) ((int64_t)ROW_PREFETCH_WEIGHTS * (bits) / 8)

typedef struct {
    int64_t start[ROW_STREAMS], end[ROW_STREAMS]; /* stream s: rows [start[s], end[s]) */
    int64_t visits;                               /* ROW_STREAMS x the longest stream's rows */
} RowWalk;

/* thread t of T's walk over rows [0, N) */
static inline RowWalk row_walk(int64_t N, int64_t t, int64_t T) {
    RowWalk w;
    const int64_t lo = N * t / T, count = N * (t + 1) / T - lo;
    for (int s = 0; s < ROW_STREAMS; s++) {
        w.start[s] = lo + count * s / ROW_STREAMS;
        w.end[s] = lo + count * (s + 1) / ROW_STREAMS;
    }
    w.visits = ROW_STREAMS * ((count + ROW_STREAMS - 1) / ROW_STREAMS);
    return w;
}
/* the row of visit i (0 <= i < visits), or -1 where that visit's stream has ended */
static inline int64_t row_walk_row(const RowWalk *w, int64_t i) {
    const int64_t n = w->start[i % ROW_STREAMS] + i / ROW_STREAMS;
    return n < w->end[i % ROW_STREAMS] ? n : -1;
}
/* the end (one past the last row) of visit i's stream */
static inline int64_t row_walk_end(const RowWalk *w, int64_t i) { return w->end[i % ROW_STREAMS]; }
/* How far ahead of row n's bytes, with rows of row_bytes, a stream ending at row `end` is
 * prefetched: `bytes` (ROW_PREFETCH_BYTES(bits a weight)), or 0 (nothing ahead) where that would
 * pass the stream's end */
static inline int64_t row_walk_ahead(int64_t n, int64_t end, int64_t row_bytes, int64_t bytes) {
    return (n + 1) * row_bytes + bytes <= end * row_bytes ? bytes : 0;
}
#endif
