/* The CPU kernels' work split over threads (OpenMP): per-head sums of row products over parts of a sequence,
 * blocks of rows, and tasks that walk a stretch of a sequence in order. Plain C; the arithmetic is simd.h's. */
#ifndef LINEAR_MHA_TASKS_H
#define LINEAR_MHA_TASKS_H
#ifdef _OPENMP
#include <omp.h>
#endif
#include "simd.h"

static inline int thread_slot(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int threads_for(int requested) { return requested > 0 ? requested : 1; }

/* Tasks for work split into rows of equal cost (the row maps): a few per thread, as threads may not be equal; at
 * most one per row. Task t of tasks handles rows [*a, *z). */
static inline int row_tasks(long rows, int threads) {
    const long tasks = 4L * threads_for(threads);
    return (int)(tasks < rows ? tasks : rows > 0 ? rows : 1);
}

static inline void task_range(long rows, int tasks, int t, long *a, long *z) {
    *a = rows * t / tasks;
    *z = rows * (t + 1) / tasks;
}

/* Fills a (rows x d) and b (rows x width) with the rows of head g from position j onwards (at most ROWS,
 * stopping before z); returns how many rows it wrote and sets *next to the first position not consumed.
 * scratch holds ROWS x (d + width) floats of thread-local space. */
typedef int (*row_source)(const void *ctx, int g, long j, long z, long *next, float *a, float *b, float *scratch);

/* How many parts to cut each head's n rows into so that bh * parts tasks make at least `tasks` of them; a part
 * of fewer than min_rows rows is not worth a task. */
static inline long parts_for(int bh, long n, int tasks, long min_rows) {
    long parts = bh >= tasks ? 1 : (tasks + bh - 1) / bh;
    if (parts > n / min_rows) parts = n / min_rows;
    return parts < 1 ? 1 : parts;
}

/* Item (group, part p) of partial_states: the part's rows of the group's turn heads, g = group turn .. group turn +
 * turn - 1, from source, each head's summed into its d x width slot; a block of positions is taken over every head
 * of the group in turn (heads_in_turn), and each slot sums its rows in order whatever the turn. */
static inline void sum_part(long item, long n, long parts, int turn, int d, int width, int cols, int split,
                            row_source source, const void *ctx, float *a, float *b, float *scratch, float *partial) {
    const long group = item / parts, part = item % parts, z = n * (part + 1) / parts;
    for (long j = n * part / parts; j < z;) {
        long next = z;
        for (int t = 0; t < turn; t++) {
            const int g = (int)(group * turn + t);
            float *state = partial + ((long)g * parts + part) * d * width;
            const int rows = source(ctx, g, j, z, &next, a, b, scratch); /* heads share their mask: the same next */
            if (split) {
                gemm_cols(FULL, split, cols - 1, rows, a, 1, d, b, width, state, width);
                column_product(FULL, d - split, rows, a + split, 1, d, b + cols - 1, width,
                               state + (long)split * width + cols - 1, width);
            } else {
                gemm_cols(FULL, d, cols, rows, a, 1, d, b, width, state, width); /* A = a^T */
            }
        }
        j = next;
    }
}

/* partial[g * parts + p] (d x width) = sum of a_row^T b_row over part p of head g's n rows (rows n p / parts up
 * to n (p + 1) / parts), for bh heads; width is a whole number of vectors, of which the first cols carry values
 * (the rest of b's rows are zero, and of the sums' rows are left zero). split > 0 (rope's [R phi, phi] rows):
 * only the sums rope keeps are made, rows < split over the cols - 1 value columns and the rest over the last
 * column alone, half the products; entries beside them may hold anything (split_state zeroes them). turn: heads
 * taken in turn over each block of positions (heads_in_turn; bh a multiple of it), 1 for a head at a time. fixed_order:
 * each thread takes the same items on every call, for a source that adds parameter gradients into per-thread sums
 * (the backward's queries); else a thread takes the next item free. */
static inline int partial_states(int bh, long n, long parts, int turn, int d, int width, int cols, int split,
                                 int threads, row_source source, const void *ctx, float *partial, int fixed_order) {
    const long size = (long)d * width;
    memset(partial, 0, sizeof(float) * bh * parts * size);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *a = malloc(sizeof(float) * ROWS * d), *b = calloc((size_t)ROWS * width, sizeof(float));
        float *scratch = malloc(sizeof(float) * ROWS * (d + width));
        if (!a || !b || !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            if (fixed_order) {
#pragma omp for schedule(static)
                for (long item = 0; item < bh / turn * parts; item++)
                    sum_part(item, n, parts, turn, d, width, cols, split, source, ctx, a, b, scratch, partial);
            } else {
#pragma omp for schedule(dynamic, 1)
                for (long item = 0; item < bh / turn * parts; item++)
                    sum_part(item, n, parts, turn, d, width, cols, split, source, ctx, a, b, scratch, partial);
            }
            stream_fence(); /* sources may write rows with streaming stores (the backward's d q) */
            ahead_start(0);  /* nothing queued outlives the call */
        }
        free(a);
        free(b);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* states[g] (d x width) = sum over the rows of head g of a_row^T b_row, for bh heads of n rows each. With fewer
 * than 8 items per thread a head's rows are split into parts summed afterwards: with a head per item, 8 heads
 * gave each of 2 threads 4 items, and a thread slowed down by the machine kept the other waiting up to an eighth
 * of the pass. turn as partial_states' (an item then holds turn heads); fixed_order as partial_states'. */
static inline int accumulate_states(int bh, long n, int turn, int d, int width, int cols, int split, int threads,
                                    row_source source, const void *ctx, float *states, int fixed_order) {
    const long parts = parts_for(bh / turn, n, 8 * threads, 256), size = (long)d * width;
    if (parts == 1)
        return partial_states(bh, n, 1, turn, d, width, cols, split, threads, source, ctx, states, fixed_order);
    float *partial = malloc(sizeof(float) * bh * parts * size);
    int failed = !partial || partial_states(bh, n, parts, turn, d, width, cols, split, threads, source, ctx, partial,
                                            fixed_order) != 0;
    if (!failed)
        for (int g = 0; g < bh; g++) {
            float *state = states + (long)g * size;
            memcpy(state, partial + (long)g * parts * size, sizeof(float) * size);
            for (long part = 1; part < parts; part++)
                for (long e = 0; e < size; e++) state[e] += partial[((long)g * parts + part) * size + e];
        }
    free(partial);
    return failed ? -1 : 0;
}

/* Turns each head's per-part sums (bh x parts matrices of d x width) into the running sum before each part, in
 * place: an exclusive scan from the first part (starting from init, (bh, d, dv + 1), or zero) or, with
 * reverse, from the last (starting from zero). */
static inline int scan_parts(float *sums, const float *init, int bh, long parts, int d, int dv, int width,
                             int reverse) {
    const long size = (long)d * width;
    float *running = malloc(sizeof(float) * size), *own = malloc(sizeof(float) * size);
    for (int g = 0; running && own && g < bh; g++) {
        memset(running, 0, sizeof(float) * size);
        if (init && !reverse)
            for (int f = 0; f < d; f++)
                memcpy(running + f * width, init + ((long)g * d + f) * (dv + 1), sizeof(float) * (dv + 1));
        for (long i = 0; i < parts; i++) {
            float *slot = sums + ((long)g * parts + (reverse ? parts - 1 - i : i)) * size;
            memcpy(own, slot, sizeof(float) * size);
            memcpy(slot, running, sizeof(float) * size);
            for (long e = 0; e < size; e++) running[e] += own[e];
        }
    }
    const int status = running && own ? 0 : -1;
    free(running);
    free(own);
    return status;
}

/* Calls block(ctx, g, i0, rows, scratch) for every block of up to ROWS positions i0.. of every one of bh heads of
 * n positions, the blocks spread over the threads; scratch is scratch_floats floats of thread-local space.
 * turn (heads_in_turn): 1 takes a head's blocks one after another; h (bh a multiple of it) takes each block of
 * positions over h heads in turn, for rows laid out as a module's, (B, N, H, d) seen as (B, H, N, d), where a
 * position's rows of every head lie together and a head's block alone reads 256 bytes in every 2-6 KiB.
 * fixed_order: each thread takes the same blocks on every call, for blocks that add parameter gradients into
 * per-thread sums; else a thread takes the next few blocks free, so a thread the machine slows down holds the
 * others up by a few blocks at most, not by half its share (static halves left 4-5% of the elu forward's samples
 * in libgomp's barrier on a shared 2-core VM). Returns -1 when that space could not be allocated. */
typedef void (*block_fn)(const void *ctx, int g, long i0, int rows, float *scratch);

#define BLOCKS_PER_GRAB 4 /* 192 rows: a grab is one atomic add on a shared counter */

/* How for_each_block, accumulate_states and the causal tasks (causal_turn) should walk h heads whose rows are
 * head_stride and position_stride floats apart: each block of positions over the heads in turn (h) where a
 * position's heads lie closer together than its positions (a module's layout), else a head at a time (1). */
static inline int heads_in_turn(int h, long head_stride, long position_stride) {
    return h > 1 && head_stride < position_stride ? h : 1;
}

/* How many heads a causal task should walk in turn, chunk by chunk (each carrying its own state): heads_in_turn's
 * answer cut down to a divisor of h that leaves every thread a task (groups of 4 of 8 heads on 2 threads ran
 * 1.03-1.06x faster than groups of 2, though a thread the machine slows down then holds the other up by more);
 * 1 where the sequences are cut into parts (parts > 1). */
static inline int causal_turn(int bh, int h, long parts, int threads, long head_stride, long position_stride) {
    if (parts > 1) return 1;
    for (int turn = heads_in_turn(h, head_stride, position_stride); turn > 1; turn--)
        if (h % turn == 0 && bh / turn >= threads) return turn;
    return 1;
}

/* Item `item` of for_each_block: head (item mod turn) of a group of turn heads, block of positions (item / turn mod
 * row_blocks), group (item / turn / row_blocks); with turn 1, block (item mod row_blocks) of head item / row_blocks. */
static inline void block_item(block_fn block, const void *ctx, long item, long row_blocks, int turn, long n,
                              float *scratch) {
    const long rest = item / turn, i0 = (rest % row_blocks) * ROWS;
    block(ctx, (int)(rest / row_blocks * turn + item % turn), i0, (int)(n - i0 < ROWS ? n - i0 : ROWS), scratch);
}

static inline int for_each_block(int bh, long n, int threads, long scratch_floats, block_fn block, const void *ctx,
                                 int fixed_order, int turn) {
    const long row_blocks = (n + ROWS - 1) / ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc(sizeof(float) * (scratch_floats > 0 ? scratch_floats : 1));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed && fixed_order) {
#pragma omp for schedule(static)
            for (long item = 0; item < bh * row_blocks; item++)
                block_item(block, ctx, item, row_blocks, turn, n, scratch);
        } else if (!failed) {
#pragma omp for schedule(dynamic, BLOCKS_PER_GRAB)
            for (long item = 0; item < bh * row_blocks; item++)
                block_item(block, ctx, item, row_blocks, turn, n, scratch);
        }
        if (!failed) {
            stream_fence();
            ahead_start(0); /* nothing queued outlives the call */
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Calls task(ctx, i, scratch) for i = 0 .. tasks - 1, one task at a time per thread (a task runs along its stretch
 * of a sequence in order); scratch is scratch_floats zero-initialised floats of thread-local space, reused from
 * task to task. fixed_order: each thread takes the same tasks on every call (tasks that add a map's parameter
 * gradients into per-thread sums then give the same sums run after run); else a thread takes the next task free.
 * Returns -1 when that space could not be allocated. */
typedef void (*task_fn)(const void *ctx, int i, float *scratch);

static inline int for_each_task(int tasks, int threads, long scratch_floats, task_fn task, const void *ctx,
                                int fixed_order) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = calloc((size_t)(scratch_floats > 0 ? scratch_floats : 1), sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed && fixed_order) {
#pragma omp for schedule(static)
            for (int i = 0; i < tasks; i++) task(ctx, i, scratch);
        } else if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < tasks; i++) task(ctx, i, scratch);
        }
        stream_fence();
        ahead_start(0); /* nothing queued outlives the call */
        free(scratch);
    }
    return failed ? -1 : 0;
}

#endif
