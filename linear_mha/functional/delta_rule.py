"""The delta rule: a state that overwrites what a key held instead of only adding to it.

    S_t = a_t (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ,    o_t = S_tᵀ q_t        (S: d_k x d_v)

With a_t = 1 it is DeltaNet (Schlag et al. 2021; trained in parallel by Yang et al. 2024); with a data-dependent
decay a_t = exp(g_t) it is Gated DeltaNet (Yang et al. 2025). Writing beta_t (v_t - S_{t-1}ᵀ k_t) moves the value
stored under k_t towards v_t, which is what lets the state recall a key's latest value. Keys of unit norm keep the
state bounded (I - beta k kᵀ is then a contraction for beta in [0, 1]).

    delta_rule_recurrent  the recurrence position by position: the reference (run it in float64)
    delta_rule_step       one position: what decoding runs
    delta_rule_attention  the chunked form for training. Within a chunk the state after position t is
                          gamma_t S_0 + sum_{j<=t} (gamma_t / gamma_j) k_j u_jᵀ with gamma the chunk's cumulative
                          decay; the pseudo-values solve the unit lower-triangular system
                          (I + A) U = diag(beta) (V - diag(gamma) K S_0),  A_tj = beta_t (gamma_t / gamma_j) k_t.k_j
                          (j < t): the WY / UT form, solved for every chunk at once; only U = U~ - W S_0 and
                          the state update run chunk after chunk. With the pseudo-values U the state is a decaying
                          sum of k_j u_jᵀ, so the outputs are gated_linear_attention's on (q, k, U).
A masked position is an identity step (beta = 0, no decay).
"""
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import backend, native_maps
from .gated_linear import gated_linear_attention
from .native_decayed import delta_states, delta_systems
from ._recurrence import (accumulating_dtype, check_heads, decay_ratios, empty_sequence, full_initial_state,
                          run_steps, split_into_chunks, starting_state)

CHUNK = 64


def _check(q, k, v, beta, log_decay, initial_state):
    check_heads(q, k, v, initial_state)
    for name, x in (("beta", beta), ("log_decay", log_decay)):
        if x is not None and (x.dim() != 3 or torch.broadcast_shapes(x.shape, q.shape[:3]) != q.shape[:3]):
            raise ValueError(f"{name} must be (B, H, L) (one value per head and position), broadcastable; got "
                             f"{tuple(x.shape)} for q {tuple(q.shape)}")


def _masked_inputs(q, k, v, beta, log_decay, key_padding_mask):
    """k, v, beta and log_decay (full-size) with masked positions made identity steps: no key, no value (whatever
    they held, NaN included, reaches nothing), beta 0, no decay."""
    beta = beta.expand(q.shape[:3])
    log_decay = torch.zeros_like(beta) if log_decay is None else log_decay.expand(q.shape[:3])
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :]  # (B, 1, L)
        beta, log_decay = beta.masked_fill(pad, 0.0), log_decay.masked_fill(pad, 0.0)
        k, v = k.masked_fill(pad[..., None], 0.0), v.masked_fill(pad[..., None], 0.0)
    return k, v, beta, log_decay


def silu_unit(x: Tensor, eps: float = 1e-12) -> Tensor:
    """silu(x) / |silu(x)| along the last dimension (the norm clamped at eps, as F.normalize does): queries and keys
    as DeltaNet takes them, of unit norm so that the state stays bounded. (B, H, L, d) -> (B, H, L, d); in one
    compiled pass, forward and backward, for float32 CPU heads (``backend.silu_unit_backend``)."""
    if backend.silu_unit_backend(x).backend == backend.NATIVE:
        return native_maps.silu_unit_map(x, eps)
    return F.normalize(F.silu(x), dim=-1, eps=eps)  # exact where it matters: float64 references, half precision


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Optional[Tensor] = None,
                    state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One position: q, k (B, H, d_k), v (B, H, d_v), beta (B, H), log_decay (B, H) or None; state (B, H, d_k, d_v)
    or None (empty). Returns (o (B, H, d_v), the new state)."""
    if state is None:
        state = k.new_zeros(*k.shape, v.shape[-1])
    elif log_decay is not None:
        state = torch.exp(log_decay)[..., None, None] * state
    stored = (k[..., None, :] @ state)[..., 0, :]  # (B, H, d_v): what the state holds under k now
    state = state + beta[..., None, None] * k[..., :, None] * (v - stored)[..., None, :]
    return (q[..., None, :] @ state.to(q.dtype))[..., 0, :], state


def delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Optional[Tensor] = None, *,
                         key_padding_mask: Optional[Tensor] = None,
                         initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The recurrence position by position (the reference): shapes as :func:`delta_rule_attention`; returns
    (out (B, H, L, d_v), final state (B, H, d_k, d_v))."""
    _check(q, k, v, beta, log_decay, initial_state)
    k, v, beta, log_decay = _masked_inputs(q, k, v, beta, log_decay, key_padding_mask)
    return run_steps(delta_rule_step, q, k, v, (beta, log_decay), initial_state)


