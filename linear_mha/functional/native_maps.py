"""Row passes beside attention in the compiled CPU code: the focused, hedgehog and SiLU-unit feature maps
(csrc/focused_map.c, csrc/hedgehog_map.c, csrc/silu_unit_map.c), GLA's log gates (csrc/log_gate_map.c), the
modules' output gate (csrc/output_gate.c) and local term (csrc/grid_conv.c). Each reads a row and writes its result,
forward and backward, instead of a chain of PyTorch ops whose fresh N-sized outputs page-fault. Loaded and declared
with the attention kernels by ``native_library.py``; the ``backend`` functions named after each (``focused_map``,
``hedgehog_map``, ``silu_unit``, ``log_gate``, ``output_gate``, ``local_term``) decide which calls come here."""
import math
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import native
from ._common import needs_grad, shares_memory_across_elements
from .grid_conv import check_grid_shapes


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
    return _parameter_map("lm_focused_map", x, scale, power)


def _rows(x):
    b, h, n, d = x.shape
    return (b, h, n, d, *x.stride()[:3])


def _parameter_map(entry: str, x: Tensor, parameter: Optional[Tensor], setting: float) -> Tensor:
    """A compiled row map of x (B, H, N, d) with a parameter per head and channel (or None) and one float setting,
    whose entry points ``<entry>_f32``, ``<entry>_backward_f32`` and ``<entry>_tasks`` take the same arguments: the
    focused map (its scales and power) and GLA's log gates (their bias and temperature)."""
    if torch.is_grad_enabled() and (x.requires_grad or (parameter is not None and parameter.requires_grad)):
        return _ParameterMap.apply(x, parameter, setting, entry)
    return _parameter_map_forward(entry, x, parameter, setting)


def _parameter_map_forward(entry, x, parameter, setting):
    out = native.output(x, *x.shape)
    native.call(f"{entry}_f32", x.data_ptr(), native.pointer(parameter), out.data_ptr(), *_rows(x), float(setting),
                torch.get_num_threads())
    return out


class _ParameterMap(torch.autograd.Function):
    """A map with its compiled backward, which recomputes the row from x; the parameter's gradient summed from the
    backward's tasks' partial sums."""

    @staticmethod
    def forward(ctx, x, parameter, setting, entry):
        ctx.save_for_backward(x, parameter)
        ctx.setting, ctx.entry = setting, entry
        return _parameter_map_forward(entry, x, parameter, setting)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, parameter = ctx.saved_tensors
        grad_x = native.output(x, *x.shape)
        partial = _partial_sums(f"{ctx.entry}_tasks", x, () if parameter is None else parameter.shape,
                                parameter is not None and ctx.needs_input_grad[1])
        grad_out = grad_out.contiguous()  # held in a name: a temporary's memory would be freed before the call
        native.call(f"{ctx.entry}_backward_f32", x.data_ptr(), native.pointer(parameter), grad_out.data_ptr(),
                    grad_x.data_ptr(), native.pointer(partial), *_rows(x), float(ctx.setting),
                    torch.get_num_threads())
        return grad_x, None if partial is None else partial.sum(0), None, None


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


