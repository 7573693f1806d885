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

struct ahead_queue {
    struct ahead_rows_left rows[AHEAD_STREAMS];
    int first, count;
    long pending; /* lines queued and not yet asked for */
    int steps;    /* GEMM steps left to spread them over */
};
static _Thread_local struct ahead_queue thread_queue;

/* Asks for up to n lines queued in q. */
static inline void ahead_some(struct ahead_queue *q, long n) {
    while (n > 0 && q->first < q->count) {
        struct ahead_rows_left *r = &q->rows[q->first];
        __builtin_prefetch(r->line + 64L * r->done, 0, 2);
        n--;
        q->pending--;
        if (++r->done == r->lines) {
            r->done = 0;
            r->line += r->stride;
            if (--r->rows == 0) q->first++;
        }
    }
    if (q->first == q->count) q->first = q->count = 0;
}

/* The calling thread's queue. A shared library reaches its thread-local data through a call to __tls_get_addr,
 * and GCC, short of registers in the GEMM tiles, made that call again at every use rather than keep the address
 * (28 calls in one GEMM, 54 in the query block; 1.7-2.2% of the elu forward's samples). The empty asm hides
 * where the address came from, so it is kept, or spilled and reloaded, like any other pointer. */
static inline struct ahead_queue *ahead_own(void) {
    struct ahead_queue *q = &thread_queue;
    __asm__("" : "+r"(q));
    return q;
}

/* Asks for an even share of what is queued over the steps still to come: called by the GEMMs after each group of
 * 6 rows (gemm_rows), the steps a loader announced (ahead_start). */
static inline void ahead_step(struct ahead_queue *q) {
    if (q->pending <= 0) return;
    const int steps = q->steps > 1 ? q->steps-- : 1;
    ahead_some(q, (q->pending + steps - 1) / steps);
}

/* Starts the calling thread's queue afresh and returns it, for rows to be asked for over the next `steps` 6-row
 * groups of GEMM (lines still queued were for the rows the loader is about to read: they are dropped). */
static inline struct ahead_queue *ahead_start(int steps) {
    struct ahead_queue *q = ahead_own();
    q->first = q->count = 0;
    q->pending = 0;
    q->steps = steps;
    return q;
}

/* Queues in q (ahead_start's) rows [j, z) of `floats` floats each, `stride` floats apart from base: rows a loader
 * will read next, wherever they lie. */
static inline void queue_rows(struct ahead_queue *q, const float *base, long j, long z, long stride, int floats) {
    if (j >= z || floats <= 0 || q->count == AHEAD_STREAMS) return;
    const uintptr_t start = (uintptr_t)(base + j * stride);
    const struct ahead_rows_left r = {(const char *)(start & ~(uintptr_t)63), stride * (long)sizeof(float),
                                      (int)(((start & 63) + sizeof(float) * (unsigned)floats + 63) / 64), 0, z - j};
    q->rows[q->count++] = r;
    q->pending += (long)r.lines * r.rows;
}

/* queue_rows for rows read right after the loader's own, in order: rows with less than a line between them are
 * left to the hardware's stream prefetchers, which follow memory read in order, and asking again only held fill
 * buffers (the contiguous elu forward ran 1.07x faster without, where a module's rows 6 KiB apart ran 1.09x
 * slower, its causal forward 1.29x). Rows read out of order (the causal backward's reverse pass) take queue_rows. */
static inline void ahead_rows(struct ahead_queue *q, const float *base, long j, long z, long stride, int floats) {
    if ((stride - floats) * (long)sizeof(float) < 64) return;
    queue_rows(q, base, j, z, stride, floats);
}

/* ahead_rows for rows read in order after the loader's own, else queue_rows. */
typedef void (*row_queuer)(struct ahead_queue *q, const float *base, long j, long z, long stride, int floats);
static inline row_queuer rows_queuer(int in_order) { return in_order ? ahead_rows : queue_rows; }

#endif
