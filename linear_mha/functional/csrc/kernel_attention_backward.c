/* Gradients of non-causal kernel attention (lm_kernel_attention_f32 in kernel_attention.c), float32.
 *
 * With [num_i, den_i] = phi(q_i) [S, z], out_i = num_i / den_i and the incoming gradient g_i:
 *   r_i = [g_i / den_i, -(g_i . out_i) / den_i]          the gradient of the row [num_i, den_i]
 *   d phi(q_i) = r_i [S, z]^T                            queries, one pass: the state is known from the forward
 *   G = sum_i phi(q_i)^T r_i                             accumulated in that same pass, d x (Dv + 1)
 *   d phi(k_j) = [v_j, 1] G^T,   d v_j = phi(k_j) G[:, :Dv]    keys, a second pass
 *   d initial_state = G
 * and d q = d phi(q) * phi'(q) (likewise k), the derivative read off the recomputed features (taylor's, which
 * needs the input's norm, off the input row: simd.h's input_grad). Masked keys get
 * zero gradients. Only q, k, v, the output, the (small) state and the normalisers are kept from the forward.
 */
#include "kernel_attention.h"

/* g_phi (rows x d, row stride dp) += rows_b S^T for rope's split state (split_state), t = S^T (width x dp): the
 * rotated features' part is a GEMM over the value columns alone, and the plain features' part each row's
 * normaliser entry times the plain rows' normaliser column, half the product the full rows would take. */
static inline void split_state_product(int rows, int d, int dv, const float *rows_b, int width, const float *t, int dp,
                                       float *g_phi) {
    const int f = d / 2;
    gemm_acc(rows, (f + W - 1) / W, dv, rows_b, width, 1, t, dp, g_phi, dp);
    for (int r = 0; r < rows; r++)
        for (int e = f; e < d; e++) g_phi[r * dp + e] = rows_b[r * width + dv] * t[(long)dv * dp + e];
}

struct query_rows {
    const float *q, *grad, *out, *den, *state_t;
    float *grad_q;
    int h, d, dp, dv, width, map;
    long n, qsb, qsh, qsn;
    const struct rope_tables *rope; /* or NULL */
    const struct map_settings *ms;  /* or NULL */
    struct rows_at grad_at, out_at, grad_q_at;
    int stream; /* streaming stores for grad_q */
};

/* Rows phi(q_i), r_i for the accumulation of G; as a side effect writes d q_i = (r_i [S, z]^T) * phi'(q_i). */
static int query_source(const void *ctx, int g, long j, long z, long *next, float *a, float *b, float *scratch) {
    const struct query_rows *c = ctx;
    const int bi = g / c->h, hi = g % c->h;
    const int rows = (int)(z - j < ROWS ? z - j : ROWS), d_in = row_inputs(c->d, c->map, c->ms, c->rope);
    const long ahead = z < j + rows + ROWS ? z : j + rows + ROWS; /* the next block's rows */
    struct ahead_queue *queue = ahead_start(ROWS / 6 + c->d / 6); /* over the GEMMs of d q and of G */
    ahead_rows(queue, c->q + bi * c->qsb + hi * c->qsh, j + rows, ahead, c->qsn, d_in);
    ahead_rows(queue, c->grad + row_offset(c->grad_at, c->h, g, 0), j + rows, ahead, c->grad_at.n, c->dv);
    ahead_rows(queue, c->out + row_offset(c->out_at, c->h, g, 0), j + rows, ahead, c->out_at.n, c->dv);
    gradient_rows(c->grad + row_offset(c->grad_at, c->h, g, j), c->grad_at.n,
                  c->out + row_offset(c->out_at, c->h, g, j), c->out_at.n, c->den + (long)g * c->n + j, rows, c->dv,
                  c->width, b);
    struct focused_kept kept[ROWS]; /* focused's row reductions, made once for the features and the gradient */
    const float *src[ROWS];
    long pos[ROWS];
    row_addresses(src, pos, c->q + bi * c->qsb + hi * c->qsh, c->qsn, j, rows);
    block_features(a, c->d, src, pos, NULL, rows, c->d, c->map, c->ms, hi, c->rope, kept);
    if (c->grad_q) {
        const float *state_t = c->state_t + (long)g * c->width * c->dp;
        if (c->rope) {
            memset(scratch, 0, sizeof(float) * rows * c->dp);
            split_state_product(rows, c->d, c->dv, b, c->width, state_t, c->dp, scratch);
        } else {
            gemm_written(FULL, rows, c->dp / W, c->dv + 1, b, c->width, 1, state_t, c->dp, scratch, c->dp);
        }
        float *dq = c->grad_q + row_offset(c->grad_q_at, c->h, g, j), *dst[ROWS];
        for (int r = 0; r < rows; r++) dst[r] = dq + r * c->grad_q_at.n;
        block_input_grad(dst, c->stream, scratch, c->dp, a, c->d, src, pos, NULL, rows, c->d, d_in, c->map, c->ms,
                         hi, c->rope, kept);
    }
    *next = j + rows;
    return rows;
}

