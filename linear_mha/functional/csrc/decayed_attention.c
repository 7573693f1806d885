/* Causal linear attention whose state decays by a scalar gate per head and position (RetNet's retention, a
 * Mamba-2-style decay, any gated_linear_attention with one gate per position), float32:
 *
 *   out_i = sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j          (g <= 0: the log gates)
 *
 * No feature map and no normaliser. Chunks of ROWS positions as the elu kernel's causal forward walks them: with e_r
 * the gates summed from the chunk's first position to its r-th, a chunk's rows get exp(e_r) q_r S from the carried
 * state S, the masked scores (q_r . k_c) exp(e_r - e_c) times V from the chunk itself, and then
 * S <- exp(e_last) S + sum_c exp(e_last - e_c) k_c v_c^T. Every exponent is a sum of gates, <= 0: nothing overflows,
 * and the sums stay within one chunk, so a long sequence loses no precision to a large running total.
 *
 * reverse = 1 runs the same along the positions from the last to the first (the anti-causal sums of the gradients):
 * out_j = sum_{i >= j} exp(g_{j+1} + ... + g_i) (q_j . k_i) v_i. Together with the forward, that gives all three
 * input gradients (see native_decayed.py).
 */
#include "kernel_attention.h"

struct decayed {
    const float *q, *k, *v, *gate;
    float *out;
    int h, dk, dv, dvp, reverse;
    long n;
    long s[12]; /* (B, H, position) strides of q, k, v, out */
};

/* Element offset of logical position p of head g in a tensor with strides s (3 longs). */
static inline long at(const struct decayed *c, const long *s, int g, long p) {
    const long row = c->reverse ? c->n - 1 - p : p;
    return (long)(g / c->h) * s[0] + (long)(g % c->h) * s[1] + row * s[2];
}

/* The gate between logical positions p - 1 and p (0 at p = 0, where the state is still empty). */
static inline float gate_at(const struct decayed *c, const float *gates, long p) {
    if (c->reverse) return p == 0 ? 0.0f : gates[c->n - p];
    return gates[p];
}

static void decayed_head(const void *ctx, int g, float *scratch) {
    const struct decayed *c = ctx;
    const int dk = c->dk, dv = c->dv, dvp = c->dvp, ldt = whole_vectors(ROWS);
    float *qr = scratch, *kr = qr + ROWS * dk, *k_t = kr + ROWS * dk, *scores = k_t + (long)dk * ldt;
    float *vr = scores + ROWS * ldt, *num = vr + ROWS * dvp, *state = num + ROWS * dvp, *e = state + (long)dk * dvp;
    const float *gates = c->gate + (long)g * c->n;
    memset(state, 0, sizeof(float) * dk * dvp);
    memset(vr, 0, sizeof(float) * ROWS * dvp); /* the padding columns stay zero */
    for (long p0 = 0; p0 < c->n; p0 += ROWS) {
        const int rows = (int)(c->n - p0 < ROWS ? c->n - p0 : ROWS);
        float sum = 0.0f;
        for (int r = 0; r < rows; r++) {
            const long p = p0 + r;
            sum += gate_at(c, gates, p);
            e[r] = sum;
            memcpy(qr + r * dk, c->q + at(c, c->s, g, p), sizeof(float) * dk);
            const float *kp = c->k + at(c, c->s + 3, g, p);
            memcpy(kr + r * dk, kp, sizeof(float) * dk);
            for (int f = 0; f < dk; f++) k_t[f * ldt + r] = kp[f];
            memcpy(vr + r * dvp, c->v + at(c, c->s + 6, g, p), sizeof(float) * dv);
        }
        memset(num, 0, sizeof(float) * rows * dvp);
        if (p0 > 0) { /* the carried state, decayed to each row */
            gemm_shaped(FULL, rows, dvp / W, dk, qr, dk, 1, state, dvp, num, dvp);
            for (int r = 0; r < rows; r++) {
                const vf scale = splat(exp_nonpositive_scalar(e[r] < 0.0f ? e[r] : 0.0f));
                for (int x = 0; x < dvp; x += W) store(num + r * dvp + x, load(num + r * dvp + x) * scale);
            }
        }
        lower_scores(rows, dk, qr, dk, k_t, ldt, scores);
        for (int r = 0; r < rows; r++) /* exp(e_r - e_c) for c <= r; the columns past r hold zeros */
            for (int x = 0; x <= r; x += W) {
                const vf ratio = exp_nonpositive(vmin(splat(e[r]) - load(e + x), splat(0.0f)));
                store(scores + r * ldt + x, load(scores + r * ldt + x) * ratio);
            }
        gemm_shaped(LOWER_K, rows, dvp / W, rows, scores, ldt, 1, vr, dvp, num, dvp);
        for (int r = 0; r < rows; r++) memcpy(c->out + at(c, c->s + 9, g, p0 + r), num + r * dvp, sizeof(float) * dv);
        if (p0 + rows < c->n) { /* the state the next chunk starts from */
            const float last = e[rows - 1];
            const vf kept = splat(exp_nonpositive_scalar(last < 0.0f ? last : 0.0f));
            for (long x = 0; x < (long)dk * dvp; x += W) store(state + x, load(state + x) * kept);
            for (int r = 0; r < rows; r++) {
                const float to_end = exp_nonpositive_scalar(last - e[r] < 0.0f ? last - e[r] : 0.0f);
                for (int f = 0; f < dk; f++) kr[r * dk + f] *= to_end;
            }
            gemm_shaped(FULL, dk, dvp / W, rows, kr, 1, dk, vr, dvp, state, dvp);
        }
    }
}

/* q, k (B, H, N, Dk), v (B, H, N, Dv), out (B, H, N, Dv) with their (B, H, position) strides in `strides` (12 longs:
 * q, k, v, out) and contiguous rows; gate (B, H, N) contiguous, the log gates (<= 0). Returns 0, or -1 when a
 * thread's buffers could not be allocated. */
int lm_decayed_causal_f32(const float *q, const float *k, const float *v, const float *gate, float *out, int b, int h,
                          long n, int dk, int dv, const long *strides, int reverse, int threads) {
    const int dvp = whole_vectors(dv), ldt = whole_vectors(ROWS);
    struct decayed c = {q, k, v, gate, out, h, dk, dv, dvp, reverse, n, {0}};
    memcpy(c.s, strides, sizeof(c.s));
    const long scratch = (long)ROWS * (2 * dk + ldt + 2 * dvp) + (long)dk * (ldt + dvp) + ldt + W;
    return for_each_task(b * h, threads_for(threads), scratch, decayed_head, &c, 0);
}
