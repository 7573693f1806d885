/* Fused CPU kernels for kernel (linear) attention with an elementwise feature map, float32: the forward passes
 * and the recurrent decoding step (the gradients are in kernel_attention_backward.c).
 *
 *   phi(x) = elu(x) + 1  (map 0),   relu(x)  (map 1),   x: features made by the caller (map 3),
 *            [1, x / |x|]  (map 4, taylor: one feature more than x has values), taylor2's (map 5),
 *            or the focused map with its power and per-head scales (map 6, focused.h)
 *   out_i  = phi(q_i) S / phi(q_i) z,   S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)
 *
 * Composed from tensor ops, this is two GEMMs plus half a dozen elementwise passes over N-sized tensors, and on
 * a CPU those passes cost more than the GEMMs. Here the feature map, the ones column that carries z through
 * the value GEMM ([S, z] = sum_j phi(k_j) [v_j, 1]^T, "the state", d x (Dv + 1) padded to whole vectors), and
 * the division are applied to a few rows at a time in thread-local buffers that stay in cache, right before
 * (or after) a register-blocked GEMM reads them: q, k, v are read once, out is written once.
 *
 * Loaded through ctypes by ../native.py, which compiles the csrc/ files on first use. Tensors are passed as
 * pointers with element strides over (B, H, position) and a contiguous last dimension. Every entry point
 * returns 0, or -1 when a buffer could not be allocated.
 */
#include "kernel_attention.h"

long lm_stream_bytes = 16L << 20;

/* out = exp(x) for n values x <= 0, as every kernel takes it (exp_nonpositive; the last n % W values through its
 * scalar form): for the tests of its accuracy and of where it gives 0. */
int lm_exp_nonpositive_f32(const float *x, float *out, long n) {
    long f = 0;
    for (; f + W <= n; f += W) store(out + f, exp_nonpositive(load(x + f)));
    for (; f < n; f++) out[f] = exp_nonpositive_scalar(x[f]);
    return 0;
}

static int noncausal_attention(const float *q, const float *k, const float *v, const uint8_t *mask, const float *init,
                               float *out, float *state_out, float *den_out, int b, int h, long nq, long nk, int d,
                               int dv, long qsb, long qsh, long qsn, long ksb, long ksh, long ksn, long vsb, long vsh,
                               long vsn, int map, int threads, const struct rope_tables *rope,
                               const struct map_settings *ms, struct rows_at out_at) {
    const int bh = b * h, nvec = (dv + 1 + W - 1) / W, dvp = nvec * W;
    threads = threads_for(threads);
    const long state_size = (long)d * dvp;
    float *states = malloc(sizeof(float) * bh * state_size);
    if (!states) return -1;
    const struct key_rows keys = {k, v, mask, h, d, dv, dvp, map, nk, ksb, ksh, ksn, vsb, vsh, vsn, NULL, rope, ms};
    if (accumulate_states(bh, nk, heads_in_turn(h, ksh, ksn), d, dvp, dv + 1, rope ? d / 2 : 0, threads, key_source,
                          &keys, states, 0) != 0) {
        free(states);
        return -1;
    }
    if (rope) split_state(states, bh, d, dvp, dv);
    for (int g = 0; g < bh; g++)
        for (int f = 0; f < d; f++) {
            float *row = states + g * state_size + f * dvp;
            if (init)
                for (int c = 0; c <= dv; c++) row[c] += init[((long)g * d + f) * (dv + 1) + c];
            if (state_out) memcpy(state_out + ((long)g * d + f) * (dv + 1), row, sizeof(float) * (dv + 1));
        }
    const struct query_outputs queries = {q, states, out, den_out, h, d, dv, dvp, nq, qsb, qsh, qsn, map, rope, ms,
                                          out_at, streamed((long)bh * nq * dv)};
    const int status = for_each_block(bh, nq, threads, (long)ROWS * (d + dvp), query_block, &queries, 0,
                                       heads_in_turn(h, qsh, qsn));
    free(states);
    return status;
}