/* d phi(k_j) = [v_j, 1] G^T and d v_j = phi(k_j) G[:, :Dv] for a block of keys, zero for masked ones. */
struct key_grads {
    const float *k, *v;
    const uint8_t *mask;
    const float *acc, *acc_t; /* G (d x width) and G^T (width x dp) of every head */
    float *grad_k, *grad_v;
    int h, d, dp, dv, width, map;
    long n, ksb, ksh, ksn, vsb, vsh, vsn;
    const struct rope_tables *rope; /* or NULL */
    const struct map_settings *ms;  /* or NULL */
    struct rows_at grad_k_at, grad_v_at;
    int stream; /* streaming stores for grad_k and grad_v */
};

static void key_block(const void *ctx, int g, long j0, int rows, float *scratch) {
    const struct key_grads *c = ctx;
    const int bi = g / c->h, hi = g % c->h, d = c->d, dp = c->dp, dv = c->dv, width = c->width;
    float *phi = scratch, *v1 = phi + ROWS * d, *g_phi = v1 + ROWS * width, *g_v1 = g_phi + ROWS * dp;
    const int d_in = row_inputs(d, c->map, c->ms, c->rope);
    const long ahead = c->n < j0 + rows + ROWS ? c->n : j0 + rows + ROWS; /* the next block's rows */
    struct ahead_queue *queue = ahead_start(2 * (ROWS / 6)); /* over the GEMMs of d phi(k) and d v */
    ahead_rows(queue, c->k + bi * c->ksb + hi * c->ksh, j0 + rows, ahead, c->ksn, d_in);
    ahead_rows(queue, c->v + bi * c->vsb + hi * c->vsh, j0 + rows, ahead, c->vsn, dv);
    struct focused_kept kept[ROWS]; /* focused's row reductions, made once for the features and the gradient */
    const float *src[ROWS];
    long pos[ROWS];
    const uint8_t *masked = c->mask ? c->mask + bi * c->n + j0 : NULL; /* never read: zero features and values */
    for (int r = 0; r < rows; r++) {
        const long j = j0 + r;
        float *row = v1 + r * width;
        src[r] = c->k + bi * c->ksb + hi * c->ksh + j * c->ksn;
        pos[r] = j;
        if (masked && masked[r]) {
            memset(row, 0, sizeof(float) * width);
            continue;
        }
        memcpy(row, c->v + bi * c->vsb + hi * c->vsh + j * c->vsn, sizeof(float) * dv);
        row[dv] = 1.0f;
        memset(row + dv + 1, 0, sizeof(float) * (width - dv - 1));
    }
    block_features(phi, d, src, pos, masked, rows, d, c->map, c->ms, key_head(c->map, c->ms, hi), c->rope, kept);
    const float *acc = c->acc + (long)g * d * width, *acc_t = c->acc_t + (long)g * width * dp;
    if (c->rope) { /* G holds values on the rotated rows only, so d v takes those rows alone */
        memset(g_phi, 0, sizeof(float) * rows * dp);
        memset(g_v1, 0, sizeof(float) * rows * width);
        split_state_product(rows, d, dv, v1, width, acc_t, dp, g_phi);
        gemm_cols(FULL, rows, dv, d / 2, phi, d, 1, acc, width, g_v1, width);
    } else { /* d v over whole vectors of its Dv columns (G's padding columns are zero) */
        gemm_written(FULL, rows, dp / W, dv + 1, v1, width, 1, acc_t, dp, g_phi, dp);
        gemm_written(FULL, rows, (dv + W - 1) / W, d, phi, d, 1, acc, width, g_v1, width);
    }
    float *dk0 = c->grad_k ? c->grad_k + row_offset(c->grad_k_at, c->h, g, j0) : NULL;
    float *dv0 = c->grad_v ? c->grad_v + row_offset(c->grad_v_at, c->h, g, j0) : NULL;
    if (dk0) {
        float *dst[ROWS];
        for (int r = 0; r < rows; r++) dst[r] = dk0 + r * c->grad_k_at.n;
        block_input_grad(dst, c->stream, g_phi, dp, phi, d, src, pos, masked, rows, d, d_in, c->map, c->ms,
                         key_head(c->map, c->ms, hi), c->rope, kept);
    }
    if (dv0) {
        float zeros[dv];
        memset(zeros, 0, sizeof zeros);
        for (int r = 0; r < rows; r++)
            put_row(dv0 + r * c->grad_v_at.n, masked && masked[r] ? zeros : g_v1 + r * width, dv, c->stream);
    }
}

