"""The @triton.jit kernels of ``triton_kernel.py`` (see there), imported on first use. Whether they run compiled or
in Triton's interpreter (``TRITON_INTERPRET=1``, as the tests run them on CPU tensors) is fixed when triton is
first imported in the process.

Feature column c of a tile reads input column c. taylor's constant feature, the first of its d + 1 in the
reference order of ``feature_maps``, is kept out of the tiles (CONST): its state row is the sum of the kept keys'
values and its normaliser their count, so its tiles stay d wide (d + 1 would pad them to twice that). hedgehog's 2m
features are two tiles, softmax(z) and softmax(-z), each with a state of its own. ``triton_kernel`` turns these
parts into the reference layout of a state (F, Dv + 1), so states and initial states mean the same on every path.
Rotary position (``grid_rope``) turns feature c with its partner column: that partner's features come from a second
load of the inputs with the columns permuted, and its gradient from a second product with the state's rows permuted,
because a register tile cannot be permuted in place.
"""
import triton
import triton.language as tl

# Globals a compiled @triton.jit reads must be tl.constexpr (the interpreter reads plain ones too)
ELU, RELU, TAYLOR, FOCUSED, HEDGEHOG = (tl.constexpr(code) for code in range(5))  # triton_kernel.MAPS
TAYLOR_EPS = tl.constexpr(1e-12)  # F.normalize's
RELU_EPS = tl.constexpr(1e-6)     # focused.RELU_EPS


@triton.jit
def _load(base, stride_n, rows, n, cols, width):
    """x[rows, cols] of an (n, width) matrix as float32, zero outside it (cols may be negative or past the end)."""
    inside = (rows[:, None] < n) & (cols[None, :] >= 0) & (cols[None, :] < width)
    return tl.load(base + rows[:, None] * stride_n + cols[None, :], mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _inputs(base, stride_n, rows, n, keep, cols, width):
    """_load's tile with the rows not kept (padded keys) zeroed, as the reference zeroes masked keys before their
    map: whatever they hold, NaN or inf, then reaches no feature and no gradient (0 * NaN would)."""
    return tl.where(keep[:, None], _load(base, stride_n, rows, n, cols, width), 0.0)


@triton.jit
def _point_features(x, cols, p_ptr, h, power, D: tl.constexpr, MAP: tl.constexpr, HAS_PARAM: tl.constexpr):
    """The features in columns ``cols`` of rows x (x[:, c] = input column c): elu/relu elementwise, taylor's
    x / |x| (its constant feature is kept apart), focused's |y| y^p / |y^p| for y = (relu(x) + eps) / scale (HAS_PARAM: a scale per head and
    channel at p_ptr, (H, D)). The maps that read a whole row (its norm, its maximum) read it in any column order,
    so a permuted ``cols`` gives the permuted features."""
    valid = (cols < D)[None, :]
    if MAP == TAYLOR:
        norm = tl.sqrt(tl.sum(x * x, axis=1))
        return tl.where(valid, x / tl.maximum(norm, TAYLOR_EPS)[:, None], 0.0)
    if MAP == FOCUSED:
        y = tl.maximum(x, 0.0) + RELU_EPS
        if HAS_PARAM:
            y = y / tl.load(p_ptr + h * D + cols, mask=cols < D, other=1.0)[None, :]
        y = tl.where(valid, y, 0.0)
        peak = tl.max(y, axis=1)
        # on y / max(y), in (0, 1], neither the power nor the norms can overflow (as composed_focused_map)
        unit = y / peak[:, None]
        powered = tl.where(valid, tl.exp(power * tl.log(tl.where(valid, unit, 1.0))), 0.0)
        size = peak * tl.sqrt(tl.sum(unit * unit, axis=1))
        return powered * (size / tl.sqrt(tl.sum(powered * powered, axis=1)))[:, None]
    if MAP == ELU:
        return tl.where(valid, tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0))), 0.0)
    return tl.where(valid, tl.maximum(x, 0.0), 0.0)


