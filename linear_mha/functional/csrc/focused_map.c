/* The focused feature map (focused.py, FLatten; the arithmetic of a row in focused.h) of every row of x in one
 * pass, float32, and its gradient, for callers that need the features themselves (a user's map built on it, or
 * attention the compiled kernels do not run). Composed from tensor ops the map is six elementwise passes, each
 * writing a fresh N-sized tensor whose page faults cost more than the arithmetic; here a row is read once and its
 * features written once. Rows are those of x (B, H, N, d) with element strides over (B, H, position) and a
 * contiguous last dimension; s is (H, d) (one scale per head and channel) or NULL. Entry points return 0, or -1
 * when a buffer could not be allocated.
 */
#include "kernel_attention.h"
#include "focused.h"

struct focused_rows {
    const float *x, *grad;
    float *out, *grad_x, *grad_scale; /* grad_scale: (tasks, H, d) partial sums, one slice per task */
    struct focused_map map;
    int h, d, tasks;
    long rows, n, xsb, xsh, xsn;
};

static inline const float *input_row(const struct focused_rows *c, long row, int *head) {
    const long bi = row / ((long)c->h * c->n), hi = row / c->n % c->h, j = row % c->n;
    *head = (int)hi;
    return c->x + bi * c->xsb + hi * c->xsh + j * c->xsn;
}

static void forward_task(const void *ctx, int t, float *scratch) {
    const struct focused_rows *c = ctx;
    long a, z;
    (void)scratch;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        int hi;
        const float *x = input_row(c, row, &hi);
        focused_features(c->out + row * c->d, x, c->d, &c->map, hi, NULL);
    }
}

/* The rows' gradients (focused.h's focused_input_grad), the scales' summed into the task's slice. */
static void backward_task(const void *ctx, int t, float *scratch) {
    const struct focused_rows *c = ctx;
    const int d = c->d;
    float *ds = c->grad_scale ? c->grad_scale + (long)t * c->h * d : NULL;
    long a, z;
    (void)scratch;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        int hi;
        const float *x = input_row(c, row, &hi);
        focused_input_grad(c->grad_x + row * d, c->grad + row * d, x, d, &c->map, hi, ds ? ds + (long)hi * d : NULL,
                           NULL);
    }
}

static struct focused_rows describe(const float *x, const float *scale, int b, int h, long n, int d, long xsb,
                                    long xsh, long xsn, float power, int threads) {
    struct focused_rows c = {x, NULL, NULL, NULL, NULL, focused_settings(power, scale), h, d, 0, (long)b * h * n, n,
                             xsb, xsh, xsn};
    c.tasks = row_tasks(c.rows, threads);
    return c;
}

/* out (B, H, N, d) contiguous <- the map of x. */
int lm_focused_map_f32(const float *x, const float *scale, float *out, int b, int h, long n, int d, long xsb,
                       long xsh, long xsn, float power, int threads) {
    struct focused_rows c = describe(x, scale, b, h, n, d, xsb, xsh, xsn, power, threads);
    c.out = out;
    return for_each_task(c.tasks, threads_for(threads), 1, forward_task, &c, 0);
}

/* The number of partial sums lm_focused_map_backward_f32 writes into grad_scale: (tasks, H, d). */
int lm_focused_map_tasks(int b, int h, long n, int threads) {
    return describe(NULL, NULL, b, h, n, 1, 0, 0, 0, 1.0f, threads).tasks;
}

/* grad_x (B, H, N, d) contiguous, and grad_scale (tasks, H, d) zeroed by the caller (NULL: not wanted), from grad
 * (B, H, N, d) contiguous, the gradient of the map's output. */
int lm_focused_map_backward_f32(const float *x, const float *scale, const float *grad, float *grad_x,
                                float *grad_scale, int b, int h, long n, int d, long xsb, long xsh, long xsn,
                                float power, int threads) {
    struct focused_rows c = describe(x, scale, b, h, n, d, xsb, xsh, xsn, power, threads);
    c.grad = grad;
    c.grad_x = grad_x;
    c.grad_scale = grad_scale;
    return for_each_task(c.tasks, threads_for(threads), 1, backward_task, &c, 0);
}
