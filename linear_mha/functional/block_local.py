"""Block-local softmax attention (the local heads of the linear-attention transformer LMs) and its rolling decode
cache.

The sequence is cut into blocks of ``window`` positions; a query in block u sees the keys of blocks u-1 and u (and
u+1 when not causal), causal queries only keys at positions <= their own. Cost O(N * window).

Masks: ``key_padding_mask`` (B, N) bool, True = padding: a masked key is seen by no query; a query that sees no key
at all gets 0.

Decoding keeps the last 2 * window keys/values: exactly what a causal query can see, so the work per token is
constant however long the context grows.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import fixed_graph
from .softmax import softmax as softmax_attention


def _look_around(x: Tensor, n_win: int, window: int, causal: bool) -> Tensor:
    """(B, H, n_win * window, D) -> (B, H, n_win, K, D) with K = 2 or 3 windows: previous, own[, next]."""
    b, h, _, d = x.shape
    xw = x.reshape(b, h, n_win, window, d)
    prev = F.pad(xw, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    parts = [prev, xw]
    if not causal:
        parts.append(F.pad(xw, (0, 0, 0, 0, 0, 1))[:, :, 1:])
    return torch.cat(parts, dim=3)


def block_local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    *,
    causal: bool,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """q, k (B, H, N, D), v (B, H, N, Dv) -> (B, H, N, Dv): self-attention, the queries at the keys' positions."""
    b, h, n, d = q.shape
    if isinstance(n, torch.SymInt) and fixed_graph():
        # The blocks are reshapes by ceil(N / window), whose layout (one block or several) export cannot leave open.
        raise ValueError("block_local attention exports with a fixed sequence length only: mark the length static "
                         "in torch.export's dynamic_shapes (batch may stay dynamic), or export one graph per length")
    if b * h * n == 0:  # nothing to attend: the empty product, still on the autograd graph
        return q @ k.transpose(-1, -2) @ v
    if n <= window:
        # One block, whose neighbours are empty: softmax over the whole sequence. The blocked form would score the
        # empty block before it too, twice the keys (an LM whose every head is local with window = seq_len).
        return softmax_attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal, dropout_p=dropout_p)[0]
    w, padding = window, key_padding_mask
    n_win = -(-n // w)
    pad = n_win * w - n
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    device = q.device
    starts = torch.arange(n_win, device=device)[:, None] * w
    qpos = starts + torch.arange(w, device=device)  # (n_win, w)
    kpos = starts + torch.arange(-w, (1 if causal else 2) * w, device=device)  # (n_win, K)
    in_range = (kpos >= 0) & (kpos < n)
    if padding is not None:
        padded = F.pad(padding, (0, pad), value=True)
        key_ok = ~padded[:, kpos.clamp(0, n_win * w - 1)] & in_range  # (B, n_win, K)
    else:
        key_ok = in_range.expand(b, -1, -1)
    allowed = key_ok[:, :, None, :].expand(-1, -1, w, -1)
    if causal:
        allowed = allowed & (kpos[None, :, None, :] <= qpos[None, :, :, None])
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=device).masked_fill(~allowed, float("-inf"))

    def fold(t: Tensor) -> Tensor:  # (B, H, n_win, L, D) -> (B * n_win, H, L, D)
        return t.transpose(1, 2).reshape(b * n_win, h, t.shape[3], t.shape[4])

    qf = fold(q.reshape(b, h, n_win, w, d))
    kf = fold(_look_around(k, n_win, w, causal))
    vf = fold(_look_around(v, n_win, w, causal))
    out, _ = softmax_attention(qf, kf, vf, attn_bias=bias.reshape(b * n_win, 1, w, -1), dropout_p=dropout_p)
    out = out.reshape(b, n_win, h, w, -1).transpose(1, 2).reshape(b, h, n_win * w, -1)
    return out[:, :, :n]


def block_local_step(
    q: Tensor, k: Tensor, v: Tensor, cache: dict, t: int, window_size: int, padding_t: Optional[Tensor] = None
) -> Tensor:
    """Causal decoding at position t: q, k (B, H, D), v (B, H, Dv) -> (B, H, Dv); ``cache`` is updated in place (every
    tensor in it has the batch first, so a beam search can reorder it)."""
    b, h, d = k.shape
    span = 2 * window_size
    if "k" not in cache:
        cache["k"] = k.new_zeros(b, h, span, d)
        cache["v"] = v.new_zeros(b, h, span, v.shape[-1])
        cache["pos"] = torch.full((b, span), -1, dtype=torch.long, device=k.device)
        cache["padding"] = torch.ones(b, span, dtype=torch.bool, device=k.device)
    if padding_t is None:
        padding_t = torch.zeros(b, dtype=torch.bool, device=k.device)
    cache["k"] = torch.cat([cache["k"][:, :, 1:], k[:, :, None]], dim=2)
    cache["v"] = torch.cat([cache["v"][:, :, 1:], v[:, :, None]], dim=2)
    cache["pos"] = torch.cat([cache["pos"][:, 1:], cache["pos"].new_full((b, 1), t)], dim=1)
    cache["padding"] = torch.cat([cache["padding"][:, 1:], padding_t[:, None]], dim=1)
    pos = cache["pos"]
    visible = (pos >= 0) & (pos >= (t // window_size - 1) * window_size)
    allowed = ~cache["padding"] & visible  # (B, span)
    out, _ = softmax_attention(q[:, :, None], cache["k"], cache["v"], key_padding_mask=~allowed)
    return out[:, :, 0]


def block_local_prefill(k: Tensor, v: Tensor, cache: dict, window_size: int,
                        padding: Optional[Tensor] = None) -> None:
    """Fill ``cache`` with the rolling window ``block_local_step`` holds after positions 0..N-1 of
    k (B, H, N, D), v (B, H, N, Dv): the last 2 * window_size keys, right-aligned, empty slots at position -1."""
    b, h, n, _ = k.shape
    span = 2 * window_size
    kept = min(n, span)
    pad = span - kept
    if padding is None:
        padding = torch.zeros(b, n, dtype=torch.bool, device=k.device)
    cache["k"] = F.pad(k[:, :, n - kept:], (0, 0, pad, 0))
    cache["v"] = F.pad(v[:, :, n - kept:], (0, 0, pad, 0))
    cache["pos"] = F.pad(torch.arange(n - kept, n, device=k.device), (pad, 0), value=-1).expand(b, span)
    cache["padding"] = F.pad(padding[:, n - kept:], (pad, 0), value=True)
