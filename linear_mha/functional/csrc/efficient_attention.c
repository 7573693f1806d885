/* Efficient Attention (Shen et al., 2021) on the CPU, float32, forward and backward:
 *
 *   out_i = softmax(q_i) S,   S_f = sum_j W_jf v_j,   W_jf = exp(k_jf - m_f) / l_f   (softmax of K over keys)
 *
 * with m_f the largest k_jf over the unmasked keys and l_f = sum_j exp(k_jf - m_f). With m fixed by a first
 * pass, [U, l] = sum_j exp(k_j - m)^T [v_j, 1] is one accumulation of the kind kernel attention makes (the ones
 * column gives l), and every exponent is <= 0. Masked keys are skipped; a sample with every key masked gets
 * l = 0, S = 0 and output 0, as the PyTorch path defines it.
 *
 * Gradients, with P = softmax(Q) by rows and g the incoming gradient:
 *   dS = P^T g;   dQ_i = P_i * (g_i S^T - (g_i S^T) . P_i);   dV_j = W_j dS;
 *   dK_jf = W_jf ((v_j . dS_f) - c_f) with c_f = S_f . dS_f.
 */
#include "kernel_attention.h"

/* m: the largest key logit of every head and feature over the unmasked keys (0 where all are masked). */
static void key_maxima(const struct key_rows *c, int bh, int threads, float *top) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < bh; g++) {
        const int bi = g / c->h, hi = g % c->h, d = c->d;
        float *t = top + (long)g * d;
        int seen = 0;
        for (long j = 0; j < c->n; j++) {
            if (c->mask && c->mask[bi * c->n + j]) continue;
            const float *kr = c->k + bi * c->ksb + hi * c->ksh + j * c->ksn;
            if (!seen) {
                memcpy(t, kr, sizeof(float) * d);
                seen = 1;
                continue;
            }
            int f = 0;
            for (; f + W <= d; f += W) {
                const vf a = load(t + f), x = load(kr + f);
                store(t + f, vmax(x, a));
            }
            for (; f < d; f++) t[f] = kr[f] > t[f] ? kr[f] : t[f];
        }
        if (!seen) memset(t, 0, sizeof(float) * d);
    }
}

/* S (bh x d x width) from [U, l]: U / l, with the column dv set to 1 so that the kernel-attention query pass
 * divides by softmax(q) . 1 = 1. 1 / l (0 where every key is masked) goes to inv_sum (bh x d) when asked for. */
static void normalise_state(float *state, int bh, int d, int dv, int width, float *inv_sum) {
    for (long row = 0; row < (long)bh * d; row++) {
        float *s = state + row * width;
        const float inv = s[dv] > 0.0f ? 1.0f / s[dv] : 0.0f;
        for (int e = 0; e < dv; e++) s[e] *= inv;
        s[dv] = 1.0f;
        if (inv_sum) inv_sum[row] = inv;
    }
}

/* Non-causal Efficient Attention: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) by element strides over
 * (B, H, position) with a contiguous last dimension; mask (B, S) bytes, nonzero = ignore, or NULL; out
 * (B, H, L, Dv), its strides over (B, H, L) in out_strides (3 longs; NULL: contiguous), its rows contiguous. For
 * autograd, state_out (B, H, D, Dv) receives S, top_out and inv_sum_out (B, H, D) m and 1 / l; each may be NULL. */
int lm_efficient_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                               float *state_out, float *top_out, float *inv_sum_out, int b, int h, long nq, long nk,
                               int d, int dv, long qsb, long qsh, long qsn, long ksb, long ksh, long ksn, long vsb,
                               long vsh, long vsn, int threads, const long *out_strides) {
    const int bh = b * h, width = (dv + 1 + W - 1) / W * W;
    threads = threads_for(threads);
    float *top = top_out ? top_out : malloc(sizeof(float) * bh * d);
    float *state = malloc(sizeof(float) * bh * d * width);
    int status = top && state ? 0 : -1;
    if (status == 0) {
        const struct key_rows keys = {k, v, mask, h, d, dv, width, 0, nk, ksb, ksh, ksn, vsb, vsh, vsn, top};
        key_maxima(&keys, bh, threads, top);
        status = accumulate_states(bh, nk, heads_in_turn(h, ksh, ksn), d, width, dv + 1, 0, threads, key_source,
                                   &keys, state, 0);
    }
    if (status == 0) {
        normalise_state(state, bh, d, dv, width, inv_sum_out);
        if (state_out)
            for (long row = 0; row < (long)bh * d; row++)
                memcpy(state_out + row * dv, state + row * width, sizeof(float) * dv);
        const struct query_outputs queries = {q, state, out, NULL, h, d, dv, width, nq, qsb, qsh, qsn, 2, NULL, NULL,
                                              rows_from(out_strides, 0, h, nq, dv), streamed((long)bh * nq * dv)};
        status = for_each_block(bh, nq, threads, (long)ROWS * (d + width), query_block, &queries, 0,
                                heads_in_turn(h, qsh, qsn));
    }
    if (!top_out) free(top);
    free(state);
    return status;
}

