"""mode='agent': Agent Attention (Han et al., ECCV 2024), softmax attention through n = a x a agent tokens pooled
from the queries over the image's token grid: O(N n d). Self-attention over a grid only (the grid reaches the
module as for ``dwc_kernel``: from DETR's transformer, a timm / torchvision ViT, or ``token_grid=``)."""
import torch

from .. import functional, naive
from ..registry import AttentionMethod, Option, positive_int, register_method


@register_method
class Agent(AttentionMethod):
    name = "agent"
    options = {"agents_per_side": Option(7, positive_int, "a: the agents are an a x a pooling of the queries "
                                                          "(the paper's 49 = 7 x 7)")}
    extra_keys = True
    needs_grid = True
    variants = {"a2": {"agents_per_side": 2}}
    cost = "O(N·n·d), n = a² agents"
    summary = "softmax through a x a agent tokens pooled from the queries over the token grid (Agent Attention)"

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None,
               token_grid=None):
        extra = {} if extra_keys is None else dict(extra_k=extra_keys[0], extra_v=extra_keys[1])
        return functional.agent_attention(q, k, v, agents_per_side=self.agents_per_side, height=token_grid.height,
                                          width=token_grid.width, prefix=token_grid.prefix,
                                          key_padding_mask=key_padding_mask, dropout_p=dropout_p, **extra)

    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        """softmax(Q Aᵀ s) softmax(A Kᵀ s) (B, H, N, N): agents A the mean of the valid grid queries in each of
        a x a bins, laid as adaptive pooling lays them (bin i of n rows covers rows floor(i n / a) to
        ceil((i + 1) n / a)) over the box that holds the valid tokens; masked keys get no weight."""
        b, h, n, d = q.shape
        grid, a = token_grid, self.agents_per_side
        valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
        agents = q.new_zeros(b, h, a * a, d)
        for i in range(b):
            cells = valid[i, grid.prefix:].reshape(grid.height, grid.width)
            rows, cols = cells.any(1).nonzero().flatten().tolist(), cells.any(0).nonzero().flatten().tolist()
            if not rows:
                continue
            top, rows_n, left, cols_n = rows[0], rows[-1] - rows[0] + 1, cols[0], cols[-1] - cols[0] + 1
            for r in range(a):
                for c in range(a):
                    r0, r1 = top + r * rows_n // a, top + -(-(r + 1) * rows_n // a)
                    c0, c1 = left + c * cols_n // a, left + -(-(c + 1) * cols_n // a)
                    members = torch.zeros(grid.height, grid.width, dtype=torch.bool, device=q.device)
                    members[r0:r1, c0:c1] = True
                    members = members & cells
                    if members.any():
                        tokens = grid.prefix + members.flatten().nonzero().flatten()
                        agents[i, :, r * a + c] = q[i, :, tokens].mean(1)
        scale = d ** -0.5
        gather = naive.softmax_weights(agents @ k.transpose(-1, -2) * scale,
                                       naive.visible(a * a, n, key_padding_mask, device=q.device))
        read = torch.softmax(q @ agents.transpose(-1, -2) * scale, dim=-1)
        return read @ gather

    def flops(self, batch_heads, tokens, head_dim, causal):
        # agents x keys, their values, queries x agents, and the agents' values read
        return 8.0 * batch_heads * tokens * self.agents_per_side ** 2 * head_dim
