"""Hedgehog (Zhang et al., "The Hedgehog & the Porcupine", ICLR 2024): kernel attention with a learnable feature
map per head, trained so linear attention's weights match softmax's (``linear_mha.calibrate``):

    phi(x) = [softmax(x W + b), softmax(-(x W + b))]   (each softmax over the m features; 2m features in all)

W (d x m) starts as the identity (m = d), so before training the map is a fixed spiky, positive map. Queries and
keys have maps of their own. Features are positive and bounded, so every normaliser is positive and nothing
overflows, in any precision.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import backend, native, native_maps, triton_kernel
from .hedgehog_map import HedgehogMap, Map
from ._common import check_qkv, compute_dtype, drop_keys, mask_keys, outside_autocast
from .kernel import check_state, check_chunk_size
from .kernel import feature_attention
from .sliding_window import sliding_window_linear



def _check_weight(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 3 or weight.shape[0] != x.shape[1] or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"the feature map's weight must have shape (heads, head_dim, m) = ({x.shape[1]}, "
                         f"{x.shape[-1]}, m), got {tuple(weight.shape)}")


def hedgehog_features(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x (B, H, N, d), weight (H, d, m), bias (H, m) -> (B, H, N, 2m)."""
    _check_weight(x, weight)
    z = torch.einsum("bhnd,hdm->bhnm", x, weight.to(x.dtype))
    if bias is not None:
        bias = bias.to(x.dtype)
    if backend.hedgehog_map_backend(z, bias).backend == backend.NATIVE:
        return native_maps.hedgehog_map(z.contiguous(), None if bias is None else bias.contiguous())
    if bias is not None:
        z = z + bias[None, :, None, :]
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


@outside_autocast
def hedgehog(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_map: Map,
    k_map: Map,
    *,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    initial_state: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    window: Optional[Tuple[int, Tensor]] = None,
) -> Tensor:
    """Hedgehog attention: q (B, H, L, d), k (B, H, S, d), v (B, H, S, Dv) -> (B, H, L, Dv); q_map / k_map:
    (weight (H, d, m), bias (H, m) or None). Masks, causality (chunked, O(N d) memory), dropout and initial_state
    (B, H, 2m, Dv + 1) as in ``kernel``. window: (w, mix (H,) in [0, 1]) for LoLCATs' hybrid, exact softmax over
    the keys at most w positions away (``sliding_window_linear``; self-attention only)."""
    check_qkv(q, k, v, key_padding_mask)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got L={q.shape[-2]}, S={k.shape[-2]}")
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    causal = causal and q.shape[-2] > 0
    _check_weight(q, q_map[0])
    _check_weight(k, k_map[0])
    windowed = window is not None and window[0] > 0
    chosen = backend.hedgehog_backend(q, k, v, q_map, k_map, causal=causal, initial_state=initial_state,
                                      window=windowed).backend
    if chosen == backend.TRITON:
        check_state(initial_state, 2 * q_map[0].shape[-1], v)
        return triton_kernel.hedgehog_attention(q, k, drop_keys(v, dropout_p), q_map, k_map, key_padding_mask,
                                                initial_state)
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), drop_keys(v.to(dtype), dropout_p)
    if chosen == backend.NATIVE:  # the maps inside the compiled kernels; they skip masked keys themselves
        check_state(initial_state, 2 * q_map[0].shape[-1], v)
        state = None if initial_state is None else initial_state.to(dtype)
        return native.kernel_attention(q, k, v, HedgehogMap(q_map, k_map), key_padding_mask, state,
                                       causal).to(out_dtype)
    phi_q = hedgehog_features(q, *q_map)
    # Masked keys are zeroed before the map (garbage reaches nothing) and their features after it (they add nothing).
    phi_k = mask_keys(hedgehog_features(mask_keys(k, key_padding_mask), *k_map), key_padding_mask)
    v = mask_keys(v, key_padding_mask)
    if initial_state is not None:
        initial_state = initial_state.to(dtype)
    if windowed:
        return sliding_window_linear(q, mask_keys(k, key_padding_mask), v, phi_q, phi_k, window=window[0],
                                     mix=window[1], causal=causal, key_padding_mask=key_padding_mask,
                                     initial_state=initial_state, chunk_size=chunk_size).to(out_dtype)
    return feature_attention(phi_q, phi_k, v, causal=causal, initial_state=initial_state,
                             chunk_size=chunk_size).to(out_dtype)


@outside_autocast
def hedgehog_state(k: Tensor, v: Tensor, k_map: Map, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """sum_j phi(k_j) [v_j, 1]^T of a set of keys (B, H, 2m, Dv + 1): extra keys every query sees, for causal
    attention's initial_state."""
    dtype = compute_dtype(k.dtype)
    phi_k = mask_keys(hedgehog_features(mask_keys(k.to(dtype), key_padding_mask), *k_map), key_padding_mask)
    v1 = torch.nn.functional.pad(mask_keys(v.to(dtype), key_padding_mask), (0, 1), value=1.0)
    return torch.matmul(phi_k.transpose(-2, -1), v1)
