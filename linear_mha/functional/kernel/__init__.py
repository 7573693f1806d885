"""Kernel (linear) attention, "Transformers are RNNs" (Katharopoulos et al., 2020):

    out_i = phi(q_i) . sum_j phi(k_j) v_j^T  /  phi(q_i) . sum_j phi(k_j)

computed right-to-left in O(N F Dv) instead of O(N^2). One package, one formula, several implementations:

    __init__.py   the entry: ``kernel`` asks ``backend.kernel_backend`` once and runs what it names; the state of a
                  set of keys (``kernel_state``) and the recurrent decoding step (``kernel_step``, through
                  ``backend.step_backend``)
    naive.py      the explicit O(L S) form every implementation is tested against
    composed.py   plain PyTorch ops on features made already (any map, dtype, device; autograd, torch.func)
                  (``feature_attention`` here sends float32 CPU features to the compiled products instead)
    chunked.py    the causal product in chunks (O(N d) memory) with its own backward, and its recurrent step
    fused.py      elu/relu without N-sized temporaries: the causal Function, and blocked inference
    ../native.py  the compiled CPU code (elu/relu, or features made by any map; float32), forward, backward, step

Causal attention carries the normaliser through the product as a ones column appended to v (states of shape
(F, Dv + 1), the layout ``kernel_state`` and ``kernel_step`` use too); non-causal attention computes it as a separate
matrix-vector product, which is cheaper than widening v.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import backend, fla_causal, native, triton_causal, triton_kernel
from .._common import (append_ones, check_qkv, compute_dtype, drop_keys, has_tangent, mask_keys, outside_autocast,
                       shares_memory_across_elements, split_normalise)
from ..elementwise_program import program_map
from ..feature_maps import FeatureMap, apply_feature_map, elementwise_feature_map
from .chunked import (CHUNK_SIZE, causal_linear_product, causal_linear_state, causal_linear_step, check_chunk_size,
                      step_unchecked)
from .composed import composed_attention, key_value_sums
from .fused import causal_kernel, kernel_inference_blocks

__all__ = ["kernel", "kernel_state", "check_state", "kernel_step", "feature_attention", "key_value_sums",
           "causal_linear_product", "causal_linear_state", "causal_linear_step", "check_chunk_size", "CHUNK_SIZE"]


@outside_autocast
def kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMap = "elu",
    *,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    projection: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """Normalised kernel attention.

    Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) -> (B, H, L, Dv), in q's dtype (float16/bfloat16
    inputs accumulate in float32).
    feature_map: "elu" | "relu" | "favor" (needs ``projection`` (m, D)) | "taylor" | "taylor2" | callable psi, e.g.
    a ``focused.FocusedMap``, or a function of elementwise steps such as ``lambda x: torch.relu(x) ** 2``
    (``elementwise_program``): both computed inside the compiled kernels on float32 CPU tensors.
    key_padding_mask: bool (B, S), True = ignore; masked keys add nothing to numerator or normaliser.
    causal: query i sees keys j <= i (requires L == S).
    dropout_p: key dropout on the numerator (see ``_common.drop_keys``); pass 0 in eval.
    initial_state: (B, H, F, Dv + 1) state of extra keys every query sees (e.g. from ``kernel_state``).
    chunk_size: chunk length of the causal product (the compiled code and fla pick their own; still checked).
    """
    check_qkv(q, k, v, key_padding_mask)
    feature_map = program_map(feature_map)  # a user's elementwise callable the compiled kernels can run as steps
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal kernel attention needs as many queries as keys, got L={q.shape[-2]}, S={k.shape[-2]}")
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    causal = causal and q.shape[-2] > 0  # an empty sequence has no future to hide; the chunked paths need N >= 1
    chosen = backend.kernel_backend(q, k, v, feature_map, causal=causal, initial_state=initial_state).backend
    if chosen == backend.FLA:  # half inputs as they are: fla accumulates in its own way
        return fla_causal.causal_kernel_fla(q, k, drop_keys(v, dropout_p), feature_map, key_padding_mask)
    if chosen == backend.TRITON and causal:  # the map in the inputs' dtype; the product accumulates in float32
        phi_q, phi_k = apply_feature_map(feature_map, q, k, key_padding_mask=key_padding_mask, causal=True,
                                         projection=projection)
        check_state(initial_state, phi_q.shape[-1], v)
        values = append_ones(mask_keys(drop_keys(v, dropout_p), key_padding_mask))
        num_den = triton_causal.causal_product(phi_q, phi_k, values, initial_state, out_dtype=torch.float32)
        return split_normalise(num_den).to(q.dtype)
    if chosen == backend.TRITON:  # half inputs as they are: the kernels accumulate in float32
        check_state(initial_state, native.feature_count(feature_map, q.shape[-1]), v)
        return triton_kernel.kernel_attention(q, k, drop_keys(v, dropout_p), feature_map, key_padding_mask,
                                              initial_state)
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), drop_keys(v.to(dtype), dropout_p)
    if initial_state is not None:
        initial_state = initial_state.to(dtype)
        if chosen not in (backend.COMPOSED, backend.NATIVE_FEATURES):  # elu/relu: F = D, taylor D + 1
            check_state(initial_state, native.feature_count(feature_map, q.shape[-1]), v)
    if chosen == backend.NATIVE:  # the compiled code skips masked keys itself: v is not copied to zero them
        return native.kernel_attention(q, k, v, feature_map, key_padding_mask, initial_state, causal).to(out_dtype)
    # With an initial state, the keys' FAVOR+ stabiliser must be kernel_state's data-independent one: both sums
    # enter one normaliser, and a per-call data-dependent constant would not cancel between them.
    feature_options = dict(key_padding_mask=key_padding_mask, causal=causal or initial_state is not None,
                           projection=projection)
    made = None
    if chosen == backend.NATIVE_FEATURES:
        made = apply_feature_map(feature_map, q, k, **feature_options)
        # Features whose map has parameters of its own (a closure's, focused's scale) may carry forward-mode
        # tangents that q and k do not, which the compiled products would drop: those take PyTorch ops below.
        if not has_tangent(*made):
            phi_q, phi_k = compiled_features(*made, feature_map)
            check_state(initial_state, phi_q.shape[-1], v)
            return native.kernel_attention(phi_q, phi_k, v, None, key_padding_mask, initial_state, causal).to(out_dtype)
    v = mask_keys(v, key_padding_mask)
    if chosen == backend.FUSED_CAUSAL:
        return causal_kernel(q, k, v, feature_map, key_padding_mask=key_padding_mask, initial_state=initial_state,
                             chunk_size=chunk_size or CHUNK_SIZE).to(out_dtype)
    if chosen == backend.BLOCKED:
        return kernel_inference_blocks(q, k, v, feature_map, key_padding_mask, initial_state).to(out_dtype)
    phi_q, phi_k = made or apply_feature_map(feature_map, q, k, **feature_options)
    # The output may be written over phi(k) when the map made it fresh (a named map), at inference.
    return composed_attention(phi_q, phi_k, v, causal=causal, initial_state=initial_state, chunk_size=chunk_size,
                              reuse_keys=isinstance(feature_map, str)).to(out_dtype)


def feature_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool = False,
                      initial_state: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                      reuse_keys: bool = False) -> Tensor:
    """Normalised linear attention on features already made: phi_q (B, H, L, F), phi_k (B, H, S, F) non-negative
    with masked keys' rows zero, v (B, H, S, Dv) with masked rows zero -> (B, H, L, Dv), in the features' dtype.
    initial_state (B, H, F, Dv + 1): extra keys every query sees. chunk_size: of the causal product (the compiled
    code picks its own). reuse_keys: phi_k is a temporary the output may be written over (inference only).
    Runs where ``backend.features_backend`` says: the compiled products on float32 CPU features, else PyTorch ops."""
    if causal and phi_q.shape[-2] != phi_k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got L={phi_q.shape[-2]}, "
                         f"S={phi_k.shape[-2]}")
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    if backend.features_backend(phi_q, phi_k, v, initial_state).backend == backend.NATIVE_FEATURES:
        check_state(initial_state, phi_q.shape[-1], v)
        return native.kernel_attention(native.rows_readable(phi_q), native.rows_readable(phi_k), v, None,
                                       initial_state=initial_state, causal=causal)
    return composed_attention(phi_q, phi_k, v, causal=causal, initial_state=initial_state, chunk_size=chunk_size,
                              reuse_keys=reuse_keys)


def compiled_features(phi_q: Tensor, phi_k: Tensor, feature_map) -> Tuple[Tensor, Tensor]:
    """Features a map made (a user's callable among them) as the compiled code reads them: float32, the last
    dimension contiguous, (B, H, N, F) for queries and keys alike. A map that changes the batch or head sizes, or
    gives queries and keys different feature counts, is refused by name rather than read out of bounds."""
    if phi_q.dim() != 4 or phi_k.dim() != 4 or phi_q.shape[:2] != phi_k.shape[:2] \
            or phi_q.shape[-1] != phi_k.shape[-1]:
        name = getattr(feature_map, "__name__", feature_map)
        raise ValueError(f"feature_map {name!r} must map (..., D) rows to (..., F) features alike for queries and keys;"
                         f" it gave {tuple(phi_q.shape)} and {tuple(phi_k.shape)}")
    return tuple(native.rows_readable(phi.to(torch.float32)) for phi in (phi_q, phi_k))


def check_state(initial_state, features, v):
    if initial_state is None:
        return
    expected = (v.shape[0], v.shape[1], features, v.shape[-1] + 1)
    if tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state must have shape (B, H, F, Dv + 1) = {expected}, got "
                         f"{tuple(initial_state.shape)}; build it with kernel_state(k, v, feature_map)")


@outside_autocast
def kernel_state(
    k: Tensor,
    v: Tensor,
    feature_map: FeatureMap = "elu",
    *,
    key_padding_mask: Optional[Tensor] = None,
    projection: Optional[Tensor] = None,
) -> Tensor:
    """State sum_j phi(k_j) [v_j, 1]^T of a set of keys: k (B, H, S, D), v (B, H, S, Dv) -> (B, H, F, Dv + 1).

    Causal feature statistics are used (no data-dependent key stabiliser), so the state can seed causal
    attention or recurrent decoding (``kernel_step``)."""
    dtype = compute_dtype(k.dtype)
    # apply_feature_map wants a query too; keys stand in for it since only phi(k) is used.
    _, phi_k = apply_feature_map(
        feature_map, k[..., :1, :].to(dtype), k.to(dtype), key_padding_mask=key_padding_mask, causal=True,
        projection=projection,
    )
    v1 = append_ones(mask_keys(v.to(dtype), key_padding_mask))
    return torch.matmul(phi_k.transpose(-2, -1), v1)


def kernel_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Optional[Tensor],
    feature_map: FeatureMap = "elu",
    *,
    projection: Optional[Tensor] = None,
    inplace: bool = False,
) -> Tuple[Tensor, Tensor]:
    """One recurrent decoding step of causal kernel attention, O(F Dv) whatever the context length.

    q, k: (B, H, D); v: (B, H, Dv); state: (B, H, F, Dv + 1) or None for an empty context.
    Returns (out (B, H, Dv), new_state). Feeding tokens one by one equals ``kernel(..., causal=True)``.
    inplace: update ``state`` in place and return it as new_state (inference only), which saves allocating a
    state per step (a measurable part of a step: docs/benchmarks.md, "Why the code is shaped as it is").
    """
    if inplace and state is not None and state.requires_grad and torch.is_grad_enabled():
        raise ValueError("kernel_step(inplace=True) overwrites the state, which autograd cannot differentiate "
                         "through; pass inplace=False when gradients are needed")
    if inplace and state is not None and shares_memory_across_elements(state):
        raise ValueError("kernel_step(inplace=True) would write through a broadcast (expanded) state, whose elements "
                         "share memory; pass state.clone() (or inplace=False)")
    if backend.step_backend(q, k, v, state, feature_map).backend == backend.NATIVE:
        return native.kernel_step(q, k, v, state, feature_map, inplace)
    _check_step(q, k, v, state)
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    convert = out_dtype != dtype  # only half inputs: decoding is bound by per-op overhead, even no-op .to() calls
    if feature_map == "favor":
        phi_q, phi_k = apply_feature_map(feature_map, q[:, :, None].to(dtype), k[:, :, None].to(dtype), causal=True,
                                         projection=projection)
        phi_q, phi_k = phi_q[:, :, 0], phi_k[:, :, 0]
    else:
        # Query and key through the map in one call: decoding is bound by per-op overhead, not arithmetic.
        qk = torch.stack((q, k))
        phi_q, phi_k = elementwise_feature_map(feature_map)(qk.to(dtype) if convert else qk).unbind(0)
    v1 = append_ones(v.to(dtype) if convert else v)
    _check_step_state(state, q.shape[:2], phi_q.shape[-1], v1.shape[-1])
    num_den, new_state = step_unchecked(phi_q, phi_k, v1, state)
    if inplace and state is not None:
        new_state = state.copy_(new_state)
    out = split_normalise(num_den)
    return (out.to(out_dtype) if convert else out), new_state


def _check_step_state(state, batch_heads, features, width):
    if state is not None and (state.shape[:2] != batch_heads or state.shape[-2:] != (features, width)):
        raise ValueError(f"state must have shape (B, H, F, Dv + 1) = {(*batch_heads, features, width)}, "
                         f"got {tuple(state.shape)}")


def _check_step(q, k, v, state):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"kernel_step takes one position per call: {name} must be a floating-point "
                             f"(B, H, D) tensor, got {got}")
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} must be equal and v {tuple(v.shape)} must share "
                         f"their (B, H)")
    if state is not None and (not isinstance(state, torch.Tensor) or state.dim() != 4):
        raise ValueError("state must be a (B, H, F, Dv + 1) tensor from kernel_state or kernel_step, or None")
