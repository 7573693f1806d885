/* The focused feature map (focused.py, FLatten) of one row, and its gradient, float32: the arithmetic both the
 * map's own pass (focused_map.c) and the attention kernels' row loaders (map 6, kernel_attention.h) run.
 *
 *   y = (relu(x) + 1e-6) / s,   phi = y^p |y| / |y^p|    (elementwise power p, L2 norms over the row)
 *
 * computed on u = y / max(y), in (0, 1], so neither the power nor the norms overflow: phi = m |u| u^p / |u^p|.
 */
#ifndef LINEAR_MHA_FOCUSED_H
#define LINEAR_MHA_FOCUSED_H
#include "simd.h"

#define FOCUSED_EPS 1e-6f /* focused.RELU_EPS */

/* The map's settings: the focusing power, and the scales s of every head (H x d) or NULL. */
struct focused_map {
    float power;
    int integer_power; /* p when p is a whole number in 1..8 (the power by multiplication), else 0 */
    const float *scale;
};

static inline struct focused_map focused_settings(float power, const float *scale) {
    const float whole = floorf(power);
    const struct focused_map m = {power, whole == power && power >= 1.0f && power <= 8.0f ? (int)power : 0, scale};
    return m;
}

static inline float power_of(float u, const struct focused_map *c) {
    if (c->integer_power) {
        float z = u;
        for (int i = 1; i < c->integer_power; i++) z *= u;
        return z;
    }
    return powf(u, c->power);
}

static inline vf power_vec(vf u, const struct focused_map *c) {
    if (c->integer_power) {
        vf z = u;
        for (int i = 1; i < c->integer_power; i++) z *= u;
        return z;
    }
    /* u in (0, 1]: u^p = exp(p ln u), every exponent <= 0 (vectors, where powf went lane by lane at a third of
     * the speed); below about e^-87.68 it is 0, as the feature it scales is nothing beside the row's largest, 1. */
    return exp_nonpositive(splat(c->power) * log_positive(u));
}

static inline float relu_eps(float x) { return (x > 0.0f ? x : 0.0f) + FOCUSED_EPS; }

/* a / b for the scales, which are positive and normal: with AVX-512 as a times 1 / b from vrcp14ps and one Newton
 * step (within 2 ulp of the quotient), as a vector division occupies its port for about as long as a row's share
 * of the GEMMs, and every focused row with scales made one per vector. */
static inline vf divide_by_scale(vf a, vf b) {
#ifdef __AVX512F__
    const vf r = (vf)_mm512_rcp14_ps((__m512)b);
    return a * (r * (splat(2.0f) - b * r));
#else
    return a / b;
#endif
}

/* y (the scaled features), u = y / max(y) and z = u^p of a row of d values, s its head's scales or NULL; returns
 * max(y) and sets |u|, |u^p|. */
static inline float focused_row(const struct focused_map *c, const float *x, const float *s, int d, float *y,
                                float *u, float *z, float *norm_u, float *norm_z) {
    int f = 0;
    vf top_v = splat(0.0f);
    for (; f + W <= d; f += W) {
        const vf xv = load(x + f), r = vmax(xv, splat(0.0f)) + splat(FOCUSED_EPS);
        const vf yv = s ? divide_by_scale(r, load(s + f)) : r;
        store(y + f, yv);
        top_v = vmax(yv, top_v);
    }
    float top = hmax(top_v);
    for (; f < d; f++) {
        y[f] = s ? relu_eps(x[f]) / s[f] : relu_eps(x[f]);
        top = y[f] > top ? y[f] : top;
    }
    /* |u^p|^2 >= 1 (the largest u is 1), so squares below 1e-36 cannot change it; they are left out because the
     * hardware makes subnormal products (u ~ 1e-7 at an epsilon-only feature, p = 3: u^6 ~ 1e-40) very slowly,
     * which measured a third of the focused forward's time. */
    const float inv_top = 1.0f / top, tiny = 1e-18f;
    vf su_v = splat(0.0f), sz_v = splat(0.0f);
    for (f = 0; f + W <= d; f += W) {
        const vf uv = load(y + f) * splat(inv_top), zv = power_vec(uv, c);
        const vf zs = vselect(zv > splat(tiny), zv, splat(0.0f));
        store(u + f, uv);
        store(z + f, zv);
        su_v += uv * uv;
        sz_v += zs * zs;
    }
    float su = hsum(su_v), sz = hsum(sz_v);
    for (; f < d; f++) {
        u[f] = y[f] * inv_top;
        z[f] = power_of(u[f], c);
        su += u[f] * u[f];
        sz += z[f] > tiny ? z[f] * z[f] : 0.0f;
    }
    *norm_u = sqrtf(su);
    *norm_z = sqrtf(sz);
    return top;
}

