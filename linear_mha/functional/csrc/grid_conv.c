/* The local term of the attention modules (linear_mha/local_term.py, functional/grid_conv.py), added to attention's
 * output: per batch entry b, head h and grid position p (a row of d values),
 *
 *   res[p] = out[p] + bias_h + sum_t w_h[t] * v[p + off_t],     t over the k x k taps, off_t = (ty - r, tx - r),
 *
 * r = k / 2, zero outside the grid; the sequence is `prefix` tokens with no local term (res = out there) followed
 * by a row-major height x width grid; a masked position's values count as zero. torch's depthwise conv2d over
 * these shapes ran at a few GFLOP/s (43 ms at 16,384 tokens of 512 on a 2-core EPYC) and its output was one more
 * N-sized tensor to add: here each task walks grid rows, the k rows of values it reads stay in cache, and each
 * output row is written once. The backward, for every position q and each tap with p = q - off_t in the grid:
 *
 *   d v[q] += w_h[t] * grad[p]   (0 where q is masked or a prefix token),
 *   d w_h[t] += v[q] * grad[p],   d bias_h += grad[p] over grid positions p,
 *
 * d w and d b summed per task into the caller's (tasks, H, k k, d) and (tasks, H, d) slices, so the sums do not
 * depend on which thread ran which task. d out is grad itself. Rows are addressed through (batch, head, position)
 * strides (struct rows_at), each row contiguous; wt (H, k k, d) and bias (H, d) contiguous, bias may be NULL; mask
 * (B, S) bytes, nonzero = masked, or NULL. Entry points return 0, or -1 when a buffer could not be allocated. */
#include "kernel_attention.h"

struct grid_rows {
    const float *v, *wt, *bias, *out, *grad;
    const uint8_t *mask;
    float *res, *grad_v, *grad_w, *grad_b;
    struct rows_at v_at, out_at, res_at, grad_at, grad_v_at;
    int h, d, k, height, width, prefix, tasks, stream;
    long s, items; /* items: batch entries x grid rows */
};

/* The values row of head g at sequence position pos, or NULL where it counts as zero (masked). */
static inline const float *value_row(const struct grid_rows *c, int g, long pos) {
    if (c->mask && c->mask[(long)(g / c->h) * c->s + pos]) return NULL;
    return c->v + row_offset(c->v_at, c->h, g, pos);
}

/* res = out + bias + sum over the taps of w * v for grid cell (y, x) of head g, in registers 4 vectors at a time
 * and written once, streamed where c->stream is set and the row starts on a whole vector. Summed first into a row
 * buffer and then copied out, the copy took 7% of the pass. */
static inline void put_vector(float *dst, vf x, int stream) {
    if (stream) store_stream(dst, x);
    else store(dst, x);
}

static void output_row(const struct grid_rows *c, int g, int y, int x) {
    const int r = c->k / 2, hi = g % c->h, d = c->d, kk = c->k * c->k;
    const float *rows[kk];
    for (int ty = 0; ty < c->k; ty++)
        for (int tx = 0; tx < c->k; tx++) {
            const int yy = y + ty - r, xx = x + tx - r;
            const int inside = yy >= 0 && yy < c->height && xx >= 0 && xx < c->width;
            rows[ty * c->k + tx] = inside ? value_row(c, g, c->prefix + (long)yy * c->width + xx) : NULL;
        }
    const float *w = c->wt + (long)hi * kk * d, *b = c->bias ? c->bias + (long)hi * d : NULL;
    const long pos = c->prefix + (long)y * c->width + x;
    const float *o = c->out + row_offset(c->out_at, c->h, g, pos);
    float *res = c->res + row_offset(c->res_at, c->h, g, pos);
    const int stream = c->stream && vector_aligned(res);
    const vf zero = splat(0.0f);
    int j = 0;
    for (; j + 4 * W <= d; j += 4 * W) {
        vf a0 = b ? load(b + j) : zero, a1 = b ? load(b + j + W) : zero, a2 = b ? load(b + j + 2 * W) : zero,
           a3 = b ? load(b + j + 3 * W) : zero;
        for (int t = 0; t < kk; t++) {
            if (!rows[t]) continue;
            const float *vr = rows[t] + j, *wr = w + (long)t * d + j;
            a0 += load(wr) * load(vr);
            a1 += load(wr + W) * load(vr + W);
            a2 += load(wr + 2 * W) * load(vr + 2 * W);
            a3 += load(wr + 3 * W) * load(vr + 3 * W);
        }
        put_vector(res + j, a0 + load(o + j), stream);
        put_vector(res + j + W, a1 + load(o + j + W), stream);
        put_vector(res + j + 2 * W, a2 + load(o + j + 2 * W), stream);
        put_vector(res + j + 3 * W, a3 + load(o + j + 3 * W), stream);
    }
    for (; j + W <= d; j += W) {
        vf a = b ? load(b + j) : zero;
        for (int t = 0; t < kk; t++)
            if (rows[t]) a += load(w + (long)t * d + j) * load(rows[t] + j);
        put_vector(res + j, a + load(o + j), stream);
    }
    for (; j < d; j++) {
        float a = b ? b[j] : 0.0f;
        for (int t = 0; t < kk; t++)
            if (rows[t]) a += w[(long)t * d + j] * rows[t][j];
        res[j] = a + o[j];
    }
}

