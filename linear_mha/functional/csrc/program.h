/* A user's elementwise feature map as a short program of unary steps (functional/elementwise_program.py reads it
 * off the user's callable), run inside the attention kernels' row loaders (map 7, kernel_attention.h): each value
 * goes through the steps in order; its gradient goes back through them in reverse. */
#ifndef LINEAR_MHA_PROGRAM_H
#define LINEAR_MHA_PROGRAM_H
#include <math.h>
#include "simd.h"

#define PROGRAM_STEPS 8 /* elementwise_program.MAX_STEPS */
enum { STEP_RELU, STEP_ELU, STEP_EXP, STEP_ABS, STEP_POW, STEP_ADD, STEP_MUL, STEP_SOFTPLUS, STEP_SIGMOID };

struct program {
    int steps;
    int op[PROGRAM_STEPS];
    float c[PROGRAM_STEPS];     /* the step's constant: the power, the term, the factor */
    int whole[PROGRAM_STEPS];   /* a power that is a whole number in 1..8, taken by multiplication; else 0 */
};

/* The program as Python lays it out: [steps, op_0, c_0, op_1, c_1, ...] (floats), or NULL for no program. */
static inline struct program program_from(const float *data) {
    struct program p = {0, {0}, {0}, {0}};
    if (!data) return p;
    p.steps = (int)data[0];
    for (int s = 0; s < p.steps && s < PROGRAM_STEPS; s++) {
        p.op[s] = (int)data[1 + 2 * s];
        p.c[s] = data[2 + 2 * s];
        const float whole = floorf(p.c[s]);
        p.whole[s] = p.op[s] == STEP_POW && whole == p.c[s] && whole >= 1.0f && whole <= 8.0f ? (int)whole : 0;
    }
    return p;
}

static inline vf vabs(vf x) { return vselect(x < splat(0.0f), -x, x); }

/* exp of any x: e^x for x <= 0, 1 / e^-x above (inf past 87.3, where float32 overflows near 88.7 anyway). */
static inline vf exp_any(vf x) {
    const vf e = exp_nonpositive(-vabs(x));
    return vselect(x <= splat(0.0f), e, splat(1.0f) / e);
}

