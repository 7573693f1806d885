"""LinearAttentionTransformerLM: token embedding -> LinearAttentionTransformer -> logits (or embeddings).

``emb_dim`` < ``dim`` factorises the embedding (ALBERT): tokens live in emb_dim and are projected to dim and back.
Positions: learned absolute embeddings, or rotary embeddings in every self-attention (``use_rotary_emb=True``,
then no absolute embedding is added), or an axial embedding (``use_axial_pos_emb=True``: two summed tables on an
``axial_position_shape`` grid, default near-square; see ``axial.py``) in place of the absolute one.
``return_embeddings=True`` returns the normalised hidden states in ``dim`` (what a decoder's context layers take)
instead of logits.
"""
from typing import Optional

import torch
from torch import nn

from .axial import AxialPositionalEmbedding
from .positional import AbsolutePositionalEmbedding
from .transformer import LinearAttentionTransformer


class LinearAttentionTransformerLM(nn.Module):
    def __init__(
        self,
        num_tokens: int,
        dim: int,
        depth: int,
        max_seq_len: int,
        heads: int = 8,
        dim_head: Optional[int] = 64,
        causal: bool = False,
        emb_dim: Optional[int] = None,
        return_embeddings: bool = False,
        use_rotary_emb: bool = False,
        use_axial_pos_emb: bool = False,
        axial_position_shape=None,
        **transformer_kwargs,
    ):
        super().__init__()
        if use_axial_pos_emb and use_rotary_emb:
            raise ValueError("use_axial_pos_emb and use_rotary_emb are two ways to encode positions; set only one")
        if axial_position_shape is not None and not use_axial_pos_emb:
            raise ValueError("axial_position_shape is only used with use_axial_pos_emb=True; set it or drop the shape")
        emb_dim = dim if emb_dim is None else emb_dim
        self.num_tokens, self.max_seq_len, self.causal = num_tokens, max_seq_len, causal
        self.return_embeddings = return_embeddings
        self.token_emb = nn.Embedding(num_tokens, emb_dim)
        if use_rotary_emb:
            self.pos_emb = None
        elif use_axial_pos_emb:
            self.pos_emb = AxialPositionalEmbedding(emb_dim, max_seq_len, axial_position_shape)
        else:
            self.pos_emb = AbsolutePositionalEmbedding(emb_dim, max_seq_len)
        self.transformer = LinearAttentionTransformer(
            dim, depth, max_seq_len, heads=heads, dim_head=dim_head, causal=causal, use_rotary_emb=use_rotary_emb,
            **transformer_kwargs,
        )
        self.project_in = nn.Linear(emb_dim, dim) if emb_dim != dim else nn.Identity()
        if return_embeddings:
            self.project_out, self.norm, self.out = nn.Identity(), nn.LayerNorm(dim), nn.Identity()
        else:
            self.project_out = nn.Linear(dim, emb_dim) if emb_dim != dim else nn.Identity()
            self.norm, self.out = nn.LayerNorm(emb_dim), nn.Linear(emb_dim, num_tokens)

    def _check_tokens(self, x):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.long, torch.int, torch.int16, torch.uint8):
            raise TypeError(f"x must be an integer tensor of token ids, got {getattr(x, 'dtype', type(x))}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.num_tokens):
            raise ValueError(f"token ids must be in [0, num_tokens={self.num_tokens}), got [{int(x.min())}, {int(x.max())}]")

    def _embed(self, tokens, positions):
        x = self.token_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        return self.project_in(x)

    def _head(self, h):
        return self.out(self.norm(self.project_out(h)))

    def forward(self, x, input_mask=None, context=None, context_mask=None):
        """x (B, N) token ids -> logits (B, N, num_tokens), or embeddings (B, N, dim) with return_embeddings."""
        if x.dim() != 2:
            raise ValueError(f"x must be (batch, seq) token ids, got shape {tuple(x.shape)}")
        self._check_tokens(x)
        if x.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds max_seq_len={self.max_seq_len}")
        h = self._embed(x, torch.arange(x.shape[1], device=x.device))
        h = self.transformer(h, input_mask=input_mask, context=context, context_mask=context_mask)
        return self._head(h)

    @torch.no_grad()
    def prefill(self, x, cache: dict, input_mask=None, context=None, context_mask=None):
        """Logits (B, P, num_tokens) of a prompt x (B, P) in one parallel pass, filling an empty ``cache`` so
        that ``step`` continues at position P exactly as if the prompt had been fed token by token."""
        if x.dim() != 2:
            raise ValueError(f"x must be (batch, seq) token ids, got shape {tuple(x.shape)}")
        self._check_tokens(x)
        if cache:
            raise ValueError("prefill() starts a decoding: pass an empty cache ({})")
        h = self._embed(x, torch.arange(x.shape[1], device=x.device))
        h = self.transformer.prefill(h, cache.setdefault("transformer", {}), input_mask, context, context_mask)
        cache["t"] = x.shape[1]
        return self._head(h)

    def step(self, tokens, cache: dict, mask_t=None, context=None, context_mask=None):
        """Next-token logits for one new token per sequence: tokens (B,) -> (B, num_tokens). Start with cache={}.
        Feeding a sequence token by token gives the same logits as ``forward`` on the whole sequence."""
        t = cache.get("t", 0)
        if t >= self.max_seq_len:
            raise ValueError(f"position {t} is past max_seq_len={self.max_seq_len}")
        self._check_tokens(tokens)
        h = self._embed(tokens, torch.full((), t, dtype=torch.long, device=tokens.device))
        h = self.transformer.step(h, cache.setdefault("transformer", {}), mask_t, context, context_mask)
        cache["t"] = t + 1
        return self._head(h)
