/* The delta rule's per-chunk systems (the WY / UT transform, delta_rule.py has the math), float32, forward and
 * backward. For a chunk of c positions with keys K (c x dk), values V (c x dv), write strengths beta and b the
 * chunk's cumulative log decay (b_0 >= b_1 >= ..., all <= 0):
 *
 *   A_tj = beta_t exp(b_t - b_j) (k_t . k_j)  for j < t,    T = (I + A)^-1,
 *   W = T diag(beta exp(b)) K,    U = T diag(beta) V,    K_end = diag(exp(b_last - b)) K
 *
 * (K_end: the keys decayed to the chunk's end, what the pass from chunk to chunk writes into the state.)
 * Every chunk is independent: one task per chunk, its matrices kept in cache; T is written out when a backward
 * will read it.
 * Given dW and dU, with X = diag(beta exp(b)) K and Y = diag(beta) V the right-hand sides of (I + A) [W U] = [X Y]:
 *
 *   dX = T^T dW,  dY = T^T dU,  dA = -(dX W^T + dY U^T)  (its strictly lower part)
 *
 * and dA reaches K through K K^T, beta and b through the scale of each entry; dX and dY reach K, V, beta and b
 * through the scaled rows. Tensors are contiguous: k (chunks, c, dk), v (chunks, c, dv), beta and b (chunks, c),
 * w and k_end like k, u like v, t (chunks, c, c).
 */
#include "kernel_attention.h"

struct delta_systems {
    const float *k, *v, *beta, *b, *t, *w_in, *u_in, *grad_w, *grad_u, *grad_k_end;
    float *w, *u, *k_end, *t_out, *grad_k, *grad_v, *grad_beta, *grad_b;
    int c, dk, dv;
};

/* rows x cols floats at src (row stride ld_src) into dst (row stride ld_dst): the columns past cols zeroed. */
static void rows_in(float *dst, int ld_dst, const float *src, int ld_src, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        memcpy(dst + (long)r * ld_dst, src + (long)r * ld_src, sizeof(float) * cols);
        memset(dst + (long)r * ld_dst + cols, 0, sizeof(float) * (ld_dst - cols));
    }
}

static void rows_out(float *dst, int ld_dst, const float *src, int ld_src, int rows, int cols) {
    for (int r = 0; r < rows; r++) memcpy(dst + (long)r * ld_dst, src + (long)r * ld_src, sizeof(float) * cols);
}

/* exp(x) for x <= 0 (a rounding above 0 read as 0) */
static inline float decayed(float x) { return exp_nonpositive_scalar(x < 0.0f ? x : 0.0f); }

/* exp(b_t - b_j) for the W columns j from x of row t: <= 1 where j <= t (a difference of the cumulative decays, so
 * it never overflows), 1 past t. e holds b padded to whole vectors. */
static inline vf ratios(const float *e, int t, int x) {
    return exp_nonpositive(vmin(splat(e[t]) - load(e + x), splat(0.0f)));
}

/* g = K K^T below and on the diagonal, zeros above (rows of g ldt apart); k_t is scratch for K^T. */
static void key_products(const float *kr, int dkp, int c, float *k_t, int ldt, float *g) {
    transpose_rows(kr, dkp, c, dkp, k_t, ldt);
    lower_scores(c, dkp, kr, dkp, k_t, ldt, g);
}

/* t = (I + A)^-1 for the strictly lower part of a (rows ld apart) by forward substitution: row i of t is
 * e_i - sum_{j < i} A_ij t_j, where row j is zero past column j. t is written whole (zeros above the diagonal). */
static void unit_lower_inverse(const float *a, int c, int ld, float *t) {
    for (int i = 0; i < c; i++) {
        float *ti = t + (long)i * ld;
        memset(ti, 0, sizeof(float) * ld);
        ti[i] = 1.0f;
        for (int j = 0; j < i; j++) {
            const float factor = a[(long)i * ld + j];
            if (factor == 0.0f) continue;
            const float *tj = t + (long)j * ld;
            const vf f = splat(factor);
            for (int x = 0; x <= j; x += W) store(ti + x, load(ti + x) - f * load(tj + x));
        }
    }
}