def delta_rule_attention(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Optional[Tensor] = None, *,
                         key_padding_mask: Optional[Tensor] = None, initial_state: Optional[Tensor] = None,
                         chunk_size: Optional[int] = None,
                         output_final_state: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Causal (gated) delta-rule attention in chunks.

    q, k: (B, H, L, d_k) (keys of unit norm for a bounded state); v: (B, H, L, d_v); beta: (B, H, L) write strength
    in [0, 1]; log_decay: (B, H, L) <= 0 (Gated DeltaNet) or None (DeltaNet); both may be anything broadcastable to
    (B, H, L). key_padding_mask: (B, L) bool, True = a padded position (an identity step). initial_state:
    (B, H, d_k, d_v). Returns out (B, H, L, d_v) in q's dtype, and with ``output_final_state`` the final state
    (float32 or wider).
    """
    _check(q, k, v, beta, log_decay, initial_state)
    batch, heads, length, d_k = q.shape
    d_v, out_dtype = v.shape[-1], q.dtype
    dtype = accumulating_dtype(q)
    k, v, beta, log_decay = _masked_inputs(q, k, v, beta, log_decay, key_padding_mask)
    q, k, v, beta, log_decay = (x.to(dtype) for x in (q, k, v, beta, log_decay))

    if length == 0:
        return empty_sequence(q, v, initial_state, out_dtype, output_final_state)

    chunk = chunk_size or CHUNK
    q_rows, k_rows, log_decay_rows = q, k, log_decay
    (q, k, v, beta, decay), chunks = split_into_chunks((q, k, v, beta[..., None], log_decay[..., None]), chunk)
    decay = decay.cumsum(-2)  # (B, H, n, C, 1): log gamma, the chunk's decay up to each position

    carried = torch.exp(decay[..., -1, :])[..., None]  # (B, H, n, 1, 1)
    # U = u_free - w S_0: u_free (B, H, n, C, d_v), w (B, H, n, C, d_k); k_to_end the keys decayed to their
    # chunk's end, what the pass over chunks writes into the state
    if backend.delta_rule_backend(q, k, v, initial_state).backend == backend.NATIVE:
        w, u_free, k_to_end = delta_systems(k, v, beta[..., 0], decay[..., 0])
        start = full_initial_state(q_rows, d_v, initial_state)
        u, state = delta_states(u_free, w, k_to_end, carried[..., 0, 0], start)
    else:
        ratio = decay_ratios(decay)  # gamma_t / gamma_j (j <= t), 0 above the diagonal
        strictly = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
        lower = (beta * (k @ k.transpose(-1, -2)) * ratio).masked_fill(~strictly, 0.0)  # A
        w, u_free = _solved(lower, beta * torch.exp(decay) * k, beta * v)
        k_to_end = k * torch.exp(decay[..., -1:, :] - decay)
        u, state = _states_in_turn(u_free, w, k_to_end, carried, starting_state(q, d_v, initial_state))
    # With the pseudo-values the state is a decaying sum of k_j u_jᵀ: the outputs are gated linear attention's.
    u = u.reshape(batch, heads, chunks * chunk, d_v)[:, :, :length]
    out = gated_linear_attention(q_rows, k_rows, u, log_decay_rows[..., None], initial_state=initial_state,
                                 chunk_size=chunk).to(out_dtype)
    return (out, state) if output_final_state else out


def _solved(lower: Tensor, keys: Tensor, values: Tensor) -> Tuple[Tensor, Tensor]:
    """(I + A)^-1 keys and (I + A)^-1 values for every chunk's strictly lower A (..., C, C): one triangular solve
    for both, the fewest FLOPs (what ``methods.DeltaNet.flops`` counts)."""
    system = lower + torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    solved = torch.linalg.solve_triangular(system, torch.cat([keys, values], dim=-1), upper=False,
                                           unitriangular=True)
    return tuple(solved.split([keys.shape[-1], values.shape[-1]], dim=-1))


def _states_in_turn(u_free: Tensor, w: Tensor, k_to_end: Tensor, carried: Tensor, state: Tensor):
    """The pass from chunk to chunk in PyTorch ops: u_c = u_free_c - w_c S_c, S_{c+1} = carried_c S_c + k_cᵀ u_c.
    Returns the pseudo-values (B, H, n, C, d_v) and the final state."""
    pseudo_values = []
    # unbound once: indexing a chunk per step would make autograd add a whole-sequence zero tensor per chunk
    for u_free_c, w_c, carried_c, k_c in zip(*(x.unbind(2) for x in (u_free, w, carried, k_to_end))):
        u = u_free_c - w_c @ state  # (B, H, C, d_v)
        pseudo_values.append(u)
        state = carried_c * state + k_c.transpose(-1, -2) @ u
    return torch.stack(pseudo_values, dim=2), state
