"""Small helpers shared by the attention functions: masking, key dropout, safe division.

All functions take ``key_padding_mask`` as a bool tensor of shape ``(B, S)`` where ``True`` marks a key to
IGNORE (torch's convention). Masking is done with ``masked_fill`` rather than multiplication so that masked
garbage (even inf/NaN) can neither leak into results nor receive gradient.
"""
import contextlib
import functools
import os
from typing import Optional

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch import Tensor


def key_mask_4d(key_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """(B, S) -> (B, 1, S, 1), broadcastable against (B, H, S, D)."""
    if key_padding_mask is None:
        return None
    return key_padding_mask[:, None, :, None]


def mask_keys(x: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Zero the rows of ``x`` (B, H, S, D) whose key is masked."""
    if key_padding_mask is None:
        return x
    return x.masked_fill(key_mask_4d(key_padding_mask), 0.0)


def drop_keys(v: Tensor, dropout_p: float) -> Tensor:
    """Attention dropout for the linear modes, which have no probability matrix to drop from.

    Each key (its value row) is dropped with probability ``p`` from the numerator only, independently per
    batch element and head, and survivors are scaled by 1/(1-p). The normaliser is left untouched, so the
    expectation of the output equals the output without dropout, as with dropout on softmax probabilities.
    """
    if dropout_p <= 0.0:
        return v
    if dropout_p >= 1.0:
        return torch.zeros_like(v)
    keep = torch.empty(v.shape[:-1] + (1,), device=v.device, dtype=v.dtype).bernoulli_(1.0 - dropout_p)
    return v * keep / (1.0 - dropout_p)


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def functorch_active() -> bool:
    """Whether a torch.func transform (vmap, grad, ...) is running: its wrapper tensors support neither out=
    nor raw data pointers, so the fast paths that use them give way to plain tensor ops."""
    return _functorch_active()


def has_tangent(*tensors: Optional[Tensor]) -> bool:
    """Whether any of these tensors carries a forward-mode AD tangent (torch.autograd.forward_ad's dual tensors):
    code that reads raw data pointers would drop it, so such calls take plain tensor ops. Free outside a dual
    level, where no tensor can carry one."""
    if getattr(forward_ad, "_current_level", 0) < 0 or functorch_active():  # torch.func takes PyTorch ops anyway
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def compiling() -> bool:
    """Whether this call is being recorded into a graph (torch.compile, torch.export and its ONNX exporter, or
    torch.jit.trace and the legacy ONNX exporter): graphs need plain ops (no ctypes calls, whose work a trace does
    not see, no per-block loops, no out= products inside custom Functions, which some torch releases cannot
    trace), and no Python branch on a tensor's values, which a graph would bake in or cannot record."""
    return _is_compiling() or torch.jit.is_tracing()


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_is_exporting = getattr(getattr(torch, "compiler", None), "is_exporting", lambda: False)


def fixed_graph() -> bool:
    """Whether this call is recorded into one graph that cannot branch on a tensor's values: torch.export (and
    the ONNX exporter built on it) or torch.jit.trace (and the legacy ONNX exporter). A check that reads values
    would fail there, or be baked in and hold for every later input. torch.compile is not one: it splits the
    graph at such a check and runs it."""
    return _is_exporting() or torch.jit.is_tracing()


def autocast_active(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type."""
    try:
        return torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # devices without autocast support (e.g. meta)
        return False


def no_autocast(device: torch.device):
    """A context that switches autocast off on ``device`` where it is on, else does nothing."""
    return torch.autocast(device_type=device.type, enabled=False) if autocast_active(device) else contextlib.nullcontext()


def outside_autocast(fn):
    """Run an attention function with autocast off on its first tensor's device. These functions accumulate half
    inputs in float32 themselves (``compute_dtype``); autocast would cast those products back to float16, where
    the normaliser of a few thousand keys overflows (65,504 is float16's largest value) and the outputs turn to
    inf/NaN. Outputs still come back in the inputs' dtype."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)), None)
        with contextlib.nullcontext() if first is None else no_autocast(first.device):
            return fn(*args, **kwargs)
    return wrapper


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Low-precision inputs accumulate states and normalisers in float32; float32/64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def append_ones(v: Tensor) -> Tensor:
    """(..., S, Dv) -> (..., S, Dv + 1): one product then yields numerator and normaliser together."""
    return F.pad(v, (0, 1), value=1.0)  # one op, where cat needs a ones tensor first (decoding counts ops)


def shares_memory_across_elements(t: Tensor) -> bool:
    """Whether some of t's elements are one memory location (an expanded tensor's are): writing it in place would
    write them more than once."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will record an op on these tensors (None entries are ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def why_not_fused_map_pair(q_map, k_map) -> Optional[str]:
    """Why hedgehog's query and key maps (weight (H, d, m), bias (H, m) or None each) cannot be read by a fused
    kernel (compiled or Triton) as it lays them out (both the same size, biases of (heads, m)), or None. A weight
    or bias with a forward-mode tangent cannot be either: the kernels read their values and would drop it."""
    if q_map[0].shape != k_map[0].shape:
        return "the query and key maps differ in size"
    for weight, bias in (q_map, k_map):
        if bias is not None and tuple(bias.shape) != (weight.shape[0], weight.shape[-1]):
            return f"a bias of shape {tuple(bias.shape)}, not (heads, m)"
    if has_tangent(*q_map, *k_map):
        return "the maps' weights carry forward-mode AD tangents, which the fused kernels drop"
    return None


def split_normalise(num_den: Tensor) -> Tensor:
    """Divide the numerator columns by the last (normaliser) column.

    A zero normaliser only occurs when every key a query can see is masked (or a non-negative feature map is
    zero on the query); the numerator is then zero too, and the output is defined as 0 rather than NaN.
    """
    return normalise(num_den[..., :-1], num_den[..., -1:])


def normalise(num: Tensor, den: Tensor) -> Tensor:
    """num / den for a non-negative normaliser. den == 0 only when every key a query can see is masked (or its
    features are zero), and then num is 0 too: dividing by 1 instead gives output 0 and a finite gradient (a
    clamp to the smallest float would give 0 too, but gradients of order 1/tiny that overflow into NaN)."""
    return num / safe_normaliser(den)


def safe_normaliser(den: Tensor) -> Tensor:
    return den.masked_fill(den == 0, 1.0)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> None:
    """Type and shape checks shared by every method; messages name the argument at fault."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}; convert it with {name}.float()")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, seq, dim); got q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k{tuple(k.shape)} and v{tuple(v.shape)} must agree in (batch, heads, seq)")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q{tuple(q.shape)} and k{tuple(k.shape)} must agree in batch, heads and head dim")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}; move them "
                         f"with .to(q.device)")
    if key_padding_mask is not None:
        if key_padding_mask.device != k.device:  # the compiled code would read a pointer to another device's memory
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but k is on {k.device}; move it with "
                             f"key_padding_mask.to(k.device)")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = ignore), got {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
            raise ValueError(
                f"key_padding_mask must have shape (batch, S) = {(k.shape[0], k.shape[2])}, "
                f"got {tuple(key_padding_mask.shape)}"
            )


class PathSwitch:
    """An opt-in path's on/off setting for the process: on where the environment variable is "1" at import, then
    switched by ``set`` (which returns the previous setting). A module exposes ``enabled`` and ``set_enabled``."""

    def __init__(self, variable: str):
        self.on = os.environ.get(variable, "0") == "1"

    def enabled(self) -> bool:
        return self.on

    def set(self, on: bool) -> bool:
        previous, self.on = self.on, bool(on)
        return previous
