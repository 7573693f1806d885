"""mode='agent': Agent Attention (Han et al., ECCV 2024), softmax attention through n = a x a agent tokens pooled
from the queries over the image's token grid: O(N n d). Self-attention over a grid only (the grid reaches the
module as for ``dwc_kernel``: from DETR's transformer, a timm / torchvision ViT, or ``token_grid=``)."""
from .. import functional
from ..registry import AttentionMethod, Option, positive_int, register_method


@register_method
class Agent(AttentionMethod):
    name = "agent"
    options = {"agents_per_side": Option(7, positive_int, "a: the agents are an a x a pooling of the queries "
                                                          "(the paper's 49 = 7 x 7)")}
    extra_keys = True
    needs_grid = True
    cost = "O(N·n·d), n = a² agents"
    summary = "softmax through a x a agent tokens pooled from the queries over the token grid (Agent Attention)"

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None,
               token_grid=None):
        extra = {} if extra_keys is None else dict(extra_k=extra_keys[0], extra_v=extra_keys[1])
        return functional.agent_attention(q, k, v, agents_per_side=self.agents_per_side, height=token_grid.height,
                                          width=token_grid.width, prefix=token_grid.prefix,
                                          key_padding_mask=key_padding_mask, dropout_p=dropout_p, **extra)
