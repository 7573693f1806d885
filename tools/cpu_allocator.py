"""Which CPU allocator a process runs under, and the environment that takes it back to glibc's defaults.

At long sequence lengths the allocator moves CPU times a good deal (README, "CPU: the memory allocator"): glibc's
default malloc maps blocks of 32 MiB or more afresh on every call, while tcmalloc, or glibc told to keep freed
memory, reuses them. So the benchmarks name the allocator in their results, and the fresh processes that measure
peak memory drop every such setting: an allocator that keeps freed blocks lets a new allocation reuse them unseen.
"""
import os
import platform
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional

# Replacement malloc libraries, by a fragment of their file names.
MALLOC_LIBRARIES = ("tcmalloc", "jemalloc", "mimalloc", "tbbmalloc", "snmalloc", "hoard")
# Environment variables the replacement libraries read; jemalloc's MALLOC_CONF is not one of glibc's MALLOC_*.
LIBRARY_SETTINGS = ("MALLOC_CONF", "TCMALLOC_", "MIMALLOC_", "TBB_MALLOC_")


def is_malloc_library(path: str) -> bool:
    return any(lib in Path(path).name for lib in MALLOC_LIBRARIES)


def _mapped_files(maps_path: str) -> Optional[List[str]]:
    """Paths of the files mapped into the process (/proc/<pid>/maps), or None where that cannot be read."""
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


def loaded_libraries(environ: Mapping[str, str], maps_path: str = "/proc/self/maps") -> List[str]:
    """File names of the replacement malloc libraries in the process: those mapped, else those in LD_PRELOAD."""
    paths = _mapped_files(maps_path)
    if paths is None:
        paths = environ.get("LD_PRELOAD", "").replace(":", " ").split()
    return sorted({Path(p).name for p in paths if is_malloc_library(p)})


def _is_glibc_setting(key: str) -> bool:
    return key.startswith("MALLOC_") and not key.startswith(LIBRARY_SETTINGS)


def describe(environ: Optional[Mapping[str, str]] = None, maps_path: str = "/proc/self/maps") -> str:
    """The process's allocator in words, for a benchmark's header and JSON: a replacement malloc library with its
    settings, or glibc's malloc with any GLIBC_TUNABLES malloc entries and MALLOC_* variables (sorted, so equal
    settings compare equal), plus torch's THP_MEM_ALLOC_ENABLE."""
    environ = os.environ if environ is None else environ
    libraries = loaded_libraries(environ, maps_path)
    if libraries:
        settings = sorted(f"{k}={v}" for k, v in environ.items() if k.startswith(LIBRARY_SETTINGS))
        parts = [", ".join(libraries + settings)]
    elif sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        settings = sorted(t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc."))
        settings += sorted(f"{k}={v}" for k, v in environ.items() if _is_glibc_setting(k))
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
