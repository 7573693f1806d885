"""mode='taylor': exp(q'·k') ≈ 1 + q'·k' on L2-normalised q, k, i.e. kernel attention with the map [1, x/|x|]."""
from ..registry import AttentionMethod, register_method
from .kernel import Kernel, kernel_attend


class FixedMapKernel(AttentionMethod):
    """Kernel attention whose feature map is fixed by name (``feature_map``): a subclass sets its name, the map's
    name in ``functional``, its cost and summary."""
    feature_map = None
    options = {"chunk_size": Kernel.options["chunk_size"]}
    causal = True
    extra_keys = True

    def describe(self):
        return f"mode={self.name!r}"

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None):
        return kernel_attend(q, k, v, self.feature_map, key_padding_mask=key_padding_mask, causal=causal,
                             dropout_p=dropout_p, extra_keys=extra_keys, chunk_size=self.chunk_size)


@register_method
class Taylor(FixedMapKernel):
    name = "taylor"
    feature_map = "taylor"
    cost = "O(N·d²)"
    summary = "first-order Taylor expansion of exp on L2-normalised q, k; causal in chunks"
