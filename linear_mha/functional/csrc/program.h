/* A user's elementwise feature map as a short program of unary steps (functional/elementwise_program.py reads it
 * off the user's callable), run inside the attention kernels' row loaders (map 7, kernel_attention.h): each value
 * goes through the steps in order; its gradient goes back through them in reverse. */
#ifndef LINEAR_MHA_PROGRAM_H
#define LINEAR_MHA_PROGRAM_H
#include "simd.h"

#define PROGRAM_STEPS 8 /* elementwise_program.MAX_STEPS */
/* STEP_POW: x ** c for c > 0 not a whole number (NaN below 0, as torch.pow); STEP_POW_WHOLE: c in 1 .. 8, by
 * multiplication (any sign). Python tells them apart on c's float64 value, before it is rounded to float32. */
enum { STEP_RELU, STEP_ELU, STEP_EXP, STEP_ABS, STEP_POW, STEP_ADD, STEP_MUL, STEP_SOFTPLUS, STEP_SIGMOID,
       STEP_POW_WHOLE };

struct program {
    int steps;
    int op[PROGRAM_STEPS];
    float c[PROGRAM_STEPS];     /* the step's constant: the power, the term, the factor */
    int whole[PROGRAM_STEPS];   /* STEP_POW_WHOLE's power */
};

/* The program as Python lays it out: [steps, op_0, c_0, op_1, c_1, ...] (floats), or NULL for no program. */
static inline struct program program_from(const float *data) {
    struct program p = {0, {0}, {0}, {0}};
    if (!data) return p;
    p.steps = (int)data[0];
    if (p.steps > PROGRAM_STEPS) p.steps = PROGRAM_STEPS; /* Python allows no more; never read past the arrays */
    for (int s = 0; s < p.steps; s++) {
        p.op[s] = (int)data[1 + 2 * s];
        p.c[s] = data[2 + 2 * s];
        if (p.op[s] == STEP_POW_WHOLE) {
            const int whole = (int)p.c[s];
            p.whole[s] = whole < 1 ? 1 : whole > 8 ? 8 : whole;
        }
    }
    return p;
}

static inline vf vabs(vf x) { return vselect(x < splat(0.0f), -x, x); }

/* exp of any x: e^x for x <= 0, 1 / e^-x above (inf past about 87.68, where float32 overflows near 88.72 anyway). */
static inline vf exp_any(vf x) {
    const vf e = exp_nonpositive(-vabs(x));
    return vselect(x <= splat(0.0f), e, splat(1.0f) / e);
}

/* One step, op with constant cs (whole: STEP_POW_WHOLE's power), on a vector of values; *slope, when slope is not
 * NULL, is multiplied by the step's derivative there. Inlined into loops over a row with op a constant, so the
 * switch is taken once per row and step, not once per vector (step_row). */
static inline __attribute__((always_inline)) vf step_op(vf v, int op, float cs, int whole, vf *slope) {
    const vf zero = splat(0.0f), one = splat(1.0f), c = splat(cs);
    const vi positive = v > zero;
    vf out, d = one;
    switch (op) {
    case STEP_RELU:
        out = vselect(positive, v, zero);
        d = vselect(positive, one, zero);
        break;
    case STEP_ELU: {
        const vf e = exp_nonpositive(vselect(positive, zero, v));
        out = vselect(positive, v, e - one);
        d = vselect(positive, one, e);
        break;
    }
    case STEP_EXP:
        out = d = exp_any(v);
        break;
    case STEP_ABS:
        out = vabs(v);
        d = vselect(positive, one, vselect(v < zero, -one, zero)); /* torch.sign: 0 at 0 */
        break;
    case STEP_POW_WHOLE: {
        vf below = one; /* v^(n - 1) */
        for (int i = 1; i < whole; i++) below *= v;
        out = below * v;
        d = c * below;
        break;
    }
    case STEP_POW: { /* v^c = exp(c ln v) for v > 0; 0 at 0 (c > 0); NaN below, as torch.pow */
        const vf safe = vselect(positive, v, one);
        const vf power = exp_any(c * log_positive(safe));
        const vf nan = splat(NAN);
        out = vselect(positive, power, vselect(v < zero, nan, zero));
        d = vselect(positive, c * power / safe, vselect(v < zero, nan, cs < 1.0f ? splat(INFINITY) : zero));
        break;
    }
    case STEP_ADD:
        out = v + c;
        break;
    case STEP_MUL:
        out = v * c;
        d = c;
        break;
    case STEP_SOFTPLUS: { /* max(v, 0) + ln(1 + e^-|v|); its slope is sigmoid(v) */
        const vf e = exp_nonpositive(-vabs(v)), u = one + e;
        /* ln(1 + e) as ln(u) e / (u - 1), exact where u rounds 1 + e (log1p's trick): ln(u) alone would lose e
         * below 2^-24, and softplus of v < -17 with it */
        const vi rounded_away = u == one;
        const vf log1p_e = vselect(rounded_away, e, log_positive(u) * e / vselect(rounded_away, one, u - one));
        out = vselect(positive, v, zero) + log1p_e;
        d = vselect(positive, one, e) / (one + e);
        break;
    }
    default: { /* STEP_SIGMOID */
        const vf e = exp_nonpositive(-vabs(v));
        out = vselect(positive, one, e) / (one + e);
        d = out * (one - out);
        break;
    }
    }
    if (slope) *slope *= d;
    return out;
}

