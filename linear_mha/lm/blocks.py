"""Wrappers around a layer's function: pre-norm (+ token shift) and axial folding.

Padding masks are True = padding (``padding`` (B, N), ``padding_t`` (B,)): see padding.py."""
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .positional import shift_tokens, shift_tokens_step


class PreNorm(nn.Module):
    """fn(shift(norm(x))): ``shifts`` (e.g. (0, 1)) enables token shift on the normalised input."""

    def __init__(self, dim: int, fn: nn.Module, shifts: Optional[Sequence[int]] = None):
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(dim), fn
        self.shifts = tuple(shifts) if shifts else None

    def forward(self, x, padding=None, **context):
        y = self.norm(x)
        if self.shifts:
            y = shift_tokens(y, self.shifts, padding)
        return self.fn(y, padding=padding, **context)

    def step(self, x, cache, t, padding_t=None, **context):
        y = self.norm(x)
        if self.shifts:
            y = shift_tokens_step(y, cache, self.shifts, padding_t)
        return self.fn.step(y, cache.setdefault("fn", {}), t, padding_t, **context)

    def prefill(self, x, cache, padding=None, **context):
        """``forward`` that leaves in ``cache`` what ``step`` would hold after the same positions."""
        y = self.norm(x)
        if self.shifts:
            span = max(self.shifts)
            if min(self.shifts) < 0:
                raise ValueError("token-shift decoding needs causal shifts (>= 0); build the model with causal=True")
            if span:
                kept = y if padding is None else y.masked_fill(padding[..., None], 0.0)
                kept = kept[:, max(0, y.shape[1] - span):]
                cache["shift_history"] = F.pad(kept, (0, 0, span - kept.shape[1], 0))
            y = shift_tokens(y, self.shifts, padding)
        return self.fn.prefill(y, cache.setdefault("fn", {}), padding=padding, **context)


class FoldAxially(nn.Module):
    """Runs ``fn`` on the ``axial_dim`` strided sub-sequences (positions i, i + a, i + 2a, ...) separately.

    Each sub-sequence is causal within itself, so a causal ``fn`` stays causal. The sequence is padded at the
    end to a multiple of ``axial_dim`` with masked tokens (they come after every real token).
    """

    def __init__(self, axial_dim: int, fn: nn.Module):
        super().__init__()
        if axial_dim < 1:
            raise ValueError(f"the axial dimension (local_attn_window_size) must be >= 1, got {axial_dim}")
        self.axial_dim, self.fn = axial_dim, fn

    def forward(self, x, padding=None, **context):
        b, n, d = x.shape
        a = self.axial_dim
        pad = -n % a
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
            base = torch.zeros(b, n, dtype=torch.bool, device=x.device) if padding is None else padding
            padding = F.pad(base, (0, pad), value=True)
        m = (n + pad) // a

        def fold(t):  # (B, m * a, ...) -> (B * a, m, ...)
            return t.reshape(b, m, a, *t.shape[2:]).transpose(1, 2).reshape(b * a, m, *t.shape[2:])

        out = self.fn(fold(x), padding=None if padding is None else fold(padding), **context)
        out = out.reshape(b, a, m, d).transpose(1, 2).reshape(b, m * a, d)
        return out[:, :n]

    def step(self, x, cache, t, padding_t=None, **context):
        # Position t belongs to sub-sequence t mod a, where it is element t // a; each keeps its own state.
        sub_cache = cache.setdefault(t % self.axial_dim, {})
        return self.fn.step(x, sub_cache, t // self.axial_dim, padding_t, **context)

    def prefill(self, x, cache, padding=None, **context):
        # One call per sub-sequence (at most axial_dim): each needs its own decoding cache, and running them
        # unpadded keeps padding out of those caches.
        out = torch.empty_like(x)
        for r in range(min(self.axial_dim, x.shape[1])):
            sub_padding = None if padding is None else padding[:, r::self.axial_dim]
            out[:, r::self.axial_dim] = self.fn.prefill(x[:, r::self.axial_dim], cache.setdefault(r, {}),
                                                        padding=sub_padding, **context)
        return out
