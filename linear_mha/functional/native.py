"""The compiled CPU kernels of ``csrc/``: built on first use, called through ctypes.

Kernel attention with an elementwise map spends most of its CPU time in elementwise passes over N-sized
tensors, not in its two GEMMs; the C kernels fuse those passes into the GEMMs (see kernel_attention.c). They
cover float32 CPU tensors: kernel attention with elu/relu (non-causal and causal, with gradients, and the
recurrent decoding step) and Efficient Attention (with gradients). Everything else (other maps and dtypes,
accelerators) stays in PyTorch, and so does everything when the kernels are unavailable.

The library is compiled with the system C compiler (``$CC``, else cc/gcc/clang) for the host CPU and cached
under ``$LINEAR_MHA_CACHE`` (default ``~/.cache/linear_mha``, or the temporary directory where the home is
read-only), keyed by the source, the flags and the CPU, so the first call in a fresh environment takes about a
second. ``LINEAR_MHA_NATIVE=0`` (or ``set_enabled(False)``) turns the kernels off; ``available()`` says whether
they are in use, ``build_error()`` why not.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._common import functorch_active

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("kernel_attention.c", "kernel_attention_backward.c", "efficient_attention.c")
_MAPS = {"elu": 0, "relu": 1}
_FLAG_SETS = tuple(["-O3", "-Wno-psabi", *arch, *omp] for arch in (["-march=native"], []) for omp in (["-fopenmp"], []))

_lock = threading.Lock()
_library = None
_threaded = False  # built with OpenMP: without it the sequence kernels run on one thread
_error: Optional[str] = None
_tried = False


_enabled = os.environ.get("LINEAR_MHA_NATIVE", "1") != "0"


def set_enabled(enabled: bool) -> bool:
    """Turn the compiled kernels on or off for this process (the default comes from ``LINEAR_MHA_NATIVE``);
    returns the previous setting, e.g. to compare both paths or to rule the kernels out when debugging."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _cpu_signature() -> str:
    # -march=native code must not be reused on another CPU: the cache key includes the CPU's model and flags.
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _compilers():
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return [path for path in map(shutil.which, names) if path]


def _cache_dir() -> Path:
    """$LINEAR_MHA_CACHE, else ~/.cache/linear_mha, else (a read-only home, as in some containers) a folder in
    the temporary directory."""
    if os.environ.get("LINEAR_MHA_CACHE"):
        return Path(os.environ["LINEAR_MHA_CACHE"])
    user = getattr(os, "getuid", lambda: "user")()
    for cache in (Path.home() / ".cache" / "linear_mha", Path(tempfile.gettempdir()) / f"linear_mha-{user}"):
        try:
            cache.mkdir(parents=True, exist_ok=True)
            if os.access(cache, os.W_OK):
                return cache
        except OSError:
            pass
    raise RuntimeError("no writable cache folder for the compiled kernels; set LINEAR_MHA_CACHE")


def _build() -> ctypes.CDLL:
    # The cache key covers every file the build reads, the header included.
    source = b"".join(path.read_bytes() for path in sorted(_CSRC.iterdir()) if path.suffix in (".c", ".h"))
    cache, cpu = _cache_dir(), _cpu_signature().encode()
    errors = []
    for compiler in _compilers():
        for flags in _FLAG_SETS:
            key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(), cpu])).hexdigest()[:16]
            target = cache / f"kernel_attention-{key}.so"
            if not target.exists():
                cache.mkdir(parents=True, exist_ok=True)
                # Build beside the target and rename: concurrent processes (DDP ranks, test workers) may race.
                with tempfile.TemporaryDirectory(dir=cache) as tmp:
                    built = Path(tmp) / target.name
                    sources = [str(_CSRC / name) for name in _SOURCES]
                    result = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(built), *sources, "-lm"],
                                            capture_output=True, text=True)
                    if result.returncode != 0:
                        errors.append(f"{compiler} {' '.join(flags)}: {result.stderr.strip()[-400:]}")
                        continue
                    os.replace(built, target)
            library = ctypes.CDLL(str(target))
            _declare(library)
            global _threaded
            _threaded = "-fopenmp" in flags
            return library
    raise RuntimeError("no C compiler could build the kernels" + (": " + " | ".join(errors) if errors else
                                                                    " (none of $CC, cc, gcc, clang was found)"))


