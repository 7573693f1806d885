"""mode='inline': InLine attention (Han et al., NeurIPS 2024): kernel similarities normalised by subtraction,
w_ij = 1/N + (s_ij - mean_j s_ij) / N, so the weights keep the query's magnitude (they are injective in it) and
may be negative. With the default identity map, s = q.k/sqrt(d) and the weights are softmax's first-order expansion
around the uniform row. O(N·d²); causal in chunks. ``CentredKernelMethod`` is shared with ``mala``."""
import torch

from .. import naive
from ..functional.centred import centred_kernel, resolve_map
from ..functional.feature_maps import elementwise_feature_map, resolve_feature_map
from ..registry import AttentionMethod, Option, register_method
from .kernel import CHUNK_OPTION, ROPE_OPTION, feature_attention_flops


def _centred_map(value, name):
    if value == "identity":
        return value
    if value == "favor":
        raise ValueError(f"{name} must be elementwise ('identity', 'elu', 'relu', 'taylor', 'taylor2' or a callable); "
                         f"'favor' treats queries and keys differently")
    return resolve_feature_map(value)


class CentredKernelMethod(AttentionMethod):
    """A kernel similarity s_ij = phi(q_i).phi(k_j) turned into weights by ``functional.centred_kernel``'s
    ``form``; a subclass names the form and its default map."""
    form = ""
    causal = True
    extra_keys = True

    def __init__(self, **options):
        super().__init__(**options)
        if self.rope:  # the grid's rotary position: an image's tokens, no order
            self.causal, self.needs_grid = False, True

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None,
               token_grid=None):
        grid = (token_grid.height, token_grid.width, token_grid.prefix) if self.rope else None
        if grid is not None and extra_keys is not None:
            raise ValueError("rope places every key on the token grid; the extra keys of add_bias_kv / add_zero_attn "
                             "have no place there: build the module without them or without rope")
        return centred_kernel(q, k, v, self.feature_map, form=self.form, causal=causal,
                              key_padding_mask=key_padding_mask, dropout_p=dropout_p, extra_keys=extra_keys,
                              chunk_size=self.chunk_size, grid=grid)

    def describe(self):
        return (f"mode={self.name!r}, feature_map={getattr(self.feature_map, '__name__', self.feature_map)!r}"
                + (", rope=True" if self.rope else ""))

    # ------------------------------------------------------------------ facts
    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        phi = elementwise_feature_map(resolve_map(self.feature_map))
        seen = naive.visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device)
        sim = (phi(q) @ phi(k).transpose(-1, -2)).masked_fill(~seen, 0.0)
        count = seen.sum(-1, keepdim=True).to(q.dtype)
        row = sim.sum(-1, keepdim=True)  # S_i, of the plain similarities
        if self.rope:  # the weights' similarities are the rotated ones
            sim = naive.rotated_similarity(phi(q), phi(k), token_grid).masked_fill(~seen, 0.0)
        safe_count = count.clamp(min=1)
        if self.form == "inline":
            weights = 1 / safe_count + (sim - row / safe_count) / safe_count
        else:  # MALA's similarities are divided by N sqrt(d)
            sim, row = sim / (safe_count * q.shape[-1] ** 0.5), row / (safe_count * q.shape[-1] ** 0.5)
            weights = (1 + 1 / torch.where(row == 0, torch.ones_like(row), row)) * sim - row / safe_count
        return weights.masked_fill(~seen, 0.0)

    def feature_count(self, head_dim):
        return elementwise_feature_map(resolve_map(self.feature_map))(torch.zeros(1, head_dim)).shape[-1]

    def flops(self, batch_heads, tokens, head_dim, causal):
        features = self.feature_count(head_dim)
        if not causal and getattr(self, "rope", False):  # rotated phi(K)^T V and phi(Q) times it; S_i = phi(Q) sum phi(K)
            return 4.0 * batch_heads * tokens * features * head_dim + 2.0 * batch_heads * tokens * features
        if not causal:  # phi(K)^T [V, 1] and phi(Q) times it: the normaliser rides in the ones column
            return 4.0 * batch_heads * tokens * features * (head_dim + 1)
        return feature_attention_flops(batch_heads, tokens, features, head_dim, causal, self.chunk_size)


@register_method
class InLine(CentredKernelMethod):
    name = "inline"
    form = "inline"
    options = {
        "feature_map": Option("identity", _centred_map, "'identity' (q.k/sqrt(d), signed), 'elu', 'relu', 'taylor', "
                                                        "'taylor2' or a callable psi(x) -> features"),
        "chunk_size": CHUNK_OPTION,
        "rope": ROPE_OPTION,
    }
    variants = {"taylor": {"feature_map": "taylor"}, "rope": {"rope": True}}
    cost = "O(N·d²)"
    summary = "InLine: similarities normalised by subtraction (1/N + (s - mean s)/N), injective; causal in chunks"
