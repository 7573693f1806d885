"""Kernel attention from plain PyTorch ops, on features already made: the path every map, dtype and device can take
(autograd through every op, torch.func, torch.compile), and the building block of the methods that make their
features themselves (hedgehog, the sliding window)."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._common import (append_ones, compiling, functorch_active, has_tangent, needs_grad, normalise, safe_normaliser,
                       split_normalise)
from .chunked import causal_linear_product


def composed_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool = False,
                      initial_state: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                      reuse_keys: bool = False) -> Tensor:
    """Normalised linear attention on features already made: phi_q (B, H, L, F), phi_k (B, H, S, F) non-negative
    with masked keys' rows zero, v (B, H, S, Dv) with masked rows zero -> (B, H, L, Dv), in the features' dtype.
    initial_state (B, H, F, Dv + 1): extra keys every query sees. reuse_keys: phi_k is a temporary the output may
    be written over (inference only)."""
    if causal:
        kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
        num_den = causal_linear_product(phi_q, phi_k, append_ones(v), initial_state=initial_state, **kwargs)
        return split_normalise(num_den)
    # Non-causal: the normaliser phi(q) . sum_j phi(k_j) is a matrix-vector product; keeping it out of the value
    # GEMM avoids copying v into a ones-column layout and an odd GEMM width.
    kv, k_sum = key_value_sums(phi_k, v)
    if initial_state is not None:
        kv = kv + initial_state[..., :-1]
        k_sum = k_sum + initial_state[..., -1:]
    den = torch.matmul(phi_q, k_sum)
    if needs_grad(phi_q, phi_k, v, initial_state):
        return normalise(torch.matmul(phi_q, kv), den)
    # Inference (accelerators, or maps without a blocked path): the output is written over phi(k) (a fresh
    # tensor for the named maps, used up by now) and divided in place. Fresh multi-megabyte outputs cost page
    # faults, not only bandwidth (docs/benchmarks.md, "Why the code is shaped as it is").
    reuse = reuse_keys and phi_k.shape == phi_q.shape[:-1] + v.shape[-1:] and not functorch_active() \
        and not compiling() and not has_tangent(phi_q, phi_k, v)  # exporters and forward AD cannot use out=
    num = torch.matmul(phi_q, kv, out=phi_k) if reuse else torch.matmul(phi_q, kv)
    return num.div_(safe_normaliser(den))


def key_value_sums(phi_k: Tensor, v: Tensor, pieces: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """sum_j phi(k_j) v_j^T (B, H, F, Dv) and sum_j phi(k_j) (B, H, F, 1) over the S positions of phi_k (B, H, S, F)
    and v (B, H, S, Dv).

    On CUDA the sum runs as ``pieces`` partial products of one batched matmul, then a sum over them: a single
    (F x S) @ (S x Dv) product per head gives the GPU only B * H small output tiles to spread over its
    multiprocessors, each walking all S positions (the split forward's time against the single product's on an
    H100: docs/cuda.md). Elsewhere (CPU threads split a single product well) ``pieces`` defaults to 1."""
    s = phi_k.shape[-2]
    if pieces is None:
        pieces = min(64, s // 256) if phi_k.device.type == "cuda" else 1
    if pieces < 2:
        return torch.matmul(phi_k.transpose(-2, -1), v), phi_k.sum(dim=-2).unsqueeze(-1)
    whole = s - s % pieces  # positions that split evenly; the rest is one more product
    split_k = phi_k[..., :whole, :].unflatten(-2, (pieces, whole // pieces))
    split_v = v[..., :whole, :].unflatten(-2, (pieces, whole // pieces))
    kv = torch.matmul(split_k.transpose(-2, -1), split_v).sum(dim=-3)
    k_sum = split_k.sum(dim=-2).sum(dim=-2)
    if whole < s:
        kv = kv + torch.matmul(phi_k[..., whole:, :].transpose(-2, -1), v[..., whole:, :])
        k_sum = k_sum + phi_k[..., whole:, :].sum(dim=-2)
    return kv, k_sum.unsqueeze(-1)
