/* Gated linear attention with a gate per key dimension (GLA), float32, position by position:
 *
 *   S_t = diag(a_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t,   a_t = exp(g_t)    (S: dk x dv; g <= 0 the log gates)
 *
 * Why not chunks: a gate per dimension makes every pair of a chunk meet through a decay per dimension, exp(b_i - b_j)
 * for each of dk dimensions (or log C levels of rescaled copies of the chunk), which costs more than the products.
 * Position by position the state stays in L1, a step is 2 dk dv multiply-adds (as many as the chunked form counts)
 * and dk exps, and nothing is ever divided by a decay, so strong decays lose no precision.
 *
 * Backward: the forward keeps the state entering every stretch of STRETCH positions (when asked); each stretch's
 * states are recomputed from it and kept, then walked back (each S_t made again from S_{t-1} on the way, so that a
 * position reads one kept state) with dS the gradient of S_t:
 *
 *   dS += q_t do_t^T,  dq_t = S_t do_t,  dk_t = dS v_t,  dv_t = dS^T k_t,  dg_t = a_t rowsum(dS o S_{t-1}),
 *   then dS <- diag(a_t) dS (the gradient of S_{t-1}); after position 0 it is the initial state's.
 *
 * q, k, g (B, H, N, dk), v (B, H, N, dv), out (B, H, N, dv) with (B, H, position) strides (15 longs: q, k, v, g,
 * out) and contiguous rows; the states (BH, dk, dv) and the kept ones (BH, stretches, dk, dv) contiguous.
 */
#include "kernel_attention.h"

#define STRETCH 16

struct gated_rows {
    const float *q, *k, *v, *g, *init, *kept_in, *grad_out, *grad_final;
    float *out, *final, *kept, *grad_q, *grad_k, *grad_v, *grad_g, *grad_init;
    int h, dk, dv;
    long n, s[15];
};

static inline const float *row(const struct gated_rows *c, const float *base, int which, int g, long t) {
    const long *s = c->s + 3 * which;
    return base + (long)(g / c->h) * s[0] + (long)(g % c->h) * s[1] + t * s[2];
}

static void state_in(float *state, int dvp, const float *src, int dk, int dv) {
    for (int f = 0; f < dk; f++) {
        if (src) memcpy(state + (long)f * dvp, src + (long)f * dv, sizeof(float) * dv);
        else memset(state + (long)f * dvp, 0, sizeof(float) * dv);
    }
}

static void state_out(float *dst, const float *state, int dvp, int dk, int dv) {
    for (int f = 0; f < dk; f++) memcpy(dst + (long)f * dv, state + (long)f * dvp, sizeof(float) * dv);
}

/* a = exp(g) for dk values (g <= 0), the vector tail by the scalar form */
static void gates(float *a, const float *g, int dk) {
    int f = 0;
    for (; f + W <= dk; f += W) store(a + f, exp_nonpositive(vmin(load(g + f), splat(0.0f))));
    for (; f < dk; f++) a[f] = exp_nonpositive_scalar(g[f] < 0.0f ? g[f] : 0.0f);
}

/* S <- diag(a) S + k v^T over V vectors of columns, and out = S^T q there: V independent sums, so that the
 * multiply-adds into out do not wait on each other from one row of S to the next. */
static inline __attribute__((always_inline)) void step_columns(const int V, float *state, int dk, int dvp,
                                                               const float *a, const float *k, const float *v,
                                                               const float *q, float *out) {
    vf vx[4], acc[4];
    for (int e = 0; e < V; e++) {
        vx[e] = load(v + e * W);
        acc[e] = splat(0.0f);
    }
    for (int f = 0; f < dk; f++, state += dvp) {
        const vf af = splat(a[f]), kf = splat(k[f]), qf = splat(q[f]);
        for (int e = 0; e < V; e++) {
            const vf next = af * load(state + e * W) + kf * vx[e];
            store(state + e * W, next);
            acc[e] += qf * next;
        }
    }
    for (int e = 0; e < V; e++) store(out + e * W, acc[e]);
}

/* S <- diag(a) S + k v^T and out = S^T q; v padded with zeros to dvp. */
static void step(float *state, int dk, int dvp, const float *a, const float *k, const float *v, const float *q,
                 float *out) {
    int x = 0;
    for (; x + 4 * W <= dvp; x += 4 * W) step_columns(4, state + x, dk, dvp, a, k, v + x, q, out + x);
    for (; x < dvp; x += W) step_columns(1, state + x, dk, dvp, a, k, v + x, q, out + x);
}

