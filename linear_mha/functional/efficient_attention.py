"""Efficient Attention (Shen et al., 2021): softmax over features for each query, softmax over the sequence for
each key feature, then Q (K^T V). The rows of the implied matrix softmax(Q) softmax(K)^T sum to one, so no
separate normaliser is needed. Non-causal only: the softmax over the sequence needs every key.
"""
from typing import Optional

import torch
from torch import Tensor

from . import backend, native
from ._common import check_qkv, compute_dtype, drop_keys, key_mask_4d, mask_keys, outside_autocast


@outside_autocast
def efficient_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) -> (B, H, L, Dv).

    key_padding_mask: bool (B, S), True = ignore: masked keys are excluded from the softmax over the sequence
    (a sample with every key masked returns 0). dropout_p: key dropout as in the other linear modes.
    """
    check_qkv(q, k, v, key_padding_mask)
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), drop_keys(v.to(dtype), dropout_p)
    if backend.efficient_backend(q, k, v).backend == backend.NATIVE:
        # The compiled code skips masked keys itself, so v is not copied to zero them.
        return native.efficient_attention(q, k, v, key_padding_mask).to(out_dtype)
    q_soft = torch.softmax(q, dim=-1)
    k_logits = k
    if key_padding_mask is not None:
        # A finite fill (not -inf) keeps a fully masked sample free of NaN; its keys are zeroed just below.
        k_logits = k_logits.masked_fill(key_mask_4d(key_padding_mask), torch.finfo(dtype).min)
    k_soft = mask_keys(torch.softmax(k_logits, dim=-2), key_padding_mask)
    context = torch.matmul(k_soft.transpose(-2, -1), mask_keys(v, key_padding_mask))
    return torch.matmul(q_soft, context).to(out_dtype)
