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
#define ROWS 32 /* rows per L1-resident block */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(32), aligned(4)));

static inline vf load(const float *p) { return *(const vf_u *)p; }
static inline void store(float *p, vf x) { *(vf_u *)p = x; }
static inline vf splat(float s) { return (vf){s, s, s, s, s, s, s, s}; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp for x <= 0 (Cephes' expf scheme: x = n ln2 + r, a degree-6 polynomial in r, 2^n through the
 * exponent bits), about 1 ulp. Below -87.3 the result is 0, as float32 elu(x) + 1 rounds to there. */
static inline vf exp_nonpositive(vf x) {
    vi tiny = x < splat(-87.3f);
    x = vselect(tiny, splat(-87.3f), x);
    vf t = x * splat(1.44269504088896341f) + splat(0.5f);
    vi n = __builtin_convertvector(t, vi); /* truncation; t < 0.5 here, so subtract 1 where it rounded up */
    n -= (vi)(__builtin_convertvector(n, vf) > t) & 1;
    vf fn = __builtin_convertvector(n, vf);
    vf r = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    vf scale = (vf)((n + 127) << 23);
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
 * A(i, p) = a[i * ai + p * ap] (so one routine serves A and A^T) and B, C rows hold whole vectors. */
static inline void tile_4x3(int k, const float *a, long ai, long ap, const float *b, long ldb, float *c, long ldc) {
    float *c1 = c + ldc, *c2 = c + 2 * ldc, *c3 = c + 3 * ldc;
    vf c00 = load(c), c01 = load(c + W), c02 = load(c + 2 * W);
    vf c10 = load(c1), c11 = load(c1 + W), c12 = load(c1 + 2 * W);
    vf c20 = load(c2), c21 = load(c2 + W), c22 = load(c2 + 2 * W);
    vf c30 = load(c3), c31 = load(c3 + W), c32 = load(c3 + 2 * W);
    const float *a0 = a, *a1 = a + ai, *a2 = a + 2 * ai, *a3 = a + 3 * ai;
    for (int p = 0; p < k; p++, b += ldb) {
        vf b0 = load(b), b1 = load(b + W), b2 = load(b + 2 * W), x;
        long o = p * ap;
        x = splat(a0[o]); c00 += x * b0; c01 += x * b1; c02 += x * b2;
        x = splat(a1[o]); c10 += x * b0; c11 += x * b1; c12 += x * b2;
        x = splat(a2[o]); c20 += x * b0; c21 += x * b1; c22 += x * b2;
        x = splat(a3[o]); c30 += x * b0; c31 += x * b1; c32 += x * b2;
    }
    store(c, c00); store(c + W, c01); store(c + 2 * W, c02);
    store(c1, c10); store(c1 + W, c11); store(c1 + 2 * W, c12);
    store(c2, c20); store(c2 + W, c21); store(c2 + 2 * W, c22);
    store(c3, c30); store(c3 + W, c31); store(c3 + 2 * W, c32);
}

static inline void tile_1x1(int k, const float *a, long ap, const float *b, long ldb, float *c) {
    vf acc = load(c);
    for (int p = 0; p < k; p++, b += ldb) acc += splat(a[p * ap]) * load(b);
    store(c, acc);
}

static void gemm_acc(int m, int nv, int k, const float *a, long ai, long ap, const float *b, long ldb, float *c,
                     long ldc) {
    int i = 0;
    for (; i + 4 <= m; i += 4) {
        int v = 0;
        for (; v + 3 <= nv; v += 3) tile_4x3(k, a + i * ai, ai, ap, b + v * W, ldb, c + i * ldc + v * W, ldc);
        for (; v < nv; v++)
            for (int r = 0; r < 4; r++) tile_1x1(k, a + (i + r) * ai, ap, b + v * W, ldb, c + (i + r) * ldc + v * W);
    }
    for (; i < m; i++)
        for (int v = 0; v < nv; v++) tile_1x1(k, a + i * ai, ap, b + v * W, ldb, c + i * ldc + v * W);
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
                for (int r = 0; r < rows; r++) {
                    const float *nd = num_den + r * dvp;
                    /* A zero normaliser means every visible key is masked (or phi(q) = 0): the numerator is
                     * 0 too and the output is defined as 0. */
                    const float inv = 1.0f / (nd[dv] == 0.0f ? 1.0f : nd[dv]);
                    float *o = out + ((long)g * nq + i0 + r) * dv;
                    int c = 0;
                    for (; c + W <= dv; c += W) store(o + c, load(nd + c) * splat(inv));
                    for (; c < dv; c++) o[c] = nd[c] * inv;
                }
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
