"""Second-order Taylor attention (the feature map of Based, Arora et al. 2024): softmax's exp(s), s = q.k / sqrt(D),
replaced by its expansion 1 + s + s^2 / 2, which is positive for every s, so

    out_i = sum_j (1 + s_ij + s_ij^2 / 2) v_j / sum_j (1 + s_ij + s_ij^2 / 2),

computed in O(N) as kernel attention with ``feature_maps.taylor2_feature_map`` (1 + D + D (D + 1) / 2 features).
Unlike first-order ``taylor`` (on normalised q, k, weights within a factor of 3 of each other) the weights grow
with s^2, so a query can focus on the keys it matches best.
"""
from typing import Optional

from torch import Tensor

from .kernel import kernel


def taylor2(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    initial_state: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) -> (B, H, L, Dv). Masks and options as in ``kernel``;
    an ``initial_state`` has feature size 1 + D + D (D + 1) / 2; ``chunk_size`` as in ``kernel``."""
    return kernel(
        q, k, v, "taylor2", causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
        initial_state=initial_state, chunk_size=chunk_size,
    )
