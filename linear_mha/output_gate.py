"""The output gate every attention module can multiply its heads' output by (``output_gate=True``): per head,
out ⊙ 2·sigmoid(q W + b), from the head's own query (RALA's and MLLA's multiplicative gate, made per head so that every
adapter has its input: a Hugging Face attention function receives the projected queries, never the layer input).
``gate_weight`` (H, d, d_v) and ``gate_bias`` (H, 1, d_v) start at zero, where the gate is exactly 1: a patched
pretrained model is unchanged until it trains, and a checkpoint of the original model loads without them.
2·sigmoid rather than SiLU for that reason (SiLU(0) = 0), and it can still shut a channel (→ 0) or double it.
The gate acts per position, so it has a causal form and needs no mask: padded queries' rows are padding's own."""
from typing import Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .functional import native_maps
from .functional._common import compiling, functorch_active, has_tangent, needs_grad
from .functional.backend import NATIVE, output_gate_backend
from .registry import boolean

OUTPUT_GATE_STATE = ("gate_weight", "gate_bias")


def check_output_gate(output_gate) -> bool:
    return boolean(output_gate, "output_gate")


def install_output_gate(module: nn.Module, num_heads: int, head_dim: int, value_dim: int, output_gate: bool,
                        factory_kwargs: dict) -> None:
    """Register ``gate_weight`` (H, d, d_v) and ``gate_bias`` (H, 1, d_v) on ``module``, zero (or None without a
    gate)."""
    if not check_output_gate(output_gate):
        for name in OUTPUT_GATE_STATE:
            module.register_parameter(name, None)
        return
    module.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim, value_dim, **factory_kwargs))
    module.gate_bias = nn.Parameter(torch.zeros(num_heads, 1, value_dim, **factory_kwargs))


def apply_output_gate(module: nn.Module, out: Tensor, q: Tensor, inplace: bool = False) -> Tensor:
    """out (B, H, L, d_v) gated by the queries q (B, H, L, d) of the same call (a no-op without a gate).
    ``inplace``: out is the caller's own fresh intermediate, which the compiled gate may write over without
    autograd."""
    weight: Optional[Tensor] = getattr(module, "gate_weight", None)
    if weight is None:
        return out
    weight, bias = weight.to(q.dtype), module.gate_bias.to(q.dtype)
    if compiling() or functorch_active() or has_tangent(out, q, weight, bias):
        # graphs, torch.func transforms and forward-mode AD see the formula as plain ops
        return out * (2.0 * torch.sigmoid(q @ weight + bias)).to(out.dtype)
    if output_gate_backend(out, q, weight, bias).backend == NATIVE:
        return native_maps.output_gate(out, q, weight, bias, inplace=inplace)
    if needs_grad(out, q, weight, bias):
        return _OutputGate.apply(out, q, weight, bias)
    return _gated(out, q, weight, bias)


def _gate(q: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """2·sigmoid(q W + b), made in one fresh tensor."""
    return torch.matmul(q, weight).add_(bias).sigmoid_().mul_(2.0)


def _gated(out: Tensor, q: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """out ⊙ the gate, written over the gate's own tensor when the dtypes allow."""
    gate = _gate(q, weight, bias)
    return gate.mul_(out) if gate.dtype == out.dtype and gate.shape == out.shape else out * gate.to(out.dtype)


class _OutputGate(torch.autograd.Function):
    """The gate with a backward of its own. Composed from tensor ops, the formula made five N-sized tensors
    forward (q W, + b, sigmoid, 2·, ⊙ out) and more backward, each a fresh allocation whose page faults cost more
    than its arithmetic: the gate added 32% to a module's forward at 16,384 tokens. Here the forward makes one
    tensor and the backward recomputes the gate instead of keeping it. Like the compiled attention kernels it has
    no double backward and no forward-mode derivative: torch.func transforms and dual tensors get the plain ops."""

    @staticmethod
    def forward(ctx, out, q, weight, bias):
        ctx.save_for_backward(out, q, weight, bias)
        return _gated(out, q, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out, q, weight, bias = ctx.saved_tensors
        z = torch.matmul(q, weight).add_(bias)
        gate = torch.sigmoid(z).mul_(2.0)  # s = 2·sigmoid(z)
        grad_out = (grad * gate.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[1:]):
            return grad_out, None, None, None
        # d z = grad ⊙ out ⊙ 2·sigmoid(z)·sigmoid(-z), made over s, which is not needed after it (each fresh N-sized
        # tensor costs more in page faults than its arithmetic). Not s - s²/2: that cancels as the gate saturates.
        grad_z = gate.mul_(z.neg_().sigmoid_()).mul_(grad.to(gate.dtype)).mul_(out.to(gate.dtype))
        grad_q = torch.matmul(grad_z, weight.transpose(-1, -2)) if ctx.needs_input_grad[1] else None
        grad_weight = torch.matmul(q.transpose(-1, -2), grad_z).sum_to_size(weight.shape) \
            if ctx.needs_input_grad[2] else None
        grad_bias = grad_z.sum_to_size(bias.shape) if ctx.needs_input_grad[3] else None
        return grad_out, grad_q, grad_weight, grad_bias