static void forward_head(const void *ctx, int g, float *scratch) {
    const struct gated_rows *c = ctx;
    const int dk = c->dk, dv = c->dv, dvp = whole_vectors(dv), dkp = whole_vectors(dk);
    float *state = scratch, *a = state + (long)dk * dvp, *v = a + dkp, *o = v + dvp;
    const long stretches = (c->n + STRETCH - 1) / STRETCH;
    state_in(state, dvp, c->init ? c->init + (long)g * dk * dv : NULL, dk, dv);
    for (long t = 0; t < c->n; t++) {
        if (c->kept && t % STRETCH == 0)
            state_out(c->kept + ((long)g * stretches + t / STRETCH) * dk * dv, state, dvp, dk, dv);
        gates(a, row(c, c->g, 3, g, t), dk);
        memcpy(v, row(c, c->v, 2, g, t), sizeof(float) * dv);
        step(state, dk, dvp, a, row(c, c->k, 1, g, t), v, row(c, c->q, 0, g, t), o);
        memcpy((float *)row(c, c->out, 4, g, t), o, sizeof(float) * dv);
    }
    if (c->final) state_out(c->final + (long)g * dk * dv, state, dvp, dk, dv);
}

/* The backward holds states and their gradient transposed, dv rows of dk (padded to dkp): the dot products over
 * dv (dq_t = S_t do_t, dk_t = dS v_t, the gates' rowsum) become sums of rows, vectors over dk, and only
 * dv_t = dS^T k_t is a dot product per column. (The forward's layout, dk rows of dv, makes o_t a sum of rows.) */
static void transposed_in(float *dst, int dkp, const float *src, int dk, int dv) {
    for (int f = 0; f < dk; f++) /* src row by row: a kept state comes from memory, read in order */
        for (int x = 0; x < dv; x++) dst[(long)x * dkp + f] = src ? src[(long)f * dv + x] : 0.0f;
}

static void transposed_out(float *dst, const float *src, int dkp, int dk, int dv) {
    for (int f = 0; f < dk; f++)
        for (int x = 0; x < dv; x++) dst[(long)f * dv + x] = src[(long)x * dkp + f];
}

/* next = diag(a) prev + k v^T, transposed: row x of S^T is a * prev_x + v_x k. */
static void step_transposed(float *next, const float *prev, int dv, int dkp, const float *a, const float *k,
                            const float *v) {
    for (int x = 0; x < dv; x++) {
        const vf vx = splat(v[x]);
        for (int f = 0; f < dkp; f += W)
            store(next + (long)x * dkp + f, load(a + f) * load(prev + (long)x * dkp + f) + load(k + f) * vx);
    }
}

/* One position walked back over FB vectors of dk from f0 (the pointers start there): dS^T (grad) updated in place,
 * dq, dk and the gates' rowsum for these dk written to out (3 x FB vectors), and each column's k . dS^T_x part added
 * into parts (dv x W; first: written). q, k, a hold whole vectors (zeros past dk). */
static inline __attribute__((always_inline)) void back_rows(const int FB, int first, float *grad,
                                                            const float *before, int dv, int dkp, const float *q,
                                                            const float *k, const float *a, const float *v,
                                                            const float *d_out, float *out, float *parts) {
    vf qv[4], kv[4], av[4], tq[4], tk[4], ta[4];
    for (int e = 0; e < FB; e++) {
        qv[e] = load(q + e * W);
        kv[e] = load(k + e * W);
        av[e] = load(a + e * W);
        tq[e] = tk[e] = ta[e] = splat(0.0f);
    }
    for (int x = 0; x < dv; x++, grad += dkp, before += dkp) {
        const vf dox = splat(d_out[x]), vx = splat(v[x]);
        vf part = splat(0.0f);
        for (int e = 0; e < FB; e++) {
            const vf d = load(grad + e * W) + dox * qv[e], b = load(before + e * W);
            tq[e] += (av[e] * b + vx * kv[e]) * dox; /* S_t from S_{t-1}: one read of the states instead of two */
            tk[e] += d * vx;
            ta[e] += d * b;
            part += kv[e] * d;
            store(grad + e * W, av[e] * d);
        }
        store(parts + (long)x * W, first ? part : load(parts + (long)x * W) + part);
    }
    for (int e = 0; e < FB; e++) {
        store(out + e * W, tq[e]);
        store(out + (FB + e) * W, tk[e]);
        store(out + (2 * FB + e) * W, av[e] * ta[e]);
    }
}

