"""The compiled CPU library of ``csrc/`` (C with OpenMP): built on first use (``native_build.py``), loaded and
declared through ctypes, switched on or off (``LINEAR_MHA_NATIVE=0`` or ``set_enabled(False)``), asked whether a call
can run there (``why_not``; ``available()`` says whether it is in use, ``build_error()`` why not), and what every
entry point uses to call it: pointers, strides and the outputs it writes, large ones kept between calls by
``output_cache.py``. The entry points are in ``native.py`` (attention and the decoding step), which hands on this
module's public names, and ``native_maps.py`` (the row passes beside attention).
"""
import ctypes
import os
import threading
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import native_build, output_cache
from ._common import compiling, functorch_active, has_tangent

_lock = threading.Lock()
_library = None
_threaded = False  # built with OpenMP: without it the sequence kernels run on one thread
_error: Optional[str] = None
_tried = False


_enabled = os.environ.get("LINEAR_MHA_NATIVE", "1") != "0"


def set_enabled(enabled: bool) -> bool:
    """Turn the compiled code on or off for this process (the default comes from ``LINEAR_MHA_NATIVE``);
    returns the previous setting, e.g. to compare both paths or to rule it out when debugging."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def enabled() -> bool:
    return _enabled


def _declare(library: ctypes.CDLL) -> None:
    p, i, l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    f = ctypes.c_float
    s = ctypes.POINTER(ctypes.c_long)  # strides over (B, H, position) of the outputs and gradients (row_strides)
    library.lm_kernel_attention_f32.argtypes = [p] * 8 + [i, i, l, l, i, i] + [l] * 9 + [i, i, f, p, s]
    library.lm_kernel_attention_backward_f32.argtypes = [p] * 12 + [i, i, l, l, i, i] + [l] * 9 + [i, i, f, p, p, s]
    library.lm_causal_kernel_attention_f32.argtypes = [p] * 7 + [i, i, l, i, i] + [l] * 9 + [i, i, f, p, s]
    library.lm_causal_kernel_attention_backward_f32.argtypes = [p] * 12 + [i, i, l, i, i] + [l] * 9 + [i, i, f, p, p, s]
    library.lm_rope_kernel_attention_f32.argtypes = [p] * 7 + [i, i, l, i, i] + [l] * 9 + [i, i, p, p, i, s]
    library.lm_rope_kernel_attention_backward_f32.argtypes = [p] * 11 + [i, i, l, i, i] + [l] * 9 + [i, i, p, p, i, s]
    library.lm_kernel_step_f32.argtypes = [p] * 6 + [i, i, i, i]
    library.lm_decayed_causal_f32.argtypes = [p] * 5 + [i, i, l, i, i, s, i, i]
    library.lm_gated_recurrence_f32.argtypes = [p] * 8 + [i, i, l, i, i, s, i]
    library.lm_gated_recurrence_backward_f32.argtypes = [p] * 12 + [i, i, l, i, i, s, i]
    library.lm_delta_systems_f32.argtypes = [p] * 8 + [l, i, i, i, i]
    library.lm_delta_systems_backward_f32.argtypes = [p] * 14 + [l, i, i, i, i]
    library.lm_delta_states_f32.argtypes = [p] * 8 + [i, l, i, i, i, i]
    library.lm_delta_states_backward_f32.argtypes = [p] * 12 + [i, l, i, i, i, i]
    library.lm_efficient_attention_f32.argtypes = [p] * 8 + [i, i, l, l, i, i] + [l] * 9 + [i, s]
    library.lm_efficient_attention_backward_f32.argtypes = [p] * 11 + [i, i, l, l, i, i] + [l] * 9 + [i, s]
    library.lm_focused_map_f32.argtypes = [p] * 3 + [i, i, l, i, l, l, l, f, i]
    library.lm_focused_map_backward_f32.argtypes = [p] * 5 + [i, i, l, i, l, l, l, f, i]
    library.lm_focused_map_tasks.argtypes = [i, i, l, i]
    library.lm_hedgehog_map_f32.argtypes = [p] * 3 + [i, i, l, i, i]
    library.lm_hedgehog_map_backward_f32.argtypes = [p] * 5 + [i, i, l, i, i]
    library.lm_hedgehog_map_tasks.argtypes = [i, i, l, i]
    library.lm_log_gate_map_f32.argtypes = [p] * 3 + [i, i, l, i, l, l, l, f, i]
    library.lm_log_gate_map_backward_f32.argtypes = [p] * 5 + [i, i, l, i, l, l, l, f, i]
    library.lm_log_gate_map_tasks.argtypes = [i, i, l, i]
    library.lm_silu_unit_map_f32.argtypes = [p] * 2 + [i, i, l, i, l, l, l, f, i]
    library.lm_silu_unit_map_backward_f32.argtypes = [p] * 3 + [i, i, l, i, l, l, l, f, i]
    library.lm_output_gate_f32.argtypes = [p] * 5 + [i, i, l, i, i, s, i]
    library.lm_output_gate_backward_f32.argtypes = [p] * 9 + [i, i, l, i, i, s, i]
    library.lm_output_gate_tasks.argtypes = [i, i, l, i]
    library.lm_grid_conv_f32.argtypes = [p] * 6 + [i, i, l, i, i, i, i, i, s, i]
    library.lm_grid_conv_backward_f32.argtypes = [p] * 7 + [i, i, l, i, i, i, i, i, s, i]
    library.lm_grid_conv_tasks.argtypes = [i, i, i]
    library.lm_prefault.argtypes = [p, l, i]
    for fn in (library.lm_kernel_attention_f32, library.lm_kernel_attention_backward_f32,
               library.lm_causal_kernel_attention_f32, library.lm_causal_kernel_attention_backward_f32,
               library.lm_rope_kernel_attention_f32, library.lm_rope_kernel_attention_backward_f32,
               library.lm_kernel_step_f32, library.lm_efficient_attention_f32,
               library.lm_efficient_attention_backward_f32, library.lm_focused_map_f32,
               library.lm_focused_map_backward_f32, library.lm_focused_map_tasks, library.lm_hedgehog_map_f32,
               library.lm_hedgehog_map_backward_f32, library.lm_hedgehog_map_tasks, library.lm_output_gate_f32,
               library.lm_output_gate_backward_f32, library.lm_output_gate_tasks, library.lm_grid_conv_f32,
               library.lm_grid_conv_backward_f32, library.lm_grid_conv_tasks, library.lm_prefault):
        fn.restype = ctypes.c_int
    output_cache.attach(library)


def _load():
    global _library, _error, _tried, _threaded
    if _tried:  # the per-call path: no lock once the build was attempted
        return _library
    with _lock:
        if not _tried:
            _tried = True
            try:
                library, threaded = native_build.build()
                _declare(library)
                _library, _threaded = library, threaded
            except Exception as exc:  # a missing or broken compiler must never break attention
                _error = str(exc)
                warnings.warn(f"linear_mha: compiled CPU code unavailable, using PyTorch ops ({_error})",
                              RuntimeWarning, stacklevel=3)
    return _library


def available() -> bool:
    """Whether the compiled code is enabled and built (builds it on the first call)."""
    return _enabled and _load() is not None


def library_path() -> Optional[str]:
    """The file of the loaded kernels (builds them on the first call), or None."""
    return None if _load() is None else _library._name


def build_error() -> Optional[str]:
    """Why the compiled code could not be built, or None."""
    _load()
    return _error


def why_not(*tensors: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why a call on these tensors cannot take the compiled path, or None: it needs float32 CPU tensors whose last
    dimension is contiguous, no torch.compile or torch.func transform around it, a build, and OpenMP in that build
    unless torch itself runs on one thread. ``dtype``: the dtype the tensors will be computed in (half inputs
    accumulate in float32 copies), if not their own."""
    if not _enabled:
        return "the compiled code is switched off (LINEAR_MHA_NATIVE=0 or native.set_enabled(False))"
    for t in tensors:
        if t is None:
            continue
        if not t.is_cpu:
            return f"a tensor is on {t.device}; the compiled code runs on the CPU"
        if (dtype or t.dtype) is not torch.float32:
            return f"a tensor is {dtype or t.dtype}; the compiled code takes float32"
        if t.stride(-1) != 1:
            return "a tensor's last dimension is not contiguous"
        if t.numel() == 0:  # the compiled code splits work by batch x heads and by rows
            return "a tensor is empty"
    if has_tangent(*tensors):
        return "a tensor carries a forward-mode AD tangent (torch.autograd.forward_ad), which the compiled code drops"
    if compiling():
        return "inside torch.compile, torch.export or torch.jit.trace, which record PyTorch ops only"
    if functorch_active():
        return "inside a torch.func transform, whose tensors have no data pointers"
    if _load() is None:
        return f"the compiled code could not be built: {_error}"
    # A one-thread build (a compiler without OpenMP) loses to torch's threaded ops on whole sequences.
    if not (_threaded or torch.get_num_threads() == 1):
        return "the compiled code was built without OpenMP and torch runs on several threads"
    return None


