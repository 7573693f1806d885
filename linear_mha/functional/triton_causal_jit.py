"""The @triton.jit kernels of ``triton_causal.py`` (see there), imported on first use: the causal linear product

    out_i = phi(q_i) S_i,   S_i = S_0 + sum_{j <= i} phi(k_j) v_jᵀ                  (S: F x Dv)

and its gradients, each program walking one (batch, head)'s sequence a chunk of BLOCK_T positions at a time with its
part of the state in registers (float32): inside a chunk the masked (T, T) scores, between chunks the state. With
dO the output's gradient and P_j = dS_N + sum_{i >= j} phi(q_i) dO_iᵀ the state's gradient seen from position j
(dS_N: the final state's, when the caller used it):

    d phi(q_i) = dO_i S_iᵀ          (a forward walk, like the output)
    d phi(k_j) = P_j v_j,   d v_j = P_jᵀ phi(k_j),   d S_0 = P_0          (walks from the end)

A program holds the rows of the state it needs whole along the other side: the output and d v split the value
columns over programs, d phi(q) and d phi(k) the feature rows. States are (G, F, Dv) float32, contiguous.
"""
import triton
import triton.language as tl

from .triton_maps_jit import _load


@triton.jit
def _state_tile(base, rows, cols, F: tl.constexpr, DV: tl.constexpr):
    """state[rows, cols] of one head's (F, Dv) float32 state, zero outside it."""
    inside = (rows[:, None] < F) & (cols[None, :] < DV)
    return tl.load(base + rows[:, None] * DV + cols[None, :], mask=inside, other=0.0)


@triton.jit
def _starting(base, feats, cols, F: tl.constexpr, DV: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr,
              GIVEN: tl.constexpr):
    """The state tile a walk starts from: the given (F, Dv) state's part, or zeros."""
    if GIVEN:
        return _state_tile(base, feats, cols, F, DV)
    return tl.zeros((BLOCK_F, BLOCK_DV), dtype=tl.float32)


@triton.jit
def _store_rows(base, stride_n, rows, n, cols, width, x):
    inside = (rows[:, None] < n) & (cols[None, :] < width)
    tl.store(base + rows[:, None] * stride_n + cols[None, :], x.to(base.dtype.element_ty), mask=inside)


