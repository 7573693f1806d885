"""Exact softmax attention: the reference every linear method is measured against."""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import check_qkv, functorch_active


def softmax(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_bias: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """softmax(q k^T * scale + bias) v.

    Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) -> out (B, H, L, Dv), weights (B, H, L, S) or None.
    attn_bias: float, additive, broadcastable to (B, H, L, S) (use -inf to forbid a pair).
    key_padding_mask: bool (B, S), True = ignore that key. causal: query i sees keys j <= i (top-left aligned,
    as in ``scaled_dot_product_attention``). scale defaults to 1/sqrt(D).
    Queries that can see no key at all return 0 (and zero weights), not NaN.
    Weights are returned after dropout, as ``nn.MultiheadAttention`` returns them.
    """
    check_qkv(q, k, v, key_padding_mask)
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    if attn_bias is not None:
        target = (q.shape[0], q.shape[1], L, S)
        try:
            torch.broadcast_shapes(tuple(attn_bias.shape), target)
        except RuntimeError:
            raise ValueError(f"attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to (B, H, L, S) = "
                             f"{target}") from None
    if causal and attn_bias is None and key_padding_mask is None and S > 0 and not need_weights \
            and not functorch_active():
        # The causal mask alone: SDPA's own is_causal (top-left aligned too, and no query is left without a key)
        # lets its kernel skip the future's blocks instead of scoring them and masking them out.
        try:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale), None
        except NotImplementedError:
            pass
    bias = attn_bias.to(q.dtype) if attn_bias is not None else None
    forbidden = None  # bool, True = the pair may not attend; broadcastable to (B, H, L, S)
    if key_padding_mask is not None:
        forbidden = key_padding_mask[:, None, None, :]
    if causal:
        future = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
        forbidden = future if forbidden is None else forbidden | future
    if forbidden is not None:
        neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
        bias = torch.where(forbidden, neg_inf, bias if bias is not None else torch.zeros_like(neg_inf))

    dead = None  # queries that see no key: their softmax would be 0/0
    if bias is not None:
        dead = torch.isneginf(bias).all(-1, keepdim=True)
        # A finite row keeps softmax and its gradient free of NaN; the row's output is zeroed afterwards.
        bias = bias.masked_fill(dead, 0.0)

    # torch's fused kernels have no forward-mode derivative (forward_ad raises NotImplementedError) and no second
    # derivative (torch.func.grad of grad), where nn.MultiheadAttention fails; the products below have both.
    if not need_weights and not functorch_active():
        try:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
            return (out if dead is None else out.masked_fill(dead, 0.0)), None
        except NotImplementedError:
            pass

    scores = _scores(q * scale, k, bias)
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.matmul(weights, v)
    # A query that sees no key is zeroed in its output row (small) rather than in its weights (L x S, and again in
    # the backward pass); its weights are zeroed only in the copy handed back, when they are asked for.
    if dead is None:
        return out, (weights if need_weights else None)
    return out.masked_fill(dead, 0.0), (weights.masked_fill(dead, 0.0) if need_weights else None)


def _scores(q: Tensor, k: Tensor, bias: Optional[Tensor]) -> Tensor:
    """q (B, H, L, D) times k (B, H, S, D) transposed, plus bias broadcastable to (B, H, L, S), with no pass over the
    L x S scores of its own where the bias allows: a bias per key (a padding mask, (..., 1, S)) is the product's
    initial value (baddbmm broadcasts it over the queries, as nn.MultiheadAttention forms its scores); any other is
    added in place, never copied out to the scores' shape first."""
    if bias is not None and q.dim() == 4 and k.dim() == 4 and (bias.dim() < 2 or bias.shape[-2] == 1):
        B, H, L, D = q.shape
        S = k.shape[-2]
        per_key = bias.expand(B, H, 1, S).reshape(B * H, 1, S)
        scores = torch.baddbmm(per_key, q.reshape(B * H, L, D), k.reshape(B * H, S, D).transpose(1, 2))
        return scores.view(B, H, L, S)
    scores = torch.matmul(q, k.transpose(-2, -1))
    return scores if bias is None else scores.add_(bias)
