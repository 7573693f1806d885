"""The CPU allocator: which one a process runs under, the environment that takes it back to glibc's defaults, and
glibc's keep-freed-memory setting made from inside a running process.

At long sequence lengths the allocator moves CPU times a good deal (docs/benchmarks.md, "CPU: the memory
allocator"): glibc's default malloc maps blocks of 32 MiB or more afresh on every call and unmaps them on free, so
each call's outputs and gradients are page-faulted in again, while tcmalloc, or glibc told to keep freed memory,
reuses them. The benchmarks name the allocator in their results, and the fresh processes that measure peak memory
drop every such setting: an allocator that keeps freed blocks lets a new allocation reuse them unseen.

The launch-time cures are an LD_PRELOADed tcmalloc or ``GLIBC_TUNABLES``; ``keep_freed_memory()`` is the same glibc
setting made with ``mallopt`` for code that cannot choose how it is launched (a notebook, a job scheduler). It
changes the whole process for the rest of its life, which is why it lives here, with the tools, and not in the
attention library.
"""
import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Mapping, Optional

# Replacement malloc libraries, by a fragment of their file names.
MALLOC_LIBRARIES = ("tcmalloc", "jemalloc", "mimalloc", "tbbmalloc", "snmalloc", "hoard")

# mallopt's parameter numbers (<malloc.h>).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = -1  # mallopt(3): a trim threshold of -1 disables trimming; any int cap would give back what lies above

_setting_made = False


def is_malloc_library(path: str) -> bool:
    return any(lib in Path(path).name for lib in MALLOC_LIBRARIES)


def mapped_files(maps_path: str = "/proc/self/maps") -> Optional[List[str]]:
    """Paths of the files mapped into a process (/proc/<pid>/maps), or None where that cannot be read."""
    try:
        with open(maps_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = []
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path, which may hold spaces]
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.append(fields[5].removesuffix(" (deleted)"))
    return paths


def replacement_mallocs(environ: Optional[Mapping[str, str]] = None,
                        maps_path: str = "/proc/self/maps") -> List[str]:
    """File names of the replacement malloc libraries in the process: those mapped, else those in LD_PRELOAD."""
    paths = mapped_files(maps_path)
    if paths is None:
        paths = (os.environ if environ is None else environ).get("LD_PRELOAD", "").replace(":", " ").split()
    return sorted({Path(p).name for p in paths if is_malloc_library(p)})


