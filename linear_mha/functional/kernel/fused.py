"""Causal kernel attention with an elementwise feature map (elu, relu) as one autograd Function.

Composed from autograd ops, causal kernel attention makes phi(q), phi(k), a ones-column copy of v and
the unnormalised product as N-sized tensors, and keeps them for backward. Here the forward runs the
chunked product of ``causal.py`` block by block with the feature map, the ones column and the
division done on each block in reused buffers, and keeps only q, k, v (the caller holds them
anyway), the output and the normaliser (B, H, N, 1). The backward recomputes the features and reads
the map's derivative off them:

    elu(x) + 1:  d/dx = 1 for x > 0, exp(x) = phi for x <= 0   ->  min(phi, 1)
    relu(x):     d/dx = [phi > 0]

so both gradients are computed in place on the product's gradients.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import backend
from .._common import append_ones, needs_grad, no_autocast, safe_normaliser
from ..feature_maps import IN_PLACE_FEATURE_MAPS, apply_feature_map
from .chunked import CHUNK_SIZE, PrefixStates, causal_scores_into, chunk_layout, product_backward, to_chunks, unchunk


def _features(q, k, v, key_padding_mask, feature_map):
    phi_q, phi_k = apply_feature_map(feature_map, q, k, key_padding_mask=key_padding_mask, causal=True)
    return phi_q, phi_k, append_ones(v)


def _derivative_in_place(grad: Tensor, phi: Tensor, feature_map: str) -> Tensor:
    """grad * dphi/dx, with the derivative recovered from phi (see the module docstring)."""
    if feature_map == "elu":
        return grad.mul_(phi.clamp_(max=1.0))
    return grad.mul_(phi > 0)


def _forward(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size):
    """(out (B, H, N, Dv), normaliser (B, H, N, 1) with its zeros replaced by 1, as ``_common.normalise``)."""
    with no_autocast(q.device):
        return _forward_blocks(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size)


def _forward_blocks(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size):
    """The chunked product of ``causal.py`` with the feature map, the ones column and the normalisation done
    block by block in reused buffers: no N-sized temporaries, and every elementwise pass runs on data the
    block's matmuls are about to read (see backend.block_positions for the block sizes)."""
    b, h, n, chunk, n_chunks, dtype, blocks, max_block = chunk_layout(q, chunk_size)
    qc, kc, vc = (to_chunks(t, n_chunks, chunk, dtype) for t in (q, k, v))
    dk, dv = q.shape[-1], v.shape[-1]
    masked = None
    if key_padding_mask is not None:
        flat = key_padding_mask.new_ones(b, n_chunks * chunk)  # the chunk padding is masked too
        flat[:, :n] = key_padding_mask
        masked = flat.view(b, 1, n_chunks, chunk, 1).expand(b, h, -1, -1, -1).reshape(-1, chunk, 1)
    init = None if initial_state is None else initial_state.to(dtype).reshape(b * h, dk, dv + 1)
    feature = IN_PLACE_FEATURE_MAPS[feature_map]
    phi_q_buf, phi_k_buf = qc.new_empty(max_block, chunk, dk), qc.new_empty(max_block, chunk, dk)
    v1_buf, num_den_buf = qc.new_empty(max_block, chunk, dv + 1), qc.new_empty(max_block, chunk, dv + 1)
    v1_buf[..., dv] = 1.0
    scores = qc.new_empty(max_block, chunk, chunk)
    out, den = qc.new_empty(qc.shape[0], chunk, dv), qc.new_empty(qc.shape[0], chunk, 1)
    prefix = PrefixStates(qc, dk, dv + 1, init, n_chunks, max_block)
    for a, z, *shape in blocks:
        length = z - a
        phi_q = feature(phi_q_buf[:length].copy_(qc[a:z]))
        phi_k = feature(phi_k_buf[:length].copy_(kc[a:z]))
        if masked is not None:
            phi_k.masked_fill_(masked[a:z], 0.0)
        v1 = v1_buf[:length]
        v1[..., :dv] = vc[a:z]
        num_den = torch.bmm(phi_q, prefix.block(phi_k, v1, a, z, *shape), out=num_den_buf[:length])
        num_den.baddbmm_(causal_scores_into(scores[:length], phi_q, phi_k), v1)
        block_den = den[a:z].copy_(safe_normaliser(num_den[..., dv:]))
        torch.div(num_den[..., :dv], block_den, out=out[a:z])
    return unchunk(out, b, h, n, q.dtype), unchunk(den, b, h, n, q.dtype)


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
        g_phi_q, g_phi_k, g_v1, g_init = product_backward(
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
    chunk_size: int = CHUNK_SIZE,
) -> Tensor:
    """Normalised causal kernel attention for feature_map in backend.FUSED_FEATURE_MAPS; no argument checks
    (``functional.kernel`` does them and calls this).

    Shapes: q, k (B, H, N, D), v (B, H, N, Dv), all of one float32/float64 dtype; key_padding_mask
    (B, N) bool, True = ignore; initial_state (B, H, D, Dv + 1). Returns (B, H, N, Dv).
    """
    if needs_grad(q, k, v, initial_state):
        return _CausalKernel.apply(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size)
    return _forward(q, k, v, initial_state, key_padding_mask, feature_map, chunk_size)[0]


