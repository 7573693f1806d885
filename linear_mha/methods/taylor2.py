"""mode='taylor2': exp(s) ≈ 1 + s + s²/2 for s = q·k/√d (Based's feature map), a map that can focus."""
from ..registry import register_method
from .taylor import FixedMapKernel


@register_method
class Taylor2(FixedMapKernel):
    name = "taylor2"
    feature_map = "taylor2"
    cost = "O(N·d³)"
    summary = "second-order Taylor expansion of softmax's exp (Based); 1 + d + d(d+1)/2 features; causal in chunks"
