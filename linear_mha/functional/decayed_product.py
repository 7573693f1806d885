"""The causal product with one decay per position, as one autograd Function whichever code computes the product:

    out_i = sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j          (g: the log gate, <= 0)

The backward needs only the same product again, forward or reversed along the positions. With do the output's
gradient:

    dq_i = sum_{j <= i} decay(j, i) (do_i . v_j) k_j     the product, forward, on (do, v, k)
    dk_j = sum_{i >= j} decay(j, i) (v_j . do_i) q_i     reversed, on (v, do, q)
    dv_j = sum_{i >= j} decay(j, i) (k_j . q_i) do_i     reversed, on (k, q, do)

and the gradient of the running log decay b_t = g_0 + ... + g_t is q_t . dq_t - k_t . dk_t (the pairs where t is
the query, less those where it is the key), so that of each gate g_s is the sum of those over t >= s.

``product(x, y, z, gate, reverse)`` is the compiled CPU code's (``native_decayed``) or the Triton kernel's
(``triton_decayed``): out_t = sum over s <= t (s >= t when reversed) of decay (x_t . y_s) z_s.
"""
from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


class _DecayedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate, product, prepare):
        q, k, v = prepare(q), prepare(k), prepare(v)
        ctx.save_for_backward(q, k, v, gate)
        ctx.product, ctx.prepare = product, prepare
        return product(q, k, v, gate, reverse=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, gate = ctx.saved_tensors
        product, grad = ctx.product, ctx.prepare(grad)
        needs_q, needs_k, needs_v, needs_gate = ctx.needs_input_grad[:4]
        dq = product(grad, v, k, gate, reverse=False) if needs_q or needs_gate else None
        dk = product(v, grad, q, gate, reverse=True) if needs_k or needs_gate else None
        dv = product(k, q, grad, gate, reverse=True) if needs_v else None
        d_gate = None
        if needs_gate:
            d_running = (q * dq).sum(-1) - (k * dk).sum(-1)  # (B, H, L)
            d_gate = d_running.flip(-1).cumsum(-1).flip(-1)
            d_gate[..., 0] = 0.0  # the sum over every pair, exactly 0: the first gate meets an empty state
        return dq, dk, dv, d_gate, None, None


def decayed_causal_product(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, product: Callable,
                           prepare: Callable[[Tensor], Tensor]) -> Tensor:
    """q, k (B, H, L, d_k), v (B, H, L, d_v); log_gate (B, H, L) contiguous. Returns out (B, H, L, d_v),
    differentiable in all four (the first gate multiplies an empty state: its gradient is 0). ``prepare`` gives
    a tensor the layout ``product`` reads."""
    return _DecayedCausal.apply(q, k, v, log_gate, product, prepare)
