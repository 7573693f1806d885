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
                          (j < t): the WY / UT form, one triangular solve per chunk for every chunk at once; only
                          U = U~ - W S_0 and the state update run chunk after chunk.
A masked position is an identity step (beta = 0, no decay).
"""
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


def _check(q, k, v, beta, log_decay, initial_state):
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q and k must be (B, H, L, d_k) and v (B, H, L, d_v) of the same B, H, L; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, x in (("beta", beta), ("log_decay", log_decay)):
        if x is not None and (x.dim() != 3 or torch.broadcast_shapes(x.shape, q.shape[:3]) != q.shape[:3]):
            raise ValueError(f"{name} must be (B, H, L) (one value per head and position), broadcastable; got "
                             f"{tuple(x.shape)} for q {tuple(q.shape)}")
    if initial_state is not None and initial_state.shape[-2:] != (q.shape[-1], v.shape[-1]):
        raise ValueError(f"initial_state must be (B, H, d_k, d_v) = (..., {q.shape[-1]}, {v.shape[-1]}); got "
                         f"{tuple(initial_state.shape)}")


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
    state = initial_state
    if state is None:
        state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        out, state = delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], log_decay[:, :, t], state)
        outs.append(out)
    return torch.stack(outs, dim=2), state


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
    dtype = torch.promote_types(q.dtype, torch.float32)
    k, v, beta, log_decay = _masked_inputs(q, k, v, beta, log_decay, key_padding_mask)
    q, k, v, beta, log_decay = (x.to(dtype) for x in (q, k, v, beta, log_decay))

    if length == 0:  # no position: nothing read, the state as it came
        state = initial_state.to(dtype) if initial_state is not None else q.new_zeros(batch, heads, d_k, d_v)
        out = v.new_zeros(batch, heads, 0, d_v).to(out_dtype) + 0 * q.sum()  # keeps q's graph for autograd
        return (out, state) if output_final_state else out

    chunk = chunk_size or CHUNK
    chunks = -(-length // chunk)
    extra = chunks * chunk - length  # identity steps after the end (beta 0, no decay); their outputs are dropped

    def chunked(x):  # (B, H, L, X) -> (B, H, n, C, X)
        return F.pad(x, (0, 0, 0, extra)).reshape(batch, heads, chunks, chunk, x.shape[-1])
    q, k, v = chunked(q), chunked(k), chunked(v)
    beta, decay = chunked(beta[..., None]), chunked(log_decay[..., None]).cumsum(-2)  # (B, H, n, C, 1) each

    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # j <= t
    ratio = torch.exp((decay - decay.transpose(-1, -2)).masked_fill(~lower, float("-inf")))  # gamma_t / gamma_j
    strictly = lower & ~torch.eye(chunk, dtype=torch.bool, device=q.device)
    system = (beta * (k @ k.transpose(-1, -2)) * ratio).masked_fill(~strictly, 0.0)
    system = system + torch.eye(chunk, dtype=dtype, device=q.device)  # I + A, unit lower triangular
    solved = torch.linalg.solve_triangular(system, torch.cat([beta * torch.exp(decay) * k, beta * v], dim=-1),
                                           upper=False, unitriangular=True)
    w, u_free = solved.split([d_k, d_v], dim=-1)  # U = u_free - w S_0: (B, H, n, C, d_k), (B, H, n, C, d_v)
    scores = (q @ k.transpose(-1, -2)) * ratio  # (B, H, n, C, C), zero above the diagonal
    q_decayed = q * torch.exp(decay)
    k_to_end = k * torch.exp(decay[..., -1:, :] - decay)
    carried = torch.exp(decay[..., -1, :])[..., None]  # (B, H, n, 1, 1)

    state = (initial_state.to(dtype) if initial_state is not None
             else q.new_zeros(batch, heads, d_k, d_v))
    outs = []
    for c in range(chunks):
        u = u_free[:, :, c] - w[:, :, c] @ state  # (B, H, C, d_v)
        outs.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ u)
        state = carried[:, :, c] * state + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * chunk, d_v)[:, :, :length].to(out_dtype)
    return (out, state) if output_final_state else out
