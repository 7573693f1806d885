/* The arithmetic under the CPU kernels: 8-float vectors (GCC/Clang vector extensions, AVX2 where the compiler
 * targets it), an exp for non-positive arguments, the feature maps and their derivatives, and a
 * register-blocked GEMM. */
#ifndef LINEAR_MHA_SIMD_H
#define LINEAR_MHA_SIMD_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ahead.h"

/* Vector width in floats: 16 (one AVX-512 register) where the compiler targets AVX-512, else 8 (AVX2). Every
 * loop below is written for any W; the GEMM's tile (TILE_V vectors wide) fills the register file of either. */
#ifdef __AVX512F__
#include <immintrin.h>
#define W 16
#define TILE_V 4 /* 6 x 4 accumulators + 4 loads + a broadcast of the 32 registers */
#else
#define W 8
#define TILE_V 2 /* 6 x 2 accumulators + 2 loads + a broadcast of the 16 registers */
#endif
#define ROWS 48 /* rows per cache-resident block, a multiple of the 6-row tile */
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));

/* n rounded up to whole vectors. */
static inline int whole_vectors(int n) { return (n + W - 1) / W * W; }
static inline vf load(const float *p) { return *(const vf_u *)p; }
static inline void store(float *p, vf x) { *(vf_u *)p = x; }
/* A store that bypasses the caches (p aligned to a whole vector), for outputs far larger than the caches: a plain
 * store first reads the line it writes into, which doubles the traffic and holds a fill buffer the reads ahead
 * (ahead.h) need. stream_fence() makes such stores visible to other threads; the kernels' task loops end with it. */
#if W == 16
static inline void store_stream(float *p, vf x) { _mm512_stream_ps(p, (__m512)x); }
static inline void stream_fence(void) { _mm_sfence(); }
#elif defined(__AVX__)
#include <immintrin.h>
static inline void store_stream(float *p, vf x) { _mm256_stream_ps(p, (__m256)x); }
static inline void stream_fence(void) { _mm_sfence(); }
#else
static inline void store_stream(float *p, vf x) { store(p, x); }
static inline void stream_fence(void) {}
#endif
static inline int vector_aligned(const float *p) { return ((uintptr_t)p & (sizeof(vf) - 1)) == 0; }

/* dst[0..n) = src[0..n), with streaming stores where `stream` is set and dst starts on a whole vector. */
static inline void put_row(float *dst, const float *src, int n, int stream) {
    int c = 0;
    if (stream && vector_aligned(dst))
        for (; c + W <= n; c += W) store_stream(dst + c, load(src + c));
    memcpy(dst + c, src + c, sizeof(float) * (n - c));
}

/* A broadcast written lane by lane: for (vf){0} + s GCC 12 left extra zeroing instructions in the GEMM tiles, which
 * cost 9% of the elu forward at 8-float vectors and 6% at 16 (a loop over the lanes was 2.6x slower still). */
