"""2-D rotary position on the token grid inside kernel attention (MLLA, RALA, MALA): the features of queries and keys
are rotated by their grid position in the numerator only,

    out_i = sum_j (R_i phi(q_i)) . (R_j phi(k_j)) alpha_j v_j  /  sum_j phi(q_i) . phi(k_j) alpha_j,

so the weights depend on relative position (R_i^T R_j = R_{j - i}) while the normaliser stays the positive kernel's.
The last R = 4·floor(F/4) features are rotated in R/2 pairs (feature F - R + m with F - R/2 + m), the first half of
the pairs by the row y and the second by the column x, at frequencies base^(-m / P) for P pairs per axis (taylor's constant feature comes first and stays as it
is); prefix tokens (a class token) sit at no position and are not rotated. alpha: optional key weights
(``key_reweight``), 1 without. Non-causal: an image's grid has no order. O(N F d).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import backend, native, triton_kernel
from ._common import check_qkv, compute_dtype, drop_keys, has_tangent, mask_keys, outside_autocast, safe_normaliser
from .feature_maps import FeatureMap, apply_feature_map
from .kernel import compiled_features

ROPE_BASE = 10000.0


def grid_angles(height: int, width: int, prefix: int, pairs_per_axis: int, base: float = ROPE_BASE,
                device=None, dtype=torch.float32) -> Tensor:
    """(prefix + height * width, 2 * pairs_per_axis) rotation angles: y * f_m then x * f_m; zero for prefix tokens."""
    freq = base ** (-torch.arange(pairs_per_axis, device=device, dtype=dtype) / max(pairs_per_axis, 1))
    # Rows and columns broadcast, then flattened: repeat_interleave / repeat by a symbolic width exports to an ONNX
    # graph that onnxruntime cannot run (an Expand of the wrong shape), which this form does not.
    y = torch.arange(height, device=device, dtype=dtype)[:, None].expand(height, width).reshape(-1)
    x = torch.arange(width, device=device, dtype=dtype)[None, :].expand(height, width).reshape(-1)
    angles = torch.cat([y[:, None] * freq, x[:, None] * freq], dim=1)
    return torch.cat([angles.new_zeros(prefix, angles.shape[1]), angles])


def sequence_tables(length: int, features: int, like: Tensor, base: float = ROPE_BASE) -> Tuple[Tensor, Tensor]:
    """1-D rotary position (RoFormer) for rows of ``features``: the (cos, sin) tables, (length, 2 P) with
    P = features // 2 pairs, of position n at frequencies base^(-m / P), for ``rotate``."""
    pairs = features // 2
    freq = base ** (-torch.arange(pairs, device=like.device, dtype=like.dtype) / max(pairs, 1))
    angles = torch.arange(length, device=like.device, dtype=like.dtype)[:, None] * freq
    return tuple(t.contiguous() for t in rotation_tables(angles))


