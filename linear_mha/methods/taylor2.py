"""mode='taylor2': exp(s) ≈ 1 + s + s²/2 for s = q·k/√d (Based's feature map), a map that can focus."""
from .. import naive
from ..registry import register_method
from .kernel import FeatureMapMethod


@register_method
class Taylor2(FeatureMapMethod):
    name = "taylor2"
    cost = "O(N·d³)"
    summary = "second-order Taylor expansion of softmax's exp (Based); 1 + d + d(d+1)/2 features; causal in chunks"

    def kernel_map(self, state):
        return "taylor2"

    def similarity(self, q, k, state):
        s = naive.scaled_scores(q, k)
        return 1 + s + s * s / 2