/* n <= W values of a row as one vector, the lanes past n zero (a row's tail goes through the same vector steps as
 * the rest of the row, so it computes exactly what they do; its padding is never stored). */
static inline vf load_some(const float *x, int n) {
    if (n == W) return load(x);
    float lanes[W] = {0};
    memcpy(lanes, x, sizeof(float) * n);
    return load(lanes);
}

/* Step s over a row: dst[f] = step(src[f]) for f < d, whole vectors (src's tail read as load_some reads it, dst
 * padded to whole_vectors(d)); src may be dst. With slope set, dst gets the gradient instead: slope[f] (the
 * gradient of the step's output) times the step's derivative at src[f], relu's as a selection, as autograd's
 * (relu after a step of infinite slope, such as x ** 0.5 at 0, passes 0, not 0 * inf).
 *
 * The switch sits outside the loop over the row's vectors. Inside it, once per vector, the dispatch took more
 * than the steps' arithmetic: with relu(x) ** 2 the map's loop had 1.5x the samples of elu's, exponential
 * included, on the 8-float build (docs/benchmarks.md, "A user's map a step at a time"). */
#define STEP_LOOP(OP)                                                                                         \
    case OP:                                                                                                  \
        for (int f = 0; f < d; f += W) {                                                                      \
            const vf x = f + W <= d ? load(src + f) : load_some(src + f, d - f);                              \
            if (!slope) {                                                                                     \
                store(dst + f, step_op(x, OP, cs, whole, NULL));                                              \
            } else if (OP == STEP_RELU) {                                                                     \
                store(dst + f, vselect(x > splat(0.0f), load(slope + f), splat(0.0f)));                       \
            } else {                                                                                          \
                vf d_step = splat(1.0f);                                                                      \
                step_op(x, OP, cs, whole, &d_step);                                                           \
                store(dst + f, load(slope + f) * d_step);                                                     \
            }                                                                                                 \
        }                                                                                                     \
        break;

static inline void step_row(float *dst, const float *src, const float *slope, int d, const struct program *p, int s) {
    const float cs = p->c[s];
    const int whole = p->whole[s];
    switch (p->op[s]) {
        STEP_LOOP(STEP_RELU)
        STEP_LOOP(STEP_ELU)
        STEP_LOOP(STEP_EXP)
        STEP_LOOP(STEP_ABS)
        STEP_LOOP(STEP_POW)
        STEP_LOOP(STEP_ADD)
        STEP_LOOP(STEP_MUL)
        STEP_LOOP(STEP_SOFTPLUS)
        STEP_LOOP(STEP_POW_WHOLE)
    default: /* STEP_SIGMOID, as step_op's own default (Python sends no other code) */
        STEP_LOOP(STEP_SIGMOID)
    }
}
#undef STEP_LOOP

/* The row's values after every step, in whole vectors (the padding lanes go through the steps as a row's tail does
 * and are never stored): into dst where d is whole vectors, else through a padded row. */
static inline void program_features(float *dst, const float *src, int d, const struct program *p) {
    if (p->steps == 0) {
        memcpy(dst, src, sizeof(float) * d);
        return;
    }
    float padded[whole_vectors(d)];
    float *row = d % W ? padded : dst;
    step_row(row, src, NULL, d, p, 0);
    for (int s = 1; s < p->steps; s++) step_row(row, row, NULL, d, p, s);
    if (row != dst) memcpy(dst, row, sizeof(float) * d);
}

/* dst = the gradient of the inputs src from g_phi, that of their features: the steps' inputs recomputed (x_0 = src,
 * x_s the input of step s), then the gradient taken back through the steps in reverse, in autograd's order (so inf
 * and NaN land as they would). */
static inline void program_input_grad(float *dst, const float *g_phi, const float *src, int d,
                                      const struct program *p) {
    const int dp = whole_vectors(d);
    if (p->steps == 0) {
        memcpy(dst, g_phi, sizeof(float) * d);
        return;
    }
    float inputs[p->steps * dp], g[dp]; /* inputs: x_1 .. x_(steps - 1) at (s - 1) dp; g: the gradient so far */
    for (int s = 1; s < p->steps; s++)
        step_row(inputs + (s - 1) * dp, s == 1 ? src : inputs + (s - 2) * dp, NULL, d, p, s - 1);
    memcpy(g, g_phi, sizeof(float) * d);
    memset(g + d, 0, sizeof(float) * (dp - d));
    for (int s = p->steps - 1; s >= 0; s--) step_row(g, s == 0 ? src : inputs + (s - 1) * dp, g, d, p, s);
    memcpy(dst, g, sizeof(float) * d);
}

#endif
