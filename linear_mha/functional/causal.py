"""Causal linear attention product: chunked parallel form, custom backward, recurrent decoding step.

For feature-mapped queries/keys ``phi_q, phi_k`` (B, H, N, Dk) and values ``v`` (B, H, N, Dv)::

    out[b, h, i] = phi_q[b, h, i] @ (S0[b, h] + sum_{j <= i} outer(phi_k[b, h, j], v[b, h, j]))

No normalisation happens here: callers append a ones column to ``v`` so the numerator and the
denominator come out of the same product.

The sequence is split into chunks of ``C`` positions. Inside a chunk the product is the masked
quadratic form ``tril(q k^T) v`` (C x C scores); across chunks it is ``q @ S_prev`` where ``S_prev``
is an exclusive prefix sum of the per-chunk states ``k_c^T v_c`` (Dk x Dv each). Memory is
O(N * (C + d)) plus O(N / C * Dk * Dv) transient; a per-position Dk x Dv state is never built.
The backward recomputes the chunk states from the saved inputs instead of keeping them.
"""
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

__all__ = ["causal_linear_product", "causal_linear_state", "causal_linear_step"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    # Prefix sums over tens of thousands of positions lose all precision in 8-bit mantissas.
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def _check_inputs(phi_q, phi_k, v, initial_state, seq_dims: int, q_name: str = "phi_q") -> None:
    """seq_dims = 4 for (B, H, N, D) sequence inputs, 3 for (B, H, D) single-step inputs.

    q_name is what phi_q is called in the caller's signature (causal_linear_state has no queries).
    """
    layout = "(B, H, N, D)" if seq_dims == 4 else "(B, H, D)"
    for name, t in ((q_name, phi_q), ("phi_k", phi_k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != seq_dims:
            raise ValueError(f"{name} must be {seq_dims}-D {layout}, got shape {tuple(t.shape)}.")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}; cast it with .float().")
        if t.device != phi_q.device:
            raise ValueError(f"{name} is on {t.device} but {q_name} is on {phi_q.device}; "
                             f"move it with .to({q_name}.device).")
        if t.dtype != phi_q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {q_name} has {phi_q.dtype}; "
                            f"cast it with .to({q_name}.dtype).")
    if phi_k.shape != phi_q.shape:
        raise ValueError(
            f"phi_k has shape {tuple(phi_k.shape)} but phi_q has {tuple(phi_q.shape)}; they must be equal."
        )
    if v.shape[:-1] != phi_q.shape[:-1]:
        raise ValueError(
            f"v has shape {tuple(v.shape)} but {q_name} has shape {tuple(phi_q.shape)}: all but the last "
            f"dimension must match; reshape v to match {q_name}."
        )
    if initial_state is not None:
        expected = (*phi_q.shape[:2], phi_q.shape[-1], v.shape[-1])
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != expected:
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise ValueError(f"initial_state must have shape (B, H, Dk, Dv) = {expected}, got {got}.")
        if not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be floating-point, got {initial_state.dtype}.")
        if initial_state.device != phi_q.device:
            raise ValueError(
                f"initial_state is on {initial_state.device} but {q_name} is on {phi_q.device}; "
                f"move it with .to({q_name}.device)."
            )


def _to_chunks(x: torch.Tensor, n_chunks: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, N, D) -> (B * H * n_chunks, chunk, D); zero rows pad the tail and add nothing to any state.

    A flat 3-D batch lets every product be one bmm and keeps chunk c of head h at index h * n_chunks + c.
    """
    b, h, n, d = x.shape
    x = x.to(dtype)
    pad = n_chunks * chunk - n
    if pad:
        x = torch.cat([x, x.new_zeros(b, h, pad, d)], dim=2)
    return x.reshape(b * h * n_chunks, chunk, d)


def _exclusive_states(k: torch.Tensor, v: torch.Tensor, init: Optional[torch.Tensor], n_chunks: int):
    """S_prev[c] = init + sum_{c' < c} k_c'^T v_c' for every chunk, as (B*H*n_chunks, Dk, Dv).

    The per-chunk products are written one slot late into a buffer with one spare slot, so each
    head's chunk c already holds chunk c - 1's product. Slot 0 of each head would hold the previous
    head's last product, which no exclusive prefix needs, so it is overwritten with init; an
    in-place cumsum then finishes the job without any shifted copy.
    """
    dk, dv = k.shape[-1], v.shape[-1]
    buf = k.new_empty(k.shape[0] + 1, dk, dv)
    torch.bmm(k.transpose(1, 2), v, out=buf[1:])
    states = buf[:-1].view(-1, n_chunks, dk, dv)
    if init is None:
        states[:, 0].zero_()
    else:
        states[:, 0] = init.reshape(-1, dk, dv)
    states.cumsum_(dim=1)
    return buf[:-1]


def _later_states(q: torch.Tensor, do: torch.Tensor, n_chunks: int, need_total: bool):
    """(R_next[c] = sum_{c' > c} q_c'^T do_c' as (B*H*n_chunks, Dk, Dv), per-head total or None)."""
    dk, dv = q.shape[-1], do.shape[-1]
    per_chunk = torch.bmm(q.transpose(1, 2), do).view(-1, n_chunks, dk, dv)
    total = per_chunk.sum(dim=1) if need_total else None
    later = torch.zeros_like(per_chunk)
    if n_chunks > 1:
        later[:, :-1] = per_chunk[:, 1:].flip(1).cumsum(dim=1).flip(1)
    return later.view(-1, dk, dv), total


def _causal_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """tril(a b^T) per chunk, diagonal kept."""
    return torch.bmm(a, b.transpose(1, 2)).tril_()


def _no_autocast(device: torch.device):
    # Autocast would round the float32 states back to half precision inside the matmuls.
    return torch.autocast(device_type=device.type, enabled=False)


def _layout(phi_q: torch.Tensor, chunk_size: int):
    b, h, n, _ = phi_q.shape
    chunk = min(chunk_size, n)
    return b, h, n, chunk, -(-n // chunk), _state_dtype(phi_q.dtype)


def _unchunk(x: torch.Tensor, b: int, h: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return x.view(b, h, -1, x.shape[-1])[:, :, :n].to(dtype)


def _forward(phi_q, phi_k, v, initial_state, chunk_size):
    with _no_autocast(phi_q.device):
        return _forward_impl(phi_q, phi_k, v, initial_state, chunk_size)


def _forward_impl(phi_q, phi_k, v, initial_state, chunk_size):
    b, h, n, chunk, n_chunks, dtype = _layout(phi_q, chunk_size)
    q = _to_chunks(phi_q, n_chunks, chunk, dtype)
    k = _to_chunks(phi_k, n_chunks, chunk, dtype)
    vc = _to_chunks(v, n_chunks, chunk, dtype)
    init = None if initial_state is None else initial_state.to(dtype)

    out = torch.bmm(q, _exclusive_states(k, vc, init, n_chunks))
    out.baddbmm_(_causal_scores(q, k), vc)
    return _unchunk(out, b, h, n, phi_q.dtype)


def _backward(phi_q, phi_k, v, initial_state, grad_out, chunk_size, needs):
    with _no_autocast(phi_q.device):
        return _backward_impl(phi_q, phi_k, v, initial_state, grad_out, chunk_size, needs)


def _backward_impl(phi_q, phi_k, v, initial_state, grad_out, chunk_size, needs):
    need_q, need_k, need_v, need_init = needs
    b, h, n, chunk, n_chunks, dtype = _layout(phi_q, chunk_size)
    q = _to_chunks(phi_q, n_chunks, chunk, dtype)
    k = _to_chunks(phi_k, n_chunks, chunk, dtype)
    vc = _to_chunks(v, n_chunks, chunk, dtype)
    do = _to_chunks(grad_out, n_chunks, chunk, dtype)

    grad_q = grad_k = grad_v = grad_init = None
    # tril(do v^T) feeds both dq and dk, so it is built once when either needs it.
    do_v = _causal_scores(do, vc) if (need_q or need_k) else None
    if need_q:
        init = None if initial_state is None else initial_state.to(dtype)
        gq = torch.bmm(do, _exclusive_states(k, vc, init, n_chunks).transpose(1, 2))
        gq.baddbmm_(do_v, k)
        grad_q = _unchunk(gq, b, h, n, phi_q.dtype)
    if need_k or need_v or need_init:
        later, total = _later_states(q, do, n_chunks, need_init)
        if need_init:
            grad_init = total.view_as(initial_state).to(initial_state.dtype)
        if need_k:
            gk = torch.bmm(vc, later.transpose(1, 2))
            gk.baddbmm_(do_v.transpose(1, 2), q)
            grad_k = _unchunk(gk, b, h, n, phi_k.dtype)
        if need_v:
            gv = torch.bmm(k, later)
            gv.baddbmm_(_causal_scores(q, k).transpose(1, 2), do)
            grad_v = _unchunk(gv, b, h, n, v.dtype)
    return grad_q, grad_k, grad_v, grad_init


class _CausalLinearProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phi_q, phi_k, v, initial_state, chunk_size):
        # Only the inputs are kept; chunk states are rebuilt in backward so memory stays O(N * d).
        ctx.save_for_backward(phi_q, phi_k, v, initial_state)
        ctx.chunk_size = chunk_size
        return _forward(phi_q, phi_k, v, initial_state, chunk_size)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        phi_q, phi_k, v, initial_state = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        grads = _backward(phi_q, phi_k, v, initial_state, grad_out, ctx.chunk_size, needs)
        return (*grads, None)


def causal_linear_product(phi_q, phi_k, v, initial_state=None, chunk_size=64):
    """Causal linear attention numerator, chunked.

    phi_q, phi_k: (B, H, N, Dk); v: (B, H, N, Dv); initial_state: (B, H, Dk, Dv) or None.
    Returns (B, H, N, Dv) in the dtype of phi_q, with
    out[b,h,i] = phi_q[b,h,i] @ (initial_state[b,h] + sum_{j<=i} outer(phi_k[b,h,j], v[b,h,j])).
    float16/bfloat16 inputs are computed in float32 internally.
    """
    _check_inputs(phi_q, phi_k, v, initial_state, seq_dims=4)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    if phi_q.shape[2] == 0:
        raise ValueError("phi_q has sequence length 0; pass at least one position (N >= 1).")
    tensors = (phi_q, phi_k, v) if initial_state is None else (phi_q, phi_k, v, initial_state)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _CausalLinearProduct.apply(phi_q, phi_k, v, initial_state, chunk_size)
    return _forward(phi_q, phi_k, v, initial_state, chunk_size)


def causal_linear_state(phi_k, v, initial_state=None):
    """Final state initial_state + sum_j outer(phi_k[j], v[j]) -> (B, H, Dk, Dv).

    phi_k: (B, H, N, Dk); v: (B, H, N, Dv). Used to prefill before decoding with
    causal_linear_step. The state is float32 for float16/bfloat16 inputs (else the input dtype),
    because it accumulates over the whole sequence.
    """
    _check_inputs(phi_k, phi_k, v, initial_state, seq_dims=4, q_name="phi_k")
    dtype = _state_dtype(phi_k.dtype)
    state = torch.matmul(phi_k.to(dtype).transpose(-1, -2), v.to(dtype))
    if initial_state is not None:
        state = state + initial_state.to(dtype)
    return state


def causal_linear_step(phi_q, phi_k, v, state):
    """One decoding step of the causal linear product.

    phi_q, phi_k: (B, H, Dk); v: (B, H, Dv); state: (B, H, Dk, Dv) or None (zeros).
    new_state = state + outer(phi_k, v); out = phi_q @ new_state.
    Returns (out (B, H, Dv) in the dtype of phi_q, new_state (float32 for half inputs)).
    Applied token by token it equals causal_linear_product.
    """
    _check_inputs(phi_q, phi_k, v, state, seq_dims=3)
    dtype = _state_dtype(phi_q.dtype)
    update = phi_k.to(dtype).unsqueeze(-1) * v.to(dtype).unsqueeze(-2)
    new_state = update if state is None else state.to(dtype) + update
    out = torch.matmul(phi_q.to(dtype).unsqueeze(-2), new_state).squeeze(-2)
    return out.to(phi_q.dtype), new_state
