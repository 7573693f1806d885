"""Measurement utilities shared by the tools/ benchmarks: thread pinning, the matmul peak, interleaved timing,
peak extra memory of one case (fresh subprocess on CPU, CUDA's peak counters on GPU), log-log slopes and float64
relative errors.

Peak memory on CPU is measured in a FRESH Python process so that nothing an earlier case allocated (or a cached
free block) can hide or inflate it. The case is described by a small JSON-able spec,

    {"builder": "module:function", "kwargs": {...}, "paths": ["dir to put on sys.path", ...]}

and ``builder(**kwargs)`` must build its inputs and return a zero-argument callable that runs the case once.
The child runs it once (warm-up: lazy initialisation, one-off caches), then takes the current RSS as the
baseline, resets the kernel's high-water mark (``/proc/self/clear_refs``), runs it again and reports
``VmHWM - baseline``: the extra memory of one call, with the inputs (and anything the case keeps between calls)
in the baseline. glibc is told to serve every allocation above 64 KiB with mmap, so freed tensors go back to the
system at once and a cached free block cannot absorb the second call's allocations unseen; for the same reason
the child drops the parent's allocator settings (tools/cpu_allocator.py) and empties linear_mha's cache of
the compiled code's outputs (linear_mha/functional/output_cache.py) after the warm-up, and a child that still finds a
replacement malloc library in itself (one in /etc/ld.so.preload, say) reports an error instead of a number.
Where clear_refs is not writable the child falls back to ``ru_maxrss`` (which then also covers the input build:
an upper bound).

    python -m linear_mha.tools.measure --memory-spec '{"builder": "linear_mha.tools.measure:allocation_case", "kwargs": {"mib": 200}}'
"""
import argparse
import gc
import importlib
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

from linear_mha.integrations.console import HelpFormatter
from linear_mha.functional import native, output_cache
from . import cpu_allocator

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


# ----------------------------------------------------------------------------------------------- threads, peak
def pin_threads(threads: Optional[int] = None) -> int:
    """Pin torch's intra-op thread count (None keeps the current one) and return the count now in force."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def cpu_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_child_environment(environ=None) -> Dict[str, str]:
    """The environment of a memory-measuring child: the parent's on plain glibc malloc, which returns every freed
    block above 64 KiB at once (see the module docstring), with the repository on its path (``-m linear_mha.tools.measure``)."""
    env = dict(cpu_allocator.plain_glibc_environment(environ), MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def sync(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_call(device="cpu", dtype=torch.float32, size: int = 2048) -> Tuple[Callable[[], object], float]:
    """A square ``size`` GEMM into a kept output, and its FLOPs (2 size^3): what the matmul peak is measured with."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    return (lambda: torch.mm(a, b, out=c)), 2.0 * size ** 3


