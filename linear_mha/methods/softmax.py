"""mode='softmax': exact attention, what nn.MultiheadAttention computes; the reference for every other method."""
import torch

from .. import functional, naive
from ..registry import AttentionMethod, register_method


@register_method
class Softmax(AttentionMethod):
    name = "softmax"
    causal = True
    any_mask = True
    returns_weights = True
    extra_keys = True
    exact = True
    cost = "O(L·S·d); O(L·S) memory with weights, SDPA otherwise"
    summary = "exact softmax(q kᵀ/√d) v: every mask nn.MultiheadAttention accepts, and the weights"

    def attend(self, q, k, v, state, *, attn_bias=None, dropout_p=0.0, extra_keys=None):
        return self.attend_with_weights(q, k, v, state, attn_bias=attn_bias, dropout_p=dropout_p,
                                        extra_keys=extra_keys, need_weights=False)[0]

    def attend_with_weights(self, q, k, v, state, *, attn_bias=None, dropout_p=0.0, extra_keys=None,
                            need_weights=True):
        if extra_keys is not None:
            k, v = torch.cat([k, extra_keys[0]], dim=2), torch.cat([v, extra_keys[1]], dim=2)
        return functional.softmax(q, k, v, attn_bias=attn_bias, dropout_p=dropout_p, need_weights=need_weights)

    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        seen = naive.visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device)
        return naive.softmax_weights(naive.scaled_scores(q, k), seen)

    def flops(self, batch_heads, tokens, head_dim, causal):
        full = 4.0 * batch_heads * tokens ** 2 * head_dim  # q kᵀ and the weights times v
        return full / 2 if causal else full
