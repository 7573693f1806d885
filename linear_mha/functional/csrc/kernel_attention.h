/* Shared pieces of the CPU kernels above the arithmetic of simd.h and the thread split of tasks.h: the maps'
 * settings, the rows' layouts, normalising rows, and the row loaders. Plain C with OpenMP; no PyTorch headers. */
#ifndef LINEAR_MHA_KERNEL_ATTENTION_H
#define LINEAR_MHA_KERNEL_ATTENTION_H
#include <float.h>
#include "focused.h"
#include "hedgehog.h"
#include "program.h"
#include "simd.h"
#include "tasks.h"

/* Maps with settings, which ride beside the map code. Map 6, focused (focused.h): its backward adds each row's
 * share of the scales' gradient into grad_scale, (threads x H x d) partial sums, one slice per thread (NULL: not
 * wanted; the caller sums the slices). Map 7, a user's elementwise map as a program of steps (program.h). Map 8,
 * hedgehog's learned maps (hedgehog.h), 2m features from d inputs, the queries' and the keys' maps apart (a key
 * row's head is key_head's); its backward adds d W and d b into grad_scale, one slice of its layout per thread. */
#define FOCUSED 6
#define PROGRAM 7
#define HEDGEHOG 8
struct map_settings {
    struct focused_map focused;
    float *grad_scale;
    int h;
    struct program program;
    struct hedgehog_map hedgehog;
};

/* The settings of a map from the entry points' arguments: focused's power and scales, or in the same pointer the
 * program's layout (program_from) or hedgehog's (hedgehog_settings). */
static inline struct map_settings settings_of(int map, float power, const float *data, float *grad_scale, int h) {
    const struct map_settings ms = {focused_settings(power, map == FOCUSED ? data : NULL), grad_scale, h,
                                    program_from(map == PROGRAM ? data : NULL),
                                    hedgehog_settings(map == HEDGEHOG ? data : NULL, h)};
    return ms;
}

/* Inputs per row for a map of d features (hedgehog's come from its own d). */
static inline int map_inputs(int d, int map, const struct map_settings *ms) {
    return map == HEDGEHOG ? ms->hedgehog.d : input_dim(d, map);
}

/* The head a key row's map is read for: its own, or for hedgehog that of the keys' map. */
static inline int key_head(int map, const struct map_settings *ms, int head) {
    return map == HEDGEHOG ? head + ms->h : head;
}

/* features() for every map but hedgehog's (whose rows go through block_features only), settings and the row's
 * head included (ms may be NULL for maps without settings). kept (or NULL): what focused's gradient of the same
 * row may reuse (focused_kept). */
static inline void map_features(float *dst, const float *src, int d, int map, const struct map_settings *ms, int head,
                                struct focused_kept *kept) {
    if (map == FOCUSED) focused_features(dst, src, d, &ms->focused, head, kept);
    else if (map == PROGRAM) program_features(dst, src, d, &ms->program);
    else features(dst, src, d, map);
}

/* input_grad() for every map but hedgehog's (block_input_grad); a focused row also adds its share of the scales'
 * gradient. */
static inline void map_input_grad(float *dst, float *g_phi, const float *phi, const float *src, int d, int map,
                                  const struct map_settings *ms, int head, const struct focused_kept *kept) {
    if (map == PROGRAM) {
        program_input_grad(dst, g_phi, src, d, &ms->program);
        return;
    }
    if (map != FOCUSED) {
        input_grad(dst, g_phi, phi, src, d, map);
        return;
    }
    float *ds = ms->grad_scale ? ms->grad_scale + ((long)thread_slot() * ms->h + head) * d : NULL;
    focused_input_grad(dst, g_phi, src, d, &ms->focused, head, ds, kept);
}

/* Element strides over (batch, head, position) of a tensor of rows, each row contiguous: the outputs and the
 * gradients are read and written where the caller laid them out, e.g. (B, N, H, d) in memory for a module whose
 * heads are views of one projection, so that it need not copy them into (B, H, N, d) and back. */
struct rows_at {
    long b, h, n;
};

/* Offset of row j of head g (of h heads per batch entry). */
static inline long row_offset(struct rows_at at, int h, int g, long j) {
    return (long)(g / h) * at.b + (long)(g % h) * at.h + j * at.n;
}

/* Layout i of the strides an entry point was given (3 per tensor: batch, head, position), or, with none given,
 * that of a contiguous (B, H, n, width) tensor. */
