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

/* acc[0..d) (registers, 4 vectors at a time) = bias + sum over the taps of w * v for grid cell (y, x) of head g,
 * then res = out + acc. */
static void output_row(const struct grid_rows *c, int g, int y, int x, float *acc) {
    const int r = c->k / 2, hi = g % c->h, d = c->d;
    const float *rows[c->k * c->k];
    for (int ty = 0; ty < c->k; ty++)
        for (int tx = 0; tx < c->k; tx++) {
            const int yy = y + ty - r, xx = x + tx - r;
            const int inside = yy >= 0 && yy < c->height && xx >= 0 && xx < c->width;
            rows[ty * c->k + tx] = inside ? value_row(c, g, c->prefix + (long)yy * c->width + xx) : NULL;
        }
    const float *w = c->wt + (long)hi * c->k * c->k * d;
    if (c->bias) memcpy(acc, c->bias + (long)hi * d, sizeof(float) * d);
    else memset(acc, 0, sizeof(float) * d);
    int j = 0;
    for (; j + 4 * W <= d; j += 4 * W) {
        vf a0 = load(acc + j), a1 = load(acc + j + W), a2 = load(acc + j + 2 * W), a3 = load(acc + j + 3 * W);
        for (int t = 0; t < c->k * c->k; t++) {
            if (!rows[t]) continue;
            const float *vr = rows[t] + j, *wr = w + (long)t * d + j;
            a0 += load(wr) * load(vr);
            a1 += load(wr + W) * load(vr + W);
            a2 += load(wr + 2 * W) * load(vr + 2 * W);
            a3 += load(wr + 3 * W) * load(vr + 3 * W);
        }
        store(acc + j, a0); store(acc + j + W, a1); store(acc + j + 2 * W, a2); store(acc + j + 3 * W, a3);
    }
    for (; j + W <= d; j += W) {
        vf a = load(acc + j);
        for (int t = 0; t < c->k * c->k; t++)
            if (rows[t]) a += load(w + (long)t * d + j) * load(rows[t] + j);
        store(acc + j, a);
    }
    for (; j < d; j++)
        for (int t = 0; t < c->k * c->k; t++)
            if (rows[t]) acc[j] += w[(long)t * d + j] * rows[t][j];
    const long pos = c->prefix + (long)y * c->width + x;
    const float *o = c->out + row_offset(c->out_at, c->h, g, pos);
    float *res = c->res + row_offset(c->res_at, c->h, g, pos);
    for (j = 0; j + W <= d; j += W) store(acc + j, load(acc + j) + load(o + j));
    for (; j < d; j++) acc[j] += o[j];
    put_row(res, acc, d, c->stream);
}

static void forward_task(const void *ctx, int t, float *acc) {
    const struct grid_rows *c = ctx;
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        const int bi = (int)(item / c->height), y = (int)(item % c->height);
        for (int x = 0; x < c->width; x++)
            for (int hi = 0; hi < c->h; hi++) output_row(c, bi * c->h + hi, y, x, acc);
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

/* d v of position q = (y, x) of head g (where c->grad_v is set), and its terms of d w into dw (k k x d) of this
 * task (dw NULL: not wanted). */
static void gradient_row(const struct grid_rows *c, int g, int y, int x, float *dv, float *dw) {
    const int r = c->k / 2, hi = g % c->h, d = c->d, want_v = c->grad_v != NULL;
    if (!want_v && !dw) return;
    const long pos = c->prefix + (long)y * c->width + x;
    const float *vq = value_row(c, g, pos), *w = c->wt + (long)hi * c->k * c->k * d;
    memset(dv, 0, sizeof(float) * d);
    if (vq)
        for (int ty = 0; ty < c->k; ty++)
            for (int tx = 0; tx < c->k; tx++) {
                const int yy = y - (ty - r), xx = x - (tx - r), t = ty * c->k + tx;
                if (yy < 0 || yy >= c->height || xx < 0 || xx >= c->width) continue;
                const float *gp = c->grad + row_offset(c->grad_at, c->h, g, c->prefix + (long)yy * c->width + xx);
                const float *wr = w + (long)t * d;
                float *dwr = dw ? dw + (long)t * d : NULL;
                int j = 0;
                for (; j + W <= d; j += W) {
                    const vf gv = load(gp + j);
                    if (want_v) store(dv + j, load(dv + j) + load(wr + j) * gv);
                    if (dwr) store(dwr + j, load(dwr + j) + load(vq + j) * gv);
                }
                for (; j < d; j++) {
                    if (want_v) dv[j] += wr[j] * gp[j];
                    if (dwr) dwr[j] += vq[j] * gp[j];
                }
            }
    if (c->grad_v) put_row(c->grad_v + row_offset(c->grad_v_at, c->h, g, pos), dv, d, c->stream);
}

static void backward_task(const void *ctx, int t, float *dv) {
    const struct grid_rows *c = ctx;
    const int kk = c->k * c->k;
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        const int bi = (int)(item / c->height), y = (int)(item % c->height);
        for (int x = 0; x < c->width; x++)
            for (int hi = 0; hi < c->h; hi++) {
                const int g = bi * c->h + hi;
                float *dw = c->grad_w ? c->grad_w + ((long)t * c->h + hi) * kk * c->d : NULL;
                gradient_row(c, g, y, x, dv, dw);
                if (c->grad_b) {
                    const float *gp = c->grad + row_offset(c->grad_at, c->h, g, c->prefix + (long)y * c->width + x);
                    float *db = c->grad_b + ((long)t * c->h + hi) * c->d;
                    for (int j = 0; j < c->d; j++) db[j] += gp[j];
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
    return for_each_task(c.tasks, threads_for(threads), d, forward_task, &c, 0);
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
    return for_each_task(c.tasks, threads_for(threads), d, backward_task, &c, 1);
}
