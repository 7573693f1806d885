/* The local term's arithmetic shared by its forward (grid_conv.c) and backward (grid_conv_backward.c): the rows
 * a call describes, and the walk over a grid row both passes take. */
#ifndef LINEAR_MHA_GRID_CONV_H
#define LINEAR_MHA_GRID_CONV_H
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

/* Both passes walk a grid row in blocks of WALK_COLUMNS columns, and within a block one head and one line of
 * channels (LINE floats, nv vectors) at a time over its columns. In the forward (and in the backward's d v, the
 * same sum over grad with the taps turned round), column x of the k source rows around the grid row is loaded
 * once and added into the k outputs it reaches, x - r .. x + r, whose sums are carried in registers (sum[i] for
 * output x - r + i), and from block to block in the task's scratch; output x - r is then complete and written.
 * That is k loads and k * k FMAs per vector of channels, the taps' weights in L1. While it walks a block the walk
 * asks for the same head's line of the next block, which it reads after the block's other heads and lines: far
 * enough ahead for memory, and every line of a position's rows asked for within a few blocks. Walked over a whole
 * grid row per head and line, with rows asked for 8 columns ahead, the forward came back to each page of v 32
 * times per row and was 1.23x faster than before; in blocks of 8 columns 1.10x faster again, of 4 1.24x more
 * (16: 0.91x; 2 or 3 as 4).
 *
 * Before, each output read its k * k source rows afresh, over the x loop outside the heads': at a module's layout
 * the rows of every position of the same parity fall in the same L1 sets, so the 9 rows, the rows asked for ahead
 * and out's row of a head thrashed them, and the forward took ~60 cycles a line of channels in cache and ~130
 * from memory (17 ms at 16,384 tokens of 512 on a 2-core EPYC, against ~5 ms for its memory traffic). */
#define LINE 16
#define LINE_V (LINE / W)
#define WALK_MAX_K 7
#define WALK_COLUMNS 4

/* One walk over grid row y: dst[x] = add[x] + bias + sum over the taps of taps[t] * src[(y, x) + off_t], zero
 * where dst_mask is set. rows[(hi * k + ty) * width + x] is head hi's source row at grid cell (y + ty - r, x)
 * (zero, d zeros, outside the grid or where masked), each row's pointer loaded where a select from offsets
 * took 5 instructions; taps packed per line (H, lines, k k, LINE); carry the sums
 * carried between blocks (H, lines, k, LINE). */
struct walk {
    const float *src, *add, *bias, *zero, *taps;
    float *dst, *carry;
    const uint8_t *dst_mask; /* the batch entry's (S), or NULL */
    struct rows_at src_at, add_at, dst_at;
    const float **rows;
    int lines, stream;
};

static int walk_lines(int d) { return (d / W * W + LINE - 1) / LINE; }

/* The zeros a walk reads for masked and outside cells: at least d, and a whole number of lines, so that what
 * follows them in scratch (taps, carry, the backward's pointer table) stays aligned for its type. */
static long zero_floats(int d) { return (d + LINE - 1) / LINE * LINE + LINE; }

/* Scratch floats for a walk's rows, zero, taps and carry. */
static long walk_floats(int h, int d, int k, int width) {
    return 2L * h * k * width + zero_floats(d) + (long)h * walk_lines(d) * (k * k + k) * LINE;
}

static float *walk_carve(struct walk *wk, const struct grid_rows *c, float *scratch) {
    wk->lines = walk_lines(c->d);
    wk->rows = (const float **)scratch;
    wk->zero = scratch + 2L * c->h * c->k * c->width; /* calloc'd: zeros */
    float *taps = scratch + 2L * c->h * c->k * c->width + zero_floats(c->d);
    wk->taps = taps;
    wk->carry = taps + (long)c->h * wk->lines * c->k * c->k * LINE;
    return taps;
}

/* The taps (H, k k, d) as walk_block reads them, (H, lines, k k, LINE), a line's taps side by side; turned round
 * (tap k k - 1 - t) where `turned`. */
static void pack_taps(const struct grid_rows *c, float *taps, int lines, int turned) {
    const int kk = c->k * c->k, walked = c->d / W * W;
    for (int hi = 0; hi < c->h; hi++)
        for (int line = 0; line < lines; line++)
            for (int t = 0; t < kk; t++) {
                const int j = line * LINE, n = walked - j < LINE ? walked - j : LINE, from = turned ? kk - 1 - t : t;
                memcpy(taps + (((long)hi * lines + line) * kk + t) * LINE, c->wt + ((long)hi * kk + from) * c->d + j,
                       sizeof(float) * n);
            }
}

/* row[x] = head g's row of grid cell (yy, x) in src (through at), or zero outside the grid or under mask (the
 * batch entry's, or NULL), for x in [0, width). */
static void walk_row(const struct grid_rows *c, const float **row, const float *src, struct rows_at at, int g,
                     const uint8_t *mask, int yy, const float *zero) {
    const float *head = src + row_offset(at, c->h, g, 0);
    for (int x = 0; x < c->width; x++) {
        const long pos = c->prefix + (long)yy * c->width + x;
        row[x] = yy < 0 || yy >= c->height || (mask && mask[pos]) ? zero : head + pos * at.n;
    }
}