def silu_unit_map(x: Tensor, eps: float) -> Tensor:
    """silu(x) / max(|silu(x)|, eps) along the last dimension of x (B, H, N, d), any strides with a contiguous last
    dimension, differentiable through the compiled backward (silu_unit_map.c), which recomputes the row. Returns a
    contiguous (B, H, N, d) tensor. Callers check ``backend.silu_unit_backend``."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _SiluUnitMap.apply(x, eps)
    return _silu_unit_forward(x, eps)


def _silu_unit_forward(x, eps):
    out = native.output(x, *x.shape)
    native.call("lm_silu_unit_map_f32", x.data_ptr(), out.data_ptr(), *_rows(x), float(eps), torch.get_num_threads())
    return out


class _SiluUnitMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        ctx.save_for_backward(x)
        ctx.eps = eps
        return _silu_unit_forward(x, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        grad_x = native.output(x, *x.shape)
        grad_out = grad_out.contiguous()  # held in a name: a temporary's memory would be freed before the call
        native.call("lm_silu_unit_map_backward_f32", x.data_ptr(), grad_out.data_ptr(), grad_x.data_ptr(), *_rows(x),
                    float(ctx.eps), torch.get_num_threads())
        return grad_x, None


def log_gate_map(z: Tensor, bias: Optional[Tensor], temperature: float) -> Tensor:
    """logsigmoid(z + bias) / temperature of z (B, H, N, d), any strides with a contiguous last dimension; bias
    (H, d) contiguous or None. Differentiable in z and bias through the compiled backward (log_gate_map.c). Returns
    a contiguous (B, H, N, d) tensor. Callers check ``backend.log_gate_backend``."""
    return _parameter_map("lm_log_gate_map", z, bias, temperature)


def output_gate(out: Tensor, q: Tensor, weight: Tensor, bias: Optional[Tensor], inplace: bool = False) -> Tensor:
    """out (B, H, L, Dv) * 2 sigmoid(q W + b) per head (``output_gate.py``): q (B, H, L, D), weight (H, D, Dv), bias
    (H, 1, Dv) or None, q and out with contiguous rows, any other strides. The gate is made a block of rows at a time
    and never stored; differentiable in all four through the compiled backward, which recomputes it. Returns a
    tensor laid out as out is (``native.rows_like``), or, with ``inplace`` and no gradient wanted, out itself, written
    over (unless its rows share memory, as an expanded tensor's do): a fresh N-sized output's page faults cost 40% of
    the gate. Callers check ``backend.output_gate_backend``."""
    if needs_grad(out, q, weight, bias):
        return _CompiledOutputGate.apply(out, q, weight, bias)
    in_place = inplace and not shares_memory_across_elements(out)
    return _gate_forward(out, q, *_gate_parameters(weight, bias), out if in_place else None)


def _gate_parameters(weight, bias):
    return weight.contiguous(), None if bias is None else bias.contiguous()


def _gate_sizes(out, q):
    b, h, n, dv = out.shape
    return b, h, n, q.shape[-1], dv


def _gate_forward(out, q, weight, bias, res=None):
    res = native.rows_like(out, *out.shape) if res is None else res
    native.call("lm_output_gate_f32", q.data_ptr(), weight.data_ptr(), native.pointer(bias), out.data_ptr(),
                res.data_ptr(), *_gate_sizes(out, q), native.row_strides(q, out, res), torch.get_num_threads())
    return res


class _CompiledOutputGate(torch.autograd.Function):
    """The compiled gate with its compiled backward; d W and d b are summed per task, then over tasks here."""

    @staticmethod
    def forward(ctx, out, q, weight, bias):
        weight, bias = _gate_parameters(weight, bias)
        ctx.save_for_backward(out, q, weight, bias)
        return _gate_forward(out, q, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out, q, weight, bias = ctx.saved_tensors
        wanted = ctx.needs_input_grad
        grad = native.rows_readable(grad)
        grad_out = native.rows_like(out, *out.shape) if wanted[0] else None
        grad_q = native.rows_like(q, *q.shape) if wanted[1] else None
        grad_w = _partial_sums("lm_output_gate_tasks", out, weight.shape, wanted[2])
        grad_b = _partial_sums("lm_output_gate_tasks", out, () if bias is None else bias.shape,
                               bias is not None and wanted[3])
        native.call("lm_output_gate_backward_f32", q.data_ptr(), weight.data_ptr(), native.pointer(bias),
                    out.data_ptr(), grad.data_ptr(), native.pointer(grad_out), native.pointer(grad_q),
                    native.pointer(grad_w), native.pointer(grad_b), *_gate_sizes(out, q),
                    native.row_strides(q, out, grad, grad_out, grad_q), torch.get_num_threads())
        return (grad_out, grad_q, None if grad_w is None else grad_w.sum(0),
                None if grad_b is None else grad_b.sum(0))


def local_term(out: Tensor, v: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int, prefix: int,
               key_padding_mask: Optional[Tensor], inplace: bool = False) -> Tensor:
    """out + ``grid_conv.token_grid_conv(v, weight, bias, height, width, prefix, key_padding_mask)`` in one pass
    (csrc/grid_conv.c): out and v (B, H, S, d) with contiguous rows, any other strides; weight (H * d, 1, k, k), bias
    (H * d,) or None, key_padding_mask (B, S) bool, True = masked, or None. Differentiable in all four through the
    compiled backward. Returns a tensor laid out as out is, or, with ``inplace`` and no gradient wanted, out itself,
    written over (unless its rows share memory, or out shares v's). Callers check ``backend.local_term_backend``."""
    check_grid_shapes(v, weight, height, width, prefix)  # the compiled code trusts the sizes it is given
    if height * width == 0:
        raise ValueError(f"the token grid is {height} x {width}: the local term needs at least one grid token")
    grid = (height, width, prefix)
    b, _, s, _ = v.shape  # a mask broadcast over the batch, as torch's masked_fill takes it, is read per entry
    mask = None if key_padding_mask is None else key_padding_mask.expand(b, s).to(torch.uint8).contiguous()
    if needs_grad(out, v, weight, bias):
        return _CompiledLocalTerm.apply(out, v, weight, bias, grid, mask)
    # Over out only when its rows are its own: the pass reads v's neighbouring rows after writing a row of out.
    in_place = inplace and not shares_memory_across_elements(out) \
        and out.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    return _local_forward(out, v, _taps(weight, v.shape[1]), _plain(bias), grid, mask, out if in_place else None)


def _taps(weight: Tensor, h: int) -> Tensor:
    """The convolution's weight (H * d, 1, k, k) as the compiled code reads it: (H, k * k, d), a tap's channels in
    a row."""
    k = weight.shape[-1]
    return weight.detach().reshape(h, -1, k * k).transpose(1, 2).contiguous()


def _plain(bias: Optional[Tensor]) -> Optional[Tensor]:
    return None if bias is None else bias.detach().contiguous()


def _grid_sizes(v, taps, grid):
    b, h, s, d = v.shape
    return b, h, s, d, math.isqrt(taps.shape[1]), *grid


def _local_forward(out, v, taps, bias, grid, mask, res=None):
    res = native.rows_like(out, *out.shape) if res is None else res
    native.call("lm_grid_conv_f32", v.data_ptr(), taps.data_ptr(), native.pointer(bias), native.pointer(mask),
                out.data_ptr(), res.data_ptr(), *_grid_sizes(v, taps, grid), native.row_strides(v, out, res),
                torch.get_num_threads())
    return res


class _CompiledLocalTerm(torch.autograd.Function):
    """out + the local term with its compiled backward: d out is the incoming gradient itself; d weight and d bias
    are summed per task, then over tasks here."""

    @staticmethod
    def forward(ctx, out, v, weight, bias, grid, mask):
        taps = _taps(weight, v.shape[1])
        ctx.save_for_backward(v, taps, mask)
        ctx.grid, ctx.weight_shape = grid, weight.shape
        return _local_forward(out, v, taps, _plain(bias), grid, mask)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        v, taps, mask = ctx.saved_tensors
        wanted = ctx.needs_input_grad
        grad = native.rows_readable(grad)
        grad_v = native.rows_like(v, *v.shape) if wanted[1] else None
        tasks = native.count("lm_grid_conv_tasks", v.shape[0], ctx.grid[0], torch.get_num_threads())
        grad_w = v.new_zeros(tasks, *taps.shape) if wanted[2] else None
        grad_b = v.new_zeros(tasks, v.shape[1] * v.shape[3]) if wanted[3] else None
        if grad_v is not None or grad_w is not None or grad_b is not None:
            native.call("lm_grid_conv_backward_f32", v.data_ptr(), taps.data_ptr(), native.pointer(mask),
                        grad.data_ptr(), native.pointer(grad_v), native.pointer(grad_w), native.pointer(grad_b),
                        *_grid_sizes(v, taps, ctx.grid), native.row_strides(v, grad, grad_v),
                        torch.get_num_threads())
        if grad_w is not None:  # (H, k k, d) back to the convolution's (H * d, 1, k, k)
            grad_w = grad_w.sum(0).transpose(1, 2).reshape(ctx.weight_shape)
        return (grad if wanted[0] else None, grad_v, grad_w, None if grad_b is None else grad_b.sum(0), None, None)
