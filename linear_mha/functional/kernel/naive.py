"""Kernel attention in its explicit O(L S) form, from the definition: what every implementation of the package is
tested against in float64 (the methods' ``reference_weights`` build on the same definition)."""
from typing import Optional

import torch
from torch import Tensor


def naive_causal_product(phi_q: Tensor, phi_k: Tensor, v: Tensor, initial_state: Optional[Tensor] = None) -> Tensor:
    """out_i = phi_q_i (S0 + sum_{j <= i} phi_k_j v_j^T), through the masked N x N matrix: (B, H, N, F),
    (B, H, N, F), (B, H, N, Dv), S0 (B, H, F, Dv) -> (B, H, N, Dv)."""
    n = phi_q.shape[-2]
    seen = torch.ones(n, n, dtype=torch.bool, device=phi_q.device).tril()
    out = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~seen, 0.0) @ v
    return out if initial_state is None else out + phi_q @ initial_state


def naive_kernel(phi_q: Tensor, phi_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                 causal: bool = False) -> Tensor:
    """Normalised kernel attention through its weights phi_q phi_k^T / row sums, masked keys and (causal) later keys
    left out; a query that sees nothing gets 0."""
    weights = phi_q @ phi_k.transpose(-1, -2)
    if key_padding_mask is not None:
        weights = weights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    if causal:
        weights = weights.tril()
    total = weights.sum(-1, keepdim=True)
    return weights @ v / torch.where(total == 0, torch.ones_like(total), total)
