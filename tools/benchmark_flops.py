"""FLOP counts of tools/benchmark.py's cases, per forward (fwdbwd counts 3x: the backward runs two products per
forward product). Every attention method states its own count (``AttentionMethod.flops``: the registry's methods,
and the formulas behind them, e.g. ``linear_mha.methods.kernel.feature_attention_flops``); the peers compute the
same functions as a method of ours and take its count. The module level adds the projections:
    module level         + 8 B N E^2                     in-projection (3E) and out-projection (E)
"""
from typing import Callable, Optional

from linear_mha import method_class
from linear_mha.functional.kernel import CHUNK_SIZE


def chunk_size() -> int:
    """The causal product's chunk length, for the benchmark's records."""
    return CHUNK_SIZE


def case_options(mode: str, c: dict) -> dict:
    """The options a case sets on a method: Linformer's projected length --proj-k, and its sequence length N."""
    cls = method_class(mode)
    sized = {"proj_k": c["proj_k"]} if "proj_k" in cls.options else {}
    if cls.sequence_length_option is not None:
        sized[cls.sequence_length_option] = c["N"]
    return sized


def method_flops(mode: str, options: Optional[dict] = None, causal: Optional[bool] = None) -> Callable:
    """The FLOP formula of registered method ``mode`` with ``options``: a function of the case (None where the method
    states none). ``causal`` overrides the case's (a peer that is not causal timed in a causal row)."""
    def flops(c):
        method = method_class(mode)(**{**(options or {}), **case_options(mode, c)})
        return method.flops(c["B"] * c["H"], c["N"], c["d"], c["causal"] if causal is None else causal)
    return flops


def projection_flops(c) -> float:
    return 8.0 * c["B"] * c["N"] * (c["H"] * c["d"]) ** 2


def plus_projections(flops):
    """A core FLOP formula plus the module's in- and out-projections (None stays None)."""
    def total(c):
        core = flops(c)
        return None if core is None else core + projection_flops(c)
    return total
