"""The causal linear product in Triton kernels of our own, forward and backward (``triton_causal_jit.py``):

    out_i = phi(q_i) (S_0 + sum_{j <= i} phi(k_j) v_jᵀ)

on features made already, what ``kernel.chunked.causal_linear_product`` computes (causal kernel attention carries
its normaliser through it as a ones column of v). Each program walks a (batch, head)'s sequence chunk by chunk with
its part of the state in float32 registers, so nothing N-sized is written but the output and the gradients; half
inputs are read as they are and accumulated in float32. An initial state goes in and the final state comes out
(prefill hands ``generate()`` its state), both with gradients.

``backend.product_backend`` sends causal products here (CUDA tensors; CPU tensors under Triton's interpreter, as
the tests run it) when the path is on: ``LINEAR_MHA_TRITON_CAUSAL=1`` or ``set_enabled(True)``. It is off by
default until its speed against fla's kernel and our PyTorch path has been measured on a GPU.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._common import PathSwitch, compiling, functorch_active, has_tangent
from .triton_kernel import HAS_TRITON, _block, _precision, cdiv, interpreted

_switch = PathSwitch("LINEAR_MHA_TRITON_CAUSAL")
enabled, set_enabled = _switch.enabled, _switch.set  # whether this process may take the path; switch it


def why_not(phi_q: Tensor, phi_k: Tensor, v: Tensor, initial_state: Optional[Tensor] = None) -> Optional[str]:
    """Why this causal product cannot run in the kernels, or None."""
    if not _switch.on:
        return "the Triton causal path is off (the default until timed on a GPU; LINEAR_MHA_TRITON_CAUSAL=1 turns it on)"
    if not HAS_TRITON:
        return "triton is not installed"
    if not (phi_q.is_cuda or interpreted()):
        return "the tensors are not on a CUDA device"
    if phi_q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or len({phi_q.dtype, phi_k.dtype, v.dtype}) > 1:
        return f"dtypes {phi_q.dtype}, {phi_k.dtype}, {v.dtype}: the kernels take one of float32, float16, bfloat16"
    if max(phi_q.shape[-1], v.shape[-1]) > 256:
        return "features or value columns above 256"
    if phi_q.numel() == 0 or v.numel() == 0:
        return "an empty tensor"
    if initial_state is not None and initial_state.device != phi_q.device:
        return f"the initial_state is on {initial_state.device}, the inputs on {phi_q.device}"
    if compiling() or functorch_active():
        return "inside torch.compile, torch.export, torch.jit.trace or a torch.func transform"
    if has_tangent(phi_q, phi_k, v, initial_state):
        return "a tensor carries a forward-mode AD tangent, for which the kernels have no formula"
    return None


BLOCK_T = None  # positions per chunk; None: _chunk's choice


def _chunk(dtype: torch.dtype) -> int:
    """Positions per chunk: 16 in the interpreter (tl.dot's smallest, the tests' speed); on a GPU 64 for half inputs
    and 32 for float32's wider tiles (not yet timed: docs/cuda.md)."""
    if BLOCK_T is not None:
        return BLOCK_T
    if interpreted():
        return 16
    return 32 if dtype == torch.float32 else 64


def _kernels():
    from . import triton_causal_jit
    return triton_causal_jit


