"""Kernel attention whose weights keep the query's magnitude: two normalisations that subtract instead of (only)
dividing, so the sharpness of a row is not thrown away. With s_ij = phi(q_i).phi(k_j) over the N_i keys query i
sees, S_i = sum_j s_ij and the mean value v̄_i:

    form="inline"     (InLine attention, Han et al. 2024)  w_ij = 1/N_i + (s_ij - S_i/N_i) / N_i
                      out_i = v̄_i + (A_i - S_i v̄_i) / N_i
    form="magnitude"  (MALA, Fan et al. 2025)              w_ij = (1 + 1/S_i) s_ij - S_i/N_i
                      out_i = (1 + 1/S_i) A_i - S_i v̄_i,  with s_ij = phi(q_i).phi(k_j) / (N_i sqrt(D))

where A_i = sum_j s_ij v_j. Every row sums to 1 and weights may be negative. MALA's similarities are divided by
N_i sqrt(D) (as its published layer scales them), so S_i = phi(q_i).mean_j phi(k_j) / sqrt(D) does not grow with the
number of keys: without that, the term S_i (A_i/S_i - v̄_i) grows with N and a detector trained with it did not
learn (0.02 AP where the divided kernel reached 0.27). InLine's weights are injective in the
similarities (softmax's are, a divided kernel's are not: scaling q leaves them unchanged); with the identity map
they are the first-order expansion of softmax around the uniform row, 1/N + (x_j - x̄)/N for logits x = q.k/sqrt(d).
MALA's deviation from the plain divided kernel grows with S_i, i.e. with |phi(q_i)|.

Both come from one product phi(q) (phi(k)ᵀ [v, 1]) = [A, S] (chunked when causal) and the sums of [v, 1] over the
keys each query sees, so they cost what kernel attention costs, O(N F d).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._common import (append_ones, check_qkv, compute_dtype, drop_keys, mask_keys, outside_autocast,
                      safe_normaliser)
from .feature_maps import FeatureMap, apply_feature_map
from . import backend
from .grid_rope import grid_rope_kernel, rotated_product
from .kernel import CHUNK_SIZE, causal_linear_product

FORMS = ("inline", "magnitude")
POSITIVE_MAPS = ("elu", "taylor2")  # every phi(q).phi(k) > 0: A_i = S_i (A_i / S_i) is exact wherever a key is seen


def identity_feature_map(x: Tensor) -> Tensor:
    """x / d^(1/4): phi(q).phi(k) = q.k / sqrt(d), softmax's logit. (..., d) -> (..., d); signed."""
    return x * x.shape[-1] ** -0.25


def resolve_map(feature_map: FeatureMap) -> FeatureMap:
    return identity_feature_map if feature_map == "identity" else feature_map


