"""Causal kernel attention with an elementwise feature map as one autograd Function.

Composed from autograd ops, causal kernel attention keeps phi(q), phi(k), the ones-column copy of v
and the unnormalised product alive until backward: four (B, H, N, D)-sized tensors besides the
inputs. This Function keeps only q, k, v (the caller holds them anyway), the output and the
normaliser (B, H, N, 1), and recomputes the rest in backward, where the feature map's derivative is
read off its output:

    elu(x) + 1:  d/dx = 1 for x > 0, exp(x) = phi for x <= 0   ->  min(phi, 1)
    relu(x):     d/dx = [phi > 0]

so both gradients are computed in place on the product's gradients.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._common import append_ones, mask_keys, safe_normaliser
from .causal import _backward as _product_backward
from .causal import _forward as _product_forward
from .feature_maps import elementwise_feature_map

FUSED_FEATURE_MAPS = ("elu", "relu")


def _features(q, k, v, key_padding_mask, feature_map):
    fn = elementwise_feature_map(feature_map)
    phi_k = mask_keys(fn(mask_keys(k, key_padding_mask)), key_padding_mask)
    return fn(q), phi_k, append_ones(v)


def _derivative_in_place(grad: Tensor, phi: Tensor, feature_map: str) -> Tensor:
    """grad * dphi/dx, with the derivative recovered from phi (see the module docstring)."""
    if feature_map == "elu":
        return grad.mul_(phi.clamp_(max=1.0))
    return grad.mul_(phi > 0)


def _forward(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size):
    """(out, normaliser with its zeros replaced by 1), normalised as in ``_common.normalise``."""
    phi_q, phi_k, v1 = _features(q, k, v, key_padding_mask, feature_map)
    del q, k
    num_den = _product_forward(phi_q, phi_k, v1, initial_state, chunk_size)
    del phi_q, phi_k, v1
    den = safe_normaliser(num_den[..., -1:])
    return num_den[..., :-1] / den, den


class _CausalKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, initial_state, key_padding_mask, feature_map, chunk_size):
        out, den = _forward(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size)
        ctx.save_for_backward(q, k, v, initial_state, key_padding_mask, out, den)
        ctx.feature_map, ctx.chunk_size = feature_map, chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, initial_state, key_padding_mask, out, den = ctx.saved_tensors
        need_q, need_k, need_v, need_init = ctx.needs_input_grad[:4]
        # out = num / den: d num = g / den, d den = -(g . out) / den.
        grad_num = grad_out / den
        grad_den = (grad_num * out).sum(-1, keepdim=True).neg_()
        grad_num_den = torch.cat([grad_num, grad_den], dim=-1)
        del grad_num, grad_den
        phi_q, phi_k, v1 = _features(q, k, v, key_padding_mask, ctx.feature_map)
        g_phi_q, g_phi_k, g_v1, g_init = _product_backward(
            phi_q, phi_k, v1, initial_state, grad_num_den, ctx.chunk_size, (need_q, need_k, need_v, need_init))
        del grad_num_den, v1
        g_q = None if g_phi_q is None else _derivative_in_place(g_phi_q, phi_q, ctx.feature_map)
        g_k = None if g_phi_k is None else _derivative_in_place(g_phi_k, phi_k, ctx.feature_map)
        g_v = None if g_v1 is None else g_v1[..., :-1]
        return g_q, g_k, g_v, g_init, None, None, None


def causal_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: str,
    *,
    key_padding_mask: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> Tensor:
    """Normalised causal kernel attention for feature_map in FUSED_FEATURE_MAPS; no argument checks
    (``kernel.kernel`` does them and calls this).

    Shapes: q, k (B, H, N, D), v (B, H, N, Dv), all of one float32/float64 dtype; key_padding_mask
    (B, N) bool, True = ignore; initial_state (B, H, D, Dv + 1). Returns (B, H, N, Dv).
    """
    tensors = (q, k, v) if initial_state is None else (q, k, v, initial_state)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _CausalKernel.apply(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size)
    return _forward(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size)[0]