def _declare(library: ctypes.CDLL) -> None:
    p, i, l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    library.lm_kernel_attention_f32.argtypes = [p] * 8 + [i, i, l, l, i, i] + [l] * 9 + [i, i]
    library.lm_kernel_attention_backward_f32.argtypes = [p] * 12 + [i, i, l, l, i, i] + [l] * 9 + [i, i]
    library.lm_causal_kernel_attention_f32.argtypes = [p] * 7 + [i, i, l, i, i] + [l] * 9 + [i, i]
    library.lm_causal_kernel_attention_backward_f32.argtypes = [p] * 12 + [i, i, l, i, i] + [l] * 9 + [i, i]
    library.lm_kernel_step_f32.argtypes = [p] * 6 + [i, i, i, i]
    library.lm_efficient_attention_f32.argtypes = [p] * 8 + [i, i, l, l, i, i] + [l] * 9 + [i]
    library.lm_efficient_attention_backward_f32.argtypes = [p] * 11 + [i, i, l, l, i, i] + [l] * 9 + [i]
    for fn in (library.lm_kernel_attention_f32, library.lm_kernel_attention_backward_f32,
               library.lm_causal_kernel_attention_f32, library.lm_causal_kernel_attention_backward_f32,
               library.lm_kernel_step_f32, library.lm_efficient_attention_f32,
               library.lm_efficient_attention_backward_f32):
        fn.restype = ctypes.c_int


def _load():
    global _library, _error, _tried
    if _tried:  # the per-call path: no lock once the build was attempted
        return _library
    with _lock:
        if not _tried:
            _tried = True
            try:
                _library = _build()
            except Exception as exc:  # a missing or broken compiler must never break attention
                _error = str(exc)
                warnings.warn(f"linear_mha: compiled CPU kernels unavailable, using PyTorch ops ({_error})",
                              RuntimeWarning, stacklevel=3)
    return _library


def available() -> bool:
    """Whether the compiled kernels are enabled and built (builds them on the first call)."""
    return _enabled and _load() is not None


def build_error() -> Optional[str]:
    """Why the kernels could not be built, or None."""
    _load()
    return _error


def supports(feature_map, *tensors: Optional[Tensor], autograd: bool = False) -> bool:
    """Whether a call on these tensors can take the compiled path: float32 CPU tensors whose last dimension is
    contiguous, an elementwise map the C code knows (None for Efficient Attention, which has its own), not
    inside torch.compile or a torch.func transform, no autograd unless the caller has a backward for it
    (``autograd=True``), and a build with OpenMP unless torch itself runs on one thread."""
    if not _enabled or (feature_map is not None and feature_map not in _MAPS):
        return False
    grad = not autograd and torch.is_grad_enabled()
    for t in tensors:
        # Empty tensors stay in PyTorch: the kernels split work by batch x heads and by rows.
        if t is not None and (not t.is_cpu or t.dtype is not torch.float32 or (grad and t.requires_grad)
                              or t.stride(-1) != 1 or t.numel() == 0):
            return False
    if _is_compiling() or functorch_active() or _load() is None:
        return False
    # A one-thread build (a compiler without OpenMP) loses to torch's threaded ops on whole sequences.
    return _threaded or torch.get_num_threads() == 1


def _lib() -> ctypes.CDLL:
    library = _load()
    if library is None:
        raise RuntimeError(f"linear_mha's compiled CPU kernels are unavailable: {_error}")
    return library


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("linear_mha's CPU kernel could not allocate its buffers")


