"""FLOP counts of tools/benchmark.py's cases, per forward (fwdbwd counts 3x: the backward runs two products per
forward product). BH = B H, F = feature size (elu d, taylor d + 1, taylor2 1 + d + d (d + 1) / 2, favor
m = d ln d), Dv = d + 1 in the causal product (the ones column that yields the normaliser), C = the causal chunk
size (causal_linear_product's default), N' = N rounded up to whole chunks, k = --proj-k:
    kernel, non-causal   2 BH N F (2 d + 1)              phi(K)^T V, phi(Q) S, and the normaliser phi(Q) sum phi(K)
    kernel, causal       4 BH N' F Dv + 2 BH N' C (F+Dv) chunk states and inter-chunk product + C x C intra-chunk
    favor features       + 4 BH N d m                    q and k times the random projection
    efficient            4 BH N d^2                      (peer linear-attention-transformer: the same count)
    peer fla             the causal kernel count         the same function as kernel_elu, causal only, CUDA only
    linformer            8 BH N k d                      E K, F V, scores, weights V
    softmax, SDPA        4 BH N^2 d, halved when causal
    module level         + 8 B N E^2                     in-projection (3E) and out-projection (E)
"""
import inspect
from typing import Callable, Optional

import linear_mha.functional as LF
from linear_mha import method_class


def chunk_size() -> int:
    default = inspect.signature(LF.causal_linear_product).parameters["chunk_size"].default
    return default if isinstance(default, int) else 64


def kernel_flops(c, features: int) -> float:
    bh, n, dv = c["B"] * c["H"], c["N"], c["d"] + 1
    if not c["causal"]:
        return 2.0 * bh * n * features * (2 * c["d"] + 1)
    chunk = min(chunk_size(), n)
    padded = -(-n // chunk) * chunk
    return 4.0 * bh * padded * features * dv + 2.0 * bh * padded * chunk * (features + dv)


def favor_features(d: int) -> int:
    return LF.default_num_favor_features(d)


def favor_flops(c, causal=None) -> float:
    m = favor_features(c["d"])
    case = c if causal is None else dict(c, causal=causal)
    return kernel_flops(case, m) + 4.0 * c["B"] * c["H"] * c["N"] * c["d"] * m


def softmax_flops(c) -> float:
    full = 4.0 * c["B"] * c["H"] * c["N"] ** 2 * c["d"]
    return full / 2 if c["causal"] else full


def efficient_flops(c) -> float:
    return 4.0 * c["B"] * c["H"] * c["N"] * c["d"] ** 2


def linformer_flops(c) -> float:
    return 8.0 * c["B"] * c["H"] * c["N"] * c["proj_k"] * c["d"]


def projection_flops(c) -> float:
    return 8.0 * c["B"] * c["N"] * (c["H"] * c["d"]) ** 2


def plus_projections(flops):
    """A core FLOP formula plus the module's in- and out-projections (None stays None)."""
    return lambda c: None if flops is None else flops(c) + projection_flops(c)


FEATURE_SIZES = {"elu": lambda d: d, "relu": lambda d: d, "taylor": lambda d: d + 1,
                 "taylor2": lambda d: 1 + d + d * (d + 1) // 2}
"""Feature size F of each named feature map with fixed features, from the head dimension d."""


def method_flops(mode: str, options: dict) -> Optional[Callable]:
    """The FLOP formula of a registered method with these options, or None for methods without one."""
    fmap = options.get("feature_map", "elu")
    if mode == "kernel" and fmap == "favor":
        return favor_flops
    if mode == "kernel":
        named = fmap
    elif mode == "focused":  # its features have the head's size d, as relu's
        named = "relu"
    else:  # methods with a fixed named map (taylor, taylor2) declare it on their class
        named = getattr(method_class(mode), "feature_map", None)
    if isinstance(named, str) and named in FEATURE_SIZES:
        return lambda c: kernel_flops(c, FEATURE_SIZES[named](c["d"]))
    if mode == "hedgehog":  # the two feature maps (d x m per head) and kernel attention on their 2m features
        def hedgehog_flops(c):
            m = options.get("feature_dim") or c["d"]
            return kernel_flops(c, 2 * m) + 4.0 * c["B"] * c["H"] * c["N"] * c["d"] * m
        return hedgehog_flops
    if mode == "agent":  # agents x keys, their values, queries x agents, and the agents' values read
        return lambda c: 8.0 * c["B"] * c["H"] * c["N"] * options.get("agents_per_side", 7) ** 2 * c["d"]
    return {"efficient": efficient_flops, "linformer": linformer_flops}.get(mode)
