"""An attention method as a user would write it in their own file: nothing here is part of linear_mha.

Kernel attention with the feature map relu(x * s_h) + eps, where s_h is a learnable scale per head: state of its
own, an option with a check, a causal form, exact key padding, all through the public functional API."""
import torch
from torch import nn

import linear_mha
from linear_mha import AttentionMethod, Option

NAME = "scaled_relu"


def positive(value, name):
    if not isinstance(value, float) or value <= 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")
    return value


class ScaledRelu(AttentionMethod):
    name = NAME
    options = {"eps": Option(1e-3, positive, "added to every feature, so no normaliser is zero")}
    causal = True

    def init_state(self, num_heads, head_dim, factory_kwargs):
        return {"feature_scale": nn.Parameter(torch.ones(num_heads, 1, 1, **factory_kwargs))}

    def features(self, scale):
        return lambda x: torch.relu(x * scale) + self.eps  # x (B, H, N, d), scale (H, 1, 1)

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0):
        return linear_mha.functional.kernel(q, k, v, self.features(state["feature_scale"]), causal=causal,
                                            key_padding_mask=key_padding_mask, dropout_p=dropout_p)


def reference(q, k, v, scale, eps, key_padding_mask=None, causal=False):
    """The same attention through its L x S weights, in the inputs' dtype."""
    phi = lambda x: torch.relu(x * scale) + eps  # noqa: E731
    weights = phi(q) @ phi(k).transpose(-2, -1)
    if key_padding_mask is not None:
        weights = weights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    if causal:
        weights = weights.tril()
    return (weights / weights.sum(-1, keepdim=True)) @ v
