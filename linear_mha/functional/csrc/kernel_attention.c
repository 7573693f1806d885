/* Fused CPU kernels for kernel (linear) attention with an elementwise feature map, float32.
 *
 *   phi(x) = elu(x) + 1  (map 0)   or   relu(x)  (map 1)
 *   out_i  = phi(q_i) S / phi(q_i) z,   S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)
 *
 * Composed from tensor ops, this is two GEMMs plus half a dozen elementwise passes over N-sized tensors, and on
 * a CPU those passes cost more than the GEMMs. Here the feature map, the ones column that carries z through
 * the value GEMM, and the division are applied to a few rows at a time in thread-local buffers that stay in
 * L1, right before (or after) a register-blocked GEMM reads them: q, k, v are read once, out is written once.
 *
 * Loaded through ctypes by ../native.py, which compiles this file on first use; plain C with GCC/Clang vector
 * extensions (8 floats, AVX2 where the compiler targets it) and OpenMP, so it needs no PyTorch headers.
 * Every entry point returns 0, or -1 when a buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define W 8
#define ROWS 48 /* rows per cache-resident block, a multiple of the 6-row tile */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(32), aligned(4)));

static inline vf load(const float *p) { return *(const vf_u *)p; }
static inline void store(float *p, vf x) { *(vf_u *)p = x; }
static inline vf splat(float s) { return (vf){s, s, s, s, s, s, s, s}; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp for x <= 0 (Cephes' expf scheme: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial in r, 2^n
 * through the exponent bits), about 1 ulp. n is rounded by adding 1.5 * 2^23, whose low mantissa bits then
 * hold n, which is cheaper than a float -> int -> float floor. Below -87.3 the result is 0, where float32
 * elu(x) + 1 has long rounded to 0 too. */
static inline vf exp_nonpositive(vf x) {
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23 */
    const vi tiny = x < splat(-87.3f);
    x = vselect(tiny, splat(-87.3f), x);
    const vf shifted = x * splat(1.44269504088896341f) + magic;
    const vf fn = shifted - magic;
    const vi n = (vi)shifted - (vi)magic;
    const vf r = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const vf scale = (vf)((n + 127) << 23);
    return vselect(tiny, splat(0.0f), p * scale);
}

static inline vf feature_vec(vf x, int map) {
    vi positive = x > splat(0.0f);
    if (map == 0) return vselect(positive, x + splat(1.0f), exp_nonpositive(vselect(positive, splat(0.0f), x)));
    return vselect(positive, x, splat(0.0f));
}

static inline float feature_scalar(float x, int map) {
    if (map == 0) return x > 0.0f ? x + 1.0f : expf(x);
    return x > 0.0f ? x : 0.0f;
}

static void features(float *dst, const float *src, int d, int map) {
    int f = 0;
    for (; f + W <= d; f += W) store(dst + f, feature_vec(load(src + f), map));
    for (; f < d; f++) dst[f] = feature_scalar(src[f], map);
}

/* Register-blocked GEMM, C[i][.] += sum_p A(i, p) B[p][.] for i < m, over nv vectors of columns, where
 * A(i, p) = a[i * ai + p * ap] (so one routine serves A and A^T) and B, C rows hold whole vectors.
 * A tile of R rows x V vectors keeps its R * V accumulators in registers; R and V are constants at every call
 * site, so the loops unroll fully. 6 x 2 (12 accumulators, 2 loads and 6 broadcasts per 12 FMAs) is the
 * shape that fills the 16 AVX2 registers; it measured 1.6-2x faster here than 4 x 3. */
static inline __attribute__((always_inline)) void tile(const int R, const int V, int k, const float *a, long ai,
                                                       long ap, const float *b, long ldb, float *c, long ldc) {
    vf acc[6][2], bv[2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) acc[r][v] = load(c + r * ldc + v * W);
    for (int p = 0; p < k; p++, b += ldb) {
        const float *ar = a + p * ap;
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) bv[v] = load(b + v * W);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const vf x = splat(ar[r * ai]);
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) acc[r][v] += x * bv[v];
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) store(c + r * ldc + v * W, acc[r][v]);
}

/* The lower-triangular variants skip the products a causal block never uses: with LOWER_K, rows i.. of the
 * tile read only p < i + R (the scores times values); with LOWER_N they write only columns < i + R (the
 * scores themselves). */
enum { FULL = 0, LOWER_K = 1, LOWER_N = 2 };

#define TILE_ROW(R)                                                                                        \
    do {                                                                                                   \
        const int kk = shape == LOWER_K && i + R < k ? i + R : k;                                         \
        const int nn = shape == LOWER_N && (i + R + W - 1) / W < nv ? (i + R + W - 1) / W : nv;           \
        const float *ar = a + i * ai;                                                                      \
        float *cr = c + i * ldc;                                                                           \
        int v = 0;                                                                                         \
        for (; v + 2 <= nn; v += 2) tile(R, 2, kk, ar, ai, ap, b + v * W, ldb, cr + v * W, ldc);          \
        if (v < nn) tile(R, 1, kk, ar, ai, ap, b + v * W, ldb, cr + v * W, ldc);                          \
    } while (0)