static void forward_chunk(const void *ctx, int m, float *scratch) {
    const struct delta_systems *s = ctx;
    const int c = s->c, dk = s->dk, dv = s->dv, dkp = whole_vectors(dk), dvp = whole_vectors(dv);
    const int ldt = whole_vectors(c);
    float *kr = scratch, *x = kr + (long)c * dkp, *y = x + (long)c * dkp, *k_t = y + (long)c * dvp;
    float *a = k_t + (long)dkp * ldt, *t = a + (long)c * ldt, *product = t + (long)c * ldt;
    float *e = product + (long)c * (dkp > dvp ? dkp : dvp);
    const float *beta = s->beta + (long)m * c, *b = s->b + (long)m * c;
    memcpy(e, b, sizeof(float) * c); /* its padding stays 0 */
    rows_in(kr, dkp, s->k + (long)m * c * dk, dk, c, dk);
    rows_in(y, dvp, s->v + (long)m * c * dv, dv, c, dv);
    key_products(kr, dkp, c, k_t, ldt, a);
    for (int i = 0; i < c; i++) { /* the entries from the diagonal on are not read */
        float *row = a + (long)i * ldt, *end = s->k_end + ((long)m * c + i) * dk;
        for (int x = 0; x < i; x += W) store(row + x, load(row + x) * ratios(e, i, x) * splat(beta[i]));
        const float to_end = decayed(b[c - 1] - b[i]);
        for (int f = 0; f < dk; f++) end[f] = kr[(long)i * dkp + f] * to_end;
    }
    unit_lower_inverse(a, c, ldt, t);
    for (int i = 0; i < c; i++) {
        const vf scale_k = splat(beta[i] * decayed(b[i])), scale_v = splat(beta[i]);
        for (int f = 0; f < dkp; f += W) store(x + (long)i * dkp + f, load(kr + (long)i * dkp + f) * scale_k);
        for (int f = 0; f < dvp; f += W) store(y + (long)i * dvp + f, load(y + (long)i * dvp + f) * scale_v);
    }
    gemm_written(LOWER_K, c, dkp / W, c, t, ldt, 1, x, dkp, product, dkp);
    rows_out(s->w + (long)m * c * dk, dk, product, dkp, c, dk);
    gemm_written(LOWER_K, c, dvp / W, c, t, ldt, 1, y, dvp, product, dvp);
    rows_out(s->u + (long)m * c * dv, dv, product, dvp, c, dv);
    if (s->t_out) rows_out(s->t_out + (long)m * c * c, c, t, ldt, c, c);
}

static void backward_chunk(const void *ctx, int m, float *scratch) {
    const struct delta_systems *s = ctx;
    const int c = s->c, dk = s->dk, dv = s->dv, dkp = whole_vectors(dk), dvp = whole_vectors(dv);
    const int ldt = whole_vectors(c), dp = dkp > dvp ? dkp : dvp;
    float *kr = scratch, *vr = kr + (long)c * dkp, *gw = vr + (long)c * dvp, *gu = gw + (long)c * dkp;
    float *dx = gu + (long)c * dvp, *dy = dx + (long)c * dkp, *dkr = dy + (long)c * dvp;
    float *t = dkr + (long)c * dkp, *sq = t + (long)c * ldt, *g = sq + (long)c * ldt;
    float *cols = g + (long)c * ldt; /* dp x ldt: W^T, U^T, then K^T */
    float *e_b = cols + (long)dp * ldt, *scale_k = e_b + ldt, *d_beta = scale_k + ldt, *d_b = d_beta + ldt;
    float *taken = d_b + ldt, *e = taken + ldt; /* taken: the sums of p_ij over i for each j; e: b padded */
    const float *beta = s->beta + (long)m * c, *b = s->b + (long)m * c;
    rows_in(kr, dkp, s->k + (long)m * c * dk, dk, c, dk);
    rows_in(vr, dvp, s->v + (long)m * c * dv, dv, c, dv);
    rows_in(gw, dkp, s->grad_w + (long)m * c * dk, dk, c, dk);
    rows_in(gu, dvp, s->grad_u + (long)m * c * dv, dv, c, dv);
    rows_in(t, ldt, s->t + (long)m * c * c, c, c, c);
    for (int i = 0; i < c; i++) {
        e_b[i] = decayed(b[i]);
        scale_k[i] = beta[i] * e_b[i];
        e[i] = b[i];
    }
    memset(taken, 0, sizeof(float) * ldt);

    /* dX = T^T dW, dY = T^T dU: T^T is upper triangular */
    gemm_written(UPPER_K, c, dkp / W, c, t, 1, ldt, gw, dkp, dx, dkp);
    gemm_written(UPPER_K, c, dvp / W, c, t, 1, ldt, gu, dvp, dy, dvp);

    /* -dA = dX W^T + dY U^T below the diagonal (sq) */
    transpose_rows(s->w_in + (long)m * c * dk, dk, c, dk, cols, ldt);
    gemm_written(LOWER_N, c, ldt / W, dk, dx, dkp, 1, cols, ldt, sq, ldt);
    transpose_rows(s->u_in + (long)m * c * dv, dv, c, dv, cols, ldt);
    gemm_shaped(LOWER_N, c, ldt / W, dv, dy, dvp, 1, cols, ldt, sq, ldt);

    /* A_ij = beta_i r_ij G_ij: with q_ij = dA_ij r_ij, dG_ij = beta_i q_ij, dbeta_i += q_ij G_ij, and
     * p_ij = dG_ij G_ij goes to db_i and (negated) to db_j. sq becomes dG + dG^T, symmetric. */
    key_products(kr, dkp, c, cols, ldt, g);
    for (int i = 0; i < c; i++) {
        float *row = sq + (long)i * ldt;
        const float *g_i = g + (long)i * ldt;
        memset(row + i, 0, sizeof(float) * (ldt - i)); /* the product's entries from the diagonal on */
        vf sum_q = splat(0.0f), sum_p = splat(0.0f);
        for (int x = 0; x < i; x += W) {
            const vf q = -load(row + x) * ratios(e, i, x), grad_g = q * splat(beta[i]), p = grad_g * load(g_i + x);
            sum_q += q * load(g_i + x);
            sum_p += p;
            store(taken + x, load(taken + x) + p);
            store(row + x, grad_g);
        }
        d_beta[i] = hsum(sum_q);
        d_b[i] = hsum(sum_p);
    }
    for (int i = 0; i < c; i++) d_b[i] -= taken[i];
    for (int i = 0; i < c; i++)
        for (int j = 0; j < i; j++) sq[(long)j * ldt + i] = sq[(long)i * ldt + j];
    gemm_written(FULL, c, dkp / W, c, sq, ldt, 1, kr, dkp, dkr, dkp);

    /* the scaled rows: X_i = beta_i exp(b_i) k_i, Y_i = beta_i v_i */
    for (int i = 0; i < c; i++) {
        float *dk_i = dkr + (long)i * dkp, *dv_i = dy + (long)i * dvp;
        const float *dx_i = dx + (long)i * dkp, *k_i = kr + (long)i * dkp;
        const float xk = dot_product(dx_i, k_i, dkp);
        d_beta[i] += xk * e_b[i];
        d_b[i] += xk * scale_k[i];
        d_beta[i] += dot_product(dv_i, vr + (long)i * dvp, dvp);
        const vf sk = splat(scale_k[i]), sv = splat(beta[i]);
        for (int f = 0; f < dkp; f += W) store(dk_i + f, load(dk_i + f) + sk * load(dx_i + f));
        for (int f = 0; f < dvp; f += W) store(dv_i + f, load(dv_i + f) * sv);
    }
    float taken_at_end = 0.0f; /* K_end_i = exp(b_last - b_i) k_i */
    for (int i = 0; i < c; i++) {
        const float *g = s->grad_k_end + ((long)m * c + i) * dk, *k_i = kr + (long)i * dkp;
        const float to_end = decayed(b[c - 1] - b[i]);
        float p = 0.0f;
        for (int f = 0; f < dk; f++) {
            dkr[(long)i * dkp + f] += g[f] * to_end;
            p += g[f] * k_i[f];
        }
        d_b[i] -= p * to_end;
        taken_at_end += p * to_end;
    }
    d_b[c - 1] += taken_at_end;
    rows_out(s->grad_k + (long)m * c * dk, dk, dkr, dkp, c, dk);
    rows_out(s->grad_v + (long)m * c * dv, dv, dy, dvp, c, dv);
    memcpy(s->grad_beta + (long)m * c, d_beta, sizeof(float) * c);
    memcpy(s->grad_b + (long)m * c, d_b, sizeof(float) * c);
}

