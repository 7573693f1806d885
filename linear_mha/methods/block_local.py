"""mode='block_local': softmax attention inside blocks of ``window`` positions, each query also seeing the block
before its own (and the one after, non-causally): exact where attention is local, O(N·w·d), with a rolling window of
2w keys for decoding. The local heads of the linear-attention transformer LMs (``n_local_attn_heads``)."""
import torch

from .. import functional, naive
from ..functional.block_local import block_local_prefill, block_local_step
from ..registry import AttentionMethod, Option, positive_int, register_method


@register_method
class BlockLocal(AttentionMethod):
    name = "block_local"
    options = {"window": Option(128, positive_int, "w: the block length; a query sees its own block and the one "
                                                   "before (and the one after, non-causal)")}
    variants = {"w3": {"window": 3}}
    causal = True
    recurrent = True
    exports_dynamic_length = False  # the blocks are reshapes by ceil(N / w), which export cannot leave open
    cost = "O(N·w·d)"
    summary = "softmax within blocks of w positions and the block before (after too, non-causal): local heads"

    @property
    def self_attention_only(self):
        return True  # blocks are positions along one sequence

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0):
        return functional.block_local_attention(q, k, v, self.window, causal=causal, key_padding_mask=key_padding_mask,
                                                dropout_p=dropout_p)

    def prefill(self, q, k, v, state, cache, *, key_padding_mask=None):
        block_local_prefill(k, v, cache, self.window, key_padding_mask)
        cache["position"] = k.shape[2]
        return self.attend(q, k, v, state, key_padding_mask=key_padding_mask, causal=True)

    def step(self, q, k, v, state, cache, *, padding=None):
        t = cache.get("position", 0)
        out = block_local_step(q, k, v, cache, t, self.window, padding)
        cache["position"] = t + 1
        return out

    # ------------------------------------------------------------------ facts
    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        seen = naive.visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device)
        i = torch.arange(q.shape[-2], device=q.device)[:, None] // self.window
        j = torch.arange(k.shape[-2], device=q.device)[None, :] // self.window
        blocks = (j >= i - 1) & (j <= i + (0 if causal else 1))
        return naive.softmax_weights(naive.scaled_scores(q, k), seen & blocks)

    def flops(self, batch_heads, tokens, head_dim, causal):
        # every query against the key slots of its 2 (causal) or 3 blocks, masked or not: scores and weights x v; a
        # sequence within one block is attended as plain softmax, over its N x N square
        if tokens <= self.window:
            return 4.0 * batch_heads * tokens * tokens * head_dim
        padded = -(-tokens // self.window) * self.window
        return 4.0 * batch_heads * padded * (2 if causal else 3) * self.window * head_dim
