"""Hedgehog's learned query and key maps as the compiled CPU kernels take them (``hedgehog.py`` calls them; the
backend chooser asks them whether they can)."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import native
from ._common import why_not_fused_map_pair

Map = Tuple[Tensor, Optional[Tensor]]  # (weight (H, d, m), bias (H, m) or None)


class HedgehogMap:
    """The query and key maps as the compiled kernels take them (map 8, csrc/hedgehog.h): their projections and
    double softmaxes run inside the kernels' row loaders, forward and backward, and no feature tensor is made. The
    settings are one float32 array, [d, m, W_q, W_k, b_q, b_k] (W (H, d, m), b (H, m), zeros for a missing bias),
    made from the maps by differentiable ops, so the gradients the kernels sum into its layout reach W and b."""

    compiled_map = "hedgehog"

    def __init__(self, q_map: Map, k_map: Map):
        self.q_map, self.k_map = q_map, k_map

    def feature_count(self, d: int) -> int:
        return 2 * self.q_map[0].shape[-1]

    def why_not_compiled(self, q: Tensor) -> Optional[str]:
        """Why the compiled kernels cannot compute these maps in their row loaders, or None."""
        weights = [t for pair in (self.q_map, self.k_map) for t in pair if t is not None]
        if any(not t.is_cpu for t in weights):
            return f"the maps' weights are on {sorted({str(t.device) for t in weights})}"
        if self.q_map[0].shape[-1] > native.HEDGEHOG_MAX_M:
            return f"maps of {self.q_map[0].shape[-1]} features per softmax, above {native.HEDGEHOG_MAX_M}"
        if self.q_map[0].shape[-2] > native.HEDGEHOG_MAX_D:
            return f"maps of {self.q_map[0].shape[-2]} inputs per row, above {native.HEDGEHOG_MAX_D}"
        return why_not_fused_map_pair(self.q_map, self.k_map)

    def compiled_settings(self, q: Tensor) -> Tuple[float, Tensor]:
        (w_q, b_q), (w_k, b_k) = self.q_map, self.k_map
        h, d, m = w_q.shape
        # float32 whatever torch's default dtype, on the CPU where the compiled code runs (its weights are checked so)
        parts = [torch.tensor([float(d), float(m)], dtype=torch.float32)]
        parts += [w.to(torch.float32).reshape(-1) for w in (w_q, w_k)]
        parts += [torch.zeros(h * m, dtype=torch.float32) if b is None else b.to(torch.float32).reshape(-1)
                  for b in (b_q, b_k)]
        return 0.0, torch.cat(parts)