def matmul_peak_gflops(device="cpu", dtype=torch.float32, size: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of a square ``size`` GEMM (2 size^3 FLOPs) at the current thread count.

    The best run is the peak: on a shared machine other work only ever slows a run down."""
    gemm, flops = matmul_call(device, dtype, size)
    gemm()
    sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        gemm()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


# ---------------------------------------------------------------------------------------------------- timing
def round_robin(callables: Dict[str, Callable[[], object]], *, repeats: int = 5, warmup: int = 1, device="cpu",
                budget_s: Optional[float] = None, min_repeats: int = 2) -> Dict[str, dict]:
    """Time several callables interleaved: round r runs every callable once, starting at a rotating position, so
    a slow phase of the machine (another process, thermal state) is shared by all of them instead of one.
    Python's cyclic garbage collector runs between rounds, never inside a timed call (as ``timeit`` keeps it
    out): a collection set off by one call's allocations scans the whole interpreter heap, 2-3% of the samples
    of a 30 ms call at 16k tokens, and lands on whichever callable happens to allocate then. Between rounds only
    the young generations are collected (what the round allocated): a full collection there took 0.4 s in a
    process holding torch, transformers and timm, several per second of a quick benchmark inside the test suite.

    On CUDA each run is timed with CUDA events, elsewhere with the host clock after the call returns.
    Returns name -> {"median_ms", "min_ms", "runs", "round_ms"} or name -> {"error": "..."} for a callable that
    raised (it is dropped from later rounds; the others go on). "round_ms" lists the runs in round order, so that
    two callables' runs of one round can be set against each other (``paired_ratio``). Rounds stop after
    ``repeats``, or earlier once ``budget_s`` seconds have passed and ``min_repeats`` rounds are done (large cases
    at a few seconds a call)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    times = {name: [] for name in callables}
    errors = {}

    on_cuda = torch.device(device).type == "cuda"

    def timed(name):
        # CUDA: events on the stream bracket the device work itself; a host clock would add the launch latency
        # of the first kernel and the synchronisation to every run.
        start = torch.cuda.Event(enable_timing=True) if on_cuda else time.perf_counter()
        end = torch.cuda.Event(enable_timing=True) if on_cuda else None
        try:
            if on_cuda:
                start.record()
            callables[name]()
            if on_cuda:
                end.record()
            sync(device)
        except Exception as exc:  # noqa: BLE001 - a failing peer or an OOM must not end the whole run
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            return None
        return start.elapsed_time(end) if on_cuda else (time.perf_counter() - start) * 1e3

    for name in callables:
        for _ in range(warmup):
            if name not in errors:
                timed(name)
    names = list(callables)
    start = time.perf_counter()
    collecting = gc.isenabled()
    try:
        for r in range(repeats):
            gc.collect(1)
            gc.disable()
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                if name not in errors:
                    ms = timed(name)
                    if ms is not None:
                        times[name].append(ms)
            if collecting:
                gc.enable()
            if budget_s is not None and r + 1 >= min_repeats and time.perf_counter() - start > budget_s:
                break
    finally:
        if collecting:
            gc.enable()
    out = {}
    for name in callables:
        if name in errors:
            out[name] = {"error": errors[name]}
        else:
            ts = sorted(times[name])
            mid = len(ts) // 2
            median = ts[mid] if len(ts) % 2 else 0.5 * (ts[mid - 1] + ts[mid])
            out[name] = {"median_ms": median, "min_ms": ts[0], "runs": len(ts), "round_ms": list(times[name])}
    return out


def paired_ratio(timed: Dict[str, dict], name: str, base: str) -> Dict[str, float]:
    """name's time over base's, round by round (``round_robin``'s "round_ms"): the median of the per-round ratios
    and their quartiles. Two calls of one round run back to back, so a machine whose speed drifts between rounds
    (10-25% here) moves both; a ratio of the two medians takes each median from other rounds and keeps that drift."""
    failed = [n for n in (name, base) if "round_ms" not in timed[n]]
    if failed:
        raise ValueError(f"paired_ratio: {failed[0]!r} has no timed rounds: {timed[failed[0]].get('error')}")
    ratios = sorted(a / b for a, b in zip(timed[name]["round_ms"], timed[base]["round_ms"]))
    if not ratios:
        raise ValueError(f"paired_ratio: no round timed both {name!r} and {base!r}")

    def quantile(q):
        at = q * (len(ratios) - 1)
        low = int(math.floor(at))
        high = min(low + 1, len(ratios) - 1)
        return ratios[low] + (ratios[high] - ratios[low]) * (at - low)
    return {"median": quantile(0.5), "q1": quantile(0.25), "q3": quantile(0.75), "rounds": len(ratios)}


# ---------------------------------------------------------------------------------------------------- memory
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def load_builder(spec: dict) -> Callable:
    """Import ``spec['builder']`` ("package.module:function") with the repository and ``spec['paths']`` on sys.path,
    after the modules of ``spec['imports']`` (which may register attention methods the case uses)."""
    if not isinstance(spec, dict) or ":" not in str(spec.get("builder", "")):
        raise ValueError(f"memory spec needs 'builder': 'module:function', got {spec!r}")
    for path in [str(REPO_ROOT), *spec.get("paths", [])]:
        if path not in sys.path:
            sys.path.insert(0, path)
    for name in spec.get("imports", []):
        importlib.import_module(name)
    module, function = spec["builder"].split(":", 1)
    return getattr(importlib.import_module(module), function)


def measure_in_this_process(spec: dict) -> dict:
    """The child side of :func:`peak_extra_memory` on CPU (also usable for a quick in-process look)."""
    run = load_builder(spec)(**spec.get("kwargs", {}))
    run()
    gc.collect()
    cache = sys.modules.get("linear_mha.functional.output_cache")
    if cache is not None:  # the warm-up's freed outputs, kept for reuse, would absorb the measured call's unseen
        cache.empty()
    baseline = _status_bytes("VmRSS")
    if _reset_high_water_mark():
        run()
        peak, how = _status_bytes("VmHWM"), "VmHWM after clear_refs reset (fresh process)"
    else:
        run()
        peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss (includes input build)"
    return {"extra_bytes": max(peak - baseline, 0), "baseline_bytes": baseline, "peak_bytes": peak, "how": how,
            "allocator": cpu_allocator.describe()}


