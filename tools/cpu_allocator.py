"""Which CPU allocator a process runs under, and the environment that takes it back to glibc's defaults.

At long sequence lengths the allocator moves CPU times a good deal (README, "CPU: the memory allocator"): glibc's
default malloc maps blocks of 32 MiB or more afresh on every call, while tcmalloc, or glibc told to keep freed
memory, reuses them. So the benchmarks name the allocator in their results, and the fresh processes that measure
peak memory drop every such setting: an allocator that keeps freed blocks lets a new allocation reuse them unseen.
"""
import os
from typing import Dict, Mapping, Optional

from linear_mha.cpu_malloc import freed_memory_kept, is_malloc_library, replacement_mallocs, uses_glibc

# Environment variables the replacement libraries read; jemalloc's MALLOC_CONF is not one of glibc's MALLOC_*.
LIBRARY_SETTINGS = ("MALLOC_CONF", "TCMALLOC_", "MIMALLOC_", "TBB_MALLOC_")


def _is_glibc_setting(key: str) -> bool:
    return key.startswith("MALLOC_") and not key.startswith(LIBRARY_SETTINGS)


def describe(environ: Optional[Mapping[str, str]] = None, maps_path: str = "/proc/self/maps") -> str:
    """The process's allocator in words, for a benchmark's header and JSON: a replacement malloc library with its
    settings, or glibc's malloc with any GLIBC_TUNABLES malloc entries and MALLOC_* variables (sorted, so equal
    settings compare equal) and linear_mha.keep_freed_memory() if it was called, plus torch's
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
            settings.append("linear_mha.keep_freed_memory()")
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
