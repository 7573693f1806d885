"""LinearAttentionTransformer: the layer stack of the linear-attention transformer, every option wired.

Every attention layer's global heads run ``global_mode`` (a method of linear_mha's registry, with ``global_options``;
default Efficient Attention, or ``feature_softmax`` when causal), its local heads ``block_local`` (SelfAttention).

Per depth: [self-attention, feed-forward], then with ``attend_axially`` an [axially folded attention,
feed-forward] pair (fold size = ``local_attn_window_size``), then with ``receives_context`` a [context attention,
feed-forward] pair. All feed-forwards are ``Chunk(ff_chunks, FeedForward(dim, glu=ff_glu, dropout=ff_dropout))``
(the original built the main one without glu/dropout). Token shift (``shift_tokens``) applies to the main pair.
At the depths listed in ``pkm_layers`` (1-indexed, as the original) a product-key memory ``PKM(dim,
num_keys=pkm_num_keys)`` replaces the main feed-forward.

``forward``, ``prefill`` and ``step`` take keep-masks (True = keep) and convert them once to the padding masks
(True = padding) that every layer below receives (padding.py).
"""
from typing import Optional, Sequence, Union

from torch import nn

from .blocks import FoldAxially, PreNorm
from .feedforward import Chunk, FeedForward
from .linformer_attention import LinformerSelfAttention
from .padding import padding_from_keep
from .pkm import PKM
from .reversible import LayerStack
from .self_attention import SelfAttention


def _stack_kwargs(padding, context_padding, padding_name="padding"):
    """kwargs_for(kind, context) for ``LayerStack``: padding masks for every layer function, plus the context
    and its padding for context layers. ``padding_name`` is "padding" for whole sequences, "padding_t" for a step."""
    def kwargs_for(kind, ctx):
        own = {padding_name: padding}
        if kind == "context":
            return dict(own, context=ctx, context_padding=context_padding), own
        return own, own

    return kwargs_for