@outside_autocast
def centred_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMap = "identity",
    *,
    form: str = "inline",
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    extra_keys: Optional[Tuple[Tensor, Tensor]] = None,
    chunk_size: Optional[int] = None,
    grid: Optional[Tuple[int, int, int]] = None,
) -> Tensor:
    """q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) -> (B, H, L, Dv), in q's dtype.

    feature_map: "identity" (q.k / sqrt(D); "inline" only), or any map ``kernel`` takes except "favor".
    form: "inline" | "magnitude" (see the module docstring). key_padding_mask: bool (B, S), True = ignore: masked
    keys count in neither the sums nor N. causal: query i sees keys j <= i (L == S). A query that sees no key gets 0.
    dropout_p: key dropout on the values (``_common.drop_keys``).
    extra_keys: (k (B, H, n, D), v (B, H, n, Dv)) of keys every query sees, never masked (add_bias_kv /
    add_zero_attn); with ``causal`` they come before the first position. chunk_size: of the causal product.
    grid: (height, width, prefix) of a self-attention call over an image's tokens: A_i's similarities get the 2-D
    rotary position of ``grid_rope`` (numerator only, as MALA's layer does); S_i, N_i and v̄_i stay as they are.
    """
    check_qkv(q, k, v, key_padding_mask)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if feature_map == "favor":
        raise ValueError("centred_kernel takes an elementwise feature map; 'favor' needs a projection: use kernel()")
    if form == "magnitude" and feature_map == "identity":
        raise ValueError("form='magnitude' divides by S_i = phi(q_i).sum_j phi(k_j), which must stay positive: give "
                         "it a non-negative feature_map such as 'elu' (MALA's), not 'identity'")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got L={q.shape[-2]}, S={k.shape[-2]}")
    if grid is not None and (causal or extra_keys is not None or q.shape[-2] != k.shape[-2]
                             or k.shape[-2] != grid[2] + grid[0] * grid[1]):
        raise ValueError(f"grid (rotary position) needs non-causal self-attention over the grid's "
                         f"{grid[2] + grid[0] * grid[1]} tokens and no extra keys; got L={q.shape[-2]}, "
                         f"S={k.shape[-2]}, causal={causal}, extra keys: {extra_keys is not None}")
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), drop_keys(v.to(dtype), dropout_p)
    phi_q, phi_k = apply_feature_map(resolve_map(feature_map), q, k, key_padding_mask=key_padding_mask,
                                     causal=causal)
    v1 = mask_keys(append_ones(v), key_padding_mask)  # [v, 1] of the seen keys: their sum is [sum v, N]
    if extra_keys is not None:
        extra_k, extra_v1 = extra_keys[0].to(dtype), append_ones(extra_keys[1].to(dtype))
        phi_extra = apply_feature_map(resolve_map(feature_map), extra_k, extra_k)[1]
        if not causal:  # interchangeable with the sequence's keys
            phi_k, v1 = torch.cat([phi_k, phi_extra], 2), torch.cat([v1, extra_v1], 2)
    if causal and q.shape[-2] > 0:
        start = None if extra_keys is None else phi_extra.transpose(-1, -2) @ extra_v1  # (B, H, F, Dv + 1)
        num_den = causal_linear_product(phi_q, phi_k, v1, start, chunk_size or CHUNK_SIZE)  # [A_i, S_i]
        sums = v1.cumsum(2)                                  # (B, H, N, Dv + 1): [sum_{j<=i} v_j, N_i]
        if extra_keys is not None:
            sums = sums + extra_v1.sum(2, keepdim=True)
    elif grid is not None:  # A_i from rotated features, S_i from the plain ones
        s = phi_q @ phi_k.sum(2, keepdim=True).transpose(-1, -2)               # (B, H, L, 1)
        sums = v1.sum(2, keepdim=True)
        if feature_map in POSITIVE_MAPS and backend.rope_backend(q, k, v, feature_map).backend == backend.NATIVE:
            # The compiled rope kernel gives A_i / S_i (every s_ij > 0, so S_i > 0 wherever a key is seen), and
            # both forms are that divided output moved away from the mean value in proportion to S_i:
            #   inline    v̄ + (S/N) (A/S - v̄),    magnitude  A/S + S/(N sqrt(D)) (A/S - v̄)
            # a handful of row-wise ops where forming A and S first would take twice as many
            divided = grid_rope_kernel(q, k, v, feature_map, grid, key_padding_mask=key_padding_mask)
            return _moved_from_mean(divided, s, sums, form, q.shape[-1]).to(out_dtype)
        num_den = torch.cat([rotated_product(phi_q, phi_k, v1[..., :-1], grid), s], -1)
    else:
        num_den = phi_q @ (phi_k.transpose(-1, -2) @ v1)     # (B, H, L, Dv + 1)
        sums = v1.sum(2, keepdim=True)                       # (B, H, 1, Dv + 1)
    a, s = num_den[..., :-1], num_den[..., -1:]
    count = sums[..., -1:]
    v_mean = sums[..., :-1] / safe_normaliser(count)
    if form == "inline":
        out = v_mean + (a - s * v_mean) / safe_normaliser(count)
    else:
        scale = safe_normaliser(count) * q.shape[-1] ** 0.5  # MALA's s_ij = phi(q_i).phi(k_j) / (N_i sqrt(D))
        a, s = a / scale, s / scale
        out = a + a / safe_normaliser(s) - s * v_mean
    return out.masked_fill(count == 0, 0.0).to(out_dtype)


def _moved_from_mean(divided: Tensor, s: Tensor, sums: Tensor, form: str, d: int) -> Tensor:
    """The centred output from the divided kernel's A_i / S_i (B, H, L, Dv), S_i (B, H, L, 1) and the sums
    [sum v, N] (B, H, 1, Dv + 1) of the keys every query sees."""
    count = sums[..., -1:]
    v_mean = sums[..., :-1] / safe_normaliser(count)
    weight = s / safe_normaliser(count) if form == "inline" else s / (safe_normaliser(count) * d ** 0.5)
    # where no key is seen, divided, S_i and the sums are all 0, and so is this
    return (v_mean if form == "inline" else divided) + weight * (divided - v_mean)
