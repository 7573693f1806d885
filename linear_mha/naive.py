"""Naive O(L·S) building blocks of the methods' references (``AttentionMethod.reference_weights``): explicit L x S
weight matrices, written from each method's definition and independently of its fast paths, which the tests hold to
them in float64."""
import math
from typing import Optional

import torch
from torch import Tensor


def visible(queries: int, keys: int, key_padding_mask: Optional[Tensor] = None, causal: bool = False,
            device=None) -> Tensor:
    """bool (B or 1, 1, L, S): True where query i may see key j (key_padding_mask (B, S): True = masked)."""
    seen = torch.ones(1, 1, queries, keys, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        seen = seen & ~key_padding_mask[:, None, None, :]
    if causal:
        seen = seen & torch.ones(queries, keys, dtype=torch.bool, device=device).tril()
    return seen


def normalised(weights: Tensor, seen: Tensor) -> Tensor:
    """Non-negative ``weights`` (B, H, L, S) restricted to the ``seen`` pairs, each row summing to 1 (0 where a
    query sees no key)."""
    w = weights.masked_fill(~seen, 0.0)
    total = w.sum(-1, keepdim=True)
    return torch.where(total > 0, w / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(w))


def softmax_weights(scores: Tensor, seen: Tensor) -> Tensor:
    """softmax over the ``seen`` keys of each row of ``scores`` (B, H, L, S); zero rows where none is seen."""
    top = scores.masked_fill(~seen, -math.inf).amax(-1, keepdim=True)
    return normalised(torch.exp(scores - top.masked_fill(torch.isinf(top), 0.0)), seen)


def scaled_scores(q: Tensor, k: Tensor) -> Tensor:
    """q k^T / sqrt(d): (B, H, L, d), (B, H, S, d) -> (B, H, L, S)."""
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