@triton.jit
def _point_input_grad(x, d_phi, cols, p_ptr, h, power, D: tl.constexpr, MAP: tl.constexpr,
                      HAS_PARAM: tl.constexpr):
    """(d x, d scale summed over the rows) from d_phi, the gradient of ``_point_features(x, cols)``; d scale is
    zero but for focused with a scale. taylor: d x = (g - x' (x' . g)) / |x| for x' = x / |x| > eps, g / eps below.
    focused, with u = y / max(y), P = u^p, w = P / |P|, n = |y|: d n = d_phi . w, d w = n d_phi,
    d P = (d w - w (w . d w)) / |P|, d y = p u^(p-1) d P / max(y) + d n y / n (w does not depend on y's scale)."""
    zero = tl.zeros((x.shape[1],), dtype=tl.float32)
    valid = (cols < D)[None, :]
    if MAP == TAYLOR:
        g = tl.where(valid, d_phi, 0.0)
        norm = tl.sqrt(tl.sum(x * x, axis=1))
        scale = tl.maximum(norm, TAYLOR_EPS)
        unit = x / scale[:, None]
        along = tl.sum(g * unit, axis=1)
        return tl.where((norm > TAYLOR_EPS)[:, None], g - unit * along[:, None], g) / scale[:, None], zero
    if MAP == FOCUSED:
        s = zero + 1.0
        if HAS_PARAM:
            s = tl.load(p_ptr + h * D + cols, mask=cols < D, other=1.0)
        y = tl.where(valid, (tl.maximum(x, 0.0) + RELU_EPS) / s[None, :], 0.0)
        peak = tl.max(y, axis=1)
        unit = y / peak[:, None]
        log_unit = tl.log(tl.where(valid, unit, 1.0))
        powered = tl.where(valid, tl.exp(power * log_unit), 0.0)
        p_norm = tl.sqrt(tl.sum(powered * powered, axis=1))
        u_norm = tl.sqrt(tl.sum(unit * unit, axis=1))
        w = powered / p_norm[:, None]
        g = tl.where(valid, d_phi, 0.0)
        d_n = tl.sum(g * w, axis=1)
        d_w = g * (peak * u_norm)[:, None]
        d_p = (d_w - w * tl.sum(w * d_w, axis=1)[:, None]) / p_norm[:, None]
        slope = tl.where(valid, power * tl.exp((power - 1.0) * log_unit), 0.0)
        d_y = slope * d_p / peak[:, None] + (d_n / u_norm)[:, None] * unit
        d_y = tl.where(valid, d_y, 0.0)
        dx = tl.where(x > 0, d_y / s[None, :], 0.0)
        return dx, -tl.sum(d_y * y / s[None, :], axis=0)
    if MAP == ELU:
        return d_phi * tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0))), zero
    return d_phi * tl.where(x > 0, 1.0, 0.0), zero


