/* The local term's backward (the sums in grid_conv.c's opening comment): d v, d w and d b of res = out + the
 * local term of v, d out being the incoming gradient itself. Before, it walked blocks of 16 positions and read
 * each position's k * k grad rows afresh for every vector of channels, which at a module's layout fell in the
 * same L1 sets as the forward's did. Forward + backward at 16,384 tokens of 512, per round against the build
 * before either walk (tools.ab_builds --methods local_term): 1.13x faster with the forward's walk alone, 1.27x
 * with these too. */
#include "grid_conv.h"

/* d w_h[ty][.] and d b_h over block [x0, x1) of grid row y, head g, channels [j, j + nv W), added into this
 * task's slices dw (k k, d) and db (d), either NULL where not wanted. For each row ty of taps, a window of the k
 * values of grid row y + ty - r around column x slides along the block, one new value a column, and the row's k
 * sums of d w stay in registers: k loads and k FMAs per tap row and column (the block's grad rows are in L1 from
 * the walk of d v just before). rows[(hi * k + ty) * (width + 2 r) + x + r]: as struct walk's for v, over
 * columns -r .. width + r - 1. */
static inline __attribute__((always_inline)) void weight_block(const struct grid_rows *c,
                                                               const float *const *rows, int g, int y, int j, int x0,
                                                               int x1, float *dw, float *db, int k, int nv) {
    const int r = k / 2, span = c->width + 2 * r;
    const long pos = c->prefix + (long)y * c->width, g_step = c->grad_at.n;
    const float *grad = c->grad + row_offset(c->grad_at, c->h, g, pos) + j;
    if (db) {
        vf sum[LINE_V];
        for (int u = 0; u < nv; u++) sum[u] = load(db + j + u * W);
        for (int x = x0; x < x1; x++)
            for (int u = 0; u < nv; u++) sum[u] += load(grad + x * g_step + u * W);
        for (int u = 0; u < nv; u++) store(db + j + u * W, sum[u]);
    }
    for (int ty = 0; dw && ty < k; ty++) {
        const float *const *row = rows + ((long)(g % c->h) * k + ty) * span; /* row[x + tx]: column x + tx - r */
        vf sum[WALK_MAX_K][LINE_V], window[WALK_MAX_K][LINE_V];
        for (int tx = 0; tx < k; tx++)
            for (int u = 0; u < nv; u++) sum[tx][u] = load(dw + (long)(ty * k + tx) * c->d + j + u * W);
        for (int tx = 1; tx < k; tx++) {
            for (int u = 0; u < nv; u++) window[tx][u] = load(row[x0 + tx - 1] + j + u * W);
        }
        for (int x = x0; x < x1; x++) {
            const int ahead = x + WALK_COLUMNS + k - 1;
            if (ahead < span) __builtin_prefetch(row[ahead] + j, 0, 3);
            for (int tx = 0; tx + 1 < k; tx++)
                for (int u = 0; u < nv; u++) window[tx][u] = window[tx + 1][u];
            for (int u = 0; u < nv; u++) {
                window[k - 1][u] = load(row[x + k - 1] + j + u * W);
                const vf gp = load(grad + x * g_step + u * W);
                for (int tx = 0; tx < k; tx++) sum[tx][u] += window[tx][u] * gp;
            }
        }
        for (int tx = 0; tx < k; tx++)
            for (int u = 0; u < nv; u++) store(dw + (long)(ty * k + tx) * c->d + j + u * W, sum[tx][u]);
    }
}

static void weight_heads_block(const struct grid_rows *c, const float *const *rows, int g, int y, int x0, int x1,
                               float *dw, float *db, int walked) {
    const int k = c->k, whole = c->d / LINE * LINE;
    for (int j = 0; j < whole; j += LINE) {
        if (k == 3) weight_block(c, rows, g, y, j, x0, x1, dw, db, 3, LINE_V);
        else if (k == 1) weight_block(c, rows, g, y, j, x0, x1, dw, db, 1, LINE_V);
        else /* k windows and sums of a line of two vectors would not fit in 16 registers */
            for (int u = 0; u < LINE_V; u++) {
                if (k == 5) weight_block(c, rows, g, y, j + u * W, x0, x1, dw, db, 5, 1);
                else weight_block(c, rows, g, y, j + u * W, x0, x1, dw, db, 7, 1);
            }
    }
    if (whole < walked) weight_block(c, rows, g, y, whole, x0, x1, dw, db, k, 1);
}

