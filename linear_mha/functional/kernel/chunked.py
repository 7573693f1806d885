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
On CPU the chunks are processed in blocks of a few thousand positions with reused buffers and the
state carried between blocks; on accelerators everything is one block (see backend.block_positions).
"""
import torch
from torch.autograd.function import once_differentiable

from .. import backend, triton_causal
from .._common import needs_grad, no_autocast

__all__ = ["causal_linear_product", "causal_linear_state", "causal_linear_step", "CHUNK_SIZE"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
CHUNK_SIZE = 64  # positions per chunk unless the caller says otherwise


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


def check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    return chunk_size


def to_chunks(x: torch.Tensor, n_chunks: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, N, D) -> (B * H * n_chunks, chunk, D); zero rows pad the tail and add nothing to any state.

    A flat 3-D batch lets every product be one bmm and keeps chunk c of head h at index h * n_chunks + c.
    """
    b, h, n, d = x.shape
    x = x.to(dtype)
    pad = n_chunks * chunk - n
    if pad:
        x = torch.cat([x, x.new_zeros(b, h, pad, d)], dim=2)
    return x.reshape(b * h * n_chunks, chunk, d)


def _blocks(groups: int, n_chunks: int, target: int):
    """Split the flat chunk axis (groups * n_chunks) into contiguous blocks [a, b).

    Yields (a, b, n_groups, chunks_per_group, starts_group, ends_group): either several whole
    groups (short sequences) or one segment of a single group (long sequences), whose state is
    carried to the next segment by the caller.
    """
    if n_chunks > target:
        for g in range(groups):
            for c0 in range(0, n_chunks, target):
                c1 = min(c0 + target, n_chunks)
                yield g * n_chunks + c0, g * n_chunks + c1, 1, c1 - c0, c0 == 0, c1 == n_chunks
    else:
        per = max(1, target // n_chunks)
        for g0 in range(0, groups, per):
            g1 = min(g0 + per, groups)
            yield g0 * n_chunks, g1 * n_chunks, g1 - g0, n_chunks, True, True


class PrefixStates:
    """Exclusive prefix states S_prev[c] = init + sum_{c' < c} k_c'^T v_c', one block at a time, in order.

    Each block's per-chunk products are written one slot late into a buffer with a spare slot, so
    chunk c's slot already holds chunk c - 1's product; the first slot of every group (which holds
    the previous group's last product, needed by no prefix) is overwritten with init or the carried
    state, and an in-place cumsum finishes the job without a shifted copy.
    """

    def __init__(self, like, dk, dv, init, n_chunks, max_block):
        self.dk, self.dv, self.init, self.n_chunks = dk, dv, init, n_chunks
        self.buf = like.new_empty(max_block + 1, dk, dv)
        self.carry = None

    def block(self, k, v, a, b, n_groups, per_group, starts, ends):
        """States for chunks [a, b) of the flat chunk axis; k, v are those chunks (b - a, C, Dk / Dv)."""
        length, dk, dv = b - a, self.dk, self.dv
        buf = self.buf[: length + 1]
        torch.bmm(k.transpose(1, 2), v, out=buf[1:])
        states = buf[:-1].view(n_groups, per_group, dk, dv)
        if not starts:
            states[:, 0] = self.carry
        elif self.init is None:
            states[:, 0].zero_()
        else:
            g0 = a // self.n_chunks
            states[:, 0] = self.init[g0: g0 + n_groups]
        states.cumsum_(dim=1)
        if not ends:
            # Inclusive state after this segment: last exclusive state plus the last chunk's product.
            self.carry = states[0, -1] + buf[-1]
        return buf[:-1]


def causal_scores_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """tril(a b^T) per chunk, diagonal kept, written into out."""
    return torch.bmm(a, b.transpose(1, 2), out=out).tril_()


def chunk_layout(phi_q: torch.Tensor, chunk_size: int):
    b, h, n, _ = phi_q.shape
    chunk = min(chunk_size, n)
    n_chunks = -(-n // chunk)
    positions = backend.block_positions(phi_q.device)
    target = b * h * n_chunks if positions is None else max(1, positions // chunk)
    max_block = min(b * h * n_chunks, target if n_chunks > target else max(1, target // n_chunks) * n_chunks)
    blocks = list(_blocks(b * h, n_chunks, target))
    return b, h, n, chunk, n_chunks, _state_dtype(phi_q.dtype), blocks, max_block


def unchunk(x: torch.Tensor, b: int, h: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    if b * h == 0:  # an empty batch: no rows to view, only the shape to give back
        return x.new_empty(b, h, n, x.shape[-1], dtype=dtype)
    return x.view(b, h, x.shape[0] // (b * h) * x.shape[1], x.shape[-1])[:, :, :n].to(dtype)


def product_forward(phi_q, phi_k, v, initial_state, chunk_size):
    with no_autocast(phi_q.device):
        return _product_forward_impl(phi_q, phi_k, v, initial_state, chunk_size)


def _product_forward_impl(phi_q, phi_k, v, initial_state, chunk_size):
    b, h, n, chunk, n_chunks, dtype, blocks, max_block = chunk_layout(phi_q, chunk_size)
    q = to_chunks(phi_q, n_chunks, chunk, dtype)
    k = to_chunks(phi_k, n_chunks, chunk, dtype)
    vc = to_chunks(v, n_chunks, chunk, dtype)
    init = None if initial_state is None else initial_state.to(dtype).reshape(b * h, *initial_state.shape[2:])

    out = q.new_empty(q.shape[0], chunk, vc.shape[-1])
    prefix = PrefixStates(k, k.shape[-1], vc.shape[-1], init, n_chunks, max_block)
    scores = q.new_empty(max_block, chunk, chunk)
    for a, z, *shape in blocks:
        torch.bmm(q[a:z], prefix.block(k[a:z], vc[a:z], a, z, *shape), out=out[a:z])
        out[a:z].baddbmm_(causal_scores_into(scores[: z - a], q[a:z], k[a:z]), vc[a:z])
    return unchunk(out, b, h, n, phi_q.dtype)


def product_backward(phi_q, phi_k, v, initial_state, grad_out, chunk_size, needs):
    with no_autocast(phi_q.device):
        return _product_backward_impl(phi_q, phi_k, v, initial_state, grad_out, chunk_size, needs)


def _product_backward_impl(phi_q, phi_k, v, initial_state, grad_out, chunk_size, needs):
    need_q, need_k, need_v, need_init = needs
    b, h, n, chunk, n_chunks, dtype, blocks, max_block = chunk_layout(phi_q, chunk_size)
    q = to_chunks(phi_q, n_chunks, chunk, dtype)
    k = to_chunks(phi_k, n_chunks, chunk, dtype)
    vc = to_chunks(v, n_chunks, chunk, dtype)
    do = to_chunks(grad_out, n_chunks, chunk, dtype)
    dk, dv = q.shape[-1], vc.shape[-1]
    scores = q.new_empty(max_block, chunk, chunk)
    gq = q.new_empty(q.shape) if need_q else None
    gk = k.new_empty(k.shape) if need_k else None
    gv = vc.new_empty(vc.shape) if need_v else None
    g_init = q.new_empty(b * h, dk, dv) if need_init else None

    # Pass 1, in sequence order: tril(do v^T) feeds dq (with the prefix states) and dk's in-chunk part.
    if need_q or need_k:
        if need_q:
            init = None if initial_state is None else initial_state.to(dtype).reshape(b * h, dk, dv)
            prefix = PrefixStates(k, dk, dv, init, n_chunks, max_block)
        for a, z, *shape in blocks:
            do_v = causal_scores_into(scores[: z - a], do[a:z], vc[a:z])
            if need_q:
                torch.bmm(do[a:z], prefix.block(k[a:z], vc[a:z], a, z, *shape).transpose(1, 2), out=gq[a:z])
                gq[a:z].baddbmm_(do_v, k[a:z])
            if need_k:
                torch.bmm(do_v.transpose(1, 2), q[a:z], out=gk[a:z])

    # Pass 2, in reverse order: R_next[c] = sum_{c' > c} q_c'^T do_c' feeds dk, dv and d initial_state.
    if need_k or need_v or need_init:
        per_chunk = q.new_empty(max_block, dk, dv)
        later = q.new_empty(max_block, dk, dv)
        suffix = q.new_empty(max_block + b * h, dk, dv)
        carry = None
        for a, z, n_groups, per_group, starts, ends in reversed(blocks):
            length = z - a
            qdo = torch.bmm(q[a:z].transpose(1, 2), do[a:z], out=per_chunk[:length])
            # suffix[:, j] = carry + sum of the last j chunks' products, built by a forward cumsum
            # over the chunks in reverse order (torch has no reverse cumsum).
            sfx = suffix[: length + n_groups].view(n_groups, per_group + 1, dk, dv)
            if ends:
                sfx[:, 0].zero_()
            else:
                sfx[:, 0] = carry
            sfx[:, 1:] = qdo.view(n_groups, per_group, dk, dv).flip(1)
            sfx.cumsum_(dim=1)
            if not starts:
                carry = sfx[0, -1].clone()
            elif need_init:
                g0 = a // n_chunks
                g_init[g0: g0 + n_groups] = sfx[:, -1]
            descending = torch.arange(per_group - 1, -1, -1, device=q.device)
            nxt = torch.index_select(sfx, 1, descending, out=later[:length].view(n_groups, per_group, dk, dv))
            nxt = nxt.view(length, dk, dv)
            if need_k:
                gk[a:z].baddbmm_(vc[a:z], nxt.transpose(1, 2))
            if need_v:
                torch.bmm(k[a:z], nxt, out=gv[a:z])
                gv[a:z].baddbmm_(causal_scores_into(scores[:length], q[a:z], k[a:z]).transpose(1, 2), do[a:z])

    grad_q = None if gq is None else unchunk(gq, b, h, n, phi_q.dtype)
    grad_k = None if gk is None else unchunk(gk, b, h, n, phi_k.dtype)
    grad_v = None if gv is None else unchunk(gv, b, h, n, v.dtype)
    grad_init = None if g_init is None else g_init.view_as(initial_state).to(initial_state.dtype)
    return grad_q, grad_k, grad_v, grad_init


class _CausalLinearProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phi_q, phi_k, v, initial_state, chunk_size):
        # Only the inputs are kept; chunk states are rebuilt in backward so memory stays O(N * d).
        ctx.save_for_backward(phi_q, phi_k, v, initial_state)
        ctx.chunk_size = chunk_size
        return product_forward(phi_q, phi_k, v, initial_state, chunk_size)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        phi_q, phi_k, v, initial_state = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        grads = product_backward(phi_q, phi_k, v, initial_state, grad_out, ctx.chunk_size, needs)
        return (*grads, None)


def _composed_product(phi_q, phi_k, v, initial_state, chunk_size):
    """The chunked product from plain differentiable ops (no custom backward, no out=, no in-place), for
    torch.func transforms, which support neither. It keeps every chunk's prefix state: O(N / C * Dk * Dv)
    memory where the custom path keeps O(Dk * Dv)."""
    b, h, n, dk = phi_q.shape
    dtype = _state_dtype(phi_q.dtype)
    chunk = min(chunk_size, n)
    pad = -n % chunk
    q, k, v_ = (torch.nn.functional.pad(t.to(dtype), (0, 0, 0, pad)).unflatten(2, (-1, chunk))
                for t in (phi_q, phi_k, v))
    products = k.transpose(-2, -1) @ v_  # (B, H, chunks, Dk, Dv)
    prefix = torch.cat([torch.zeros_like(products[:, :, :1]), products[:, :, :-1].cumsum(2)], dim=2)
    if initial_state is not None:
        prefix = prefix + initial_state.to(dtype).unsqueeze(2)
    out = q @ prefix + (q @ k.transpose(-2, -1)).tril() @ v_
    return out.flatten(2, 3)[:, :, :n].to(phi_q.dtype)


def causal_linear_product(phi_q, phi_k, v, initial_state=None, chunk_size=CHUNK_SIZE):
    """Causal linear attention numerator, chunked.

    phi_q, phi_k: (B, H, N, Dk); v: (B, H, N, Dv); initial_state: (B, H, Dk, Dv) or None.
    Returns (B, H, N, Dv) in the dtype of phi_q, with
    out[b,h,i] = phi_q[b,h,i] @ (initial_state[b,h] + sum_{j<=i} outer(phi_k[b,h,j], v[b,h,j])).
    float16/bfloat16 inputs are computed in float32 internally.
    """
    _check_inputs(phi_q, phi_k, v, initial_state, seq_dims=4)
    check_chunk_size(chunk_size)
    if phi_q.shape[2] == 0:
        raise ValueError("phi_q has sequence length 0; pass at least one position (N >= 1).")
    chosen = backend.product_backend(phi_q, phi_k, v, initial_state).backend
    if chosen == backend.COMPOSED:
        return _composed_product(phi_q, phi_k, v, initial_state, chunk_size)
    if chosen == backend.TRITON:
        return triton_causal.causal_product(phi_q, phi_k, v, initial_state)
    if needs_grad(phi_q, phi_k, v, initial_state):
        return _CausalLinearProduct.apply(phi_q, phi_k, v, initial_state, chunk_size)
    return product_forward(phi_q, phi_k, v, initial_state, chunk_size)


def causal_linear_state(phi_k, v, initial_state=None):
    """Final state initial_state + sum_j outer(phi_k[j], v[j]) -> (B, H, Dk, Dv).

    phi_k: (B, H, N, Dk); v: (B, H, N, Dv). Used to prefill before decoding with
    causal_linear_step. The state is float32 for float16/bfloat16 inputs (else the input dtype),
    because it accumulates over the whole sequence.
    """
    _check_inputs(phi_k, phi_k, v, initial_state, seq_dims=4, q_name="phi_k")
    dtype = _state_dtype(phi_k.dtype)
    with no_autocast(phi_k.device):
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
    return step_unchecked(phi_q, phi_k, v, state)


def step_unchecked(phi_q, phi_k, v, state):
    """causal_linear_step without its argument checks, for callers that have done them. Decoding is bound
    by per-op overhead (a few microseconds each, more than the arithmetic), so no-op conversions and
    context managers are skipped too."""
    dtype = _state_dtype(phi_q.dtype)
    out_dtype = phi_q.dtype
    if out_dtype != dtype:
        phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    if state is not None and state.dtype != dtype:
        state = state.to(dtype)
    phi_k, v = phi_k.unsqueeze(-1), v.unsqueeze(-2)
    new_state = phi_k * v if state is None else torch.addcmul(state, phi_k, v)
    b, h, dk, dv = new_state.shape
    # bmm on 3-D views: matmul's broadcasting of 4-D operands costs more than the product itself here.
    args = (phi_q.reshape(b * h, 1, dk), new_state.reshape(b * h, dk, dv))
    if torch.is_autocast_enabled(phi_q.device.type):
        with no_autocast(phi_q.device):
            out = torch.bmm(*args)
    else:
        out = torch.bmm(*args)
    out = out.view(b, h, dv)
    return (out if out_dtype == dtype else out.to(out_dtype)), new_state