static inline struct rows_at rows_from(const long *strides, int i, int h, long n, int width) {
    if (strides) {
        const struct rows_at at = {strides[3 * i], strides[3 * i + 1], strides[3 * i + 2]};
        return at;
    }
    const struct rows_at at = {(long)h * n * width, n * width, width};
    return at;
}

/* Outputs of at least lm_stream_bytes bytes (16 MiB; kernel_attention.c) are written with streaming stores
 * (store_stream): far larger than the caches, they would only push out the inputs, and their lines need not be
 * read before being written. Tests lower it to reach those stores at small sizes. */
extern long lm_stream_bytes;
static inline int streamed(long floats) { return floats >= lm_stream_bytes / (long)sizeof(float); }

/* Whether a normaliser counts as 0: every visible key masked, or phi(q) = 0, or features so near 0 that the
 * normaliser is under FLT_MIN, where 1 / den would overflow to inf (an elu query whose every input lies below
 * about -87). Such a query's output is defined as 0, and the backward stores 1 for its normaliser. */
static inline int negligible(float den) { return fabsf(den) < FLT_MIN; }

/* out[r][c] = num_den[r][c] / num_den[r][dv] for rows of width dvp (out's rows ld_out apart), with streaming
 * stores where `stream` is set and a row starts on a whole vector; 0 where the normaliser is negligible. */
static inline void normalise_rows(const float *num_den, int rows, int dvp, int dv, float *out, long ld_out,
                                  int stream) {
    for (int r = 0; r < rows; r++, num_den += dvp, out += ld_out) {
        const float inv = negligible(num_den[dv]) ? 0.0f : 1.0f / num_den[dv];
        int c = 0;
        if (stream && vector_aligned(out))
            for (; c + W <= dv; c += W) store_stream(out + c, load(num_den + c) * splat(inv));
        for (; c + W <= dv; c += W) store(out + c, load(num_den + c) * splat(inv));
        for (; c < dv; c++) out[c] = num_den[c] * inv;
    }
}

/* The normalisers of rows of width dvp, negligible ones replaced by 1, for the backward. */
static inline void store_normalisers(const float *num_den, int rows, int dvp, int dv, float *den) {
    for (int r = 0; r < rows; r++) den[r] = negligible(num_den[r * dvp + dv]) ? 1.0f : num_den[r * dvp + dv];
}

/* 2-D rotary position on the token grid inside non-causal kernel attention (functional/grid_rope.py): each row's
 * f features phi become 2 f, [R_i phi, phi], R_i turning the last `rotated` features in pairs (feature
 * f - rotated + m with f - rotated / 2 + m) by the angles of the row's position i, read from cos and sin
 * (n x rotated, each angle twice, as grid_rope.rotation_tables makes them). The state's first f rows then feed
 * only the numerator and its last f rows only the normaliser (split_state), so one GEMM per side gives
 * num_i = (R_i phi_i) sum_j (R_j phi_j) v_j^T and den_i = phi_i . sum_j phi_j. A query whose normaliser is 0
 * gets 0, as in grid_rope_kernel: the rotated numerator, which that normaliser does not bound, may not be 0. */
struct rope_tables {
    const float *cos, *sin;
    int rotated;
};

static inline void rotate_row(float *dst, const float *src, int f, const struct rope_tables *rope, long pos) {
    const int half = rope->rotated / 2, kept = f - rope->rotated;
    const float *c = rope->cos + pos * rope->rotated, *s = rope->sin + pos * rope->rotated;
    memcpy(dst, src, sizeof(float) * kept);
    for (int m = 0; m < half; m++) {
        const float a = src[kept + m], b = src[kept + half + m];
        dst[kept + m] = a * c[m] - b * s[m];
        dst[kept + half + m] = b * c[half + m] + a * s[half + m];
    }
}

/* The features of a row, d of them: phi, or with rope [R_pos phi, phi] (d = 2 f). */
static inline void row_features(float *dst, const float *src, int d, int map, const struct map_settings *ms, int head,
                                const struct rope_tables *rope, long pos, struct focused_kept *kept) {
    if (!rope) {
        map_features(dst, src, d, map, ms, head, kept);
        return;
    }
    const int f = d / 2;
    map_features(dst + f, src, f, map, ms, head, kept);
    rotate_row(dst, dst + f, f, rope, pos);
}

/* The gradient of the input row src from g_phi, that of its d row_features phi (g_phi is overwritten): with rope
 * that of the plain features is g[f:] + R_pos^T g[:f], then the map's own derivative. */
