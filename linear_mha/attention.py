"""LinearMultiheadAttention: nn.MultiheadAttention's parameters, signature and return values, with any attention
method of the registry inside: a linear one, or exact softmax as the reference.

Parameters carry nn.MultiheadAttention's names and shapes in all three layouts (packed in_proj_weight, or
separate q/k/v_proj_weight when kdim/vdim differ), so ``load_state_dict(mha.state_dict())`` loads every
attention weight. Methods with state of their own (Linformer's E/F, FAVOR's projection) accept a state dict
without it: an nn.MultiheadAttention checkpoint has no such keys, and those tensors keep their initialisation.
The module projects its inputs to heads; ``self.method`` (see ``registry``) attends them, through ``attend``.
"""
import inspect
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils.rnn import pad_sequence

from . import masks, torch_models
from .errors import InputError
from .input_ranks import is_unbatched
from .adapters import AttentionAdapter, register_adapter, traced_whole
from .attend import attend_heads, split_for_options
from .local_term import add_local_term
from .output_gate import apply_output_gate
from .plain_linear import call_linear
from .registry import DEFAULT_MODE, create_method
from .token_grid import TokenGrid, resolve_token_grid
from .functional._common import autocast_active, compiling
from .functional.projection import project
from .torch_models import TORCH_MHA


def _disable_torch_fast_path(module, args):
    """Registered as a forward pre-hook so that nn.TransformerEncoderLayer's inference fast path, which checks
    for hooks and otherwise runs exact softmax on in_proj_weight without calling our forward, is never taken."""
    return None


_disable_torch_fast_path.idempotent = True  # run twice, it changes nothing (adapters.traced_whole)


