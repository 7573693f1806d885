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

static inline void put_vector(float *dst, vf x, int stream) {
    if (stream) store_stream(dst, x);
    else store(dst, x);
}

/* res = out + bias + sum over the taps of w * v for grid cell (y, x) of head g, channels [j0, d): the taps read
 * one at a time. What the walk below leaves: kernels wider than WALK_MAX_K and the last d % W channels. */
static void output_row(const struct grid_rows *c, int g, int y, int x, int j0) {
    const int r = c->k / 2, hi = g % c->h, d = c->d, kk = c->k * c->k;
    const float *w = c->wt + (long)hi * kk * d, *b = c->bias ? c->bias + (long)hi * d : NULL;
    const long pos = c->prefix + (long)y * c->width + x;
    const float *o = c->out + row_offset(c->out_at, c->h, g, pos);
    float *res = c->res + row_offset(c->res_at, c->h, g, pos);
    for (int j = j0; j < d; j++) {
        float a = b ? b[j] : 0.0f;
        for (int t = 0; t < kk; t++) {
            const int yy = y + t / c->k - r, xx = x + t % c->k - r;
            if (yy < 0 || yy >= c->height || xx < 0 || xx >= c->width) continue;
            const float *vr = value_row(c, g, c->prefix + (long)yy * c->width + xx);
            if (vr) a += w[(long)t * d + j] * vr[j];
        }
        res[j] = a + o[j];
    }
}

/* The forward walks a grid row in blocks of WALK_COLUMNS columns, and within a block one head and one line of
 * channels (LINE floats, nv vectors) at a time over its columns. Column x of the k value rows around the grid row
 * is loaded once and added into the k outputs it reaches, x - r .. x + r, whose sums are carried in registers
 * (sum[i] for output x - r + i), and from block to block in the task's scratch; output x - r is then complete and
 * written. That is k loads and k * k FMAs per vector of channels, the taps' weights in L1. While it walks a block
 * the walk asks for the same head's line of the next block, which it reads after the block's other heads and
 * lines: far enough ahead for memory, and every line of a position's rows asked for within a few blocks. Walked
 * over a whole grid row per head and line, with rows asked for 8 columns ahead, the pass came back to each page of
 * v 32 times per row and was 1.32x faster than before; in blocks of 8 columns 1.1x faster again, of 4 1.24x more
 * (16: 0.91x; 2 or 3 as 4).
 *
 * Before, each output read its k * k value rows afresh, over the x loop outside the heads': at a module's layout
 * the rows of every position of the same parity fall in the same L1 sets, so the 9 value rows, the rows asked
 * for ahead and out's row of a head thrashed them, and the pass took ~60 cycles a line of channels in cache and
 * ~130 from memory (17 ms at 16,384 tokens of 512 on a 2-core EPYC, against ~5 ms for its memory traffic). */
#define LINE 16
#define LINE_V (LINE / W)
#define WALK_MAX_K 7
#define WALK_COLUMNS 4

/* A task's view of its grid row: off[ty * width + x] the values row of grid cell (y + ty - r, x) from a head's row
 * 0 (-1: outside the grid or masked, read as zero), the taps packed per line (H, lines, k k, LINE) and the sums
 * carried between blocks (H, lines, k, LINE). */
struct walk_rows {
    long *off;
    const float *zero; /* LINE zeros */
    float *taps, *carry;
    int lines;
};

static int walk_lines(int d) { return (d / W * W + LINE - 1) / LINE; }

static long walk_scratch(int h, int d, int k, int width) {
    return 2L * k * width + LINE + (long)h * walk_lines(d) * (k * k + k) * LINE;
}

/* Block [x0, x1) of grid row y, head g, channels [j, j + nv W); past the row's last block, its last r outputs. */
static inline __attribute__((always_inline)) void walk_block(const struct grid_rows *c, const struct walk_rows *wr,
                                                             int g, int y, int j, int x0, int x1, int k, int nv,
                                                             int stream) {
    const int r = k / 2, width = c->width, hi = g % c->h, line = j / LINE;
    const long pos = c->prefix + (long)y * width, o_step = c->out_at.n, res_step = c->res_at.n;
    const float *v = c->v + row_offset(c->v_at, c->h, g, 0) + j;
    const float *o = c->out + row_offset(c->out_at, c->h, g, pos) + j;
    float *res = c->res + row_offset(c->res_at, c->h, g, pos) + j;
    const float *w = wr->taps + ((long)hi * wr->lines + line) * k * k * LINE;
    float *carry = wr->carry + ((long)hi * wr->lines + line) * k * LINE;
    const long *off = wr->off;
    vf sum[WALK_MAX_K][LINE_V], start[LINE_V];
    for (int u = 0; u < nv; u++) start[u] = c->bias ? load(c->bias + (long)hi * c->d + j + u * W) : splat(0.0f);
    for (int i = 0; i < k; i++)
        for (int u = 0; u < nv; u++) sum[i][u] = x0 == 0 ? start[u] : load(carry + i * LINE + u * W);
    const int end = x1 == width ? width + r : x1;
    for (int x = x0; x < end; x++) {
        if (x < width) {
            const int ahead = x + WALK_COLUMNS;
            if (ahead < width) {
                for (int ty = 0; ty < k; ty++)
                    if (off[ty * width + ahead] >= 0) __builtin_prefetch(v + off[ty * width + ahead], 0, 3);
                if (ahead >= r) __builtin_prefetch(o + (ahead - r) * o_step, 0, 3);
            }
            for (int ty = 0; ty < k; ty++) {
                const float *row = off[ty * width + x] >= 0 ? v + off[ty * width + x] : wr->zero;
                for (int u = 0; u < nv; u++) {
                    const vf value = load(row + u * W);
                    for (int tx = 0; tx < k; tx++)
                        sum[k - 1 - tx][u] += load(w + (ty * k + tx) * LINE + u * W) * value;
                }
            }
        }
        if (x >= r)
            for (int u = 0; u < nv; u++)
                put_vector(res + (x - r) * res_step + u * W, sum[0][u] + load(o + (x - r) * o_step + u * W), stream);
        for (int i = 0; i + 1 < k; i++)
            for (int u = 0; u < nv; u++) sum[i][u] = sum[i + 1][u];
        for (int u = 0; u < nv; u++) sum[k - 1][u] = start[u];
    }
    if (x1 < width)
        for (int i = 0; i < k; i++)
            for (int u = 0; u < nv; u++) store(carry + i * LINE + u * W, sum[i][u]);
}

