"""Speed, memory and accuracy of linear_mha's attention against SDPA and nn.MultiheadAttention (and, when they
are installed, linear-attention-transformer / performer-pytorch / linformer, and flash-linear-attention's causal
kernel on CUDA), over sequence length N, in ONE process, round-robin, with the thread count pinned and reported.

    python -m linear_mha.tools.benchmark --threads 2 --json runs/bench/cpu.json --png runs/bench/cpu.png --resume
    python -m linear_mha.tools.benchmark --quick --json /tmp/quick.json --png /tmp/quick.png     # tiny smoke run
    python -m linear_mha.tools.benchmark --device cuda --dtype bfloat16 --json runs/bench/cuda.json --png runs/bench/cuda.png

Levels. core: the attention function on q, k, v (B, H, N, d): linear_mha.functional, raw SDPA, and exact softmax
with materialised weights (what nn.MultiheadAttention(need_weights=True) computes inside). module:
LinearMultiheadAttention(E = H d, H, mode=...) against nn.MultiheadAttention with need_weights=False (SDPA) and
the default need_weights=True, batch_first self-attention on x (B, N, E), projections included.
Passes. fwd: forward under torch.inference_mode, modules in eval(). fwdbwd: forward + backward of a fixed random
output gradient, modules in train() (dropout 0), input and parameter gradients.

FLOP formulas: tools/benchmark_flops.py; inputs and references: tools/benchmark_cases.py. % of peak: against the
best of five runs of a square GEMM at the start, and from N = --peak-in-rounds-from on also against that GEMM timed
in the case's own rounds (median to median, best to best), under the same conditions as the case.
GB/s counts the bytes of q, k, v and out (x2 for fwdbwd: their gradients too).
What was asked for but cannot run (a mask or level the method lacks, another device, a peer not installed) is
listed with its reason under the tables and in the JSON's "not_run", never dropped silently.
Quadratic methods are timed up to --sdpa-max-n (weight-materialising ones up to --weights-max-n) and extrapolated
x4 per doubling beyond: '*' in the table, "extrapolated": true in the JSON (ratios against them: "~").
Relative error (fwd output, N <= --err-max-n): exact attention in float64 for the core softmax methods, the same
method (same weights, projections) in float64 otherwise, and for flash-linear-attention (no float64 kernels) our
kernel_elu in float64: the check that the peer computes the same function. Peak extra memory: tools/measure.py
(fresh subprocess per case on CPU, CUDA peak counters on GPU). Slopes: least squares in log-log over measured
N >= --slope-min-n (the two largest N when fewer). Every method is also set against --against (kernel_elu, the
fast path) round by round within its group, beside the ratio of their FLOPs. The recurrent decode step
(kernel_step, elu) is timed at several context lengths, with a new state per step and in place. The header
says whether linear_mha's compiled CPU code ran (--no-native turns it off) and which CPU allocator the process has
(a preloaded tcmalloc, glibc's settings, or --keep-freed-memory; at long N it moves CPU times a good deal,
docs/cpu_allocator.md) and how much of its own freed outputs the compiled code keeps (LINEAR_MHA_OUTPUT_CACHE_MIB);
--resume refuses to mix any of them.
"""
import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import torch

from linear_mha.integrations.checkpoint_io import write_text_atomic
from linear_mha.integrations.console import HelpFormatter
from linear_mha.functional import fla_causal, native, output_cache

from . import cpu_allocator
from . import measure as M
from .benchmark_cases import (BASELINE, Method, available_peers, build_runner, case_key, decode_step_times,
                              make_data, method_row, methods, reference_error)
from .benchmark_flops import chunk_size
from .benchmark_report import CASE_FIELDS, NOT_RECORDED, FlopCounts, finalize, plot, print_table
from .cpu_allocator import keep_freed_memory


# ------------------------------------------------------------------------------------------------ planning
def parse_row(text: str):
    """'level:BxD' or 'level:BxD:maxN' (this row stops at N = maxN) -> (level, B, D, maxN or inf)."""
    parts = text.split(":")
    try:
        b, d = (int(v) for v in parts[1].lower().split("x"))
        max_n = int(parts[2]) if len(parts) == 3 else math.inf
        if len(parts) not in (2, 3):
            raise ValueError
    except (ValueError, IndexError):
        raise SystemExit(f"--rows entries look like core:1x64, module:4x64 or core:1x128:16384 (level:BxD[:maxN]), "
                         f"got {text!r}")
    if parts[0] not in BASELINE or min(b, d, max_n) < 1:
        raise SystemExit(f"--rows: level must be core or module and B, D, maxN >= 1, got {text!r}")
    return parts[0], b, d, max_n