@triton.jit
def _softmax_pair(x, w, b, fcols, M: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """hedgehog's features of rows x (n, BLOCK_D): softmax(z) and softmax(-z) over the M columns of z = x W + b."""
    z = tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        z += b[None, :]
    valid = (fcols < M)[None, :]
    up = tl.where(valid, z, -float("inf"))
    down = tl.where(valid, -z, -float("inf"))
    up = tl.exp(up - tl.max(up, axis=1)[:, None])
    down = tl.exp(down - tl.max(down, axis=1)[:, None])
    return up / tl.sum(up, axis=1)[:, None], down / tl.sum(down, axis=1)[:, None]


@triton.jit
def _softmax_pair_grad(pos, neg, d_pos, d_neg):
    """d z from the gradients of softmax(z) and softmax(-z)."""
    return (pos * (d_pos - tl.sum(d_pos * pos, axis=1)[:, None])
            - neg * (d_neg - tl.sum(d_neg * neg, axis=1)[:, None]))


@triton.jit
def _rope(cos_ptr, sin_ptr, rows, n, fcols, F: tl.constexpr, R: tl.constexpr):
    """(cos, signed sin) for rows and feature columns: the last R of F features turn in pairs (c, c + R/2),
    rot(f)[c] = f[c] cos - f[c + R/2] sin in the first half, f[c] cos + f[c - R/2] sin in the second; cos 1 and
    sin 0 for the features that stay."""
    t = fcols - (F - R)
    inside = (rows[:, None] < n) & ((t >= 0) & (fcols < F))[None, :]
    cos = tl.load(cos_ptr + rows[:, None] * R + t[None, :], mask=inside, other=1.0)
    sin = tl.load(sin_ptr + rows[:, None] * R + t[None, :], mask=inside, other=0.0)
    return cos, tl.where((t < R // 2)[None, :], -sin, sin)


@triton.jit
def _partner(fcols, F: tl.constexpr, R: tl.constexpr):
    """The column each feature turns with (itself for the features that stay)."""
    t = fcols - (F - R)
    return tl.where((t >= 0) & (fcols < F), F - R + (t + R // 2) % R, fcols)


@triton.jit
def _head_params(p_ptr, b_ptr, h, dcols, fcols, D: tl.constexpr, M: tl.constexpr, MAP: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """hedgehog's W (BLOCK_D, BLOCK_F) and b (BLOCK_F,) of head h, zero outside (D, M); dummies for other maps."""
    if MAP == HEDGEHOG:
        w = tl.load(p_ptr + h * D * M + dcols[:, None] * M + fcols[None, :],
                    mask=(dcols[:, None] < D) & (fcols[None, :] < M), other=0.0)
        b = tl.zeros(fcols.shape, tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + h * M + fcols, mask=fcols < M, other=0.0)
        return w, b
    return tl.zeros((dcols.shape[0], fcols.shape[0]), tl.float32), tl.zeros(fcols.shape, tl.float32)


@triton.jit
def _features(base, stride_n, rows, n, keep, p_ptr, w, b, h, power, cos_ptr, sin_ptr, dcols, fcols,
              D: tl.constexpr, F: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
              MAP: tl.constexpr, HAS_PARAM: tl.constexpr, PRECISION: tl.constexpr):
    """The features of rows ``rows`` (zero where not ``keep``): (plain, rotated, second), where rotated is plain
    turned by rotary position (plain itself without it) and second is hedgehog's softmax(-z) tile (plain again for
    the other maps, unused)."""
    if MAP == HEDGEHOG:
        x = _inputs(base, stride_n, rows, n, keep, dcols, D)
        pos, neg = _softmax_pair(x, w, b, fcols, M, HAS_PARAM, PRECISION)
        pos, neg = tl.where(keep[:, None], pos, 0.0), tl.where(keep[:, None], neg, 0.0)
        return pos, pos, neg
    x = _inputs(base, stride_n, rows, n, keep, fcols, D)
    plain = tl.where(keep[:, None], _point_features(x, fcols, p_ptr, h, power, D, MAP, HAS_PARAM), 0.0)
    rotated = plain
    if R > 0:
        cos, sin = _rope(cos_ptr, sin_ptr, rows, n, fcols, F, R)
        partner = _partner(fcols, F, R)
        x_partner = _inputs(base, stride_n, rows, n, keep, partner, D)
        other = tl.where(keep[:, None], _point_features(x_partner, partner, p_ptr, h, power, D, MAP, HAS_PARAM), 0.0)
        rotated = plain * cos + other * sin
    return plain, rotated, plain


@triton.jit
def _feature_grads(base, stride_n, rows, n, keep, p_ptr, w, b, h, power, cos_ptr, sin_ptr, dcols, fcols,
                   d_rot, d_rot_partner, d_plain, d_second, dx_ptr, dx_rows,
                   D: tl.constexpr, F: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                   MAP: tl.constexpr, HAS_PARAM: tl.constexpr, NEED_DX: tl.constexpr, PRECISION: tl.constexpr):
    """Given the gradients of a tile's features (d_rot of the rotated ones, d_rot_partner the same at the partner
    columns, d_plain of the plain ones; hedgehog: d_rot of softmax(z), d_second of softmax(-z)), store d x (when
    NEED_DX) and return the map's parameter gradients summed over the rows: (d W or d scale, d b)."""
    if MAP == HEDGEHOG:
        x = _inputs(base, stride_n, rows, n, keep, dcols, D)
        pos, neg = _softmax_pair(x, w, b, fcols, M, HAS_PARAM, PRECISION)
        d_z = tl.where(keep[:, None], _softmax_pair_grad(pos, neg, d_rot + d_plain, d_second), 0.0)
        if NEED_DX:
            dx = tl.dot(d_z, tl.trans(w), input_precision=PRECISION)
            tl.store(dx_ptr + dx_rows[:, None] * D + dcols[None, :], dx,
                     mask=(rows[:, None] < n) & (dcols[None, :] < D))
        return tl.dot(tl.trans(x), d_z, input_precision=PRECISION), tl.sum(d_z, axis=0)
    d_phi = d_plain + d_rot
    if R > 0:
        cos, sin = _rope(cos_ptr, sin_ptr, rows, n, fcols, F, R)
        d_phi = d_plain + d_rot * cos - d_rot_partner * sin  # R^T: the turn by minus the angle
    d_phi = tl.where(keep[:, None], d_phi, 0.0)
    x = _inputs(base, stride_n, rows, n, keep, fcols, D)
    dx, d_scale = _point_input_grad(x, d_phi, fcols, p_ptr, h, power, D, MAP, HAS_PARAM)
    if NEED_DX:
        tl.store(dx_ptr + dx_rows[:, None] * D + (fcols)[None, :], dx,
                 mask=(rows[:, None] < n) & (fcols[None, :] < D))
    return tl.zeros((dcols.shape[0], fcols.shape[0]), tl.float32), d_scale


@triton.jit
def key_sums(k_ptr, v_ptr, mask_ptr, p_ptr, b_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, c_ptr, cz_ptr, H, S,
             ksb, ksh, ksn, vsb, vsh, vsn, power,
             D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
             R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
             BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PARAM: tl.constexpr,
             TILES: tl.constexpr, CONST: tl.constexpr, PRECISION: tl.constexpr):
    """Program (g, p): S_p = sum rot(phi(k_j)) v_j^T and z_p = sum phi(k_j) over the TILES * BLOCK_N keys from
    p * TILES * BLOCK_N of head g (hedgehog: a pair of each, one per softmax); CONST: the constant feature's row,
    sum v_j, and its normaliser, the number of keys kept. TILES is a constexpr trip count: a
    loop bound given at run time is not one that every Triton version's interpreter reads."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    k_base, v_base = k_ptr + b * ksb + h * ksh, v_ptr + b * vsb + h * vsh
    dcols, fcols, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    w, bias = _head_params(p_ptr, b_ptr, h, dcols, fcols, D, M, MAP, HAS_PARAM)
    acc = tl.zeros((BLOCK_F, BLOCK_DV), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_F,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_F, BLOCK_DV), dtype=tl.float32)
    acc2_z = tl.zeros((BLOCK_F,), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_DV,), dtype=tl.float32)
    acc_cz = 0.0
    for tile in range(TILES):
        rows = (p * TILES + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = rows < S
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b * S + rows, mask=keep, other=1) == 0)
        plain, rotated, second = _features(k_base, ksn, rows, S, keep, p_ptr, w, bias, h, power, cos_ptr, sin_ptr,
                                           dcols, fcols, D, F, M, R, MAP, HAS_PARAM, PRECISION)
        # a padded key's value may hold anything, NaN included: 0 * NaN = NaN
        v = _inputs(v_base, vsn, rows, S, keep, c, DV)
        acc += tl.dot(tl.trans(rotated), v, input_precision=PRECISION)
        acc_z += tl.sum(plain, axis=0)
        if MAP == HEDGEHOG:
            acc2 += tl.dot(tl.trans(second), v, input_precision=PRECISION)
            acc2_z += tl.sum(second, axis=0)
        if CONST:
            acc_c += tl.sum(v, axis=0)
            acc_cz += tl.sum(keep.to(tl.float32), axis=0)
    if CONST:
        tl.store(c_ptr + (g * tl.num_programs(1) + p) * BLOCK_DV + c, acc_c)
        tl.store(cz_ptr + g * tl.num_programs(1) + p, acc_cz)
    out = (g * tl.num_programs(1) + p) * (2 if MAP == HEDGEHOG else 1)
    tl.store(s_ptr + out * BLOCK_F * BLOCK_DV + fcols[:, None] * BLOCK_DV + c[None, :], acc)
    tl.store(z_ptr + out * BLOCK_F + fcols, acc_z)
    if MAP == HEDGEHOG:
        tl.store(s_ptr + (out + 1) * BLOCK_F * BLOCK_DV + fcols[:, None] * BLOCK_DV + c[None, :], acc2)
        tl.store(z_ptr + (out + 1) * BLOCK_F + fcols, acc2_z)


@triton.jit
def _state(s_ptr, z_ptr, g, half, rows_of_s, fcols, c, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr,
           MAP: tl.constexpr):
    """Rows ``rows_of_s`` of head g's state (S: (BLOCK_F, BLOCK_DV) per half) and its key sum z."""
    at = g * (2 if MAP == HEDGEHOG else 1) + half
    s = tl.load(s_ptr + at * BLOCK_F * BLOCK_DV + rows_of_s[:, None] * BLOCK_DV + c[None, :])
    return s, tl.load(z_ptr + at * BLOCK_F + fcols)


@triton.jit
def _states(s_ptr, z_ptr, g, fcols, c, F: tl.constexpr, R: tl.constexpr, BLOCK_F: tl.constexpr,
            BLOCK_DV: tl.constexpr, MAP: tl.constexpr):
    """What a backward pass reads of head g's state (or of G): (S, z) of the first half, of hedgehog's second (the
    first again otherwise), and S with its rows permuted to the partner features (rotary position; S otherwise)."""
    s, z = _state(s_ptr, z_ptr, g, 0, fcols, fcols, c, BLOCK_F, BLOCK_DV, MAP)
    s2, z2 = s, z
    if MAP == HEDGEHOG:
        s2, z2 = _state(s_ptr, z_ptr, g, 1, fcols, fcols, c, BLOCK_F, BLOCK_DV, MAP)
    s_partner = s
    if R > 0:
        s_partner, _ = _state(s_ptr, z_ptr, g, 0, _partner(fcols, F, R), fcols, c, BLOCK_F, BLOCK_DV, MAP)
    return s, z, s2, z2, s_partner


@triton.jit
def queries(q_ptr, p_ptr, b_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, c_ptr, cz_ptr, o_ptr, den_ptr, H, L, qsb, qsh, qsn,
            power,
            D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
            R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
            BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_PARAM: tl.constexpr, CONST: tl.constexpr,
            PRECISION: tl.constexpr):
    """Program (g, i): out rows i * BLOCK_M ... of head g = rot(phi(q)) S / phi(q) z (0 where phi(q) z = 0), the
    constant feature's row and count added (CONST)."""
    g, i = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = rows < L
    dcols, fcols, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    w, bias = _head_params(p_ptr, b_ptr, h, dcols, fcols, D, M, MAP, HAS_PARAM)
    plain, rotated, second = _features(q_ptr + b * qsb + h * qsh, qsn, rows, L, inside, p_ptr, w, bias, h, power,
                                       cos_ptr, sin_ptr, dcols, fcols, D, F, M, R, MAP, HAS_PARAM, PRECISION)
    s, z = _state(s_ptr, z_ptr, g, 0, fcols, fcols, c, BLOCK_F, BLOCK_DV, MAP)
    num = tl.dot(rotated, s, input_precision=PRECISION)
    den = tl.sum(plain * z[None, :], axis=1)
    if MAP == HEDGEHOG:
        s2, z2 = _state(s_ptr, z_ptr, g, 1, fcols, fcols, c, BLOCK_F, BLOCK_DV, MAP)
        num += tl.dot(second, s2, input_precision=PRECISION)
        den += tl.sum(second * z2[None, :], axis=1)
    if CONST:
        num += tl.load(c_ptr + g * BLOCK_DV + c)[None, :]
        den += tl.load(cz_ptr + g)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + (g * L + rows[:, None]) * DV + c[None, :], (num / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=inside[:, None] & (c[None, :] < DV))
    tl.store(den_ptr + g * L + rows, den, mask=inside)


@triton.jit
def query_grads(q_ptr, p_ptr, b_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, o_ptr, den_ptr, go_ptr, dq_ptr, gs_ptr, gz_ptr,
                gc_ptr, gcz_ptr, dp_ptr, db_ptr, H, L, qsb, qsh, qsn, power,
                D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
                R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_PARAM: tl.constexpr, NEED_DX: tl.constexpr,
                NEED_DP: tl.constexpr, TILES: tl.constexpr, CONST: tl.constexpr, PRECISION: tl.constexpr):
    """Program (g, p) over the TILES * BLOCK_M queries from p * TILES * BLOCK_M: with r = [go / den, -(go . out) / den],
    the partial G_p = sum rot(phi(q))^T r_v and g_p = sum phi(q) r_z (CONST: the constant feature's, sum r_v and
    sum r_z); d q from d rot(phi(q)) = r_v S^T and
    d phi(q) = r_z z (NEED_DX), and the map's parameter gradients summed over the tiles (NEED_DP)."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    q_base = q_ptr + b * qsb + h * qsh
    dcols, fcols, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    w, bias = _head_params(p_ptr, b_ptr, h, dcols, fcols, D, M, MAP, HAS_PARAM)
    s, z, s2, z2, s_partner = _states(s_ptr, z_ptr, g, fcols, c, F, R, BLOCK_F, BLOCK_DV, MAP)
    acc = tl.zeros((BLOCK_F, BLOCK_DV), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_F,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_F, BLOCK_DV), dtype=tl.float32)
    acc2_z = tl.zeros((BLOCK_F,), dtype=tl.float32)
    acc_dp = tl.zeros((BLOCK_D, BLOCK_F), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK_F,), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_DV,), dtype=tl.float32)
    acc_cz = 0.0
    for tile in range(TILES):
        rows = (p * TILES + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        inside = rows < L
        go = _load(go_ptr + g * L * DV, DV, rows, L, c, DV)
        out = _load(o_ptr + g * L * DV, DV, rows, L, c, DV)
        den = tl.load(den_ptr + g * L + rows, mask=inside, other=1.0)
        r_v = go / den[:, None]
        r_z = -tl.sum(go * out, axis=1) / den
        plain, rotated, second = _features(q_base, qsn, rows, L, inside, p_ptr, w, bias, h, power, cos_ptr, sin_ptr,
                                           dcols, fcols, D, F, M, R, MAP, HAS_PARAM, PRECISION)
        acc += tl.dot(tl.trans(rotated), r_v, input_precision=PRECISION)
        acc_z += tl.sum(plain * r_z[:, None], axis=0)
        if MAP == HEDGEHOG:
            acc2 += tl.dot(tl.trans(second), r_v, input_precision=PRECISION)
            acc2_z += tl.sum(second * r_z[:, None], axis=0)
        if CONST:
            acc_c += tl.sum(r_v, axis=0)
            acc_cz += tl.sum(r_z, axis=0)
        if NEED_DX or NEED_DP:
            d_rot = tl.dot(r_v, tl.trans(s), input_precision=PRECISION)
            d_partner = d_rot
            if R > 0:
                d_partner = tl.dot(r_v, tl.trans(s_partner), input_precision=PRECISION)
            d_second = tl.dot(r_v, tl.trans(s2), input_precision=PRECISION) + r_z[:, None] * z2[None, :]
            d_w, d_b = _feature_grads(q_base, qsn, rows, L, inside, p_ptr, w, bias, h, power, cos_ptr, sin_ptr,
                                      dcols, fcols, d_rot, d_partner, r_z[:, None] * z[None, :], d_second, dq_ptr,
                                      g * L + rows, D, F, M, R, MAP, HAS_PARAM, NEED_DX, PRECISION)
            acc_dp += d_w
            acc_db += d_b
    at = g * tl.num_programs(1) + p
    if CONST:
        tl.store(gc_ptr + at * BLOCK_DV + c, acc_c)
        tl.store(gcz_ptr + at, acc_cz)
    halves = 2 if MAP == HEDGEHOG else 1
    tl.store(gs_ptr + at * halves * BLOCK_F * BLOCK_DV + fcols[:, None] * BLOCK_DV + c[None, :], acc)
    tl.store(gz_ptr + at * halves * BLOCK_F + fcols, acc_z)
    if MAP == HEDGEHOG:
        tl.store(gs_ptr + (at * 2 + 1) * BLOCK_F * BLOCK_DV + fcols[:, None] * BLOCK_DV + c[None, :], acc2)
        tl.store(gz_ptr + (at * 2 + 1) * BLOCK_F + fcols, acc2_z)
    if NEED_DP:
        _store_param_grads(dp_ptr, db_ptr, at, acc_dp, acc_db, dcols, fcols, BLOCK_D, BLOCK_F, MAP)


@triton.jit
def _store_param_grads(dp_ptr, db_ptr, at, acc_dp, acc_db, dcols, fcols, BLOCK_D: tl.constexpr,
                       BLOCK_F: tl.constexpr, MAP: tl.constexpr):
    """One program's partial sums of the map's parameter gradients: d W (BLOCK_D, BLOCK_F) for hedgehog, d b or
    focused's d scale (BLOCK_F,)."""
    if MAP == HEDGEHOG:
        tl.store(dp_ptr + at * BLOCK_D * BLOCK_F + dcols[:, None] * BLOCK_F + fcols[None, :], acc_dp)
    tl.store(db_ptr + at * BLOCK_F + fcols, acc_db)


@triton.jit
def key_grads(k_ptr, v_ptr, mask_ptr, p_ptr, b_ptr, cos_ptr, sin_ptr, gs_ptr, gz_ptr, gc_ptr, dk_ptr, dv_ptr, dp_ptr,
              db_ptr,
              H, S, ksb, ksh, ksn, vsb, vsh, vsn, power,
              D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
              R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
              BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PARAM: tl.constexpr,
              NEED_DX: tl.constexpr, NEED_DP: tl.constexpr, TILES: tl.constexpr, CONST: tl.constexpr,
              PRECISION: tl.constexpr):
    """Program (g, p) over the TILES * BLOCK_N keys from p * TILES * BLOCK_N of head g: d rot(phi(k)) = v G^T,
    d phi(k) = g^T, d v = rot(phi(k)) G (plus the constant feature's row of G, CONST); zero for masked keys; the map's parameter gradients summed (NEED_DP)."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    k_base, v_base = k_ptr + b * ksb + h * ksh, v_ptr + b * vsb + h * vsh
    dcols, fcols, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    w, bias = _head_params(p_ptr, b_ptr, h, dcols, fcols, D, M, MAP, HAS_PARAM)
    gs, gz, gs2, gz2, gs_partner = _states(gs_ptr, gz_ptr, g, fcols, c, F, R, BLOCK_F, BLOCK_DV, MAP)
    acc_dp = tl.zeros((BLOCK_D, BLOCK_F), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK_F,), dtype=tl.float32)
    gc = tl.zeros((BLOCK_DV,), dtype=tl.float32)
    if CONST:
        gc = tl.load(gc_ptr + g * BLOCK_DV + c)
    for tile in range(TILES):
        rows = (p * TILES + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = rows < S
        keep = inside
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b * S + rows, mask=inside, other=1) == 0)
        v = _inputs(v_base, vsn, rows, S, keep, c, DV)
        plain, rotated, second = _features(k_base, ksn, rows, S, keep, p_ptr, w, bias, h, power, cos_ptr, sin_ptr,
                                           dcols, fcols, D, F, M, R, MAP, HAS_PARAM, PRECISION)
        dv = tl.dot(rotated, gs, input_precision=PRECISION)
        if MAP == HEDGEHOG:
            dv += tl.dot(second, gs2, input_precision=PRECISION)
        if CONST:
            dv += tl.where(keep[:, None], gc[None, :], 0.0)
        tl.store(dv_ptr + (g * S + rows[:, None]) * DV + c[None, :], dv, mask=inside[:, None] & (c[None, :] < DV))
        if NEED_DX or NEED_DP:
            d_rot = tl.dot(v, tl.trans(gs), input_precision=PRECISION)
            d_partner = d_rot
            if R > 0:
                d_partner = tl.dot(v, tl.trans(gs_partner), input_precision=PRECISION)
            d_second = tl.dot(v, tl.trans(gs2), input_precision=PRECISION) + gz2[None, :]
            d_w, d_b = _feature_grads(k_base, ksn, rows, S, keep, p_ptr, w, bias, h, power, cos_ptr, sin_ptr,
                                      dcols, fcols, d_rot, d_partner, tl.zeros_like(d_rot) + gz[None, :], d_second,
                                      dk_ptr, g * S + rows, D, F, M, R, MAP, HAS_PARAM, NEED_DX, PRECISION)
            acc_dp += d_w
            acc_db += d_b
    if NEED_DP:
        _store_param_grads(dp_ptr, db_ptr, g * tl.num_programs(1) + p, acc_dp, acc_db, dcols, fcols, BLOCK_D,
                           BLOCK_F, MAP)
