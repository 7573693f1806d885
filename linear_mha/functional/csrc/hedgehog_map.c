/* Hedgehog's feature map after its projection (hedgehog.py): for every row z of m projected values, plus the
 * head's bias,
 *
 *   phi = [softmax(z + b), softmax(-(z + b))]      (2m features, each softmax over the m values)
 *
 * in one pass, float32, and its gradient. Composed from tensor ops this is a bias add, a negation, two softmaxes
 * and a concatenation, each a fresh N-sized tensor whose page faults cost more than the arithmetic. z is
 * (B, H, N, m) contiguous, b (H, m) or NULL, phi (B, H, N, 2m) contiguous. Entry points return 0, or -1 when a
 * buffer could not be allocated.
 */
#include "kernel_attention.h"

struct hedgehog_rows {
    const float *z, *bias, *grad;
    float *out, *grad_z, *grad_bias; /* grad_bias: (tasks, H, m) partial sums, one slice per task */
    int h, m, tasks;
    long rows, n;
};

/* The row's biased values into zb and its 2m features into phi. */
static inline void hedgehog_row(const struct hedgehog_rows *c, long row, float *zb, float *phi) {
    const int m = c->m;
    const float *z = c->z + row * m, *b = c->bias ? c->bias + (row / c->n % c->h) * m : NULL;
    for (int f = 0; f < m; f++) zb[f] = b ? z[f] + b[f] : z[f];
    double_softmax(phi, zb, m);
}

static void forward_task(const void *ctx, int t, float *scratch) {
    const struct hedgehog_rows *c = ctx;
    long a, z;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) hedgehog_row(c, row, scratch, c->out + row * 2 * c->m);
}

/* dz of each row (double_softmax_grad), and its share of d b. */
static void backward_task(const void *ctx, int t, float *scratch) {
    const struct hedgehog_rows *c = ctx;
    const int m = c->m;
    float *zb = scratch, *phi = zb + m, *db = c->grad_bias ? c->grad_bias + (long)t * c->h * m : NULL;
    long a, z;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        hedgehog_row(c, row, zb, phi);
        float *dz = c->grad_z + row * m;
        double_softmax_grad(dz, c->grad + row * 2 * m, phi, m);
        if (db) {
            float *dbh = db + (row / c->n % c->h) * m;
            for (int f = 0; f < m; f++) dbh[f] += dz[f];
        }
    }
}

static struct hedgehog_rows describe(int b, int h, long n, int m, int threads) {
    struct hedgehog_rows c = {NULL, NULL, NULL, NULL, NULL, NULL, h, m, 0, (long)b * h * n, n};
    c.tasks = row_tasks(c.rows, threads);
    return c;
}

/* out (B, H, N, 2m) <- the features of z (B, H, N, m) and bias (H, m) or NULL. */
int lm_hedgehog_map_f32(const float *z, const float *bias, float *out, int b, int h, long n, int m, int threads) {
    struct hedgehog_rows c = describe(b, h, n, m, threads);
    c.z = z;
    c.bias = bias;
    c.out = out;
    return for_each_task(c.tasks, threads_for(threads), 3L * m, forward_task, &c, 0);
}

/* The number of partial sums lm_hedgehog_map_backward_f32 writes into grad_bias: (tasks, H, m). */
int lm_hedgehog_map_tasks(int b, int h, long n, int threads) { return describe(b, h, n, 1, threads).tasks; }

/* grad_z (B, H, N, m) and grad_bias (tasks, H, m), zeroed by the caller (NULL: not wanted), from grad
 * (B, H, N, 2m), the gradient of the features; all contiguous. */
int lm_hedgehog_map_backward_f32(const float *z, const float *bias, const float *grad, float *grad_z,
                                 float *grad_bias, int b, int h, long n, int m, int threads) {
    struct hedgehog_rows c = describe(b, h, n, m, threads);
    c.z = z;
    c.bias = bias;
    c.grad = grad;
    c.grad_z = grad_z;
    c.grad_bias = grad_bias;
    return for_each_task(c.tasks, threads_for(threads), 3L * m, backward_task, &c, 0);
}
