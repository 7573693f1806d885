"""Agent Attention (Han et al., "Agent Attention: On the Integration of Softmax and Linear Attention", ECCV 2024):
n = a x a agent tokens, the queries average-pooled over the token grid, first gather the values with softmax
attention over the keys, then every query reads the agents with softmax attention:

    A = pool(Q);   V_A = softmax(A K^T s) V;   out = softmax(Q A^T s) V_A,   s = 1 / sqrt(d),

O(N n d) in time and memory: a softmax attention of rank n, whose rows stay data-dependent and local (each agent
summarises a region of the image). The paper also adds learned position biases to both softmaxes; here the
positions are those DETR / the ViT already add to q and k, and the local term is ``dwc_kernel``'s.

Padding: the agents pool only valid grid tokens, over the bins of the valid tokens' bounding box (the image, when a
batch pads images at the bottom and right), masked keys are left out of the first softmax and masked positions'
queries are zeroed, so a padded image gets the outputs it gets alone. Prefix tokens (class / register) are queries and keys but are not pooled.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import check_qkv, mask_keys


def _bin_members(valid_lines: Tensor, bins: int) -> Tensor:
    """valid_lines (B, n) bool: which rows (or columns) of the grid hold a valid token -> (B, bins, n) float, 1 where
    line j lies in bin i of ``bins`` adaptive-pooling bins over the span from the first valid line to the last (the
    bins adaptive_avg_pool2d makes over that span: [floor(i m / a), ceil((i + 1) m / a)), m its length), 0 elsewhere
    and everywhere for a sample with no valid line.

    Built from the span's ends as tensors, not by slicing the grid to the span: the shapes stay those of the grid,
    so graphs (torch.compile, torch.export) record it whatever the mask holds."""
    n = valid_lines.shape[1]
    index = torch.arange(n, device=valid_lines.device)
    first = torch.where(valid_lines, index, n).amin(1, keepdim=True)  # (B, 1); n where no line is valid
    last = torch.where(valid_lines, index, -1).amax(1, keepdim=True)
    span = (last - first + 1).clamp(min=0)[:, :, None]  # (B, 1, 1)
    i = torch.arange(bins, device=valid_lines.device)[None, :, None]  # (1, bins, 1)
    offset = (index - first)[:, None, :]  # (B, 1, n): a line's position inside the span
    start = torch.div(i * span, bins, rounding_mode="floor")
    stop = torch.div((i + 1) * span + bins - 1, bins, rounding_mode="floor")
    return ((offset >= start) & (offset < stop)).float()


def pool_agents(q: Tensor, agents_per_side: int, height: int, width: int, prefix: int = 0,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """q (B, H, prefix + height * width, d) -> agents (B, H, a * a, d): the mean of the valid grid queries in each
    of a x a bins over the valid tokens' bounding box (a bin with none is 0)."""
    b, h, _, d = q.shape
    grid = q[:, :, prefix:].reshape(b, h, height, width, d)
    if key_padding_mask is None:  # every box is the whole grid
        grid = grid.permute(0, 1, 4, 2, 3).reshape(b, h * d, height, width)
        return F.adaptive_avg_pool2d(grid, agents_per_side).reshape(b, h, d, -1).transpose(2, 3)
    valid = ~key_padding_mask[:, prefix:].reshape(b, height, width)
    rows = _bin_members(valid.any(2), agents_per_side).to(q.dtype)  # (B, a, height)
    cols = _bin_members(valid.any(1), agents_per_side).to(q.dtype)  # (B, a, width)
    keep = valid.to(q.dtype)
    grid = grid.masked_fill(~valid[:, None, :, :, None], 0.0)  # padding's garbage (even NaN) times 0 would be NaN
    # Each agent is the sum of its bin's valid queries over their count (adaptive pooling's mean of the masked grid
    # over the mean of the mask: the bin's area cancels).
    total = torch.einsum("bir,bjc,brc,bhrcd->bhijd", rows, cols, keep, grid)
    count = torch.einsum("bir,bjc,brc->bij", rows, cols, keep)[:, None, :, :, None]
    return (total / count.masked_fill(count == 0, 1.0)).reshape(b, h, agents_per_side * agents_per_side, d)


def agent_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    agents_per_side: int,
    height: int,
    width: int,
    prefix: int = 0,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    extra_k: Optional[Tensor] = None,
    extra_v: Optional[Tensor] = None,
) -> Tensor:
    """Self-attention over a token grid: q, k (B, H, N, d), v (B, H, N, d_v), N = prefix + height * width ->
    (B, H, N, d_v). key_padding_mask: bool (B, N), True = ignore (the same tokens are the queries). extra_k / extra_v
    (B, H, n, .): keys every agent sees (add_bias_kv / add_zero_attn). dropout_p: on both attention matrices."""
    check_qkv(q, k, v, key_padding_mask)
    if q.shape[2] != k.shape[2] or k.shape[2] != prefix + height * width:
        raise ValueError(f"agent attention is self-attention over a {height} x {width} grid after {prefix} prefix "
                         f"token(s) ({prefix + height * width} tokens); got {q.shape[2]} queries and {k.shape[2]} keys")
    if isinstance(agents_per_side, bool) or not isinstance(agents_per_side, int) or agents_per_side < 1:
        raise ValueError(f"agents_per_side must be a positive int, got {agents_per_side!r}")
    scale = 1.0 / math.sqrt(q.shape[-1])
    agents = pool_agents(q, agents_per_side, height, width, prefix, key_padding_mask)
    # Padded positions are queries too (self-attention): zeroed like the keys, so garbage there (even NaN) reaches
    # no output and no gradient, not even through the padded rows' own (unused) outputs.
    q, k, v = (mask_keys(t, key_padding_mask) for t in (q, k, v))
    if extra_k is not None:
        k, v = torch.cat([k, extra_k.to(k.dtype)], dim=2), torch.cat([v, extra_v.to(v.dtype)], dim=2)
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, extra_k.shape[2]), value=False)
    scores = torch.matmul(agents * scale, k.transpose(-2, -1))  # (B, H, n, S)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        # An image with no valid key at all: its agents gather nothing (0) instead of NaN.
        scores = scores.masked_fill(key_padding_mask.all(-1)[:, None, None, None], 0.0)
    gather = F.dropout(torch.softmax(scores, dim=-1), dropout_p, training=dropout_p > 0)
    if key_padding_mask is not None:
        gather = gather.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    agent_values = torch.matmul(gather, v)  # (B, H, n, d_v)
    read = torch.softmax(torch.matmul(q * scale, agents.transpose(-2, -1)), dim=-1)  # (B, H, N, n)
    return torch.matmul(F.dropout(read, dropout_p, training=dropout_p > 0), agent_values)
