"""A module's in-projection, ``F.linear(x, weight, bias)``, with its output and input gradient in kept memory.

At N = 16k a module's (N, 3E) in-projection output is 96 MiB: under glibc's default allocator each call maps it
afresh and the OS faults in and zeroes every page, about a fifth of the product's own time on the 2-core Xeon of
docs/benchmarks.md (90 ms fresh against 70 ms into memory already written). On the compiled CPU path this writes
the output, and in the backward the input's gradient, into blocks of ``output_cache``; the products are torch's
own (``addmm`` and ``mm``). Anywhere else, and for anything a block cannot serve, it is ``F.linear``.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native, output_cache
from ._common import autocast_active


def project(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x (..., in) -> (..., out) = x weight^T + bias, as ``F.linear``."""
    if _rows(x) is None or autocast_active(x.device) or native.why_not(x, weight, bias) is not None:
        return F.linear(x, weight, bias)
    if not output_cache.serves(x.numel() // x.shape[-1] * weight.shape[0] * x.element_size()):
        return F.linear(x, weight, bias)
    return _Projection.apply(x, weight, bias)


def _rows(x: Tensor) -> Optional[bool]:
    """How x's rows lie: False when x is contiguous, True when its first two dimensions are swapped in memory (a
    (L, B, E) input seen batch-major), None otherwise (F.linear then copies as it must)."""
    if x.dim() >= 2 and x.is_contiguous():
        return False
    if x.dim() == 3 and x.transpose(0, 1).is_contiguous():
        return True
    return None


def _matrix(t: Tensor, swapped: bool) -> Tensor:
    """t (A, B, C) as the (rows, C) matrix of its memory order."""
    return (t.transpose(0, 1) if swapped else t).reshape(-1, t.shape[-1])


def _kept(rows: int, cols: int, like: Tensor) -> Tensor:
    out = output_cache.take(like.dtype, (rows, cols))
    return like.new_empty(rows, cols) if out is None else out


def _shaped_view(matrix: Tensor, shape, swapped: bool) -> Tensor:
    """The (rows, C) matrix back in an input's shape (its last size replaced) and layout, a view."""
    if swapped:
        return matrix.view(shape[1], shape[0], -1).transpose(0, 1)
    return matrix.view(*shape[:-1], -1)


def _shaped(matrix: Tensor, shape, swapped: bool) -> Tensor:
    """``_shaped_view`` as a tensor of its own over the same memory, not a view: a view made inside a custom
    Function may not be changed in place, and F.linear's output may."""
    view = _shaped_view(matrix, shape, swapped)
    return matrix.new_empty(0).set_(matrix.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class _Projection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        swapped = _rows(x)
        x2 = _matrix(x, swapped)
        out = _kept(x2.shape[0], weight.shape[0], x2)
        if bias is None:
            torch.mm(x2, weight.t(), out=out)
        else:
            torch.addmm(bias, x2, weight.t(), out=out)
        ctx.swapped, ctx.shape, ctx.has_bias = swapped, x.shape, bias is not None
        need_x, need_w, _ = ctx.needs_input_grad
        # As F.linear: x is kept only for the weight's gradient, the weight only for x's (a frozen weight, as in
        # adapter fine-tuning, must not hold every layer's input until the backward).
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        return _shaped(out, x.shape, swapped)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        swapped, shape = ctx.swapped, ctx.shape
        need_x, need_w, need_b = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: differentiable ops, no out=
            g2 = _matrix(grad, swapped)
            grad_x = _shaped_view(g2 @ weight, shape, swapped) if need_x else None
            return (grad_x, (g2.t() @ _matrix(x, swapped) if need_w else None),
                    (g2.sum(0) if need_b and ctx.has_bias else None))
        g2 = _matrix(grad, swapped)  # a view when grad lies as the output did, else one copy
        grad_x = None
        if need_x:
            grad_x = _kept(g2.shape[0], weight.shape[1], g2)
            torch.mm(g2, weight, out=grad_x)
            grad_x = _shaped(grad_x, shape, swapped)
        grad_w = g2.t() @ _matrix(x, swapped) if need_w else None
        grad_b = g2.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b
