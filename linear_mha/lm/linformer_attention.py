"""LinformerSelfAttention: keys and values projected along the sequence to k positions (Wang et al., 2020).

API of the ``linformer`` package: (dim, seq_len, k, heads, dim_head, one_kv_head, share_kv, dropout), plus padding
masks and sequences of any length <= seq_len (the first S columns of the projections are used). Called directly it
takes keep-masks (``input_mask``, ``context_mask``: True = keep); in a layer stack, padding masks (``padding``,
``context_padding``: True = padding; see padding.py).
Keys come from ``context`` when one is given. Non-causal by construction: every projected key mixes all positions.
"""
from typing import Optional

import torch
from torch import nn

from ..attend import attend_heads
from ..registry import create_method
from .padding import padding_of_layer


class LinformerSelfAttention(nn.Module):
    def __init__(
        self,
        dim: int,
        seq_len: int,
        k: int = 256,
        heads: int = 8,
        dim_head: Optional[int] = None,
        one_kv_head: bool = False,
        share_kv: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        if dim_head is None:
            if dim % heads:
                raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}), or pass dim_head")
            dim_head = dim // heads
        if k < 1 or seq_len < 1:
            raise ValueError(f"k and seq_len must be >= 1, got k={k}, seq_len={seq_len}")
        self.seq_len, self.k, self.heads, self.dim_head = seq_len, k, heads, dim_head
        self.kv_heads = 1 if one_kv_head else heads
        self.dropout = dropout
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_k = nn.Linear(dim, dim_head * self.kv_heads, bias=False)
        self.to_v = None if share_kv else nn.Linear(dim, dim_head * self.kv_heads, bias=False)
        bound = k ** -0.5
        self.proj_k = nn.Parameter(torch.empty(k, seq_len).uniform_(-bound, bound))
        self.proj_v = None if share_kv else nn.Parameter(torch.empty(k, seq_len).uniform_(-bound, bound))
        self.to_out = nn.Linear(dim_head * heads, dim)
        # The registry's linformer method, on this layer's own projections (the linformer package's names)
        self.method = create_method("linformer", {"seq_len": seq_len, "proj_k": k,
                                                  "param_sharing": "kv" if share_kv else "headwise"})

    def _heads(self, t, n_heads):
        t = t.reshape(*t.shape[:-1], n_heads, self.dim_head).transpose(1, 2)
        return t.expand(t.shape[0], self.heads, *t.shape[2:]) if n_heads == 1 else t

    def forward(self, x, context=None, input_mask=None, context_mask=None, *, padding=None, context_padding=None):
        """x (B, N, dim); context (B, S, dim) or None; keys from the context when given, else from x."""
        if context is None:
            if context_mask is not None or context_padding is not None:
                raise ValueError("a context mask was given without context")
            src, key_padding = x, padding_of_layer("input_mask", input_mask, padding, x.shape[:2])
        else:
            src = context
            key_padding = padding_of_layer("context_mask", context_mask, context_padding, context.shape[:2])
        if src.shape[1] > self.seq_len:
            raise ValueError(
                f"the {'context' if context is not None else 'input'} has length {src.shape[1]} but this "
                f"LinformerSelfAttention was built for seq_len={self.seq_len}; build it with a larger seq_len"
            )
        q = self._heads(self.to_q(x), self.heads)
        k = self._heads(self.to_k(src), self.kv_heads)
        v = k if self.to_v is None else self._heads(self.to_v(src), self.kv_heads)
        out, _ = attend_heads(self.method, {"e_proj": self.proj_k, "f_proj": self.proj_v}, q, k, v,
                              key_padding_mask=key_padding, dropout_p=self.dropout if self.training else 0.0)
        return self.to_out(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def step(self, x, cache, t, padding_t=None, context=None, context_padding=None):
        """Decoding against a fixed context (a causal decoder's context layer): x (B, dim) -> (B, dim)."""
        _require_context(context)
        return self.forward(x[:, None], context=context, context_padding=context_padding)[:, 0]

    def prefill(self, x, cache, padding=None, context=None, context_padding=None):
        """The prompt's pass of a causal decoder's context layer: each position attends to the context only, so
        it is ``forward``, and ``step`` needs nothing cached from it."""
        _require_context(context)
        return self.forward(x, context=context, context_padding=context_padding)


def _require_context(context):
    if context is None:
        raise ValueError("Linformer self-attention is non-causal and cannot decode token by token; "
                         "only its context-attention form (context=...) has a step")
