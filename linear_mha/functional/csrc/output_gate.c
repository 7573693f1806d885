/* The output gate of the attention modules (linear_mha/output_gate.py): per head h,
 *
 *   res = out * s,   s = 2 sigmoid(z),   z = q W_h + b_h      (q: d values, out, res, z: dv values per row)
 *
 * and its gradients, a block of ROWS rows of one head at a time. The logits are a register-tiled GEMM into
 * thread-local scratch, so the gate is never an N-sized tensor: composed from tensor ops it was one fresh
 * (B, H, N, dv) tensor per product and pass, and their page faults cost more than the arithmetic. The backward
 * recomputes s, then
 *
 *   d out = grad * s,   d z = grad * out * 2 e / (1 + e)^2   (d s / d z = 2 sigmoid(z) sigmoid(-z), e = exp(-|z|)),
 *   d q = d z W_h^T,    d W_h = sum q^T d z,   d b_h = sum d z,
 *
 * d W and d b summed per task into the caller's (tasks, H, d, dv) and (tasks, H, dv) slices, so the sums do not
 * depend on which thread ran which task. Rows are addressed through (batch, head, position) strides (struct
 * rows_at), each row contiguous; W (H, d, dv) and b (H, dv) contiguous, b may be NULL. Entry points return 0, or
 * -1 when a buffer could not be allocated. */
#include "kernel_attention.h"

struct gate_rows {
    const float *q, *bias, *out, *grad;
    float *res, *grad_out, *grad_q, *grad_w, *grad_b;
    float *w_rows;      /* (H, d, dvp): W with rows padded to whole vectors, for z = q W */
    float *w_t;         /* (H, dv, dp): W^T likewise, for d q = d z W^T */
    struct rows_at q_at, out_at, res_at, grad_at, grad_out_at, grad_q_at;
    int h, d, dv, dvp, dp, tasks;
    long n, blocks, items; /* blocks of ROWS positions per head; items = B H blocks */
    int stream;            /* outputs far larger than the caches, written with streaming stores (streamed()) */
};

/* 2 sigmoid(z) into *s and, with slope, its derivative 2 e / (1 + e)^2 into *slope, from e = exp(-|z|), so that
 * nothing overflows: sigmoid is 1 / (1 + e) for z >= 0, e / (1 + e) below. The derivative written as 2 s' (1 - s')
 * instead would cancel as the gate saturates (6% off at z = 16, 0 beyond 17). */
static inline void twice_sigmoid(float *s, float *slope) {
    const vf z = load(s);
    const vi negative = z < splat(0.0f);
    const vf e = exp_nonpositive(vselect(negative, z, -z)), inv = splat(1.0f) / (splat(1.0f) + e);
    store(s, splat(2.0f) * vselect(negative, e, splat(1.0f)) * inv);
    if (slope) store(slope, splat(2.0f) * e * inv * inv);
}

/* s (rows x dvp) = 2 sigmoid(z), z = q W_h + b_h, for positions i0.. of head g, and its derivative into slope
 * (rows x dvp) unless NULL. */
static void gate_block(const struct gate_rows *c, int g, long i0, int rows, float *s, float *slope) {
    const int hi = g % c->h;
    const float *b = c->bias ? c->bias + (long)hi * c->dv : NULL;
    for (int r = 0; r < rows; r++) {
        float *sr = s + (long)r * c->dvp;
        memset(sr, 0, sizeof(float) * c->dvp);
        if (b) memcpy(sr, b, sizeof(float) * c->dv);
    }
    gemm_acc(rows, c->dvp / W, c->d, c->q + row_offset(c->q_at, c->h, g, i0), c->q_at.n, 1,
             c->w_rows + (long)hi * c->d * c->dvp, c->dvp, s, c->dvp);
    for (long f = 0; f < (long)rows * c->dvp; f += W) twice_sigmoid(s + f, slope ? slope + f : NULL);
}

