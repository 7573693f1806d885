/* Hedgehog's learned feature map (hedgehog.py) of one row, and its gradient, float32: the arithmetic the map's own
 * pass (hedgehog_map.c, on values projected already) and the attention kernels' row loaders (map 8,
 * kernel_attention.h, projection included) run.
 *
 *   z = x W + b,   phi = [softmax(z), softmax(-z)]      (x: d values, z: m, phi: 2m; each softmax over the m)
 *
 * In the row loaders the queries and the keys have maps of their own: heads 0 .. H - 1 read the queries' W and b,
 * heads H .. 2H - 1 the keys'. */
#ifndef LINEAR_MHA_HEDGEHOG_H
#define LINEAR_MHA_HEDGEHOG_H
#include "simd.h"

#define HEDGEHOG_MAX_M 256 /* native.HEDGEHOG_MAX_M: a row's projections live on the stack */

/* e = exp(sign * (x - extreme)), all exponents <= 0; returns the sum of e. */
static inline float shifted_exps(float *e, const float *x, int m, float extreme, float sign) {
    vf sum_v = splat(0.0f);
    int f = 0;
    for (; f + W <= m; f += W) {
        const vf ev = exp_nonpositive(splat(sign) * (load(x + f) - splat(extreme)));
        store(e + f, ev);
        sum_v += ev;
    }
    float sum = hsum(sum_v);
    for (; f < m; f++) {
        const float a = sign * (x[f] - extreme);
        sum += e[f] = a < -87.3f ? 0.0f : expf(a);
    }
    return sum;
}

/* phi (2m) = [softmax(z), softmax(-z)] of m values z. */
static inline void double_softmax(float *phi, const float *z, int m) {
    float top = -INFINITY, bottom = INFINITY;
    for (int f = 0; f < m; f++) {
        top = z[f] > top ? z[f] : top;
        bottom = z[f] < bottom ? z[f] : bottom;
    }
    scaled_copy(phi, phi, m, 1.0f / shifted_exps(phi, z, m, top, 1.0f));
    scaled_copy(phi + m, phi + m, m, 1.0f / shifted_exps(phi + m, z, m, bottom, -1.0f));
}

/* The maps' settings as hedgehog.HedgehogMap lays them out in one float array: [d, m, W (2H x d x m),
 * b (2H x m)]; its gradient has the same layout. */
struct hedgehog_map {
    const float *w, *b;
    int d, m, h;
    long len; /* floats in the layout, the size of a thread's slice of the gradient */
};

static inline struct hedgehog_map hedgehog_settings(const float *data, int h) {
    struct hedgehog_map c = {NULL, NULL, 0, 0, h, 0};
    if (!data) return c;
    c.d = (int)data[0];
    c.m = (int)data[1];
    c.w = data + 2;
    c.b = c.w + 2L * h * c.d * c.m;
    c.len = 2 + 2L * h * c.d * c.m + 2L * h * c.m;
    return c;
}

/* z (m) = x W + b for the map of head (0 .. 2H - 1). */
static inline void hedgehog_project(const struct hedgehog_map *c, const float *x, int head, float *z) {
    const int m = c->m;
    const float *w = c->w + (long)head * c->d * m;
    memcpy(z, c->b + (long)head * m, sizeof(float) * m);
    for (int e = 0; e < c->d; e++, w += m) {
        const float xe = x[e];
        int f = 0;
        for (; f + W <= m; f += W) store(z + f, load(z + f) + splat(xe) * load(w + f));
        for (; f < m; f++) z[f] += xe * w[f];
    }
}

static inline void hedgehog_features(float *phi, const float *x, const struct hedgehog_map *c, int head) {
    float z[HEDGEHOG_MAX_M];
    hedgehog_project(c, x, head, z);
    double_softmax(phi, z, c->m);
}

/* dx (d) from g (2m), the gradient of the row's features; with grad (a thread's slice of the layout, or NULL) the
 * row's share of d W (x^T dz) and d b (dz) added. With s, u the two softmaxes and g1, g2 the halves of g:
 * dz = s (g1 - s.g1) - u (g2 - u.g2), dx = W dz. */
static inline void hedgehog_input_grad(float *dx, const float *g, const float *x, const struct hedgehog_map *c,
                                       int head, float *grad) {
    const int m = c->m;
    float z[HEDGEHOG_MAX_M], phi[2 * HEDGEHOG_MAX_M], dz[HEDGEHOG_MAX_M];
    hedgehog_project(c, x, head, z);
    double_softmax(phi, z, m);
    const float *s = phi, *u = phi + m;
    const float sg = dot_product(s, g, m), ug = dot_product(u, g + m, m);
    int f = 0;
    for (; f + W <= m; f += W)
        store(dz + f, load(s + f) * (load(g + f) - splat(sg)) - load(u + f) * (load(g + m + f) - splat(ug)));
    for (; f < m; f++) dz[f] = s[f] * (g[f] - sg) - u[f] * (g[m + f] - ug);
    const float *w = c->w + (long)head * c->d * m;
    for (int e = 0; e < c->d; e++) dx[e] = dot_product(w + (long)e * m, dz, m);
    if (!grad) return;
    float *dw = grad + 2 + (long)head * c->d * m, *db = grad + 2 + 2L * c->h * c->d * m + (long)head * m;
    for (int e = 0; e < c->d; e++, dw += m) {
        const float xe = x[e];
        for (f = 0; f + W <= m; f += W) store(dw + f, load(dw + f) + splat(xe) * load(dz + f));
        for (; f < m; f++) dw[f] += xe * dz[f];
    }
    for (f = 0; f < m; f++) db[f] += dz[f];
}

#endif