def _heads(x: Tensor):
    """A (B, H, N, X) tensor with a contiguous last dimension and its (b, h, n) strides."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, x.stride()[:3]


class _Tiles:
    """Tile sizes of one call: the whole feature and value widths, and the parts programs split them into."""

    def __init__(self, features: int, values: int, dtype: torch.dtype, device: torch.device):
        self.F, self.DV = features, values
        self.block_f, self.block_dv = _block(features), _block(values)
        self.part_f, self.part_dv = min(self.block_f, 64), min(self.block_dv, 64)
        self.chunk, self.precision = _chunk(dtype), _precision(dtype, device)


class _CausalProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phi_q, phi_k, v, initial_state, keep_state, out_dtype):
        kernels = _kernels()
        (phi_q, sq), (phi_k, sk), (v, sv) = _heads(phi_q), _heads(phi_k), _heads(v)
        b, h, n, f = phi_q.shape
        t = _Tiles(f, v.shape[-1], phi_q.dtype, phi_q.device)
        s0 = None if initial_state is None else initial_state.to(torch.float32).reshape(b * h, f, t.DV).contiguous()
        out = torch.empty(b, h, n, t.DV, device=v.device, dtype=out_dtype or phi_q.dtype)
        final = torch.empty(b, h, f, t.DV, device=v.device, dtype=torch.float32) if keep_state else out
        kernels.causal_forward[(b * h, cdiv(t.DV, t.part_dv))](
            phi_q, phi_k, v, phi_q if s0 is None else s0, out, final, h, n, *sq, *sk, *sv, *out.stride()[:3],
            F=t.F, DV=t.DV, BLOCK_T=t.chunk, BLOCK_F=t.block_f, BLOCK_DV=t.part_dv, HAS_S0=s0 is not None,
            STORE_STATE=keep_state, PRECISION=t.precision)
        ctx.save_for_backward(phi_q, phi_k, v, s0)
        ctx.tiles, ctx.state_dtype = t, None if initial_state is None else initial_state.dtype
        return (out, final) if keep_state else out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_final=None):
        kernels = _kernels()
        phi_q, phi_k, v, s0 = ctx.saved_tensors
        t, need = ctx.tiles, ctx.needs_input_grad
        b, h, n, f = phi_q.shape
        f32 = dict(device=v.device, dtype=torch.float32)
        do, sd = _heads(grad_out if grad_out is not None else torch.zeros(b, h, n, t.DV, **f32))
        dsn = None if grad_final is None else grad_final.to(torch.float32).reshape(b * h, f, t.DV).contiguous()
        sq, sk, sv = phi_q.stride()[:3], phi_k.stride()[:3], v.stride()[:3]
        common = dict(F=t.F, DV=t.DV, BLOCK_T=t.chunk, PRECISION=t.precision)
        dq = dk = dv = d_state = None
        if need[0]:
            dq = torch.empty(b, h, n, f, **f32)
            kernels.causal_grad_queries[(b * h, cdiv(f, t.part_f))](
                phi_k, v, do, phi_q if s0 is None else s0, dq, h, n, *sk, *sv, *sd, *dq.stride()[:3],
                BLOCK_F=t.part_f, BLOCK_DV=t.block_dv, HAS_S0=s0 is not None, **common)
        store_ds0 = s0 is not None and need[3]
        if need[1] or store_ds0:
            dk = torch.empty(b, h, n, f, **f32)
            d_state = torch.empty(b * h, f, t.DV, **f32) if store_ds0 else dk
            kernels.causal_grad_keys[(b * h, cdiv(f, t.part_f))](
                phi_q, phi_k, v, do, dk if dsn is None else dsn, dk, dk, d_state, h, n, *sq, *sk, *sv, *sd,
                *dk.stride()[:3], *dk.stride()[:3], BLOCK_F=t.part_f, BLOCK_DV=t.block_dv, FEATURE_ROWS=True,
                HAS_DSN=dsn is not None, STORE_DS0=store_ds0, **common)
        if need[2]:
            dv = torch.empty(b, h, n, t.DV, **f32)
            kernels.causal_grad_keys[(b * h, cdiv(t.DV, t.part_dv))](
                phi_q, phi_k, v, do, dv if dsn is None else dsn, dv, dv, dv, h, n, *sq, *sk, *sv, *sd,
                *dv.stride()[:3], *dv.stride()[:3], BLOCK_F=t.block_f, BLOCK_DV=t.part_dv, FEATURE_ROWS=False,
                HAS_DSN=dsn is not None, STORE_DS0=False, **common)
        return (None if dq is None else dq.to(phi_q.dtype), dk.to(phi_k.dtype) if need[1] else None,
                None if dv is None else dv.to(v.dtype),
                d_state.reshape(b, h, f, t.DV).to(ctx.state_dtype) if store_ds0 else None, None, None)


def causal_product(phi_q: Tensor, phi_k: Tensor, v: Tensor, initial_state: Optional[Tensor] = None,
                   output_final_state: bool = False, out_dtype: Optional[torch.dtype] = None):
    """phi_q, phi_k (B, H, N, F), v (B, H, N, Dv), one dtype of float32 / float16 / bfloat16, any strides with a
    contiguous last dimension; initial_state (B, H, F, Dv) or None. Returns out (B, H, N, Dv) in ``out_dtype``
    (default: the inputs'; float32 keeps a normaliser column that would pass float16's largest value at long N),
    and with ``output_final_state`` the state after the last position (B, H, F, Dv), float32. Callers check
    ``why_not``."""
    return _CausalProduct.apply(phi_q, phi_k, v, initial_state, output_final_state, out_dtype)