/* rows for grid row y of batch entry bi: each head's k rows around it. */
static void walk_rows(const struct grid_rows *c, const struct walk *wk, int bi, const uint8_t *mask, int y) {
    for (int hi = 0; hi < c->h; hi++)
        for (int ty = 0; ty < c->k; ty++)
            walk_row(c, wk->rows + ((long)hi * c->k + ty) * c->width, wk->src, wk->src_at, bi * c->h + hi, mask,
                     y + ty - c->k / 2, wk->zero);
}

/* Block [x0, x1) of grid row y, head g, channels [j, j + nv W); past the row's last block, its last r outputs. */
static inline __attribute__((always_inline)) void walk_block(const struct grid_rows *c, const struct walk *wk, int g,
                                                             int y, int j, int x0, int x1, int k, int nv,
                                                             int stream, int adds) {
    const int r = k / 2, width = c->width, hi = g % c->h, line = j / LINE;
    const long pos = c->prefix + (long)y * width, a_step = wk->add_at.n, d_step = wk->dst_at.n;
    const float *add = adds ? wk->add + row_offset(wk->add_at, c->h, g, pos) + j : NULL;
    float *dst = wk->dst + row_offset(wk->dst_at, c->h, g, pos) + j;
    const uint8_t *dst_mask = !adds && wk->dst_mask ? wk->dst_mask + pos : NULL; /* the backward's */
    const float *w = wk->taps + ((long)hi * wk->lines + line) * k * k * LINE;
    float *carry = wk->carry + ((long)hi * wk->lines + line) * k * LINE;
    const float *const *rows = wk->rows + (long)hi * k * width;
    vf sum[WALK_MAX_K][LINE_V], start[LINE_V];
    for (int u = 0; u < nv; u++) start[u] = wk->bias ? load(wk->bias + (long)hi * c->d + j + u * W) : splat(0.0f);
    for (int i = 0; i < k; i++)
        for (int u = 0; u < nv; u++) sum[i][u] = x0 == 0 ? start[u] : load(carry + i * LINE + u * W);
    const int end = x1 == width ? width + r : x1;
    for (int x = x0; x < end; x++) {
        if (x < width) {
            const int ahead = x + WALK_COLUMNS;
            if (ahead < width) {
                for (int ty = 0; ty < k; ty++) __builtin_prefetch(rows[ty * width + ahead] + j, 0, 3);
                if (adds && ahead >= r) __builtin_prefetch(add + (ahead - r) * a_step, 0, 3);
            }
            for (int ty = 0; ty < k; ty++) {
                const float *row = rows[ty * width + x] + j;
                for (int u = 0; u < nv; u++) {
                    const vf value = load(row + u * W);
                    for (int tx = 0; tx < k; tx++)
                        sum[k - 1 - tx][u] += load(w + (ty * k + tx) * LINE + u * W) * value;
                }
            }
        }
        if (x >= r) {
            const int zero = !adds && dst_mask && dst_mask[x - r];
            for (int u = 0; u < nv; u++) {
                const vf a = adds ? sum[0][u] + load(add + (x - r) * a_step + u * W) : sum[0][u];
                put_vector(dst + (x - r) * d_step + u * W, zero ? splat(0.0f) : a, stream);
            }
        }
        for (int i = 0; i + 1 < k; i++)
            for (int u = 0; u < nv; u++) sum[i][u] = sum[i + 1][u];
        for (int u = 0; u < nv; u++) sum[k - 1][u] = start[u];
    }
    if (x1 < width)
        for (int i = 0; i < k; i++)
            for (int u = 0; u < nv; u++) store(carry + i * LINE + u * W, sum[i][u]);
}

/* Whether dst's rows may be streamed: c->stream set and every row starting on a whole line. */
static int lined_rows(const struct grid_rows *c, const float *dst, struct rows_at at) {
    return c->stream && (uintptr_t)dst % 64 == 0 && (at.b | at.h | at.n) % LINE == 0;
}

/* Block [x0, x1) of grid row y, head g, over the whole lines of channels and then one vector (W = 8); adds: the
 * forward (a constant: its outputs add out, the backward's are masked), which as a test taken at run time cost the
 * forward 2-4% (tools.ab_builds, per round). */
static inline __attribute__((always_inline)) void walk_heads_block(const struct grid_rows *c, const struct walk *wk,
                                                                   int g, int y, int x0, int x1, int walked, int adds) {
    const int k = c->k, whole = c->d / LINE * LINE;
    for (int j = 0; j < whole; j += LINE) {
        if (k == 3) walk_block(c, wk, g, y, j, x0, x1, 3, LINE_V, wk->stream, adds);
        else if (k == 1) walk_block(c, wk, g, y, j, x0, x1, 1, LINE_V, wk->stream, adds);
        else if (k == 5) walk_block(c, wk, g, y, j, x0, x1, 5, LINE_V, wk->stream, adds);
        else walk_block(c, wk, g, y, j, x0, x1, 7, LINE_V, wk->stream, adds);
    }
    if (whole < walked) walk_block(c, wk, g, y, whole, x0, x1, k, 1, 0, adds);
}

/* Channels the walks take: whole vectors, for odd kernels of up to WALK_MAX_K (the walks' radius is k / 2 on
 * each side); the rest go tap by tap. */
static int walked_channels(const struct grid_rows *c) { return c->k <= WALK_MAX_K && c->k % 2 ? c->d / W * W : 0; }

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

#endif
