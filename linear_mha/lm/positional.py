"""Position handling: learned absolute embeddings, rotary embeddings and token shift.

Token shift (Peng's RWKV trick, as in the original ``shift_tokens``) moves slices of the feature vector one
token along the sequence. Masked tokens are zeroed first, so a padded token's features never reach a real one
(the original looked the mask up under the wrong keyword and never applied it).
"""
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AbsolutePositionalEmbedding(nn.Module):
    def __init__(self, dim: int, max_seq_len: int):
        super().__init__()
        self.emb = nn.Embedding(max_seq_len, dim)
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, positions: Tensor) -> Tensor:
        return self.emb(positions)


def rotary_cos_sin(positions: Tensor, dim: int, dtype: torch.dtype, base: float = 10000.0):
    """positions (N,) -> cos, sin of shape (N, dim) for the rotate-half convention."""
    if dim % 2:
        raise ValueError(f"rotary embeddings need an even head dimension, got dim_head={dim}")
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., N, D) rotated pairwise (i, i + D/2) by the angles of its position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def shift_tokens(x: Tensor, shifts: Sequence[int], padding: Optional[Tensor] = None) -> Tensor:
    """x (B, N, D); the i-th of ``len(shifts)`` feature slices takes its value from token t - shifts[i]
    (zeros beyond the ends); features past the last full slice stay. padding (B, N) bool, True = padding."""
    if padding is not None:
        x = x.masked_fill(padding[..., None], 0.0)
    size = x.shape[-1] // len(shifts)
    pieces = list(x.split(size, dim=-1))
    for i, s in enumerate(shifts):
        if s:
            # Positive s pads s zeros in front and drops s at the end; negative s the reverse.
            pieces[i] = F.pad(pieces[i], (0, 0, s, -s))
    return torch.cat(pieces, dim=-1)


def shift_tokens_step(x: Tensor, cache: dict, shifts: Sequence[int], padding_t: Optional[Tensor] = None) -> Tensor:
    """One decoding step of ``shift_tokens`` for causal shifts (all >= 0): keeps the last max(shifts) inputs."""
    if min(shifts) < 0:
        raise ValueError("token-shift decoding needs causal shifts (>= 0); build the model with causal=True")
    if padding_t is not None:
        x = x.masked_fill(padding_t[:, None], 0.0)
    span = max(shifts)
    history = cache.get("shift_history")
    if history is None:
        history = x.new_zeros(x.shape[0], span, x.shape[-1])
    size = x.shape[-1] // len(shifts)
    pieces = list(x.split(size, dim=-1))
    for i, s in enumerate(shifts):
        if s > 0:
            pieces[i] = history[:, span - s, i * size:(i + 1) * size]
    if span:
        cache["shift_history"] = torch.cat([history[:, 1:], x[:, None]], dim=1)
    return torch.cat(pieces, dim=-1)
