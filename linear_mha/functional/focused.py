"""Focused linear attention (FLatten Transformer, Han et al., ICCV 2023): kernel attention whose feature map keeps
ReLU features' norm but raises their direction to a power, so a query can sharpen its attention:

    phi_p(x) = f_p(relu(x) / s),   f_p(y) = (|y| / |y**p|) * y**p   (elementwise power p, the focusing factor)

s is a learnable per-channel scale (FLatten: softplus of a parameter initialised at 0). Plain kernel maps give
phi(q).phi(k) whose spread over keys cannot grow with the query's confidence; y**p pulls each feature vector
toward its largest components, making similar vectors more similar and the rest less (FLatten, section 4.1).
FLatten normalises over a whole token's channels; here, as for every method, each head is one vector.
"""
from typing import Optional

import torch
from torch import Tensor

from . import backend, native, native_maps
from ._common import compute_dtype, drop_keys
from .kernel import check_initial_state, check_kernel_inputs, kernel

RELU_EPS = 1e-6  # FLatten's relu(x) + 1e-6: no feature vector is exactly zero, so no normaliser vanishes


def focused_feature_map(x: Tensor, focusing_factor: float = 3.0, scale: Optional[Tensor] = None) -> Tensor:
    """phi_p(x) on the last dimension: x (..., d) -> (..., d); ``scale`` broadcastable to x, positive. Float32 CPU
    rows (B, H, N, d) with one scale per head and channel run as one compiled pass (``backend.focused_map_backend``)."""
    if backend.focused_map_backend(x, scale).backend == backend.NATIVE:
        return native_maps.focused_map(x, _per_head(scale, x), focusing_factor)
    return composed_focused_map(x, focusing_factor, scale)


def _per_head(scale: Optional[Tensor], x: Tensor) -> Optional[Tensor]:
    """A scale of one value per head and channel, (..., H|1, 1, d|1), as the compiled code reads it: (H, d)
    contiguous (autograd carries its gradient back to the caller's shape)."""
    if scale is None:
        return None
    per_head = scale.reshape((1,) * (4 - scale.dim()) + tuple(scale.shape))[0, :, 0, :]
    return per_head.expand(x.shape[1], x.shape[3]).contiguous()


def composed_focused_map(x: Tensor, focusing_factor: float = 3.0, scale: Optional[Tensor] = None) -> Tensor:
    """focused_feature_map from PyTorch ops: any shape, dtype, device, autograd and torch.func."""
    y = torch.relu(x) + RELU_EPS
    if scale is not None:
        y = y / scale
    # Everything is computed on y / max(y), in [0, 1]: |y| = max(y) |y / max(y)| and y**p / |y**p| does not depend
    # on y's scale, so neither the norm nor the power can overflow, whatever p and the size of x.
    peak = y.amax(dim=-1, keepdim=True)
    unit = y / peak
    powered = unit ** focusing_factor
    norm = peak * torch.linalg.vector_norm(unit, dim=-1, keepdim=True)
    return powered / torch.linalg.vector_norm(powered, dim=-1, keepdim=True) * norm


def focused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    focusing_factor: float = 3.0,
    scale: Optional[Tensor] = None,
    causal: bool = False,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    initial_state: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """Focused linear attention: q (B, H, L, d), k (B, H, S, d), v (B, H, S, d_v) -> (B, H, L, d_v).

    scale: positive, broadcastable to (B, H, N, d), e.g. (H, 1, d) per head and channel (None: 1). Masks, causality,
    dropout and initial_state as in ``kernel`` (the state has feature size d). On float32 CPU tensors with one scale
    per head and channel the map runs inside the compiled kernels, forward and backward, and no feature tensor is
    made; elsewhere the map's features go to ``kernel`` (``backend.focused_backend`` says which, and why)."""
    if isinstance(focusing_factor, bool) or not isinstance(focusing_factor, (int, float)) or focusing_factor <= 0:
        raise ValueError(f"focusing_factor must be a positive number, got {focusing_factor!r}")
    chosen = backend.focused_backend(q, k, v, scale, causal=causal, initial_state=initial_state).backend
    if chosen == backend.NATIVE:  # the map inside the compiled kernels' row loaders: no feature tensors are made
        causal = check_kernel_inputs(q, k, v, key_padding_mask, causal, chunk_size)
        out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
        q, k, v = q.to(dtype), k.to(dtype), drop_keys(v.to(dtype), dropout_p)
        if initial_state is not None:
            initial_state = initial_state.to(dtype)
            check_initial_state(initial_state, q.shape[-1], v)
        settings = (float(focusing_factor), None if scale is None else _per_head(scale.to(dtype), q))
        return native.kernel_attention(q, k, v, "focused", key_padding_mask, initial_state, causal,
                                       focused=settings).to(out_dtype)

    def feature(x):
        return focused_feature_map(x, focusing_factor, scale)

    return kernel(q, k, v, feature, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
                  initial_state=initial_state, chunk_size=chunk_size)
