"""mode='feature_softmax': kernel attention whose feature map is the softmax over each query's and key's own
features: positive, bounded features summing to 1 (Efficient Attention's map for queries, used for keys too, which
gives the method a causal form). The causal global heads of the linear-attention transformer LMs use it."""
import torch

from ..registry import register_method
from .kernel import FeatureMapMethod


@register_method
class FeatureSoftmax(FeatureMapMethod):
    name = "feature_softmax"
    cost = "O(N·d²)"
    summary = "phi(x) = softmax(x) over the head's features, for queries and keys; causal in chunks"

    def features(self, x, state):
        return torch.softmax(x, dim=-1)
