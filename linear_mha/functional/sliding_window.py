"""Sliding-window softmax plus linear attention (LoLCATs, Zhang et al. 2024): each query attends to the keys at most
``window`` positions away with softmax's own weights, and to every other key through a feature map, under one
normaliser:

    y_i = (f sum_{j near i} e_ij v_j + (1 - f) sum_{j far} phi(q_i).phi(k_j) v_j)
          / (f sum_{j near i} e_ij + (1 - f) sum_{j far} phi(q_i).phi(k_j)),      e_ij = exp(q_i.k_j / sqrt(d) - m_i)

with m_i the largest near score of query i and f in [0, 1] a mix per head. Near: |i - j| <= window (causal:
i - window <= j <= i). A converted model keeps softmax exactly where most of its attention mass is (nearby
tokens, for text) and pays O(N * window * d) for it; far keys stay O(N m d).
"""
from typing import Optional

import torch
from torch import Tensor

from ._common import append_ones, normalise
from .kernel import causal_linear_product
from .kernel import key_value_sums


def _bands(x: Tensor, window: int, causal: bool) -> Tensor:
    """x (B, H, N, D) -> (B, H, N, W, D): row i holds positions i - window .. i (+ window unless causal), zeros past
    either end. W = window + 1 causal, 2 window + 1 otherwise."""
    after = 0 if causal else window
    padded = torch.nn.functional.pad(x, (0, 0, window, after))
    return padded.unfold(2, window + 1 + after, 1).transpose(-1, -2)


def _near_keys(n: int, window: int, causal: bool, key_padding_mask: Optional[Tensor], device) -> Tensor:
    """Which band entries are real, unmasked keys: (B or 1, 1, N, W) bool."""
    after = 0 if causal else window
    offsets = torch.arange(-window, after + 1, device=device)
    position = torch.arange(n, device=device)[:, None] + offsets  # (N, W): the key each band entry holds
    inside = (position >= 0) & (position < n)
    if key_padding_mask is None:
        return inside[None, None]
    kept = ~key_padding_mask[:, position.clamp(0, n - 1)]  # (B, N, W)
    return (inside & kept)[:, None]


def sliding_window_linear(q: Tensor, k: Tensor, v: Tensor, phi_q: Tensor, phi_k: Tensor, *, window: int,
                          mix: Tensor, causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                          initial_state: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
    """q, k (B, H, N, d); v (B, H, N, Dv), masked keys' rows zero; phi_q, phi_k (B, H, N, F) non-negative, masked
    keys' rows zero; mix (H,) in [0, 1], the weight of the softmax terms -> (B, H, N, Dv). Self-attention only
    (as many queries as keys: windows are positions along one sequence). initial_state (B, H, F, Dv + 1): extra
    keys every query sees, far keys of everyone."""
    n = q.shape[-2]
    if k.shape[-2] != n:
        raise ValueError(f"a sliding window needs self-attention (as many queries as keys), got L={n}, "
                         f"S={k.shape[-2]}; patch cross-attention with window=0 (e.g. exclude= it)")
    if n == 0:  # no positions to unfold windows from: the empty product, still on the autograd graph
        return q @ k.transpose(-1, -2) @ v
    near = _near_keys(n, window, causal, key_padding_mask, q.device)
    k_band, v_band, phi_k_band = (_bands(x, window, causal) for x in (k, v, phi_k))  # (B, H, N, W, .)
    scores = torch.einsum("bhnd,bhnwd->bhnw", q, k_band) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~near, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = top.masked_fill(torch.isinf(top), 0.0)  # a query with no near key: its exps are all exp(-inf) = 0
    near_weights = torch.exp(scores - top)  # (B, H, N, W), at most 1
    near_num = torch.einsum("bhnw,bhnwd->bhnd", near_weights, v_band)
    near_den = near_weights.sum(-1, keepdim=True)

    if causal:  # far keys are j < i - window: the causal product over keys shifted window + 1 places later
        shift = lambda x: torch.nn.functional.pad(x, (0, 0, window + 1, 0))[..., :n, :]  # noqa: E731
        kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
        far = causal_linear_product(phi_q, shift(phi_k), shift(append_ones(v)), initial_state=initial_state, **kwargs)
        far_num, far_den = far[..., :-1], far[..., -1:]
    else:  # far = every key minus the near ones (the normaliser's terms are non-negative: rounding is clamped)
        kv, k_sum = key_value_sums(phi_k, v)
        if initial_state is not None:
            kv, k_sum = kv + initial_state[..., :-1], k_sum + initial_state[..., -1:]
        near_linear = torch.einsum("bhnf,bhnwf->bhnw", phi_q, phi_k_band)  # masked keys' features are zero
        far_num = torch.matmul(phi_q, kv) - torch.einsum("bhnw,bhnwd->bhnd", near_linear, v_band)
        far_den = (torch.matmul(phi_q, k_sum) - near_linear.sum(-1, keepdim=True)).clamp_min(0.0)
    f = mix.to(q.dtype)[None, :, None, None]
    return normalise(f * near_num + (1 - f) * far_num, f * near_den + (1 - f) * far_den)
