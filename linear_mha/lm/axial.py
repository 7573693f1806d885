"""Axial positional embedding: position p of a sequence laid out on an (rows, cols) grid gets
row_table[p // cols] + col_table[p % cols].

Two learned tables of width ``dim`` each are **summed** per position, as the ``axial_positional_embedding``
package does with its default ``axial_dims=None`` (not concatenated halves), so parameters are
(rows + cols) * dim instead of max_seq_len * dim: O(sqrt(N) * dim) for a near-square grid.
The grid only needs rows * cols >= max_seq_len, so every max_seq_len (a prime too) gets a near-square one.
"""
import math
from typing import Optional, Sequence

import torch
from torch import Tensor, nn


def near_square_shape(max_seq_len: int) -> tuple:
    """(rows, cols) with rows * cols >= max_seq_len and both close to sqrt(max_seq_len)."""
    cols = math.isqrt(max_seq_len - 1) + 1 if max_seq_len > 1 else 1
    return -(-max_seq_len // cols), cols


class AxialPositionalEmbedding(nn.Module):
    def __init__(self, dim: int, max_seq_len: int, shape: Optional[Sequence[int]] = None):
        super().__init__()
        shape = near_square_shape(max_seq_len) if shape is None else tuple(shape)
        if len(shape) != 2 or not all(isinstance(s, int) and s >= 1 for s in shape):
            raise ValueError(f"axial_position_shape must be two positive ints (rows, cols), got {shape!r}")
        if shape[0] * shape[1] < max_seq_len:
            raise ValueError(f"axial_position_shape {shape} covers {shape[0] * shape[1]} positions, fewer than "
                             f"max_seq_len={max_seq_len}; pass rows * cols >= max_seq_len or leave it None")
        self.shape = shape
        self.rows = nn.Parameter(torch.randn(shape[0], dim) * 0.02)
        self.cols = nn.Parameter(torch.randn(shape[1], dim) * 0.02)

    def forward(self, positions: Tensor) -> Tensor:
        """positions: integer tensor of any shape -> (*positions.shape, dim)."""
        cols = self.shape[1]
        return self.rows[positions // cols] + self.cols[positions % cols]