def cap_for(method: Method, a) -> float:
    return {"sdpa": a.sdpa_max_n, "weights": a.weights_max_n}.get(method.kind, math.inf)


def plan(a, peers: dict):
    """Groups of cases timed together (one row, N, mask, pass); beyond-cap quadratic cases are listed apart; and
    what was asked for but cannot run, {"level", "method", "mask", "why"} once each, so that nothing is dropped
    silently (a method without a causal form, one of the other level only, a peer not installed, another device)."""
    groups, beyond, not_run = [], [], {}
    known = methods()
    for name in a.methods or []:  # a row with options changed, e.g. hedgehog:feature_dim=32
        if ":" in name:
            known.update({(level, name): method_row(level, name, known) for level in BASELINE})
    for row in a.rows:
        level, b, d, max_n = parse_row(row)
        for name in a.methods or []:  # asked for by name at a level it does not have
            if (level, name) not in known:
                other = "module" if level == "core" else "core"
                not_run[(level, name, "any")] = f"has no {level}-level form (it is a {other}-level method)"
        for n in (n for n in a.n if n <= max_n):
            for causal in a.causal:
                for pss in a.passes:
                    group = []
                    for (lv, name), method in known.items():
                        if lv != level or (a.methods and name not in a.methods):
                            continue
                        why = why_not_run(method, causal, a.device, peers)
                        if why:
                            not_run[(level, name, "causal" if causal else "full")] = why
                            continue
                        case = dict(level=level, method=name, B=b, H=a.heads, d=d, N=n, causal=causal, proj_k=a.proj_k,
                                    seed=a.seed, **{"pass": pss})
                        (beyond if n > cap_for(method, a) else group).append(case)
                    groups.append(group)
    return groups, beyond, [dict(level=lv, method=name, mask=mask, why=why) for (lv, name, mask), why in not_run.items()]


def why_not_run(method, causal: bool, device: str, peers: dict) -> Optional[str]:
    """Why a method cannot be timed with this mask on this device, or None."""
    if causal and not method.causal:
        return "has no causal form"
    if not causal and not method.full:
        return "is causal only"
    if device not in method.devices:
        return f"runs on {', '.join(method.devices)} only"
    if method.peer and peers.get(method.peer) != "available":
        return f"peer {method.peer}: {peers.get(method.peer, 'not checked')}"
    return None


def largest_output_bytes(a, dtype) -> int:
    """Bytes of the largest (B, H, N, d) output the run plans: glibc's default malloc maps such blocks afresh on
    every call from 32 MiB up."""
    sizes = [b * a.heads * d * max(n for n in a.n if n <= max_n) * dtype.itemsize
             for _, b, d, max_n in map(parse_row, a.rows) if min(a.n) <= max_n]
    return max(sizes, default=0)


def needs_memory(c, a) -> bool:
    rows = {parse_row(r)[:3] for r in a.memory_rows}
    return (not a.no_memory and c["N"] in a.memory_n and (c["level"], c["B"], c["d"]) in rows
            and (not a.memory_methods or c["method"] in a.memory_methods) and c["pass"] in a.memory_passes)


# ------------------------------------------------------------------------------------------------- running
def save(path: Optional[Path], result: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=1))


ROUND_PEAK = "matmul peak, same rounds"  # the GEMM's name among a group's runners (no case key looks like it)


