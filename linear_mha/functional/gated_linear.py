"""Gated linear attention: a state that decays before every write, S_t = diag(a_t) S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ q_t.

One recurrence serves the decaying family: a gate a_t = exp(g_t) per key dimension and data-dependent is GLA (Yang
et al. 2024), one scalar per head and position is Mamba-2's decay, and a constant per head is RetNet's retention (Sun
et al. 2023). The output is not normalised (the methods apply their own output norm).

Three forms, one definition:
    gated_linear_recurrent  the recurrence itself, position by position: the reference (run it in float64)
    gated_linear_step       one position of it: what decoding runs
    gated_linear_attention  the chunked form training runs: between chunks the (d_k, d_v) state carries the past;
                            inside a chunk every decay is a ratio exp(b_i - b_j) <= 1 (b the cumulative log gate),
                            so nothing overflows. One gate per position: the (C, C) ratios directly. A gate per key
                            dimension: the chunk is halved again and again; at each level the queries of a second
                            half and the keys of its first half are each scaled to the position between them,
                            q_i exp(b_i - b_r) and k_j exp(b_r - b_j) (both <= 1), and meet in one matmul. That
                            costs the causal half of a dense (C, C) product instead of C x C x d_k decays.
                            (For float32 CPU tensors both gates run in compiled code: one per position chunked as
                            here, one per key dimension position by position; one per position runs in a Triton
                            kernel on CUDA when switched on; see ``backend.decay_backend``.)
A masked position is an identity step: it neither writes to the state nor decays it.
"""
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import backend, native_maps, triton_decayed
from .native_decayed import decayed_causal, gated_recurrence
from ._recurrence import (accumulating_dtype, check_heads, decay_ratios, empty_sequence, full_initial_state,
                          run_steps, split_into_chunks, starting_state)

CHUNK = 64


def _masked_inputs(k, v, log_gate, key_padding_mask):
    """k, v, log_gate with masked positions made identity steps: no key, no value, no decay."""
    if key_padding_mask is None:
        return k, v, log_gate
    pad = key_padding_mask[:, None, :, None]  # (B, 1, L, 1)
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0), log_gate.masked_fill(pad, 0.0)


def _check(q, k, v, log_gate, initial_state):
    check_heads(q, k, v, initial_state)
    if log_gate.dim() != 4 or log_gate.shape[-1] not in (1, q.shape[-1]):
        raise ValueError(f"log_gate must be (B, H, L, d_k) (a gate per key dimension) or (B, H, L, 1) (one per "
                         f"position), broadcastable; got {tuple(log_gate.shape)} for q {tuple(q.shape)}")


def log_sigmoid_gate(z: Tensor, bias: Optional[Tensor] = None, temperature: float = 1.0) -> Tensor:
    """GLA's log gates, logsigmoid(z + bias) / temperature, all <= 0: z (B, H, L, d) the keys' projection, bias
    (H, d) or None. In one compiled pass for float32 CPU heads (``backend.log_gate_backend``)."""
    if backend.log_gate_backend(z, bias).backend == backend.NATIVE:
        return native_maps.log_gate_map(z, None if bias is None else bias.contiguous(), temperature)
    return F.logsigmoid(z if bias is None else z + bias[:, None, :]) / temperature