static void gemm_shaped(int shape, int m, int nv, int k, const float *a, long ai, long ap, const float *b, long ldb,
                        float *c, long ldc) {
    int i = 0;
    for (; i + 6 <= m; i += 6) TILE_ROW(6);
    for (; i + 3 <= m; i += 3) TILE_ROW(3);
    for (; i < m; i++) TILE_ROW(1);
}

static void gemm_acc(int m, int nv, int k, const float *a, long ai, long ap, const float *b, long ldb, float *c,
                     long ldc) {
    gemm_shaped(FULL, m, nv, k, a, ai, ap, b, ldb, c, ldc);
}

/* out[r][c] = num_den[r][c] / num_den[r][dv] for rows of width dvp. A zero normaliser means every visible key
 * is masked (or phi(q) = 0): the numerator is 0 too and the output is defined as 0. */
static void normalise_rows(const float *num_den, int rows, int dvp, int dv, float *out) {
    for (int r = 0; r < rows; r++, num_den += dvp, out += dv) {
        const float inv = 1.0f / (num_den[dv] == 0.0f ? 1.0f : num_den[dv]);
        int c = 0;
        for (; c + W <= dv; c += W) store(out + c, load(num_den + c) * splat(inv));
        for (; c < dv; c++) out[c] = num_den[c] * inv;
    }
}

static inline int threads_for(int requested) { return requested > 0 ? requested : 1; }

/* Non-causal attention. q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) given by element strides over
 * (B, H, position) with a contiguous last dimension; mask (B, S) bytes, nonzero = ignore, or NULL; init
 * (B, H, D, Dv + 1) contiguous state of extra keys, or NULL; out (B, H, L, Dv) contiguous. */
int lm_kernel_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask, const float *init,
                            float *out, int b, int h, long nq, long nk, int d, int dv, long qsb, long qsh,
                            long qsn, long ksb, long ksh, long ksn, long vsb, long vsh, long vsn, int map,
                            int threads) {
    const int bh = b * h, nvec = (dv + 1 + W - 1) / W, dvp = nvec * W;
    threads = threads_for(threads);
    /* With fewer heads than threads the key sum is split along the sequence and reduced afterwards. */
    long parts = bh >= 2 * threads ? 1 : (2 * threads + bh - 1) / bh;
    if (parts > (nk + 255) / 256) parts = (nk + 255) / 256;
    if (parts < 1) parts = 1;
    const long state_size = (long)d * dvp;
    float *states = calloc((size_t)bh * parts * state_size, sizeof(float));
    if (!states) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *phi = malloc(sizeof(float) * ROWS * d), *v1 = calloc((size_t)ROWS * dvp, sizeof(float));
        if (!phi || !v1) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            for (int r = 0; r < ROWS; r++) v1[r * dvp + dv] = 1.0f;
#pragma omp for schedule(dynamic, 1)
            for (long item = 0; item < bh * parts; item++) {
                const int g = (int)(item / parts), bi = g / h, hi = g % h;
                const long part = item % parts, a = nk * part / parts, z = nk * (part + 1) / parts;
                float *state = states + item * state_size;
                for (long j0 = a; j0 < z; j0 += ROWS) {
                    int rows = 0;
                    for (long j = j0; j < j0 + ROWS && j < z; j++) {
                        if (mask && mask[bi * nk + j]) continue; /* a masked key adds nothing */
                        features(phi + rows * d, k + bi * ksb + hi * ksh + j * ksn, d, map);
                        memcpy(v1 + rows * dvp, v + bi * vsb + hi * vsh + j * vsn, sizeof(float) * dv);
                        rows++;
                    }
                    /* state[f][c] += sum_j phi[j][f] v1[j][c]: A = phi^T */
                    gemm_acc(d, nvec, rows, phi, 1, d, v1, dvp, state, dvp);
                }
            }
#pragma omp for schedule(static)
            for (int g = 0; g < bh; g++) {
                float *state = states + (long)g * parts * state_size;
                for (long part = 1; part < parts; part++)
                    for (long e = 0; e < state_size; e++) state[e] += state[part * state_size + e];
                if (init)
                    for (int f = 0; f < d; f++)
                        for (int c = 0; c <= dv; c++) state[f * dvp + c] += init[((long)g * d + f) * (dv + 1) + c];
            }
            const long row_blocks = (nq + ROWS - 1) / ROWS;
            float *num_den = v1; /* reused: the key pass is over */
#pragma omp for schedule(static)
            for (long item = 0; item < bh * row_blocks; item++) {
                const int g = (int)(item / row_blocks), bi = g / h, hi = g % h;
                const long i0 = (item % row_blocks) * ROWS;
                const int rows = (int)(nq - i0 < ROWS ? nq - i0 : ROWS);
                for (int r = 0; r < rows; r++) features(phi + r * d, q + bi * qsb + hi * qsh + (i0 + r) * qsn, d, map);
                memset(num_den, 0, sizeof(float) * rows * dvp);
                gemm_acc(rows, nvec, d, phi, d, 1, states + (long)g * parts * state_size, dvp, num_den, dvp);
                normalise_rows(num_den, rows, dvp, dv, out + ((long)g * nq + i0) * dv);
            }
        }
        free(phi);
        free(v1);
    }
    free(states);
    return failed ? -1 : 0;
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
        const float inv = 1.0f / (acc[dv] == 0.0f ? 1.0f : acc[dv]);
        for (int i = 0; i < dv; i++) out[(long)g * dv + i] = acc[i] * inv;
    }
    return 0;
}