/* What a row's gradient needs of its features' pass, for a caller that keeps it between the two (the backward's
 * blocks): the row's maximum and norms, whose reductions are most of focused_row's work. */
struct focused_kept {
    float top, norm_u, norm_z;
};

/* y, u and z as focused_row makes them (the same operations, so the same bits), the row's maximum known. */
static inline void focused_row_known(const struct focused_map *c, const float *x, const float *s, int d, float top,
                                     float *y, float *u, float *z) {
    const float inv_top = 1.0f / top;
    int f = 0;
    for (; f + W <= d; f += W) {
        const vf xv = load(x + f), r = vmax(xv, splat(0.0f)) + splat(FOCUSED_EPS);
        const vf yv = s ? divide_by_scale(r, load(s + f)) : r, uv = yv * splat(inv_top);
        store(y + f, yv);
        store(u + f, uv);
        store(z + f, power_vec(uv, c));
    }
    for (; f < d; f++) {
        y[f] = s ? relu_eps(x[f]) / s[f] : relu_eps(x[f]);
        u[f] = y[f] * inv_top;
        z[f] = power_of(u[f], c);
    }
}

/* phi (d) of the row x of head `head`; its maximum and norms into kept unless NULL. */
static inline void focused_features(float *phi, const float *x, int d, const struct focused_map *c, int head,
                                    struct focused_kept *kept) {
    float y[d], u[d], norm_u, norm_z;
    const float top = focused_row(c, x, c->scale ? c->scale + (long)head * d : NULL, d, y, u, phi, &norm_u, &norm_z);
    scaled_copy(phi, phi, d, top * norm_u / norm_z);
    if (kept) {
        const struct focused_kept k = {top, norm_u, norm_z};
        *kept = k;
    }
}

/* The gradient dx (d) of the row x from g (d), that of its features; adds the row's share of the scales' gradient
 * to ds (d, this head's) unless NULL. With S = g . u^p, A = |u|, Z = |u^p| (the row's maximum cancels, phi being
 * homogeneous of degree 1 in y): dy = u S / (A Z) + (A p u^(p-1) / Z) (g - S u^p / Z^2), then dx = dy / s where
 * x > 0 (else 0) and ds = -dy y / s. */
static inline void focused_input_grad(float *dx, const float *g, const float *x, int d, const struct focused_map *c,
                                      int head, float *ds, const struct focused_kept *kept) {
    float y[d], u[d], zp[d], norm_u, norm_z;
    const float *s = c->scale ? c->scale + (long)head * d : NULL;
    if (kept) { /* the features' pass made the reductions */
        focused_row_known(c, x, s, d, kept->top, y, u, zp);
        norm_u = kept->norm_u;
        norm_z = kept->norm_z;
    } else {
        focused_row(c, x, s, d, y, u, zp, &norm_u, &norm_z);
    }
    const float dot = dot_product(g, zp, d);
    const float radial = dot / (norm_u * norm_z), tangential = norm_u * c->power / norm_z;
    const float along = dot / (norm_z * norm_z);
    int f = 0;
    /* u^(p - 1) by multiplication for a whole p, else as u^p / u (u > 0); no division by absent scales. A vector
     * division costs about as much as a row's share of the GEMMs, and this loop made two per vector. */
    for (; f + W <= d; f += W) {
        const vf uv = load(u + f), zv = load(zp + f), xv = load(x + f);
        vf below = splat(1.0f);
        if (c->integer_power)
            for (int i = 1; i < c->integer_power; i++) below *= uv;
        else
            below = zv / uv;
        const vf dy = uv * splat(radial) + splat(tangential) * below * (load(g + f) - splat(along) * zv);
        const vf dy_s = s ? divide_by_scale(dy, load(s + f)) : dy;
        store(dx + f, vselect(xv > splat(0.0f), dy_s, splat(0.0f)));
        if (ds) store(ds + f, load(ds + f) - dy_s * load(y + f));
    }
    for (; f < d; f++) {
        const float dy = u[f] * radial + tangential * (zp[f] / u[f]) * (g[f] - along * zp[f]);
        const float scale = s ? s[f] : 1.0f;
        dx[f] = x[f] > 0.0f ? dy / scale : 0.0f;
        if (ds) ds[f] -= dy * y[f] / scale;
    }
}

#endif
