"""Causal linear attention with one decay per head and position in the compiled CPU code (csrc/decayed_attention.c):
the chunked form of ``gated_linear_attention`` when its gate is a scalar (RetNet's retention, a Mamba-2-style
decay), forward and backward.

The C code computes one product, out_i = sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j, in either direction
along the positions; its backward is three more of the same (``decayed_product.py``).

A gate per key dimension (GLA) runs position by position instead: ``gated_recurrence`` (csrc/gated_recurrence.c).
The delta rule's other steps are here too: ``delta_systems``, each chunk's pseudo-values from its unit
lower-triangular system (csrc/delta_systems.c), and ``delta_states``, its pass from chunk to chunk
(csrc/delta_states.c).
"""
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .decayed_product import decayed_causal_product
from .native_library import call, output, pointer, row_strides, rows_readable

GATED_STRETCH = 16  # csrc/gated_recurrence.c's STRETCH: positions between the states the forward keeps


def _product(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, reverse: bool) -> Tensor:
    batch, heads, length, d_k = q.shape
    out = output(v, batch, heads, length, v.shape[-1])
    call("lm_decayed_causal_f32", pointer(q), pointer(k), pointer(v), pointer(gate), pointer(out), batch, heads,
         length, d_k, v.shape[-1], row_strides(q, k, v, out), int(reverse), torch.get_num_threads())
    return out


def decayed_causal(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor) -> Tensor:
    """q, k (B, H, L, d_k), v (B, H, L, d_v) float32 CPU with contiguous rows; log_gate (B, H, L) contiguous, <= 0:
    the log of the decay between each position and the one before it. Returns (B, H, L, d_v): the causal product
    out_i = sum_{j <= i} exp(log_gate_{j+1} + ... + log_gate_i) (q_i . k_j) v_j, differentiable in all four (the
    first gate multiplies an empty state: its gradient is 0). Callers check ``native.why_not`` first."""
    return decayed_causal_product(q, k, v, log_gate, _product, rows_readable)


class _GatedRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_gate, initial_state):
        q, k, v, log_gate = (rows_readable(x) for x in (q, k, v, log_gate))
        init = None if initial_state is None else initial_state.contiguous()
        batch, heads, length, d_k = q.shape
        d_v = v.shape[-1]
        out, final = output(v, batch, heads, length, d_v), output(v, batch, heads, d_k, d_v)
        kept = None
        if any(ctx.needs_input_grad):  # the state entering every stretch, for the backward to start from
            kept = output(v, batch * heads, -(-length // GATED_STRETCH), d_k, d_v)
        call("lm_gated_recurrence_f32", *(pointer(x) for x in (q, k, v, log_gate, init, out, final, kept)), batch,
             heads, length, d_k, d_v, row_strides(q, k, v, log_gate, out), torch.get_num_threads())
        ctx.save_for_backward(q, k, v, log_gate, kept)
        return out, final

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_final):
        q, k, v, log_gate, kept = ctx.saved_tensors
        batch, heads, length, d_k = q.shape
        grad_out = torch.zeros_like(v) if grad_out is None else grad_out.contiguous()
        grad_final = None if grad_final is None else grad_final.contiguous()
        grads = [output(x, batch, heads, length, x.shape[-1]) for x in (q, k, v, q)]
        grad_init = output(q, batch, heads, d_k, v.shape[-1]) if ctx.needs_input_grad[4] else None
        call("lm_gated_recurrence_backward_f32", *(pointer(x) for x in (q, k, v, log_gate, kept, grad_out, grad_final)),
             *(pointer(x) for x in grads), pointer(grad_init), batch, heads, length, d_k, v.shape[-1],
             row_strides(q, k, v, log_gate, None), torch.get_num_threads())
        grad_q, grad_k, grad_v, grad_gate = grads
        return grad_q, grad_k, grad_v, grad_gate, grad_init


def gated_recurrence(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, initial_state=None):
    """Gated linear attention with a gate per key dimension, position by position (csrc/gated_recurrence.c): q, k,
    log_gate (B, H, L, d_k) (the gate may be expanded, e.g. over positions), v (B, H, L, d_v), float32 CPU, log gates
    <= 0; initial_state (B, H, d_k, d_v) or None. Returns (out (B, H, L, d_v), the final state), differentiable in
    all five. Callers check ``backend.decay_backend``."""
    return _GatedRecurrence.apply(q, k, v, log_gate, initial_state)


class _DeltaSystems(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, beta, decay):
        k, v, beta, decay = (x.contiguous() for x in (k, v, beta, decay))
        chunk = k.shape[-2]
        chunks = k.numel() // (chunk * k.shape[-1])
        w, u, k_end = output(k, *k.shape), output(v, *v.shape), output(k, *k.shape)
        inverse = output(k, *k.shape[:-1], chunk) if any(ctx.needs_input_grad) else None  # only the backward reads it
        call("lm_delta_systems_f32", *(pointer(x) for x in (k, v, beta, decay, w, u, k_end, inverse)), chunks, chunk,
             k.shape[-1], v.shape[-1], torch.get_num_threads())
        ctx.save_for_backward(k, v, beta, decay, inverse, w, u)
        return w, u, k_end

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_w, grad_u, grad_k_end):
        k, v, beta, decay, inverse, w, u = ctx.saved_tensors
        grad_w, grad_k_end = ((torch.zeros_like(k) if g is None else g.contiguous()) for g in (grad_w, grad_k_end))
        grad_u = torch.zeros_like(v) if grad_u is None else grad_u.contiguous()
        grads = [torch.empty_like(x) for x in (k, v, beta, decay)]
        chunk = k.shape[-2]
        call("lm_delta_systems_backward_f32",
             *(pointer(x) for x in (k, v, beta, decay, inverse, w, u, grad_w, grad_u, grad_k_end)),
             *(pointer(x) for x in grads), k.numel() // (chunk * k.shape[-1]), chunk, k.shape[-1], v.shape[-1],
             torch.get_num_threads())
        return tuple(grads)


