"""ImageLinearAttention: Efficient Attention (softmax kernels) over the pixels of a (B, C, H, W) feature map.

Queries, keys and values are convolutions of the image; keys are softmax-normalised over the positions and, with
``norm_queries``, queries over their features (Shen et al.), so the cost is linear in H * W. An optional
``context`` (B, C, ...) adds extra keys/values (projected with the same 1x1-style convolutions). Unlike the
original, strided convolutions work: the output grid is taken from the convolution, not from the input.
"""
import torch
from torch import nn

from ..attend import attend_heads
from ..registry import create_method


class ImageLinearAttention(nn.Module):
    def __init__(self, chan: int, chan_out: int = None, kernel_size: int = 1, padding: int = 0, stride: int = 1,
                 key_dim: int = 64, value_dim: int = 64, heads: int = 8, norm_queries: bool = True):
        super().__init__()
        chan_out = chan if chan_out is None else chan_out
        self.chan, self.key_dim, self.value_dim, self.heads = chan, key_dim, value_dim, heads
        self.norm_queries = norm_queries
        conv = dict(kernel_size=kernel_size, padding=padding, stride=stride)
        self.to_q = nn.Conv2d(chan, key_dim * heads, **conv)
        self.to_k = nn.Conv2d(chan, key_dim * heads, **conv)
        self.to_v = nn.Conv2d(chan, value_dim * heads, **conv)
        self.to_out = nn.Conv2d(value_dim * heads, chan_out, kernel_size, padding=padding)
        self.method = create_method("efficient", {})  # norm_queries=True: the registry's Efficient Attention

    def forward(self, x, context=None):
        """x (B, chan, H, W) -> (B, chan_out, H', W'); context (B, chan, ...) of any spatial shape, or None."""
        if x.dim() != 4 or x.shape[1] != self.chan:
            raise ValueError(f"x must be (batch, chan={self.chan}, H, W), got {tuple(x.shape)}")
        b = x.shape[0]
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        h, w = q.shape[-2:]

        def tokens(t, d):  # (B, heads * d, h, w) -> (B, heads, h * w, d)
            return t.reshape(b, self.heads, d, -1).transpose(-1, -2)

        q, k, v = tokens(q, self.key_dim), tokens(k, self.key_dim), tokens(v, self.value_dim)
        scale = self.key_dim ** -0.25  # the original's softmax temperature
        if context is not None:
            if context.shape[0] != b or context.shape[1] != self.chan:
                raise ValueError(f"context must be (batch={b}, chan={self.chan}, ...), got {tuple(context.shape)}")
            if self.to_k.kernel_size != (1, 1) or self.to_k.stride != (1, 1):
                raise ValueError("context needs kernel_size=1 and stride=1 (its positions have no 2-D layout)")
            ctx = context.reshape(b, self.chan, 1, -1)
            k = torch.cat([k, tokens(self.to_k(ctx), self.key_dim)], dim=2)
            v = torch.cat([v, tokens(self.to_v(ctx), self.value_dim)], dim=2)
        q, k = q * scale, k * scale
        if self.norm_queries:
            out, _ = attend_heads(self.method, {}, q, k, v)
        else:
            # Un-normalised queries: Q (softmax_seq(K)^T V), the original's norm_queries=False form.
            out = q @ (k.softmax(dim=-2).transpose(-1, -2) @ v)
        out = out.transpose(-1, -2).reshape(b, self.heads * self.value_dim, h, w)
        return self.to_out(out)


LinearImageAttention = ImageLinearAttention