/* Asks for the rows of every head of batch entry bi at grid column x of grid rows y - r .. y + r in rows (v_at or
 * grad_at's layout): the column that a pass over grid row y reads first AHEAD_COLUMNS positions later. In a module's
 * layout a position's rows lie a page or more from the next position's, where the hardware's prefetchers do not
 * follow, and each pass's loads of a new column waited on memory (the forward's FMAs on the values took 54% of its
 * samples). */
#define AHEAD_COLUMNS 3
static inline void ask_column(const struct grid_rows *c, const float *rows, struct rows_at at, int bi, int y,
                              int x, int r) {
    if (x >= c->width) return;
    for (int yy = y - r; yy <= y + r; yy++) {
        if (yy < 0 || yy >= c->height) continue;
        const long pos = c->prefix + (long)yy * c->width + x;
        for (int hi = 0; hi < c->h; hi++) {
            const uintptr_t start = (uintptr_t)(rows + row_offset(at, c->h, bi * c->h + hi, pos));
            const uintptr_t end = start + sizeof(float) * (unsigned)c->d;
            for (uintptr_t line = start & ~(uintptr_t)63; line < end; line += 64)
                __builtin_prefetch((const void *)line, 0, 3);
        }
    }
}

static void forward_task(const void *ctx, int t, float *scratch) {
    const struct grid_rows *c = ctx;
    long a, z;
    (void)scratch;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        const int bi = (int)(item / c->height), y = (int)(item % c->height);
        for (int x = 0; x < AHEAD_COLUMNS; x++) ask_column(c, c->v, c->v_at, bi, y, x + c->k / 2, c->k / 2);
        for (int x = 0; x < c->width; x++) {
            ask_column(c, c->v, c->v_at, bi, y, x + c->k / 2 + AHEAD_COLUMNS, c->k / 2);
            for (int hi = 0; hi < c->h; hi++) output_row(c, bi * c->h + hi, y, x);
        }
    }
    /* the prefix rows keep out, copied by the task that ends the batch entry's grid */
    for (long item = a; item < z; item++)
        if (item % c->height == c->height - 1 && c->res != c->out)
            for (int hi = 0; hi < c->h; hi++)
                for (long pos = 0; pos < c->prefix; pos++) {
                    const int g = (int)(item / c->height) * c->h + hi;
                    memcpy(c->res + row_offset(c->res_at, c->h, g, pos), c->out + row_offset(c->out_at, c->h, g, pos),
                           sizeof(float) * c->d);
                }
}

/* The backward walks each grid row in blocks of BLOCK_COLUMNS positions, and within a block one head and one vector
 * of channels at a time over the block's positions, so that each tap's d w (and d b) stays in a register over the
 * block and each d v is written once. Over positions innermost, with d w and d v added into memory tap by tap, it
 * made 18 stores per vector of channels and position at k = 3, and those loads and stores were its hottest
 * instructions. The block's rows of grad (k grid rows of k + BLOCK_COLUMNS - 1 columns) and of v stay in L1 over
 * its passes (14 KiB a head at k = 3 and d = 64). */
#define BLOCK_COLUMNS 16
#define REGISTER_TAPS 9 /* kernels of up to this many taps keep d w in registers; larger ones add it in memory */

/* Where a block's rows lie, as offsets from head g's row 0 in each tensor: tap[x * kk + t] grad's row at tap t
 * of the block's position x (-1: outside the grid), own[x] grad's row at that position (for d b), value[x] v's
 * (-1: masked, which has no d v and adds nothing to d w), and d v's rows into dv (columns x d), streamed out
 * after the block. Carved from the task's scratch (block_scratch floats). */
struct block_rows {
    long *tap, own[BLOCK_COLUMNS], value[BLOCK_COLUMNS];
    float *dv;
    int columns;
};

static long block_scratch(int k, int d) { return 2L * BLOCK_COLUMNS * k * k + (long)BLOCK_COLUMNS * d; }