@register_adapter
class LinearMultiheadAttention(AttentionAdapter, nn.Module):
    r"""Drop-in replacement for :class:`torch.nn.MultiheadAttention` with linear-time attention.

    Positional arguments and defaults are nn.MultiheadAttention's. Keyword arguments: ``mode``, the name of an
    attention method of the registry (``linear_mha.available_methods()``, the README's table: the built-in ones and
    any registered with ``linear_mha.register_method``; by default ``"taylor"``, which takes any length, or
    ``"linformer"`` when its options ``seq_len`` / ``proj_k`` / ``param_sharing`` are given), then that method's own
    options (``linear_mha.method_class(mode).options`` lists them, each with its default and help; an option the method
    does not have raises a ValueError listing the ones it has), and ``dwc_kernel``.

    The configured method is ``self.method`` (its options are attributes: ``self.method.seq_len``); ``self.mode``
    is its name. Methods with state of their own (Linformer's E and F, FAVOR+'s projection, learnable maps)
    register it on this module; ``redraw_features()`` draws FAVOR+'s projection again.

    ``dwc_kernel`` (any method; default None): add a depthwise ``dwc_kernel`` x ``dwc_kernel`` convolution of the
    values over the image's token grid to the attention output (FLatten's DWC, MLLA's LePE), the local term linear
    attention lacks. Self-attention over an image only, non-causal; the grid comes from ``forward(...,
    token_grid=TokenGrid(h, w, prefix))`` or from the model (``patch`` finds it for DETR, timm and torchvision ViTs;
    ``linear_mha.track_token_grid`` elsewhere). Its parameters ``dwc_weight``, ``dwc_bias`` start at zero and may
    be absent from a checkpoint.

    ``dropout`` is applied only in training, as each method defines it: exact softmax drops attention
    probabilities, Linformer probabilities over the projected keys; a method without a probability matrix drops
    each key from the numerator with probability ``dropout`` (per sample and head) and rescales the survivors, which
    keeps the expected output equal to the eval output.

    ``need_weights``: only methods that form the weights (``softmax``) return them. The linear methods never form
    the L x S matrix and return ``None`` in its place (callers such as DETR discard it); use
    :meth:`attention_matrix` to get the matrix the approximation implies, e.g. for visualisation.
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, mode=DEFAULT_MODE,
                 dwc_kernel=None, output_gate=False, **options):
        method = create_method(mode, options)  # first: a wrong option fails before anything is allocated
        torch_models.check_arguments(embed_dim, num_heads, dropout, kdim, vdim, dtype)
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
        self.init_method(method, num_heads, self.head_dim, factory_kwargs, dwc_kernel, output_gate)
        self.register_forward_pre_hook(_disable_torch_fast_path)

    # ------------------------------------------------------------------ construction
    def reset_own_parameters(self):
        self.out_proj.reset_parameters()  # drawn before the rest when built, as in nn.MultiheadAttention
        self._reset_parameters()

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
        if not isinstance(mha, TORCH_MHA):
            raise TypeError(f"from_torch expects an nn.MultiheadAttention, got {type(mha).__name__}")
        ref = mha.in_proj_weight if mha._qkv_same_embed_dim else mha.q_proj_weight
        new = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
                  add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim,
                  vdim=mha.vdim, batch_first=mha.batch_first, device=ref.device, dtype=ref.dtype, **options)
        if copy:
            new.load_state_dict(mha.state_dict(), strict=True)
        else:
            _share_parameters(mha, new)
        return new.train(mha.training)

    def to_torch(self) -> nn.MultiheadAttention:
        """The nn.MultiheadAttention this module replaced (or a new one, for a module built directly), holding this
        module's current Parameters."""
        return self.to_original()

    # ------------------------------------------------------------------ as the adapter of nn.MultiheadAttention
    kind = "mha"

    @classmethod
    def matches(cls, module):
        return isinstance(module, TORCH_MHA)

    @classmethod
    def unsupported_reason(cls, module):
        return torch_models.mha_subclass_reason(module)

    @classmethod
    def from_original(cls, mha: nn.MultiheadAttention, **options) -> "LinearMultiheadAttention":
        """The same Parameter objects (so state_dict tensors are equal and an optimizer holding them keeps
        working), device, dtype and train/eval state, with the method of ``options``; ``mha`` is kept."""
        new = cls.from_torch(mha, copy=False, **options)
        new.keep_original(mha)
        return new

    def to_original(self) -> nn.MultiheadAttention:
        original = self.original
        if original is None:
            ref = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
            original = TORCH_MHA(
                self.embed_dim, self.num_heads, dropout=self.dropout, bias=self.in_proj_bias is not None,
                add_bias_kv=self.bias_k is not None, add_zero_attn=self.add_zero_attn, kdim=self.kdim,
                vdim=self.vdim, batch_first=self.batch_first, device=ref.device, dtype=ref.dtype)
        _share_parameters(self, original)
        original.dropout = self.dropout
        return original.train(self.training)

    def original_output(self, args, kwargs):
        """nn.MultiheadAttention's attention output on this call, without forming its weights."""
        kwargs = {key: value for key, value in kwargs.items() if key != "token_grid"}
        return super().original_output(args, {**kwargs, "need_weights": False})[0]

    @classmethod
    def sequence_length(cls, owner):
        return torch_models.sequence_length(owner)

    @classmethod
    def grid_source(cls, owner_name, owner, name):
        return torch_models.grid_source(owner_name, owner, name)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, {self.method.describe()}"
        s += self.extras_repr()
        if self.batch_first:
            s += ", batch_first=True"
        return s

    # ------------------------------------------------------------------ forward
    @traced_whole
    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, token_grid: Optional[TokenGrid] = None) -> Tuple[Tensor, Optional[Tensor]]:
        r"""Same arguments, shapes and return values as :meth:`torch.nn.MultiheadAttention.forward`.

        query (L, N, E) / key (S, N, kdim) / value (S, N, vdim); (N, L, E) ... with ``batch_first``; or unbatched
        (L, E). Returns ``(attn_output, attn_weights)``; ``attn_weights`` is ``None`` unless ``need_weights`` and
        mode='softmax' (see :meth:`attention_matrix` for the linear modes). Queries that can see no key at all
        (every key masked) get a zero attention output (before ``out_proj``) in every mode.
        ``is_causal=True`` without ``attn_mask`` means a causal mask; with one, the mask is checked to be causal.
        ``token_grid`` (not in nn.MultiheadAttention): the grid of the tokens, for ``dwc_kernel`` and methods
        that need it (``agent``), when the model does not provide it (``patch`` / ``track_token_grid``).
        """
        self.method.before_forward(self)
        if query.is_nested and query.dim() != 3:  # an empty one has no rows: 1-D, which torch refuses too
            is_unbatched(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        q, k, v, extra_keys, kpm, mask, layout = self._prepare(query, key, value, key_padding_mask, attn_mask)
        q_gate, v_local = layout["option_inputs"]
        token_grid = resolve_token_grid(self, token_grid)
        out, weights = attend_heads(self.method, self.method.state(self), q, k, v, key_padding_mask=kpm,
                                    attn_mask=mask, is_causal=is_causal, extra_keys=extra_keys,
                                    need_weights=need_weights, dropout_p=self.dropout if self.training else 0.0,
                                    token_grid=token_grid)
        out = apply_output_gate(self, add_local_term(self, out, v_local, kpm, mask, is_causal, token_grid), q_gate,
                                inplace=True)
        heads = out.transpose(1, 2).reshape(layout["batch"], layout["tgt_len"], self.embed_dim)
        out = call_linear(self.out_proj, heads)  # the user's nn.Linear: hooks and wrappers see it called
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if layout["unbatched"]:
            return out[0], (weights[0] if weights is not None else None)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def output_padding(self, *args, **kwargs) -> Optional[Tensor]:
        """For ``calibrate``: a bool mask broadcastable to the attention output of ``forward(*args, **kwargs)``,
        True on the rows that are padding's own, or None. In self-attention (query is key) with a key_padding_mask
        a linear mode zeroes the padded positions as queries too (``_zero_padding``), so those rows are not
        softmax's, and a model that masks those keys never reads them."""
        bound = inspect.signature(self.forward).bind(*args, **kwargs).arguments
        query, kpm = bound["query"], bound.get("key_padding_mask")
        if kpm is None or query is not bound["key"] or query.is_nested or self.method.any_mask:
            return None
        rows = masks.to_forbidden(kpm, "key_padding_mask", self.mode)  # (N, S), or (S,) unbatched
        if query.dim() == 2:
            return rows[:, None]
        return rows[:, :, None] if self.batch_first else rows.t()[:, :, None]

    @torch.no_grad()
    def attention_matrix(self, query: Tensor, key: Tensor, key_padding_mask: Optional[Tensor] = None,
                         attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                         is_causal: bool = False, token_grid: Optional[TokenGrid] = None) -> Tensor:
        """The (N, L, S) (or (N, H, L, S)) matrix A with attn_output = A @ V that this module's approximation
        implies, for visualisation. It is computed by running the mode's own attention path on an identity
        value matrix (no dropout), so it is exactly what forward uses, and it costs O(L S) memory: use small
        inputs. Columns of extra keys (add_bias_kv, add_zero_attn) come last, as in nn.MultiheadAttention. The local
        term of ``dwc_kernel`` is not attention and is not included."""
        value = key.new_zeros(key.shape[:-1] + (self.vdim,))
        q, k, _, extra_keys, kpm, mask, layout = self._prepare(query, key, value, key_padding_mask, attn_mask)
        B, H, S = k.shape[:3]
        n_extra = 0 if extra_keys is None else extra_keys[0].shape[2]
        eye = torch.eye(S + n_extra, dtype=q.dtype, device=q.device).expand(B, H, S + n_extra, S + n_extra)
        if extra_keys is not None:
            extra_keys = (extra_keys[0], eye[:, :, S:])
        weights, _ = attend_heads(self.method, self.method.state(self), q, k, eye[:, :, :S], key_padding_mask=kpm,
                                  attn_mask=mask, is_causal=is_causal, extra_keys=extra_keys,
                                  token_grid=resolve_token_grid(self, token_grid))
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return weights[0] if layout["unbatched"] else weights

    def _prepare(self, query, key, value, key_padding_mask, attn_mask):
        """Validate nn.MHA-style inputs and project them to heads (B, H, ., head_dim); the extra keys of add_bias_kv /
        add_zero_attn come back apart, as (k, v) heads of 1 or 2 positions, or None."""
        unbatched = is_unbatched(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != width:
                raise InputError(f"{name} has feature size {t.shape[-1]}, expected {width}"
                                 + ("" if name == "query" else " (kdim/vdim of this module)"))
        self._check_dtypes(query, key, value)
        same_qkv, same_kv, query_is_key = query is key and key is value, key is value, query is key

        def batch_major(t):
            return t[None] if unbatched else (t if self.batch_first else t.transpose(0, 1))

        query, key, value = batch_major(query), batch_major(key), batch_major(value)
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
            raise InputError(f"key and value must have the same batch and sequence sizes, and the batch of query; got "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} "
                             f"(batch-major)")
        kpm = masks.check_key_padding_mask(key_padding_mask, B, S, unbatched, key.device)
        mask = masks.check_attn_mask(attn_mask, B, self.num_heads, L, S, unbatched, key.device)
        if kpm is not None and not self.method.any_mask:
            query, key, value = self._zero_padding(query, key, value, kpm, query_is_key, same_kv)

        q, k, v, option_inputs = self._in_projection(query, key, value, same_qkv, same_kv, query_is_key)
        H, d = self.num_heads, self.head_dim
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self.bias_k.reshape(1, H, 1, d).expand(B, H, 1, d).to(k.dtype))
            extra_v.append(self.bias_v.reshape(1, H, 1, d).expand(B, H, 1, d).to(v.dtype))
        if self.add_zero_attn:
            extra_k.append(k.new_zeros(B, H, 1, d))
            extra_v.append(v.new_zeros(B, H, 1, d))
        extra_keys = (torch.cat(extra_k, dim=2), torch.cat(extra_v, dim=2)) if extra_k else None
        layout = {"batch": B, "tgt_len": L, "unbatched": unbatched, "option_inputs": option_inputs}
        return q, k, v, extra_keys, kpm, mask, layout

    def _check_dtypes(self, query, key, value):
        """Inputs in the parameters' dtype (torch's own error names neither), unless autocast casts them."""
        weight = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
        if not autocast_active(query.device):
            for name, t in (("query", query), ("key", key), ("value", value)):
                if t.dtype != weight.dtype:
                    raise TypeError(f"{name} is {t.dtype} but this module's parameters are {weight.dtype}; convert "
                                    f"the input ({name}.to({weight.dtype})) or the module (module.to({t.dtype}))")

    def _zero_padding(self, query, key, value, kpm, query_is_key, same_kv):
        """The linear methods' inputs with masked positions zeroed before the projection: garbage there (even NaN or
        inf) then reaches neither an output nor a gradient, in_proj_weight's included (a projected NaN row times a
        zero gradient is NaN). In self-attention the masked positions are queries too and are zeroed with the keys;
        their own outputs are padding's. (mode='softmax' computes what nn.MultiheadAttention does.)"""
        forbidden = masks.to_forbidden(kpm, "key_padding_mask", self.mode)
        if not compiling() and not bool(forbidden.any()):  # a graph takes the masked path, exact for any mask
            return query, key, value
        rows = forbidden[:, :, None]
        key = key.masked_fill(rows, 0.0)
        value = key if same_kv else value.masked_fill(rows, 0.0)
        return (key if query_is_key else query), key, value

    def _in_projection(self, query, key, value, same_qkv, same_kv, query_is_key):
        """q, k, v projected and split into heads: (B, H, L or S, d) each, and (q, v) as the output gate and the
        local term are to read them. Inputs that are one tensor share one projection (DETR's encoder: query is key),
        split into several (split_heads), which hands the compiled backward's side-by-side gradients back without a
        copy; a split part an option reads too is handed out again for it, so that its two gradients are summed
        by the split, in place, rather than by autograd into a new tensor."""
        E, H = self.embed_dim, self.num_heads
        b = self.in_proj_bias
        weight = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
        if b is not None and b.dtype != weight.dtype:  # torch adds a bias of another dtype in the weights' dtype
            b = b.to(weight.dtype)
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])

        def heads(t):
            return t.reshape(t.shape[0], t.shape[1], H, self.head_dim).transpose(1, 2)

        if not self._qkv_same_embed_dim:
            q, k, v = (heads(project(query, self.q_proj_weight, bq)), heads(project(key, self.k_proj_weight, bk)),
                       heads(project(value, self.v_proj_weight, bv)))
            return q, k, v, (q, v)
        w = self.in_proj_weight
        if same_qkv:  # self-attention: one GEMM for all three
            (q, k, v), q2, v2 = split_for_options(self, project(query, w, b), 3, q_at=0, v_at=2)
        elif query_is_key:  # positions added to queries and keys, not to values (DETR)
            (q, k), q2, v2 = split_for_options(self, project(query, w[:2 * E], None if b is None else b[:2 * E]),
                                               2, q_at=0)
            v = heads(project(value, w[2 * E:], bv))
        elif same_kv:
            q, q2 = heads(project(query, w[:E], bq)), None
            (k, v), _, v2 = split_for_options(self, project(key, w[E:], None if b is None else b[E:]), 2, v_at=1)
        else:
            q, k, v = (heads(project(query, w[:E], bq)), heads(project(key, w[E:2 * E], bk)),
                       heads(project(value, w[2 * E:], bv)))
            q2 = v2 = None
        return q, k, v, (q if q2 is None else q2, v if v2 is None else v2)

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """nn.TransformerEncoder built with enable_nested_tensor=True hands its layers NestedTensors in inference.
        Pad them, attend with the padding masked, and return a NestedTensor of the same structure."""
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError("masks cannot be combined with NestedTensor inputs: the nesting already encodes lengths")
        if not (query.is_nested and key.is_nested and value.is_nested):
            raise ValueError("query, key and value must all be NestedTensors or all be dense tensors")
        q_lens = [t.shape[0] for t in query.unbind()]
        k_lens = [t.shape[0] for t in key.unbind()]
        if not q_lens:  # no sequences at all: nothing to attend, an empty batch back
            return query, None
        # unbind + pad_sequence rather than to_padded_tensor: jagged-layout tensors lack it before torch 2.6
        pad = {id(t): pad_sequence(t.unbind(), batch_first=True) for t in (query, key, value)}  # (B, len, E) each
        q_pad, k_pad, v_pad = pad[id(query)], pad[id(key)], pad[id(value)]
        kpm = torch.arange(k_pad.shape[1], device=k_pad.device)[None] >= torch.tensor(k_lens, device=k_pad.device)[:, None]
        if not self.batch_first:
            q_pad, k_pad, v_pad = (t.transpose(0, 1) for t in (q_pad, k_pad, v_pad))
        if query is key and key is value:
            k_pad = v_pad = q_pad
        out, weights = self.forward(q_pad, k_pad, v_pad, key_padding_mask=kpm, need_weights=need_weights,
                                    is_causal=is_causal)
        out = out if self.batch_first else out.transpose(0, 1)
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, q_lens)], layout=query.layout), weights


_PARAMETERS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v")


def _share_parameters(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` the very Parameter objects of ``source`` (nn.MultiheadAttention's names, both classes)."""
    for name in _PARAMETERS:
        if getattr(source, name) is not None:
            setattr(target, name, getattr(source, name))
    target.out_proj = source.out_proj
