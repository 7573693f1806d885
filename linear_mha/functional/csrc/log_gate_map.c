/* GLA's log gates from the keys' projection, float32, and their gradient:
 *
 *   y = logsigmoid(z + b_h) / T = (min(u, 0) - log(1 + e)) / T,   u = z + b_h,  e = exp(-|u|)
 *   dz = dy sigmoid(-u) / T,   sigmoid(-u) = e / (1 + e) for u >= 0, 1 / (1 + e) below;   db_h = sum of dz
 *
 * In PyTorch ops the bias add, logsigmoid and the division are three N-sized passes, and logsigmoid alone took
 * twice GLA's whole recurrence on CPU (24 ms for 2 M values: its log is not vectorised there). log(1 + e) is taken
 * as log(w) - ((w - 1) - e) / w with w = 1 + e rounded, which keeps e's precision where w rounds to 1.
 * Rows are those of z (B, H, N, d) with element strides over (B, H, position) and a contiguous last dimension; y
 * and dz are contiguous; b is (H, d) or NULL. Entry points return 0, or -1 when a buffer could not be allocated.
 */
#include "kernel_attention.h"

struct log_gate_rows {
    const float *z, *bias, *grad;
    float *out, *grad_z, *grad_bias; /* grad_bias: (tasks, H, d) partial sums, one slice per task */
    float inv_t;
    int h, d, tasks;
    long rows, n, zsb, zsh, zsn;
};

static inline const float *row_of(const struct log_gate_rows *c, long row, int *head) {
    const long bi = row / ((long)c->h * c->n), hi = row / c->n % c->h, j = row % c->n;
    *head = (int)hi;
    return c->z + bi * c->zsb + hi * c->zsh + j * c->zsn;
}

/* logsigmoid(u) / T, and (slope != NULL) sigmoid(-u) / T into *slope */
static inline vf log_gate_vec(vf u, vf inv_t, vf *slope) {
    const vi negative = u < splat(0.0f);
    const vf e = exp_nonpositive(vselect(negative, u, -u)), w = splat(1.0f) + e;
    const vf log1p_e = log_positive(w) - ((w - splat(1.0f)) - e) / w;
    if (slope) *slope = vselect(negative, splat(1.0f), e) / w * inv_t;
    return (vmin(u, splat(0.0f)) - log1p_e) * inv_t;
}

static inline float log_gate_scalar(float u, float inv_t, float *slope) {
    const float e = exp_nonpositive_scalar(-fabsf(u)), w = 1.0f + e;
    if (slope) *slope = (u < 0.0f ? 1.0f : e) / w * inv_t;
    return ((u < 0.0f ? u : 0.0f) - log1pf(e)) * inv_t;
}

static void forward_task(const void *ctx, int t, float *scratch) {
    const struct log_gate_rows *c = ctx;
    const int d = c->d;
    const vf inv_t = splat(c->inv_t);
    long a, z;
    (void)scratch;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        int hi;
        const float *x = row_of(c, row, &hi), *b = c->bias ? c->bias + (long)hi * d : NULL;
        float *y = c->out + row * d;
        int f = 0;
        for (; f + W <= d; f += W) store(y + f, log_gate_vec(b ? load(x + f) + load(b + f) : load(x + f), inv_t, NULL));
        for (; f < d; f++) y[f] = log_gate_scalar(b ? x[f] + b[f] : x[f], c->inv_t, NULL);
    }
}

static void backward_task(const void *ctx, int t, float *scratch) {
    const struct log_gate_rows *c = ctx;
    const int d = c->d;
    const vf inv_t = splat(c->inv_t);
    float *db = c->grad_bias ? c->grad_bias + (long)t * c->h * d : NULL;
    long a, z;
    (void)scratch;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        int hi;
        const float *x = row_of(c, row, &hi), *b = c->bias ? c->bias + (long)hi * d : NULL, *g = c->grad + row * d;
        float *dz = c->grad_z + row * d, *db_h = db ? db + (long)hi * d : NULL;
        int f = 0;
        for (; f + W <= d; f += W) {
            vf slope;
            log_gate_vec(b ? load(x + f) + load(b + f) : load(x + f), inv_t, &slope);
            const vf grad = load(g + f) * slope;
            store(dz + f, grad);
            if (db_h) store(db_h + f, load(db_h + f) + grad);
        }
        for (; f < d; f++) {
            float slope;
            log_gate_scalar(b ? x[f] + b[f] : x[f], c->inv_t, &slope);
            dz[f] = g[f] * slope;
            if (db_h) db_h[f] += dz[f];
        }
    }
}

static struct log_gate_rows describe(const float *z, const float *bias, int b, int h, long n, int d, long zsb,
                                     long zsh, long zsn, float temperature, int threads) {
    struct log_gate_rows c = {z, bias, NULL, NULL, NULL, NULL, 1.0f / temperature, h, d, 0, (long)b * h * n, n,
                              zsb, zsh, zsn};
    c.tasks = row_tasks(c.rows, threads);
    return c;
}

/* out (B, H, N, d) contiguous <- logsigmoid(z + bias) / temperature. */
int lm_log_gate_map_f32(const float *z, const float *bias, float *out, int b, int h, long n, int d, long zsb,
                        long zsh, long zsn, float temperature, int threads) {
    struct log_gate_rows c = describe(z, bias, b, h, n, d, zsb, zsh, zsn, temperature, threads);
    c.out = out;
    return for_each_task(c.tasks, threads_for(threads), 1, forward_task, &c, 0);
}

/* The number of partial sums lm_log_gate_map_backward_f32 writes into grad_bias: (tasks, H, d). */
int lm_log_gate_map_tasks(int b, int h, long n, int threads) {
    return describe(NULL, NULL, b, h, n, 1, 0, 0, 0, 1.0f, threads).tasks;
}

/* grad_z (B, H, N, d) contiguous, and grad_bias (tasks, H, d) zeroed by the caller (NULL: not wanted), from grad
 * (B, H, N, d) contiguous, the gradient of the map's output. */
int lm_log_gate_map_backward_f32(const float *z, const float *bias, const float *grad, float *grad_z,
                                 float *grad_bias, int b, int h, long n, int d, long zsb, long zsh, long zsn,
                                 float temperature, int threads) {
    struct log_gate_rows c = describe(z, bias, b, h, n, d, zsb, zsh, zsn, temperature, threads);
    c.grad = grad;
    c.grad_z = grad_z;
    c.grad_bias = grad_bias;
    return for_each_task(c.tasks, threads_for(threads), 1, backward_task, &c, 0);
}