def cuda_peak_extra(run: Callable[[], object], device) -> dict:
    """Extra CUDA memory of one call of ``run`` beyond what is allocated before it (inputs, warm caches)."""
    run()
    sync(device)
    gc.collect()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"extra_bytes": peak - base, "baseline_bytes": base, "peak_bytes": peak,
            "how": "torch.cuda.max_memory_allocated - memory_allocated"}


def peak_extra_memory(spec: dict, device="cpu", timeout_s: float = 1800.0) -> dict:
    """Peak extra memory (bytes) of one run of the case ``spec`` describes; see the module docstring.

    CPU: a fresh subprocess. CUDA: this process, with torch's peak counters. Returns the dict of
    :func:`measure_in_this_process` (``extra_bytes`` ...) or {"error": "..."} when the case failed."""
    json.dumps(spec)  # fail here, with the spec in the traceback, if it cannot reach a child process
    if torch.device(device).type == "cuda":
        try:
            return cuda_peak_extra(load_builder(spec)(**spec.get("kwargs", {})), device)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: reported in the table, the run goes on
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    env = memory_child_environment()
    cmd = [sys.executable, "-m", "linear_mha.tools.measure", "--memory-spec", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"memory child timed out after {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"error": f"memory child failed: {tail}"[:300]}
    measured = json.loads(lines[-1])
    if not measured.get("allocator", "glibc").startswith(("glibc", "platform")):
        return {"error": f"memory child still ran under {measured['allocator']}, which keeps freed memory and would "
                         f"hide allocations; measure without it"[:300]}
    return measured


def peak_extra_mib(spec: dict, device="cpu") -> float:
    """:func:`peak_extra_memory` in MiB, or NaN with the error printed to stderr (a report shows the gap)."""
    mem = peak_extra_memory(spec, device)
    if "error" in mem:
        print(f"memory measurement failed ({spec.get('builder')}): {mem['error']}", file=sys.stderr)
        return float("nan")
    return mem["extra_bytes"] / MIB


def reset_cuda_peak(device) -> None:
    """Start a CUDA peak-memory window (no-op on other devices); read it with :func:`cuda_peak_mib`."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_mib(device) -> float:
    return torch.cuda.max_memory_allocated(device) / MIB if torch.device(device).type == "cuda" else float("nan")


def allocation_case(mib: float = 200.0, cached: bool = False) -> Callable[[], object]:
    """A case with a known answer: each call fills ``mib`` MiB and frees it. Used to check the memory
    measurement itself (tests, and the benchmark's calibration line). ``cached``: the block comes from the cache
    of the compiled code's outputs, which keeps it when it is freed, as the kernels' outputs are kept."""
    numel = int(mib * MIB) // 4
    if cached and not native.available():  # the cache comes with the compiled code
        raise RuntimeError(f"cached=True needs linear_mha's compiled code: {native.build_error()}")

    def run():
        block = output_cache.take(torch.float32, (numel,)) if cached else None
        block = torch.ones(numel, dtype=torch.float32) if block is None else block.fill_(1.0)
        return float(block[-1])
    return run


# ------------------------------------------------------------------------------------------- fits and errors
def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(y) against log(x): 1 for linear growth, 2 for quadratic.

    None when fewer than two usable points (both coordinates positive and finite, at least two distinct x)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys)
           if x is not None and y is not None and x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)]
    if len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in float64 on ref's device."""
    if out.shape != ref.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but ref has {tuple(ref.shape)}")
    ref64 = ref.detach().to(torch.float64)
    diff = out.detach().to(device=ref64.device, dtype=torch.float64) - ref64
    denom = torch.linalg.vector_norm(ref64)
    if denom == 0:
        return float(torch.linalg.vector_norm(diff))
    return float(torch.linalg.vector_norm(diff) / denom)


def to_float64(tensors: Iterable[torch.Tensor]):
    """Detached float64 copies, e.g. of a case's inputs for its float64 reference."""
    return [t.detach().to(torch.float64) for t in tensors]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.measure", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--memory-spec", required=True, help="JSON spec of the case to measure in THIS process")
    args = p.parse_args(argv)
    print(json.dumps(measure_in_this_process(json.loads(args.memory_spec))))


if __name__ == "__main__":
    main()
