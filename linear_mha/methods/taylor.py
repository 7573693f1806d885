"""mode='taylor': exp(q'·k') ≈ 1 + q'·k' on L2-normalised q, k, i.e. kernel attention with the map [1, x/|x|]."""
import torch.nn.functional as F

from ..registry import register_method
from .kernel import FeatureMapMethod


@register_method
class Taylor(FeatureMapMethod):
    name = "taylor"
    cost = "O(N·d²)"
    summary = "first-order Taylor expansion of exp on L2-normalised q, k; causal in chunks"
    presets = {None: {}, "key_reweight": {"key_reweight": True}, "rope": {"rope": True}}  # the accuracy options' costs
    variants = {"rope_key_reweight": {"rope": True, "key_reweight": True}}

    def kernel_map(self, state):
        return "taylor"

    def similarity(self, q, k, state):
        return 1 + F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
