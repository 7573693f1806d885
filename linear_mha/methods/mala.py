"""mode='mala': magnitude-aware linear attention (MALA, Fan et al., ICCV 2025). With s_ij = phi(q_i).phi(k_j) /
(N sqrt(d)) and S_i = sum_j s_ij, w_ij = (1 + 1/S_i) s_ij - S_i/N: each row sums to 1 like a divided kernel's, but its deviation from
the divided kernel grows with S_i, i.e. with the query's magnitude, which division discards. phi = elu + 1 as in
MALA. O(N·d²); causal in chunks."""
from ..functional.feature_maps import resolve_feature_map
from ..registry import Option, register_method
from .inline import CentredKernelMethod
from .kernel import CHUNK_OPTION, ROPE_OPTION


def _positive_map(value, name):
    if value in ("identity", "favor"):
        raise ValueError(f"{name} must be a non-negative elementwise map ('elu', 'relu', 'taylor', 'taylor2' or a "
                         f"callable): mala divides by phi(q).sum phi(k), got {value!r}")
    return resolve_feature_map(value)


@register_method
class MALA(CentredKernelMethod):
    name = "mala"
    form = "magnitude"
    options = {
        "feature_map": Option("elu", _positive_map, "'elu' (elu+1, MALA's), 'relu', 'taylor', 'taylor2' or a "
                                                    "callable psi(x) -> non-negative features"),
        "chunk_size": CHUNK_OPTION,
        "rope": ROPE_OPTION,
    }
    presets = {None: {}, "rope": {"rope": True}}  # the benchmark's rows: rope's cost on mala
    cost = "O(N·d²)"
    summary = "magnitude-aware: (1 + 1/S) s - S/N, sharper as |phi(q)| grows (MALA); causal in chunks"