/* Non-causal attention. q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); mask (B, S) bytes, nonzero = ignore,
 * or NULL; init (B, H, D, Dv + 1) contiguous state of extra keys, or NULL; out (B, H, L, Dv), its strides over
 * (B, H, L) in out_strides (3 longs; NULL: contiguous), its rows contiguous.
 * For autograd, state_out (B, H, D, Dv + 1) receives the state and den_out (B, H, L) the normalisers (zeros
 * replaced by 1); either may be NULL. power and scale ((H, D) contiguous, or NULL): the focused map's settings
 * (map 6); for map 7 scale holds the program of a user's elementwise map (program_from); ignored by the others. */
int lm_kernel_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask, const float *init,
                            float *out, float *state_out, float *den_out, int b, int h, long nq, long nk, int d,
                            int dv, long qsb, long qsh, long qsn, long ksb, long ksh, long ksn, long vsb, long vsh,
                            long vsn, int map, int threads, float power, const float *scale,
                            const long *out_strides) {
    const struct map_settings ms = settings_of(map, power, scale, NULL, h);
    return noncausal_attention(q, k, v, mask, init, out, state_out, den_out, b, h, nq, nk, d, dv, qsb, qsh, qsn, ksb,
                               ksh, ksn, vsb, vsh, vsn, map, threads, NULL, &ms, rows_from(out_strides, 0, h, nq, dv));
}

/* The same with 2-D rotary position (struct rope_tables in kernel_attention.h): self-attention over n = nq = nk
 * positions, d = twice the map's feature count, cos and sin (n x rotated) contiguous; no extra keys, and no map
 * with settings (not focused: its features come made). den_out keeps a normaliser of 0 (its query's output is 0). */
int lm_rope_kernel_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                                 float *state_out, float *den_out, int b, int h, long n, int d, int dv, long qsb,
                                 long qsh, long qsn, long ksb, long ksh, long ksn, long vsb, long vsh, long vsn,
                                 int map, int threads, const float *cos, const float *sin, int rotated,
                                 const long *out_strides) {
    const struct rope_tables rope = {cos, sin, rotated};
    return noncausal_attention(q, k, v, mask, NULL, out, state_out, den_out, b, h, n, n, d, dv, qsb, qsh, qsn, ksb,
                               ksh, ksn, vsb, vsh, vsn, map, threads, &rope, NULL, rows_from(out_strides, 0, h, n, dv));
}

/* One recurrent decoding step for B*H = bh heads: q, k (bh, D), v (bh, Dv), state and new_state (bh, D,
 * Dv + 1) contiguous (state NULL for an empty context), out (bh, Dv). new_state = state + phi(k) [v, 1]^T and
 * out = phi(q) new_state normalised, in one pass over the state: each column block of the state is updated
 * and multiplied while its accumulator stays in a register. */