@triton.jit
def causal_forward(q_ptr, k_ptr, v_ptr, s0_ptr, out_ptr, sn_ptr, H, n,
                   sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
                   F: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                   BLOCK_DV: tl.constexpr, HAS_S0: tl.constexpr, STORE_STATE: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Program (g, c): the output's value columns c * BLOCK_DV ... of head g = b * H + h, and the final state's."""
    g, c = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    q_base, k_base = q_ptr + b * sq_b + h * sq_h, k_ptr + b * sk_b + h * sk_h
    v_base, o_base = v_ptr + b * sv_b + h * sv_h, out_ptr + b * so_b + h * so_h
    feats, cols, steps = tl.arange(0, BLOCK_F), c * BLOCK_DV + tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_T)
    seen = steps[:, None] >= steps[None, :]  # key j <= query i inside a chunk
    state = _starting(s0_ptr + g * F * DV, feats, cols, F, DV, BLOCK_F, BLOCK_DV, HAS_S0)
    for start in range(0, n, BLOCK_T):
        rows = start + steps
        q = _load(q_base, sq_n, rows, n, feats, F)
        k = _load(k_base, sk_n, rows, n, feats, F)
        v = _load(v_base, sv_n, rows, n, cols, DV)
        scores = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0)
        out = tl.dot(q, state, input_precision=PRECISION) + tl.dot(scores, v, input_precision=PRECISION)
        _store_rows(o_base, so_n, rows, n, cols, DV, out)
        state += tl.dot(tl.trans(k), v, input_precision=PRECISION)
    if STORE_STATE:
        inside = (feats[:, None] < F) & (cols[None, :] < DV)
        tl.store(sn_ptr + g * F * DV + feats[:, None] * DV + cols[None, :], state, mask=inside)


@triton.jit
def causal_grad_queries(k_ptr, v_ptr, do_ptr, s0_ptr, dq_ptr, H, n,
                        sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n, sdq_b, sdq_h, sdq_n,
                        F: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_DV: tl.constexpr, HAS_S0: tl.constexpr, PRECISION: tl.constexpr):
    """Program (g, r): d phi(q) in feature columns r * BLOCK_F ... of head g, walking forward with the state's rows
    r * BLOCK_F ... over every value column."""
    g, r = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    k_base, v_base = k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h
    do_base, dq_base = do_ptr + b * sd_b + h * sd_h, dq_ptr + b * sdq_b + h * sdq_h
    feats, cols, steps = r * BLOCK_F + tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_T)
    seen = steps[:, None] >= steps[None, :]
    state = _starting(s0_ptr + g * F * DV, feats, cols, F, DV, BLOCK_F, BLOCK_DV, HAS_S0)
    for start in range(0, n, BLOCK_T):
        rows = start + steps
        k = _load(k_base, sk_n, rows, n, feats, F)
        v = _load(v_base, sv_n, rows, n, cols, DV)
        do = _load(do_base, sd_n, rows, n, cols, DV)
        weights = tl.where(seen, tl.dot(do, tl.trans(v), input_precision=PRECISION), 0.0)  # dO_i . v_j, j <= i
        dq = tl.dot(do, tl.trans(state), input_precision=PRECISION) + tl.dot(weights, k, input_precision=PRECISION)
        _store_rows(dq_base, sdq_n, rows, n, feats, F, dq)
        state += tl.dot(tl.trans(k), v, input_precision=PRECISION)


@triton.jit
def causal_grad_keys(q_ptr, k_ptr, v_ptr, do_ptr, dsn_ptr, dk_ptr, dv_ptr, ds0_ptr, H, n,
                     sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n,
                     sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
                     F: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                     BLOCK_DV: tl.constexpr, FEATURE_ROWS: tl.constexpr, HAS_DSN: tl.constexpr,
                     STORE_DS0: tl.constexpr, PRECISION: tl.constexpr):
    """Program (g, p), walking head g from its last chunk to its first with a part of P. FEATURE_ROWS: P's rows
    p * BLOCK_F ... over every value column, giving d phi(k) in those feature columns (and d S_0's rows); else P's
    value columns p * BLOCK_DV ... over every feature row, giving d v in those columns."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    q_base, k_base = q_ptr + b * sq_b + h * sq_h, k_ptr + b * sk_b + h * sk_h
    v_base, do_base = v_ptr + b * sv_b + h * sv_h, do_ptr + b * sd_b + h * sd_h
    if FEATURE_ROWS:
        feats, cols = p * BLOCK_F + tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    else:
        feats, cols = tl.arange(0, BLOCK_F), p * BLOCK_DV + tl.arange(0, BLOCK_DV)
    steps = tl.arange(0, BLOCK_T)
    seen = steps[:, None] >= steps[None, :]  # query i >= key j inside a chunk
    grad_state = _starting(dsn_ptr + g * F * DV, feats, cols, F, DV, BLOCK_F, BLOCK_DV, HAS_DSN)
    chunks = tl.cdiv(n, BLOCK_T)
    for walked in range(0, chunks):
        rows = (chunks - 1 - walked) * BLOCK_T + steps
        q = _load(q_base, sq_n, rows, n, feats, F)
        k = _load(k_base, sk_n, rows, n, feats, F)
        v = _load(v_base, sv_n, rows, n, cols, DV)
        do = _load(do_base, sd_n, rows, n, cols, DV)
        if FEATURE_ROWS:
            weights = tl.where(seen, tl.dot(do, tl.trans(v), input_precision=PRECISION), 0.0)  # [i, j]: dO_i . v_j
            dk = tl.dot(v, tl.trans(grad_state), input_precision=PRECISION) \
                + tl.dot(tl.trans(weights), q, input_precision=PRECISION)
            _store_rows(dk_ptr + b * sdk_b + h * sdk_h, sdk_n, rows, n, feats, F, dk)
        else:
            scores = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0)  # [i, j]: q_i . k_j
            dv = tl.dot(k, grad_state, input_precision=PRECISION) \
                + tl.dot(tl.trans(scores), do, input_precision=PRECISION)
            _store_rows(dv_ptr + b * sdv_b + h * sdv_h, sdv_n, rows, n, cols, DV, dv)
        grad_state += tl.dot(tl.trans(q), do, input_precision=PRECISION)
    if FEATURE_ROWS and STORE_DS0:
        inside = (feats[:, None] < F) & (cols[None, :] < DV)
        tl.store(ds0_ptr + g * F * DV + feats[:, None] * DV + cols[None, :], grad_state, mask=inside)


@triton.jit
def decayed_product(x_ptr, y_ptr, z_ptr, gate_ptr, out_ptr, H, n,
                    sx_b, sx_h, sx_n, sy_b, sy_h, sy_n, sz_b, sz_h, sz_n, so_b, so_h, so_n,
                    F: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                    BLOCK_DV: tl.constexpr, REVERSE: tl.constexpr, PRECISION: tl.constexpr):
    """Program (g, c): value columns c * BLOCK_DV ... of head g of the product with one decay per position
    (``triton_decayed.py``), out_t = sum_s decay (x_t . y_s) z_s over s <= t, or s >= t when REVERSE, decay being
    exp of the gates after the earlier of s, t up to the later. The gate is (G, n) contiguous. Inside a chunk every
    exponent is a difference of the chunk's own running gate sums (c_t = the gates from the chunk's start up to
    t), <= 0 but in the masked half, which tl.where drops; between chunks the state, decayed across each."""
    g, c = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    x_base, y_base = x_ptr + b * sx_b + h * sx_h, y_ptr + b * sy_b + h * sy_h
    z_base, o_base = z_ptr + b * sz_b + h * sz_h, out_ptr + b * so_b + h * so_h
    feats, cols, steps = tl.arange(0, BLOCK_F), c * BLOCK_DV + tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_T)
    if REVERSE:
        seen = steps[:, None] <= steps[None, :]  # [t, s]: s >= t inside a chunk
    else:
        seen = steps[:, None] >= steps[None, :]  # [t, s]: s <= t
    # Forward: sum_{s before the chunk} exp(b_{start-1} - b_s) y_s z_sᵀ. Reversed: sum_{s after the chunk}
    # exp(b_s - b_end) y_s z_sᵀ.
    state = tl.zeros((BLOCK_F, BLOCK_DV), dtype=tl.float32)
    chunks = tl.cdiv(n, BLOCK_T)
    for walked in range(0, chunks):
        if REVERSE:
            rows = (chunks - 1 - walked) * BLOCK_T + steps
        else:
            rows = walked * BLOCK_T + steps
        x = _load(x_base, sx_n, rows, n, feats, F)
        y = _load(y_base, sy_n, rows, n, feats, F)
        z = _load(z_base, sz_n, rows, n, cols, DV)
        gates = tl.load(gate_ptr + g * n + rows, mask=rows < n, other=0.0)  # 0 past the end: no decay there
        running, whole = tl.cumsum(gates, 0), tl.sum(gates, 0)  # c_t, and the chunk's whole decay
        if REVERSE:
            apart = running[None, :] - running[:, None]  # [t, s]: c_s - c_t, the gates after t up to s
            from_state, to_state = tl.exp(whole - running), tl.exp(running)
        else:
            apart = running[:, None] - running[None, :]  # [t, s]: c_t - c_s
            from_state, to_state = tl.exp(running), tl.exp(whole - running)
        ratios = tl.exp(tl.where(seen, apart, 0.0))  # the masked half's exponents may be large and positive
        weights = tl.where(seen, tl.dot(x, tl.trans(y), input_precision=PRECISION) * ratios, 0.0)
        out = tl.dot(x * from_state[:, None], state, input_precision=PRECISION) \
            + tl.dot(weights, z, input_precision=PRECISION)
        _store_rows(o_base, so_n, rows, n, cols, DV, out)
        state = state * tl.exp(whole) + tl.dot(tl.trans(y * to_state[:, None]), z, input_precision=PRECISION)
