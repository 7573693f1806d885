"""Wrappers around a layer's function: pre-norm (+ token shift) and axial folding."""
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

    def forward(self, x, input_mask=None, **kwargs):
        y = self.norm(x)
        if self.shifts:
            y = shift_tokens(y, self.shifts, input_mask)
        return self.fn(y, input_mask=input_mask, **kwargs)

    def step(self, x, cache, t, mask_t=None, **kwargs):
        y = self.norm(x)
        if self.shifts:
            y = shift_tokens_step(y, cache, self.shifts, mask_t)
        return self.fn.step(y, cache.setdefault("fn", {}), t, mask_t, **kwargs)

    def prefill(self, x, cache, input_mask=None, **kwargs):
        """``forward`` that leaves in ``cache`` what ``step`` would hold after the same positions."""
        y = self.norm(x)
        if self.shifts:
            span = max(self.shifts)
            if min(self.shifts) < 0:
                raise ValueError("token-shift decoding needs causal shifts (>= 0); build the model with causal=True")
            if span:
                kept = y if input_mask is None else y.masked_fill(~input_mask[..., None], 0.0)
                kept = kept[:, max(0, y.shape[1] - span):]
                cache["shift_history"] = F.pad(kept, (0, 0, span - kept.shape[1], 0))
            y = shift_tokens(y, self.shifts, input_mask)
        return self.fn.prefill(y, cache.setdefault("fn", {}), input_mask=input_mask, **kwargs)


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

    def forward(self, x, input_mask=None, **kwargs):
        b, n, d = x.shape
        a = self.axial_dim
        pad = -n % a
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
            base = torch.ones(b, n, dtype=torch.bool, device=x.device) if input_mask is None else input_mask
            input_mask = F.pad(base, (0, pad), value=False)
        m = (n + pad) // a

        def fold(t):  # (B, m * a, ...) -> (B * a, m, ...)
            return t.reshape(b, m, a, *t.shape[2:]).transpose(1, 2).reshape(b * a, m, *t.shape[2:])

        mask = None if input_mask is None else fold(input_mask)
        out = self.fn(fold(x), input_mask=mask, **kwargs)
        out = out.reshape(b, a, m, d).transpose(1, 2).reshape(b, m * a, d)
        return out[:, :n]

    def step(self, x, cache, t, mask_t=None, **kwargs):
        # Position t belongs to sub-sequence t mod a, where it is element t // a; each keeps its own state.
        sub_cache = cache.setdefault(t % self.axial_dim, {})
        return self.fn.step(x, sub_cache, t // self.axial_dim, mask_t, **kwargs)

    def prefill(self, x, cache, input_mask=None, **kwargs):
        # One call per sub-sequence (at most axial_dim): each needs its own decoding cache, and running them
        # unpadded keeps padding out of those caches.
        out = torch.empty_like(x)
        for r in range(min(self.axial_dim, x.shape[1])):
            mask = None if input_mask is None else input_mask[:, r::self.axial_dim]
            out[:, r::self.axial_dim] = self.fn.prefill(x[:, r::self.axial_dim], cache.setdefault(r, {}),
                                                        input_mask=mask, **kwargs)
        return out
