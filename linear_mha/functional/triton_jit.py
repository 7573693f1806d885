"""The @triton.jit kernels of ``triton_kernel.py`` (see there), imported on first use. Whether they run compiled or
in Triton's interpreter (``TRITON_INTERPRET=1``, as the tests run them on CPU tensors) is fixed when triton is
first imported in the process."""
import triton
import triton.language as tl


@triton.jit
def _phi(x, MAP: tl.constexpr):
    if MAP == 0:
        return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    return tl.maximum(x, 0.0)


@triton.jit
def _phi_grad(x, MAP: tl.constexpr):
    if MAP == 0:
        return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))
    return tl.where(x > 0, 1.0, 0.0)


TAYLOR_EPS = 1e-12  # F.normalize's


@triton.jit
def _features(x, cols, D: tl.constexpr, MAP: tl.constexpr):
    """The features of a (rows, BLOCK_D) tile of inputs (columns >= D are zero): elu/relu elementwise, or taylor's
    [x / |x|, 1] (the constant feature in column D: any order serves, as long as queries and keys share it)."""
    if MAP == 2:
        norm = tl.sqrt(tl.sum(x * x, axis=1))
        unit = x / tl.maximum(norm, TAYLOR_EPS)[:, None]
        return tl.where(cols[None, :] < D, unit, tl.where(cols[None, :] == D, 1.0, 0.0))
    return tl.where(cols[None, :] < D, _phi(x, MAP), 0.0)


@triton.jit
def _input_grad(x, d_phi, cols, D: tl.constexpr, MAP: tl.constexpr):
    """The gradient of the inputs x from d_phi, that of their features. taylor: with u = |x| > eps and x' = x / u,
    d x = (g - x' (x' . g)) / u for g the gradient of x'; below eps x' = x / eps and d x = g / eps."""
    if MAP == 2:
        g = tl.where(cols[None, :] < D, d_phi, 0.0)
        norm = tl.sqrt(tl.sum(x * x, axis=1))
        scale = tl.maximum(norm, TAYLOR_EPS)
        unit = x / scale[:, None]
        along = tl.sum(g * unit, axis=1)
        projected = tl.where((norm > TAYLOR_EPS)[:, None], g - unit * along[:, None], g)
        return projected / scale[:, None]
    return d_phi * _phi_grad(x, MAP)