static void backward_head(const void *ctx, int g, float *scratch) {
    const struct gated_rows *c = ctx;
    const int dk = c->dk, dv = c->dv, dkp = whole_vectors(dk);
    const long size = (long)dv * dkp, stretches = (c->n + STRETCH - 1) / STRETCH;
    float *states = scratch, *grad = states + STRETCH * size, *a = grad + size, *q = a + dkp, *k = q + dkp;
    float *rows = k + dkp, *parts = rows + 3L * dkp; /* rows: dq, dk and the gates' gradient of one position */
    transposed_in(grad, dkp, c->grad_final ? c->grad_final + (long)g * dk * dv : NULL, dk, dv);
    for (long z = stretches - 1; z >= 0; z--) {
        const long t0 = z * STRETCH, t1 = t0 + STRETCH < c->n ? t0 + STRETCH : c->n;
        transposed_in(states, dkp, c->kept_in + ((long)g * stretches + z) * dk * dv, dk, dv); /* S_{t0 - 1} */
        for (long t = t0; t + 1 < t1; t++) { /* S_{t0} .. S_{t1 - 2}: the walk back makes each S_t from S_{t-1} */
            float *next = states + (t - t0 + 1) * size;
            gates(a, row(c, c->g, 3, g, t), dk);
            memcpy(k, row(c, c->k, 1, g, t), sizeof(float) * dk);
            step_transposed(next, next - size, dv, dkp, a, k, row(c, c->v, 2, g, t));
        }
        for (long t = t1 - 1; t >= t0; t--) {
            const float *before = states + (t - t0) * size, *v = row(c, c->v, 2, g, t); /* S_{t-1} */
            const long at = (long)g * c->n + t;
            const float *d_out = c->grad_out + at * dv;
            gates(a, row(c, c->g, 3, g, t), dk);
            memcpy(q, row(c, c->q, 0, g, t), sizeof(float) * dk);
            memcpy(k, row(c, c->k, 1, g, t), sizeof(float) * dk);
            int f = 0;
            for (; f + TILE_V * W <= dkp; f += TILE_V * W) {
                float out[3 * TILE_V * W];
                back_rows(TILE_V, f == 0, grad + f, before + f, dv, dkp, q + f, k + f, a + f, v, d_out,
                          out, parts);
                for (int e = 0; e < TILE_V * W; e++) {
                    rows[f + e] = out[e];
                    rows[dkp + f + e] = out[TILE_V * W + e];
                    rows[2 * dkp + f + e] = out[2 * TILE_V * W + e];
                }
            }
            for (; f < dkp; f += W) {
                float out[3 * W];
                back_rows(1, f == 0, grad + f, before + f, dv, dkp, q + f, k + f, a + f, v, d_out, out,
                          parts);
                for (int e = 0; e < W; e++) {
                    rows[f + e] = out[e];
                    rows[dkp + f + e] = out[W + e];
                    rows[2 * dkp + f + e] = out[2 * W + e];
                }
            }
            memcpy(c->grad_q + at * dk, rows, sizeof(float) * dk);
            memcpy(c->grad_k + at * dk, rows + dkp, sizeof(float) * dk);
            memcpy(c->grad_g + at * dk, rows + 2 * dkp, sizeof(float) * dk);
            float *dv_t = c->grad_v + at * dv;
            for (int x = 0; x < dv; x++) dv_t[x] = hsum(load(parts + (long)x * W));
        }
    }
    if (c->grad_init) transposed_out(c->grad_init + (long)g * dk * dv, grad, dkp, dk, dv);
}

/* Forward: out, and final (BH, dk, dv) and kept (BH, ceil(N / STRETCH), dk, dv) where not NULL; init NULL: an
 * empty state. Returns 0, or -1 when a thread's buffers could not be allocated. */
int lm_gated_recurrence_f32(const float *q, const float *k, const float *v, const float *g, const float *init,
                            float *out, float *final, float *kept, int b, int h, long n, int dk, int dv,
                            const long *strides, int threads) {
    struct gated_rows c = {q, k, v, g, init, NULL, NULL, NULL, out, final, kept, NULL, NULL, NULL, NULL, NULL,
                           h, dk, dv, n, {0}};
    memcpy(c.s, strides, sizeof(c.s));
    const long dvp = whole_vectors(dv), dkp = whole_vectors(dk);
    return for_each_task(b * h, threads_for(threads), dk * dvp + dkp + 2 * dvp, forward_head, &c, 0);
}

/* Backward: the forward's inputs (strides of q, k, v, g; out's are not read) and its kept states, grad_out
 * (B, H, N, dv) contiguous and grad_final (BH, dk, dv) or NULL -> grad_q, grad_k, grad_g (B, H, N, dk), grad_v
 * (B, H, N, dv) contiguous, and grad_init (BH, dk, dv) unless NULL. */
int lm_gated_recurrence_backward_f32(const float *q, const float *k, const float *v, const float *g,
                                     const float *kept, const float *grad_out, const float *grad_final,
                                     float *grad_q, float *grad_k, float *grad_v, float *grad_g, float *grad_init,
                                     int b, int h, long n, int dk, int dv, const long *strides, int threads) {
    struct gated_rows c = {q, k, v, g, NULL, kept, grad_out, grad_final, NULL, NULL, NULL, grad_q, grad_k, grad_v,
                           grad_g, grad_init, h, dk, dv, n, {0}};
    memcpy(c.s, strides, sizeof(c.s));
    const long dkp = whole_vectors(dk);
    const long scratch = (STRETCH + 1) * (long)dv * dkp + 6L * dkp + (long)dv * W;
    return for_each_task(b * h, threads_for(threads), scratch, backward_head, &c, 0);
}