static int noncausal_backward(const float *q, const float *k, const float *v, const uint8_t *mask, const float *state,
                              const float *den, const float *out, const float *grad, float *grad_q, float *grad_k,
                              float *grad_v, float *grad_state, int b, int h, long nq, long nk, int d, int dv, long qsb,
                              long qsh, long qsn, long ksb, long ksh, long ksn, long vsb, long vsh, long vsn, int map,
                              int threads, const struct rope_tables *rope, const struct map_settings *ms,
                              const long *strides) {
    const int bh = b * h, width = (dv + 1 + W - 1) / W * W, dp = (d + W - 1) / W * W;
    const int d_in = row_inputs(d, map, ms, rope);
    threads = threads_for(threads);
    float *state_t = malloc(sizeof(float) * bh * width * dp), *acc = malloc(sizeof(float) * bh * d * width);
    float *acc_t = malloc(sizeof(float) * bh * width * dp);
    int failed = !state_t || !acc || !acc_t;
    if (!failed) {
        transpose_states(state, dv + 1, bh, d, dv, width, dp, state_t);
        const struct query_rows queries = {q, grad, out, den, state_t, grad_q, h, d, dp, dv, width, map, nq,
                                           qsb, qsh, qsn, rope, ms, rows_from(strides, 1, h, nq, dv),
                                           rows_from(strides, 0, h, nq, dv), rows_from(strides, 2, h, nq, d_in),
                                           streamed((long)bh * nq * d_in)};
        failed = accumulate_states(bh, nq, heads_in_turn(h, qsh, qsn), d, width, dv + 1, rope ? d / 2 : 0, threads,
                                   query_source, &queries, acc, /* rows that add parameter gradients per thread: */
                                   ms && ms->grad_scale) != 0;
    }
    if (!failed && rope) split_state(acc, bh, d, width, dv); /* the state's entries rope holds at zero get none */
    if (!failed && grad_state)
        for (long g = 0; g < (long)bh * d; g++) memcpy(grad_state + g * (dv + 1), acc + g * width, sizeof(float) * (dv + 1));
    if (!failed && (grad_k || grad_v)) {
        transpose_states(acc, width, bh, d, dv, width, dp, acc_t);
        const struct key_grads keys = {k, v, mask, acc, acc_t, grad_k, grad_v, h, d, dp, dv, width, map, nk,
                                       ksb, ksh, ksn, vsb, vsh, vsn, rope, ms, rows_from(strides, 3, h, nk, d_in),
                                       rows_from(strides, 4, h, nk, dv), streamed((long)bh * nk * d_in)};
        failed = for_each_block(bh, nk, threads, (long)ROWS * (d + 2 * width + dp), key_block, &keys,
                                ms && ms->grad_scale, /* parameter gradients summed per thread */
                                heads_in_turn(h, ksh, ksn)) != 0;
    }
    free(state_t);
    free(acc);
    free(acc_t);
    return failed ? -1 : 0;
}

