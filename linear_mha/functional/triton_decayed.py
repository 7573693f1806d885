"""Causal linear attention with one decay per head and position in a Triton kernel of our own
(``triton_causal_jit.decayed_product``): the scalar-gate form of ``gated_linear_attention`` (RetNet's retention, a
Mamba-2-style decay, the delta rule's output) on CUDA, what ``native_decayed`` is on CPU. The same product, forward
or reversed along the positions, gives the output and, three times more, the gradients (``decayed_product.py``).

Each program walks one (batch, head)'s sequence chunk by chunk with its value columns of the (d_k, d_v) state in
float32 registers. ``backend.decay_backend`` sends calls here (CUDA tensors; CPU tensors under Triton's interpreter,
as the tests run it) when the Triton causal path is on (``LINEAR_MHA_TRITON_CAUSAL=1``, the switch of
``triton_causal.py``), off by default until timed on a GPU.
"""
from typing import Optional

import torch
from torch import Tensor

from . import triton_causal
from ._common import has_tangent
from .decayed_product import decayed_causal_product
from .triton_kernel import _block, _precision, cdiv


def why_not(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor) -> Optional[str]:
    """Why this call (heads in their compute dtype, a (B, H, L, 1) log gate) cannot run in the kernel, or None:
    the causal kernels' own conditions (``triton_causal.why_not``), and the gate's."""
    if log_gate.shape[-1] != 1:
        return "a gate per key dimension (GLA): the kernel takes one gate per position"
    why = triton_causal.why_not(q, k, v)
    if why is not None:
        return why
    if {q.dtype, log_gate.dtype} != {torch.float32}:
        return f"dtypes {q.dtype} and {log_gate.dtype} (gate): the kernel takes float32 (gated linear attention " \
               f"computes half inputs in float32)"
    if has_tangent(log_gate):
        return "the gate carries a forward-mode AD tangent, for which the kernel has no formula"
    return None


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return triton_causal._heads(x)[0]


def _product(x: Tensor, y: Tensor, z: Tensor, gate: Tensor, reverse: bool) -> Tensor:
    from . import triton_causal_jit

    batch, heads, length, features = x.shape
    width = z.shape[-1]
    out = torch.empty(batch, heads, length, width, device=z.device, dtype=torch.float32)
    part = min(_block(width), 64)
    triton_causal_jit.decayed_product[(batch * heads, cdiv(width, part))](
        x, y, z, gate, out, heads, length, *x.stride()[:3], *y.stride()[:3], *z.stride()[:3], *out.stride()[:3],
        F=features, DV=width, BLOCK_T=triton_causal._chunk(x.dtype), BLOCK_F=_block(features), BLOCK_DV=part,
        REVERSE=reverse, PRECISION=_precision(x.dtype, x.device))
    return out


def decayed_causal(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor) -> Tensor:
    """q, k (B, H, L, d_k), v (B, H, L, d_v) float32 (CUDA, or CPU under the interpreter); log_gate (B, H, L), <= 0.
    Returns out_i = sum_{j <= i} exp(log_gate_{j+1} + ... + log_gate_i) (q_i . k_j) v_j (B, H, L, d_v),
    differentiable in all four. Callers check ``why_not`` first."""
    return decayed_causal_product(q, k, v, log_gate.contiguous(), _product, _last_dim_contiguous)
