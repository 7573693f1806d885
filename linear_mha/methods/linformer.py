"""mode='linformer' (Wang et al., 2020): keys and values projected along the sequence onto proj_k positions by
E, F (proj_k x seq_len), then softmax over those: O(N·k). Sequences shorter than seq_len use E's first S columns."""
import math

import torch
from torch import nn

from .. import functional, naive
from ..registry import AttentionMethod, Option, one_of, positive_int, register_method

PARAM_SHARING = ("none", "headwise", "kv", "layerwise")


@register_method
class Linformer(AttentionMethod):
    name = "linformer"
    options = {
        "seq_len": Option(100, positive_int, "longest key sequence; E and F have this many columns"),
        "proj_k": Option(128, positive_int, "projected length k"),
        "param_sharing": Option("none", one_of(*PARAM_SHARING),
                                "'none': E_i, F_i per head; 'headwise': one E, F per layer; 'kv': E = F per layer; "
                                "'layerwise': one E = F for every layer (patch ties it, or pass shared_projection)"),
        "shared_projection": Option(None, None, "the nn.Parameter (proj_k, seq_len) of param_sharing='layerwise'"),
    }
    extra_keys = True
    sequence_length_option = "seq_len"
    variants = {"headwise": {"param_sharing": "headwise"}, "kv": {"param_sharing": "kv"}}
    cost = "O(L·k·d)"
    summary = "keys and values projected onto k positions along the sequence, then softmax (S ≤ seq_len)"

    @classmethod
    def check_options(cls, options):
        shared = options["shared_projection"]
        if shared is None:
            return
        if options["param_sharing"] != "layerwise":
            raise ValueError("shared_projection is only used with param_sharing='layerwise'")
        if not isinstance(shared, nn.Parameter):
            raise TypeError(f"shared_projection must be an nn.Parameter (a plain tensor would be neither trained "
                            f"nor saved); got {type(shared).__name__}, wrap it in nn.Parameter(...)")
        expected = (options["proj_k"], options["seq_len"])
        if tuple(shared.shape) != expected:
            raise ValueError(f"shared_projection must have shape (proj_k, seq_len) = {expected}, "
                             f"got {tuple(shared.shape)}")

    def describe(self):
        return (f"mode='linformer', seq_len={self.seq_len}, proj_k={self.proj_k}, "
                f"param_sharing={self.param_sharing!r}")

    def _new_projection(self, shape, factory_kwargs):
        # E ~ N(0, 1/k), so a projected key has the scale of a key summed over seq_len/k positions.
        return nn.Parameter(torch.randn(shape, **factory_kwargs) / math.sqrt(self.proj_k))

    def init_state(self, num_heads, head_dim, factory_kwargs):
        shape = (self.proj_k, self.seq_len)
        if self.param_sharing == "none":
            shape = (num_heads,) + shape
        if self.param_sharing in ("none", "headwise"):
            return {"e_proj": self._new_projection(shape, factory_kwargs),
                    "f_proj": self._new_projection(shape, factory_kwargs)}
        shared, self.shared_projection = self.shared_projection, None  # the module holds it from here on
        return {"e_proj": shared if shared is not None else self._new_projection(shape, factory_kwargs),
                "f_proj": None}

    @classmethod
    def layer_shared(cls, options):
        return ("e_proj", "shared_projection") if options.get("param_sharing") == "layerwise" else None

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None):
        S = k.shape[2]
        if S > self.seq_len:
            raise ValueError(f"sequence length S={S} exceeds seq_len={self.seq_len} of this Linformer attention; "
                             f"build it (or patch the model) with seq_len >= {S}")
        # Extra keys (add_bias_kv / add_zero_attn) join after the projection: projected with the sequence, their
        # column of E / F would move with S and with the amount of padding.
        extra = {} if extra_keys is None else dict(extra_k=extra_keys[0], extra_v=extra_keys[1])
        out, _ = functional.linformer(q, k, v, state["e_proj"], state["f_proj"], key_padding_mask=key_padding_mask,
                                      dropout_p=dropout_p, **extra)
        return out

    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        """softmax(q (E k)ᵀ / sqrt(d)) F: the (L, S) matrix the projections imply, masked keys' columns zero."""
        e = state["e_proj"]
        f = e if state["f_proj"] is None else state["f_proj"]
        S = k.shape[-2]
        e, f = e[..., :S].to(q.dtype), f[..., :S].to(q.dtype)
        if key_padding_mask is not None:
            keep = (~key_padding_mask)[:, None, None, :].to(q.dtype)  # (B, 1, 1, S)
            e, f = e * keep, f * keep
        projected = e @ k
        seen = naive.visible(q.shape[-2], projected.shape[-2], device=q.device)
        return naive.softmax_weights(naive.scaled_scores(q, projected), seen) @ f

    def flops(self, batch_heads, tokens, head_dim, causal):
        return 8.0 * batch_heads * tokens * self.proj_k * head_dim  # E K, F V, the scores, the weights times F V
