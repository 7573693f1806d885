"""linear_mha.patch for the LM stack: SelfAttention with its softmax (local) heads run by a registry method.

The stack's softmax heads are its ``n_local_attn_heads``; with a window as long as the sequence they are exact
causal softmax (tools.train_lm's ``--variant softmax``, the model users train with this stack and then want to
convert). ``patch`` swaps each such SelfAttention for a PatchedSelfAttention that holds the very same submodules
(to_q, to_k, to_v, to_out, gate, conv, short_conv, head_norm), keeps rotary embeddings and the global linear heads
as they were, and runs the local heads through the method over every key the query may see (every earlier one when
causal): the method's cost is linear, so it needs no window. A window shorter than the sequence is therefore not
kept; ``calibrate`` fits the method to the windowed softmax all the same. Layers without softmax heads are already
linear and skipped.

Decoding (``prefill`` / ``step``) runs the method's own decoding through ``attend.prefill_heads`` / ``step_heads``:
a recurrent method (every feature-map method, hedgehog with a window included) keeps a state of fixed size, so each
token costs the same however long the context; any other causal method keeps the keys and values (O(t) per token).
"""
from torch import nn

from ..adapters import AttentionAdapter, register_adapter
from ..registry import DEFAULT_MODE, causal_methods, create_method
from .padding import padding_of_layer
from .self_attention import SelfAttention

_REUSED = ("to_q", "to_k", "to_v", "to_out", "dropout", "gate", "conv", "short_conv", "head_norm")
_SETTINGS = ("heads", "dim_head", "causal", "kv_heads", "n_local", "window", "blindspot_size", "receives_context",
             "rotary", "attn_dropout", "global_method")


@register_adapter
class PatchedSelfAttention(AttentionAdapter, SelfAttention):
    """A SelfAttention whose ``n_local`` softmax heads run ``mode`` (any registry method and its options)."""

    kind, reused = "lm", _REUSED

    def __init__(self, attention: SelfAttention, mode: str = DEFAULT_MODE, dwc_kernel=None, output_gate=False,
                 **options):
        reason = self.unsupported_reason(attention)
        if reason:
            raise ValueError(f"cannot patch this SelfAttention: {reason}")
        if output_gate:
            raise ValueError("output_gate is not available for the LM stack's SelfAttention, whose local heads share "
                             "one output with its global heads; the stack has its own gate over all heads (build "
                             "it with attn_gate=True), or leave output_gate out")
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
        for name in () if self.global_method is None else self.global_method.state_names:
            tensor = getattr(attention, name)  # the global heads' own tensors, the very same ones
            if tensor is None or isinstance(tensor, nn.Parameter):
                self.register_parameter(name, tensor)
            else:
                self.register_buffer(name, tensor)
        weight = attention.to_q.weight
        self.init_method(method, self.n_local, self.dim_head, {"device": weight.device, "dtype": weight.dtype})
        self.local_method = method  # the local heads run the patched method
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
