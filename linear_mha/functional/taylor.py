"""Taylor attention: exp(q'.k') ~ 1 + q'.k' on L2-normalised queries and keys, i.e.

    out_i = (sum_j v_j + q'_i . sum_j k'_j v_j^T) / (N + q'_i . sum_j k'_j),   N = number of valid keys,

which is kernel attention with the feature map [1, x/|x|] (``feature_maps.taylor_feature_map``).
"""
from typing import Optional

from torch import Tensor

from .kernel import kernel


def taylor(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    initial_state: Optional[Tensor] = None,
) -> Tensor:
    """q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) -> (B, H, L, Dv). Masks and options as in ``kernel``;
    an ``initial_state`` has feature size D + 1."""
    return kernel(
        q, k, v, "taylor", causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
        initial_state=initial_state,
    )