static inline void row_input_grad(float *dst, float *g_phi, const float *phi, const float *src, int d, int map,
                                  const struct map_settings *ms, int head, const struct rope_tables *rope, long pos,
                                  const struct focused_kept *row_kept) {
    if (!rope) {
        map_input_grad(dst, g_phi, phi, src, d, map, ms, head, row_kept);
        return;
    }
    const int f = d / 2, half = rope->rotated / 2, kept = f - rope->rotated;
    const float *c = rope->cos + pos * rope->rotated, *s = rope->sin + pos * rope->rotated;
    float *g = g_phi + f;
    for (int e = 0; e < kept; e++) g[e] += g_phi[e];
    for (int m = 0; m < half; m++) {
        const float ga = g_phi[kept + m], gb = g_phi[kept + half + m];
        g[kept + m] += ga * c[m] + gb * s[half + m];
        g[kept + half + m] += gb * c[half + m] - ga * s[m];
    }
    map_input_grad(dst, g, phi + f, src, f, map, ms, head, row_kept);
}

/* src[r] = the address of row i0 + r of a head's rows, `stride` floats apart from its row 0 at base, and pos[r]
 * = i0 + r: a block's rows as block_features and block_input_grad take them. */
static inline void row_addresses(const float **src, long *pos, const float *base, long stride, long i0, int rows) {
    for (int r = 0; r < rows; r++) {
        src[r] = base + (i0 + r) * stride;
        pos[r] = i0 + r;
    }
}

/* row_features of `rows` rows: row r read from src[r] (at position pos[r], which only rope reads; pos NULL
 * without rope) and written at dst + r * ld, zeros where skip[r] is set (skip NULL: none); focused keeps its row
 * reductions in kept[r] (kept NULL: not wanted). Hedgehog's projections run as one GEMM per group of rows. */
static inline void block_features(float *dst, long ld, const float *const *src, const long *pos, const uint8_t *skip,
                                  int rows, int d, int map, const struct map_settings *ms, int head,
                                  const struct rope_tables *rope, struct focused_kept *kept) {
    if (map == HEDGEHOG) { /* never with rope: its entry points take no map settings */
        hedgehog_rows(dst, ld, src, skip, rows, &ms->hedgehog, head);
        return;
    }
    for (int r = 0; r < rows; r++) {
        if (skip && skip[r]) memset(dst + r * ld, 0, sizeof(float) * d);
        else row_features(dst + r * ld, src[r], d, map, ms, head, rope, pos ? pos[r] : 0, kept ? kept + r : NULL);
    }
}

/* row_input_grad of `rows` rows, row r's gradient (d_in values) put at dst[r] with streaming stores where stream
 * is set: from g_phi + r * ldg (overwritten), its features phi + r * ldphi and its input src[r] at position pos[r]
 * (pos NULL without rope); zeros where skip[r] is set (skip NULL: none). Hedgehog's d x = d Z W^T runs as one GEMM
 * per group of rows. */
static inline void block_input_grad(float *const *dst, int stream, float *g_phi, long ldg, const float *phi,
                                    long ldphi, const float *const *src, const long *pos, const uint8_t *skip,
                                    int rows, int d, int d_in, int map, const struct map_settings *ms, int head,
                                    const struct rope_tables *rope, const struct focused_kept *kept) {
    if (map == HEDGEHOG) {
        hedgehog_rows_grad(dst, stream, g_phi, ldg, phi, ldphi, src, skip, rows, &ms->hedgehog, head,
                           thread_slot());
        return;
    }
    float row[stream ? d_in : 1];
    for (int r = 0; r < rows; r++) {
        float *out = stream ? row : dst[r];
        if (skip && skip[r]) memset(out, 0, sizeof(float) * d_in);
        else row_input_grad(out, g_phi + r * ldg, phi + r * ldphi, src[r], d, map, ms, head, rope,
                            pos ? pos[r] : 0, kept ? kept + r : NULL);
        if (stream) put_row(dst[r], row, d_in, 1);
    }
}

/* Values per input row: the map's inputs for its features (d, or half of them with rope). */
static inline int row_inputs(int d, int map, const struct map_settings *ms, const struct rope_tables *rope) {
    return map_inputs(rope ? d / 2 : d, map, ms);
}

/* Zeroes what rope keeps apart in bh (d x width) states: the normaliser column of the first d / 2 rows (rotated
 * features), the value columns of the last d / 2 (plain ones). */