class LinearAttentionTransformer(nn.Module):
    def __init__(
        self,
        dim: int,
        depth: int,
        max_seq_len: int,
        heads: int = 8,
        dim_head: Optional[int] = None,
        causal: bool = False,
        ff_chunks: int = 1,
        ff_glu: bool = False,
        ff_dropout: float = 0.0,
        attn_layer_dropout: float = 0.0,
        attn_dropout: float = 0.0,
        reversible: bool = False,
        blindspot_size: int = 1,
        n_local_attn_heads: Union[int, Sequence[int]] = 0,
        local_attn_window_size: int = 128,
        receives_context: bool = False,
        attend_axially: bool = False,
        linformer_settings=None,
        context_linformer_settings=None,
        shift_tokens: bool = False,
        use_rotary_emb: bool = False,
        attn_gate: bool = False,
        local_conv: bool = False,
        short_conv: int = 0,
        head_norm: bool = False,
        one_kv_head: bool = False,
        pkm_layers: Union[int, Sequence[int]] = (),
        pkm_num_keys: int = 128,
        global_mode: Optional[str] = None,
        global_options: Optional[dict] = None,
    ):
        super().__init__()
        pkm_layers = (pkm_layers,) if isinstance(pkm_layers, int) else tuple(pkm_layers)
        if not all(isinstance(i, int) and 1 <= i <= depth for i in pkm_layers):
            raise ValueError(f"pkm_layers lists 1-indexed depths in [1, depth={depth}], got {pkm_layers}")
        local_heads = (n_local_attn_heads,) * depth if isinstance(n_local_attn_heads, int) else tuple(n_local_attn_heads)
        if len(local_heads) != depth:
            raise ValueError(f"n_local_attn_heads must be an int or a tuple of length depth={depth}, got {n_local_attn_heads}")
        if linformer_settings is not None:
            if causal:
                raise ValueError("Linformer self-attention mixes all positions; use linformer_settings only with causal=False")
            if any(local_heads) or attn_gate or local_conv or short_conv or head_norm or use_rotary_emb:
                raise ValueError("linformer_settings replaces SelfAttention: n_local_attn_heads, attn_gate, "
                                 "local_conv, short_conv, head_norm and use_rotary_emb do not apply to it; drop them "
                                 "or linformer_settings")
        self.max_seq_len, self.causal, self.receives_context = max_seq_len, causal, receives_context
        shifts = ((0, 1) if causal else (-1, 0, 1)) if shift_tokens else None

        def ff(pkm=False):
            inner = PKM(dim, num_keys=pkm_num_keys) if pkm else FeedForward(dim, glu=ff_glu, dropout=ff_dropout)
            return Chunk(ff_chunks, inner, along_dim=1)

        common = dict(heads=heads, dim_head=dim_head, dropout=attn_layer_dropout, attn_dropout=attn_dropout,
                      one_kv_head=one_kv_head, global_mode=global_mode, global_options=global_options)
        layers, kinds = [], []
        for layer_num, n_local in enumerate(local_heads, start=1):
            if linformer_settings is None:
                attn = SelfAttention(dim, causal=causal, blindspot_size=blindspot_size, n_local_attn_heads=n_local,
                                     local_attn_window_size=local_attn_window_size, rotary=use_rotary_emb,
                                     attn_gate=attn_gate, local_conv=local_conv, short_conv=short_conv,
                                     head_norm=head_norm, **common)
            else:
                attn = LinformerSelfAttention(dim, max_seq_len, linformer_settings.k, heads=heads, dim_head=dim_head,
                                              one_kv_head=one_kv_head, dropout=attn_dropout)
            layers.append([PreNorm(dim, attn, shifts), PreNorm(dim, ff(layer_num in pkm_layers), shifts)])
            kinds.append("self")
            if attend_axially:
                axial = SelfAttention(dim, causal=causal, rotary=use_rotary_emb, attn_gate=attn_gate,
                                      local_conv=local_conv, short_conv=short_conv, head_norm=head_norm, **common)
                layers.append([PreNorm(dim, FoldAxially(local_attn_window_size, axial)), PreNorm(dim, ff())])
                kinds.append("self")
            if receives_context:
                if context_linformer_settings is None:
                    ctx_attn = SelfAttention(dim, receives_context=True, attn_gate=attn_gate, head_norm=head_norm,
                                             **common)
                else:
                    s = context_linformer_settings
                    ctx_attn = LinformerSelfAttention(dim, s.seq_len, s.k, heads=heads, dim_head=dim_head,
                                                      one_kv_head=one_kv_head, dropout=attn_dropout)
                layers.append([PreNorm(dim, ctx_attn), PreNorm(dim, ff())])
                kinds.append("context")
        self.layers = LayerStack(layers, kinds, reversible=reversible)

    def forward(self, x, input_mask=None, context=None, context_mask=None):
        """x (B, N, dim) -> (B, N, dim); input_mask (B, N), context (B, S, dim), context_mask (B, S)."""
        b, n, _ = x.shape
        if n > self.max_seq_len:
            raise ValueError(f"sequence length {n} exceeds max_seq_len={self.max_seq_len}; build with a larger max_seq_len")
        padding = padding_from_keep("input_mask", input_mask, (b, n))
        context_padding = self._context_padding(b, context, context_mask)
        return self.layers(x, _stack_kwargs(padding, context_padding), context)

    def _context_padding(self, batch, context, context_mask):
        if not self.receives_context:
            if context is not None or context_mask is not None:
                raise ValueError("context was given but the transformer was built with receives_context=False")
            return None
        if context is None:
            raise ValueError("this transformer has receives_context=True: pass context=(B, S, dim)")
        return padding_from_keep("context_mask", context_mask, (batch, context.shape[1]))

    def prefill(self, x, cache: dict, input_mask=None, context=None, context_mask=None):
        """The forward pass over a prompt x (B, P, dim) of a causal model that also fills an empty ``cache``
        with what P calls of ``step`` would leave: decoding continues from it at position P."""
        if not self.causal:
            raise ValueError("prefill() decodes causal models; build the model with causal=True")
        if cache:
            raise ValueError("prefill() starts a decoding: pass an empty cache ({})")
        b, n, _ = x.shape
        if n > self.max_seq_len:
            raise ValueError(f"sequence length {n} exceeds max_seq_len={self.max_seq_len}; build with a larger max_seq_len")
        padding = padding_from_keep("input_mask", input_mask, (b, n))
        context_padding = self._context_padding(b, context, context_mask)
        out = self.layers.prefill(x, cache.setdefault("layers", []), _stack_kwargs(padding, context_padding),
                                  context)
        cache["t"] = n
        return out

    def step(self, x, cache: dict, mask_t=None, context=None, context_mask=None):
        """Decode one position of a causal model: x (B, dim) -> (B, dim). ``cache`` starts as {} and carries
        the recurrent state (global heads), rolling windows (local heads), shift and conv histories."""
        if not self.causal:
            raise ValueError("step() decodes causal models; build the model with causal=True")
        t = cache.get("t", 0)
        padding_t = padding_from_keep("mask_t", mask_t, x.shape[:1])
        context_padding = self._context_padding(x.shape[0], context, context_mask)
        kwargs_for = _stack_kwargs(padding_t, context_padding, padding_name="padding_t")
        out = self.layers.step(x, cache.setdefault("layers", []), t, kwargs_for, context)
        cache["t"] = t + 1
        return out