/* The backward of grid row y of head g for channels [j0, d), tap by tap: what the walks leave. */
static void gradient_row(const struct grid_rows *c, int g, int y, int j0, float *dw, float *db) {
    const int r = c->k / 2, hi = g % c->h, d = c->d, kk = c->k * c->k;
    const float *w = c->wt + (long)hi * kk * d;
    for (int x = 0; x < c->width; x++) {
        const long pos = c->prefix + (long)y * c->width + x;
        const float *gp = c->grad + row_offset(c->grad_at, c->h, g, pos), *vq = value_row(c, g, pos);
        float *dv = c->grad_v ? c->grad_v + row_offset(c->grad_v_at, c->h, g, pos) : NULL;
        for (int j = j0; j < d; j++) {
            float acc = 0.0f;
            if (db) db[j] += gp[j];
            for (int t = 0; t < kk; t++) {
                const int ty = t / c->k - r, tx = t % c->k - r;
                const int py = y - ty, px = x - tx, qy = y + ty, qx = x + tx;
                if (vq && py >= 0 && py < c->height && px >= 0 && px < c->width) /* d v[q]: grad at p = q - off_t */
                    acc += w[(long)t * d + j] *
                           c->grad[row_offset(c->grad_at, c->h, g, c->prefix + (long)py * c->width + px) + j];
                if (dw && qy >= 0 && qy < c->height && qx >= 0 && qx < c->width) { /* d w: v at q = p + off_t */
                    const float *vr = value_row(c, g, c->prefix + (long)qy * c->width + qx);
                    if (vr) dw[(long)t * d + j] += vr[j] * gp[j];
                }
            }
            if (dv) dv[j] = acc;
        }
    }
}

/* The backward over grid row y (the positions p of grad and q of d v): d v by walk_block over grad with the taps
 * turned round, then d w and d b by weight_block. */
static void backward_task(const void *ctx, int t, float *scratch) {
    const struct grid_rows *c = ctx;
    const int walked = walked_channels(c), r = c->k / 2, span = c->width + 2 * r;
    struct walk wk = {.src = c->grad, .dst = c->grad_v, .src_at = c->grad_at, .dst_at = c->grad_v_at};
    float *taps = walk_carve(&wk, c, scratch);
    const float **vrows = (const float **)(wk.carry + (long)c->h * wk.lines * c->k * LINE);
    if (walked && c->grad_v) pack_taps(c, taps, wk.lines, 1);
    wk.stream = c->grad_v && lined_rows(c, c->grad_v, c->grad_v_at);
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        const int bi = (int)(item / c->height), y = (int)(item % c->height);
        const uint8_t *mask = c->mask ? c->mask + (long)bi * c->s : NULL;
        wk.dst_mask = mask;
        if (walked) {
            walk_rows(c, &wk, bi, NULL, y);
            for (int hi = 0; hi < c->h; hi++)
                for (int ty = 0; ty < c->k; ty++) {
                    const float **row = vrows + ((long)hi * c->k + ty) * span;
                    for (int x = 0; x < r; x++) row[x] = row[span - 1 - x] = wk.zero;
                    walk_row(c, row + r, c->v, c->v_at, bi * c->h + hi, mask, y + ty - r, wk.zero);
                }
        }
        for (int hi = 0; hi < c->h; hi++) {
            float *dw = c->grad_w ? c->grad_w + ((long)t * c->h + hi) * c->k * c->k * c->d : NULL;
            float *db = c->grad_b ? c->grad_b + ((long)t * c->h + hi) * c->d : NULL;
            if (walked < c->d) gradient_row(c, bi * c->h + hi, y, walked, dw, db);
        }
        for (int x0 = 0; walked && x0 < c->width; x0 += WALK_COLUMNS) {
            const int x1 = x0 + WALK_COLUMNS < c->width ? x0 + WALK_COLUMNS : c->width;
            for (int hi = 0; hi < c->h; hi++) {
                const int g = bi * c->h + hi;
                if (c->grad_v) walk_heads_block(c, &wk, g, y, x0, x1, walked, 0);
                float *dw = c->grad_w ? c->grad_w + ((long)t * c->h + hi) * c->k * c->k * c->d : NULL;
                float *db = c->grad_b ? c->grad_b + ((long)t * c->h + hi) * c->d : NULL;
                if (dw || db) weight_heads_block(c, vrows, g, y, x0, x1, dw, db, walked);
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
    return for_each_task(c.tasks, threads_for(threads), walk_floats(h, d, k, width) + 2L * h * k * (width + 2 * (k / 2)),
                         backward_task, &c, 1);
}
