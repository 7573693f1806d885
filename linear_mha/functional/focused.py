"""Focused linear attention (FLatten Transformer, Han et al., ICCV 2023): kernel attention whose feature map keeps
ReLU features' norm but raises their direction to a power, so a query can sharpen its attention:

    phi_p(x) = f_p(relu(x) / s),   f_p(y) = (|y| / |y**p|) * y**p   (elementwise power p, the focusing factor)

s is a learnable per-channel scale (FLatten: softplus of a parameter initialised at 0). Plain kernel maps give
phi(q).phi(k) whose spread over keys cannot grow with the query's confidence; y**p pulls each feature vector
toward its largest components, making similar vectors more similar and the rest less (FLatten, section 4.1).
FLatten normalises over a whole token's channels; here, as for every method, each head is one vector.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import backend, native_maps
from ._common import has_tangent
from .kernel import kernel

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


class FocusedMap:
    """focused's map as a value ``kernel`` takes: called, it makes the features (``focused_feature_map``); on float32
    CPU tensors with one scale per head and channel the compiled kernels compute it inside their row loaders
    instead, forward and backward, and no feature tensor is made (``compiled_map`` names it to them,
    ``compiled_settings`` gives its power and scales, ``why_not_compiled`` says when it cannot go there)."""

    compiled_map = "focused"
    __name__ = "focused"

    def __init__(self, focusing_factor: float = 3.0, scale: Optional[Tensor] = None):
        if isinstance(focusing_factor, bool) or not isinstance(focusing_factor, (int, float)) or focusing_factor <= 0:
            raise ValueError(f"focusing_factor must be a positive number, got {focusing_factor!r}")
        self.focusing_factor, self.scale = focusing_factor, scale

    def __call__(self, x: Tensor) -> Tensor:
        return focused_feature_map(x, self.focusing_factor, self.scale)

    def __repr__(self):
        return f"focused(focusing_factor={self.focusing_factor})"

    def why_not_compiled(self, q: Tensor) -> Optional[str]:
        if self.scale is not None and not self.scale.is_cpu:
            return f"the scale is on {self.scale.device}"
        return self.why_not_rows(q)

    def why_not_rows(self, q: Tensor) -> Optional[str]:
        """Why a fused kernel (compiled or Triton) cannot read q and the scale as they are shaped, or None. A scale
        with a forward-mode tangent cannot go there either: the kernels read its values and would drop it."""
        if has_tangent(self.scale):
            return "the scale carries a forward-mode AD tangent, which the fused kernels drop"
        return backend.why_not_focused_rows(q, self.scale)

    def compiled_settings(self, q: Tensor) -> Tuple[float, Optional[Tensor]]:
        """(power, scales (H, d) float32 contiguous or None) for q (B, H, N, d)."""
        scale = None if self.scale is None else _per_head(self.scale.to(torch.float32), q)
        return float(self.focusing_factor), scale


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
    made (``FocusedMap``); ``backend.kernel_backend`` says which path a call takes, and why."""
    return kernel(q, k, v, FocusedMap(focusing_factor, scale), causal=causal, key_padding_mask=key_padding_mask,
                  dropout_p=dropout_p, initial_state=initial_state, chunk_size=chunk_size)