def uses_glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Tell this process's glibc malloc to serve large blocks from its heap and keep freed memory for reuse.

    The launch-time equivalent is ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...``:
    ``mallopt(M_MMAP_MAX, 0)`` (blocks no longer get their own mmap) and ``mallopt(M_TRIM_THRESHOLD, -1)`` (free
    memory at the top of the heap is never returned). It applies to allocations made after the call. One limit is
    glibc's, and the launch-time setting has it too: a thread other than the main one allocates from its own heap of
    at most 64 MiB, so a larger block made on such a thread is still mmapped and unmapped (PyTorch runs CPU forward
    and backward on the thread that calls them). The cost is the process's footprint: it stays near its peak instead
    of shrinking when tensors are freed (PyTorch's CUDA caching allocator makes the same trade on the GPU). Calling
    it again does nothing more.

    Returns True when the setting is in force. Returns False, with a warning that says why, where it cannot
    apply: not glibc (macOS, Windows, musl), glibc's library not loadable, or a replacement malloc such as
    tcmalloc already serving the process, which keeps freed memory by itself.
    """
    global _setting_made
    if _setting_made:
        return True
    if not uses_glibc():
        warnings.warn(f"keep_freed_memory: this process does not allocate with glibc's malloc ({sys.platform}, "
                      f"libc {platform.libc_ver()[0] or 'unknown'}); nothing was changed. Its allocator decides "
                      "whether freed memory is kept.", RuntimeWarning, stacklevel=2)
        return False
    replacements = replacement_mallocs()
    if replacements:
        warnings.warn(f"keep_freed_memory: this process allocates with {', '.join(replacements)}, which keeps "
                      "freed memory by itself; glibc's malloc setting would change nothing, so it was not made.",
                      RuntimeWarning, stacklevel=2)
        return False
    try:  # glibc's own mallopt, whatever else in the process defines the symbol
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError as e:
        warnings.warn(f"keep_freed_memory: glibc's library could not be loaded ({e}); nothing was changed. Launch "
                      "with GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295 instead.",
                      RuntimeWarning, stacklevel=2)
        return False
    if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) != 1:
        raise RuntimeError("keep_freed_memory: glibc's mallopt refused M_MMAP_MAX = 0 or M_TRIM_THRESHOLD; "
                           "launch with GLIBC_TUNABLES=glibc.malloc.mmap_max=0:"
                           "glibc.malloc.trim_threshold=4294967295 instead")
    _setting_made = True
    return True


def freed_memory_kept() -> bool:
    """Whether ``keep_freed_memory()`` has put its setting in force in this process."""
    return _setting_made

# Environment variables the replacement libraries read; jemalloc's MALLOC_CONF is not one of glibc's MALLOC_*.
LIBRARY_SETTINGS = ("MALLOC_CONF", "TCMALLOC_", "MIMALLOC_", "TBB_MALLOC_")


def _is_glibc_setting(key: str) -> bool:
    return key.startswith("MALLOC_") and not key.startswith(LIBRARY_SETTINGS)


def describe(environ: Optional[Mapping[str, str]] = None, maps_path: str = "/proc/self/maps") -> str:
    """The process's allocator in words, for a benchmark's header and JSON: a replacement malloc library with its
    settings, or glibc's malloc with any GLIBC_TUNABLES malloc entries and MALLOC_* variables (sorted, so equal
    settings compare equal) and keep_freed_memory() if it was called, plus torch's
    THP_MEM_ALLOC_ENABLE."""
    environ = os.environ if environ is None else environ
    libraries = replacement_mallocs(environ, maps_path)
    if libraries:
        settings = sorted(f"{k}={v}" for k, v in environ.items() if k.startswith(LIBRARY_SETTINGS))
        parts = [", ".join(libraries + settings)]
    elif uses_glibc():
        settings = sorted(t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc."))
        settings += sorted(f"{k}={v}" for k, v in environ.items() if _is_glibc_setting(k))
        if freed_memory_kept():  # mallopt's setting overrides the launch-time ones it touches
            settings.append("tools.cpu_allocator.keep_freed_memory()")
        parts = ["glibc malloc" + (f" ({', '.join(settings)})" if settings else " (defaults)")]
    else:
        parts = ["platform malloc"]
    if environ.get("THP_MEM_ALLOC_ENABLE") == "1":
        parts.append("THP_MEM_ALLOC_ENABLE=1")
    return ", ".join(parts)


def plain_glibc_environment(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``environ`` (default: this process's) without the settings that change how memory is allocated: malloc
    libraries in LD_PRELOAD, GLIBC_TUNABLES' malloc entries, MALLOC_* and the libraries' variables, and
    THP_MEM_ALLOC_ENABLE (2 MiB pages round the resident size up)."""
    env = dict(os.environ if environ is None else environ)
    preload = [p for p in env.pop("LD_PRELOAD", "").replace(":", " ").split() if not is_malloc_library(p)]
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.")]
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    for key in [k for k in env if k.startswith(("MALLOC_",) + LIBRARY_SETTINGS)] + ["THP_MEM_ALLOC_ENABLE"]:
        env.pop(key, None)
    return env


def main(argv=None):
    """``python -m linear_mha.tools.cpu_allocator``: say which allocator this Python process runs under and how to change it."""
    import argparse
    from linear_mha.integrations.console import HelpFormatter
    argparse.ArgumentParser(prog="python -m linear_mha.tools.cpu_allocator", formatter_class=HelpFormatter,
                            description=__doc__ + "\nRun as a command, it prints the allocator a Python process "
                                                  "started here gets, and the settings that change it.").parse_args(argv)
    print(f"this process: {describe()}")
    print("keep freed memory at launch (either):\n"
          "  LD_PRELOAD=<path to libtcmalloc_minimal.so.4> python ...\n"
          "  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295 python ...\n"
          "or from inside a process: from linear_mha.tools.cpu_allocator import keep_freed_memory; keep_freed_memory()")


if __name__ == "__main__":
    main()