/* dst[f] = a[f] * b[f] for f < n, with streaming stores where `stream` is set and dst starts on a whole vector. */
static inline void times_to(float *dst, const float *a, const float *b, int n, int stream) {
    int f = 0;
    if (stream && vector_aligned(dst))
        for (; f + W <= n; f += W) store_stream(dst + f, load(a + f) * load(b + f));
    for (; f + W <= n; f += W) store(dst + f, load(a + f) * load(b + f));
    for (; f < n; f++) dst[f] = a[f] * b[f];
}

/* Item `item` as head g, first position i0 and rows. Heads run fastest: in a module's layout, (B, N, H, d) seen as
 * (B, H, N, d), a position's rows of every head lie together, so one block of positions over all heads reads
 * whole runs of memory, where a head's block alone read 256 bytes every 2 KiB (6 KiB in q, a slice of the
 * in-projection's output) and a new page every two rows: 2.0-2.4 against 1.5-2.0 us per token and thread in the
 * forward at 16,384 x 8 x 64 (a C loop over this code, one thread). */
static inline int item_rows(const struct gate_rows *c, long item, int *g, long *i0) {
    const long hi = item % c->h, block = item / c->h;
    *g = (int)(block / c->blocks * c->h + hi);
    *i0 = block % c->blocks * ROWS;
    return (int)(c->n - *i0 < ROWS ? c->n - *i0 : ROWS);
}

/* Queues the rows item `next` will read (q, out and, with grad set, grad), unless it is `end`, to be asked for over
 * the GEMM steps of the item before it (ahead.h), in any layout: the next item is another head's block. Without
 * it each block's first reads of q and out waited on memory: 45% of the forward's samples in its loop over out,
 * and a GEMM stalled on the rows of q. */
static void queue_next(const struct gate_rows *c, long next, long end, int steps, int grad) {
    struct ahead_queue *queue = ahead_start(steps);
    if (next >= end) return;
    int g;
    long i0;
    const int rows = item_rows(c, next, &g, &i0);
    queue_rows(queue, c->q + row_offset(c->q_at, c->h, g, 0), i0, i0 + rows, c->q_at.n, c->d);
    queue_rows(queue, c->out + row_offset(c->out_at, c->h, g, 0), i0, i0 + rows, c->out_at.n, c->dv);
    if (grad) queue_rows(queue, c->grad + row_offset(c->grad_at, c->h, g, 0), i0, i0 + rows, c->grad_at.n, c->dv);
}

static void forward_task(const void *ctx, int t, float *s) {
    const struct gate_rows *c = ctx;
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        int g;
        long i0;
        const int rows = item_rows(c, item, &g, &i0);
        queue_next(c, item + 1, z, ROWS / 6, 0); /* over gate_block's GEMM */
        gate_block(c, g, i0, rows, s, NULL);
        const float *out = c->out + row_offset(c->out_at, c->h, g, i0);
        float *res = c->res + row_offset(c->res_at, c->h, g, i0);
        for (int r = 0; r < rows; r++)
            times_to(res + r * c->res_at.n, out + r * c->out_at.n, s + (long)r * c->dvp, c->dv, c->stream);
    }
}

/* Adds head hi's d W and d b, summed in the thread's scratch, into task t's slices, and zeroes the scratch. */
static void flush_head(const struct gate_rows *c, int t, int hi, float *dw, float *db) {
    if (c->grad_w) {
        float *to = c->grad_w + ((long)t * c->h + hi) * c->d * c->dv;
        for (int i = 0; i < c->d; i++)
            for (int e = 0; e < c->dv; e++) to[(long)i * c->dv + e] += dw[(long)i * c->dvp + e];
        memset(dw, 0, sizeof(float) * c->d * c->dvp);
    }
    if (c->grad_b) {
        float *to = c->grad_b + ((long)t * c->h + hi) * c->dv;
        for (int e = 0; e < c->dv; e++) to[e] += db[e];
        memset(db, 0, sizeof(float) * c->dvp);
    }
}