/* Forward: k, v, beta, b -> w, u, k_end, and t (NULL: not kept, no backward follows) for `chunks` chunks of c
 * positions.
 * Returns 0, or -1 when a thread's buffers could not be allocated. */
int lm_delta_systems_f32(const float *k, const float *v, const float *beta, const float *b, float *w, float *u,
                         float *k_end, float *t, long chunks, int c, int dk, int dv, int threads) {
    const struct delta_systems s = {k, v, beta, b, NULL, NULL, NULL, NULL, NULL, NULL, w, u, k_end, t, NULL, NULL,
                                    NULL, NULL, c, dk, dv};
    const long dkp = whole_vectors(dk), dvp = whole_vectors(dv), ldt = whole_vectors(c);
    const long scratch = c * (2 * dkp + dvp) + dkp * ldt + 2 * c * ldt + c * (dkp > dvp ? dkp : dvp) + ldt + W;
    return for_each_task((int)chunks, threads_for(threads), scratch, forward_chunk, &s, 0);
}

/* Backward: the forward's inputs and outputs (t, w, u), and the gradients of w, u and k_end -> those of k, v, beta
 * and b. */
int lm_delta_systems_backward_f32(const float *k, const float *v, const float *beta, const float *b, const float *t,
                                  const float *w, const float *u, const float *grad_w, const float *grad_u,
                                  const float *grad_k_end, float *grad_k, float *grad_v, float *grad_beta,
                                  float *grad_b, long chunks, int c, int dk, int dv, int threads) {
    const struct delta_systems s = {k, v, beta, b, t, w, u, grad_w, grad_u, grad_k_end, NULL, NULL, NULL, NULL,
                                    grad_k, grad_v, grad_beta, grad_b, c, dk, dv};
    const long dkp = whole_vectors(dk), dvp = whole_vectors(dv), ldt = whole_vectors(c);
    const long dp = dkp > dvp ? dkp : dvp;
    const long scratch = c * (4 * dkp + 3 * dvp) + 3 * c * ldt + dp * ldt + 6 * ldt + W;
    return for_each_task((int)chunks, threads_for(threads), scratch, backward_chunk, &s, 0);
}