/* q, k, v, mask, strides, sizes and map as the forward; state (B, H, D, Dv + 1) and den (B, H, L) from it,
 * contiguous; out (B, H, L, Dv) its output and grad (B, H, L, Dv) the incoming gradient. Writes grad_q (B, H, L,
 * D), grad_k (B, H, S, D), grad_v (B, H, S, Dv) (each skipped when NULL) and grad_state (B, H, D, Dv + 1,
 * contiguous, or NULL). strides: 3 longs (over B, H, position) for each of out, grad, grad_q, grad_k and grad_v in
 * that order, their rows contiguous (NULL: all contiguous). power, scale: the focused map's, as the forward;
 * grad_scale (threads, H, D), zeroed by the caller, receives the scales' gradient in one slice per thread (NULL:
 * not wanted; it is summed only from the rows whose grad_q or grad_k is written, so a caller wanting it asks for
 * both). */
int lm_kernel_attention_backward_f32(const float *q, const float *k, const float *v, const uint8_t *mask,
                                     const float *state, const float *den, const float *out, const float *grad,
                                     float *grad_q, float *grad_k, float *grad_v, float *grad_state, int b, int h,
                                     long nq, long nk, int d, int dv, long qsb, long qsh, long qsn, long ksb,
                                     long ksh, long ksn, long vsb, long vsh, long vsn, int map, int threads,
                                     float power, const float *scale, float *grad_scale, const long *strides) {
    struct map_settings ms = settings_of(map, power, scale, grad_scale, h);
    struct hedgehog_grads hedgehog;
    if (map == HEDGEHOG && hedgehog_grads_start(&ms.hedgehog, &hedgehog, threads_for(threads), grad_scale != NULL))
        return -1;
    const int status = noncausal_backward(q, k, v, mask, state, den, out, grad, grad_q, grad_k, grad_v, grad_state, b,
                                          h, nq, nk, d, dv, qsb, qsh, qsn, ksb, ksh, ksn, vsb, vsh, vsn, map, threads,
                                          NULL, &ms, strides);
    if (map == HEDGEHOG) hedgehog_grads_finish(&ms.hedgehog, grad_scale);
    return status;
}

/* The gradients of lm_rope_kernel_attention_f32 (n positions, d = twice the map's features, its tables), the
 * arguments as above without the extra keys' state. */
int lm_rope_kernel_attention_backward_f32(const float *q, const float *k, const float *v, const uint8_t *mask,
                                          const float *state, const float *den, const float *out, const float *grad,
                                          float *grad_q, float *grad_k, float *grad_v, int b, int h, long n, int d,
                                          int dv, long qsb, long qsh, long qsn, long ksb, long ksh, long ksn,
                                          long vsb, long vsh, long vsn, int map, int threads, const float *cos,
                                          const float *sin, int rotated, const long *strides) {
    const struct rope_tables rope = {cos, sin, rotated};
    return noncausal_backward(q, k, v, mask, state, den, out, grad, grad_q, grad_k, grad_v, NULL, b, h, n, n, d, dv,
                              qsb, qsh, qsn, ksb, ksh, ksn, vsb, vsh, vsn, map, threads, &rope, NULL, strides);
}