/* The thread's sums of d W and d b for every head (scratch after s, d z and d q): items alternate heads. */
static void backward_task(const void *ctx, int t, float *scratch) {
    const struct gate_rows *c = ctx;
    float *s = scratch, *dz = s + ROWS * c->dvp, *dq = dz + ROWS * c->dvp, *dw = dq + ROWS * c->dp,
          *db = dw + (long)c->h * c->d * c->dvp;
    const int params = c->grad_w || c->grad_b, inputs = c->grad_q || params;
    long a, z;
    task_range(c->items, c->tasks, t, &a, &z);
    for (long item = a; item < z; item++) {
        int g;
        long i0;
        const int rows = item_rows(c, item, &g, &i0), hi = g % c->h;
        float *dw_h = dw + (long)hi * c->d * c->dvp, *db_h = db + (long)hi * c->dvp;
        queue_next(c, item + 1, z, ROWS / 6 + (c->grad_q ? ROWS / 6 : 0) + (c->grad_w ? c->d / 6 : 0), 1);
        gate_block(c, g, i0, rows, s, inputs ? dz : NULL);
        const float *grad = c->grad + row_offset(c->grad_at, c->h, g, i0);
        const float *out = c->out + row_offset(c->out_at, c->h, g, i0);
        if (c->grad_out) {
            float *go = c->grad_out + row_offset(c->grad_out_at, c->h, g, i0);
            for (int r = 0; r < rows; r++)
                times_to(go + r * c->grad_out_at.n, grad + r * c->grad_at.n, s + (long)r * c->dvp, c->dv, c->stream);
        }
        if (!inputs) continue;
        for (int r = 0; r < rows; r++) { /* d z = grad out s', over the slope; its padding is made 0 */
            const float *gr = grad + r * c->grad_at.n, *orow = out + r * c->out_at.n;
            float *dzr = dz + (long)r * c->dvp;
            times_to(dzr, dzr, gr, c->dv, 0);
            times_to(dzr, dzr, orow, c->dv, 0);
            memset(dzr + c->dv, 0, sizeof(float) * (c->dvp - c->dv));
        }
        if (c->grad_q) {
            memset(dq, 0, sizeof(float) * rows * c->dp);
            gemm_acc(rows, c->dp / W, c->dv, dz, c->dvp, 1, c->w_t + (long)hi * c->dv * c->dp, c->dp, dq, c->dp);
            float *to = c->grad_q + row_offset(c->grad_q_at, c->h, g, i0);
            for (int r = 0; r < rows; r++) put_row(to + r * c->grad_q_at.n, dq + (long)r * c->dp, c->d, c->stream);
        }
        if (c->grad_w) /* d W_h += q^T d z: A(i, p) = q row p, column i */
            gemm_acc(c->d, c->dvp / W, rows, c->q + row_offset(c->q_at, c->h, g, i0), 1, c->q_at.n, dz, c->dvp, dw_h,
                     c->dvp);
        if (c->grad_b)
            for (int r = 0; r < rows; r++)
                for (int e = 0; e < c->dv; e++) db_h[e] += dz[(long)r * c->dvp + e];
    }
    if (params && a < z)
        for (int hi = 0; hi < c->h; hi++) flush_head(c, t, hi, dw + (long)hi * c->d * c->dvp, db + (long)hi * c->dvp);
}

/* The inputs both passes read (q, b, out and their layouts: strides 0 and 1), the task count (from the sizes and
 * threads), W padded into (H, d, dvp) and, for a backward, W^T into (H, dv, dp); -1 when they could not be
 * allocated. */
