"""Position-wise feed-forward (GELU or GEGLU) and sequence chunking.

Unlike the projects this descends from, ``glu`` and ``dropout`` reach every feed-forward block of the stack: the
transformer builds all of them through ``FeedForward(dim, glu=ff_glu, dropout=ff_dropout)``.
"""
import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """x (..., dim) -> (..., dim): w2(dropout(act(w1 x))) or, with ``glu``, w2(dropout(gelu(a) * b))."""

    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0, glu: bool = False):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.glu = glu
        self.w1 = nn.Linear(dim, dim * mult * (2 if glu else 1))
        self.dropout = nn.Dropout(dropout)
        self.w2 = nn.Linear(dim * mult, dim)

    def forward(self, x, padding=None):  # position-wise: no padding changes a position's output
        if self.glu:
            h, gate = self.w1(x).chunk(2, dim=-1)
            h = F.gelu(h) * gate
        else:
            h = F.gelu(self.w1(x))
        return self.w2(self.dropout(h))

    def step(self, x, cache, t, padding_t=None):
        return self.forward(x)

    def prefill(self, x, cache, padding=None):
        return self.forward(x)


class Chunk(nn.Module):
    """Applies a position-wise ``fn`` to ``chunks`` pieces of the sequence in turn: the hidden activations of
    only one piece are alive at a time, and since ``fn`` mixes no positions the result is unchanged."""

    def __init__(self, chunks: int, fn: nn.Module, along_dim: int = 1):
        super().__init__()
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"ff_chunks must be a positive int, got {chunks!r}")
        self.chunks, self.fn, self.dim = chunks, fn, along_dim

    def forward(self, x, padding=None):  # fn is position-wise: padding changes nothing
        if self.chunks == 1:
            return self.fn(x)
        return torch.cat([self.fn(c) for c in x.chunk(self.chunks, dim=self.dim)], dim=self.dim)

    def step(self, x, cache, t, padding_t=None):
        return self.fn.step(x, cache, t, padding_t)

    def prefill(self, x, cache, padding=None):
        return self.forward(x)  # fn is position-wise: it keeps no decoding state