/* Causal attention, query i seeing keys j <= i. Shapes, strides, mask and init as lm_kernel_attention_f32,
 * with L = S = n. Chunks of ROWS positions: within a chunk the masked score block phi(Q_c) phi(K_c)^T
 * multiplies [V_c, 1]; the keys of earlier chunks arrive through the carried state S, so
 * [num, den]_c = phi(Q_c) S + tril(phi(Q_c) phi(K_c)^T) [V_c, 1], then S += phi(K_c)^T [V_c, 1].
 * Heads run in parallel; each walks its chunks in order. */
int lm_causal_kernel_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask,
                                   const float *init, float *out, int b, int h, long n, int d, int dv, long qsb,
                                   long qsh, long qsn, long ksb, long ksh, long ksn, long vsb, long vsh, long vsn,
                                   int map, int threads) {
    const int bh = b * h, nvec = (dv + 1 + W - 1) / W, dvp = nvec * W;
    const int score_vec = (ROWS + W - 1) / W, ldt = score_vec * W;
    threads = threads_for(threads);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *phi_q = malloc(sizeof(float) * ROWS * d), *phi_k = malloc(sizeof(float) * ROWS * d);
        float *k_t = calloc((size_t)d * ldt, sizeof(float)), *scores = malloc(sizeof(float) * ROWS * ldt);
        float *v1 = calloc((size_t)ROWS * dvp, sizeof(float)), *num_den = malloc(sizeof(float) * ROWS * dvp);
        float *state = malloc(sizeof(float) * d * dvp);
        if (!phi_q || !phi_k || !k_t || !scores || !v1 || !num_den || !state) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int g = 0; g < bh; g++) {
                const int bi = g / h, hi = g % h;
                memset(state, 0, sizeof(float) * d * dvp);
                if (init)
                    for (int f = 0; f < d; f++)
                        memcpy(state + f * dvp, init + ((long)g * d + f) * (dv + 1), sizeof(float) * (dv + 1));
                for (long i0 = 0; i0 < n; i0 += ROWS) {
                    const int rows = (int)(n - i0 < ROWS ? n - i0 : ROWS);
                    for (int r = 0; r < rows; r++) {
                        const long j = i0 + r;
                        features(phi_q + r * d, q + bi * qsb + hi * qsh + j * qsn, d, map);
                        float *vr = v1 + r * dvp;
                        if (mask && mask[bi * n + j]) { /* a masked key: no features, no value, no normaliser */
                            memset(phi_k + r * d, 0, sizeof(float) * d);
                            memset(vr, 0, sizeof(float) * (dv + 1));
                        } else {
                            features(phi_k + r * d, k + bi * ksb + hi * ksh + j * ksn, d, map);
                            memcpy(vr, v + bi * vsb + hi * vsh + j * vsn, sizeof(float) * dv);
                            vr[dv] = 1.0f;
                        }
                        for (int f = 0; f < d; f++) k_t[f * ldt + r] = phi_k[r * d + f];
                    }
                    memset(num_den, 0, sizeof(float) * rows * dvp);
                    gemm_acc(rows, nvec, d, phi_q, d, 1, state, dvp, num_den, dvp);
                    memset(scores, 0, sizeof(float) * rows * ldt);
                    gemm_shaped(LOWER_N, rows, (rows + W - 1) / W, d, phi_q, d, 1, k_t, ldt, scores, ldt);
                    for (int r = 0; r < rows; r++)
                        for (int c = r + 1; c < rows; c++) scores[r * ldt + c] = 0.0f;
                    gemm_shaped(LOWER_K, rows, nvec, rows, scores, ldt, 1, v1, dvp, num_den, dvp);
                    gemm_acc(d, nvec, rows, phi_k, 1, d, v1, dvp, state, dvp);
                    normalise_rows(num_den, rows, dvp, dv, out + ((long)g * n + i0) * dv);
                }
            }
        }
        free(phi_q); free(phi_k); free(k_t); free(scores); free(v1); free(num_den); free(state);
    }
    return failed ? -1 : 0;
}