/* The backward's query rows: a = softmax(q_i), b = g_i (padded to width); as a side effect
 * d q_i = P_i * (dP_i - dP_i . P_i) with dP_i = g_i S^T. */
struct efficient_queries {
    const float *q, *grad, *state_t; /* state_t: S^T per head, width x dp */
    float *grad_q;
    int h, d, dp, dv, width;
    long n, qsb, qsh, qsn;
    struct rows_at grad_at, grad_q_at;
    int stream; /* streaming stores for grad_q */
};

static int efficient_query_source(const void *ctx, int g, long j, long z, long *next, float *a, float *b,
                                  float *scratch) {
    const struct efficient_queries *c = ctx;
    const int bi = g / c->h, hi = g % c->h, d = c->d, dp = c->dp, width = c->width;
    const int rows = (int)(z - j < ROWS ? z - j : ROWS);
    const long ahead = z < j + rows + ROWS ? z : j + rows + ROWS; /* the next block's rows */
    struct ahead_queue *queue = ahead_start(ROWS / 6 + d / 6); /* over the GEMMs of d q and of dS */
    ahead_rows(queue, c->q + bi * c->qsb + hi * c->qsh, j + rows, ahead, c->qsn, d);
    ahead_rows(queue, c->grad + row_offset(c->grad_at, c->h, g, 0), j + rows, ahead, c->grad_at.n, c->dv);
    for (int r = 0; r < rows; r++) {
        features(a + r * d, c->q + bi * c->qsb + hi * c->qsh + (j + r) * c->qsn, d, 2);
        float *row = b + r * width;
        memcpy(row, c->grad + row_offset(c->grad_at, c->h, g, j + r), sizeof(float) * c->dv);
        memset(row + c->dv, 0, sizeof(float) * (width - c->dv));
    }
    if (c->grad_q) {
        memset(scratch, 0, sizeof(float) * rows * dp);
        gemm_acc(rows, dp / W, width, b, width, 1, c->state_t + (long)g * width * dp, dp, scratch, dp);
        for (int r = 0; r < rows; r++) {
            const float *p = a + r * d;
            float *dq = scratch + r * dp;
            const float dot = dot_product(dq, p, d);
            for (int f = 0; f < d; f++) dq[f] = p[f] * (dq[f] - dot);
            put_row(c->grad_q + row_offset(c->grad_q_at, c->h, g, j + r), dq, d, c->stream);
        }
    }
    *next = j + rows;
    return rows;
}

/* d k_j and d v_j for a block of keys from dS (acc, d x width per head), dS^T and c = S . dS. */
struct efficient_key_grads {
    struct key_rows keys;
    const float *inv_sum, *acc, *acc_t, *dots;
    float *grad_k, *grad_v;
    int dp;
    struct rows_at grad_k_at, grad_v_at;
    int stream; /* streaming stores for grad_k and grad_v */
};