def delta_systems(k: Tensor, v: Tensor, beta: Tensor, decay: Tensor):
    """The delta rule's per-chunk systems (delta_rule.py): k (..., C, d_k), v (..., C, d_v), beta and decay
    (..., C) float32 CPU, decay the chunk's cumulative log decay (non-increasing, <= 0). With A_tj = beta_t
    exp(decay_t - decay_j) k_t . k_j (j < t), returns (I + A)^-1 diag(beta exp(decay)) K, (I + A)^-1 diag(beta) V
    and the keys decayed to the chunk's end, exp(decay_last - decay) K, differentiable in all four."""
    return _DeltaSystems.apply(k, v, beta, decay)


class _DeltaStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u_free, w, k_to_end, carried, initial_state):
        u_free, w, k_to_end, carried = (x.contiguous() for x in (u_free, w, k_to_end, carried))
        init = None if initial_state is None else initial_state.contiguous()
        batch, heads, chunks, chunk, d_v = u_free.shape
        d_k = w.shape[-1]
        u, final = output(u_free, *u_free.shape), output(u_free, batch, heads, d_k, d_v)
        # the state entering every chunk, which only the backward reads
        states = output(u_free, batch, heads, chunks + 1, d_k, d_v) if any(ctx.needs_input_grad) else None
        call("lm_delta_states_f32", *(pointer(x) for x in (u_free, w, k_to_end, carried, init, u, states, final)),
             batch * heads, chunks, chunk, d_k, d_v, torch.get_num_threads())
        ctx.save_for_backward(w, k_to_end, carried, u, states)
        return u, final

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_u, grad_final):
        w, k_to_end, carried, u, states = ctx.saved_tensors
        batch, heads, chunks, chunk, d_v = u.shape
        d_k = w.shape[-1]
        grad_u, grad_final = grad_u.contiguous(), grad_final.contiguous()
        grads = [torch.empty_like(x) for x in (u, w, k_to_end, carried)]
        grad_init = states.new_empty(batch, heads, d_k, d_v) if ctx.needs_input_grad[4] else None
        call("lm_delta_states_backward_f32", pointer(w), pointer(k_to_end), pointer(carried), pointer(u),
             pointer(states), pointer(grad_u), pointer(grad_final), *(pointer(x) for x in grads), pointer(grad_init),
             batch * heads, chunks, chunk, d_k, d_v, torch.get_num_threads())
        return (*grads, grad_init)


def delta_states(u_free: Tensor, w: Tensor, k_to_end: Tensor, carried: Tensor, initial_state=None):
    """The delta rule's pass from chunk to chunk (delta_rule.py): u_free (B, H, n, C, d_v), w and k_to_end
    (B, H, n, C, d_k), carried (B, H, n), initial_state (B, H, d_k, d_v) or None, float32 CPU. Returns the
    pseudo-values u_c = u_free_c - w_c S_c, (B, H, n, C, d_v), and the final state; differentiable in all five."""
    return _DeltaStates.apply(u_free, w, k_to_end, carried, initial_state)
