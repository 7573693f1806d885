/* The focused feature map (focused.py, FLatten) of every row of x in one pass, float32, and its gradient:
 *
 *   y = (relu(x) + 1e-6) / s,   phi = y^p |y| / |y^p|    (elementwise power p, L2 norms over the row)
 *
 * computed on u = y / max(y), in (0, 1], so neither the power nor the norms overflow: phi = m |u| u^p / |u^p|.
 * Composed from tensor ops the map is six elementwise passes, each writing a fresh N-sized tensor whose page
 * faults cost more than the arithmetic; here a row is read once and its features written once. Rows are those
 * of x (B, H, N, d) with element strides over (B, H, position) and a contiguous last dimension; s is (H, d)
 * (one scale per head and channel) or NULL. Entry points return 0, or -1 when a buffer could not be allocated.
 */
#include "kernel_attention.h"

#define FOCUSED_EPS 1e-6f /* focused.RELU_EPS */

struct focused_rows {
    const float *x, *scale, *grad;
    float *out, *grad_x, *grad_scale; /* grad_scale: (tasks, H, d) partial sums, one slice per task */
    int h, d, tasks;
    long rows, n, xsb, xsh, xsn;
    float power;
    int integer_power; /* p when p is a whole number in 1..8 (the power by multiplication), else 0 */
};

static inline float power_of(float u, const struct focused_rows *c) {
    if (c->integer_power) {
        float z = u;
        for (int i = 1; i < c->integer_power; i++) z *= u;
        return z;
    }
    return powf(u, c->power);
}

static inline vf power_vec(vf u, const struct focused_rows *c) {
    if (c->integer_power) {
        vf z = u;
        for (int i = 1; i < c->integer_power; i++) z *= u;
        return z;
    }
    vf z;
    for (int i = 0; i < W; i++) z[i] = powf(u[i], c->power);
    return z;
}

static inline float relu_eps(float x) { return (x > 0.0f ? x : 0.0f) + FOCUSED_EPS; }

/* y (the scaled features), u = y / max(y) and z = u^p of one row; returns max(y) and sets |u|, |u^p|. The
 * divisions are divisions, as in the composed map. */
static inline float focused_row(const struct focused_rows *c, const float *x, const float *s, float *y, float *u,
                                float *z, float *norm_u, float *norm_z) {
    const int d = c->d;
    int f = 0;
    vf top_v = splat(0.0f);
    for (; f + W <= d; f += W) {
        const vf xv = load(x + f), r = vselect(xv > splat(0.0f), xv, splat(0.0f)) + splat(FOCUSED_EPS);
        const vf yv = s ? r / load(s + f) : r;
        store(y + f, yv);
        top_v = vselect(yv > top_v, yv, top_v);
    }
    float top = 0.0f;
    for (int i = 0; i < W; i++) top = top_v[i] > top ? top_v[i] : top;
    for (; f < d; f++) {
        y[f] = s ? relu_eps(x[f]) / s[f] : relu_eps(x[f]);
        top = y[f] > top ? y[f] : top;
    }
    vf su_v = splat(0.0f), sz_v = splat(0.0f);
    for (f = 0; f + W <= d; f += W) {
        const vf uv = load(y + f) / splat(top), zv = power_vec(uv, c);
        store(u + f, uv);
        store(z + f, zv);
        su_v += uv * uv;
        sz_v += zv * zv;
    }
    float su = 0.0f, sz = 0.0f;
    for (int i = 0; i < W; i++) {
        su += su_v[i];
        sz += sz_v[i];
    }
    for (; f < d; f++) {
        u[f] = y[f] / top;
        z[f] = power_of(u[f], c);
        su += u[f] * u[f];
        sz += z[f] * z[f];
    }
    *norm_u = sqrtf(su);
    *norm_z = sqrtf(sz);
    return top;
}

static inline const float *input_row(const struct focused_rows *c, long row, int *head) {
    const long bi = row / ((long)c->h * c->n), hi = row / c->n % c->h, j = row % c->n;
    *head = (int)hi;
    return c->x + bi * c->xsb + hi * c->xsh + j * c->xsn;
}

