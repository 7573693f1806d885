/* Hedgehog's learned feature map (hedgehog.py) and its gradient, float32: the arithmetic the map's own pass
 * (hedgehog_map.c, a row at a time on values projected already) and the attention kernels' row loaders (map 8,
 * kernel_attention.h, a block of rows at a time, projection included) run.
 *
 *   z = x W + b,   phi = [softmax(z), softmax(-z)]      (x: d values, z: m, phi: 2m; each softmax over the m)
 *
 * In the row loaders the queries and the keys have maps of their own: heads 0 .. H - 1 read the queries' W and b,
 * heads H .. 2H - 1 the keys'. */
#ifndef LINEAR_MHA_HEDGEHOG_H
#define LINEAR_MHA_HEDGEHOG_H
#include "simd.h"

#define HEDGEHOG_MAX_M 256 /* native.HEDGEHOG_MAX_M: a row's projections live on the stack */
#define HEDGEHOG_MAX_D 1024 /* native.HEDGEHOG_MAX_D: a group's inputs and their gradients too */

/* e = exp(sign * (x - extreme)), all exponents <= 0; returns the sum of e. */
static inline float shifted_exps(float *e, const float *x, int m, float extreme, float sign) {
    vf sum_v = splat(0.0f);
    int f = 0;
    for (; f + W <= m; f += W) {
        const vf ev = exp_nonpositive(splat(sign) * (load(x + f) - splat(extreme)));
        store(e + f, ev);
        sum_v += ev;
    }
    float sum = hsum(sum_v);
    for (; f < m; f++) {
        const float a = sign * (x[f] - extreme);
        sum += e[f] = exp_nonpositive_scalar(a);
    }
    return sum;
}

/* phi (2m) = [softmax(z), softmax(-z)] of m values z. Where the row's range is under 80 (nearly always), softmax(-z)
 * reuses softmax(z)'s exponentials: exp(bottom - z) = exp(bottom - top) / exp(z - top), a division where an
 * exponential costs 16 vector operations. Both factors stay normal floats (above e^-80), so the quotient is within
 * a few ulp; exp(bottom - top) cancels in the normalisation and is there to keep the quotients at most 1. A wider
 * row takes the second exponential. */
static inline void double_softmax(float *phi, const float *z, int m) {
    float top = -INFINITY, bottom = INFINITY;
    int f = 0;
    if (m >= W) {
        vf top_v = load(z), bottom_v = top_v;
        for (f = W; f + W <= m; f += W) {
            const vf zv = load(z + f);
            top_v = vmax(zv, top_v);
            bottom_v = vmin(zv, bottom_v);
        }
        top = hmax(top_v);
        bottom = -hmax(splat(0.0f) - bottom_v);
    }
    for (; f < m; f++) {
        top = z[f] > top ? z[f] : top;
        bottom = z[f] < bottom ? z[f] : bottom;
    }
    const float sum = shifted_exps(phi, z, m, top, 1.0f);
    if (top - bottom < 80.0f) {
        const float c = expf(bottom - top);
        vf sum_v = splat(0.0f);
        for (f = 0; f + W <= m; f += W) {
            const vf u = splat(c) / load(phi + f);
            store(phi + m + f, u);
            sum_v += u;
        }
        float below = hsum(sum_v);
        for (; f < m; f++) below += phi[m + f] = c / phi[f];
        scaled_copy(phi + m, phi + m, m, 1.0f / below);
    } else {
        scaled_copy(phi + m, phi + m, m, 1.0f / shifted_exps(phi + m, z, m, bottom, -1.0f));
    }
    scaled_copy(phi, phi, m, 1.0f / sum);
}

/* dz (m) from g (2m), the gradient of phi = [s, u] = double_softmax(z): dz = s (g1 - s.g1) - u (g2 - u.g2), g1 and
 * g2 the halves of g. */