#if W == 16
static inline vf splat(float s) { return (vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
#else
static inline vf splat(float s) { return (vf){s, s, s, s, s, s, s, s}; }
#endif
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
/* a > b ? a : b and a < b ? a : b, lane by lane, so b where either is NaN: what x86's max and min instructions
 * compute, one instruction where the compare and the blend above take two (unlike the blend, they return a
 * subnormal as +0 when denormals are flushed, torch.set_flush_denormal). The elu map written with them (and its
 * exp's clamp) gives the same bits; its loop over a block of rows in cache took 0.40 against 0.50 ns per value on
 * the AVX2 machine (median of 5 runs, best of 30 timings each). */
#if W == 16
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
static inline vf vmin(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
#elif defined(__AVX__)
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
static inline vf vmin(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
#else
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
static inline vf vmin(vf a, vf b) { return vselect(a < b, a, b); }
#endif

/* The sum and the maximum of a vector's lanes, halving through 4-lane vectors (a few shuffles rather than W scalar
 * steps: row maps reduce every row of d values, 4 vectors at d = 64). */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

static inline float hsum(vf x) {
    v4f q[W / 4];
    memcpy(q, &x, sizeof q);
    for (int i = 1; i < W / 4; i++) q[0] += q[i];
    return (q[0][0] + q[0][2]) + (q[0][1] + q[0][3]);
}

static inline float hmax(vf x) {
    v4f q[W / 4];
    memcpy(q, &x, sizeof q);
    for (int i = 1; i < W / 4; i++) {
        const v4i more = q[i] > q[0];
        q[0] = (v4f)(((v4i)q[i] & more) | ((v4i)q[0] & ~more));
    }
    const float a = q[0][0] > q[0][1] ? q[0][0] : q[0][1], b = q[0][2] > q[0][3] ? q[0][2] : q[0][3];
    return a > b ? a : b;
}

/* exp(r) for |r| <= ln2 / 2: 1 + r + r^2 P(r), P of degree 4, whose coefficients were fitted here to the relative
 * error of exp on that interval (Lawson's iteration over weighted least squares): 3e-9 before rounding; through
 * exp_nonpositive every float <= 0 whose e^x is normal comes within 1.02 ulp (checked over all of them, with and
 * without FMA), as with Cephes' degree-5 P. One FMA fewer than Cephes' form. */
static inline vf exp_reduced(vf r) {
    vf p = splat(1.38146e-3f);
    p = p * r + splat(8.36871e-3f);
    p = p * r + splat(4.166839e-2f);
    p = p * r + splat(1.6666521e-1f);
    p = p * r + splat(4.9999994e-1f);
    p = p * r * r + r + splat(1.0f);
    return p;
}

/* exp for x <= 0 (Cephes' expf scheme: x = n ln2 + r with |r| <= ln2 / 2, exp_reduced(r) times 2^n), about 1 ulp,
 * 16 vector operations. Where n would be -127 or less (x below about -87.68) the result is 0: float32 elu(x) + 1
 * has long rounded to 0 there, and a softmax weight e^-87.7 is nothing beside its row's largest, 1. Above that, down
 * to n = -126, a result under FLT_MIN comes out subnormal, rounded once (x in (-87.68, -87.34)): products that read
 * it may take a microcode assist, a cost only arguments in that band pay, and a normaliser made of such features
 * counts as 0 (kernel_attention.h, negligible). With AVX-512, n is rounded and 2^n applied by one instruction
 * each (vrndscaleps, vscalefps) and the zeros are a mask on n. Elsewhere n is rounded by adding 1.5 * 2^23, whose
 * low mantissa bits then hold n, and 2^n is built in the exponent bits: x is first raised to -88, where n is -127,
 * so the exponent bits of 2^n are 0 and the product is 0 with no compare and mask (they were 2 of 19 operations,
 * and with a term fewer in exp_reduced the elu map's loop takes 0.46 against 0.57-0.61 ns per value). The two forms
 * give the same bits but where x log2(e) lies within rounding of a half-integer. exp_nonpositive_scalar is the
 * tails' form of the same. */
#ifdef __AVX512F__
static inline vf exp_nonpositive(vf x) {
    const vf fn = (vf)_mm512_roundscale_ps((__m512)(x * splat(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 kept = _mm512_cmp_ps_mask((__m512)fn, _mm512_set1_ps(-127.0f), _CMP_NLE_UQ); /* NaN kept */
    const vf r = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
    return (vf)_mm512_maskz_scalef_ps(kept, (__m512)exp_reduced(r), (__m512)fn);
}
#else
static inline vf exp_nonpositive(vf x) {
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23 */
    x = vmax(splat(-88.0f), x);          /* NaN kept */
    const vf shifted = x * splat(1.44269504088896341f) + magic;
    const vf fn = shifted - magic;
    const vi n = (vi)shifted - (vi)magic;
    const vf r = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
    const vf scale = (vf)((n + 127) << 23); /* +0 for n = -127 */
    return exp_reduced(r) * scale;
}
#endif

/* exp_nonpositive for one value: 0 where n, x log2(e) rounded, is -127 or less. */
static inline float exp_nonpositive_scalar(float x) { return x * 1.44269504f < -126.5f ? 0.0f : expf(x); }

/* The natural log of positive normal x (Cephes' logf scheme: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-8
 * polynomial in m - 1), about 1 ulp. e becomes a float by the same magic-number trick as above. */
static inline vf log_positive(vf x) {
    const vi bits = (vi)x;
    vi e = ((bits >> 23) & 0xff) - 126;                              /* x = m 2^e, m in [1/2, 1) */
    vf m = (vf)((bits & 0x007fffff) | 0x3f000000);
    const vi small = m < splat(0.707106781186547524f);
    e = e - (small & 1);                                               /* m < sqrt(1/2): m 2 and e - 1 */
    m = vselect(small, m + m, m) - splat(1.0f);
    const vf magic = splat(12582912.0f);                               /* 1.5 * 2^23 */
    const vf fe = (vf)((vi)magic + e) - magic;
    const vf z = m * m;
    vf p = splat(7.0376836292e-2f);
    p = p * m + splat(-1.1514610310e-1f);
    p = p * m + splat(1.1676998740e-1f);
    p = p * m + splat(-1.2420140846e-1f);
    p = p * m + splat(1.4249322787e-1f);
    p = p * m + splat(-1.6668057665e-1f);
    p = p * m + splat(2.0000714765e-1f);
    p = p * m + splat(-2.4999993993e-1f);
    p = p * m + splat(3.3333331174e-1f);
    vf y = m * z * p + fe * splat(-2.12194440e-4f) - z * splat(0.5f);
    return m + y + fe * splat(0.693359375f);
}

static inline vf feature_vec(vf x, int map) {
    /* elu + 1: exp(min(x, 0)) + max(x, 0), exp(0) being exactly 1; a NaN passes through both */
    if (map == 0) return exp_nonpositive(vmin(splat(0.0f), x)) + vmax(x, splat(0.0f));
    return vselect(~(x <= splat(0.0f)), x, splat(0.0f)); /* relu; NaN stays NaN, as torch.relu keeps it */
}

static inline float feature_scalar(float x, int map) {
    if (map == 0) return x > 0.0f ? x + 1.0f : exp_nonpositive_scalar(x);
    return x <= 0.0f ? 0.0f : x;
}

/* The largest of d values (a NaN among them may or may not be it: a row holding one gives NaN features anyway). */
static inline float row_max(const float *x, int d) {
    int f = 0;
    float top = x[0];
    if (d >= W) {
        vf top_v = load(x);
        for (f = W; f + W <= d; f += W) {
            const vf xv = load(x + f);
            top_v = vmax(xv, top_v);
        }
        top = hmax(top_v);
    }
    for (; f < d; f++) top = x[f] > top ? x[f] : top;
    return top;
}

/* softmax over a row of d values (map 2, Efficient Attention's query features). */
static inline void softmax_row(float *dst, const float *src, int d) {
    const float top = row_max(src, d);
    vf sum_v = splat(0.0f);
    int f = 0;
    for (; f + W <= d; f += W) {
        const vf e = exp_nonpositive(load(src + f) - splat(top));
        store(dst + f, e);
        sum_v += e;
    }
    float sum = hsum(sum_v);
    for (; f < d; f++) sum += dst[f] = exp_nonpositive_scalar(src[f] - top);
    const float inv = 1.0f / sum; /* the largest entry gives exp(0) = 1, so sum >= 1 */
    for (f = 0; f + W <= d; f += W) store(dst + f, load(dst + f) * splat(inv));
    for (; f < d; f++) dst[f] *= inv;
}

/* Map 3: the inputs are features made already (learned maps, a user's map: made by PyTorch ops, so autograd takes
 * their gradient), copied as they are. */
#define FEATURES_GIVEN 3
/* Map 4, taylor: [1, x / max(|x|, 1e-12)] (feature_maps.taylor_feature_map), d features from d - 1 inputs. The
 * only map whose feature count differs from its input's: d counts features everywhere, rows of q, k and of
 * their gradients have input_dim(d, map) values. */
#define TAYLOR 4
#define TAYLOR_EPS 1e-12f /* F.normalize's eps */
/* Map 5, taylor2: [1, x', x'_i x'_j (i <= j, the squares times 1/sqrt(2))] with x' = x / n^(1/4)
 * (feature_maps.taylor2_feature_map, in its order), 1 + n + n (n + 1) / 2 features from n inputs. */
#define TAYLOR2 5

/* n with 1 + n + n (n + 1) / 2 == d (taylor2's input size from its feature count). */
static inline int taylor2_inputs(int d) {
    int n = (int)((sqrt(8.0 * d - 7.0) - 3.0) / 2.0);
    while (1 + n + n * (n + 1) / 2 < d) n++;
    while (n > 0 && 1 + n + n * (n + 1) / 2 > d) n--;
    return n;
}

static inline int input_dim(int d, int map) {
    return map == TAYLOR ? d - 1 : map == TAYLOR2 ? taylor2_inputs(d) : d;
}

/* sum_f a[f] b[f] over n values. */
static inline float dot_product(const float *a, const float *b, int n) {
    vf acc = splat(0.0f);
    int f = 0;
    for (; f + W <= n; f += W) acc += load(a + f) * load(b + f);
    float s = hsum(acc);
    for (; f < n; f++) s += a[f] * b[f];
    return s;
}

static inline float sum_of_squares(const float *x, int n) { return dot_product(x, x, n); }

/* x / max(|x|, eps), divided as F.normalize does: a multiplication by the reciprocal can leave a unit vector an
 * ulp short, and 1 + q'.k' of opposite unit vectors then a rounding error instead of an exact 0. */
static inline void taylor_unit(float *dst, const float *x, int n) {
    const float norm = sqrtf(sum_of_squares(x, n)), divisor = norm > TAYLOR_EPS ? norm : TAYLOR_EPS;
    int f = 0;
    for (; f + W <= n; f += W) store(dst + f, load(x + f) / splat(divisor));
    for (; f < n; f++) dst[f] = x[f] / divisor;
}

static inline void scaled_copy(float *dst, const float *src, int n, float scale) {
    int f = 0;
    for (; f + W <= n; f += W) store(dst + f, load(src + f) * splat(scale));
    for (; f < n; f++) dst[f] = src[f] * scale;
}

static inline void features(float *dst, const float *src, int d, int map) {
    if (map == 2) {
        softmax_row(dst, src, d);
        return;
    }
    if (map == FEATURES_GIVEN) {
        memcpy(dst, src, sizeof(float) * d);
        return;
    }
    if (map == TAYLOR) {
        dst[0] = 1.0f;
        taylor_unit(dst + 1, src, d - 1);
        return;
    }
    if (map == TAYLOR2) {
        const int n = taylor2_inputs(d);
        const float scale = 1.0f / sqrtf(sqrtf((float)n)), half = sqrtf(0.5f);
        float *x = dst + 1, *pair = dst + 1 + n;
        dst[0] = 1.0f;
        for (int i = 0; i < n; i++) x[i] = src[i] * scale;
        for (int i = 0; i < n; i++) {
            const float xi = x[i];
            *pair++ = xi * x[i] * half;
            int j = i + 1;
            for (; j + W <= n; j += W, pair += W) store(pair, load(x + j) * splat(xi));
            for (; j < n; j++) *pair++ = xi * x[j];
        }
        return;
    }
    int f = 0;
    for (; f + W <= d; f += W) store(dst + f, feature_vec(load(src + f), map));
    for (; f < d; f++) dst[f] = feature_scalar(src[f], map);
}

/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols. The causal kernels transpose every chunk's features
 * and values (the GEMM tile reads B by rows), and their backward the d x (Dv + 1) state of every chunk; one float
 * at a time that was 7% of the causal backward with AVX-512 and more than a tenth of it with AVX2. Square blocks
 * of a vector's width go through registers instead: W loads, a few shuffles per row, W stores. */
#ifdef __AVX512F__
#define TRANSPOSE_BLOCK 16
static inline void transpose_block(const float *src, long lds, float *dst, long ldd) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2) { /* pairs of rows interleaved */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* then pairs of those, as doubles */
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int i = 0; i < 4; i++) { /* then the 128-bit lanes, twice */
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ldd, r[i]);
}
#elif defined(__AVX__)
#define TRANSPOSE_BLOCK 8
static inline void transpose_block(const float *src, long lds, float *dst, long ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) { /* pairs of rows interleaved: a0 b0 a1 b1 | a4 b4 a5 b5, ... */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* then four rows' column j within each 128-bit half */
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) { /* then the halves of rows 0-3 and 4-7 joined */
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}
#endif

static inline void transpose_rows(const float *src, long lds, int rows, int cols, float *dst, long ldd) {
    int r = 0;
#ifdef TRANSPOSE_BLOCK
    for (; r + TRANSPOSE_BLOCK <= rows; r += TRANSPOSE_BLOCK) {
        int c = 0;
        for (; c + TRANSPOSE_BLOCK <= cols; c += TRANSPOSE_BLOCK)
            transpose_block(src + r * lds + c, lds, dst + (long)c * ldd + r, ldd);
        for (; c < cols; c++)
            for (int i = r; i < r + TRANSPOSE_BLOCK; i++) dst[(long)c * ldd + i] = src[i * lds + c];
    }
#endif
    for (; r < rows; r++)
        for (int c = 0; c < cols; c++) dst[(long)c * ldd + r] = src[r * lds + c];
}

/* Register-blocked GEMM, C[i][.] += sum_p A(i, p) B[p][.] for i < m, over nv vectors of columns, where
 * A(i, p) = a[i * ai + p * ap] (so one routine serves A and A^T) and B, C rows hold whole vectors.
 * A tile of R rows x V vectors keeps its R * V accumulators in registers; R and V are constants at every call
 * site, so the loops unroll fully. 6 x 2 (12 accumulators, 2 loads and 6 broadcasts per 12 FMAs) is the
 * shape that fills the 16 AVX2 registers; it measured 1.6-2x faster here than 4 x 3.
 * With written (gemm_written, gemm_scaled), C is not read: the tile starts from zero and writes the product over
 * C, each row r times scale[r] where scale is given, with streaming stores where stream is set and the row starts
 * on a whole vector. */
static inline __attribute__((always_inline)) void tile(const int R, const int V, int k, const float *a, long ai,
                                                       long ap, const float *b, long ldb, float *c, long ldc,
                                                       int written, const float *scale, int stream) {
    vf acc[6][TILE_V], bv[TILE_V];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[r][v] = written ? splat(0.0f) : load(c + r * ldc + v * W);
    for (int p = 0; p < k; p++, b += ldb) {
        const float *ar = a + p * ap;
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) bv[v] = load(b + v * W);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const vf x = splat(ar[r * ai]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[r][v] += x * bv[v];
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        float *cr = c + r * ldc;
        if (written && stream && vector_aligned(cr)) {
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) store_stream(cr + v * W, scale ? acc[r][v] * splat(scale[r]) : acc[r][v]);
        } else {
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) store(cr + v * W, scale ? acc[r][v] * splat(scale[r]) : acc[r][v]);
        }
    }
}

/* The triangular variants skip the products a causal block never uses: with LOWER_K, rows i.. of the tile
 * read only p < i + R (the scores times values); with LOWER_N they write only columns < i + R (the scores
 * themselves); with UPPER_K they read only p >= i (a transposed lower-triangular A: the causal backward's
 * M^T R and dM^T phi(Q), whose products were a quarter of its key pass's). */
enum { FULL = 0, LOWER_K = 1, LOWER_N = 2, UPPER_K = 3 };

#define TILE_ROW(R)                                                                                        \
    do {                                                                                                   \
        const int kk = shape == LOWER_K && i + R < k ? i + R : k;                                         \
        const int nn = shape == LOWER_N && (i + R + W - 1) / W < nv ? (i + R + W - 1) / W : nv;           \
        const int k0 = shape == UPPER_K ? (i < kk ? i : kk) : 0;                                          \
        const float *ar = a + i * ai + k0 * ap, *br = b + k0 * ldb, *sr = scale ? scale + i : NULL;        \
        float *cr = c + i * ldc;                                                                           \
        int v = 0;                                                                                         \
        for (; v + TILE_V <= nn; v += TILE_V)                                                              \
            tile(R, TILE_V, kk - k0, ar, ai, ap, br + v * W, ldb, cr + v * W, ldc, written, sr, stream);   \
        if (TILE_V > 2 && v + 2 <= nn) {                                                                   \
            tile(R, 2, kk - k0, ar, ai, ap, br + v * W, ldb, cr + v * W, ldc, written, sr, stream);        \
            v += 2;                                                                                        \
        }                                                                                                  \
        if (v < nn) tile(R, 1, kk - k0, ar, ai, ap, br + v * W, ldb, cr + v * W, ldc, written, sr, stream);\
    } while (0)

/* Between its 6-row groups the GEMM asks for some of the lines the row loaders queued (ahead.h). */
static inline __attribute__((always_inline)) void gemm_rows(int shape, int m, int nv, int k, const float *a, long ai,
                                                            long ap, const float *b, long ldb, float *c, long ldc,
                                                            int written, const float *scale, int stream) {
    struct ahead_queue *queue = ahead_own();
    int i = 0;
    for (; i + 6 <= m; i += 6) {
        TILE_ROW(6);
        ahead_step(queue);
    }
    for (; i + 3 <= m; i += 3) TILE_ROW(3);
    for (; i < m; i++) TILE_ROW(1);
}

static inline void gemm_shaped(int shape, int m, int nv, int k, const float *a, long ai, long ap, const float *b,
                               long ldb, float *c, long ldc) {
    gemm_rows(shape, m, nv, k, a, ai, ap, b, ldb, c, ldc, 0, NULL, 0);
}

/* c[i][.] = scale[i] sum_p A(i, p) B[p][.]: the product written (not added) and each row scaled as it leaves the
 * registers, e.g. divided by its normaliser; stream as in tile. */
static inline void gemm_scaled(int m, int nv, int k, const float *a, long ai, long ap, const float *b, long ldb,
                               const float *scale, float *c, long ldc, int stream) {
    gemm_rows(FULL, m, nv, k, a, ai, ap, b, ldb, c, ldc, 1, scale, stream);
}

/* gemm_shaped's product written over C instead of added to it: C is neither zeroed first nor read (the causal
 * chunks' memsets were 2-3% of their backward's samples). */
static inline void gemm_written(int shape, int m, int nv, int k, const float *a, long ai, long ap, const float *b,
                                long ldb, float *c, long ldc) {
    gemm_rows(shape, m, nv, k, a, ai, ap, b, ldb, c, ldc, 1, NULL, 0);
}

static inline void gemm_acc(int m, int nv, int k, const float *a, long ai, long ap, const float *b, long ldb, float *c,
                     long ldc) {
    gemm_shaped(FULL, m, nv, k, a, ai, ap, b, ldb, c, ldc);
}

/* c[i * ldc] += sum_p A(i, p) b[p * ldb] for i < m (p <= i with LOWER_K): one column of a GEMM, A as gemm_shaped
 * reads it. Vectorised over i when A is stored transposed (ai == 1), as a dot product per row when its rows are
 * contiguous (ap == 1). */
static inline void column_product(int shape, int m, int k, const float *a, long ai, long ap, const float *b, long ldb,
                                  float *c, long ldc) {
    if (ai == 1 && shape == FULL) {
        int i = 0;
        for (; i + W <= m; i += W) {
            vf acc = splat(0.0f);
            for (int p = 0; p < k; p++) acc += load(a + i + p * ap) * splat(b[p * ldb]);
            for (int e = 0; e < W; e++) c[(i + e) * ldc] += acc[e];
        }
        for (; i < m; i++) {
            float acc = 0.0f;
            for (int p = 0; p < k; p++) acc += a[i + p * ap] * b[p * ldb];
            c[i * ldc] += acc;
        }
        return;
    }
    float column[k > 0 ? k : 1];
    for (int p = 0; p < k; p++) column[p] = b[p * ldb];
    for (int i = 0; i < m; i++) {
        const int kk = shape == LOWER_K && i + 1 < k ? i + 1 : k;
        const float *ar = a + i * ai;
        float acc = 0.0f;
        if (ap == 1) acc = dot_product(ar, column, kk);
        else
            for (int p = 0; p < kk; p++) acc += ar[p * ap] * column[p];
        c[i * ldc] += acc;
    }
}

/* gemm_shaped (FULL or LOWER_K) over the first `cols` columns of B and C, whose rows are padded to whole vectors
 * (the columns beyond are left as they are). Kernel attention's value rows are [v, 1]: with Dv a whole number of
 * vectors, the normaliser's one column would take a vector of its own, a sixth to a ninth more work; that column
 * is taken as a column_product instead. */
static inline void gemm_cols(int shape, int m, int cols, int k, const float *a, long ai, long ap, const float *b,
                             long ldb, float *c, long ldc) {
    const int whole = (cols - 1) / W;
    if (whole == 0 || (cols - 1) % W != 0) {
        gemm_shaped(shape, m, (cols + W - 1) / W, k, a, ai, ap, b, ldb, c, ldc);
        return;
    }
    gemm_shaped(shape, m, whole, k, a, ai, ap, b, ldb, c, ldc);
    column_product(shape, m, k, a, ai, ap, b + cols - 1, ldb, c + cols - 1, ldc);
}

/* grad * dphi/dx in place, the derivative read off phi itself: elu(x) + 1 has derivative 1 for x > 0 and
 * exp(x) = phi for x <= 0, i.e. min(phi, 1); relu has [phi > 0]. */
static inline void feature_grad(float *grad, const float *phi, int d, int map) {
    if (map == FEATURES_GIVEN) return; /* the gradient with respect to the features is the answer */
    int f = 0;
    for (; f + W <= d; f += W) {
        const vf p = load(phi + f);
        const vf dphi = map == 0 ? vmin(p, splat(1.0f))
                                 : vselect(p > splat(0.0f), splat(1.0f), splat(0.0f));
        store(grad + f, load(grad + f) * dphi);
    }
    for (; f < d; f++) grad[f] *= map == 0 ? (phi[f] < 1.0f ? phi[f] : 1.0f) : (phi[f] > 0.0f ? 1.0f : 0.0f);
}

/* The gradient of the input row src from g_phi, that of its d features phi, written to dst (input_dim values);
 * g_phi is overwritten. Taylor: with u = |x| > eps, d x = (g - x' (x' . g)) / u for g the gradient of x' = x / u;
 * below eps x' = x / eps and d x = g / eps. */
/* taylor2's input gradient: with w the pair weights (1/sqrt(2) on squares), d x'_k = g_k + sum over pairs (i, j)
 * holding k of g_ij w_ij x'_other (2 w x'_k for a square), then d x = d x' / n^(1/4). phi holds x' at 1..n. */
static inline void taylor2_input_grad(float *dst, const float *g_phi, const float *phi, int d) {
    const int n = taylor2_inputs(d);
    const float scale = 1.0f / sqrtf(sqrtf((float)n)), half = sqrtf(0.5f);
    const float *x = phi + 1, *g = g_phi + 1 + n;
    for (int k = 0; k < n; k++) dst[k] = g_phi[1 + k];
    for (int i = 0; i < n; i++) {
        float acc = 2.0f * half * x[i] * *g++;
        for (int j = i + 1; j < n; j++, g++) {
            acc += *g * x[j];
            dst[j] += *g * x[i];
        }
        dst[i] += acc;
    }
    for (int k = 0; k < n; k++) dst[k] *= scale;
}

static inline __attribute__((always_inline)) void input_grad(float *dst, float *g_phi, const float *phi,
                                                             const float *src, int d, int map) {
    if (map == TAYLOR2) {
        taylor2_input_grad(dst, g_phi, phi, d);
        return;
    }
    if (map != TAYLOR) {
        feature_grad(g_phi, phi, d, map);
        memcpy(dst, g_phi, sizeof(float) * d);
        return;
    }
    const int n = d - 1;
    const float *g = g_phi + 1, *unit = phi + 1;
    const float norm = sqrtf(sum_of_squares(src, n));
    if (!(norm > TAYLOR_EPS)) {
        scaled_copy(dst, g, n, 1.0f / TAYLOR_EPS);
        return;
    }
    const float dot = dot_product(g, unit, n), inv = 1.0f / norm;
    int f = 0;
    for (; f + W <= n; f += W) store(dst + f, (load(g + f) - load(unit + f) * splat(dot)) * splat(inv));
    for (; f < n; f++) dst[f] = (g[f] - unit[f] * dot) * inv;
}

#endif
