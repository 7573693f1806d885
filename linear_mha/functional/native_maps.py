"""Feature maps of a whole row in the compiled CPU code (csrc/focused_map.c, csrc/hedgehog_map.c): one pass that
reads a row and writes its features, forward and backward, instead of a chain of elementwise PyTorch ops whose
fresh N-sized outputs page-fault. Loaded and declared with the attention kernels by ``native.py``;
``backend.focused_map_backend`` / ``backend.hedgehog_map_backend`` decide which calls come here."""
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import native


def _partial_sums(tasks_entry: str, x: Tensor, shape, wanted: bool) -> Optional[Tensor]:
    """Zeroed (tasks, *shape) buffer for a parameter's gradient, summed by the caller over its first dimension: each
    of the compiled backward's tasks adds its rows into its own slice, so threads never write the same sum."""
    if not wanted:
        return None
    b, h, n = x.shape[:3]
    tasks = native.count(tasks_entry, b, h, n, torch.get_num_threads())
    return x.new_zeros(tasks, *shape)


def focused_map(x: Tensor, scale: Optional[Tensor], power: float) -> Tensor:
    """The focused map (``focused.focused_feature_map``) of x (B, H, N, d), any strides with a contiguous last
    dimension; scale (H, d) contiguous, positive, or None. Differentiable in x and scale through the compiled
    backward (focused_map.c). Returns a contiguous (B, H, N, d) tensor. Callers check ``why_not``."""
    if torch.is_grad_enabled() and (x.requires_grad or (scale is not None and scale.requires_grad)):
        return _FocusedMap.apply(x, scale, power)
    return _focused_forward(x, scale, power)


def _rows(x):
    b, h, n, d = x.shape
    return (b, h, n, d, *x.stride()[:3])


def _focused_forward(x, scale, power):
    out = native.output(x, *x.shape)
    native.call("lm_focused_map_f32", x.data_ptr(), native.pointer(scale), out.data_ptr(), *_rows(x), float(power),
         torch.get_num_threads())
    return out


class _FocusedMap(torch.autograd.Function):
    """The focused map with its compiled backward, which recomputes the row's features from x."""

    @staticmethod
    def forward(ctx, x, scale, power):
        ctx.save_for_backward(x, scale)
        ctx.power = power
        return _focused_forward(x, scale, power)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, scale = ctx.saved_tensors
        grad_x = native.output(x, *x.shape)
        partial = _partial_sums("lm_focused_map_tasks", x, () if scale is None else scale.shape,
                                scale is not None and ctx.needs_input_grad[1])
        grad_out = grad_out.contiguous()  # held in a name: a temporary's memory would be freed before the call
        native.call("lm_focused_map_backward_f32", x.data_ptr(), native.pointer(scale), grad_out.data_ptr(),
             grad_x.data_ptr(), native.pointer(partial), *_rows(x), float(ctx.power), torch.get_num_threads())
        return grad_x, None if partial is None else partial.sum(0), None


def hedgehog_map(z: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Hedgehog's features [softmax(z + b), softmax(-(z + b))] of z (B, H, N, m) contiguous, bias (H, m) contiguous
    or None, differentiable in both through the compiled backward (hedgehog_map.c). Returns (B, H, N, 2m).
    Callers check ``why_not``."""
    if torch.is_grad_enabled() and (z.requires_grad or (bias is not None and bias.requires_grad)):
        return _HedgehogMap.apply(z, bias)
    return _hedgehog_forward(z, bias)


def _hedgehog_forward(z, bias):
    b, h, n, m = z.shape
    out = native.output(z, b, h, n, 2 * m)
    native.call("lm_hedgehog_map_f32", z.data_ptr(), native.pointer(bias), out.data_ptr(), b, h, n, m,
         torch.get_num_threads())
    return out


class _HedgehogMap(torch.autograd.Function):
    """Hedgehog's double softmax with its compiled backward, which recomputes the features from z."""

    @staticmethod
    def forward(ctx, z, bias):
        ctx.save_for_backward(z, bias)
        return _hedgehog_forward(z, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        z, bias = ctx.saved_tensors
        grad_z = native.output(z, *z.shape)
        partial = _partial_sums("lm_hedgehog_map_tasks", z, () if bias is None else bias.shape,
                                bias is not None and ctx.needs_input_grad[1])
        grad_out = grad_out.contiguous()  # held in a name: a temporary's memory would be freed before the call
        native.call("lm_hedgehog_map_backward_f32", z.data_ptr(), native.pointer(bias), grad_out.data_ptr(),
             grad_z.data_ptr(), native.pointer(partial), *z.shape, torch.get_num_threads())
        return grad_z, None if partial is None else partial.sum(0)
