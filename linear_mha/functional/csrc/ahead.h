/* Memory asked for ahead of its use, spread over the arithmetic that comes before it.
 *
 * The kernels load a block of rows (the row loaders), then spend thousands of cycles of GEMM on it. Asking for
 * the next block's lines all at once, as the loaders did, stalls the core: each line in flight holds one of its
 * ~16 fill buffers for a memory latency (~200 ns on the 2-core Xeon this was measured on), so a burst of hundreds
 * of prefetches waits for itself while the GEMM that follows leaves memory idle. Instead a loader queues the next
 * block's rows (ahead_rows) and the GEMM asks for a few lines between its tiles (ahead_some, gemm_shaped): the
 * non-causal elu forward at 16k went from 15.1 to 14.0 ms with this alone, and to 11.5 ms together with streaming
 * stores of its output (store_stream), which leave the fill buffers to the reads.
 *
 * The queue is the calling thread's own and first in, first out; rows queued beyond its 8 streams are not asked for,
 * and the kernels' task loops empty it as they end. */
#ifndef LINEAR_MHA_AHEAD_H
#define LINEAR_MHA_AHEAD_H
#include <stdint.h>

#define AHEAD_STREAMS 8

struct ahead_rows_left {
    const char *line; /* the next line asked for */
    long stride;      /* bytes from a row to the next */
    int lines, done;  /* lines per row; those of the current row already asked for */
    long rows;        /* rows left, the current one included */
};

static _Thread_local struct {
    struct ahead_rows_left rows[AHEAD_STREAMS];
    int first, count;
    long pending; /* lines queued and not yet asked for */
    int steps;    /* GEMM steps left to spread them over */
} ahead_queue;

/* Asks for up to n queued lines. */
static inline void ahead_some(long n) {
    while (n > 0 && ahead_queue.first < ahead_queue.count) {
        struct ahead_rows_left *r = &ahead_queue.rows[ahead_queue.first];
        __builtin_prefetch(r->line + 64L * r->done, 0, 2);
        n--;
        ahead_queue.pending--;
        if (++r->done == r->lines) {
            r->done = 0;
            r->line += r->stride;
            if (--r->rows == 0) ahead_queue.first++;
        }
    }
    if (ahead_queue.first == ahead_queue.count) ahead_queue.first = ahead_queue.count = 0;
}

/* Asks for an even share of what is queued over the steps still to come: called by the GEMMs after each group of
 * 6 rows (gemm_rows), the steps a loader announced (ahead_start). */
static inline void ahead_step(void) {
    if (ahead_queue.pending <= 0) return;
    const int steps = ahead_queue.steps > 1 ? ahead_queue.steps-- : 1;
    ahead_some((ahead_queue.pending + steps - 1) / steps);
}

/* Starts a loader's queue afresh, for rows to be asked for over the next `steps` 6-row groups of GEMM (lines still
 * queued were for the rows the loader is about to read: they are dropped). */
static inline void ahead_start(int steps) {
    ahead_queue.first = ahead_queue.count = 0;
    ahead_queue.pending = 0;
    ahead_queue.steps = steps;
}

/* Queues rows [j, z) of `floats` floats each, `stride` floats apart from base: rows a loader will read next. */
static inline void ahead_rows(const float *base, long j, long z, long stride, int floats) {
    if (j >= z || floats <= 0 || ahead_queue.count == AHEAD_STREAMS) return;
    const uintptr_t start = (uintptr_t)(base + j * stride);
    const struct ahead_rows_left r = {(const char *)(start & ~(uintptr_t)63), stride * (long)sizeof(float),
                                      (int)(((start & 63) + sizeof(float) * (unsigned)floats + 63) / 64), 0, z - j};
    ahead_queue.rows[ahead_queue.count++] = r;
    ahead_queue.pending += (long)r.lines * r.rows;
}

#endif