static void block_offsets(const struct grid_rows *c, int bi, int y, int x0, struct block_rows *br) {
    const int r = c->k / 2, kk = c->k * c->k;
    br->columns = c->width - x0 < BLOCK_COLUMNS ? c->width - x0 : BLOCK_COLUMNS;
    for (int x = 0; x < br->columns; x++) {
        const long pos = c->prefix + (long)y * c->width + x0 + x;
        br->own[x] = pos * c->grad_at.n;
        br->value[x] = c->mask && c->mask[(long)bi * c->s + pos] ? -1 : pos * c->v_at.n;
        for (int t = 0; t < kk; t++) {
            const int yy = y - (t / c->k - r), xx = x0 + x - (t % c->k - r);
            const int inside = yy >= 0 && yy < c->height && xx >= 0 && xx < c->width;
            br->tap[x * kk + t] = inside ? (c->prefix + (long)yy * c->width + xx) * c->grad_at.n : -1;
        }
    }
}

/* A head's gradients over a block for the channels [j, j + W): d v into br->dv, d w (kk x d, NULL: not wanted) and
 * d b (d, NULL: not wanted) added to. With kk a constant of at most REGISTER_TAPS, the taps' d w are registers. */
static inline __attribute__((always_inline)) void block_vector(const struct grid_rows *c, const struct block_rows *br,
                                                               const float *grad, const float *v, const float *w,
                                                               float *dw, float *db, int kk, int j) {
    vf dw_acc[REGISTER_TAPS], w_t[REGISTER_TAPS], db_acc = db ? load(db + j) : splat(0.0f);
    const int in_registers = kk <= REGISTER_TAPS;
    for (int t = 0; in_registers && t < kk; t++) {
        dw_acc[t] = dw ? load(dw + (long)t * c->d + j) : splat(0.0f);
        w_t[t] = load(w + (long)t * c->d + j);
    }
    for (int x = 0; x < br->columns; x++) {
        if (db) db_acc += load(grad + br->own[x] + j);
        vf acc = splat(0.0f);
        if (br->value[x] >= 0) {
            const vf vq = load(v + br->value[x] + j);
            const long *tap = br->tap + (long)x * kk;
            for (int t = 0; t < kk; t++) {
                if (tap[t] < 0) continue;
                const vf g = load(grad + tap[t] + j);
                if (in_registers) {
                    acc += w_t[t] * g;
                    dw_acc[t] += vq * g;
                } else {
                    acc += load(w + (long)t * c->d + j) * g;
                    if (dw) store(dw + (long)t * c->d + j, load(dw + (long)t * c->d + j) + vq * g);
                }
            }
        }
        store(br->dv + (long)x * c->d + j, acc);
    }
    if (db) store(db + j, db_acc);
    for (int t = 0; dw && in_registers && t < kk; t++) store(dw + (long)t * c->d + j, dw_acc[t]);
}

/* block_vector for the last d % W channels, one at a time. */
static void block_tail(const struct grid_rows *c, const struct block_rows *br, const float *grad, const float *v,
                       const float *w, float *dw, float *db, int kk, int j0) {
    for (int x = 0; x < br->columns; x++)
        for (int j = j0; j < c->d; j++) {
            if (db) db[j] += grad[br->own[x] + j];
            float acc = 0.0f;
            if (br->value[x] >= 0)
                for (int t = 0; t < kk; t++) {
                    const long at = br->tap[(long)x * kk + t];
                    if (at < 0) continue;
                    acc += w[(long)t * c->d + j] * grad[at + j];
                    if (dw) dw[(long)t * c->d + j] += v[br->value[x] + j] * grad[at + j];
                }
            br->dv[(long)x * c->d + j] = acc;
        }
}

/* Head g's d v over the block's positions (where c->grad_v is set), and their terms of d w and d b into this task's
 * slices (NULL: not wanted). */
static void block_gradients(const struct grid_rows *c, const struct block_rows *br, int g, int x0, int y, float *dw,
                            float *db) {
    const int kk = c->k * c->k, hi = g % c->h;
    const float *grad = c->grad + row_offset(c->grad_at, c->h, g, 0), *v = c->v + row_offset(c->v_at, c->h, g, 0);
    const float *w = c->wt + (long)hi * kk * c->d;
    int j = 0;
    for (; j + W <= c->d; j += W) {
        if (kk == 9) block_vector(c, br, grad, v, w, dw, db, 9, j);
        else if (kk == 1) block_vector(c, br, grad, v, w, dw, db, 1, j);
        else block_vector(c, br, grad, v, w, dw, db, kk, j);
    }
    if (j < c->d) block_tail(c, br, grad, v, w, dw, db, kk, j);
    if (!c->grad_v) return;
    const long pos = c->prefix + (long)y * c->width + x0;
    for (int x = 0; x < br->columns; x++)
        put_row(c->grad_v + row_offset(c->grad_v_at, c->h, g, pos + x), br->dv + (long)x * c->d, c->d, c->stream);
}

