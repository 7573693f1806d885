"""Product-key memory (Lample et al. 2019, "Large Memory Layers with Product Keys"), position-wise.

Per head, the query is split in two halves; each half scores ``num_keys`` sub-keys and keeps its ``topk``; the
topk x topk sums of the two halves' scores index the num_keys ** 2 memory slots (i * num_keys + j); the best
``topk`` of those are softmaxed and weight a sum of value vectors (an EmbeddingBag, so only the chosen rows are
read). The heads' outputs are summed. Defaults are those of the ``product_key_memory`` package's ``PKM``.

Query normalisation: the package uses BatchNorm on the queries, whose training-mode statistics mix every
position of the batch, so a causal LM's memory read at step t depends on later tokens (and on the other
sequences). Here a LayerNorm per head normalises each query on its own: the layer stays position-wise, causal
in training as in eval, and decoding one token equals the full forward.
"""
import torch
from torch import Tensor, nn


class PKM(nn.Module):
    def __init__(
        self,
        dim: int,
        heads: int = 4,
        num_keys: int = 128,
        topk: int = 32,
        dim_head: int = 256,
        input_dropout: float = 0.0,
        query_dropout: float = 0.0,
        value_dropout: float = 0.0,
    ):
        super().__init__()
        for name, value in (("heads", heads), ("pkm_num_keys", num_keys), ("topk", topk), ("dim_head", dim_head)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PKM {name} must be a positive int, got {value!r}")
        if topk > num_keys:
            raise ValueError(f"PKM topk ({topk}) must be <= num_keys ({num_keys}): each half keeps topk sub-keys")
        if dim_head % 2:
            raise ValueError(f"PKM dim_head must be even (the query is split in two halves), got {dim_head}")
        self.heads, self.num_keys, self.topk, self.dim_head = heads, num_keys, topk, dim_head
        self.to_queries = nn.Linear(dim, heads * dim_head, bias=False)
        self.norm = nn.LayerNorm(dim_head)
        self.keys = nn.Parameter(torch.randn(heads, num_keys, 2, dim_head // 2) * (dim_head // 2) ** -0.5)
        self.values = nn.EmbeddingBag(num_keys ** 2, dim, mode="sum")
        nn.init.normal_(self.values.weight, std=dim ** -0.5)
        self.input_dropout = nn.Dropout(input_dropout)
        self.query_dropout = nn.Dropout(query_dropout)
        self.value_dropout = nn.Dropout(value_dropout)

    def forward(self, x: Tensor, padding=None) -> Tensor:  # position-wise: padding changes nothing
        """x (..., dim) -> (..., dim); every position reads the memory on its own."""
        lead, dim = x.shape[:-1], x.shape[-1]
        x = self.input_dropout(x.reshape(-1, dim))
        q = self.norm(self.to_queries(x).reshape(-1, self.heads, self.dim_head))
        q = self.query_dropout(q).reshape(-1, self.heads, 2, self.dim_head // 2)
        dots = torch.einsum("mhpd,hnpd->mhpn", q, self.keys)  # (M, heads, 2 halves, num_keys)
        scores, indices = dots.topk(self.topk, dim=-1)
        k = self.topk
        all_scores = (scores[:, :, 0, :, None] + scores[:, :, 1, None, :]).reshape(-1, self.heads, k * k)
        all_indices = (indices[:, :, 0, :, None] * self.num_keys + indices[:, :, 1, None, :]).reshape(-1, self.heads, k * k)
        best, best_at = all_scores.topk(k, dim=-1)
        slots = all_indices.gather(-1, best_at)
        weights = best.softmax(dim=-1)
        out = self.values(slots.reshape(-1, self.heads * k), per_sample_weights=weights.reshape(-1, self.heads * k))
        return self.value_dropout(out).reshape(*lead, out.shape[-1])

    def step(self, x, cache, t, padding_t=None):
        return self.forward(x)

    def prefill(self, x, cache, padding=None):
        return self.forward(x)
