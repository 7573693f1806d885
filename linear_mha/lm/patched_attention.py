"""linear_mha.patch for the LM stack: SelfAttention with its softmax (local) heads run by a registry method.

The stack's softmax heads are its ``n_local_attn_heads``; with a window as long as the sequence they are exact
causal softmax (tools.train_lm's ``--variant softmax``, the model users train with this stack and then want to
convert). ``patch`` swaps each such SelfAttention for a PatchedSelfAttention that holds the very same submodules
(to_q, to_k, to_v, to_out, gate, conv), keeps rotary embeddings and the global linear heads as they were, and runs
the local heads through the method over every key the query may see (every earlier one when causal): the method's
cost is linear, so it needs no window. A window shorter than the sequence is therefore not kept; ``calibrate``
fits the method to the windowed softmax all the same. Layers without softmax heads are already linear and skipped.

Decoding (``prefill`` / ``step``) keeps the patched heads' queries, keys and values and runs the method's causal
attention over them again for each new position: exactly what ``forward`` gives, at O(t) work per token (the
method's own recurrent state would be O(1); the registry does not expose one yet).
"""
import torch
from torch import nn

from ..adapters import AttentionAdapter, register_adapter
from ..attend import attend_heads
from ..registry import DEFAULT_MODE, causal_methods, create_method
from .padding import padding_of_layer
from .self_attention import SelfAttention

_REUSED = ("to_q", "to_k", "to_v", "to_out", "dropout", "gate", "conv")
_SETTINGS = ("heads", "dim_head", "causal", "kv_heads", "n_local", "window", "blindspot_size", "receives_context",
             "rotary", "attn_dropout")


@register_adapter
class PatchedSelfAttention(AttentionAdapter, SelfAttention):
    """A SelfAttention whose ``n_local`` softmax heads run ``mode`` (any registry method and its options)."""

    kind, reused = "lm", _REUSED

    def __init__(self, attention: SelfAttention, mode: str = DEFAULT_MODE, dwc_kernel=None, **options):
        reason = self.unsupported_reason(attention)
        if reason:
            raise ValueError(f"cannot patch this SelfAttention: {reason}")
        method = create_method(mode, options)
        if dwc_kernel is not None or method.needs_grid:
            raise ValueError(f"{'dwc_kernel' if dwc_kernel is not None else f'mode={mode!r}'} works on an image's "
                             f"token grid, and an LM's tokens are a sequence; leave it out (the stack's local_conv "
                             f"is the sequence form of a local term)")
        if attention.causal and not method.causal:
            raise ValueError(f"mode={mode!r} has no causal form and this layer is causal; causal methods: "
                             f"{causal_methods()}")
        nn.Module.__init__(self)
        for name in _SETTINGS:
            setattr(self, name, getattr(attention, name))
        for name in _REUSED:
            setattr(self, name, getattr(attention, name))
        weight = attention.to_q.weight
        self.init_method(method, self.n_local, self.dim_head, {"device": weight.device, "dtype": weight.dtype})
        self.keep_original(attention)
        self.train(attention.training)

    @classmethod
    def originals(cls):
        return (SelfAttention,)

    @classmethod
    def sequence_length(cls, owner):
        return owner.max_seq_len if isinstance(getattr(owner, "max_seq_len", None), int) else None

    @classmethod
    def unsupported_reason(cls, attention: SelfAttention):
        if attention.n_local == 0:
            return "no softmax heads (n_local_attn_heads=0): every head is already global linear attention"
        return None

    @classmethod
    def from_original(cls, attention: SelfAttention, **options) -> "PatchedSelfAttention":
        return cls(attention, **options)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, patched local heads={self.n_local}, causal={self.causal}, {self.method.describe()}"

    def output_padding(self, x, input_mask=None, *args, padding=None, **kwargs):
        """For ``calibrate``: (B, N, 1) True on padding tokens' own outputs, or None: no kept token reads them,
        and the method does not let a padding token see itself as the windowed softmax does."""
        padding = padding_of_layer("input_mask", input_mask, padding, tuple(x.shape[:2]))
        return None if padding is None else padding[:, :, None]

    def _local_heads(self, q, k, v, padding, dropout_p):  # (B, n_local, N, D) each -> (B, n_local, N, Dv)
        self.method.before_forward(self)
        out, _ = attend_heads(self.method, self.method.state(self), q, k, v, key_padding_mask=padding,
                              is_causal=self.causal, dropout_p=dropout_p)
        return out

    def _local_prefill(self, q, k, v, cache, padding):
        if padding is None:
            padding = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
        cache.update(q=q, k=k, v=v, padding=padding)

    def _local_step(self, q, k, v, cache, t, padding_t):  # (B, n_local, D) each -> (B, n_local, Dv)
        if padding_t is None:
            padding_t = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
        new = {"q": q[:, :, None], "k": k[:, :, None], "v": v[:, :, None], "padding": padding_t[:, None]}
        for key, value in new.items():
            cache[key] = value if key not in cache else torch.cat([cache[key], value], dim=-1 if key == "padding"
                                                                  else 2)
        return self._local_heads(cache["q"], cache["k"], cache["v"], cache["padding"], 0.0)[:, :, -1]
