"""The @triton.jit kernels of ``triton_kernel.py`` (see there), imported on first use: the keys' sums, the queries'
outputs, and the two backward passes. What they do to each row (load it, make its features, rotate them) is in
``triton_maps_jit.py``. Whether they run compiled or in Triton's interpreter (``TRITON_INTERPRET=1``, as the tests
run them on CPU tensors) is fixed when triton is first imported in the process.
"""
import triton
import triton.language as tl

from .triton_maps_jit import (HEDGEHOG, _feature_grads, _features, _head_params, _inputs, _load, _partner,
                              _swap_halves)


@triton.jit
def key_sums(k_ptr, v_ptr, mask_ptr, p_ptr, b_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, c_ptr, cz_ptr, H, S,
             ksb, ksh, ksn, vsb, vsh, vsn, power,
             D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
             R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
             BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PARAM: tl.constexpr,
             TILES: tl.constexpr, CONST: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr):
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
                                           dcols, fcols, D, F, M, R, SWAP, MAP, HAS_PARAM, PRECISION)
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
def _states(s_ptr, z_ptr, g, fcols, c, F: tl.constexpr, R: tl.constexpr, SWAP: tl.constexpr,
            BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, MAP: tl.constexpr):
    """What a backward pass reads of head g's state (or of G): (S, z) of the first half, of hedgehog's second (the
    first again otherwise), and S with its rows permuted to the partner features (rotary position without SWAP; S
    otherwise)."""
    s, z = _state(s_ptr, z_ptr, g, 0, fcols, fcols, c, BLOCK_F, BLOCK_DV, MAP)
    s2, z2 = s, z
    if MAP == HEDGEHOG:
        s2, z2 = _state(s_ptr, z_ptr, g, 1, fcols, fcols, c, BLOCK_F, BLOCK_DV, MAP)
    s_partner = s
    if R > 0 and not SWAP:
        s_partner, _ = _state(s_ptr, z_ptr, g, 0, _partner(fcols, F, R), fcols, c, BLOCK_F, BLOCK_DV, MAP)
    return s, z, s2, z2, s_partner


@triton.jit
def queries(q_ptr, p_ptr, b_ptr, cos_ptr, sin_ptr, s_ptr, z_ptr, c_ptr, cz_ptr, o_ptr, den_ptr, H, L, qsb, qsh, qsn,
            power,
            D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, M: tl.constexpr,
            R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
            BLOCK_DV: tl.constexpr, MAP: tl.constexpr, HAS_PARAM: tl.constexpr, CONST: tl.constexpr,
            PRECISION: tl.constexpr, SWAP: tl.constexpr):
    """Program (g, i): out rows i * BLOCK_M ... of head g = rot(phi(q)) S / phi(q) z (0 where phi(q) z = 0), the
    constant feature's row and count added (CONST)."""
    g, i = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = rows < L
    dcols, fcols, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    w, bias = _head_params(p_ptr, b_ptr, h, dcols, fcols, D, M, MAP, HAS_PARAM)
    plain, rotated, second = _features(q_ptr + b * qsb + h * qsh, qsn, rows, L, inside, p_ptr, w, bias, h, power,
                                       cos_ptr, sin_ptr, dcols, fcols, D, F, M, R, SWAP, MAP, HAS_PARAM, PRECISION)
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
                NEED_DP: tl.constexpr, TILES: tl.constexpr, CONST: tl.constexpr, PRECISION: tl.constexpr,
                SWAP: tl.constexpr):
    """Program (g, p) over the TILES * BLOCK_M queries from p * TILES * BLOCK_M: with r = [go / den, -(go . out) / den],
    the partial G_p = sum rot(phi(q))^T r_v and g_p = sum phi(q) r_z (CONST: the constant feature's, sum r_v and
    sum r_z); d q from d rot(phi(q)) = r_v S^T and
    d phi(q) = r_z z (NEED_DX), and the map's parameter gradients summed over the tiles (NEED_DP)."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    q_base = q_ptr + b * qsb + h * qsh
    dcols, fcols, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    w, bias = _head_params(p_ptr, b_ptr, h, dcols, fcols, D, M, MAP, HAS_PARAM)
    s, z, s2, z2, s_partner = _states(s_ptr, z_ptr, g, fcols, c, F, R, SWAP, BLOCK_F, BLOCK_DV, MAP)
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
                                           dcols, fcols, D, F, M, R, SWAP, MAP, HAS_PARAM, PRECISION)
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
            if SWAP:
                d_partner = _swap_halves(d_rot)
            elif R > 0:
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
              PRECISION: tl.constexpr, SWAP: tl.constexpr):
    """Program (g, p) over the TILES * BLOCK_N keys from p * TILES * BLOCK_N of head g: d rot(phi(k)) = v G^T,
    d phi(k) = g^T, d v = rot(phi(k)) G (plus the constant feature's row of G, CONST); zero for masked keys; the map's parameter gradients summed (NEED_DP)."""
    g, p = tl.program_id(0), tl.program_id(1)
    b, h = g // H, g % H
    k_base, v_base = k_ptr + b * ksb + h * ksh, v_ptr + b * vsb + h * vsh
    dcols, fcols, c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_DV)
    w, bias = _head_params(p_ptr, b_ptr, h, dcols, fcols, D, M, MAP, HAS_PARAM)
    gs, gz, gs2, gz2, gs_partner = _states(gs_ptr, gz_ptr, g, fcols, c, F, R, SWAP, BLOCK_F, BLOCK_DV, MAP)
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
                                           dcols, fcols, D, F, M, R, SWAP, MAP, HAS_PARAM, PRECISION)
        dv = tl.dot(rotated, gs, input_precision=PRECISION)
        if MAP == HEDGEHOG:
            dv += tl.dot(second, gs2, input_precision=PRECISION)
        if CONST:
            dv += tl.where(keep[:, None], gc[None, :], 0.0)
        tl.store(dv_ptr + (g * S + rows[:, None]) * DV + c[None, :], dv, mask=inside[:, None] & (c[None, :] < DV))
        if NEED_DX or NEED_DP:
            d_rot = tl.dot(v, tl.trans(gs), input_precision=PRECISION)
            d_partner = d_rot
            if SWAP:
                d_partner = _swap_halves(d_rot)
            elif R > 0:
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
