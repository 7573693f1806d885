"""mode='efficient': Efficient Attention (Shen et al., 2021), softmax(q over features) (softmax(k over the
sequence)ᵀ v): O(N·d²), non-causal."""
import torch

from .. import functional, naive
from ..registry import AttentionMethod, append_extra_keys, register_method


@register_method
class Efficient(AttentionMethod):
    name = "efficient"
    extra_keys = True
    cost = "O(N·d²)"
    summary = "softmax of q over features times softmax of k over the sequence (Shen et al.)"

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None):
        if extra_keys is not None:
            k, v, key_padding_mask = append_extra_keys(k, v, key_padding_mask, extra_keys)
        return functional.efficient_attention(q, k, v, key_padding_mask=key_padding_mask, dropout_p=dropout_p)

    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        # each key feature softmax-normalised over the valid keys, each query over its features
        keys = naive.softmax_weights(k.transpose(-1, -2), naive.visible(1, k.shape[-2], key_padding_mask,
                                                                          device=q.device))  # (B, H, d, S)
        return torch.softmax(q, dim=-1) @ keys

    def flops(self, batch_heads, tokens, head_dim, causal):
        return 4.0 * batch_heads * tokens * head_dim ** 2  # softmax(K)ᵀ V, then softmax(Q) times it