def kernel_attention(q: Tensor, k: Tensor, v: Tensor, feature_map: str, key_padding_mask: Optional[Tensor] = None,
                     initial_state: Optional[Tensor] = None, causal: bool = False) -> Tensor:
    """Kernel attention, differentiable through the compiled backward. Shapes as ``kernel.kernel``: q (B, H, L, D),
    k (B, H, S, D), v (B, H, S, Dv), any strides with a contiguous last dimension (L == S when causal);
    key_padding_mask (B, S) bool, True = ignore; initial_state (B, H, D, Dv + 1). Returns a contiguous
    (B, H, L, Dv) tensor. Callers check ``supports`` and the shapes."""
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    init = None if initial_state is None else initial_state.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, init)):
        return _KernelAttention.apply(q, k, v, init, mask, feature_map, causal)
    return _forward(q, k, v, mask, init, feature_map, causal, keep=False)[0]


def _pointer(t: Optional[Tensor]):
    return None if t is None else t.data_ptr()


def _sizes(q, k, v, causal):
    """The size and stride arguments of the C entry points."""
    b, h, n_q, d = q.shape
    lengths = (n_q,) if causal else (n_q, k.shape[2])
    return (b, h, *lengths, d, v.shape[-1], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3])


def _forward(q, k, v, mask, init, feature_map, causal, keep):
    """(out, state, den): the state (B, H, D, Dv + 1, non-causal only) and the normalisers den (B, H, L) are
    returned for the backward when ``keep``, else None."""
    b, h, n_q, d = q.shape
    dv = v.shape[-1]
    out = q.new_empty(b, h, n_q, dv)
    den = q.new_empty(b, h, n_q) if keep else None
    state = q.new_empty(b, h, d, dv + 1) if keep and not causal else None
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), _pointer(mask), _pointer(init), out.data_ptr())
    tail = (*_sizes(q, k, v, causal), _MAPS[feature_map], torch.get_num_threads())
    if causal:
        status = _lib().lm_causal_kernel_attention_f32(*pointers, _pointer(den), *tail)
    else:
        status = _lib().lm_kernel_attention_f32(*pointers, _pointer(state), _pointer(den), *tail)
    _check(status)
    return out, state, den


class _KernelAttention(torch.autograd.Function):
    """Kernel attention with the compiled backward (kernel_attention_backward.c), which recomputes the features
    and keeps only the output, the normalisers and, non-causal, the (B, H, D, Dv + 1) state."""

    @staticmethod
    def forward(ctx, q, k, v, init, mask, feature_map, causal):
        out, state, den = _forward(q, k, v, mask, init, feature_map, causal, keep=True)
        ctx.save_for_backward(q, k, v, init, mask, out, state, den)
        ctx.feature_map, ctx.causal = feature_map, causal
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, init, mask, out, state, den = ctx.saved_tensors
        need_q, need_k, need_v, need_init = ctx.needs_input_grad[:4]
        b, h, n_q, d = q.shape
        n_k, dv = k.shape[2], v.shape[-1]
        grads = (q.new_empty(b, h, n_q, d) if need_q else None, k.new_empty(b, h, n_k, d) if need_k else None,
                 v.new_empty(b, h, n_k, dv) if need_v else None, q.new_empty(b, h, d, dv + 1) if need_init else None)
        grad_out = grad_out.contiguous()  # held in a name: a temporary's memory would be freed before the call
        pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), _pointer(mask))
        tail = (out.data_ptr(), grad_out.data_ptr(), *map(_pointer, grads), *_sizes(q, k, v, ctx.causal),
                _MAPS[ctx.feature_map], torch.get_num_threads())
        if ctx.causal:
            status = _lib().lm_causal_kernel_attention_backward_f32(*pointers, _pointer(init), den.data_ptr(), *tail)
        else:
            status = _lib().lm_kernel_attention_backward_f32(*pointers, state.data_ptr(), den.data_ptr(), *tail)
        _check(status)
        return (*grads, None, None, None)