static inline void split_state(float *states, int bh, int d, int width, int dv) {
    for (long row = 0; row < (long)bh * d; row++) {
        float *r = states + row * width;
        if (row % d < d / 2) r[dv] = 0.0f;
        else memset(r, 0, sizeof(float) * dv);
    }
}

/* Transposes the (d x (dv + 1)) matrices of bh heads, src rows spaced src_ld apart, into (width x dp) ones. */
static inline void transpose_states(const float *src, long src_ld, int bh, int d, int dv, int width, int dp, float *dst) {
    memset(dst, 0, sizeof(float) * bh * width * dp);
    for (int g = 0; g < bh; g++)
        transpose_rows(src + (long)g * d * src_ld, src_ld, d, dv + 1, dst + (long)g * width * dp, dp);
}

struct key_rows {
    const float *k, *v;
    const uint8_t *mask;
    int h, d, dv, width, map;
    long n, ksb, ksh, ksn, vsb, vsh, vsn;
    const float *shift; /* (B*H, D) or NULL: features exp(k - shift) instead of the map (Efficient Attention) */
    const struct rope_tables *rope; /* or NULL */
    const struct map_settings *ms;  /* or NULL */
};

/* dst = exp(src - shift), every exponent <= 0 (shift holds the maxima of src); 0 below about -87.68 as elsewhere. */
static inline void shifted_exp(float *dst, const float *src, const float *shift, int d) {
    int f = 0;
    for (; f + W <= d; f += W) store(dst + f, exp_nonpositive(load(src + f) - load(shift + f)));
    for (; f < d; f++) dst[f] = exp_nonpositive_scalar(src[f] - shift[f]);
}

/* The rows phi(k_j), [v_j, 1, 0...] of one head, masked keys skipped: they add nothing. */
static inline int key_source(const void *ctx, int g, long j, long z, long *next, float *a, float *b, float *scratch) {
    const struct key_rows *c = ctx;
    const int bi = g / c->h, hi = g % c->h;
    int rows = 0;
    (void)scratch;
    const long ahead = z < j + 2 * ROWS ? z : j + 2 * ROWS; /* the next block's rows */
    struct ahead_queue *queue = ahead_start(c->d / 6); /* over the GEMM that sums this block into the state */
    ahead_rows(queue, c->k + bi * c->ksb + hi * c->ksh, j + ROWS, ahead, c->ksn,
               c->shift ? c->d : row_inputs(c->d, c->map, c->ms, c->rope));
    ahead_rows(queue, c->v + bi * c->vsb + hi * c->vsh, j + ROWS, ahead, c->vsn, c->dv);
    const float *src[ROWS];
    long pos[ROWS];
    for (; j < z && rows < ROWS; j++) {
        if (c->mask && c->mask[bi * c->n + j]) continue;
        src[rows] = c->k + bi * c->ksb + hi * c->ksh + j * c->ksn;
        pos[rows] = j;
        if (c->shift) shifted_exp(a + rows * c->d, src[rows], c->shift + (long)g * c->d, c->d);
        float *row = b + rows * c->width;
        memcpy(row, c->v + bi * c->vsb + hi * c->vsh + j * c->vsn, sizeof(float) * c->dv);
        row[c->dv] = 1.0f;
        memset(row + c->dv + 1, 0, sizeof(float) * (c->width - c->dv - 1));
        rows++;
    }
    if (!c->shift)
        block_features(a, c->d, src, pos, NULL, rows, c->d, c->map, c->ms, key_head(c->map, c->ms, hi), c->rope,
                       NULL);
    *next = j;
    return rows;
}

/* Rows of out (and of the normalisers) from a block of queries: phi(q) [S, z], divided. */
struct query_outputs {
    const float *q, *states;
    float *out, *den_out;
    int h, d, dv, width;
    long n, qsb, qsh, qsn;
    int map;
    const struct rope_tables *rope; /* or NULL */
    const struct map_settings *ms;  /* or NULL */
    struct rows_at out_at;
    int stream; /* streaming stores for out */
};

