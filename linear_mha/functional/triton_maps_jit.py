"""What the kernels of ``triton_jit.py`` do to each row: load it, make its features (elu, relu, taylor, focused,
hedgehog's pair of softmaxes), turn them by rotary position, and carry gradients back through all of that.

Feature column c of a tile reads input column c. taylor's constant feature, the first of its d + 1 in the
reference order of ``feature_maps``, is kept out of the tiles (CONST): its state row is the sum of the kept keys'
values and its normaliser their count, so its tiles stay d wide (d + 1 would pad them to twice that). hedgehog's 2m
features are two tiles, softmax(z) and softmax(-z), each with a state of its own. ``triton_kernel`` turns these
parts into the reference layout of a state (F, Dv + 1), so states and initial states mean the same on every path.
Rotary position (``grid_rope``) turns feature c with its partner column. Where every column of the tile turns
(SWAP: R equals the tile's power-of-two width, as at head sizes 16, 32, 64, 128), the partner of column c is
c +- width / 2, so the partner features are the tile with its halves swapped in registers, and the partner's gradient
the gradient tile swapped likewise: nothing is loaded or multiplied twice. Otherwise the partner's features come
from a second load of the inputs with the columns permuted, and its gradient from a second product with the state's
rows permuted.
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
def _swap_halves(t):
    """t (rows, width) with its two column halves exchanged: column c holds t[:, (c + width / 2) % width]."""
    rows, width = t.shape[0], t.shape[1]
    first, second = tl.split(tl.permute(tl.reshape(t, (rows, 2, width // 2)), (0, 2, 1)))
    return tl.reshape(tl.permute(tl.join(second, first), (0, 2, 1)), (rows, width))


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
              D: tl.constexpr, F: tl.constexpr, M: tl.constexpr, R: tl.constexpr, SWAP: tl.constexpr,
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
        if SWAP:
            other = _swap_halves(plain)
        else:
            partner = _partner(fcols, F, R)
            x_partner = _inputs(base, stride_n, rows, n, keep, partner, D)
            other = tl.where(keep[:, None], _point_features(x_partner, partner, p_ptr, h, power, D, MAP, HAS_PARAM),
                             0.0)
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