int lm_kernel_step_f32(const float *q, const float *k, const float *v, const float *state, float *new_state,
                       float *out, int bh, int d, int dv, int map) {
    const int width = dv + 1;
    float phi_q[d], phi_k[d], v1[width], acc[width];
    for (int g = 0; g < bh; g++) {
        features(phi_q, q + (long)g * d, d, map);
        features(phi_k, k + (long)g * d, d, map);
        memcpy(v1, v + (long)g * dv, sizeof(float) * dv);
        v1[dv] = 1.0f;
        const float *s = state ? state + (long)g * d * width : NULL;
        float *ns = new_state + (long)g * d * width;
        int c = 0;
        /* Four column vectors at a time: four independent accumulator chains hide the FMA latency. */
        for (; c + 4 * W <= width; c += 4 * W) {
            const vf v0 = load(v1 + c), v1_ = load(v1 + c + W), v2 = load(v1 + c + 2 * W), v3 = load(v1 + c + 3 * W);
            vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
            for (int f = 0; f < d; f++) {
                const vf pk = splat(phi_k[f]), pq = splat(phi_q[f]);
                vf r0 = pk * v0, r1 = pk * v1_, r2 = pk * v2, r3 = pk * v3;
                if (s) {
                    const float *sr = s + f * width + c;
                    r0 += load(sr); r1 += load(sr + W); r2 += load(sr + 2 * W); r3 += load(sr + 3 * W);
                }
                float *nr = ns + f * width + c;
                store(nr, r0); store(nr + W, r1); store(nr + 2 * W, r2); store(nr + 3 * W, r3);
                a0 += pq * r0; a1 += pq * r1; a2 += pq * r2; a3 += pq * r3;
            }
            store(acc + c, a0); store(acc + c + W, a1); store(acc + c + 2 * W, a2); store(acc + c + 3 * W, a3);
        }
        for (; c + W <= width; c += W) {
            const vf vc = load(v1 + c);
            vf sum = splat(0.0f);
            for (int f = 0; f < d; f++) {
                vf row = splat(phi_k[f]) * vc;
                if (s) row += load(s + f * width + c);
                store(ns + f * width + c, row);
                sum += splat(phi_q[f]) * row;
            }
            store(acc + c, sum);
        }
        for (; c < width; c++) {
            float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int f = 0; f < d; f++) {
                float x = phi_k[f] * v1[c] + (s ? s[f * width + c] : 0.0f);
                ns[f * width + c] = x;
                sum[f & 3] += phi_q[f] * x;
            }
            acc[c] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
        }
        const float inv = negligible(acc[dv]) ? 0.0f : 1.0f / acc[dv];
        for (int i = 0; i < dv; i++) out[(long)g * dv + i] = acc[i] * inv;
    }
    return 0;
}

/* Causal attention, query i seeing keys j <= i. Shapes, strides, mask, init, out and den_out as
 * lm_kernel_attention_f32, with L = S = n. Chunks of ROWS positions: within a chunk the masked score block
 * phi(Q_c) phi(K_c)^T multiplies [V_c, 1]; the keys of earlier chunks arrive through the carried state S, so
 * [num, den]_c = phi(Q_c) S + tril(phi(Q_c) phi(K_c)^T) [V_c, 1], then S += phi(K_c)^T [V_c, 1].
 * Heads run in parallel, each walking its chunks in order; in a module's layout a task walks a few heads in turn,
 * chunk by chunk, as their rows at the same positions share pages. With fewer heads than threads each head's
 * sequence is also cut into parts: a first parallel pass sums every part's keys into a state, a short scan turns
 * the sums into each part's starting state, and the parts then run in parallel, for about a third more work. */
struct causal_forward {
    struct causal_inputs in;
    const float *init, *starts; /* starts: each part's starting state (bh x parts x d x dvp), or NULL */
    float *out, *den_out;
    int dvp, ldt;
    long parts;
    struct rows_at out_at;
    int stream; /* streaming stores for out */
    int turn;   /* heads a task walks in turn (causal_turn); a task is (group of turn heads, part) */
};

