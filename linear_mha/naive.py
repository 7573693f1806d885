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


def rotated_similarity(phi_q: Tensor, phi_k: Tensor, grid) -> Tensor:
    """(R_i phi_q_i) . (R_j phi_k_j) (B, H, L, S) with explicit per-position rotation matrices (``rope``). On a token
    grid the last R = 4 floor(F / 4) features turn in pairs (F - R + m, F - R/2 + m), the first half of the pairs by
    the grid row y and the second by the column x, at 10000^(-m / P) for P pairs per axis; prefix tokens do not turn.
    With ``grid`` None (a sequence), the last R = 2 floor(F / 2) features turn by the position n, P = R / 2 pairs."""
    features = phi_q.shape[-1]
    pairs = features // 4 if grid is not None else features // 2
    turning = 4 * pairs if grid is not None else 2 * pairs
    rotations = torch.eye(features, dtype=phi_q.dtype, device=phi_q.device).repeat(phi_k.shape[-2], 1, 1)
    for n in range(grid.prefix if grid is not None else 0, phi_k.shape[-2]):
        if grid is not None:
            y, x = divmod(n - grid.prefix, grid.width)
        for pair in range(turning // 2):
            position = (y if pair < pairs else x) if grid is not None else n
            angle = position * 10000.0 ** (-(pair % pairs) / pairs)
            i, j = features - turning + pair, features - turning // 2 + pair
            c, s = math.cos(angle), math.sin(angle)
            rotations[n, i, i], rotations[n, i, j], rotations[n, j, i], rotations[n, j, j] = c, -s, s, c
    turned_q = (rotations @ phi_q[..., None])[..., 0]
    turned_k = (rotations @ phi_k[..., None])[..., 0]
    return turned_q @ turned_k.transpose(-1, -2)
