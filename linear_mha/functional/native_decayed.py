"""Causal linear attention with one decay per head and position in the compiled CPU code (csrc/decayed_attention.c):
the chunked form of ``gated_linear_attention`` when its gate is a scalar (RetNet's retention, a Mamba-2-style
decay), forward and backward.

The C code computes one product, out_i = sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j, in either direction
along the positions. The backward needs nothing else: with do the output's gradient,

    dq_i = sum_{j <= i} decay(j, i) (do_i . v_j) k_j     the same product, forward, on (do, v, k)
    dk_j = sum_{i >= j} decay(j, i) (v_j . do_i) q_i     reversed, on (v, do, q)
    dv_j = sum_{i >= j} decay(j, i) (k_j . q_i) do_i     reversed, on (k, q, do)

and the gradient of the running log decay b_t = g_0 + ... + g_t is q_t . dq_t - k_t . dk_t (the pairs where t is
the query, less those where it is the key), so that of each gate g_s is the sum of those over t >= s.
"""
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .native_library import call, output, pointer, row_strides, rows_readable


def _product(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, reverse: bool) -> Tensor:
    batch, heads, length, d_k = q.shape
    out = output(v, batch, heads, length, v.shape[-1])
    call("lm_decayed_causal_f32", pointer(q), pointer(k), pointer(v), pointer(gate), pointer(out), batch, heads,
         length, d_k, v.shape[-1], row_strides(q, k, v, out), int(reverse), torch.get_num_threads())
    return out


class _DecayedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate):
        q, k, v = rows_readable(q), rows_readable(k), rows_readable(v)
        ctx.save_for_backward(q, k, v, gate)
        return _product(q, k, v, gate, reverse=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, gate = ctx.saved_tensors
        grad = rows_readable(grad)
        needs_q, needs_k, needs_v, needs_gate = ctx.needs_input_grad
        dq = _product(grad, v, k, gate, reverse=False) if needs_q or needs_gate else None
        dk = _product(v, grad, q, gate, reverse=True) if needs_k or needs_gate else None
        dv = _product(k, q, grad, gate, reverse=True) if needs_v else None
        d_gate = None
        if needs_gate:
            d_running = (q * dq).sum(-1) - (k * dk).sum(-1)  # (B, H, L)
            d_gate = d_running.flip(-1).cumsum(-1).flip(-1)
            d_gate[..., 0] = 0.0  # the sum over every pair, exactly 0: the first gate meets an empty state
        return dq, dk, dv, d_gate


def decayed_causal(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor) -> Tensor:
    """q, k (B, H, L, d_k), v (B, H, L, d_v) float32 CPU with contiguous rows; log_gate (B, H, L) contiguous, <= 0:
    the log of the decay between each position and the one before it. Returns (B, H, L, d_v): the causal product
    out_i = sum_{j <= i} exp(log_gate_{j+1} + ... + log_gate_i) (q_i . k_j) v_j, differentiable in all four (the
    first gate multiplies an empty state: its gradient is 0). Callers check ``native.why_not`` first."""
    return _DecayedCausal.apply(q, k, v, log_gate)
