"""mode='kernel' (Katharopoulos et al., 2020; Performer's FAVOR+): phi(q) (phi(k)ᵀ v) / phi(q) sum phi(k), O(N·F·d),
with a chunked causal form whose memory is O(N·d)."""
from typing import Optional

import torch

from .. import functional
from ..functional.causal import check_chunk_size
from ..registry import AttentionMethod, Option, append_extra_keys, optional, positive_int, register_method


def _feature_map(value, name):
    return "elu" if value is None else functional.resolve_feature_map(value)


@register_method
class Kernel(AttentionMethod):
    name = "kernel"
    options = {
        "feature_map": Option("elu", _feature_map, "'elu' (elu+1), 'relu', 'favor' (FAVOR+ random features), "
                                                   "'taylor', 'taylor2' or a callable psi(x) -> non-negative "
                                                   "features"),
        "num_features": Option(None, optional(positive_int), "FAVOR+'s random-feature count (default d log d)"),
        "redraw_interval": Option(None, optional(positive_int),
                                  "FAVOR+: redraw the features every that many training forwards"),
        "chunk_size": Option(None, optional(lambda value, name: check_chunk_size(value)),
                             "chunk length of the causal product"),
    }
    causal = True
    extra_keys = True
    presets = {"elu": {"feature_map": "elu"}, "favor": {"feature_map": "favor"}}
    cost = "O(N·F·d)"
    summary = "normalised phi(q) (phi(k)ᵀ v) with a feature map; causal in chunks, O(N·d) memory"

    @classmethod
    def check_options(cls, options):
        favor = options["feature_map"] == "favor"
        for key in ("num_features", "redraw_interval"):
            if options[key] is not None and not favor:
                raise ValueError(f"{key} only applies to feature_map='favor'")

    def describe(self):
        return f"mode='kernel', feature_map={getattr(self.feature_map, '__name__', self.feature_map)!r}"

    def init_state(self, num_heads, head_dim, factory_kwargs):
        self._forwards_since_redraw = 0
        if self.feature_map != "favor":
            return {}
        self.num_features = self.num_features or functional.default_num_favor_features(head_dim)
        return {"favor_projection": functional.orthogonal_random_features(
            self.num_features, head_dim, device=factory_kwargs["device"])}

    def before_forward(self, module):
        if module.training and self.redraw_interval is not None:
            self._forwards_since_redraw += 1
            if self._forwards_since_redraw >= self.redraw_interval:
                self.redraw(module)

    @torch.no_grad()
    def redraw(self, module, generator: Optional[torch.Generator] = None):
        """Draw a new FAVOR+ random projection."""
        if self.feature_map != "favor":
            super().redraw(module, generator)
        projection = module.favor_projection
        projection.copy_(functional.orthogonal_random_features(
            self.num_features, projection.shape[-1], generator=generator, device=projection.device))
        self._forwards_since_redraw = 0

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None):
        return kernel_attend(q, k, v, self.feature_map, key_padding_mask=key_padding_mask, causal=causal,
                             dropout_p=dropout_p, extra_keys=extra_keys, projection=state.get("favor_projection"),
                             chunk_size=self.chunk_size)


def kernel_attend(q, k, v, feature_map, *, key_padding_mask, causal, dropout_p, extra_keys, projection=None,
                  chunk_size=None):
    """functional.kernel with extra keys: appended when non-causal; the state every query starts from when causal."""
    initial_state = None
    if extra_keys is not None:
        if causal:
            initial_state = functional.kernel_state(*extra_keys, feature_map, projection=projection)
        else:
            k, v, key_padding_mask = append_extra_keys(k, v, key_padding_mask, extra_keys)
    return functional.kernel(q, k, v, feature_map, causal=causal, key_padding_mask=key_padding_mask,
                             dropout_p=dropout_p, projection=projection, initial_state=initial_state,
                             chunk_size=chunk_size)