/* Gradients of causal attention (lm_causal_kernel_attention_f32). Per chunk c, with S_c the state before it,
 * M_c = tril(phi(Q_c) phi(K_c)^T), R_c the gradient rows of [num, den]_c and dM_c = tril(R_c [V_c, 1]^T):
 *   d phi(Q_c) = R_c S_c^T + dM_c phi(K_c)                                 forward order (S_c grows)
 *   G_c = sum_{c' >= c} phi(Q_c')^T R_c'                                   the gradient reaching S_c
 *   d [V_c, 1] = M_c^T R_c + phi(K_c) G_{c+1}
 *   d phi(K_c) = dM_c^T phi(Q_c) + [V_c, 1] G_{c+1}^T                      reverse order (G grows)
 *   d initial_state = G_0
 * Two passes per head recompute the features instead of keeping them; S is never rebuilt by subtraction. */
struct causal_backward {
    struct causal_inputs in;
    const float *init, *den, *out, *grad;
    float *grad_q, *grad_k, *grad_v, *grad_state;
    int width, dp, ldt;
    long parts;
    /* With parts > 1, each part's state S at its start and gradient G at its end (bh x parts x d x width). */
    const float *starts, *ends;
    struct rows_at out_at, grad_at, grad_q_at, grad_k_at, grad_v_at;
    int stream; /* streaming stores for the input gradients */
    int turn;   /* heads a task walks in turn (causal_turn); a task is (group of turn heads, part) */
};

/* A chunk as both causal passes need it: load_chunk's features (row stride dp), values and phi(k)^T (k_t NULL:
 * the d q pass does not read it), [v, 1] transposed into the first Dv + 1 rows of v1_t (width x ldt) and the
 * gradient rows of [num, den]. The rows of the next chunk, grad's and out's with them, are queued as
 * load_chunk queues its own (the next head's at these positions, or the chunk before in the reverse pass). */
static void load_gradient_chunk(const struct causal_backward *c, int g, long i0, int rows, struct next_chunk next,
                                float *phi_q, float *phi_k, float *v1, float *k_t, float *v1_t, float *r_rows) {
    const struct causal_inputs *in = &c->in;
    const int width = c->width, ldt = c->ldt;
    struct ahead_queue *queue = load_chunk(in, g, i0, rows, next, phi_q, phi_k, c->dp, v1, width, k_t, ldt);
    const long end = chunk_end(in, next);
    const row_queuer ahead = rows_queuer(next_follows(next, g, i0 + rows));
    ahead(queue, c->grad + row_offset(c->grad_at, in->h, next.g, 0), next.i0, end, c->grad_at.n, in->dv);
    ahead(queue, c->out + row_offset(c->out_at, in->h, next.g, 0), next.i0, end, c->out_at.n, in->dv);
    gradient_rows(c->grad + row_offset(c->grad_at, in->h, g, i0), c->grad_at.n,
                  c->out + row_offset(c->out_at, in->h, g, i0), c->out_at.n, c->den + (long)g * in->n + i0, rows,
                  in->dv, width, r_rows);
    transpose_rows(v1, width, rows, in->dv + 1, v1_t, ldt);
}

/* A causal backward task's thread-local buffers: one chunk's rows and products, shared by its heads in turn. */
struct chunk_buffers {
    float *phi_q, *phi_k, *v1, *r_rows, *k_t, *v1_t, *scores, *d_scores, *g_phi, *g_v1;
};

static struct chunk_buffers chunk_buffers_in(const struct causal_backward *c, float *scratch) {
    struct chunk_buffers b;
    const int dp = c->dp, width = c->width, ldt = c->ldt;
    b.phi_q = scratch, b.phi_k = b.phi_q + ROWS * dp, b.v1 = b.phi_k + ROWS * dp, b.r_rows = b.v1 + ROWS * width;
    b.k_t = b.r_rows + ROWS * width, b.v1_t = b.k_t + c->in.d * ldt, b.scores = b.v1_t + width * ldt;
    b.d_scores = b.scores + ROWS * ldt, b.g_phi = b.d_scores + ROWS * ldt, b.g_v1 = b.g_phi + ROWS * dp;
    return b;
}

