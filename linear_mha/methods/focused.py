"""mode='focused': focused linear attention (FLatten Transformer, ICCV 2023), kernel attention with the map
f_p(relu(x) / s): ReLU features whose direction is raised to the power p (focusing_factor) at constant norm, and a
learnable per-channel scale s = softplus(w), w initialised at 0 as in FLatten. O(N·d²); causal in chunks."""
import torch
import torch.nn.functional as F
from torch import nn

from .. import functional
from ..registry import AttentionMethod, Option, positive_float, register_method
from .kernel import Kernel, kernel_attend


def _bool(value, name):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


@register_method
class Focused(AttentionMethod):
    name = "focused"
    options = {
        "focusing_factor": Option(3.0, positive_float, "power p of the focused map (FLatten uses 3)"),
        "learnable_scale": Option(True, _bool, "learn the per-channel scale s (False: s = 1)"),
        "chunk_size": Kernel.options["chunk_size"],
    }
    causal = True
    extra_keys = True
    cost = "O(N·d²)"
    summary = "FLatten's focused map: ReLU features sharpened by a power at constant norm, a learnable scale"

    def init_state(self, num_heads, head_dim, factory_kwargs):
        if not self.learnable_scale:
            return {}
        return {"focus_scale": nn.Parameter(torch.zeros(num_heads, 1, head_dim, **factory_kwargs))}

    def feature_map(self, state):
        raw = state.get("focus_scale")
        scale = None if raw is None else F.softplus(raw)

        def focused_map(x):
            return functional.focused_feature_map(x, self.focusing_factor, scale)
        return focused_map

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None):
        return kernel_attend(q, k, v, self.feature_map(state), key_padding_mask=key_padding_mask, causal=causal,
                             dropout_p=dropout_p, extra_keys=extra_keys, chunk_size=self.chunk_size)