/* One step on a vector of values; *slope, when slope is not NULL, is multiplied by the step's derivative there. */
static inline vf step_vec(vf v, const struct program *p, int s, vf *slope) {
    const vf zero = splat(0.0f), one = splat(1.0f), c = splat(p->c[s]);
    const vi positive = v > zero;
    vf out, d = one;
    switch (p->op[s]) {
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
    case STEP_POW:
        if (p->whole[s]) {
            vf below = one; /* v^(n - 1) */
            for (int i = 1; i < p->whole[s]; i++) below *= v;
            out = below * v;
            d = c * below;
        } else { /* v^c = exp(c ln v) for v > 0; 0 at 0 (c > 0); NaN below, as torch.pow */
            const vf safe = vselect(positive, v, one);
            const vf power = exp_any(c * log_positive(safe));
            const vf nan = splat(NAN);
            out = vselect(positive, power, vselect(v < zero, nan, zero));
            d = vselect(positive, c * power / safe, vselect(v < zero, nan, p->c[s] < 1.0f ? splat(INFINITY) : zero));
            if (p->c[s] == 1.0f) d = vselect(v == zero, one, d);
        }
        break;
    case STEP_ADD:
        out = v + c;
        break;
    case STEP_MUL:
        out = v * c;
        d = c;
        break;
    case STEP_SOFTPLUS: { /* max(v, 0) + ln(1 + e^-|v|); its slope is sigmoid(v) */
        const vf e = exp_nonpositive(-vabs(v));
        out = vselect(positive, v, zero) + log_positive(one + e);
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

/* The same step on one value (the rows' tails). */
static inline float step_scalar(float v, const struct program *p, int s, float *slope) {
    const float c = p->c[s];
    float out, d = 1.0f;
    switch (p->op[s]) {
    case STEP_RELU:
        out = v > 0.0f ? v : 0.0f;
        d = v > 0.0f ? 1.0f : 0.0f;
        break;
    case STEP_ELU: {
        const float e = expf(v > 0.0f ? 0.0f : v);
        out = v > 0.0f ? v : e - 1.0f;
        d = v > 0.0f ? 1.0f : e;
        break;
    }
    case STEP_EXP:
        out = d = expf(v);
        break;
    case STEP_ABS:
        out = fabsf(v);
        d = v > 0.0f ? 1.0f : v < 0.0f ? -1.0f : 0.0f;
        break;
    case STEP_POW:
        if (p->whole[s]) {
            float below = 1.0f;
            for (int i = 1; i < p->whole[s]; i++) below *= v;
            out = below * v;
            d = c * below;
        } else if (v > 0.0f) {
            out = powf(v, c);
            d = c * out / v;
        } else {
            out = v < 0.0f ? NAN : 0.0f;
            d = v < 0.0f ? NAN : c < 1.0f ? INFINITY : c == 1.0f ? 1.0f : 0.0f;
        }
        break;
    case STEP_ADD:
        out = v + c;
        break;
    case STEP_MUL:
        out = v * c;
        d = c;
        break;
    case STEP_SOFTPLUS: {
        const float e = expf(-fabsf(v));
        out = (v > 0.0f ? v : 0.0f) + log1pf(e);
        d = (v > 0.0f ? 1.0f : e) / (1.0f + e);
        break;
    }
    default: {
        const float e = expf(-fabsf(v));
        out = (v > 0.0f ? 1.0f : e) / (1.0f + e);
        d = out * (1.0f - out);
        break;
    }
    }
    if (slope) *slope *= d;
    return out;
}

static inline void program_features(float *dst, const float *src, int d, const struct program *p) {
    int f = 0;
    for (; f + W <= d; f += W) {
        vf v = load(src + f);
        for (int s = 0; s < p->steps; s++) v = step_vec(v, p, s, NULL);
        store(dst + f, v);
    }
    for (; f < d; f++) {
        float v = src[f];
        for (int s = 0; s < p->steps; s++) v = step_scalar(v, p, s, NULL);
        dst[f] = v;
    }
}

/* The gradient through step s at its input x: g times the step's slope, but relu's is a selection, as autograd's
 * (relu after a step of infinite slope, such as x ** 0.5 at 0, passes 0, not 0 * inf). */
static inline vf step_grad_vec(vf g, vf x, const struct program *p, int s) {
    if (p->op[s] == STEP_RELU) return vselect(x > splat(0.0f), g, splat(0.0f));
    vf slope = splat(1.0f);
    step_vec(x, p, s, &slope);
    return g * slope;
}

static inline float step_grad_scalar(float g, float x, const struct program *p, int s) {
    if (p->op[s] == STEP_RELU) return x > 0.0f ? g : 0.0f;
    float slope = 1.0f;
    step_scalar(x, p, s, &slope);
    return g * slope;
}

/* dst = the gradient of the inputs src from g_phi, that of their features: the steps' inputs recomputed, then
 * the gradient taken back through the steps in reverse, in autograd's order (so inf and NaN land as they would). */
static inline void program_input_grad(float *dst, const float *g_phi, const float *src, int d,
                                      const struct program *p) {
    int f = 0;
    for (; f + W <= d; f += W) {
        vf x[PROGRAM_STEPS], v = load(src + f), g = load(g_phi + f);
        for (int s = 0; s < p->steps; s++) v = step_vec(x[s] = v, p, s, NULL);
        for (int s = p->steps - 1; s >= 0; s--) g = step_grad_vec(g, x[s], p, s);
        store(dst + f, g);
    }
    for (; f < d; f++) {
        float x[PROGRAM_STEPS], v = src[f], g = g_phi[f];
        for (int s = 0; s < p->steps; s++) v = step_scalar(x[s] = v, p, s, NULL);
        for (int s = p->steps - 1; s >= 0; s--) g = step_grad_scalar(g, x[s], p, s);
        dst[f] = g;
    }
}

#endif
