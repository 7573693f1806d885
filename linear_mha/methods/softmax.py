"""mode='softmax': exact attention, what nn.MultiheadAttention computes; the reference for every other method.

``rope=True`` gives it the rotary position the linear methods take, so that they can be compared with the
strongest softmax baseline: q and k rotated by their positions before the softmax (RoPE), on the token grid when
the module knows one (2-D, the linear methods' rotation; Heo et al., ECCV 2024, "RoPE-Axial"), else over the
sequence (1-D, RoFormer). Extra keys (add_bias_kv / add_zero_attn) have no position and are not rotated.
"""
import math

import torch

from .. import functional, naive
from ..functional._common import compute_dtype
from ..functional.grid_rope import grid_tables, rotate, sequence_tables
from ..registry import AttentionMethod, Option, boolean, register_method

ROPE_OPTION = Option(False, boolean, "rotary position on q and k before the softmax: 2-D on the token grid when the "
                                     "module knows one (as the linear methods' rope), 1-D over the sequence "
                                     "otherwise; self-attention")


@register_method
class Softmax(AttentionMethod):
    name = "softmax"
    options = {"rope": ROPE_OPTION}
    variants = {"rope": {"rope": True}}
    causal = True
    any_mask = True
    returns_weights = True
    extra_keys = True
    exact = True
    cost = "O(L·S·d); O(L·S) memory with weights, SDPA otherwise"
    summary = "exact softmax(q kᵀ/√d) v: every mask nn.MultiheadAttention accepts, and the weights"

    @property
    def reads_grid(self):
        return self.rope

    @property
    def computes_torch_attention(self):  # rope rotates q and k first
        return not self.rope

    @property
    def self_attention_only(self):  # positions pair queries with keys
        return self.rope

    def attend(self, q, k, v, state, *, attn_bias=None, dropout_p=0.0, extra_keys=None, token_grid=None):
        return self.attend_with_weights(q, k, v, state, attn_bias=attn_bias, dropout_p=dropout_p,
                                        extra_keys=extra_keys, need_weights=False, token_grid=token_grid)[0]

    def attend_with_weights(self, q, k, v, state, *, attn_bias=None, dropout_p=0.0, extra_keys=None,
                            need_weights=True, token_grid=None):
        if self.rope:
            q, k = rotate_positions(q, k, token_grid)
        if extra_keys is not None:
            k, v = torch.cat([k, extra_keys[0]], dim=2), torch.cat([v, extra_keys[1]], dim=2)
        return functional.softmax(q, k, v, attn_bias=attn_bias, dropout_p=dropout_p, need_weights=need_weights)

    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        seen = naive.visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device)
        if self.rope:
            scores = naive.rotated_similarity(q, k, token_grid) / math.sqrt(q.shape[-1])
        else:
            scores = naive.scaled_scores(q, k)
        return naive.softmax_weights(scores, seen)

    def flops(self, batch_heads, tokens, head_dim, causal):
        full = 4.0 * batch_heads * tokens ** 2 * head_dim  # q kᵀ and the weights times v
        return full / 2 if causal else full


def rotate_positions(q, k, token_grid):
    """q, k (B, H, N, d) rotated by their positions: on ``token_grid`` (2-D) or, given None, along the sequence."""
    like = q.new_empty((), dtype=compute_dtype(q.dtype))  # angles in float32 at least: float16 has no position 2049
    if token_grid is not None:
        tables = grid_tables((token_grid.height, token_grid.width, token_grid.prefix), q.shape[-1], like)
    else:
        tables = sequence_tables(q.shape[2], q.shape[-1], like)
    return rotate(q, None, tables), rotate(k, None, tables)