def time_group(group, a, device, dtype):
    """Build every case of the group (a case that cannot be built, e.g. a broken peer, becomes an error row),
    then time them round-robin. From N = --peak-in-rounds-from on, the matmul-peak GEMM runs in the same rounds,
    and each case's timing carries its GFLOP/s there (``round_peak_gflops``, median; ``round_peak_best_gflops``):
    the peak measured once at the start moved 1.6x between runs an hour apart (docs/benchmarks.md), and a case's
    share of it with it. A GEMM that cannot be built or run leaves ``round_peak_error`` on the group's cases."""
    runners, failed = {}, {}
    data = make_data(group[0], dtype, device)  # the cases of a group differ only in method and mask
    for c in group:
        try:
            runners[case_key(c)] = build_runner(c, device, dtype, data)
        except Exception as exc:  # noqa: BLE001 - reported in the table; the other cases still run
            failed[case_key(c)] = {"error": f"build failed: {type(exc).__name__}: {exc}"[:300]}
    # Below a size whose inputs outlast the caches the GEMM would evict them between a case's rounds.
    gemm_flops, peak = None, {}
    if runners and a.peak_in_rounds_from and group[0]["N"] >= a.peak_in_rounds_from:
        try:
            runners[ROUND_PEAK], gemm_flops = M.matmul_call(device, dtype, a.peak_size)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the cases are still timed, and say why
            peak = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    timed = M.round_robin(runners, repeats=a.repeats, warmup=a.warmup, device=device, budget_s=a.budget_s,
                          min_repeats=min(3, a.repeats))
    peak = timed.pop(ROUND_PEAK, peak)
    rounds = uuid.uuid4().hex[:12]  # these cases' rounds ran together: their round_ms pair (not a resumed file's)
    for t in timed.values():
        if "median_ms" not in t:
            continue
        t["round_group"] = rounds
        if "median_ms" in peak:
            t["round_peak_gflops"] = gemm_flops / peak["median_ms"] / 1e6
            t["round_peak_best_gflops"] = gemm_flops / peak["min_ms"] / 1e6
            t["round_peak_size"] = a.peak_size  # per record: a resumed file may mix runs of other sizes
        elif "error" in peak:
            t["round_peak_error"] = peak["error"]
    return {**timed, **failed}


def time_decode(a, device, dtype):
    """The decode table; with --decode-samples K, K timings spread over K seconds, each context's numbers the
    median (and least min) over them, every sample's median kept: a sample lasts a fraction of a second, so on a
    machine whose speed drifts a single one can fall in a slow or a fast stretch."""
    samples = []
    for i in range(a.decode_samples):
        if i:
            time.sleep(1.0)
        samples.append(decode_step_times(a.heads, a.decode_dim, a.decode_contexts, a.decode_steps,
                                         max(a.repeats, 5), a.seed, device, dtype))
    if len(samples) == 1:
        return samples[0]
    rows = []
    for per_context in zip(*samples):
        row = dict(per_context[0])
        for key in ("us_median", "us_median_inplace"):
            row[f"{key}_samples"] = [r[key] for r in per_context]
            row[key] = statistics.median(row[f"{key}_samples"])
        for key in ("us_min", "us_min_inplace"):
            row[key] = min(r[key] for r in per_context)
        rows.append(row)
    return rows


QUICK = dict(n=[64, 128, 256], rows=["core:1x16", "module:1x16"], heads=2, sdpa_max_n=128, weights_max_n=128,
             err_max_n=256, proj_k=16, repeats=2, budget_s=5.0, memory_n=[64], memory_rows=["core:1x16"],
             memory_methods=["kernel_elu"], memory_passes=["fwd"], decode_contexts=[16, 256], decode_dim=16,
             decode_steps=10, slope_min_n=64, peak_size=256, peak_in_rounds_from=256)
FULL = dict(n=[256 * 2 ** i for i in range(9)], rows=["core:1x64", "core:4x64", "core:1x128:16384", "module:1x64"],
            heads=8, sdpa_max_n=8192, weights_max_n=4096, err_max_n=4096, proj_k=256, repeats=5, budget_s=20.0,
            memory_n=[1024, 4096, 16384, 65536], memory_rows=["core:1x64", "module:1x64"], memory_methods=[],
            memory_passes=["fwd", "fwdbwd"], decode_contexts=[256, 4096, 65536], decode_dim=64, decode_steps=100,
            slope_min_n=4096, peak_size=2048, peak_in_rounds_from=16384)