static void forward_task(const void *ctx, int t, float *scratch) {
    const struct focused_rows *c = ctx;
    const int d = c->d;
    float *y = scratch, *u = y + d;
    long a, z;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        int hi;
        const float *x = input_row(c, row, &hi);
        float *phi = c->out + row * d, norm_u, norm_z;
        const float top = focused_row(c, x, c->scale ? c->scale + (long)hi * d : NULL, y, u, phi, &norm_u, &norm_z);
        scaled_copy(phi, phi, d, top * norm_u / norm_z);
    }
}

/* With G the gradient of phi, S = G . u^p and A = |u|, Z = |u^p|, the gradient of y (m cancels, phi being
 * homogeneous of degree 1 in y):  dy = u (S / (A Z)) + (A p u^(p-1) / Z) (G - S u^p / Z^2);  then
 * dx = dy / s where x > 0 (else 0), and ds = -dy y / s, summed over rows into the task's slice. */
static void backward_task(const void *ctx, int t, float *scratch) {
    const struct focused_rows *c = ctx;
    const int d = c->d;
    float *y = scratch, *u = y + d, *zp = u + d;
    float *ds = c->grad_scale ? c->grad_scale + (long)t * c->h * d : NULL;
    long a, z;
    task_range(c->rows, c->tasks, t, &a, &z);
    for (long row = a; row < z; row++) {
        int hi;
        const float *x = input_row(c, row, &hi), *s = c->scale ? c->scale + (long)hi * d : NULL;
        const float *g = c->grad + row * d;
        float norm_u, norm_z;
        focused_row(c, x, s, y, u, zp, &norm_u, &norm_z);
        float dot = 0.0f;
        for (int f = 0; f < d; f++) dot += g[f] * zp[f];
        const float radial = dot / (norm_u * norm_z), tangential = norm_u * c->power / norm_z;
        const float along = dot / (norm_z * norm_z);
        float *dx = c->grad_x + row * d;
        int f = 0;
        if (c->integer_power)
            for (; f + W <= d; f += W) {
                const vf uv = load(u + f), zv = load(zp + f), xv = load(x + f);
                const vf dy = uv * splat(radial) + splat(tangential) * (zv / uv) * (load(g + f) - splat(along) * zv);
                const vf scale = s ? load(s + f) : splat(1.0f);
                store(dx + f, vselect(xv > splat(0.0f), dy / scale, splat(0.0f)));
                if (ds) store(ds + (long)hi * d + f, load(ds + (long)hi * d + f) - dy * load(y + f) / scale);
            }
        for (; f < d; f++) {
            const float u_p1 = c->integer_power ? zp[f] / u[f] : powf(u[f], c->power - 1.0f);
            const float dy = u[f] * radial + tangential * u_p1 * (g[f] - along * zp[f]);
            const float scale = s ? s[f] : 1.0f;
            dx[f] = x[f] > 0.0f ? dy / scale : 0.0f;
            if (ds) ds[(long)hi * d + f] -= dy * y[f] / scale;
        }
    }
}

static struct focused_rows describe(const float *x, const float *scale, int b, int h, long n, int d, long xsb,
                                    long xsh, long xsn, float power, int threads) {
    const float whole = floorf(power);
    struct focused_rows c = {x, scale, NULL, NULL, NULL, NULL, h, d, 0, (long)b * h * n, n, xsb, xsh, xsn,
                             power, whole == power && power >= 1.0f && power <= 8.0f ? (int)power : 0};
    c.tasks = row_tasks(c.rows, threads);
    return c;
}

/* out (B, H, N, d) contiguous <- the map of x. */
int lm_focused_map_f32(const float *x, const float *scale, float *out, int b, int h, long n, int d, long xsb,
                       long xsh, long xsn, float power, int threads) {
    struct focused_rows c = describe(x, scale, b, h, n, d, xsb, xsh, xsn, power, threads);
    c.out = out;
    return for_each_task(c.tasks, threads_for(threads), 2L * d, forward_task, &c);
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
    return for_each_task(c.tasks, threads_for(threads), 3L * d, backward_task, &c);
}