/* Grid row y of batch entry bi: the walk over whole lines of channels, then over one vector, then output_row's for
 * what is left (and for kernels wider than WALK_MAX_K). Streamed where c->stream is set, res is not out (whose
 * lines were just read) and its rows start on whole lines. */
static void output_grid_row(const struct grid_rows *c, const struct walk_rows *wr, int bi, int y) {
    const int k = c->k, r = k / 2, d = c->d, width = c->width, whole = d / LINE * LINE;
    const int walked = k <= WALK_MAX_K ? d / W * W : 0;
    if (walked) {
        for (int ty = 0; ty < k; ty++)
            for (int x = 0; x < width; x++) {
                const int yy = y + ty - r;
                const long at = c->prefix + (long)yy * width + x;
                const int zero = yy < 0 || yy >= c->height || (c->mask && c->mask[(long)bi * c->s + at]);
                wr->off[ty * width + x] = zero ? -1 : at * c->v_at.n;
            }
        const int stream = c->stream && c->res != c->out && (uintptr_t)c->res % 64 == 0 &&
                           (c->res_at.b | c->res_at.h | c->res_at.n) % LINE == 0;
        for (int x0 = 0; x0 < width; x0 += WALK_COLUMNS) {
            const int x1 = x0 + WALK_COLUMNS < width ? x0 + WALK_COLUMNS : width;
            for (int hi = 0; hi < c->h; hi++) {
                const int g = bi * c->h + hi;
                for (int j = 0; j < whole; j += LINE) {
                    if (k == 3) walk_block(c, wr, g, y, j, x0, x1, 3, LINE_V, stream);
                    else if (k == 1) walk_block(c, wr, g, y, j, x0, x1, 1, LINE_V, stream);
                    else if (k == 5) walk_block(c, wr, g, y, j, x0, x1, 5, LINE_V, stream);
                    else walk_block(c, wr, g, y, j, x0, x1, 7, LINE_V, stream);
                }
                if (whole < walked) walk_block(c, wr, g, y, whole, x0, x1, k, 1, 0); /* one vector (W = 8) */
            }
        }
    }
    if (walked < d)
        for (int hi = 0; hi < c->h; hi++)
            for (int x = 0; x < width; x++) output_row(c, bi * c->h + hi, y, x, walked);
}

/* The taps (H, k k, d) as walk_block reads them, (H, lines, k k, LINE), a line's taps side by side. */
static void pack_taps(const struct grid_rows *c, float *taps, int lines) {
    const int kk = c->k * c->k, walked = c->d / W * W;
    for (int hi = 0; hi < c->h; hi++)
        for (int line = 0; line < lines; line++)
            for (int t = 0; t < kk; t++) {
                const int j = line * LINE, n = walked - j < LINE ? walked - j : LINE;
                memcpy(taps + (((long)hi * lines + line) * kk + t) * LINE, c->wt + ((long)hi * kk + t) * c->d + j,
                       sizeof(float) * n);
            }
}

/* Asks for the rows of every head of batch entry bi at grid column x of grid rows y - r .. y + r in rows (v_at or
 * grad_at's layout): the column that the backward's pass over grid row y reads first some positions later. In a
 * module's layout a position's rows lie a page or more from the next position's, where the hardware's prefetchers
 * do not follow. */
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
    const int lines = walk_lines(c->d);
    struct walk_rows wr = {(long *)scratch, scratch + 2L * c->k * c->width, NULL, NULL, lines};
    wr.taps = scratch + 2L * c->k * c->width + LINE; /* after LINE zeros (calloc'd) */
    wr.carry = wr.taps + (long)c->h * lines * c->k * c->k * LINE;
    if (c->k <= WALK_MAX_K) pack_taps(c, wr.taps, lines);
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) output_grid_row(c, &wr, (int)(item / c->height), (int)(item % c->height));
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
    return for_each_task(c.tasks, threads_for(threads), walk_scratch(h, d, k, width), forward_task, &c, 0);
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