/* Forward order, one chunk of head g: its d q, and S^T (acc_t, width x dp) grown past it. */
static void query_chunk_backward(const struct causal_backward *c, int g, long i0, int rows, struct next_chunk next,
                                 const struct chunk_buffers *b, float *acc_t) {
    const int d = c->in.d, dv = c->in.dv, width = c->width, dp = c->dp, ldt = c->ldt, map = c->in.map;
    const int bi = g / c->in.h, hi = g % c->in.h;
    load_gradient_chunk(c, g, i0, rows, next, b->phi_q, b->phi_k, b->v1, NULL, b->v1_t, b->r_rows);
    gemm_written(FULL, rows, dp / W, dv + 1, b->r_rows, width, 1, acc_t, dp, b->g_phi, dp);
    lower_scores(rows, dv + 1, b->r_rows, width, b->v1_t, ldt, b->d_scores);
    gemm_shaped(LOWER_K, rows, dp / W, rows, b->d_scores, ldt, 1, b->phi_k, dp, b->g_phi, dp);
    float *dq = c->grad_q + row_offset(c->grad_q_at, c->in.h, g, i0), *dst[ROWS];
    const float *src[ROWS];
    for (int r = 0; r < rows; r++) {
        dst[r] = dq + r * c->grad_q_at.n;
        src[r] = c->in.q + bi * c->in.qsb + hi * c->in.qsh + (i0 + r) * c->in.qsn;
    }
    block_input_grad(dst, c->stream, b->g_phi, dp, b->phi_q, dp, src, NULL, NULL, rows, d,
                     map_inputs(d, map, c->in.ms), map, c->in.ms, hi, NULL, NULL);
    gemm_acc(dv + 1, dp / W, rows, b->v1, 1, width, b->phi_k, dp, acc_t, dp); /* S^T += V1^T phi(K) */
}

/* Reverse order, one chunk of head g: its d k and d v, and G (acc, d x width) grown past it; acc_t is room for
 * G^T (width x dp). */
static void key_chunk_backward(const struct causal_backward *c, int g, long i0, int rows, struct next_chunk next,
                               const struct chunk_buffers *b, float *acc, float *acc_t) {
    const int d = c->in.d, dv = c->in.dv, width = c->width, dp = c->dp, ldt = c->ldt, map = c->in.map;
    const int bi = g / c->in.h, hi = g % c->in.h;
    load_gradient_chunk(c, g, i0, rows, next, b->phi_q, b->phi_k, b->v1, b->k_t, b->v1_t, b->r_rows);
    lower_scores(rows, d, b->phi_q, dp, b->k_t, ldt, b->scores);
    lower_scores(rows, dv + 1, b->r_rows, width, b->v1_t, ldt, b->d_scores);
    transpose_states(acc, width, 1, d, width - 1, width, dp, acc_t);
    /* M^T R over whole vectors of d v's Dv columns, then phi(K) G added */
    gemm_written(UPPER_K, rows, (dv + W - 1) / W, rows, b->scores, 1, ldt, b->r_rows, width, b->g_v1, width);
    gemm_cols(FULL, rows, dv, d, b->phi_k, dp, 1, acc, width, b->g_v1, width);
    gemm_written(UPPER_K, rows, dp / W, rows, b->d_scores, 1, ldt, b->phi_q, dp, b->g_phi, dp); /* dM^T phi(Q) */
    gemm_acc(rows, dp / W, dv + 1, b->v1, width, 1, acc_t, dp, b->g_phi, dp);           /* V1 G^T */
    float *dk0 = c->grad_k ? c->grad_k + row_offset(c->grad_k_at, c->in.h, g, i0) : NULL;
    float *dv0 = c->grad_v ? c->grad_v + row_offset(c->grad_v_at, c->in.h, g, i0) : NULL;
    const uint8_t *masked = c->in.mask ? c->in.mask + bi * c->in.n + i0 : NULL;
    if (dk0) {
        float *dst[ROWS];
        const float *src[ROWS];
        for (int r = 0; r < rows; r++) {
            dst[r] = dk0 + r * c->grad_k_at.n;
            src[r] = c->in.k + bi * c->in.ksb + hi * c->in.ksh + (i0 + r) * c->in.ksn;
        }
        block_input_grad(dst, c->stream, b->g_phi, dp, b->phi_k, dp, src, NULL, masked, rows, d,
                         map_inputs(d, map, c->in.ms), map, c->in.ms, key_head(map, c->in.ms, hi), NULL, NULL);
    }
    if (dv0) {
        float zeros[dv];
        memset(zeros, 0, sizeof zeros);
        for (int r = 0; r < rows; r++)
            put_row(dv0 + r * c->grad_v_at.n, masked && masked[r] ? zeros : b->g_v1 + r * width, dv, c->stream);
    }
    gemm_cols(FULL, d, dv + 1, rows, b->phi_q, 1, dp, b->r_rows, width, acc, width); /* G += phi(Q)^T R */
}