static void efficient_key_block(const void *ctx, int g, long j0, int rows, float *scratch) {
    const struct efficient_key_grads *c = ctx;
    const struct key_rows *in = &c->keys;
    const int bi = g / in->h, hi = g % in->h, d = in->d, dv = in->dv, width = in->width, dp = c->dp;
    const float *top = in->shift + (long)g * d, *inv = c->inv_sum + (long)g * d, *dots = c->dots + (long)g * d;
    float *w = scratch, *v1 = w + ROWS * d, *g_v = v1 + ROWS * width, *g_k = g_v + ROWS * width;
    const long ahead = in->n < j0 + rows + ROWS ? in->n : j0 + rows + ROWS; /* the next block's rows */
    struct ahead_queue *queue = ahead_start(2 * (ROWS / 6)); /* over the GEMMs of d v and d k */
    ahead_rows(queue, in->k + bi * in->ksb + hi * in->ksh, j0 + rows, ahead, in->ksn, d);
    ahead_rows(queue, in->v + bi * in->vsb + hi * in->vsh, j0 + rows, ahead, in->vsn, dv);
    for (int r = 0; r < rows; r++) {
        const long j = j0 + r;
        const float *kr = in->k + bi * in->ksb + hi * in->ksh + j * in->ksn;
        shifted_exp(w + r * d, kr, top, d);
        for (int f = 0; f < d; f++) w[r * d + f] *= inv[f];
        memcpy(v1 + r * width, in->v + bi * in->vsb + hi * in->vsh + j * in->vsn, sizeof(float) * dv);
        memset(v1 + r * width + dv, 0, sizeof(float) * (width - dv));
    }
    memset(g_v, 0, sizeof(float) * rows * width);
    memset(g_k, 0, sizeof(float) * rows * dp);
    gemm_acc(rows, width / W, d, w, d, 1, c->acc + (long)g * d * width, width, g_v, width);     /* W dS */
    gemm_acc(rows, dp / W, width, v1, width, 1, c->acc_t + (long)g * width * dp, dp, g_k, dp); /* V dS^T */
    for (int r = 0; r < rows; r++) {
        const int masked = in->mask && in->mask[bi * in->n + j0 + r];
        if (c->grad_k) {
            float *gk = g_k + r * dp;
            for (int f = 0; f < d; f++) gk[f] = masked ? 0.0f : w[r * d + f] * (gk[f] - dots[f]);
            put_row(c->grad_k + row_offset(c->grad_k_at, in->h, g, j0 + r), gk, d, c->stream);
        }
        if (c->grad_v) {
            float *gv = g_v + r * width;
            if (masked) memset(gv, 0, sizeof(float) * dv);
            put_row(c->grad_v + row_offset(c->grad_v_at, in->h, g, j0 + r), gv, dv, c->stream);
        }
    }
}

/* Gradients: q, k, v, mask, sizes and strides as the forward; state (B, H, D, Dv), top and inv_sum (B, H, D) from
 * it; grad (B, H, L, Dv). Writes grad_q (B, H, L, D), grad_k (B, H, S, D), grad_v (B, H, S, Dv), each skipped when
 * NULL. strides: the (B, H, position) strides of grad, grad_q, grad_k, grad_v (12 longs; NULL: all contiguous),
 * every row contiguous. */
int lm_efficient_attention_backward_f32(const float *q, const float *k, const float *v, const uint8_t *mask,
                                        const float *state, const float *top, const float *inv_sum,
                                        const float *grad, float *grad_q, float *grad_k, float *grad_v, int b,
                                        int h, long nq, long nk, int d, int dv, long qsb, long qsh, long qsn,
                                        long ksb, long ksh, long ksn, long vsb, long vsh, long vsn, int threads,
                                        const long *strides) {
    const int bh = b * h, width = (dv + W - 1) / W * W, dp = (d + W - 1) / W * W;
    threads = threads_for(threads);
    float *state_t = malloc(sizeof(float) * bh * width * dp), *acc = malloc(sizeof(float) * bh * d * width);
    float *acc_t = malloc(sizeof(float) * bh * width * dp), *dots = malloc(sizeof(float) * bh * d);
    int failed = !state_t || !acc || !acc_t || !dots;
    if (!failed) {
        transpose_states(state, dv, bh, d, dv - 1, width, dp, state_t);
        const struct efficient_queries queries = {q, grad, state_t, grad_q, h, d, dp, dv, width, nq, qsb, qsh, qsn,
                                                  rows_from(strides, 0, h, nq, dv), rows_from(strides, 1, h, nq, d),
                                                  streamed((long)bh * nq * d)};
        failed = accumulate_states(bh, nq, heads_in_turn(h, qsh, qsn), d, width, dv, 0, threads,
                                   efficient_query_source, &queries, acc, 0) != 0;
    }
    if (!failed && (grad_k || grad_v)) {
        for (long row = 0; row < (long)bh * d; row++) {
            float dot = 0.0f;
            for (int e = 0; e < dv; e++) dot += state[row * dv + e] * acc[row * width + e];
            dots[row] = dot;
        }
        transpose_states(acc, width, bh, d, dv - 1, width, dp, acc_t);
        const struct efficient_key_grads keys = {{k, v, mask, h, d, dv, width, 0, nk, ksb, ksh, ksn, vsb, vsh, vsn, top},
                                                 inv_sum, acc, acc_t, dots, grad_k, grad_v, dp,
                                                 rows_from(strides, 2, h, nk, d), rows_from(strides, 3, h, nk, dv),
                                                 streamed((long)bh * nk * d)};
        failed = for_each_block(bh, nk, threads, (long)ROWS * (d + 2 * width + dp), efficient_key_block, &keys,
                                0, heads_in_turn(h, ksh, ksn)) != 0;
    }
    free(state_t);
    free(acc);
    free(acc_t);
    free(dots);
    return failed ? -1 : 0;
}
