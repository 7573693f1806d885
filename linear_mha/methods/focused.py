"""mode='focused': focused linear attention (FLatten Transformer, ICCV 2023), kernel attention with the map
f_p(relu(x) / s): ReLU features whose direction is raised to the power p (focusing_factor) at constant norm, and a
learnable per-channel scale s = softplus(w), w initialised at 0 as in FLatten. O(N·d²); causal in chunks."""
import torch
import torch.nn.functional as F
from torch import nn

from .. import functional
from ..functional.focused import RELU_EPS, FocusedMap
from ..registry import Option, boolean, positive_float, register_method
from .kernel import CHUNK_OPTION, KEY_REWEIGHT_OPTION, ROPE_OPTION, FeatureMapMethod


@register_method
class Focused(FeatureMapMethod):
    name = "focused"
    options = {
        "focusing_factor": Option(3.0, positive_float, "power p of the focused map (FLatten uses 3)"),
        "learnable_scale": Option(True, boolean, "learn the per-channel scale s (False: s = 1)"),
        "chunk_size": CHUNK_OPTION,
        "key_reweight": KEY_REWEIGHT_OPTION,
        "rope": ROPE_OPTION,
    }
    variants = {"p2_fixed_scale": {"focusing_factor": 2.0, "learnable_scale": False}}
    cost = "O(N·d²)"
    summary = "FLatten's focused map: ReLU features sharpened by a power at constant norm, a learnable scale"

    def init_state(self, num_heads, head_dim, factory_kwargs):
        if not self.learnable_scale:
            return {}
        return {"focus_scale": nn.Parameter(torch.zeros(num_heads, 1, head_dim, **factory_kwargs))}

    def _scale(self, state):
        raw = state.get("focus_scale")
        return None if raw is None else F.softplus(raw)

    def features(self, x, state):
        return functional.focused_feature_map(x, self.focusing_factor, self._scale(state))

    def kernel_map(self, state):
        # A value the compiled kernels recognise: on float32 CPU tensors they compute the map in their row loaders.
        return FocusedMap(self.focusing_factor, self._scale(state))

    def similarity(self, q, k, state):
        # The map as FLatten writes it: (|y| / |y**p|) y**p with y = (relu(x) + 1e-6) / s.
        scale, p = self._scale(state), self.focusing_factor

        def phi(x):
            y = torch.relu(x) + RELU_EPS
            y = y if scale is None else y / scale.to(y.dtype)
            return y.norm(dim=-1, keepdim=True) / (y ** p).norm(dim=-1, keepdim=True) * y ** p
        return phi(q) @ phi(k).transpose(-1, -2)