static void causal_part(const void *ctx, int item, float *scratch) {
    const struct causal_forward *c = ctx;
    const int d = c->in.d, dv = c->in.dv, dvp = c->dvp, ldt = c->ldt, turn = c->turn;
    const long n = c->in.n, group = item / c->parts, part = item % c->parts, z = n * (part + 1) / c->parts;
    float *phi_q = scratch, *phi_k = phi_q + ROWS * d, *k_t = phi_k + ROWS * d, *scores = k_t + d * ldt;
    float *v1 = scores + ROWS * ldt, *num_den = v1 + ROWS * dvp, *states = num_den + ROWS * dvp; /* turn states */
    for (int t = 0; t < turn; t++) {
        const int g = (int)(group * turn + t);
        float *state = states + (long)t * d * dvp;
        if (c->starts) {
            memcpy(state, c->starts + ((long)g * c->parts + part) * d * dvp, sizeof(float) * d * dvp);
        } else {
            memset(state, 0, sizeof(float) * d * dvp);
            if (c->init)
                for (int f = 0; f < d; f++)
                    memcpy(state + f * dvp, c->init + ((long)g * d + f) * (dv + 1), sizeof(float) * (dv + 1));
        }
    }
    for (long i0 = n * part / c->parts; i0 < z; i0 += ROWS) {
        const int rows = (int)(z - i0 < ROWS ? z - i0 : ROWS);
        for (int t = 0; t < turn; t++) { /* the group's heads over these positions, whose rows share pages */
            const int g = (int)(group * turn + t);
            float *state = states + (long)t * d * dvp;
            const struct next_chunk next = next_in_turn(g, t, turn, i0, i0 + rows < z ? i0 + rows : -1);
            load_chunk(&c->in, g, i0, rows, next, phi_q, phi_k, d, v1, dvp, k_t, ldt);
            memset(num_den, 0, sizeof(float) * rows * dvp);
            gemm_cols(FULL, rows, dv + 1, d, phi_q, d, 1, state, dvp, num_den, dvp);
            lower_scores(rows, d, phi_q, d, k_t, ldt, scores);
            gemm_cols(LOWER_K, rows, dv + 1, rows, scores, ldt, 1, v1, dvp, num_den, dvp);
            gemm_cols(FULL, d, dv + 1, rows, phi_k, 1, d, v1, dvp, state, dvp);
            normalise_rows(num_den, rows, dvp, dv, c->out + row_offset(c->out_at, c->in.h, g, i0), c->out_at.n,
                           c->stream);
            if (c->den_out) store_normalisers(num_den, rows, dvp, dv, c->den_out + (long)g * n + i0);
        }
    }
}

int lm_causal_kernel_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask,
                                   const float *init, float *out, float *den_out, int b, int h, long n, int d,
                                   int dv, long qsb, long qsh, long qsn, long ksb, long ksh, long ksn, long vsb,
                                   long vsh, long vsn, int map, int threads, float power, const float *scale,
                                   const long *out_strides) {
    const int bh = b * h, dvp = (dv + 1 + W - 1) / W * W, ldt = (ROWS + W - 1) / W * W;
    const struct map_settings ms = settings_of(map, power, scale, NULL, h);
    threads = threads_for(threads);
    const long parts = parts_for(bh, n, threads, 8 * ROWS);
    float *starts = NULL;
    if (parts > 1) {
        starts = malloc(sizeof(float) * bh * parts * d * dvp);
        const struct key_rows keys = {k, v, mask, h, d, dv, dvp, map, n, ksb, ksh, ksn, vsb, vsh, vsn, NULL, NULL, &ms};
        if (!starts || partial_states(bh, n, parts, 1, d, dvp, dv + 1, 0, threads, key_source, &keys, starts, 0) != 0 ||
            scan_parts(starts, init, bh, parts, d, dv, dvp, 0) != 0) {
            free(starts);
            return -1;
        }
    }
    const struct causal_forward forward = {{q, k, v, mask, h, d, dv, map, n, qsb, qsh, qsn, ksb, ksh, ksn, vsb, vsh,
                                            vsn, &ms}, init, starts, out, den_out, dvp, ldt, parts,
                                           rows_from(out_strides, 0, h, n, dv), streamed((long)bh * n * dv),
                                           causal_turn(bh, h, parts, threads, qsh, qsn)};
    const long scratch = (long)ROWS * (2 * d + ldt + 2 * dvp) + (long)d * (ldt + forward.turn * dvp);
    const int status = for_each_task((int)(bh / forward.turn * parts), threads, scratch, causal_part, &forward, 0);
    free(starts);
    return status;
}
