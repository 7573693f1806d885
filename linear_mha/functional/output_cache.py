"""The compiled kernels' large outputs and input gradients, kept between calls (``csrc/output_cache.c``).

Under glibc's default allocator every block of 32 MiB or more is mapped afresh and unmapped when freed, so each
call at N = 16k pays for the OS faulting in and zeroing its output's pages again (measured in docs/benchmarks.md,
"The kernels' outputs kept between calls"). This cache keeps the blocks the kernels write: a tensor made here is an
ordinary CPU tensor to every caller, and its memory comes back to the cache only when torch frees the last view of
it, so nothing that can still be read is ever reused. It changes nothing about the process's allocator.

What it keeps is bounded: free blocks up to ``limit()`` bytes (``LINEAR_MHA_OUTPUT_CACHE_MIB``, default an eighth
of the machine's memory; 0 turns the cache off), the longest unused given back first. ``empty()`` gives every
free block back, as ``torch.cuda.empty_cache`` does on the GPU; ``stats()`` says what is kept and how often a
request was served from it.
"""
import ctypes
import os
from typing import Dict, Optional

import torch
from torch import Tensor

MIN_BYTES = 1 << 20  # smaller outputs come from glibc's heap, reused already; caching them would only pin memory
_CAPSULE_NAME = b"dltensor"  # must outlive every capsule made with it: a module constant does

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_library: Optional[ctypes.CDLL] = None
_limit: Optional[int] = None  # None until asked for or set: then LINEAR_MHA_OUTPUT_CACHE_MIB or the default


def _default_limit() -> int:
    setting = os.environ.get("LINEAR_MHA_OUTPUT_CACHE_MIB")
    if setting is not None:
        try:
            mib = float(setting)
        except ValueError:
            raise ValueError(f"LINEAR_MHA_OUTPUT_CACHE_MIB={setting!r}: give the MiB of freed outputs to keep, "
                             f"e.g. 1024, or 0 to turn the cache off") from None
        if mib < 0:
            raise ValueError(f"LINEAR_MHA_OUTPUT_CACHE_MIB={setting!r} is negative; give 0 to turn the cache off")
        return int(mib * (1 << 20))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): a fixed gibibyte
        return 1 << 30


def attach(library: ctypes.CDLL) -> None:
    """Declares the cache's entry points of the freshly loaded kernels' library and sets its limit."""
    global _library
    p, l = ctypes.c_void_p, ctypes.c_long
    library.lm_cache_take.argtypes, library.lm_cache_take.restype = [l], p
    library.lm_cache_set_limit.argtypes, library.lm_cache_set_limit.restype = [l], None
    library.lm_cache_stats.argtypes, library.lm_cache_stats.restype = [ctypes.POINTER(l)], None
    library.lm_cache_set_limit(limit())
    _library = library


def take(dtype: torch.dtype, shape) -> Optional[Tensor]:
    """An uninitialised contiguous CPU tensor from the cache, or None where the cache is off, unsupported or the
    tensor too small to be worth it (the caller then allocates as usual)."""
    if _library is None or not _limit:
        return None
    size = 1
    for extent in shape:
        size *= extent
    nbytes = size * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES:
        return None
    handle = _library.lm_cache_take(nbytes)
    if not handle:
        return None
    # torch takes the capsule over and calls the block's deleter, which returns it here, when the storage dies.
    memory = torch.utils.dlpack.from_dlpack(_capsule_new(handle, _CAPSULE_NAME, None))
    return memory.view(dtype).view(shape)


def stats() -> Dict[str, int]:
    """kept_bytes (free blocks held now), limit_bytes, hits (requests served from the cache), misses (requests
    that allocated); all 0 but the limit until the compiled code is loaded."""
    values = (ctypes.c_long * 4)()
    if _library is not None:
        _library.lm_cache_stats(values)
    values[1] = limit()
    return dict(zip(("kept_bytes", "limit_bytes", "hits", "misses"), values))


def limit() -> int:
    """The bytes of free blocks the cache keeps at most (0: the cache is off)."""
    global _limit
    if _limit is None:
        _limit = _default_limit()
    return _limit


def set_limit(nbytes: int) -> int:
    """Keep at most ``nbytes`` of freed outputs from now on (0 turns the cache off and gives back what it holds);
    returns the previous limit."""
    global _limit
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: give the bytes of freed outputs to keep as an int, or 0 to turn the "
                         f"cache off")
    previous, _limit = limit(), nbytes
    if _library is not None:
        _library.lm_cache_set_limit(nbytes)
    return previous


def empty() -> None:
    """Give every free block back to the system; blocks in use come back to the cache when they are freed."""
    if _library is not None:
        _library.lm_cache_set_limit(0)
        _library.lm_cache_set_limit(limit())