static inline void double_softmax_grad(float *dz, const float *g, const float *phi, int m) {
    const float *s = phi, *u = phi + m;
    const float sg = dot_product(s, g, m), ug = dot_product(u, g + m, m);
    int f = 0;
    for (; f + W <= m; f += W)
        store(dz + f, load(s + f) * (load(g + f) - splat(sg)) - load(u + f) * (load(g + m + f) - splat(ug)));
    for (; f < m; f++) dz[f] = s[f] * (g[f] - sg) - u[f] * (g[m + f] - ug);
}

/* What a backward pass holds for the maps' gradients: each head's W transposed (dx = W dz as a row times W^T),
 * and per thread the sums d W and d b over its rows. A row's x and dz wait in the thread's block until ROWS rows
 * of one head are there, which are then added to d W as one product X^T dZ: a rank-1 update per row would read
 * and write all of d W's d x m floats for each row, and took more of the backward than the attention itself. */
struct hedgehog_grads {
    float *wt;        /* (2H x m x d) */
    float *dw, *db;   /* per thread (2H x d x mp), (2H x mp), mp = m rounded up to whole vectors */
    float *x, *dz;    /* per thread: pending rows, ROWS x d and ROWS x mp */
    int *pending;     /* per thread, 16 ints apart: [rows pending, their head] */
    int mp, threads;
};

/* The maps' settings as hedgehog.HedgehogMap lays them out in one float array: [d, m, W (2H x d x m),
 * b (2H x m)]; its gradient has the same layout. grads: set by a backward pass (hedgehog_grads_start). */
struct hedgehog_map {
    const float *w, *b;
    int d, m, h;
    long len; /* floats in the layout, the size of a thread's slice of the gradient */
    struct hedgehog_grads *grads;
};

static inline struct hedgehog_map hedgehog_settings(const float *data, int h) {
    struct hedgehog_map c = {NULL, NULL, 0, 0, h, 0, NULL};
    if (!data) return c;
    c.d = (int)data[0];
    c.m = (int)data[1];
    c.w = data + 2;
    c.b = c.w + 2L * h * c.d * c.m;
    c.len = 2 + 2L * h * c.d * c.m + 2L * h * c.m;
    return c;
}

/* Sets up c->grads for a backward on `threads` threads (the sums only with sums != 0); 0, or -1 when out of
 * memory. hedgehog_grads_finish adds the sums into the caller's slices and frees it all. */
static inline int hedgehog_grads_start(struct hedgehog_map *c, struct hedgehog_grads *g, int threads, int sums) {
    const int d = c->d, m = c->m, heads = 2 * c->h, mp = (m + W - 1) / W * W;
    memset(g, 0, sizeof *g);
    g->mp = mp;
    g->threads = sums ? threads : 0;
    g->wt = malloc(sizeof(float) * heads * m * d);
    if (sums) {
        g->dw = calloc((size_t)threads * heads * (d + 1) * mp, sizeof(float));
        g->db = g->dw ? g->dw + (long)threads * heads * d * mp : NULL;
        g->x = malloc(sizeof(float) * threads * ROWS * d);
        g->dz = calloc((size_t)threads * ROWS * mp, sizeof(float));
        g->pending = calloc((size_t)threads * 16, sizeof(int));
    }
    if (!g->wt || (sums && (!g->dw || !g->x || !g->dz || !g->pending))) {
        free(g->wt); free(g->dw); free(g->x); free(g->dz); free(g->pending);
        return -1;
    }
    for (int head = 0; head < heads; head++)
        for (int e = 0; e < d; e++)
            for (int f = 0; f < m; f++)
                g->wt[((long)head * m + f) * d + e] = c->w[((long)head * d + e) * m + f];
    c->grads = g;
    return 0;
}

/* Thread t's pending rows into its sums d W += X^T dZ, d b += the dZ rows (once per block of rows: kept out of
 * line, away from the row loaders). */
