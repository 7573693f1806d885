"""Building and loading the compiled CPU code of ``csrc/``: compiler search, the cache folder, and the rule
that decides which shared library may be loaded.

The library is compiled with the system C compiler (``$CC``, else cc/gcc/clang) for the host CPU, one source file per
core at a time (about 17 s of compiler time in all; the largest file alone takes 5 s), and cached under
``$LINEAR_MHA_CACHE`` (default ``~/.cache/linear_mha``), keyed by the source, the compiler, the flags and the CPU.
Loading a shared library runs its code, so a cache folder is used only if it is ours: owned by the current user and
writable by nobody else (mode ``0o700`` when this module creates it), and so is every library in it. A folder that
fails the rule is never read from; the code is then built into a private temporary folder for this process (one
warning says why). Builds go into a private temporary folder first and are renamed into place, so concurrent processes
(DDP ranks, test workers) never load a half-written file.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("kernel_attention.c", "kernel_attention_backward.c", "efficient_attention.c", "focused_map.c",
           "hedgehog_map.c", "output_gate.c", "grid_conv.c", "grid_conv_backward.c", "prefault.c",
           "output_cache.c", "decayed_attention.c",
           "delta_systems.c", "delta_states.c",
           "gated_recurrence.c", "silu_unit_map.c", "log_gate_map.c")
FLAG_SETS = tuple(["-O3", "-Wno-psabi", *arch, *omp] for arch in (["-march=native"], []) for omp in (["-fopenmp"], []))


def cpu_signature() -> str:
    # -march=native code must not be reused on another CPU: the cache key includes the CPU's model and flags.
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def compilers() -> List[str]:
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return [path for path in map(shutil.which, names) if path]


def untrusted_reason(path: Path) -> Optional[str]:
    """Why ``path`` (a folder or a library) must not be used, or None if it is the current user's and writable by
    nobody else. Where the OS has no user ids (Windows) every path is trusted, as any other file the user runs."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if info.st_uid != getuid():
        return f"is owned by user id {info.st_uid}, not by this user ({getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def configured_cache_dir() -> Path:
    return Path(os.environ.get("LINEAR_MHA_CACHE") or Path.home() / ".cache" / "linear_mha")


def cache_dir() -> Tuple[Path, Optional[str]]:
    """(folder to build into and load from, None) when the configured cache can be trusted; else (a fresh private
    temporary folder, why the configured one was not used)."""
    configured = configured_cache_dir()
    try:
        configured.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = untrusted_reason(configured)
        if reason is None and not os.access(configured, os.W_OK):
            reason = "is not writable"
    except OSError as exc:
        reason = f"cannot be created ({exc.strerror})"
    if reason is None:
        return configured, None
    return Path(tempfile.mkdtemp(prefix="linear_mha-")), f"the kernel cache {configured} {reason}"


def library_name(compiler: str, flags: List[str]) -> str:
    """The cached library's file name: a key over every file the build reads (the header included), the compiler,
    the flags and the CPU."""
    source = b"".join(path.read_bytes() for path in sorted(CSRC.iterdir()) if path.suffix in (".c", ".h"))
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(), cpu_signature().encode()]))
    return f"kernel_attention-{key.hexdigest()[:16]}.so"


def build() -> Tuple[ctypes.CDLL, bool]:
    """(the loaded library, whether it was built with OpenMP). Raises RuntimeError when no compiler can build it."""
    cache, why_not_cache = cache_dir()
    if why_not_cache:
        warnings.warn(f"linear_mha: {why_not_cache}, so nothing is loaded from it; building the compiled CPU code "
                      f"in the private folder {cache} for this process instead. Point LINEAR_MHA_CACHE at a folder "
                      f"only you can write to (e.g. mode 700) to keep them between runs.", RuntimeWarning, stacklevel=4)
    errors = []
    for compiler in compilers():
        for flags in FLAG_SETS:
            target = cache / library_name(compiler, flags)
            if target.exists() and untrusted_reason(target) is None:
                return ctypes.CDLL(str(target)), "-fopenmp" in flags
            # Absent, or not trustworthy (someone else's file): built afresh and renamed over it.
            error = _compile(compiler, flags, cache, target)
            if error:
                errors.append(error)
                continue
            return ctypes.CDLL(str(target)), "-fopenmp" in flags
    raise RuntimeError("no C compiler could build the compiled code" + (": " + " | ".join(errors) if errors else
                                                                    " (none of $CC, cc, gcc, clang was found)"))


def _compile(compiler: str, flags: List[str], cache: Path, target: Path) -> Optional[str]:
    """Compile into a private folder beside the target and rename into place; returns an error text or None.
    Each source is compiled on its own, as many at once as there are cores, then linked: one compiler call over
    all of them would use one core, and the first import waits for it."""
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        objects = [str(Path(tmp) / (Path(name).stem + ".o")) for name in SOURCES]

        def run(command: List[str]) -> Optional[str]:
            result = subprocess.run(command, capture_output=True, text=True)
            return None if result.returncode == 0 else f"{compiler} {' '.join(flags)}: {result.stderr.strip()[-400:]}"

        with ThreadPoolExecutor(max_workers=min(len(SOURCES), _usable_cores())) as pool:
            # the largest files first, so that no core is left with one at the end
            order = sorted(range(len(SOURCES)), key=lambda i: -(CSRC / SOURCES[i]).stat().st_size)
            errors = list(pool.map(lambda i: run([compiler, *flags, "-fPIC", "-c", str(CSRC / SOURCES[i]),
                                                  "-o", objects[i]]), order))
        error = next((e for e in errors if e), None) or run([compiler, *flags, "-shared", "-fPIC", "-o", str(built),
                                                             *objects, "-lm"])
        if error:
            return error
        os.chmod(built, 0o700)
        os.replace(built, target)
    return None


def _usable_cores() -> int:
    """The cores this process may run on (its affinity, e.g. under taskset or a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
