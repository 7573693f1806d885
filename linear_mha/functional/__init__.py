"""Pure attention functions on (batch, heads, seq, dim) tensors: one method per module.

    softmax    exact reference (SDPA when no weights are needed)
    linformer  keys/values projected along the sequence (Wang et al.)
    kernel     phi(Q)(phi(K)^T V) normalised; elu / relu / favor / taylor / callable feature maps: the package
               kernel/ (its entry, the naive form, composed ops, the chunked causal product, the fused paths)
    efficient_attention  softmax(Q over features) (softmax(K over sequence)^T V) (Shen et al.)
    taylor     first-order Taylor of exp on L2-normalised Q, K
    centred_kernel  kernel similarities normalised by subtraction (InLine) or magnitude-aware (MALA)
    focused    kernel attention with FLatten's focused map (ReLU features, direction raised to a power)
    hedgehog   kernel attention with learnable per-head maps [softmax(xW), softmax(-xW)] (Zhang et al.)
    token_grid_conv  the local term: a depthwise convolution of the values over the token grid
    agent_attention  softmax through a x a agent tokens pooled from the queries over the token grid (Han et al.)
    block_local_attention  softmax within blocks of w positions and the block before (and after): local heads
    gated_linear_attention  causal: a state that decays per key dimension or per head before each write (GLA,
               Mamba-2's decay, RetNet's retention), chunked, with its recurrence and step
    delta_rule_attention  causal: a state that overwrites what a key held (DeltaNet, Gated DeltaNet), in the
               chunked WY form, with its recurrence and step
    causal_linear_product / causal_linear_step  the chunked causal product and its recurrent form
    append_ones / split_normalise / drop_keys   the building blocks other layers reuse with the product
    backend    which implementation runs a call (compiled CPU code, fla, fused causal, blocked, chunked, composed)
               and why: asked once per call
    native     the compiled CPU code (``native_build`` compiles and caches it)
    output_cache  the compiled code's large outputs, kept between calls: its limit, stats and ``empty()``
"""
import warnings

from . import backend, native, output_cache  # noqa: F401  (public submodules)
from ._common import append_ones, drop_keys, split_normalise
from .agent import agent_attention, pool_agents
from .block_local import block_local_attention
from .centred import centred_kernel
from .efficient_attention import efficient_attention
from .focused import focused, focused_feature_map
from .hedgehog import hedgehog, hedgehog_features
from .grid_conv import token_grid_conv
from .feature_maps import (
    FEATURE_MAPS,
    apply_feature_map,
    default_num_favor_features,
    elu_feature_map,
    favor_feature_map,
    orthogonal_random_features,
    relu_feature_map,
    resolve_feature_map,
    taylor_feature_map,
    taylor2_feature_map,
)
from .kernel import (causal_linear_product, causal_linear_state, causal_linear_step, kernel, kernel_state,
                     kernel_step)
from .delta_rule import delta_rule_attention, delta_rule_recurrent, delta_rule_step
from .gated_linear import gated_linear_attention, gated_linear_recurrent, gated_linear_step
from .linformer import linformer
from .softmax import softmax
from .taylor import taylor
from .taylor2 import taylor2

__all__ = [
    "softmax", "linformer", "kernel", "centred_kernel", "kernel_state", "kernel_step", "efficient_attention", "taylor", "taylor2", "focused",
    "focused_feature_map", "token_grid_conv", "agent_attention", "pool_agents", "block_local_attention", "hedgehog", "hedgehog_features",
    "causal_linear_product", "causal_linear_state", "causal_linear_step",
    "gated_linear_attention", "gated_linear_recurrent", "gated_linear_step",
    "delta_rule_attention", "delta_rule_recurrent", "delta_rule_step",
    "append_ones", "split_normalise", "drop_keys",
    "FEATURE_MAPS", "apply_feature_map", "resolve_feature_map", "default_num_favor_features",
    "elu_feature_map", "relu_feature_map", "taylor_feature_map", "taylor2_feature_map", "favor_feature_map", "orthogonal_random_features",
]


def efficient(q, k, v, **kwargs):
    """Deprecated: the old name of :func:`efficient_attention`, which it calls."""
    warnings.warn("linear_mha.functional.efficient() is now efficient_attention(); the old name still works and will "
                  "be removed in a later release", DeprecationWarning, stacklevel=2)
    return efficient_attention(q, k, v, **kwargs)