def _lib() -> ctypes.CDLL:
    library = _load()
    if library is None:
        raise RuntimeError(f"linear_mha's compiled CPU code is unavailable: {_error}")
    return library


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("linear_mha's compiled CPU code could not allocate its buffers")


def call(entry: str, *args) -> None:
    """Runs the compiled entry point ``entry`` (pointers from ``pointer``); raises MemoryError if it could not
    allocate its buffers. For the modules that hold the entry points (native.py, native_maps.py)."""
    _check(getattr(_lib(), entry)(*args))


def count(entry: str, *args) -> int:
    """The int a compiled sizing entry point returns (e.g. how many partial sums a backward writes)."""
    return getattr(_lib(), entry)(*args)


def pointer(t: Optional[Tensor]):
    """The data address ctypes passes for t, or None (NULL)."""
    return None if t is None else t.data_ptr()


PREFAULT_BYTES = 1 << 20  # below this a fresh output's page faults cost less than asking for them to be done at once
prefault_outputs = True  # False: let the kernels' writes fault fresh outputs in page by page (for A/B timing)


def output(like: Tensor, *shape: int) -> Tensor:
    """An uninitialised contiguous tensor for the compiled code to write: a block kept from an earlier call when it
    is large (output_cache.py), else a new one, its pages faulted in at once when it is fresh memory of at least
    PREFAULT_BYTES: the page-by-page faults of a fresh output cost a quarter of the elu forward at N = 16k under
    glibc's default allocator, and faulting them in at once saves part of that (csrc/prefault.c)."""
    out = output_cache.take(like.dtype, shape)
    if out is None:
        out = like.new_empty(shape)
    if prefault_outputs and out.numel() * out.element_size() >= PREFAULT_BYTES:
        _lib().lm_prefault(out.data_ptr(), out.numel() * out.element_size(), torch.get_num_threads())
    return out


def rows_like(t: Tensor, b: int, h: int, n: int, width: int) -> Tensor:
    """A fresh (B, H, n, width) tensor for the compiled code to write (``output``), laid out as t is: (B, n, H, width)
    in memory when t's heads lie within its positions, as a module's heads split from one projection do (merging
    them back is then a view, and the input gradients reshape to the projection's layout without a copy), else
    contiguous."""
    if h > 1 and n > 1 and t.stride(1) < t.stride(2):
        return output(t, b, n, h, width).transpose(1, 2)
    return output(t, b, h, n, width)


def row_strides(*tensors: Optional[Tensor]):
    """The (B, H, position) strides of each tensor, 0s for None, as the entry points' ``strides`` take them."""
    values = [stride for t in tensors for stride in (t.stride()[:3] if t is not None else (0, 0, 0))]
    return (ctypes.c_long * len(values))(*values)


def rows_readable(t: Tensor) -> Tensor:
    """t, or a copy of it, with contiguous rows (its last dimension), as the compiled code reads tensors."""
    return t if t.stride(-1) == 1 else t.contiguous()
