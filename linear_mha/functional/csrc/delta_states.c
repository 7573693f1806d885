/* The delta rule's pass from chunk to chunk, float32, forward and backward (delta_rule.py has the math): with the
 * pseudo-values of a chunk known up to the state it starts from,
 *
 *   u_c = u_free_c - w_c S_c,    S_{c+1} = a_c S_c + k_c^T u_c          (S: d_k x d_v, S_0 the initial state)
 *
 * where k_c are the chunk's keys already decayed to its end and a_c the chunk's whole decay. This is the only part
 * of the chunked form that runs chunk after chunk; each step is two small GEMMs on a state kept in cache.
 * Tensors are contiguous: u_free, u (BH, n, C, d_v); w, k (BH, n, C, d_k); carried (BH, n); states
 * (BH, n + 1, d_k, d_v): the state entering every chunk and the final one.
 */
#include "kernel_attention.h"

struct delta_states {
    const float *u_free, *w, *k, *carried, *init, *grad_u, *grad_final, *states, *u;
    float *u_out, *states_out, *final, *grad_u_free, *grad_w, *grad_k, *grad_carried, *grad_init;
    long n;
    int c, dk, dv;
};

/* rows x cols floats at src (row stride ld_src) into dst (row stride ld_dst), the columns past cols zeroed. */
static void copy_rows(float *dst, int ld_dst, const float *src, int ld_src, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        memcpy(dst + (long)r * ld_dst, src + (long)r * ld_src, sizeof(float) * cols);
        memset(dst + (long)r * ld_dst + cols, 0, sizeof(float) * (ld_dst - cols));
    }
}

static void forward_head(const void *ctx, int g, float *scratch) {
    const struct delta_states *s = ctx;
    const int c = s->c, dk = s->dk, dv = s->dv, dvp = whole_vectors(dv);
    float *state = scratch, *u = state + (long)dk * dvp, *product = u + (long)c * dvp;
    const long chunk_v = (long)c * dv, chunk_k = (long)c * dk, head = (long)g * s->n;
    if (s->init) copy_rows(state, dvp, s->init + (long)g * dk * dv, dv, dk, dv);
    else memset(state, 0, sizeof(float) * dk * dvp);
    for (long i = 0; i < s->n; i++) {
        const long at = head + i;
        if (s->states_out) /* S_i, see below */
            copy_rows(s->states_out + at * dk * dv + g * (long)dk * dv, dv, state, dvp, dk, dv);
        copy_rows(u, dvp, s->u_free + at * chunk_v, dv, c, dv);
        memset(product, 0, sizeof(float) * c * dvp);
        gemm_shaped(FULL, c, dvp / W, dk, s->w + at * chunk_k, dk, 1, state, dvp, product, dvp);
        for (long x = 0; x < (long)c * dvp; x += W) store(u + x, load(u + x) - load(product + x));
        copy_rows(s->u_out + at * chunk_v, dv, u, dvp, c, dv);
        const vf kept = splat(s->carried[at]);
        for (long x = 0; x < (long)dk * dvp; x += W) store(state + x, load(state + x) * kept);
        gemm_shaped(FULL, dk, dvp / W, c, s->k + at * chunk_k, 1, dk, u, dvp, state, dvp);
    }
    if (s->states_out) copy_rows(s->states_out + (head + s->n) * dk * dv + g * (long)dk * dv, dv, state, dvp, dk, dv);
    copy_rows(s->final + (long)g * dk * dv, dv, state, dvp, dk, dv);
}

/* Walking the chunks back with G = dL/dS_{c+1}: the pseudo-values' gradient is g_u = du_c + k_c G; then
 * dk_c = u_c G^T, da_c = <S_c, G>, dw_c = -g_u S_c^T, du_free_c = g_u, and dL/dS_c = a_c G - w_c^T g_u. */