/* Task (group of turn heads, part): both passes over the part's chunks, each chunk over the group's heads in turn
 * (causal_turn), each head carrying its own S^T and G. */
static void causal_part_backward(const void *ctx, int item, float *scratch) {
    const struct causal_backward *c = ctx;
    const int d = c->in.d, dv = c->in.dv, width = c->width, dp = c->dp, turn = c->turn;
    const long n = c->in.n, group = item / c->parts, part = item % c->parts, a = n * part / c->parts;
    const long z = n * (part + 1) / c->parts, last = z > a ? a + (z - a - 1) / ROWS * ROWS : a - 1;
    const struct chunk_buffers b = chunk_buffers_in(c, scratch);
    float *accs = b.g_v1 + ROWS * width, *acc_ts = accs + (long)turn * d * width; /* turn of each */
    const long acc_size = (long)d * width, acc_t_size = (long)width * dp;
    if (c->grad_q) {
        for (int t = 0; t < turn; t++) {
            const long g = group * turn + t;
            float *acc_t = acc_ts + t * acc_t_size;
            if (c->starts) transpose_states(c->starts + (g * c->parts + part) * acc_size, width, 1, d, dv, width, dp,
                                            acc_t);
            else if (c->init) transpose_states(c->init + g * d * (dv + 1), dv + 1, 1, d, dv, width, dp, acc_t);
            else memset(acc_t, 0, sizeof(float) * acc_t_size);
        }
        for (long i0 = a; i0 < z; i0 += ROWS) {
            const int rows = (int)(z - i0 < ROWS ? z - i0 : ROWS);
            for (int t = 0; t < turn; t++) {
                const int g = (int)(group * turn + t);
                const struct next_chunk next = next_in_turn(g, t, turn, i0, i0 + rows < z ? i0 + rows : -1);
                query_chunk_backward(c, g, i0, rows, next, &b, acc_ts + t * acc_t_size);
            }
        }
    }
    if (!c->grad_k && !c->grad_v && !c->grad_state) return;
    for (int t = 0; t < turn; t++) {
        const long g = group * turn + t;
        float *acc = accs + t * acc_size;
        if (c->ends) memcpy(acc, c->ends + (g * c->parts + part) * acc_size, sizeof(float) * acc_size);
        else memset(acc, 0, sizeof(float) * acc_size);
    }
    for (long i0 = last; i0 >= a; i0 -= ROWS) {
        const int rows = (int)(z - i0 < ROWS ? z - i0 : ROWS);
        for (int t = 0; t < turn; t++) {
            const int g = (int)(group * turn + t);
            const struct next_chunk next = next_in_turn(g, t, turn, i0, i0 - ROWS >= a ? i0 - ROWS : -1);
            key_chunk_backward(c, g, i0, rows, next, &b, accs + t * acc_size, acc_ts); /* S^T's room, unused now */
        }
    }
    if (c->grad_state && part == 0) /* G after the first part is G_0 */
        for (int t = 0; t < turn; t++) {
            const long g = group * turn + t;
            for (int f = 0; f < d; f++)
                memcpy(c->grad_state + (g * d + f) * (dv + 1), accs + t * acc_size + f * width,
                       sizeof(float) * (dv + 1));
        }
}

