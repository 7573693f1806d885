/* SiLU then unit norm of every row, y = s / max(|s|, eps) with s = x sigmoid(x): the delta rule's queries and keys
 * (methods/delta_rule.py), float32, and its gradient. Composed from tensor ops it is five N-sized passes forward,
 * more backward, each writing a fresh tensor whose page faults cost more than the arithmetic (they were half of
 * DeltaNet's forward at N = 4k); here a row is read once and written once. Rows are those of x (B, H, N, d) with
 * element strides over (B, H, position) and a contiguous last dimension; outputs and gradients are contiguous.
 * Entry points return 0, or -1 when a buffer could not be allocated.
 *
 * Backward, with g the output's gradient and n = |s|: ds = (g - y (y . g)) / n where n > eps, g / eps where the
 * norm was clamped; dx = ds silu'(x), silu'(x) = sigmoid(x) + x sigmoid(x) sigmoid(-x).
 */
#include "kernel_attention.h"

struct silu_unit_rows {
    const float *x, *grad;
    float *out, *grad_x;
    float eps;
    int h, d, tasks;
    long rows, n, xsb, xsh, xsn;
};

static inline const float *row_of(const struct silu_unit_rows *c, long row) {
    const long bi = row / ((long)c->h * c->n), hi = row / c->n % c->h, j = row % c->n;
    return c->x + bi * c->xsb + hi * c->xsh + j * c->xsn;
}

/* silu(x) and, with slope, its derivative, from e = exp(-|x|) so that nothing overflows: sigmoid(x) is 1 / (1 + e)
 * for x >= 0, e / (1 + e) below, and sigmoid(x) sigmoid(-x) = e / (1 + e)^2. */
static inline vf silu_vec(vf x, vf *slope) {
    const vi negative = x < splat(0.0f);
    const vf e = exp_nonpositive(vselect(negative, x, -x)), inv = splat(1.0f) / (splat(1.0f) + e);
    const vf sig = vselect(negative, e, splat(1.0f)) * inv;
    if (slope) *slope = sig + x * e * inv * inv;
    return x * sig;
}

static inline float silu_scalar(float x, float *slope) {
    const float e = exp_nonpositive_scalar(-fabsf(x)), inv = 1.0f / (1.0f + e), sig = (x < 0.0f ? e : 1.0f) * inv;
    if (slope) *slope = sig + x * e * inv * inv;
    return x * sig;
}

/* s = silu(x) into dst (and its derivative into slope, unless NULL); returns |s|^2. */
static float silu_row(float *dst, float *slope, const float *x, int d) {
    vf sum = splat(0.0f), dv;
    int f = 0;
    for (; f + W <= d; f += W) {
        const vf s = silu_vec(load(x + f), slope ? &dv : NULL);
        store(dst + f, s);
        if (slope) store(slope + f, dv);
        sum += s * s;
    }
    float total = hsum(sum);
    for (; f < d; f++) {
        dst[f] = silu_scalar(x[f], slope ? slope + f : NULL);
        total += dst[f] * dst[f];
    }
    return total;
}

static inline float norm_or_eps(float squares, float eps) {
    const float n = sqrtf(squares);
    return n > eps ? n : eps;
}

static void forward_task(const void *ctx, int t, float *scratch) {
    const struct silu_unit_rows *c = ctx;
    const int d = c->d;
    long a, z;
    (void)scratch;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        float *y = c->out + row * d;
        const float inv = 1.0f / norm_or_eps(silu_row(y, NULL, row_of(c, row), d), c->eps);
        for (int f = 0; f < d; f++) y[f] *= inv;
    }
}

static void backward_task(const void *ctx, int t, float *scratch) {
    const struct silu_unit_rows *c = ctx;
    const int d = c->d;
    float *s = scratch, *slope = s + d;
    long a, z;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        const float squares = silu_row(s, slope, row_of(c, row), d), n = sqrtf(squares);
        const float *g = c->grad + row * d;
        float *dx = c->grad_x + row * d;
        if (n > c->eps) { /* y = s / n; ds = (g - y (y . g)) / n = (g - s (s . g) / n^2) / n */
            const float inv = 1.0f / n, along = dot_product(s, g, d) * inv * inv;
            for (int f = 0; f < d; f++) dx[f] = (g[f] - s[f] * along) * inv * slope[f];
        } else {
            const float inv = 1.0f / c->eps;
            for (int f = 0; f < d; f++) dx[f] = g[f] * inv * slope[f];
        }
    }
}

static struct silu_unit_rows describe(const float *x, int b, int h, long n, int d, long xsb, long xsh, long xsn,
                                      float eps, int threads) {
    struct silu_unit_rows c = {x, NULL, NULL, NULL, eps, h, d, 0, (long)b * h * n, n, xsb, xsh, xsn};
    c.tasks = row_tasks(c.rows, threads);
    return c;
}

/* out (B, H, N, d) contiguous <- the map of x. */
int lm_silu_unit_map_f32(const float *x, float *out, int b, int h, long n, int d, long xsb, long xsh, long xsn,
                         float eps, int threads) {
    struct silu_unit_rows c = describe(x, b, h, n, d, xsb, xsh, xsn, eps, threads);
    c.out = out;
    return for_each_task(c.tasks, threads_for(threads), 1, forward_task, &c, 0);
}

/* grad_x (B, H, N, d) contiguous from grad (B, H, N, d) contiguous, the gradient of the map's output. */
int lm_silu_unit_map_backward_f32(const float *x, const float *grad, float *grad_x, int b, int h, long n, int d,
                                  long xsb, long xsh, long xsn, float eps, int threads) {
    struct silu_unit_rows c = describe(x, b, h, n, d, xsb, xsh, xsn, eps, threads);
    c.grad = grad;
    c.grad_x = grad_x;
    return for_each_task(c.tasks, threads_for(threads), 2L * d, backward_task, &c, 0);
}