static void backward_task(const void *ctx, int t, float *scratch) {
    const struct grid_rows *c = ctx;
    const int kk = c->k * c->k, r = c->k / 2;
    struct block_rows br = {(long *)scratch, {0}, {0}, scratch + 2L * BLOCK_COLUMNS * kk, 0};
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        const int bi = (int)(item / c->height), y = (int)(item % c->height);
        for (int x0 = 0; x0 < c->width; x0 += BLOCK_COLUMNS) {
            block_offsets(c, bi, y, x0, &br);
            for (int x = x0 + BLOCK_COLUMNS; x < x0 + 2 * BLOCK_COLUMNS && x < c->width; x++) { /* the next block's */
                ask_column(c, c->grad, c->grad_at, bi, y, x + r, r);
                ask_column(c, c->v, c->v_at, bi, y, x, 0);
            }
            for (int hi = 0; hi < c->h; hi++) {
                float *dw = c->grad_w ? c->grad_w + ((long)t * c->h + hi) * kk * c->d : NULL;
                float *db = c->grad_b ? c->grad_b + ((long)t * c->h + hi) * c->d : NULL;
                block_gradients(c, &br, bi * c->h + hi, x0, y, dw, db);
            }
        }
    }
    if (c->grad_v) /* the prefix tokens have no local term: their d v is 0 */
        for (long item = a; item < z; item++)
            if (item % c->height == c->height - 1)
                for (int hi = 0; hi < c->h; hi++)
                    for (long pos = 0; pos < c->prefix; pos++)
                        memset(c->grad_v + row_offset(c->grad_v_at, c->h, (int)(item / c->height) * c->h + hi, pos), 0,
                               sizeof(float) * c->d);
}

static void describe(struct grid_rows *c, const float *v, const float *wt, const float *bias, const uint8_t *mask,
                     int b, int h, long s, int d, int k, int height, int width, int prefix, int threads) {
    c->v = v;
    c->wt = wt;
    c->bias = bias;
    c->mask = mask;
    c->h = h;
    c->d = d;
    c->k = k;
    c->height = height;
    c->width = width;
    c->prefix = prefix;
    c->s = s;
    c->items = (long)b * height;
    c->tasks = row_tasks(c->items, threads);
    c->stream = streamed((long)b * h * s * d);
}

/* The partial sums lm_grid_conv_backward_f32 writes per task: grad_w (tasks, H, k k, d), grad_b (tasks, H, d). */
int lm_grid_conv_tasks(int b, int height, int threads) { return row_tasks((long)b * height, threads); }

/* res <- out + the local term of v; res may be out. v, out, res (B, H, S, d), S = prefix + height * width;
 * strides: v, out, res (3 each: batch, head, position). */
int lm_grid_conv_f32(const float *v, const float *wt, const float *bias, const uint8_t *mask, const float *out,
                     float *res, int b, int h, long s, int d, int k, int height, int width, int prefix,
                     const long *strides, int threads) {
    struct grid_rows c = {0};
    describe(&c, v, wt, bias, mask, b, h, s, d, k, height, width, prefix, threads);
    c.out = out;
    c.res = res;
    c.v_at = rows_from(strides, 0, h, s, d);
    c.out_at = rows_from(strides, 1, h, s, d);
    c.res_at = rows_from(strides, 2, h, s, d);
    return for_each_task(c.tasks, threads_for(threads), 1, forward_task, &c, 0);
}

/* The gradients of res from grad, that of res: grad_v (NULL: not wanted), and grad_w / grad_b per task (zeroed by
 * the caller; NULL: not wanted). strides: v, grad, grad_v. */
int lm_grid_conv_backward_f32(const float *v, const float *wt, const uint8_t *mask, const float *grad, float *grad_v,
                              float *grad_w, float *grad_b, int b, int h, long s, int d, int k, int height, int width,
                              int prefix, const long *strides, int threads) {
    struct grid_rows c = {0};
    describe(&c, v, wt, NULL, mask, b, h, s, d, k, height, width, prefix, threads);
    c.grad = grad;
    c.grad_v = grad_v;
    c.grad_w = grad_w;
    c.grad_b = grad_b;
    c.v_at = rows_from(strides, 0, h, s, d);
    c.grad_at = rows_from(strides, 1, h, s, d);
    c.grad_v_at = rows_from(strides, 2, h, s, d);
    return for_each_task(c.tasks, threads_for(threads), block_scratch(k, d), backward_task, &c, 1);
}
