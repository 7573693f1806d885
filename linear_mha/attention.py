"""LinearMultiheadAttention: nn.MultiheadAttention's parameters, signature and return values, with linear-time
attention inside (Linformer, kernel feature maps, Efficient Attention, Taylor) or exact softmax as the reference.

Parameters carry nn.MultiheadAttention's names and shapes in all three layouts (packed in_proj_weight, or
separate q/k/v_proj_weight when kdim/vdim differ), so ``load_state_dict(mha.state_dict())`` loads every
attention weight. Modes with extra state (Linformer's E/F, FAVOR's projection) accept a state dict without it:
an nn.MultiheadAttention checkpoint has no such keys, and those tensors keep their initialisation.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from . import masks as M
from .mode_attention import ModeAttention


def _disable_torch_fast_path(module, args):
    """Registered as a forward pre-hook so that nn.TransformerEncoderLayer's inference fast path, which checks
    for hooks and otherwise runs exact softmax on in_proj_weight without calling our forward, is never taken."""
    return None


class LinearMultiheadAttention(ModeAttention):
    r"""Drop-in replacement for :class:`torch.nn.MultiheadAttention` with linear-time attention.

    Positional arguments and defaults are nn.MultiheadAttention's. Keyword options:

    * ``mode``: ``"linformer"`` (default), ``"kernel"``, ``"efficient"``, ``"taylor"`` or ``"softmax"`` (exact).
    * ``seq_len`` (100), ``proj_k`` (128): Linformer projects up to ``seq_len`` keys onto ``proj_k`` positions.
    * ``param_sharing`` (Linformer): ``"none"`` E_i, F_i per head; ``"headwise"`` one E, F per layer; ``"kv"``
      E = F per layer; ``"layerwise"`` one projection (E = F) shared by every layer: pass it as
      ``shared_projection`` (an ``nn.Parameter`` of shape (proj_k, seq_len)) or let the patcher tie it.
    * ``feature_map`` (kernel mode): ``"elu"`` (default), ``"relu"``, ``"favor"`` or a callable psi(x) -> features.
      ``num_features`` sets FAVOR's random-feature count (default d log d); ``redraw_interval`` redraws them every
      that many training forwards (default: never; call ``redraw_features()`` yourself).
    * ``chunk_size``: chunk length of the causal kernel product.

    ``dropout`` is applied only in training. In ``softmax`` it drops attention probabilities, in ``linformer``
    probabilities over the projected keys; ``kernel``, ``efficient`` and ``taylor`` have no probability matrix,
    so each key is dropped from the numerator with probability ``dropout`` (per sample and head) and survivors are
    rescaled, which keeps the expected output equal to the eval output.

    ``need_weights``: only ``softmax`` returns attention weights. The linear modes never form the L x S matrix
    and return ``None`` in its place (callers such as DETR discard it); use :meth:`attention_matrix` to get the
    matrix the approximation implies, e.g. for visualisation.
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, mode="linformer",
                 seq_len=100, proj_k=128, param_sharing="none", feature_map=None, num_features=None,
                 shared_projection=None, chunk_size=None, redraw_interval=None, **unknown):
        options = dict(mode=mode, seq_len=seq_len, proj_k=proj_k, param_sharing=param_sharing,
                       feature_map=feature_map, num_features=num_features, shared_projection=shared_projection,
                       chunk_size=chunk_size, redraw_interval=redraw_interval, **unknown)
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got embed_dim={embed_dim}, num_heads={num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads

        # Same parameters, in the same registration order, as nn.MultiheadAttention.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory_kwargs)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn

        self._reset_parameters()
        self._init_mode(options, factory_kwargs)
        self.register_forward_pre_hook(_disable_torch_fast_path)

    # ------------------------------------------------------------------ construction
    def _reset_parameters(self):
        # nn.MultiheadAttention's initialisation, so a fresh module is statistically the same as one.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, *, copy: bool = True, **options) -> "LinearMultiheadAttention":
        """Build from an nn.MultiheadAttention, carrying its weights over exactly (and its train/eval state).

        copy=False reuses mha's Parameter objects instead of copying them (no extra memory; an optimizer that
        holds them keeps working)."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects an nn.MultiheadAttention, got {type(mha).__name__}")
        ref = mha.in_proj_weight if mha._qkv_same_embed_dim else mha.q_proj_weight
        new = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
                  add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim,
                  vdim=mha.vdim, batch_first=mha.batch_first, device=ref.device, dtype=ref.dtype, **options)
        if copy:
            new.load_state_dict(mha.state_dict(), strict=True)
        else:
            for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                         "bias_k", "bias_v"):
                if getattr(mha, name) is not None:
                    setattr(new, name, getattr(mha, name))
            new.out_proj = mha.out_proj
        return new.train(mha.training)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, {self.mode_repr()}"
        if self.batch_first:
            s += ", batch_first=True"
        return s

    # ------------------------------------------------------------------ forward
    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        r"""Same arguments, shapes and return values as :meth:`torch.nn.MultiheadAttention.forward`.

        query (L, N, E) / key (S, N, kdim) / value (S, N, vdim); (N, L, E) ... with ``batch_first``; or unbatched
        (L, E). Returns ``(attn_output, attn_weights)``; ``attn_weights`` is ``None`` unless ``need_weights`` and
        mode='softmax' (see :meth:`attention_matrix` for the linear modes). Queries that can see no key at all
        (every key masked) get a zero attention output (before ``out_proj``) in every mode.
        ``is_causal=True`` without ``attn_mask`` means a causal mask; with one, the mask is checked to be causal.
        """
        self._count_forward_for_redraw()
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        q, k, v, kpm, mask, layout = self._prepare(query, key, value, key_padding_mask, attn_mask)
        dropout_p = self.dropout if self.training else 0.0
        out, weights = self._attend(q, k, v, kpm, mask, is_causal, layout["n_extra"], need_weights, dropout_p)
        out = self.out_proj(out.transpose(1, 2).reshape(layout["batch"], layout["tgt_len"], self.embed_dim))
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if layout["unbatched"]:
            return out[0], (weights[0] if weights is not None else None)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    @torch.no_grad()
    def attention_matrix(self, query: Tensor, key: Tensor, key_padding_mask: Optional[Tensor] = None,
                         attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                         is_causal: bool = False) -> Tensor:
        """The (N, L, S) (or (N, H, L, S)) matrix A with attn_output = A @ V that this module's approximation
        implies, for visualisation. It is computed by running the mode's own attention path on an identity
        value matrix (no dropout), so it is exactly what forward uses, and it costs O(L S) memory: use small
        inputs. Columns of extra keys (add_bias_kv, add_zero_attn) come last, as in nn.MultiheadAttention."""
        value = key.new_zeros(key.shape[:-1] + (self.vdim,))
        q, k, _, kpm, mask, layout = self._prepare(query, key, value, key_padding_mask, attn_mask)
        B, H, S_total = k.shape[0], k.shape[1], k.shape[2]
        eye = torch.eye(S_total, dtype=q.dtype, device=q.device).expand(B, H, S_total, S_total)
        weights, _ = self._attend(q, k, eye, kpm, mask, is_causal, layout["n_extra"], False, 0.0)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return weights[0] if layout["unbatched"] else weights

    def _prepare(self, query, key, value, key_padding_mask, attn_mask):
        """Validate nn.MHA-style inputs; project them to heads (B, H, ., head_dim) and append the extra keys."""
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 3-D (batched) or 2-D (unbatched (L, E)), got a {query.dim()}-D tensor "
                             f"of shape {tuple(query.shape)}")
        unbatched = query.dim() == 2
        expected_dim = 2 if unbatched else 3
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != expected_dim:
                raise ValueError(f"query, key and value must all be batched (3-D) or all unbatched (2-D); "
                                 f"query is {query.dim()}-D but {name} is {t.dim()}-D")
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != width:
                raise ValueError(f"{name} has feature size {t.shape[-1]}, expected {width}"
                                 + ("" if name == "query" else " (kdim/vdim of this module)"))
        same_qkv, same_kv = query is key and key is value, key is value

        def batch_major(t):
            return t[None] if unbatched else (t if self.batch_first else t.transpose(0, 1))

        query, key, value = batch_major(query), batch_major(key), batch_major(value)
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
            raise ValueError(f"key and value must have the same batch and sequence sizes, and the batch of query; got "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} "
                             f"(batch-major)")
        kpm = M.check_key_padding_mask(key_padding_mask, B, S, unbatched)
        mask = M.check_attn_mask(attn_mask, B, self.num_heads, L, S, unbatched)

        q, k, v = self._in_projection(query, key, value, same_qkv, same_kv)
        H, d = self.num_heads, self.head_dim
        q, k, v = (t.reshape(B, t.shape[1], H, d).transpose(1, 2) for t in (q, k, v))
        n_extra = 0
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.reshape(1, H, 1, d).expand(B, H, 1, d).to(k.dtype)], dim=2)
            v = torch.cat([v, self.bias_v.reshape(1, H, 1, d).expand(B, H, 1, d).to(v.dtype)], dim=2)
            n_extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, H, 1, d)], dim=2)
            v = torch.cat([v, v.new_zeros(B, H, 1, d)], dim=2)
            n_extra += 1
        layout = {"batch": B, "tgt_len": L, "unbatched": unbatched, "n_extra": n_extra}
        return q, k, v, kpm, mask, layout

    def _in_projection(self, query, key, value, same_qkv, same_kv):
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, bq), F.linear(key, self.k_proj_weight, bk),
                    F.linear(value, self.v_proj_weight, bv))
        w = self.in_proj_weight
        if same_qkv:  # self-attention: one GEMM for all three
            return F.linear(query, w, b).chunk(3, dim=-1)
        q = F.linear(query, w[:E], bq)
        if same_kv:
            k, v = F.linear(key, w[E:], None if b is None else b[E:]).chunk(2, dim=-1)
            return q, k, v
        return q, F.linear(key, w[E:2 * E], bk), F.linear(value, w[2 * E:], bv)

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """nn.TransformerEncoder built with enable_nested_tensor=True hands its layers NestedTensors in inference.
        Pad them, attend with the padding masked, and return a NestedTensor of the same structure."""
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError("masks cannot be combined with NestedTensor inputs: the nesting already encodes lengths")
        if not (query.is_nested and key.is_nested and value.is_nested):
            raise ValueError("query, key and value must all be NestedTensors or all be dense tensors")
        q_lens = [t.shape[0] for t in query.unbind()]
        k_lens = [t.shape[0] for t in key.unbind()]
        pad = {id(t): t.to_padded_tensor(0.0) for t in (query, key, value)}  # (B, len, E) each
        q_pad, k_pad, v_pad = pad[id(query)], pad[id(key)], pad[id(value)]
        kpm = torch.arange(k_pad.shape[1], device=k_pad.device)[None] >= torch.tensor(k_lens, device=k_pad.device)[:, None]
        if not self.batch_first:
            q_pad, k_pad, v_pad = (t.transpose(0, 1) for t in (q_pad, k_pad, v_pad))
        if query is key and key is value:
            k_pad = v_pad = q_pad
        out, weights = self.forward(q_pad, k_pad, v_pad, key_padding_mask=kpm, need_weights=need_weights,
                                    is_causal=is_causal)
        out = out if self.batch_first else out.transpose(0, 1)
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, q_lens)]), weights
