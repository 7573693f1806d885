"""Linformer and LinformerLM with the ``linformer`` package's API (non-causal encoders), plus padding masks
(``input_mask``, True = keep, converted once in ``Linformer.forward``; see padding.py)."""
from typing import Optional

import torch
from torch import nn

from .blocks import PreNorm
from .feedforward import FeedForward
from .linformer_attention import LinformerSelfAttention
from .reversible import LayerStack
from .padding import padding_from_keep


class Linformer(nn.Module):
    """x (B, N <= seq_len, dim) -> (B, N, dim): depth x [Linformer attention, feed-forward], pre-norm."""

    def __init__(self, dim: int, seq_len: int, depth: int, k: int = 256, heads: int = 8,
                 dim_head: Optional[int] = None, one_kv_head: bool = False, share_kv: bool = False,
                 reversible: bool = False, dropout: float = 0.0):
        super().__init__()
        self.seq_len = seq_len
        layers = [
            [PreNorm(dim, LinformerSelfAttention(dim, seq_len, k, heads, dim_head, one_kv_head, share_kv, dropout)),
             PreNorm(dim, FeedForward(dim, dropout=dropout))]
            for _ in range(depth)
        ]
        self.layers = LayerStack(layers, ["self"] * depth, reversible=reversible)

    def forward(self, x, input_mask=None):
        padding = padding_from_keep("input_mask", input_mask, x.shape[:2])
        return self.layers(x, lambda kind, ctx: (dict(padding=padding), {}))


class LinformerLM(nn.Module):
    """Token ids (B, N <= seq_len) -> logits (B, N, num_tokens); ``input_mask`` (B, N) True = keep."""

    def __init__(self, num_tokens: int, dim: int, seq_len: int, depth: int, k: int = 256, heads: int = 8,
                 dim_head: Optional[int] = None, one_kv_head: bool = False, share_kv: bool = False,
                 reversible: bool = False, dropout: float = 0.0):
        super().__init__()
        self.num_tokens, self.seq_len = num_tokens, seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.linformer = Linformer(dim, seq_len, depth, k, heads, dim_head, one_kv_head, share_kv, reversible, dropout)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, input_mask=None):
        if x.dim() != 2:
            raise ValueError(f"x must be (batch, seq) token ids, got shape {tuple(x.shape)}")
        if x.shape[1] > self.seq_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds seq_len={self.seq_len}; build with a larger seq_len")
        h = self.token_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        return self.to_logits(self.linformer(h, input_mask=input_mask))