@triton.jit
def _rows(base, stride_n, start, n, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) float32 tile of rows start.. of an (n, D) matrix, zeros outside; and its row mask."""
    rows = start + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < n) & (cols[None, :] < D)
    x = tl.load(base + rows[:, None] * stride_n + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    return x, rows < n


@triton.jit
def key_sums(k_ptr, v_ptr, mask_ptr, s_ptr, z_ptr, H, S,
              ksb, ksh, ksn, vsb, vsh, vsn,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_MASK: tl.constexpr, TILES: tl.constexpr,
             PRECISION: tl.constexpr):
    """Program (g, p): S_p = sum phi(k_j) v_j^T and z_p = sum phi(k_j) over the TILES * BLOCK_N keys from
    p * TILES * BLOCK_N of head g (a constexpr trip count: a loop bound given at run time is not one that every
    Triton version's interpreter reads)."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    k_base, v_base = k_ptr + b * ksb + h * ksh, v_ptr + b * vsb + h * vsh
    acc = tl.zeros((BLOCK_D, BLOCK_DV), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    cols = tl.arange(0, BLOCK_D)
    for tile in range(TILES):
        start = (p * TILES + tile) * BLOCK_N
        k, inside = _rows(k_base, ksn, start, S, D, BLOCK_N, BLOCK_D)
        v, _ = _rows(v_base, vsn, start, S, DV, BLOCK_N, BLOCK_DV)
        keep = inside
        if HAS_MASK:
            rows = start + tl.arange(0, BLOCK_N)
            padded = tl.load(mask_ptr + b * S + rows, mask=inside, other=1)
            keep = keep & (padded == 0)
        phi = tl.where(keep[:, None], _features(k, cols, D, MAP), 0.0)
        v = tl.where(keep[:, None], v, 0.0)  # a padded key's value may hold anything, NaN included: 0 * NaN = NaN
        acc += tl.dot(tl.trans(phi), v, input_precision=PRECISION)
        acc_z += tl.sum(phi, axis=0)
    out = (g * tl.num_programs(1) + p)
    f, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    tl.store(s_ptr + out * BLOCK_D * BLOCK_DV + f[:, None] * BLOCK_DV + c[None, :], acc)
    tl.store(z_ptr + out * BLOCK_D + f, acc_z)


@triton.jit
def queries(q_ptr, s_ptr, z_ptr, o_ptr, den_ptr, H, L, qsb, qsh, qsn,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, MAP: tl.constexpr, PRECISION: tl.constexpr):
    """Program (g, i): out rows i * BLOCK_M ... of head g = phi(q) S / phi(q) z (0 where phi(q) z = 0)."""
    g, i = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    start = i * BLOCK_M
    q, inside = _rows(q_ptr + b * qsb + h * qsh, qsn, start, L, D, BLOCK_M, BLOCK_D)
    cols = tl.arange(0, BLOCK_D)
    phi = _features(q, cols, D, MAP)
    f, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    s = tl.load(s_ptr + g * BLOCK_D * BLOCK_DV + f[:, None] * BLOCK_DV + c[None, :])
    z = tl.load(z_ptr + g * BLOCK_D + f)
    num = tl.dot(phi, s, input_precision=PRECISION)
    den = tl.sum(phi * z[None, :], axis=1)
    den = tl.where(den == 0.0, 1.0, den)
    out = num / den[:, None]
    rows = start + tl.arange(0, BLOCK_M)
    tl.store(o_ptr + (g * L + rows[:, None]) * DV + c[None, :], out.to(o_ptr.dtype.element_ty),
             mask=inside[:, None] & (c[None, :] < DV))
    tl.store(den_ptr + g * L + rows, den, mask=inside)


@triton.jit
def query_grads(q_ptr, s_ptr, z_ptr, o_ptr, den_ptr, go_ptr, dq_ptr, gs_ptr, gz_ptr, H, L,
                 qsb, qsh, qsn,
                 D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, MAP: tl.constexpr, NEED_DQ: tl.constexpr, TILES: tl.constexpr,
                PRECISION: tl.constexpr):
    """Program (g, p) over the TILES * BLOCK_M queries from p * TILES * BLOCK_M: with r = [go / den, -(go . out) / den],
    d q = (r_v S^T + r_z z^T) phi'(q), and the partial G_p = sum phi(q)^T r_v, g_p = sum phi(q) r_z."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    f, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    s = tl.load(s_ptr + g * BLOCK_D * BLOCK_DV + f[:, None] * BLOCK_DV + c[None, :])
    z = tl.load(z_ptr + g * BLOCK_D + f)
    acc = tl.zeros((BLOCK_D, BLOCK_DV), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for tile in range(TILES):
        start = (p * TILES + tile) * BLOCK_M
        q, inside = _rows(q_ptr + b * qsb + h * qsh, qsn, start, L, D, BLOCK_M, BLOCK_D)
        go, _ = _rows(go_ptr + g * L * DV, DV, start, L, DV, BLOCK_M, BLOCK_DV)
        out, _ = _rows(o_ptr + g * L * DV, DV, start, L, DV, BLOCK_M, BLOCK_DV)
        rows = start + tl.arange(0, BLOCK_M)
        den = tl.load(den_ptr + g * L + rows, mask=inside, other=1.0)
        r_v = go / den[:, None]
        r_z = -tl.sum(go * out, axis=1) / den
        phi = tl.where(inside[:, None], _features(q, f, D, MAP), 0.0)
        acc += tl.dot(tl.trans(phi), r_v, input_precision=PRECISION)
        acc_z += tl.sum(phi * r_z[:, None], axis=0)
        if NEED_DQ:
            d_phi = tl.dot(r_v, tl.trans(s), input_precision=PRECISION) + r_z[:, None] * z[None, :]
            dq = _input_grad(q, d_phi, f, D, MAP)
            tl.store(dq_ptr + (g * L + rows[:, None]) * D + f[None, :], dq,
                     mask=inside[:, None] & (f[None, :] < D))
    out_index = g * tl.num_programs(1) + p
    tl.store(gs_ptr + out_index * BLOCK_D * BLOCK_DV + f[:, None] * BLOCK_DV + c[None, :], acc)
    tl.store(gz_ptr + out_index * BLOCK_D + f, acc_z)


@triton.jit
def key_grads(k_ptr, v_ptr, mask_ptr, gs_ptr, gz_ptr, dk_ptr, dv_ptr, H, S, ksb, ksh, ksn, vsb, vsh, vsn,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_MASK: tl.constexpr,
              PRECISION: tl.constexpr):
    """Program (g, j): for keys j * BLOCK_N ... of head g, d phi(k) = v G^T + g^T, d k = d phi(k) phi'(k),
    d v = phi(k) G; zero for masked keys."""
    g, j = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    start = j * BLOCK_N
    k, inside = _rows(k_ptr + b * ksb + h * ksh, ksn, start, S, D, BLOCK_N, BLOCK_D)
    v, _ = _rows(v_ptr + b * vsb + h * vsh, vsn, start, S, DV, BLOCK_N, BLOCK_DV)
    rows = start + tl.arange(0, BLOCK_N)
    keep = inside
    if HAS_MASK:
        padded = tl.load(mask_ptr + b * S + rows, mask=inside, other=1)
        keep = keep & (padded == 0)
    f, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    gs = tl.load(gs_ptr + g * BLOCK_D * BLOCK_DV + f[:, None] * BLOCK_DV + c[None, :])
    gz = tl.load(gz_ptr + g * BLOCK_D + f)
    phi = tl.where(keep[:, None], _features(k, f, D, MAP), 0.0)
    d_phi = tl.dot(v, tl.trans(gs), input_precision=PRECISION) + gz[None, :]
    dk = tl.where(keep[:, None], _input_grad(k, d_phi, f, D, MAP), 0.0)
    dv = tl.dot(phi, gs, input_precision=PRECISION)
    tl.store(dk_ptr + (g * S + rows[:, None]) * D + f[None, :], dk, mask=inside[:, None] & (f[None, :] < D))
    tl.store(dv_ptr + (g * S + rows[:, None]) * DV + c[None, :], dv, mask=inside[:, None] & (c[None, :] < DV))