int lm_causal_kernel_attention_backward_f32(const float *q, const float *k, const float *v, const uint8_t *mask,
                                            const float *init, const float *den, const float *out,
                                            const float *grad, float *grad_q, float *grad_k, float *grad_v,
                                            float *grad_state, int b, int h, long n, int d, int dv, long qsb,
                                            long qsh, long qsn, long ksb, long ksh, long ksn, long vsb, long vsh,
                                            long vsn, int map, int threads, float power, const float *scale,
                                            float *grad_scale, const long *strides) {
    const int bh = b * h, width = (dv + 1 + W - 1) / W * W, dp = (d + W - 1) / W * W;
    struct map_settings ms = settings_of(map, power, scale, grad_scale, h);
    const int ldt = (ROWS + W - 1) / W * W, d_in = map_inputs(d, map, &ms);
    const struct rows_at out_at = rows_from(strides, 0, h, n, dv), grad_at = rows_from(strides, 1, h, n, dv);
    threads = threads_for(threads);
    struct hedgehog_grads hedgehog;
    if (map == HEDGEHOG && hedgehog_grads_start(&ms.hedgehog, &hedgehog, threads, grad_scale != NULL)) return -1;
    /* With fewer heads than threads each sequence is cut into parts, as in the forward: the parts' key sums give
     * their starting states S and the parts' sums of phi(q)^T R, scanned from the end, their final gradients G. */
    const long parts = parts_for(bh, n, threads, 8 * ROWS), size = (long)bh * parts * d * width;
    float *starts = NULL, *ends = NULL;
    if (parts > 1) {
        starts = malloc(sizeof(float) * size);
        ends = malloc(sizeof(float) * size);
        const struct key_rows keys = {k, v, mask, h, d, dv, width, map, n, ksb, ksh, ksn, vsb, vsh, vsn, NULL, NULL,
                                      &ms};
        const struct query_rows queries = {q, grad, out, den, NULL, NULL, h, d, dp, dv, width, map, n, qsb, qsh, qsn,
                                           NULL, &ms, grad_at, out_at, {0, 0, 0}};
        if (!starts || !ends ||
            partial_states(bh, n, parts, 1, d, width, dv + 1, 0, threads, key_source, &keys, starts, 0) != 0 ||
            scan_parts(starts, init, bh, parts, d, dv, width, 0) != 0 ||
            partial_states(bh, n, parts, 1, d, width, dv + 1, 0, threads, query_source, &queries, ends, 0) != 0 ||
            scan_parts(ends, NULL, bh, parts, d, dv, width, 1) != 0) {
            free(starts);
            free(ends);
            if (map == HEDGEHOG) hedgehog_grads_finish(&ms.hedgehog, NULL);
            return -1;
        }
    }
    const struct causal_backward backward = {{q, k, v, mask, h, d, dv, map, n, qsb, qsh, qsn, ksb, ksh, ksn, vsb,
                                              vsh, vsn, &ms}, init, den, out, grad, grad_q, grad_k, grad_v, grad_state,
                                             width, dp, ldt, parts, starts, ends, out_at, grad_at,
                                             rows_from(strides, 2, h, n, d_in), rows_from(strides, 3, h, n, d_in),
                                             rows_from(strides, 4, h, n, dv), streamed((long)bh * n * d_in),
                                             causal_turn(bh, h, parts, threads, qsh, qsn)};
    const long scratch = (long)ROWS * (3 * dp + 3 * width + 2 * ldt) + (long)d * ldt + (long)width * ldt +
                         (long)backward.turn * width * (d + dp);
    const int status = for_each_task((int)(bh / backward.turn * parts), threads, scratch, causal_part_backward,
                                     &backward, grad_scale != NULL); /* a fixed order: parameter gradients per thread */
    if (map == HEDGEHOG) hedgehog_grads_finish(&ms.hedgehog, grad_scale);
    free(starts);
    free(ends);
    return status;
}