static __attribute__((noinline, unused)) void hedgehog_flush(struct hedgehog_grads *g, int d, int heads, int t) {
    int *state = g->pending + 16L * t;
    const int rows = state[0], head = state[1], mp = g->mp;
    if (rows == 0) return;
    const float *x = g->x + (long)t * ROWS * d, *dz = g->dz + (long)t * ROWS * mp;
    gemm_acc(d, mp / W, rows, x, 1, d, dz, mp, g->dw + ((long)t * heads + head) * d * mp, mp);
    float *db = g->db + ((long)t * heads + head) * mp;
    for (int r = 0; r < rows; r++)
        for (int f = 0; f < mp; f += W) store(db + f, load(db + f) + load(dz + (long)r * mp + f));
    state[0] = 0;
}

/* Flushes every thread's rows, adds its sums into its slice of grad (the layout's, threads slices; NULL when no
 * sums were asked for, or on an error) and frees what hedgehog_grads_start took. */
static inline void hedgehog_grads_finish(struct hedgehog_map *c, float *grad) {
    struct hedgehog_grads *g = c->grads;
    const int d = c->d, m = c->m, heads = 2 * c->h, mp = g->mp;
    for (int t = 0; grad && t < g->threads; t++) {
        hedgehog_flush(g, d, heads, t);
        float *slice = grad + (long)t * c->len, *dw = slice + 2, *db = dw + (long)heads * d * m;
        for (long row = 0; row < (long)heads * d; row++)
            for (int f = 0; f < m; f++) dw[row * m + f] += g->dw[((long)t * heads * d + row) * mp + f];
        for (long head = 0; head < heads; head++)
            for (int f = 0; f < m; f++) db[head * m + f] += g->db[((long)t * heads + head) * mp + f];
    }
    free(g->wt); free(g->dw); free(g->x); free(g->dz); free(g->pending);
    c->grads = NULL;
}

/* Rows of a block go through the projections HEDGEHOG_GROUP at a time, as one GEMM: its register tiles use each
 * vector of W they load for 6 rows, where a product row by row loads all of W again for every row (a quarter of
 * the hedgehog forward's time at d = m = 64). 12 rows' x and z stay in L1 beside W. The block functions are kept
 * out of line: once per block, and their stack arrays would otherwise sit in the frames of the other maps'
 * loaders. */
#define HEDGEHOG_GROUP 12

/* The next group: up to HEDGEHOG_GROUP rows from *r on (below rows) that skip leaves (skip NULL: all), their
 * indices into at; *r moves past them. Returns how many. */
static inline int next_group(const uint8_t *skip, int rows, int *r, int *at) {
    int n = 0;
    for (; *r < rows && n < HEDGEHOG_GROUP; ++*r)
        if (!skip || !skip[*r]) at[n++] = *r;
    return n;
}

/* z (rows x m, row stride m) = X W[head] + b[head] for rows of x (rows x d, row stride d), rows <= HEDGEHOG_GROUP:
 * whole vectors of z by the GEMM, the last m mod W columns one by one. */
static inline void hedgehog_project_rows(const struct hedgehog_map *c, const float *x, int rows, int head, float *z) {
    const int d = c->d, m = c->m, whole = m / W;
    const float *w = c->w + (long)head * d * m, *bias = c->b + (long)head * m;
    for (int r = 0; r < rows; r++) memcpy(z + r * m, bias, sizeof(float) * m);
    if (whole) gemm_acc(rows, whole, d, x, d, 1, w, m, z, m);
    for (int r = 0; r < rows; r++)
        for (int f = whole * W; f < m; f++) {
            float sum = z[r * m + f];
            for (int e = 0; e < d; e++) sum += x[r * d + e] * w[(long)e * m + f];
            z[r * m + f] = sum;
        }
}

/* phi = [softmax(z), softmax(-z)], z = x W + b with the map of head (0 .. 2H - 1), of `rows` rows: row r read
 * from x[r], written at phi + r * ld (2m floats); a row with skip[r] set (skip NULL: none) is written as zeros and
 * never read. */