static inline void query_block(const void *ctx, int g, long i0, int rows, float *scratch) {
    const struct query_outputs *c = ctx;
    const int bi = g / c->h, hi = g % c->h;
    float *phi = scratch, *num_den = scratch + ROWS * c->d;
    struct ahead_queue *queue = ahead_start(ROWS / 6); /* over this block's GEMM */
    ahead_rows(queue, c->q + bi * c->qsb + hi * c->qsh, i0 + rows, c->n < i0 + rows + ROWS ? c->n : i0 + rows + ROWS,
               c->qsn, row_inputs(c->d, c->map, c->ms, c->rope));
    const float *src[ROWS];
    long pos[ROWS];
    row_addresses(src, pos, c->q + bi * c->qsb + hi * c->qsh, c->qsn, i0, rows);
    block_features(phi, c->d, src, pos, NULL, rows, c->d, c->map, c->ms, hi, c->rope, NULL);
    const float *state = c->states + (long)g * c->d * c->width;
    float *out = c->out + row_offset(c->out_at, c->h, g, i0);
    float *den = c->den_out ? c->den_out + (long)g * c->n + i0 : NULL;
    if (!c->rope && c->dv % W == 0) { /* the normalisers first, then the numerators divided as they are written */
        float inv[ROWS] = {0.0f};
        column_product(FULL, rows, c->d, phi, c->d, 1, state + c->dv, c->width, inv, 1);
        for (int r = 0; r < rows; r++) {
            const int none = negligible(inv[r]); /* out is 0 */
            if (den) den[r] = none ? 1.0f : inv[r];
            inv[r] = none ? 0.0f : 1.0f / inv[r];
        }
        gemm_scaled(rows, c->dv / W, c->d, phi, c->d, 1, state, c->width, inv, out, c->out_at.n, c->stream);
        return;
    }
    memset(num_den, 0, sizeof(float) * rows * c->width);
    if (c->rope) { /* half the product: rotated features on the numerator's rows, the normaliser from the plain half */
        const int f = c->d / 2;
        gemm_cols(FULL, rows, c->dv + 1, f, phi, c->d, 1, state, c->width, num_den, c->width);
        for (int r = 0; r < rows; r++) {
            float sum = 0.0f;
            for (int e = 0; e < f; e++) sum += phi[r * c->d + f + e] * state[(long)(f + e) * c->width + c->dv];
            num_den[r * c->width + c->dv] = sum;
        }
    } else {
        gemm_cols(FULL, rows, c->dv + 1, c->d, phi, c->d, 1, state, c->width, num_den, c->width);
    }
    normalise_rows(num_den, rows, c->width, c->dv, out, c->out_at.n, c->stream);
    if (den) store_normalisers(num_den, rows, c->width, c->dv, den);
    if (c->rope) /* a negligible normaliser: output 0, and a stored 0 tells the backward to send no gradient */
        for (int r = 0; r < rows; r++)
            if (negligible(num_den[r * c->width + c->dv])) {
                memset(out + r * c->out_at.n, 0, sizeof(float) * c->dv);
                if (den) den[r] = 0.0f;
            }
}

/* The inputs of causal attention as its forward and backward read them: element strides over (B, H, position)
 * with a contiguous last dimension; mask (B, n) bytes, nonzero = ignore, or NULL. */
struct causal_inputs {
    const float *q, *k, *v;
    const uint8_t *mask;
    int h, d, dv, map;
    long n, qsb, qsh, qsn, ksb, ksh, ksn, vsb, vsh, vsn;
    const struct map_settings *ms; /* or NULL */
};

/* The chunk a causal pass loads after this one: head g's from position i0 (-1: none). */
struct next_chunk {
    int g;
    long i0;
};

/* The chunk after head g's at position i0, for the t-th of a task's turn heads (g = group turn + t): the next
 * head's at i0, or after the last head the first head's at `following` (-1: none). */
static inline struct next_chunk next_in_turn(int g, int t, int turn, long i0, long following) {
    const struct next_chunk next = {t + 1 < turn ? g + 1 : g - t, t + 1 < turn ? i0 : following};
    return next;
}

/* Whether that chunk starts where head g's rows read up to `end` stop: read in order, as the hardware's
 * prefetchers follow (ahead_rows), rather than back or on another head (queue_rows). */
static inline int next_follows(struct next_chunk next, int g, long end) { return next.g == g && next.i0 == end; }

/* The end of that chunk (its start where it is -1, no chunk). */
static inline long chunk_end(const struct causal_inputs *in, struct next_chunk next) {
    return next.i0 < 0 ? next.i0 : in->n < next.i0 + ROWS ? in->n : next.i0 + ROWS;
}

/* Positions i0 .. i0 + rows of head g: phi(q) and phi(k) with row stride ld, [v, 1] with row stride width (its
 * padding left as it is) and phi(k)^T into k_t (d x ldt; NULL: not wanted). A masked key gets zero features, value and
 * normaliser, so it adds nothing to any product. The rows of the next chunk are queued, to be asked for over this
 * chunk's GEMMs (ahead.h): in a module's layout a head's rows lie 3 H d floats apart, a page or more, and the
 * hardware's own prefetchers do not follow them. Returns the queue. */
