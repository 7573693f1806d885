/* Gated linear attention with a gate per key dimension (GLA), float32, position by position:
 *
 *   S_t = diag(a_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t,   a_t = exp(g_t)    (S: dk x dv; g <= 0 the log gates)
 *
 * Why not chunks: a gate per dimension makes every pair of a chunk meet through a decay per dimension, exp(b_i - b_j)
 * for each of dk dimensions (or log C levels of rescaled copies of the chunk), which costs more than the products.
 * Position by position the state stays in L1, a step is 2 dk dv multiply-adds (as many as the chunked form counts)
 * and dk exps, and nothing is ever divided by a decay, so strong decays lose no precision.
 *
 * Backward: the forward keeps the state entering every stretch of STRETCH positions (when asked, transposed); each
 * stretch's states are recomputed from it and kept, then walked back (each S_t made again from S_{t-1} on the way,
 * so that a position reads one kept state) with dS the gradient of S_t:
 *
 *   dS += q_t do_t^T,  dq_t = S_t do_t,  dk_t = dS v_t,  dv_t = dS^T k_t,  dg_t = a_t rowsum(dS o S_{t-1}),
 *   then dS <- diag(a_t) dS (the gradient of S_{t-1}); after position 0 it is the initial state's.
 *
 * q, k, g (B, H, N, dk), v (B, H, N, dv), out (B, H, N, dv) with (B, H, position) strides (15 longs: q, k, v, g,
 * out) and contiguous rows; the states (BH, dk, dv) and the kept ones (BH, stretches, dv, dk: transposed)
 * contiguous.
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
        if (c->kept && t % STRETCH == 0) /* kept transposed, as the backward reads it (a scalar copy there cost 25%) */
            transpose_rows(state, dvp, dk, dv, c->kept + ((long)g * stretches + t / STRETCH) * dk * dv, dk);
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
    for (int f = 0; f < dk; f++)
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

/* One position walked back over the rows of S^T in [grad, before) (rows of them) and FB vectors of dk (the pointers
 * start there): dS^T updated in place; these rows' parts of dq, dk and the gates' rowsum written (add: added) to
 * dq, dk, da; and each row's k . dS^T_x as a vector into parts (first: written, else added). q, k, a hold whole
 * vectors (zeros past dk). */
static inline __attribute__((always_inline)) void back_rows(const int FB, int first, int add, float *grad,
                                                            const float *before, int rows, int dkp, const float *q,
                                                            const float *k, const float *a, const float *v,
                                                            const float *d_out, float *dq, float *dk, float *da,
                                                            float *parts) {
    vf qv[4], kv[4], av[4], tq[4], tk[4], ta[4];
    for (int e = 0; e < FB; e++) {
        qv[e] = load(q + e * W);
        kv[e] = load(k + e * W);
        av[e] = load(a + e * W);
        tq[e] = tk[e] = ta[e] = splat(0.0f);
    }
    for (int x = 0; x < rows; x++, grad += dkp, before += dkp) {
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
        store(dq + e * W, add ? load(dq + e * W) + tq[e] : tq[e]);
        store(dk + e * W, add ? load(dk + e * W) + tk[e] : tk[e]);
        store(da + e * W, add ? load(da + e * W) + ta[e] : ta[e]);
    }
}

/* The walk back runs a few rows of S^T at a time (rows are independent; dq, dk and the gates' sums over them add
 * up): those rows' states over a stretch, 16 x 4 rows of dk, stay in L1, where the whole states' did not (the
 * backward 52 -> 43-47 ms at B=1 H=8 d=64 N=4096, one thread). */
#define ROWS_AT_ONCE 4