static int describe(struct gate_rows *c, const float *q, const float *w, const float *bias, const float *out, int b,
                    int h, long n, int d, int dv, const long *strides, int threads, int transposed) {
    c->q = q;
    c->bias = bias;
    c->out = out;
    c->q_at = rows_from(strides, 0, h, n, d);
    c->out_at = rows_from(strides, 1, h, n, dv);
    c->h = h;
    c->d = d;
    c->dv = dv;
    c->dvp = whole_vectors(dv);
    c->dp = whole_vectors(d);
    c->n = n;
    c->blocks = (n + ROWS - 1) / ROWS;
    c->items = (long)b * h * c->blocks;
    c->tasks = row_tasks(c->items, threads);
    c->w_rows = calloc((size_t)h * d * c->dvp, sizeof(float));
    c->w_t = transposed ? calloc((size_t)h * dv * c->dp, sizeof(float)) : NULL;
    if (!c->w_rows || (transposed && !c->w_t)) return -1;
    for (long hi = 0; hi < h; hi++)
        for (int i = 0; i < d; i++)
            for (int e = 0; e < dv; e++) {
                const float x = w[(hi * d + i) * dv + e];
                c->w_rows[(hi * d + i) * c->dvp + e] = x;
                if (transposed) c->w_t[(hi * dv + e) * c->dp + i] = x;
            }
    return 0;
}

static int finish(struct gate_rows *c, int status) {
    free(c->w_rows);
    free(c->w_t);
    return status;
}

/* The partial sums lm_output_gate_backward_f32 writes per task: grad_w (tasks, H, d, dv), grad_b (tasks, H, dv). */
int lm_output_gate_tasks(int b, int h, long n, int threads) {
    const long blocks = (n + ROWS - 1) / ROWS;
    return row_tasks((long)b * h * blocks, threads);
}

/* res <- out * 2 sigmoid(q W + b); res may be out. strides: q, out, res (3 each, batch, head, position). */
int lm_output_gate_f32(const float *q, const float *w, const float *bias, const float *out, float *res, int b, int h,
                       long n, int d, int dv, const long *strides, int threads) {
    struct gate_rows c = {0};
    if (describe(&c, q, w, bias, out, b, h, n, d, dv, strides, threads, 0)) return finish(&c, -1);
    c.res = res;
    c.res_at = rows_from(strides, 2, h, n, dv);
    c.stream = res != out && streamed((long)b * h * n * dv); /* in place, out's lines are in cache already */
    return finish(&c, for_each_task(c.tasks, threads_for(threads), (long)ROWS * c.dvp, forward_task, &c, 0));
}

/* The gradients of res = out * 2 sigmoid(q W + b) from grad, that of res: grad_out, grad_q (NULL: not wanted), and
 * grad_w / grad_b per task (zeroed by the caller, NULL: not wanted). strides: q, out, grad, grad_out, grad_q. */
int lm_output_gate_backward_f32(const float *q, const float *w, const float *bias, const float *out,
                                const float *grad, float *grad_out, float *grad_q, float *grad_w, float *grad_b,
                                int b, int h, long n, int d, int dv, const long *strides, int threads) {
    struct gate_rows c = {0};
    if (describe(&c, q, w, bias, out, b, h, n, d, dv, strides, threads, grad_q != NULL)) return finish(&c, -1);
    c.grad = grad;
    c.grad_out = grad_out;
    c.grad_q = grad_q;
    c.grad_w = grad_w;
    c.grad_b = grad_b;
    c.grad_at = rows_from(strides, 2, h, n, dv);
    c.grad_out_at = rows_from(strides, 3, h, n, dv);
    c.grad_q_at = rows_from(strides, 4, h, n, d);
    c.stream = streamed((long)b * h * n * (d < dv ? d : dv));
    const long scratch = 2L * ROWS * c.dvp + (long)ROWS * c.dp + (long)h * ((long)d * c.dvp + c.dvp);
    return finish(&c, for_each_task(c.tasks, threads_for(threads), scratch, backward_task, &c, 0));
}
