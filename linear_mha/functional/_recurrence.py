"""What the forms of the state recurrences share (``gated_linear``, ``delta_rule``): the checks of their heads,
the dtype they accumulate in, the state they start from, sequences cut into chunks, the decays between the positions
of a chunk, and the position-by-position loop of their references."""
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def check_heads(q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor]) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q and k must be (B, H, L, d_k) and v (B, H, L, d_v) of the same B, H, L; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if initial_state is not None and (initial_state.dim() > 4
                                      or initial_state.shape[-2:] != (q.shape[-1], v.shape[-1])
                                      or _broadcast(initial_state.shape[:-2], q.shape[:2]) != tuple(q.shape[:2])):
        raise ValueError(f"initial_state must be (B, H, d_k, d_v) = ({q.shape[0]}, {q.shape[1]}, {q.shape[-1]}, "
                         f"{v.shape[-1]}) or broadcastable to it; got {tuple(initial_state.shape)}")


def _broadcast(a, b):
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def accumulating_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # half inputs accumulate in float32


def starting_state(q: Tensor, d_v: int, initial_state: Optional[Tensor]) -> Tensor:
    """The (B, H, d_k, d_v) state before the first position, in q's (accumulating) dtype: zeros, or the initial
    state (one broadcast over the batch or heads expanded, its gradient summing back through the expand)."""
    if initial_state is not None:
        return full_initial_state(q, d_v, initial_state)
    return q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], d_v)


def full_initial_state(q: Tensor, d_v: int, initial_state: Optional[Tensor]) -> Optional[Tensor]:
    """The initial state as the compiled code reads it, (B, H, d_k, d_v) in q's dtype, or None."""
    if initial_state is None:
        return None
    return initial_state.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[-1], d_v)


def empty_sequence(q: Tensor, v: Tensor, initial_state: Optional[Tensor], out_dtype: torch.dtype,
                   output_final_state: bool):
    """The result for L = 0: no output rows, and the state as it came. The output stays in q's graph (its gradient
    zero) so that a caller's backward through it works as for any other length."""
    out = v.new_zeros(v.shape[0], v.shape[1], 0, v.shape[-1]).to(out_dtype) + 0 * q.sum()
    return (out, starting_state(q, v.shape[-1], initial_state)) if output_final_state else out


def split_into_chunks(tensors: Sequence[Tensor], chunk: int) -> Tuple[Tuple[Tensor, ...], int]:
    """(B, H, L, X) tensors -> (B, H, n, C, X) with n = ceil(L / C), the end padded with zeros: positions the
    recurrences treat as identity steps (no write, no decay) and whose outputs the caller drops."""
    batch, heads, length = tensors[0].shape[:3]
    chunks = -(-length // chunk)
    extra = chunks * chunk - length
    # F.pad copies even when it adds nothing: a whole number of chunks is a view
    return tuple((F.pad(x, (0, 0, 0, extra)) if extra else x).reshape(batch, heads, chunks, chunk, x.shape[-1])
                 for x in tensors), chunks


def decay_ratios(cumulative: Tensor) -> Tensor:
    """exp(b_i - b_j) for j <= i, 0 above the diagonal: (..., C, 1) cumulative log decays of a chunk -> (..., C, C),
    each ratio <= 1 (formed as a difference, so long strong decays never overflow)."""
    chunk = cumulative.shape[-2]
    seen = torch.ones(chunk, chunk, dtype=torch.bool, device=cumulative.device).tril()
    return torch.exp((cumulative - cumulative.transpose(-1, -2)).masked_fill(~seen, float("-inf")))


def run_steps(step, q: Tensor, k: Tensor, v: Tensor, per_position: Sequence[Tensor],
              initial_state: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """A recurrence position by position (the references): ``step(q_t, k_t, v_t, *per_position_t, state)`` ->
    (o_t, state) over (B, H, L, ·) heads and (B, H, L, ...) per-position tensors. Returns (out (B, H, L, d_v),
    the final state)."""
    state = starting_state(q, v.shape[-1], initial_state)
    outs = []
    for t in range(q.shape[2]):
        out, state = step(q[:, :, t], k[:, :, t], v[:, :, t], *(x[:, :, t] for x in per_position), state)
        outs.append(out)
    return torch.stack(outs, dim=2), state