static __attribute__((noinline, unused)) void hedgehog_rows(float *phi, long ld, const float *const *x,
                                                             const uint8_t *skip, int rows,
                                                             const struct hedgehog_map *c, int head) {
    const int d = c->d, m = c->m;
    float xs[HEDGEHOG_GROUP * d], z[HEDGEHOG_GROUP * HEDGEHOG_MAX_M];
    int at[HEDGEHOG_GROUP];
    for (int r = 0; skip && r < rows; r++)
        if (skip[r]) memset(phi + r * ld, 0, sizeof(float) * 2 * m);
    for (int r = 0, n; (n = next_group(skip, rows, &r, at)) > 0;) {
        for (int i = 0; i < n; i++) memcpy(xs + i * d, x[at[i]], sizeof(float) * d);
        hedgehog_project_rows(c, xs, n, head, z);
        for (int i = 0; i < n; i++) double_softmax(phi + at[i] * ld, z + i * m, m);
    }
}

/* Thread t's share of d W and d b from one row: x and dz wait in its block (flushed when full or when the head
 * changes), with the sums asked for. */
static inline void hedgehog_pend(struct hedgehog_grads *grads, const float *x, const float *dz, int d, int m,
                                 int heads, int head, int t) {
    if (!grads->threads) return;
    int *state = grads->pending + 16L * t;
    if (state[0] == ROWS || (state[0] > 0 && state[1] != head)) hedgehog_flush(grads, d, heads, t);
    state[1] = head;
    const long r = (long)t * ROWS + state[0]++;
    memcpy(grads->x + r * d, x, sizeof(float) * d);
    memcpy(grads->dz + r * grads->mp, dz, sizeof(float) * m); /* the padding past m stays 0 from calloc */
}

/* The input gradients of `rows` rows in a backward (c->grads set), dx = dZ W^T as one GEMM per group, dz from g,
 * the gradient of the row's features phi as hedgehog_rows made them: row r's g at g + r * ldg, phi at
 * phi + r * ldphi, input x[r]; its dx is put at dx[r] (with streaming stores where stream is set). With sums asked
 * for, each row's x and dz wait in thread t's block for d W (x^T dz) and d b (dz). A row with skip[r] set (skip
 * NULL: none) gets a zero dx and adds nothing to d W or d b. */
static __attribute__((noinline, unused)) void hedgehog_rows_grad(float *const *dx, int stream, const float *g,
                                                                  long ldg, const float *phi, long ldphi,
                                                                  const float *const *x, const uint8_t *skip,
                                                                  int rows, const struct hedgehog_map *c, int head,
                                                                  int t) {
    const int d = c->d, m = c->m, whole = d / W;
    const float *wt = c->grads->wt + (long)head * m * d;
    float dz[HEDGEHOG_GROUP * HEDGEHOG_MAX_M], dxs[HEDGEHOG_GROUP * d];
    int at[HEDGEHOG_GROUP];
    memset(dxs, 0, sizeof(float) * d);
    for (int r = 0; skip && r < rows; r++)
        if (skip[r]) put_row(dx[r], dxs, d, stream);
    for (int r = 0, n; (n = next_group(skip, rows, &r, at)) > 0;) {
        for (int i = 0; i < n; i++) {
            double_softmax_grad(dz + i * m, g + at[i] * ldg, phi + at[i] * ldphi, m);
            hedgehog_pend(c->grads, x[at[i]], dz + i * m, d, m, 2 * c->h, head, t);
        }
        memset(dxs, 0, sizeof(float) * n * d);
        if (whole) gemm_acc(n, whole, m, dz, m, 1, wt, d, dxs, d);
        for (int i = 0; i < n; i++) {
            for (int e = whole * W; e < d; e++) {
                float sum = 0.0f;
                for (int f = 0; f < m; f++) sum += dz[i * m + f] * wt[(long)f * d + e];
                dxs[i * d + e] = sum;
            }
            put_row(dx[at[i]], dxs + i * d, d, stream);
        }
    }
}

#endif
