"""LinearSelfAttention: kernel self-attention layer on (B, N, dim) with a feature map ``psi_fn``: the registry's
``kernel`` method with ``feature_map=psi_fn``.

psi_fn: any map the method accepts ("elu", "relu", "favor", "taylor", ...) or a callable psi(x) -> non-negative
features (default elu(x) + 1). Causal mode uses the core's chunked causal kernel; ``one_kv_head`` shares one
key/value head across the query heads. ``step`` decodes one token with a constant-size state.
"""
from typing import Optional

from torch import nn

from ..attend import attend_heads, step_heads
from ..functional.packed_heads import split_heads
from ..registry import create_method
from .padding import padding_from_keep


class LinearSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 8, causal: bool = False, one_kv_head: bool = False, psi_fn="elu",
                 dim_head: Optional[int] = None, dropout: float = 0.0):
        super().__init__()
        if dim_head is None:
            if dim % heads:
                raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}), or pass dim_head")
            dim_head = dim // heads
        self.heads, self.dim_head, self.causal, self.psi_fn = heads, dim_head, causal, psi_fn
        self.kv_heads = 1 if one_kv_head else heads
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * self.kv_heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)
        self.dropout = dropout
        self.method = create_method("kernel", {"feature_map": psi_fn})
        self.method.install(self, heads, dim_head, {"device": self.to_q.weight.device, "dtype": self.to_q.weight.dtype})

    def _split(self, t, n_heads):
        t = t.reshape(*t.shape[:-1], n_heads, self.dim_head).transpose(-2, -3)
        return self._shared(t, n_heads)

    def _shared(self, t, n_heads):
        """One key/value head shared by every query head (n_heads 1) seen as heads copies, without a copy."""
        return t.expand(t.shape[0], self.heads, *t.shape[2:]) if n_heads == 1 else t

    def forward(self, x, input_mask=None):
        """x (B, N, dim) -> (B, N, dim); input_mask (B, N) bool, True = keep."""
        b, n, _ = x.shape
        padding = padding_from_keep("input_mask", input_mask, (b, n))
        q = self._split(self.to_q(x), self.heads)
        k, v = (self._shared(t, self.kv_heads) for t in split_heads(self.to_kv(x), 2, self.kv_heads))
        self.method.before_forward(self)
        out, _ = attend_heads(self.method, self.method.state(self), q, k, v, key_padding_mask=padding,
                              is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

    def step(self, x, cache: dict):
        """Causal decoding of one position: x (B, dim) -> (B, dim); ``cache`` starts as {}."""
        if not self.causal:
            raise ValueError("step() needs causal=True")
        q = self._split(self.to_q(x)[:, None], self.heads)[:, :, 0]
        k, v = (self._split(t[:, None], self.kv_heads)[:, :, 0] for t in self.to_kv(x).chunk(2, dim=-1))
        # The method's state (B, H, F, Dv + 1) lives in the cache, updated in place where autograd allows.
        out = step_heads(self.method, self.method.state(self), q, k, v, cache)
        return self.to_out(out.reshape(x.shape[0], -1))