# On a GPU the grid the GPU issue asks for: B 1 and 8, 16 heads, d 64 and 128, N 1k .. 64k, SDPA timed to the end
# (its flash kernel is fast enough), the weight-materialising path to 4k (B 8 x 16 heads x 8k^2 scores is 17 GB).
CUDA = dict(FULL, n=[1024 * 2 ** i for i in range(7)],
            rows=["core:1x64", "core:8x64", "core:1x128", "core:8x128:16384", "module:8x64:16384"], heads=16,
            sdpa_max_n=65536, weights_max_n=4096, repeats=10, budget_s=10.0, memory_n=[1024, 4096, 16384, 65536],
            memory_rows=["core:1x64", "core:8x64"], peak_size=8192)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.benchmark", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds); explicit options still win")
    # The defaults below in parentheses are the CPU grid's; --device cuda without --quick starts from CUDA's.
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's current)")
    p.add_argument("--no-native", action="store_true",
                   help="switch linear_mha's compiled CPU code off (torch ops only), e.g. to compare both")
    p.add_argument("--n", type=int, nargs="+", help="sequence lengths (default 256 .. 65536, doubling)")
    p.add_argument("--rows", nargs="+",
                   help="level:BxD[:maxN] grid rows (default core:1x64 core:4x64 core:1x128:16384 module:1x64)")
    p.add_argument("--heads", type=int, help="H (default 8)")
    p.add_argument("--methods", nargs="+", default=[],
                   help="only these method names (default: all); 'row:key=value,...' is a registered method's row "
                        "with options changed, e.g. hedgehog:feature_dim=32")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first, e.g. one that registers your own attention method with "
                        "linear_mha.register_method (memory children import it too); repeatable")
    p.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--masks", nargs="+", choices=["full", "causal"], default=["full", "causal"],
                   help="non-causal and/or causal attention (default both; causal only for the modes that have it)")
    p.add_argument("--sdpa-max-n", type=int, help="time SDPA / nn.MHA(need_weights=False) up to this N (8192)")
    p.add_argument("--weights-max-n", type=int, help="time the weight-materialising paths up to this N (4096)")
    p.add_argument("--err-max-n", type=int, help="relative error against float64 up to this N (4096)")
    p.add_argument("--proj-k", type=int, help="Linformer's projected length k (256)")
    p.add_argument("--repeats", type=int, help="timed rounds per case (5)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget-s", type=float, help="stop a group's rounds after this many seconds, >= 3 rounds (20)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="call linear_mha.keep_freed_memory() first: glibc keeps freed blocks for reuse (CPU)")
    p.add_argument("--no-memory", action="store_true", help="skip peak-memory measurements")
    p.add_argument("--memory-n", type=int, nargs="+", help="N at which to measure memory (1024 4096 16384 65536)")
    p.add_argument("--memory-rows", nargs="+", help="grid rows to measure memory for (core:1x64 module:1x64)")
    p.add_argument("--memory-methods", nargs="+", help="methods to measure memory for (default: all)")
    p.add_argument("--memory-passes", nargs="+", choices=["fwd", "fwdbwd"], help="(default: both)")
    p.add_argument("--decode-contexts", type=int, nargs="+", help="context lengths for kernel_step (256 4096 65536)")
    p.add_argument("--decode-dim", type=int, help="head dim of the decode step (64)")
    p.add_argument("--decode-steps", type=int, help="steps per timed sample (100)")
    p.add_argument("--decode-samples", type=int, default=1,
                   help="time the decode step this many times, a second apart, and keep each sample (1)")
    p.add_argument("--slope-min-n", type=int, help="fit slopes over N >= this (4096)")
    p.add_argument("--peak-size", type=int, help="matrix size of the matmul-peak GEMM (2048)")
    p.add_argument("--peak-in-rounds-from", type=int,
                   help="from this N on, time the matmul-peak GEMM in the same rounds as the cases and give each "
                        "case's share of it as well as of the run's peak; 0: never (16384)")
    p.add_argument("--against", default="kernel_elu", metavar="METHOD",
                   help="set each method's time against this one's in the same rounds, beside their FLOPs' ratio "
                        "(default: kernel_elu, the fast path; a method the run does not time gives no such table)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="results file, rewritten after every finished case")
    p.add_argument("--png", type=Path, help="time and memory against N")
    p.add_argument("--resume", action="store_true", help="keep the cases already in --json and run the rest")
    a = p.parse_args(argv)
    for name, value in (QUICK if a.quick else CUDA if a.device == "cuda" else FULL).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.causal = [m == "causal" for m in dict.fromkeys(a.masks)]
    for row in a.rows + a.memory_rows:
        parse_row(row)  # exits with the expected format on a typo, before any measuring
    sys.path.insert(0, os.getcwd())  # a user's own module, as `python -c "import MODULE"` would find it
    for module in a.imports:
        importlib.import_module(module)
    known = sorted({name for _, name in methods()})
    for flag, names in (("methods", a.methods), ("memory_methods", a.memory_methods), ("against", [a.against])):
        unknown = sorted(set(names) - set(known))
        for name in [n for n in unknown if ":" in n]:
            try:
                method_row("core", name)
            except (KeyError, ValueError, TypeError) as exc:
                raise SystemExit(f"--{flag.replace('_', '-')} {name}: {exc.args[0] if exc.args else exc}")
            unknown.remove(name)
        if unknown:
            raise SystemExit(f"--{flag.replace('_', '-')}: unknown method(s) {unknown}; choose from {known}, or "
                             f"a row with options changed, as in hedgehog:feature_dim=32")
    for name in ("n", "memory_n", "decode_contexts"):
        if min(getattr(a, name)) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} values must be >= 1")
    if a.peak_in_rounds_from < 0 or a.peak_size < 1:
        raise SystemExit("--peak-in-rounds-from must be >= 0 (0: never) and --peak-size >= 1")
    if a.decode_samples < 1:
        raise SystemExit("--decode-samples must be >= 1")
    if a.resume and a.json is None:
        raise SystemExit("--resume needs --json PATH (the results file to continue)")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch.cuda.is_available() is False; use --device cpu")
    return a


def output_cache_mib(device: str) -> float:
    """The MiB of freed outputs the compiled code keeps (0: off, or not the CPU's compiled code)."""
    return output_cache.limit() / 2 ** 20 if device == "cpu" and native.available() else 0.0


def load_previous(a, meta):
    if not (a.resume and a.json is not None and a.json.exists()):
        return {}
    old = json.loads(a.json.read_text())
    absent = dict(native_kernels=False, output_cache_mib=0.0)  # files from before a field was recorded
    for field in ("device", "dtype", "threads", "proj_k", "native_kernels", "output_cache_mib"):
        if old["meta"].get(field, absent.get(field)) != meta[field]:
            how = {"output_cache_mib": "set LINEAR_MHA_OUTPUT_CACHE_MIB as it was",
                   "native_kernels": "pass --no-native as it was"}.get(field, f"pass the same --{field}")
            raise SystemExit(f"--resume: {a.json} was written with {field}={old['meta'].get(field)!r}, this run has "
                             f"{meta[field]!r}; {how} or write to a new --json")
    if meta["device"] == "cpu":
        recorded = old["meta"].get("allocator", NOT_RECORDED)
        if recorded == NOT_RECORDED:  # a file from before allocators were recorded: its rows stay unlabelled
            meta["allocator"] = NOT_RECORDED
        elif recorded != meta["allocator"]:
            raise SystemExit(f"--resume: {a.json} was written under the allocator {recorded!r}, this run has "
                             f"{meta['allocator']!r} (LD_PRELOAD, GLIBC_TUNABLES, MALLOC_*, THP_MEM_ALLOC_ENABLE); "
                             f"launch it the same way or write to a new --json")
    for field in ("matmul_peak_gflops", "matmul_peak_gflops_float32"):  # % of peak stays comparable across sessions
        if field in old["meta"]:
            meta[field] = old["meta"][field]
    return old


def main(argv=None):
    a = parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    threads = M.pin_threads(a.threads)
    if a.no_native:
        os.environ["LINEAR_MHA_NATIVE"] = "0"  # inherited by the memory-measuring subprocesses
        native.set_enabled(False)
    if a.keep_freed_memory and not keep_freed_memory():
        raise SystemExit("--keep-freed-memory: glibc's setting could not be made here (see the warning above); "
                         "leave the flag out to measure this process's allocator as it is")
    allocator = cpu_allocator.describe()  # before the peers are imported: they could map their own malloc
    peers = available_peers(a.device)
    meta = dict(torch=torch.__version__, device=a.device, dtype=a.dtype, threads=threads, cpu=M.cpu_name(),
                native_kernels=a.device == "cpu" and native.available(), allocator=allocator,
                output_cache_mib=output_cache_mib(a.device),
                fla_dispatch=fla_causal.enabled(),  # causal bfloat16 kernel_elu through fla (LINEAR_MHA_FLA=1)
                cpu_count=os.cpu_count(), heads=a.heads, proj_k=a.proj_k, chunk_size=chunk_size(),
                sdpa_max_n=a.sdpa_max_n, weights_max_n=a.weights_max_n, err_max_n=a.err_max_n, peers=peers,
                slope_min_n=a.slope_min_n, peak_size=a.peak_size, peak_in_rounds_from=a.peak_in_rounds_from,
                against=a.against,
                command=" ".join(sys.argv[1:] if argv is None else argv))
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    old = load_previous(a, meta)
    if "matmul_peak_gflops" not in meta:  # % of peak is against a GEMM in the run's dtype
        meta["matmul_peak_gflops"] = M.matmul_peak_gflops(device, dtype, size=a.peak_size)
        if dtype != torch.float32:
            meta["matmul_peak_gflops_float32"] = M.matmul_peak_gflops(device, torch.float32, size=a.peak_size)
    result = dict(meta=meta, records=[r for r in old.get("records", []) if not r.get("extrapolated")],
                  decode=old.get("decode", []))
    print(f"torch {meta['torch']} | {a.device} {meta.get('gpu', meta['cpu'])} | {a.dtype} | {threads} threads | "
          f"matmul peak {meta['matmul_peak_gflops']:.1f} GFLOP/s | compiled CPU code: "
          f"{'on' if meta['native_kernels'] else 'off'} | allocator: {meta['allocator']} | output cache: "
          f"{meta['output_cache_mib']:.0f} MiB | peers: {peers}", flush=True)
    if (a.device == "cpu" and meta["allocator"] == "glibc malloc (defaults)"
            and largest_output_bytes(a, dtype) >= 32 * 2 ** 20):
        print("note: glibc's default malloc maps every block of 32 MiB or more afresh, so long outputs are "
              "page-faulted in on each call; the compiled code keeps its own outputs between calls (output cache, "
              "docs/cpu_allocator.md), torch's are not kept; tcmalloc or a glibc setting (--keep-freed-memory) "
              "keeps every block", flush=True)
    by_key = {r["key"]: r for r in result["records"]}
    groups, beyond, not_run = plan(a, peers)
    flop_counts = FlopCounts()
    result["not_run"] = not_run
    for skipped in not_run:
        print(f"  not run: {skipped['level']} {skipped['method']} ({skipped['mask']}): {skipped['why']}", flush=True)
    planned = {case_key(c) for c in beyond}  # extrapolations of rows run by an earlier invocation stay in the file
    beyond += [{f: r[f] for f in CASE_FIELDS} for r in old.get("records", [])
               if r.get("extrapolated") and r["key"] not in planned]
    for group in groups:
        todo = [c for c in group if case_key(c) not in by_key]
        if todo:
            timed = time_group(todo, a, device, dtype)
            for c in todo:
                rec = dict(c, key=case_key(c), **timed[case_key(c)])
                result["records"].append(rec)
                by_key[rec["key"]] = rec
                print(f"  {rec['key']:<52} " + (f"{rec['median_ms']:10.3f} ms" if "median_ms" in rec else
                                               f"ERROR {rec['error']}"), flush=True)
            save(a.json, finalize(result, beyond, flop_counts))
        for c in group:
            rec = by_key[case_key(c)]
            if "error" in rec:
                continue
            if c["pass"] == "fwd" and c["N"] <= a.err_max_n and "rel_err" not in rec:
                try:
                    rec["rel_err"] = reference_error(c, device, dtype)
                except Exception as exc:  # noqa: BLE001 - e.g. a peer without float64 support
                    rec["rel_err"], rec["rel_err_error"] = None, f"{type(exc).__name__}: {exc}"[:200]
                    print(f"  {rec['key']:<52} float64 reference failed: {rec['rel_err_error']}", flush=True)
                save(a.json, finalize(result, beyond, flop_counts))
            if needs_memory(c, a) and "mem_extra_mib" not in rec and "mem_error" not in rec:
                spec = dict(builder="linear_mha.tools.benchmark_cases:memory_case", imports=a.imports, paths=[os.getcwd()],
                            kwargs=dict(case=c, device=a.device, dtype=a.dtype, threads=threads))
                mem = M.peak_extra_memory(spec, device)
                if "error" in mem:
                    rec["mem_error"] = mem["error"]
                else:
                    rec["mem_extra_mib"], rec["mem_how"] = mem["extra_bytes"] / M.MIB, mem["how"]
                print(f"  {rec['key']:<52} memory " + (f"{rec['mem_extra_mib']:.1f} MiB" if "mem_extra_mib" in rec
                                                      else rec["mem_error"]), flush=True)
                save(a.json, finalize(result, beyond, flop_counts))
    if not result["decode"]:
        result["decode"] = time_decode(a, device, dtype)
    result = finalize(result, beyond, flop_counts)
    save(a.json, result)
    print_table(result)
    if a.png:
        plot(result, a.png)
    return result


if __name__ == "__main__":
    main()
