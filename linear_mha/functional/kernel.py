"""Kernel (linear) attention, "Transformers are RNNs" (Katharopoulos et al., 2020):

    out_i = phi(q_i) . sum_j phi(k_j) v_j^T  /  phi(q_i) . sum_j phi(k_j)

computed right-to-left in O(N F Dv) instead of O(N^2). Causal attention restricts the sums to j <= i and runs the
chunked product in ``causal.py``, where a ones column appended to v carries the normaliser through the same product
(the state then has shape (F, Dv + 1), the layout ``kernel_state`` and ``kernel_step`` use too). Non-causal
attention computes the normaliser as a separate matrix-vector product instead, which is cheaper than widening v.
On float32 CPU tensors with elu/relu, attention (forward and backward, causal or not) and the decoding step run
in the compiled kernels of ``native.py`` when they could be built, with the feature map and the division fused
into the products.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import backend, fla_causal, native
from ._common import (append_ones, check_qkv, compute_dtype, drop_keys, functorch_active, mask_keys, needs_grad,
                      normalise, outside_autocast, safe_normaliser, split_normalise)
from .causal import causal_linear_product, check_chunk_size, step_unchecked
from .causal_kernel import causal_kernel, kernel_inference_blocks
from .feature_maps import FeatureMap, apply_feature_map, elementwise_feature_map


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
    feature_map: "elu" | "relu" | "favor" (needs ``projection`` (m, D)) | "taylor" | "taylor2" | callable psi.
    key_padding_mask: bool (B, S), True = ignore; masked keys add nothing to numerator or normaliser.
    causal: query i sees keys j <= i (requires L == S).
    dropout_p: key dropout on the numerator (see ``_common.drop_keys``); pass 0 in eval.
    initial_state: (B, H, F, Dv + 1) state of extra keys every query sees (e.g. from ``kernel_state``).
    """
    check_qkv(q, k, v, key_padding_mask)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal kernel attention needs as many queries as keys, got L={q.shape[-2]}, S={k.shape[-2]}")
    causal = causal and q.shape[-2] > 0  # an empty sequence has no future to hide; the chunked paths need N >= 1
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    if causal and dtype != out_dtype and backend.kernel_backend(  # half inputs: fla takes them as they are
            q, k, v, feature_map, causal=True, initial_state=initial_state).backend == backend.FLA:
        if chunk_size is not None:
            check_chunk_size(chunk_size)  # fla picks its own chunks; the argument is still checked
        return fla_causal.causal_kernel_fla(q, k, drop_keys(v, dropout_p), feature_map, key_padding_mask)
    q, k, v = q.to(dtype), k.to(dtype), drop_keys(v.to(dtype), dropout_p)
    if initial_state is not None:
        initial_state = initial_state.to(dtype)
    chosen = backend.kernel_backend(q, k, v, feature_map, causal=causal, initial_state=initial_state,
                                    input_dtype=out_dtype).backend
    if chosen == backend.NATIVE:
        # The compiled kernels skip masked keys themselves, so v is not copied to zero them.
        _check_state(initial_state, q, v)
        if chunk_size is not None:
            check_chunk_size(chunk_size)  # the kernels pick their own block size; the argument is still checked
        return native.kernel_attention(q, k, v, feature_map, key_padding_mask, initial_state, causal).to(out_dtype)
    v = mask_keys(v, key_padding_mask)
    if chosen == backend.FUSED_CAUSAL:
        _check_state(initial_state, q, v)
        kwargs = {} if chunk_size is None else {"chunk_size": check_chunk_size(chunk_size)}
        return causal_kernel(q, k, v, feature_map, key_padding_mask=key_padding_mask,
                             initial_state=initial_state, **kwargs).to(out_dtype)
    if chosen == backend.BLOCKED:
        _check_state(initial_state, q, v)
        return kernel_inference_blocks(q, k, v, feature_map, key_padding_mask, initial_state).to(out_dtype)
    # With an initial state, the keys' FAVOR+ stabiliser must be kernel_state's data-independent one: both sums
    # enter one normaliser, and a per-call data-dependent constant would not cancel between them.
    phi_q, phi_k = apply_feature_map(
        feature_map, q, k, key_padding_mask=key_padding_mask, causal=causal or initial_state is not None,
        projection=projection,
    )
    # The output may be written over phi(k) when the map made it fresh (a named map), at inference.
    return feature_attention(phi_q, phi_k, v, causal=causal, initial_state=initial_state, chunk_size=chunk_size,
                             reuse_keys=isinstance(feature_map, str)).to(out_dtype)


