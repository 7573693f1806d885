"""mode='taylor': exp(q'·k') ≈ 1 + q'·k' on L2-normalised q, k, i.e. kernel attention with the map [1, x/|x|]."""
from ..registry import AttentionMethod, register_method
from .kernel import Kernel, kernel_attend


@register_method
class Taylor(AttentionMethod):
    name = "taylor"
    options = {"chunk_size": Kernel.options["chunk_size"]}
    causal = True
    extra_keys = True
    cost = "O(N·d²)"
    summary = "first-order Taylor expansion of exp on L2-normalised q, k; causal in chunks"

    def describe(self):
        return "mode='taylor'"

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None):
        return kernel_attend(q, k, v, "taylor", key_padding_mask=key_padding_mask, causal=causal,
                             dropout_p=dropout_p, extra_keys=extra_keys, chunk_size=self.chunk_size)
