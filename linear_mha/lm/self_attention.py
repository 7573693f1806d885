"""The attention layer of the linear-attention transformer: local heads + global linear heads, each group running a
method of linear_mha's registry.

The first ``n_local_attn_heads`` heads attend within local blocks (``block_local``: softmax over the query's block
of ``local_attn_window_size`` positions and the block before, and after when not causal), the others globally with a
linear method: ``global_mode`` (default ``efficient``, Efficient Attention, when not causal or attending to a
context; ``feature_softmax`` when causal) and its ``global_options``. Every registered method with the needed form
can run the global heads; ``linear_mha.patch`` swaps the local heads' method (patched_attention.py).
Optional improvements on the output, all before ``to_out``:

- ``local_conv``: a depthwise 3-tap convolution over the values added to the attention output (as in the
  "local enhancement" of linear-attention vision models), restoring the sharp local mixing linear attention
  lacks. Causal models pad it on the left only, so it never reads a later token. Self-attention only: in a
  context layer queries and values belong to different sequences.
- ``attn_gate``: the output is multiplied feature-wise by sigmoid(W_g x).
- ``head_norm``: each head's attention output is RMS-normalised (one learned scale per channel, shared by the
  heads), as Gated DeltaNet, GLA and RetNet normalise theirs before the output gate: a state read by a query is not
  a weighted mean of values, and its size drifts with the keys written. Applied before the local term is added.
  With ``attn_gate`` it makes a gated norm as theirs, with a sigmoid gate where Gated DeltaNet's gate is SiLU.

And one on the input: ``short_conv`` = K > 0 convolves the query, key and value projections along the positions, a
causal depthwise convolution of K taps per channel (no bias), before the heads' method (and rotary) sees them: the
"short convolution" that DeltaNet, Gated DeltaNet and Mamba-2 put before their recurrence (K = 4 in
flash-linear-attention), which lets a key be formed from the few tokens before it. Each method then prepares its
queries and keys as it always does (the delta rule's SiLU and unit norm follow the convolution, as in those layers;
the values get no SiLU here, where flash-linear-attention's layers apply one). Causal self-attention only; padded
positions enter it as zeros, so they reach no later position through it.

``attn_dropout`` drops attention weights in local heads and whole keys (numerator only) in global heads;
``dropout`` (the transformer's ``attn_layer_dropout``) acts on the layer output. ``blindspot_size`` > 1 (causal
global heads with a feature-map method) hides a query's own bucket of positions (blindspot.py).

Called directly, the layer takes keep-masks (``input_mask``, ``context_mask``: True = keep); inside the
transformer's stack it gets padding masks (``padding``, ``context_padding``, ``padding_t``: True = padding),
converted once at the transformer's boundary (padding.py). ``prefill`` and ``step`` belong to the stack and decode
every head group through ``attend.prefill_heads`` / ``step_heads``: O(1) work per token for recurrent methods.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attend import attend_heads, prefill_heads, step_heads
from ..methods.kernel import FeatureMapMethod
from ..registry import bidirectional_methods, causal_methods, create_method
from .blindspot import bucket_attention, bucket_prefill, bucket_step
from .padding import padding_of_layer
from .positional import apply_rotary, rotary_cos_sin


class SelfAttention(nn.Module):
    def __init__(
        self,
        dim: int,
        heads: int = 8,
        causal: bool = False,
        dim_head: Optional[int] = None,
        blindspot_size: int = 1,
        n_local_attn_heads: int = 0,
        local_attn_window_size: int = 128,
        receives_context: bool = False,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        one_kv_head: bool = False,
        rotary: bool = False,
        attn_gate: bool = False,
        local_conv: bool = False,
        short_conv: int = 0,
        head_norm: bool = False,
        global_mode: Optional[str] = None,
        global_options: Optional[dict] = None,
    ):
        super().__init__()
        if dim_head is None:
            if dim % heads:
                raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}), or pass dim_head")
            dim_head = dim // heads
        if not 0 <= n_local_attn_heads <= heads:
            raise ValueError(f"n_local_attn_heads must be in [0, heads={heads}], got {n_local_attn_heads}")
        if not isinstance(blindspot_size, int) or blindspot_size < 1:
            raise ValueError(f"blindspot_size must be a positive int, got {blindspot_size!r}")
        if blindspot_size > 1 and not causal:
            raise ValueError("blindspot_size only applies to causal global heads; set causal=True or blindspot_size=1")
        if n_local_attn_heads and local_attn_window_size < 1:
            raise ValueError(f"local_attn_window_size must be >= 1, got {local_attn_window_size}")
        if receives_context and (n_local_attn_heads or local_conv or short_conv or causal):
            raise ValueError("a context-attention layer is non-causal, global only and has no local_conv or "
                             "short_conv")
        if isinstance(short_conv, bool) or not isinstance(short_conv, int) or short_conv < 0:
            raise ValueError(f"short_conv is the causal convolution's number of taps, an int >= 0 (0: none; 4 is "
                             f"DeltaNet's); got {short_conv!r}")
        if short_conv and not causal:
            raise ValueError("short_conv convolves queries, keys and values over the positions before each one: it "
                             "belongs to causal self-attention; build the layer with causal=True or leave it out")
        if rotary and dim_head % 2:
            raise ValueError(f"rotary embeddings need an even dim_head, got {dim_head}")
        self.heads, self.dim_head, self.causal = heads, dim_head, causal
        self.kv_heads = 1 if one_kv_head else heads
        self.n_local, self.window = n_local_attn_heads, local_attn_window_size
        self.blindspot_size, self.receives_context, self.rotary = blindspot_size, receives_context, rotary
        self.attn_dropout = attn_dropout
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, dim_head * self.kv_heads, bias=False)
        self.to_v = nn.Linear(dim, dim_head * self.kv_heads, bias=False)
        self.to_out = nn.Linear(inner, dim)
        self.dropout = nn.Dropout(dropout)
        self.gate = nn.Linear(dim, inner) if attn_gate else None
        self.head_norm = nn.RMSNorm(dim_head, eps=1e-5) if head_norm else None
        self.conv = nn.Conv1d(inner, inner, 3, groups=inner, bias=False) if local_conv else None
        qkv = inner + 2 * dim_head * self.kv_heads
        self.short_conv = nn.Conv1d(qkv, qkv, short_conv, groups=qkv, bias=False) if short_conv else None
        self.local_method = (create_method("block_local", {"window": local_attn_window_size})
                             if n_local_attn_heads else None)
        self.global_method = None
        if n_local_attn_heads < heads:
            default = "feature_softmax" if causal else "efficient"
            self.global_method = create_method(global_mode or default, dict(global_options or {}))
            self._check_global_method()
            self.global_method.install(self, heads - n_local_attn_heads, dim_head,
                                       {"device": self.to_q.weight.device, "dtype": self.to_q.weight.dtype})
        elif global_mode is not None or global_options:
            raise ValueError("global_mode / global_options choose the global heads' method, and every head is local "
                             "(n_local_attn_heads = heads); drop them or keep some heads global")

    def _check_global_method(self):
        method = self.global_method
        if self.causal and not method.causal:
            raise ValueError(f"global_mode={method.name!r} has no causal form and this layer is causal; causal "
                             f"methods: {', '.join(causal_methods())}")
        if not self.causal and not method.bidirectional:
            raise ValueError(f"global_mode={method.name!r} is causal only and this layer is not causal; build the "
                             f"model with causal=True, or pick a method of {', '.join(bidirectional_methods())}")
        if method.self_attention_only and self.receives_context:
            raise ValueError(f"global_mode={method.name!r} needs self-attention, and this layer attends to a context")
        if method.needs_grid:
            raise ValueError(f"global_mode={method.name!r} attends over an image's token grid; an LM's tokens are a "
                             f"sequence")
        if self.blindspot_size > 1 and not isinstance(method, FeatureMapMethod):
            raise ValueError(f"blindspot_size > 1 buckets the keys of a feature-map method (e.g. feature_softmax, "
                             f"taylor); global_mode={method.name!r} is not one")

    def _heads(self, t: Tensor, n_heads: int) -> Tensor:  # (B, N, n_heads * D) -> (B, H, N, D)
        t = t.reshape(*t.shape[:-1], n_heads, self.dim_head).transpose(-2, -3)
        return t.expand(t.shape[0], self.heads, *t.shape[2:]) if n_heads == 1 else t

    def _project(self, x, context=None, positions=None, padding=None, cache=None):
        """-> q, k, v (B, H, ., D): the projections, through the short convolution (which continues from and
        updates ``cache`` when decoding), then rotary (self-attention only)."""
        if self.receives_context and context is None:
            raise ValueError("this layer attends to a context: pass context=(B, S, dim) encoder output")
        src = context if self.receives_context else x
        q, k, v = self.to_q(x), self.to_k(src), self.to_v(src)
        if self.short_conv is not None:
            q, k, v = self._short_conv(torch.cat([q, k, v], dim=-1), padding, cache).split(
                [q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if self.rotary and not self.receives_context:
            positions = torch.arange(x.shape[1], device=x.device) if positions is None else positions
            cos, sin = rotary_cos_sin(positions, self.dim_head, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def _short_conv(self, qkv: Tensor, padding: Optional[Tensor], cache: Optional[dict]) -> Tensor:
        """qkv (B, N, C) -> (B, N, C), each position mixing itself and the K - 1 before it; a padded position enters
        as zeros. With a cache it continues from the K - 1 inputs a previous call kept there (zeros at the start)
        and keeps its own last K - 1: a prompt and then single positions give the full sequence's outputs.

        The weights are a depthwise Conv1d's (as flash-linear-attention keeps them), applied as K shifted products
        in the (B, N, C) layout: Conv1d would hand back channels-first rows, whose transpose the compiled delta rule
        and feature maps do not take, and its CPU backward costs more than the products."""
        if padding is not None:
            qkv = qkv.masked_fill(padding[..., None], 0.0)
        weight = self.short_conv.weight[:, 0].to(qkv.dtype)  # (C, K): tap K - 1 weighs the position itself
        taps, n = weight.shape[1], qkv.shape[1]
        before = None if cache is None else cache.get("short_conv")
        window = torch.cat([qkv.new_zeros(qkv.shape[0], taps - 1, qkv.shape[2]) if before is None else before, qkv],
                           dim=1)  # (B, K - 1 + N, C)
        if cache is not None:
            cache["short_conv"] = window[:, window.shape[1] - (taps - 1):].clone()  # a view would keep the prompt
        out = window[:, :n] * weight[:, 0]
        for tap in range(1, taps):
            out = out + window[:, tap:tap + n] * weight[:, tap]
        return out

    def forward(self, x, input_mask=None, context=None, context_mask=None, positions=None, *, padding=None,
                context_padding=None):
        """x (B, N, dim) -> (B, N, dim); input_mask (B, N), context_mask (B, S) bool, True = keep, or the
        stack's padding (B, N), context_padding (B, S), True = padding."""
        b, n, _ = x.shape
        padding = padding_of_layer("input_mask", input_mask, padding, (b, n))
        if context is not None:
            context_padding = padding_of_layer("context_mask", context_mask, context_padding,
                                               (b, context.shape[1]))
        elif context_mask is not None:
            raise ValueError("context_mask was given without context")
        q, k, v = self._project(x, context, positions, padding)
        return self._attend(x, q, k, v, padding, context_padding)

    def _attend(self, x, q, k, v, padding, context_padding):
        kv_padding = context_padding if self.receives_context else padding
        p = self.attn_dropout if self.training else 0.0
        outs = []
        if self.n_local:
            l = self.n_local
            outs.append(self._local_heads(q[:, :l], k[:, :l], v[:, :l], padding, p))
        if self.global_method is not None:
            g = slice(self.n_local, None)
            outs.append(self._global_heads(q[:, g], k[:, g], v[:, g], kv_padding, p))
        return self._output(x, outs, v, padding)

    def _output(self, x, outs, v, padding):
        """The head groups' outputs (B, H_group, N, Dv) joined (and normalised), the local term and the gate applied,
        projected."""
        b, n, _ = x.shape
        attn = self._joined(outs)
        if self.conv is not None:
            attn = attn + self._conv(v, padding)
        attn = attn.transpose(1, 2).reshape(b, n, -1)
        if self.gate is not None:
            attn = attn * torch.sigmoid(self.gate(x))
        return self.dropout(self.to_out(attn))

    def _joined(self, outs):
        """The head groups' outputs (B, H_group, ..., Dv) -> (B, H, ..., Dv), each head normalised with head_norm."""
        attn = torch.cat(outs, dim=1)
        return attn if self.head_norm is None else self.head_norm(attn)

    # The local heads, apart so linear_mha.patch can swap their method (patched_attention.py).
    def _local_heads(self, q, k, v, padding, dropout_p):  # (B, n_local, N, D) each -> (B, n_local, N, Dv)
        self.local_method.before_forward(self)
        return attend_heads(self.local_method, self.local_method.state(self), q, k, v, key_padding_mask=padding,
                            is_causal=self.causal, dropout_p=dropout_p)[0]

    def _global_heads(self, q, k, v, padding, dropout_p):  # (B, H - n_local, ., D) each -> (B, H - n_local, N, Dv)
        method = self.global_method
        method.before_forward(self)
        if self.causal and self.blindspot_size > 1:
            return bucket_attention(method, method.state(self), q, k, v, padding, self.blindspot_size, dropout_p)
        return attend_heads(method, method.state(self), q, k, v, key_padding_mask=padding, is_causal=self.causal,
                            dropout_p=dropout_p)[0]

    def prefill(self, x, cache, padding=None, context=None, context_padding=None):
        """``forward`` over positions 0..N-1 that also leaves in ``cache`` what ``step`` would have after them."""
        if not (self.causal or self.receives_context):
            raise ValueError("prefill() decodes causal models; build the model with causal=True")
        q, k, v = self._project(x, context, padding=padding, cache=cache)
        if self.receives_context:
            cache["ctx_k"], cache["ctx_v"] = k, v
            return self._attend(x, q, k, v, padding, context_padding)
        outs = self._decode(q, k, v, cache, padding)
        if self.conv is not None:
            vm = v if padding is None else v.masked_fill(padding[:, None, :, None], 0.0)
            b, h, n, d = vm.shape
            flat = vm[:, :, max(0, n - 2):].permute(0, 1, 3, 2).reshape(b, h * d, -1)
            cache["conv"] = F.pad(flat, (2 - flat.shape[-1], 0))
        return self._output(x, outs, v, padding)

    def _decode(self, q, k, v, cache, padding, t=None):
        """Each head group's outputs, decoding through its method: a prompt (t None; q, k, v (B, H, N, D), padding
        (B, N)) that fills the group's cache, or position t (q, k, v (B, H, D), padding (B,))."""
        groups = []
        if self.n_local:
            groups.append(("local", self.local_method, slice(None, self.n_local)))
        if self.global_method is not None:
            groups.append(("global", self.global_method, slice(self.n_local, None)))
        outs = []
        for name, method, heads in groups:
            args = (method, method.state(self), q[:, heads], k[:, heads], v[:, heads], cache.setdefault(name, {}))
            if name == "global" and self.blindspot_size > 1:
                outs.append(bucket_prefill(*args, padding, self.blindspot_size) if t is None
                            else bucket_step(*args, t, padding, self.blindspot_size))
            else:
                outs.append(prefill_heads(*args, key_padding_mask=padding) if t is None
                            else step_heads(*args, padding=padding))
        return outs

    def _conv(self, v: Tensor, padding: Optional[Tensor]) -> Tensor:
        b, h, n, d = v.shape
        if padding is not None:
            v = v.masked_fill(padding[:, None, :, None], 0.0)
        flat = v.permute(0, 1, 3, 2).reshape(b, h * d, n)
        flat = F.pad(flat, (2, 0) if self.causal else (1, 1))
        return self.conv(flat).reshape(b, h, d, n).permute(0, 1, 3, 2)

    def step(self, x, cache, t, padding_t=None, context=None, context_padding=None):
        """Decode position t: x (B, dim) -> (B, dim); ``cache`` (a dict) carries this layer's state."""
        if not (self.causal or self.receives_context):
            raise ValueError("step() decodes causal models; build the model with causal=True")
        b = x.shape[0]
        if self.receives_context:
            if context is None:
                raise ValueError("this layer attends to a context: pass context=(B, S, dim) to step()/generate()")
            if "ctx_k" not in cache:  # the context is fixed while decoding: project it once
                cache["ctx_k"] = self._heads(self.to_k(context), self.kv_heads)
                cache["ctx_v"] = self._heads(self.to_v(context), self.kv_heads)
            q, method = self._heads(self.to_q(x)[:, None], self.heads), self.global_method
            attn, _ = attend_heads(method, method.state(self), q, cache["ctx_k"], cache["ctx_v"],
                                   key_padding_mask=context_padding)
            attn = self._joined([attn])
        else:
            q, k, v = self._project(x[:, None], positions=torch.tensor([t], device=x.device),
                                    padding=None if padding_t is None else padding_t[:, None], cache=cache)
            outs = self._decode(q[:, :, 0], k[:, :, 0], v[:, :, 0], cache, padding_t, t)
            attn = self._joined(outs)[:, :, None]
            if self.conv is not None:
                attn = attn + self._conv_step(v, padding_t, cache)
        attn = attn.transpose(1, 2).reshape(b, -1)
        if self.gate is not None:
            attn = attn * torch.sigmoid(self.gate(x))
        return self.dropout(self.to_out(attn))

    def _conv_step(self, v: Tensor, padding_t: Optional[Tensor], cache: dict) -> Tensor:
        b, h, _, d = v.shape
        if padding_t is not None:
            v = v.masked_fill(padding_t[:, None, None, None], 0.0)
        flat = v.permute(0, 1, 3, 2).reshape(b, h * d, 1)
        history = cache.get("conv", flat.new_zeros(b, h * d, 2))
        window = torch.cat([history, flat], dim=-1)
        cache["conv"] = window[..., 1:]
        return self.conv(window).reshape(b, h, d, 1).permute(0, 1, 3, 2)
