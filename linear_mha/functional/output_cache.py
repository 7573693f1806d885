"""The compiled kernels' large outputs and input gradients, kept between calls (``csrc/output_cache.c``).

Under glibc's default allocator every block of 32 MiB or more is mapped afresh and unmapped when freed, so each
call at N = 16k pays for the OS faulting in and zeroing its output's pages again (measured in docs/benchmarks.md,
"The kernels' outputs kept between calls"). This cache keeps the blocks the kernels write: a tensor made here is an
ordinary CPU tensor to every caller, and its memory comes back to the cache only when torch frees the last view of
it, so nothing that can still be read is ever reused. It changes nothing about the process's allocator.

What it keeps is bounded: free blocks up to ``limit()`` bytes (``LINEAR_MHA_OUTPUT_CACHE_MIB``; by default 1 GiB,
or an eighth of the memory the process may use where that is less; 0 turns the cache off), the longest unused
given back first. ``empty()`` gives every free block back, as ``torch.cuda.empty_cache`` does on the GPU;
``stats()`` says what is kept and how often a request was served from it. Each process (a DDP rank, a forked
worker) has its own. One difference from torch's own tensors: the storage of an output made here cannot be resized
(``out.resize_`` to a larger size raises); turn the cache off where code does that.
"""
import ctypes
import os
from typing import Dict, Optional

import torch
from torch import Tensor

MIN_BYTES = 1 << 20  # smaller outputs come from glibc's heap, reused already; caching them would only pin memory
_CAPSULE_NAME = b"dltensor"  # must outlive every capsule made with it: a module constant does

# A prototype of our own: setting argtypes on ctypes.pythonapi.PyCapsule_New would change it for the whole process.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
DEFAULT_LIMIT = 1 << 30

_library: Optional[ctypes.CDLL] = None
_limit: Optional[int] = None  # None until asked for or set: then LINEAR_MHA_OUTPUT_CACHE_MIB or the default
_applied = False  # whether the C side holds _limit (it starts at 0, keeping nothing)


def _default_limit() -> int:
    setting = os.environ.get("LINEAR_MHA_OUTPUT_CACHE_MIB")
    if setting:  # set and not empty
        try:
            mib = float(setting)
        except ValueError:
            raise ValueError(f"LINEAR_MHA_OUTPUT_CACHE_MIB={setting!r}: give the MiB of freed outputs to keep, "
                             f"e.g. 1024, or 0 to turn the cache off") from None
        if mib < 0:
            raise ValueError(f"LINEAR_MHA_OUTPUT_CACHE_MIB={setting!r} is negative; give 0 to turn the cache off")
        return int(mib * (1 << 20))
    memory = _usable_memory()
    return DEFAULT_LIMIT if memory is None else min(DEFAULT_LIMIT, memory // 8)


def _usable_memory() -> Optional[int]:
    """The bytes this process may use: the machine's memory, or a container's (cgroup) limit where lower."""
    try:
        found = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        found = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                found.append(int(f.read().strip()))
        except (OSError, ValueError):  # absent, or "max" (no limit)
            pass
    return min(found) if found else None


def attach(library: ctypes.CDLL) -> None:
    """Declares the cache's entry points of the freshly loaded kernels' library. Its limit is applied on the first
    request (``take``), so that a bad LINEAR_MHA_OUTPUT_CACHE_MIB is an error of that call, not of the build."""
    global _library
    p, l = ctypes.c_void_p, ctypes.c_long
    library.lm_cache_take.argtypes, library.lm_cache_take.restype = [l], p
    library.lm_cache_give_back.argtypes, library.lm_cache_give_back.restype = [p], None
    library.lm_cache_set_limit.argtypes, library.lm_cache_set_limit.restype = [l], None
    library.lm_cache_stats.argtypes, library.lm_cache_stats.restype = [ctypes.POINTER(l)], None
    _library = library


def take(dtype: torch.dtype, shape) -> Optional[Tensor]:
    """An uninitialised contiguous CPU tensor from the cache, or None where the cache is off, unsupported or the
    tensor too small to be worth it (the caller then allocates as usual)."""
    nbytes = dtype.itemsize
    for extent in shape:
        nbytes *= extent
    if not serves(nbytes):
        return None
    global _applied
    if not _applied:  # the first request: the setting is read and handed to the C side
        _library.lm_cache_set_limit(limit())
        _applied = True
    handle = _library.lm_cache_take(nbytes)
    if not handle:
        return None
    # torch takes the capsule over and calls the block's deleter, which returns it here, when the storage dies.
    try:
        memory = torch.utils.dlpack.from_dlpack(_capsule_new(handle, _CAPSULE_NAME, None))
    except BaseException:  # never taken over (an interrupt, an unexpected torch): the block comes back at once
        _library.lm_cache_give_back(handle)
        raise
    return memory.view(dtype).view(shape)


def serves(nbytes: int) -> bool:
    """Whether a request of nbytes would come from the cache: it is loaded and on, and the block large enough."""
    return _library is not None and nbytes >= MIN_BYTES and limit() > 0


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
    global _limit, _applied
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: give the bytes of freed outputs to keep as an int, or 0 to turn the "
                         f"cache off")
    previous, _limit = limit(), nbytes
    if _library is not None:
        _library.lm_cache_set_limit(nbytes)
        _applied = True
    return previous


def empty() -> None:
    """Give every free block back to the system; blocks in use come back to the cache when they are freed."""
    if _library is not None:
        _library.lm_cache_set_limit(0)
        _library.lm_cache_set_limit(limit())