static inline struct ahead_queue *load_chunk(const struct causal_inputs *in, int g, long i0, int rows,
                                             struct next_chunk next, float *phi_q, float *phi_k, int ld, float *v1,
                                             int width, float *k_t, int ldt) {
    const int bi = g / in->h, hi = g % in->h, d = in->d, dv = in->dv, nb = next.g / in->h, nh = next.g % in->h;
    const uint8_t *masked = in->mask ? in->mask + bi * in->n + i0 : NULL;
    const long end = chunk_end(in, next);
    struct ahead_queue *queue = ahead_start(3 * (ROWS / 6)); /* the scores, and the products with [V, 1] and S */
    const row_queuer ahead = rows_queuer(next_follows(next, g, i0 + rows));
    ahead(queue, in->q + nb * in->qsb + nh * in->qsh, next.i0, end, in->qsn, map_inputs(d, in->map, in->ms));
    ahead(queue, in->k + nb * in->ksb + nh * in->ksh, next.i0, end, in->ksn, map_inputs(d, in->map, in->ms));
    ahead(queue, in->v + nb * in->vsb + nh * in->vsh, next.i0, end, in->vsn, dv);
    const float *qs[ROWS], *ks[ROWS];
    for (int r = 0; r < rows; r++) {
        const long j = i0 + r;
        float *vr = v1 + r * width;
        qs[r] = in->q + bi * in->qsb + hi * in->qsh + j * in->qsn;
        ks[r] = in->k + bi * in->ksb + hi * in->ksh + j * in->ksn;
        if (masked && masked[r]) {
            memset(vr, 0, sizeof(float) * (dv + 1));
        } else {
            memcpy(vr, in->v + bi * in->vsb + hi * in->vsh + j * in->vsn, sizeof(float) * dv);
            vr[dv] = 1.0f;
        }
    }
    block_features(phi_q, ld, qs, NULL, NULL, rows, d, in->map, in->ms, hi, NULL, NULL);
    block_features(phi_k, ld, ks, NULL, masked, rows, d, in->map, in->ms, key_head(in->map, in->ms, hi), NULL, NULL);
    if (k_t) transpose_rows(phi_k, ld, rows, d, k_t, ldt);
    return queue;
}

/* scores (rows x ldt) = tril(a b): a is (rows x k) with row stride lda, b is (k x ldt); entries above the
 * diagonal are zero, columns from rows on are left undefined (no product reads them). */
static inline void lower_scores(int rows, int k, const float *a, int lda, const float *b, int ldt, float *scores) {
    gemm_written(LOWER_N, rows, (rows + W - 1) / W, k, a, lda, 1, b, ldt, scores, ldt); /* c <= r and more */
    for (int r = 0; r < rows; r++)
        for (int c = r + 1; c < rows; c++) scores[r * ldt + c] = 0.0f;
}

/* The gradient of the rows [num, den] from that of out = num / den: [g / den, -(g . out) / den], padded with zeros
 * to width. grad, out are rows of dv, ld_grad and ld_out apart; den holds the rows' normalisers (zeros already
 * replaced by 1, except where rope's forward gave a query 0: that row is 0). */
static inline void gradient_rows(const float *grad, long ld_grad, const float *out, long ld_out, const float *den,
                                 int rows, int dv, int width, float *r_rows) {
    for (int r = 0; r < rows; r++, grad += ld_grad, out += ld_out) {
        float dot = 0.0f, *row = r_rows + r * width;
        if (den[r] == 0.0f) { /* stored only by rope's forward: a query given 0, whatever its gradient */
            memset(row, 0, sizeof(float) * width);
            continue;
        }
        const float inv = 1.0f / den[r];
        int e = 0;
        vf dots = splat(0.0f); /* in vectors: a scalar sum must add its terms one after another */
        for (; e + W <= dv; e += W) {
            const vf gv = load(grad + e);
            store(row + e, gv * splat(inv));
            dots += gv * load(out + e);
        }
        for (; e < dv; e++) {
            row[e] = grad[e] * inv;
            dot += grad[e] * out[e];
        }
        row[dv] = -(dot + hsum(dots)) * inv;
        memset(row + dv + 1, 0, sizeof(float) * (width - dv - 1));
    }
}

#endif