def kernel_inference_blocks(q, k, v, feature_map, key_padding_mask=None, initial_state=None):
    """Non-causal kernel attention without autograd, a block of positions at a time (CPU; see
    backend.block_positions): keys first, accumulating phi(k)^T v and sum phi(k), then queries, each
    block's features made in place in a reused buffer and divided straight into the output. q, k, v
    are read once and the output written once, so at long N the elementwise passes run on cached
    data. Shapes as ``kernel.kernel``: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv), one dtype;
    initial_state (B, H, D, Dv + 1). Returns (B, H, L, Dv)."""
    b, h, n_q, d = q.shape
    n_k, dv = k.shape[2], v.shape[-1]
    if b * h == 0 or n_q == 0:
        return q.new_zeros(b, h, n_q, dv)
    positions = max(1, (backend.block_positions(q.device) or b * h * max(n_q, n_k)) // (b * h))
    feature = IN_PLACE_FEATURE_MAPS[feature_map]
    buf = q.new_empty(b * h, min(positions, max(n_q, n_k)), d)

    def features(x, a, z):
        # Block a:z of x (B, H, *, D) through the map in the buffer; x may be strided (a module's q, k are
        # transposed views of its projections), so it is copied by block, never as a whole.
        block = buf[:, : z - a]
        block.view(b, h, z - a, d).copy_(x[:, :, a:z])
        return feature(block)

    if initial_state is None:
        kv, k_sum = q.new_zeros(b * h, d, dv), q.new_zeros(b * h, d, 1)
    else:
        state = initial_state.reshape(b * h, d, dv + 1)
        kv, k_sum = state[..., :-1].clone(), state[..., -1:].clone()
    for a in range(0, n_k, positions):
        z = min(a + positions, n_k)
        phi_k = features(k, a, z)
        if key_padding_mask is not None:
            phi_k.masked_fill_(key_padding_mask[:, None, a:z, None].expand(b, h, -1, -1).reshape(b * h, -1, 1), 0.0)
        kv.baddbmm_(phi_k.transpose(1, 2), v[:, :, a:z].reshape(b * h, z - a, dv))
        k_sum += phi_k.sum(1).unsqueeze(-1)
    out = q.new_empty(b * h, n_q, dv)
    for a in range(0, n_q, positions):
        z = min(a + positions, n_q)
        phi_q = features(q, a, z)
        den = torch.bmm(phi_q, k_sum)
        torch.div(torch.bmm(phi_q, kv), safe_normaliser(den), out=out[:, a:z])
    return out.view(b, h, n_q, dv)