static void backward_head(const void *ctx, int g, float *scratch) {
    const struct gated_rows *c = ctx;
    const int dk = c->dk, dv = c->dv, dkp = whole_vectors(dk);
    const long size = (long)dv * dkp, stretches = (c->n + STRETCH - 1) / STRETCH, block = ROWS_AT_ONCE * (long)dkp;
    float *entering = scratch, *grad = entering + size, *kept = grad + size, *a = kept + STRETCH * block;
    float *q = a + STRETCH * dkp, *k = q + STRETCH * dkp, *dq = k + STRETCH * dkp, *dk_ = dq + STRETCH * dkp;
    float *da = dk_ + STRETCH * dkp, *parts = da + STRETCH * dkp;
    transposed_in(grad, dkp, c->grad_final ? c->grad_final + (long)g * dk * dv : NULL, dk, dv);
    for (long z = stretches - 1; z >= 0; z--) {
        const long t0 = z * STRETCH;
        const int len = (int)(t0 + STRETCH < c->n ? STRETCH : c->n - t0);
        const float *kept_in = c->kept_in + ((long)g * stretches + z) * dk * dv; /* S_{t0 - 1}^T, rows of dk */
        for (int x = 0; x < dv; x++) memcpy(entering + (long)x * dkp, kept_in + (long)x * dk, sizeof(float) * dk);
        for (int i = 0; i < len; i++) {
            gates(a + (long)i * dkp, row(c, c->g, 3, g, t0 + i), dk);
            memcpy(q + (long)i * dkp, row(c, c->q, 0, g, t0 + i), sizeof(float) * dk);
            memcpy(k + (long)i * dkp, row(c, c->k, 1, g, t0 + i), sizeof(float) * dk);
        }
        for (int x0 = 0; x0 < dv; x0 += ROWS_AT_ONCE) {
            const int rows = dv - x0 < ROWS_AT_ONCE ? dv - x0 : ROWS_AT_ONCE;
            const float *prev = entering + (long)x0 * dkp;
            for (int i = 0; i + 1 < len; i++) { /* S_{t0} .. S_{t0 + len - 2} of these rows */
                step_transposed(kept + i * block, prev, rows, dkp, a + (long)i * dkp, k + (long)i * dkp,
                                row(c, c->v, 2, g, t0 + i) + x0);
                prev = kept + i * block;
            }
            for (int i = len - 1; i >= 0; i--) {
                const long at = (long)g * c->n + t0 + i;
                const float *before = i == 0 ? entering + (long)x0 * dkp : kept + (i - 1) * block; /* S_{t-1} */
                const float *v = row(c, c->v, 2, g, t0 + i) + x0, *d_out = c->grad_out + at * dv + x0;
                const long r = (long)i * dkp;
                int f = 0;
                for (; f + TILE_V * W <= dkp; f += TILE_V * W)
                    back_rows(TILE_V, f == 0, x0 > 0, grad + (long)x0 * dkp + f, before + f, rows, dkp, q + r + f,
                              k + r + f, a + r + f, v, d_out, dq + r + f, dk_ + r + f, da + r + f, parts);
                for (; f < dkp; f += W)
                    back_rows(1, f == 0, x0 > 0, grad + (long)x0 * dkp + f, before + f, rows, dkp, q + r + f,
                              k + r + f, a + r + f, v, d_out, dq + r + f, dk_ + r + f, da + r + f, parts);
                float *dv_t = c->grad_v + at * dv + x0;
                for (int x = 0; x < rows; x++) dv_t[x] = hsum(load(parts + (long)x * W));
            }
        }
        for (int i = 0; i < len; i++) {
            const long at = (long)g * c->n + t0 + i, r = (long)i * dkp;
            memcpy(c->grad_q + at * dk, dq + r, sizeof(float) * dk);
            memcpy(c->grad_k + at * dk, dk_ + r, sizeof(float) * dk);
            for (int f = 0; f < dk; f++) c->grad_g[at * dk + f] = a[r + f] * da[r + f];
        }
    }
    if (c->grad_init) transposed_out(c->grad_init + (long)g * dk * dv, grad, dkp, dk, dv);
}

/* Forward: out, and final (BH, dk, dv) and kept (BH, ceil(N / STRETCH), dv, dk) where not NULL; init NULL: an
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
    const long scratch = 2L * dv * dkp + STRETCH * (ROWS_AT_ONCE + 6L) * dkp + ROWS_AT_ONCE * W;
    return for_each_task(b * h, threads_for(threads), scratch, backward_head, &c, 0);
}
