/* The local term of the attention modules (linear_mha/local_term.py, functional/grid_conv.py), added to attention's
 * output: per batch entry b, head h and grid position p (a row of d values),
 *
 *   res[p] = out[p] + bias_h + sum_t w_h[t] * v[p + off_t],     t over the k x k taps, off_t = (ty - r, tx - r),
 *
 * r = k / 2, zero outside the grid; the sequence is `prefix` tokens with no local term (res = out there) followed
 * by a row-major height x width grid; a masked position's values count as zero. torch's depthwise conv2d over
 * these shapes ran at a few GFLOP/s (43 ms at 16,384 tokens of 512 on a 2-core EPYC) and its output was one more
 * N-sized tensor to add: here each task walks grid rows (the walk in grid_conv.h), each value row is read once a
 * grid row, and each output row is written once. The backward (grid_conv_backward.c), for every position q and
 * each tap with p = q - off_t in the grid:
 *
 *   d v[q] += w_h[t] * grad[p]   (0 where q is masked or a prefix token),
 *   d w_h[t] += v[q] * grad[p],   d bias_h += grad[p] over grid positions p,
 *
 * d w and d b summed per task into the caller's (tasks, H, k k, d) and (tasks, H, d) slices, so the sums do not
 * depend on which thread ran which task. d out is grad itself. Rows are addressed through (batch, head, position)
 * strides (struct rows_at), each row contiguous; wt (H, k k, d) and bias (H, d) contiguous, bias may be NULL; mask
 * (B, S) bytes, nonzero = masked, or NULL. Entry points return 0, or -1 when a buffer could not be allocated. */
#include "grid_conv.h"

/* res = out + bias + sum over the taps of w * v for grid cell (y, x) of head g, channels [j0, d): the taps read
 * one at a time. What the walks (grid_conv.h) leave: kernels wider than WALK_MAX_K and the last d % W channels. */
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

static void forward_task(const void *ctx, int t, float *scratch) {
    const struct grid_rows *c = ctx;
    const int walked = walked_channels(c);
    struct walk wk = {.src = c->v, .add = c->out, .bias = c->bias, .dst = c->res, .src_at = c->v_at,
                      .add_at = c->out_at, .dst_at = c->res_at};
    float *taps = walk_carve(&wk, c, scratch);
    if (walked) pack_taps(c, taps, wk.lines, 0);
    wk.stream = c->res != c->out && lined_rows(c, c->res, c->res_at); /* in place, out's lines were just read */
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        const int bi = (int)(item / c->height), y = (int)(item % c->height);
        if (walked) {
            walk_rows(c, &wk, bi, c->mask ? c->mask + (long)bi * c->s : NULL, y);
            for (int x0 = 0; x0 < c->width; x0 += WALK_COLUMNS)
                for (int hi = 0; hi < c->h; hi++)
                    walk_heads_block(c, &wk, bi * c->h + hi, y, x0, x0 + WALK_COLUMNS < c->width ? x0 + WALK_COLUMNS
                                                                                               : c->width, walked, 1);
        }
        if (walked < c->d)
            for (int hi = 0; hi < c->h; hi++)
                for (int x = 0; x < c->width; x++) output_row(c, bi * c->h + hi, y, x, walked);
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
    return for_each_task(c.tasks, threads_for(threads), walk_floats(h, d, k, width), forward_task, &c, 0);
}