def feature_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool = False,
                      initial_state: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                      reuse_keys: bool = False) -> Tensor:
    """Normalised linear attention on features already made: phi_q (B, H, L, F), phi_k (B, H, S, F) non-negative
    with masked keys' rows zero, v (B, H, S, Dv) with masked rows zero -> (B, H, L, Dv), in the features' dtype.
    initial_state (B, H, F, Dv + 1): extra keys every query sees. reuse_keys: phi_k is a temporary the output may
    be written over (inference only)."""
    if causal:
        kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
        num_den = causal_linear_product(phi_q, phi_k, append_ones(v), initial_state=initial_state, **kwargs)
        return split_normalise(num_den)
    # Non-causal: the normaliser phi(q) . sum_j phi(k_j) is a matrix-vector product; keeping it out of the value
    # GEMM avoids copying v into a ones-column layout and an odd GEMM width.
    kv, k_sum = key_value_sums(phi_k, v)
    if initial_state is not None:
        kv = kv + initial_state[..., :-1]
        k_sum = k_sum + initial_state[..., -1:]
    den = torch.matmul(phi_q, k_sum)
    if needs_grad(phi_q, phi_k, v, initial_state):
        return normalise(torch.matmul(phi_q, kv), den)
    # Inference (accelerators, or maps without a blocked path): the output is written over phi(k) (a fresh
    # tensor for the named maps, used up by now) and divided in place. Fresh multi-megabyte outputs cost page
    # faults, not only bandwidth: at N = 16k on CPU this measured 30% faster.
    reuse = reuse_keys and phi_k.shape == phi_q.shape[:-1] + v.shape[-1:] and not functorch_active()
    num = torch.matmul(phi_q, kv, out=phi_k) if reuse else torch.matmul(phi_q, kv)
    return num.div_(safe_normaliser(den))


def key_value_sums(phi_k: Tensor, v: Tensor, pieces: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """sum_j phi(k_j) v_j^T (B, H, F, Dv) and sum_j phi(k_j) (B, H, F, 1) over the S positions of phi_k (B, H, S, F)
    and v (B, H, S, Dv).

    On CUDA the sum runs as ``pieces`` partial products of one batched matmul, then a sum over them: a single
    (F x S) @ (S x Dv) product per head gives the GPU only B * H small output tiles to spread over its
    multiprocessors, each walking all S positions. A forward written this way measured 0.69 ms against 1.19 ms in
    bfloat16 and 0.48 against 1.01 in float32 (B 1, H 16, S 16k, d 64, H100). Elsewhere (CPU threads split a
    single product well) ``pieces`` defaults to 1."""
    s = phi_k.shape[-2]
    if pieces is None:
        pieces = min(64, s // 256) if phi_k.device.type == "cuda" else 1
    if pieces < 2:
        return torch.matmul(phi_k.transpose(-2, -1), v), phi_k.sum(dim=-2).unsqueeze(-1)
    whole = s - s % pieces  # positions that split evenly; the rest is one more product
    split_k = phi_k[..., :whole, :].unflatten(-2, (pieces, whole // pieces))
    split_v = v[..., :whole, :].unflatten(-2, (pieces, whole // pieces))
    kv = torch.matmul(split_k.transpose(-2, -1), split_v).sum(dim=-3)
    k_sum = split_k.sum(dim=-2).sum(dim=-2)
    if whole < s:
        kv = kv + torch.matmul(phi_k[..., whole:, :].transpose(-2, -1), v[..., whole:, :])
        k_sum = k_sum + phi_k[..., whole:, :].sum(dim=-2)
    return kv, k_sum.unsqueeze(-1)


def _check_state(initial_state, q, v):
    if initial_state is None:
        return
    expected = (q.shape[0], q.shape[1], q.shape[-1], v.shape[-1] + 1)
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
    state per step (about 2 us of the compiled step's 12-14 us at B*H = 8, d = 64 on the README's CPU).
    """
    if inplace and state is not None and state.requires_grad and torch.is_grad_enabled():
        raise ValueError("kernel_step(inplace=True) overwrites the state, which autograd cannot differentiate "
                         "through; pass inplace=False when gradients are needed")
    if native.step_ready(feature_map, q, k, v, state):  # valid inputs for the compiled step, checked cheaply
        return native.kernel_step(q, k, v, state, feature_map, inplace)
    _check_step(q, k, v, state)
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    convert = out_dtype != dtype  # only half inputs: the no-op .to() calls alone cost ~20 us per step
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