static void backward_head(const void *ctx, int g, float *scratch) {
    const struct delta_states *s = ctx;
    const int c = s->c, dk = s->dk, dv = s->dv, dvp = whole_vectors(dv), dkp = whole_vectors(dk);
    float *grad = scratch, *g_u = grad + (long)dk * dvp, *g_t = g_u + (long)c * dvp, *s_t = g_t + (long)dv * dkp;
    float *rows_k = s_t + (long)dv * dkp, *product = rows_k + (long)c * dkp;
    const long chunk_v = (long)c * dv, chunk_k = (long)c * dk, head = (long)g * s->n;
    if (s->grad_final) copy_rows(grad, dvp, s->grad_final + (long)g * dk * dv, dv, dk, dv);
    else memset(grad, 0, sizeof(float) * dk * dvp);
    for (long i = s->n - 1; i >= 0; i--) {
        const long at = head + i;
        const float *state = s->states + (at + g) * dk * dv; /* S_i: head g's states start at (g (n + 1)) */
        copy_rows(g_u, dvp, s->grad_u + at * chunk_v, dv, c, dv);
        gemm_shaped(FULL, c, dvp / W, dk, s->k + at * chunk_k, dk, 1, grad, dvp, g_u, dvp);
        copy_rows(s->grad_u_free + at * chunk_v, dv, g_u, dvp, c, dv);

        transpose_rows(grad, dvp, dk, dv, g_t, dkp); /* G^T: dv x dk (the padding columns stay as calloc left them) */
        memset(rows_k, 0, sizeof(float) * c * dkp);
        gemm_shaped(FULL, c, dkp / W, dv, s->u + at * chunk_v, dv, 1, g_t, dkp, rows_k, dkp);
        copy_rows(s->grad_k + at * chunk_k, dk, rows_k, dkp, c, dk);

        float dot = 0.0f;
        for (int f = 0; f < dk; f++)
            for (int x = 0; x < dv; x++) dot += state[(long)f * dv + x] * grad[(long)f * dvp + x];
        s->grad_carried[at] = dot;

        transpose_rows(state, dv, dk, dv, s_t, dkp); /* S_i^T: dv x dk */
        memset(rows_k, 0, sizeof(float) * c * dkp);
        gemm_shaped(FULL, c, dkp / W, dv, g_u, dvp, 1, s_t, dkp, rows_k, dkp);
        for (int r = 0; r < c; r++)
            for (int f = 0; f < dk; f++) s->grad_w[at * chunk_k + (long)r * dk + f] = -rows_k[(long)r * dkp + f];

        memset(product, 0, sizeof(float) * dk * dvp);
        gemm_shaped(FULL, dk, dvp / W, c, s->w + at * chunk_k, 1, dk, g_u, dvp, product, dvp);
        const vf kept = splat(s->carried[at]);
        for (long x = 0; x < (long)dk * dvp; x += W) store(grad + x, load(grad + x) * kept - load(product + x));
    }
    if (s->grad_init) copy_rows(s->grad_init + (long)g * dk * dv, dv, grad, dvp, dk, dv);
}

/* Forward: u_free, w, k, carried, init (BH, d_k, d_v) or NULL -> u, final (BH, d_k, d_v), and states unless NULL
 * (only a backward reads them). Returns 0, or -1 when a thread's buffers could not be allocated. */
int lm_delta_states_f32(const float *u_free, const float *w, const float *k, const float *carried, const float *init,
                        float *u, float *states, float *final, int bh, long n, int c, int dk, int dv, int threads) {
    const struct delta_states s = {u_free, w, k, carried, init, NULL, NULL, NULL, NULL,
                                   u, states, final, NULL, NULL, NULL, NULL, NULL, n, c, dk, dv};
    const int dvp = whole_vectors(dv);
    return for_each_task(bh, threads_for(threads), (long)dvp * (dk + 2L * c), forward_head, &s, 0);
}

/* Backward: the forward's inputs, its u and states, grad_u (as u) and grad_final (BH, d_k, d_v) or NULL -> the
 * gradients of u_free, w, k, carried, and of init (NULL: not wanted). */
int lm_delta_states_backward_f32(const float *w, const float *k, const float *carried, const float *u,
                                 const float *states, const float *grad_u, const float *grad_final,
                                 float *grad_u_free, float *grad_w, float *grad_k, float *grad_carried,
                                 float *grad_init, int bh, long n, int c, int dk, int dv, int threads) {
    const struct delta_states s = {NULL, w, k, carried, NULL, grad_u, grad_final, states, u, NULL, NULL, NULL,
                                   grad_u_free, grad_w, grad_k, grad_carried, grad_init, n, c, dk, dv};
    const int dvp = whole_vectors(dv), dkp = whole_vectors(dk);
    const long scratch = (long)dk * dvp + (long)c * dvp + 2L * dv * dkp + (long)c * dkp + (long)dk * dvp;
    return for_each_task(bh, threads_for(threads), scratch, backward_head, &s, 0);
}