def efficient_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Efficient Attention (softmax of q over features, of k over the sequence), differentiable through the
    compiled backward (efficient_attention.c). Shapes as ``efficient.efficient``, any strides with a contiguous
    last dimension; returns a contiguous (B, H, L, Dv) tensor. Callers check ``supports``."""
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _EfficientAttention.apply(q, k, v, mask)
    return _efficient_forward(q, k, v, mask, keep=False)[0]


def _efficient_forward(q, k, v, mask, keep):
    """(out, state (B, H, D, Dv), key maxima m and inverse sums 1 / l (B, H, D)); all but out only when keep."""
    b, h, n_q, d = q.shape
    dv = v.shape[-1]
    out = q.new_empty(b, h, n_q, dv)
    saved = (q.new_empty(b, h, d, dv), q.new_empty(b, h, d), q.new_empty(b, h, d)) if keep else (None,) * 3
    _check(_lib().lm_efficient_attention_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _pointer(mask), out.data_ptr(), *map(_pointer, saved),
        *_sizes(q, k, v, False), torch.get_num_threads()))
    return (out, *saved)


class _EfficientAttention(torch.autograd.Function):
    """Efficient Attention with the compiled backward, which recomputes softmax(q) and the key weights from q, k,
    the (B, H, D, Dv) state and the per-feature maxima and sums."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out, state, top, inv_sum = _efficient_forward(q, k, v, mask, keep=True)
        ctx.save_for_backward(q, k, v, mask, state, top, inv_sum)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, mask, state, top, inv_sum = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        grads = (torch.empty_like(q, memory_format=torch.contiguous_format) if need_q else None,
                 torch.empty_like(k, memory_format=torch.contiguous_format) if need_k else None,
                 torch.empty_like(v, memory_format=torch.contiguous_format) if need_v else None)
        grad_out = grad_out.contiguous()  # held in a name: a temporary's memory would be freed before the call
        _check(_lib().lm_efficient_attention_backward_f32(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), _pointer(mask), state.data_ptr(), top.data_ptr(),
            inv_sum.data_ptr(), grad_out.data_ptr(), *map(_pointer, grads), *_sizes(q, k, v, False),
            torch.get_num_threads()))
        return (*grads, None)


def step_ready(feature_map, q, k, v, state) -> bool:
    """Whether ``kernel_step`` can run in the compiled step: what ``supports`` asks, plus contiguous tensors of
    consistent shapes (q, k (B, H, D), v (B, H, Dv), state (B, H, D, Dv + 1) or None). Anything else, invalid
    input included, goes the PyTorch way, whose checks explain the problem. Decoding is bound by per-call
    overhead, so this one pass replaces the separate argument checks."""
    if not _enabled or feature_map not in _MAPS or (_library is None and _load() is None):
        return False
    grad = torch.is_grad_enabled()
    for t in (q, k, v, state):
        if t is not None and (type(t) is not Tensor or not t.is_cpu or t.dtype is not torch.float32
                              or (grad and t.requires_grad) or not t.is_contiguous()):
            return False
    shape = q.shape
    if len(shape) != 3 or k.shape != shape or v.dim() != 3 or v.shape[:2] != shape[:2] or 0 in shape:
        return False
    if state is not None and state.shape != (*shape, v.shape[2] + 1):
        return False
    return not _is_compiling() and not functorch_active()


def kernel_step(q: Tensor, k: Tensor, v: Tensor, state: Optional[Tensor], feature_map: str, inplace: bool = False):
    """One decoding step; q, k (B, H, D), v (B, H, Dv), state (B, H, D, Dv + 1) or None, as ``step_ready``
    accepts them. Returns (out (B, H, Dv), new_state), new_state being ``state`` itself when ``inplace`` (the C
    step reads each state element before it writes it)."""
    b, h, d = q.shape
    dv = v.shape[-1]
    out = q.new_empty(b, h, dv)
    new_state = state if inplace and state is not None else q.new_empty(b, h, d, dv + 1)
    _check(_lib().lm_kernel_step_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                       None if state is None else state.data_ptr(), new_state.data_ptr(),
                                       out.data_ptr(), b * h, d, dv, _MAPS[feature_map]))
    return out, new_state