def gated_linear_step(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor,
                      state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One position: q, k (B, H, d_k), v (B, H, d_v), log_gate (B, H, d_k) or (B, H, 1), <= 0; state (B, H, d_k, d_v)
    or None (empty). Returns (o (B, H, d_v), the new state)."""
    write = k[..., :, None] * v[..., None, :]  # (B, H, d_k, d_v)
    state = write if state is None else torch.exp(log_gate)[..., None] * state + write
    return (q[..., None, :] @ state.to(q.dtype))[..., 0, :], state


def gated_linear_recurrent(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, *,
                           key_padding_mask: Optional[Tensor] = None,
                           initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The recurrence position by position (the reference): shapes as :func:`gated_linear_attention`; returns
    (out (B, H, L, d_v), final state (B, H, d_k, d_v))."""
    _check(q, k, v, log_gate, initial_state)
    log_gate = log_gate.expand(*q.shape[:3], log_gate.shape[-1])
    k, v, log_gate = _masked_inputs(k, v, log_gate, key_padding_mask)
    return run_steps(gated_linear_step, q, k, v, (log_gate,), initial_state)


def gated_linear_attention(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, *,
                           key_padding_mask: Optional[Tensor] = None, initial_state: Optional[Tensor] = None,
                           chunk_size: Optional[int] = None,
                           output_final_state: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Causal gated linear attention in chunks.

    q, k: (B, H, L, d_k); v: (B, H, L, d_v); log_gate: (B, H, L, d_k) or (B, H, L, 1) (or anything broadcastable to
    one of them, e.g. (1, H, 1, 1) for a fixed decay per head), log of the gate, <= 0. key_padding_mask: (B, L)
    bool, True = a padded position (an identity step). initial_state: (B, H, d_k, d_v), the state before position 0.
    Returns out (B, H, L, d_v) in q's dtype, and with ``output_final_state`` the state after the last position
    (float32 or wider).
    """
    _check(q, k, v, log_gate, initial_state)
    batch, heads, length = q.shape[:3]
    d_v, out_dtype, dtype = v.shape[-1], q.dtype, accumulating_dtype(q)
    gate_dim = log_gate.shape[-1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    log_gate = log_gate.to(dtype).expand(batch, heads, length, gate_dim)
    k, v, log_gate = _masked_inputs(k, v, log_gate, key_padding_mask)

    if length == 0:
        return empty_sequence(q, v, initial_state, out_dtype, output_final_state)

    chosen = backend.decay_backend(q, k, v, log_gate).backend
    if chosen == backend.TRITON:
        return _scalar_gate_product(triton_decayed.decayed_causal, q, k, v, log_gate[..., 0].contiguous(),
                                    initial_state, out_dtype, output_final_state)
    if chosen == backend.NATIVE:
        if gate_dim == 1:
            return _scalar_gate_product(decayed_causal, q, k, v, log_gate[..., 0].contiguous(), initial_state,
                                        out_dtype, output_final_state)
        out, state = gated_recurrence(q, k, v, log_gate, full_initial_state(q, d_v, initial_state))
        return (out.to(out_dtype), state) if output_final_state else out.to(out_dtype)

    chunk = chunk_size or CHUNK
    if gate_dim != 1:  # the halving inside a chunk needs a power of two: round the size up
        chunk = 1 << (chunk - 1).bit_length()
    (q, k, v, log_gate), chunks = split_into_chunks((q, k, v, log_gate), chunk)

    decay = log_gate.cumsum(-2)  # b: (B, H, n, C, G), log of the product of the chunk's gates up to each position
    if gate_dim == 1:
        within = ((q @ k.transpose(-1, -2)) * decay_ratios(decay)) @ v  # (B, H, n, C, d_v)
    else:
        within = _within_chunk_per_dimension(q, k, v, decay)

    last = decay[..., -1:, :]  # (B, H, n, 1, G)
    writes = (k * torch.exp(last - decay)).transpose(-1, -2) @ v  # (B, H, n, d_k, d_v): each chunk's own writes
    carried = torch.exp(last).transpose(-1, -2)  # (B, H, n, G, 1): how much of the state a chunk keeps
    state = starting_state(q, d_v, initial_state)
    entering = []
    for carried_c, writes_c in zip(carried.unbind(2), writes.unbind(2)):  # unbound once: see delta_rule
        entering.append(state)
        state = carried_c * state + writes_c
    from_past = (q * torch.exp(decay)) @ torch.stack(entering, dim=2)  # (B, H, n, C, d_v)
    out = (within + from_past).reshape(batch, heads, chunks * chunk, d_v)[:, :, :length].to(out_dtype)
    return (out, state) if output_final_state else out


def _scalar_gate_product(decayed_product, q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor,
                         initial_state: Optional[Tensor], out_dtype: torch.dtype, output_final_state: bool):
    """The causal product of the compiled code or the Triton kernel (``decayed_product``: native_decayed's or
    triton_decayed's) for a (B, H, L) gate; the initial state's share of the outputs and the final state, each one
    product over the whole sequence, in PyTorch ops beside it."""
    out = decayed_product(q, k, v, log_gate)
    if initial_state is not None:  # position i sees the initial state decayed by every gate up to i
        out = out + torch.exp(log_gate.cumsum(-1))[..., None] * (q @ initial_state.to(q.dtype))
    out = out.to(out_dtype)
    if not output_final_state:
        return out
    # Each key decayed by the gates after it: a sum from the end (an exclusive one), precise where it is short.
    after = log_gate.flip(-1).cumsum(-1).flip(-1) - log_gate
    state = (k * torch.exp(after)[..., None]).transpose(-1, -2) @ v  # (B, H, d_k, d_v)
    if initial_state is not None:
        state = state + torch.exp(log_gate.sum(-1))[..., None, None] * initial_state.to(q.dtype)
    return out, state


def _within_chunk_per_dimension(q: Tensor, k: Tensor, v: Tensor, decay: Tensor) -> Tensor:
    """sum_{j <= i} (sum_d q_id k_jd exp(b_id - b_jd)) v_j inside chunks of a power-of-two length C:
    q, k, decay (..., C, d_k), v (..., C, d_v) -> (..., C, d_v). Position i meets itself undecayed; every other pair
    (j < i) meets at the one level where i lies in the second half of a block and j in its first, through the
    block's middle r (the first half's last position): exp(b_i - b_r) exp(b_r - b_j), two factors <= 1."""
    out = (q * k).sum(-1, keepdim=True) * v
    lead, chunk = q.shape[:-2], q.shape[-2]
    block = 2
    while block <= chunk:
        half = block // 2
        qb, kb, vb, bb = (x.reshape(*lead, chunk // block, 2, half, x.shape[-1]) for x in (q, k, v, decay))
        middle = bb[..., 0, half - 1:, :]  # (..., C / block, 1, d_k)
        queries = qb[..., 1, :, :] * torch.exp(bb[..., 1, :, :] - middle)
        keys = kb[..., 0, :, :] * torch.exp(middle - bb[..., 0, :, :])
        reached = (queries @ keys.transpose(-1, -2)) @ vb[..., 0, :, :]  # (..., C / block, half, d_v)
        out = out + F.pad(reached, (0, 0, half, 0)).reshape(out.shape)  # rows of the first halves get nothing
        block *= 2
    return out