def rotation_tables(angles: Tensor) -> Tuple[Tensor, Tensor]:
    """(cos, sin), each (N, 2 P) for angles (N, P): the factors of ``rotate``'s two halves."""
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def grid_tables(grid: Tuple[int, int, int], features: int, like: Tensor) -> Tuple[Tensor, Tensor]:
    """The contiguous (cos, sin) tables of grid (height, width, prefix)'s positions for rows of ``features``
    features, in like's device and dtype: what ``rotate`` and the compiled code read."""
    angles = grid_angles(*grid, features // 4, device=like.device, dtype=like.dtype)
    return tuple(t.contiguous() for t in rotation_tables(angles))


def rotate(features: Tensor, angles: Optional[Tensor], tables: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """features (B, H, N, F) with their last R = 2 * angles.shape[-1] features rotated by angles (N, R / 2): feature
    F - R + m pairs with feature F - R / 2 + m at angle m ("rotate half", one negation and one concatenation instead
    of a gather per pair: the rotation's own cost is what an image-sized call pays). ``tables``: from
    ``rotation_tables(angles)`` (or ``grid_tables``), made once for several calls; angles may then be None."""
    cos, sin = tables if tables is not None else rotation_tables(angles)
    rotated = cos.shape[-1]
    if rotated == 0:
        return features
    kept, turned = features[..., :-rotated], features[..., -rotated:]
    first, second = turned[..., :rotated // 2], turned[..., rotated // 2:]
    turned = turned * cos.to(features.dtype) + torch.cat([-second, first], -1) * sin.to(features.dtype)
    return torch.cat([kept, turned], -1) if kept.shape[-1] else turned


def rotated_product(phi_q: Tensor, phi_k: Tensor, v: Tensor, grid: Tuple[int, int, int]) -> Tensor:
    """(R_i phi_q_i) . sum_j (R_j phi_k_j) v_j for every query: phi_q, phi_k (B, H, N, F), v (B, H, N, Dv) ->
    (B, H, N, Dv), the rotations by the positions of grid (height, width, prefix), in O(N F Dv)."""
    tables = grid_tables(grid, phi_q.shape[-1], phi_q)
    return rotate(phi_q, None, tables) @ (rotate(phi_k, None, tables).transpose(-1, -2) @ v)


@outside_autocast
def grid_rope_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMap,
    grid: Tuple[int, int, int],
    *,
    key_padding_mask: Optional[Tensor] = None,
    key_weights: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    projection: Optional[Tensor] = None,
) -> Tensor:
    """q, k (B, H, N, D), v (B, H, N, Dv) -> (B, H, N, Dv), N = prefix + height * width for grid (height, width,
    prefix). key_padding_mask bool (B, N), True = ignore; key_weights (B, H, N) or None. Self-attention only."""
    check_qkv(q, k, v, key_padding_mask)
    height, width, prefix = grid
    if q.shape[2] != k.shape[2] or k.shape[2] != prefix + height * width:
        raise ValueError(f"grid rope needs self-attention over the grid's {prefix + height * width} tokens "
                         f"({height} x {width} + {prefix} prefix); got {q.shape[2]} queries and {k.shape[2]} keys")
    chosen = backend.rope_backend(q, k, v, feature_map, key_weights).backend
    if chosen == backend.TRITON:  # half inputs as they are: the kernels accumulate in float32
        tables = grid_tables(grid, native.feature_count(feature_map, q.shape[-1]), q.new_empty((), dtype=torch.float32))
        return triton_kernel.kernel_attention(q, k, drop_keys(v, dropout_p), feature_map, key_padding_mask,
                                              rope_tables=tables)
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), drop_keys(v.to(dtype), dropout_p)
    if chosen == backend.NATIVE:  # the compiled code makes the features from q and k
        tables = grid_tables(grid, native.feature_count(feature_map, q.shape[-1]), q)
        return native.kernel_attention(q, k, v, feature_map, key_padding_mask, rope_tables=tables).to(out_dtype)
    phi_q, phi_k = apply_feature_map(feature_map, q, k, key_padding_mask=key_padding_mask, projection=projection)
    if key_weights is not None:
        phi_k = phi_k * key_weights[..., None].to(dtype)
    if chosen == backend.NATIVE_FEATURES and not has_tangent(phi_q, phi_k):  # a map's own parameters' tangents
        phi_q, phi_k = compiled_features(phi_q, phi_k, feature_map)               # take PyTorch ops below
        tables = grid_tables(grid, phi_q.shape[-1], q)
        return native.kernel_attention(phi_q, phi_k, v, None, key_padding_mask, rope_tables=tables).to(out_dtype)
    numerator = rotated_product(phi_q, phi_k, mask_keys(v, key_padding_mask), grid)  # (B, H, N, Dv)
    normaliser = phi_q @ phi_k.sum(2, keepdim=True).transpose(-1, -2)                  # (B, H, N, 1)
    # A query whose normaliser is 0 sees no key with a non-zero feature: the rotated numerator, which the positive
    # normaliser does not bound, could still be non-zero there; such a query gets 0 as in every kernel method.
    out = (numerator / safe_normaliser(normaliser)).masked_fill(normaliser == 0, 0.0)
    return out.to(out_dtype)
