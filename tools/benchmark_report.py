"""The benchmark's results: derived numbers (GFLOP/s, % of the matmul peak, GB/s, ratios against SDPA, log-log
slopes, extrapolated quadratic cases), the printed tables and the PNG. ``tools.benchmark`` measures; this reports."""
from pathlib import Path

import torch

from . import measure as M
from .benchmark_cases import BASELINE, case_key, method_row, methods

SERIES = ("level", "method", "B", "H", "d", "causal", "pass")
NOT_RECORDED = "not recorded"
CASE_FIELDS = SERIES + ("N", "proj_k", "seed")


def series_key(r):
    return tuple(r[f] for f in SERIES)


def _fit(rs, field, min_n):
    pts = [(r["N"], r[field]) for r in rs if r.get(field) is not None]
    use = [p for p in pts if p[0] >= min_n]
    use = use if len(use) >= 2 else pts[-2:]
    return M.loglog_slope([p[0] for p in use], [p[1] for p in use]), ([use[0][0], use[-1][0]] if use else None)


class FlopCounts:
    """FLOPs per forward of each case, counted once per process and read from the methods as they stood when it was
    made: a method's count builds the method (a user's map is traced), and the benchmark finalizes its results after
    every case, so counting afresh each time made a run's bookkeeping grow with the square of its cases."""

    def __init__(self):
        self.methods, self.counts = methods(), {}

    def __call__(self, r):
        case = tuple(r[f] for f in CASE_FIELDS)
        if case not in self.counts:
            self.counts[case] = method_row(r["level"], r["method"], self.methods).flops(r)
        return self.counts[case]


def finalize(result, beyond, flop_counts=None):
    """Extrapolated records, derived columns (FLOP/s, % of peak, GB/s, ratio to SDPA) and slopes, recomputed
    from the measured records each time, so a resumed run and a straight run give the same file. flop_counts: a
    FlopCounts kept across the calls of one run (None: a new one)."""
    meta = result["meta"]
    flop_counts = flop_counts or FlopCounts()
    records = [r for r in result["records"] if not r.get("extrapolated")]
    measured = {}
    for r in records:
        if "median_ms" in r:
            measured.setdefault(series_key(r), []).append(r)
    for c in beyond:
        src = measured.get(series_key(c))
        if src:
            src = max(src, key=lambda r: r["N"])
            grow = (c["N"] / src["N"]) ** 2  # x4 per doubling
            records.append(dict(c, key=case_key(c), median_ms=src["median_ms"] * grow, min_ms=src["min_ms"] * grow,
                                extrapolated=True, extrapolated_from_n=src["N"]))
    itemsize = torch.empty(0, dtype=getattr(torch, meta["dtype"])).element_size()
    index = {r["key"]: r for r in records}
    for r in records:
        if "median_ms" not in r:
            continue
        fwdbwd = r["pass"] == "fwdbwd"
        flops = flop_counts(r)
        if flops is not None:  # a registered method without a FLOP formula has no GFLOP/s
            r["flops"] = flops * (3 if fwdbwd else 1)
            r["gflops"] = r["flops"] / r["median_ms"] / 1e6
            r["pct_peak"] = 100.0 * r["gflops"] / meta["matmul_peak_gflops"]
            # The peak is a best run (measure.matmul_peak_gflops); a best run against it compares like with like,
            # where the median also carries the machine's noise (medians 1.2-1.3x the best on a shared VM).
            r["pct_peak_best"] = 100.0 * r["flops"] / r["min_ms"] / 1e6 / meta["matmul_peak_gflops"]
            if "round_peak_gflops" in r:  # the GEMM timed in the case's own rounds: median to median, best to best
                r["pct_round_peak"] = 100.0 * r["gflops"] / r["round_peak_gflops"]
                r["pct_round_peak_best"] = 100.0 * r["flops"] / r["min_ms"] / 1e6 / r["round_peak_best_gflops"]
        r["bytes"] = 4 * r["B"] * r["H"] * r["N"] * r["d"] * itemsize * (2 if fwdbwd else 1)
        r["gbps"] = r["bytes"] / r["median_ms"] / 1e6
        base = index.get(case_key(dict(r, method=BASELINE[r["level"]])))
        if base is not None and "median_ms" in base:
            r["ratio_vs_sdpa"] = base["median_ms"] / r["median_ms"]
            r["ratio_extrapolated"] = bool(base.get("extrapolated") or r.get("extrapolated"))
    set_against(records, meta.get("against"))
    records.sort(key=lambda r: (r["level"], r["B"], r["d"], r["causal"], r["pass"], r["method"], r["N"]))
    groups = {}
    for r in records:
        if "median_ms" in r and not r.get("extrapolated"):
            groups.setdefault(series_key(r), []).append(r)
    slopes = []
    for key, rs in groups.items():
        time_slope, time_n = _fit(rs, "median_ms", meta["slope_min_n"])
        mem_slope, mem_n = _fit(rs, "mem_extra_mib", meta["slope_min_n"])
        slopes.append(dict(zip(SERIES, key), time_slope=time_slope, time_fit_n=time_n, mem_slope=mem_slope,
                           mem_fit_n=mem_n))
    decode = result.get("decode") or []
    meta["decode_slope"] = M.loglog_slope([r["context"] for r in decode], [r["us_median"] for r in decode])
    return dict(result, records=records, slopes=slopes)


def set_against(records, against):
    """Each record's time over ``against``'s in the same rounds ("vs_against": the per-round ratios' median and
    quartiles, measure.paired_ratio) and their FLOPs' ratio ("flop_ratio"), for the cases timed in one group with
    it (the same round_group): a ratio of medians taken in other stretches of the run would carry the machine's
    drift between them, and a method's time over its FLOPs' ratio says how much of it the method's own work
    explains (hedgehog's 2m features and projections, taylor2's pairs)."""
    groups = {}
    for r in records:
        if r.get("round_group") and "round_ms" in r:
            groups.setdefault(r["round_group"], {})[r["method"]] = r
    for members in groups.values():
        base = members.get(against)
        for name, r in members.items():
            if base is None or name == against:
                continue
            r["vs_against"] = dict(method=against, **M.paired_ratio({name: r, against: base}, name, against))
            if r.get("flops") and base.get("flops"):
                r["flop_ratio"] = r["flops"] / base["flops"]


def _num(x, fmt):
    return "-" if x is None else format(x, fmt)


def _round_peak(r) -> str:
    if "round_peak_error" in r:
        return "error"
    if "pct_round_peak" not in r:
        return "-"
    return f"{r['pct_round_peak']:.1f} ({r['pct_round_peak_best']:.1f})"


def print_table(result):
    meta = result["meta"]
    print(f"\n{meta['device']} {meta.get('gpu', meta['cpu'])}, {meta['dtype']}, {meta['threads']} threads, "
          f"matmul peak {meta['matmul_peak_gflops']:.1f} GFLOP/s, H={meta['heads']}, causal chunk "
          f"{meta['chunk_size']}, compiled CPU code {'on' if meta.get('native_kernels') else 'off'}, allocator "
          f"{meta.get('allocator', NOT_RECORDED)}, output cache {meta.get('output_cache_mib', 0):.0f} MiB; "
          f"* = extrapolated x4 per doubling, ~ = ratio against an extrapolated time")
    print("| level | B | d | mask | pass | method | N | ms | min ms | GFLOP/s | % peak | % peak, min "
          "| % peak in its rounds (min) | GB/s | rel err | x SDPA | extra MiB |")
    print("|" + "---|" * 17)
    for r in result["records"]:
        head = (f"| {r['level']} | {r['B']} | {r['d']} | {'causal' if r['causal'] else 'full'} | {r['pass']} | "
                f"{r['method']} | {r['N']} | ")
        if "median_ms" not in r:
            print(head + f"error: {r.get('error')} |")
            continue
        star = "*" if r.get("extrapolated") else ""
        ratio = _num(r.get("ratio_vs_sdpa"), ".1f") + ("~" if r.get("ratio_extrapolated") else "")
        mem = _num(r.get("mem_extra_mib"), ".1f") if "mem_error" not in r else "error"
        print(head + f"{r['median_ms']:.3f}{star} | {r['min_ms']:.3f}{star} | {_num(r.get('gflops'), '.1f')} | "
              f"{_num(r.get('pct_peak'), '.1f')} | {_num(r.get('pct_peak_best'), '.1f')} | {_round_peak(r)} | "
              f"{r['gbps']:.2f} | "
              f"{_num(r.get('rel_err'), '.1e')} | {ratio} | {mem} |")
    print_pivot(result)
    print_against(result)
    print("\n| level | B | d | mask | pass | method | time slope (N range) | memory slope (N range) |")
    print("|" + "---|" * 8)
    for s in result["slopes"]:
        print(f"| {s['level']} | {s['B']} | {s['d']} | {'causal' if s['causal'] else 'full'} | {s['pass']} | "
              f"{s['method']} | {_num(s['time_slope'], '.2f')} {s['time_fit_n']} | {_num(s['mem_slope'], '.2f')} "
              f"{s['mem_fit_n'] or ''} |")
    print("\n| decode step (kernel_step, elu) | context | us median | us min | in place: us median | us min "
          "| samples' medians (in place) |")
    print("|---|---|---|---|---|---|---|")
    for r in result.get("decode", []):
        spread = "-"
        if "us_median_samples" in r:
            spread = " ".join(f"{x:.1f}" for x in r["us_median_samples"]) + " (" + " ".join(
                f"{x:.1f}" for x in r["us_median_inplace_samples"]) + ")"
        print(f"| B={r['B']} H={r['H']} d={r['d']} | {r['context']} | {r['us_median']:.1f} | {r['us_min']:.1f} | "
              f"{_num(r.get('us_median_inplace'), '.1f')} | {_num(r.get('us_min_inplace'), '.1f')} | {spread} |")
    print(f"decode time slope in context length: {_num(meta.get('decode_slope'), '.3f')} (0 = flat)")
    if result.get("not_run"):
        print("\n| not run: level | method | mask | why |")
        print("|---|---|---|---|")
        for r in result["not_run"]:
            print(f"| {r['level']} | {r['method']} | {r['mask']} | {r['why']} |")


def print_pivot(result):
    """The same numbers in one line per series: 'ms (x SDPA)' at every N, for reading and for the README."""
    ns = sorted({r["N"] for r in result["records"]})
    series = {}
    for r in result["records"]:
        if "median_ms" in r:
            star = "*" if r.get("extrapolated") else ""
            ratio = r.get("ratio_vs_sdpa")
            cell = f"{r['median_ms']:.4g}{star}" + ("" if ratio is None else f" ({ratio:.3g}x)")
            series.setdefault(series_key(r), {})[r["N"]] = cell
    print("\n| level | B | d | mask | pass | method | " + " | ".join(f"N={n}" for n in ns) + " |")
    print("|" + "---|" * (6 + len(ns)))
    for key, cells in series.items():
        level, method, b, _, d, causal, pss = key
        print(f"| {level} | {b} | {d} | {'causal' if causal else 'full'} | {pss} | {method} | "
              + " | ".join(cells.get(n, "") for n in ns) + " |")


def print_against(result):
    """Each method's time over the --against method's in the same rounds, beside its FLOPs' ratio."""
    rows = [r for r in result["records"] if "vs_against" in r]
    if not rows:
        return
    against = rows[0]["vs_against"]["method"]
    print(f"\n| level | B | d | mask | pass | method | N | time x {against}, per round: median (quartiles) "
          f"| FLOPs x {against} |")
    print("|" + "---|" * 9)
    for r in rows:
        v = r["vs_against"]
        print(f"| {r['level']} | {r['B']} | {r['d']} | {'causal' if r['causal'] else 'full'} | {r['pass']} | "
              f"{r['method']} | {r['N']} | {v['median']:.2f} ({v['q1']:.2f}-{v['q3']:.2f}) | "
              f"{_num(r.get('flop_ratio'), '.2f')} |")


def plot(result, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if "median_ms" in r]
    cols = sorted({(r["causal"], r["pass"]) for r in recs})
    panels = []  # (grid row, field): a memory panel only where memory was measured
    for row in sorted({(r["level"], r["B"], r["d"]) for r in recs}):
        of_row = [r for r in recs if (r["level"], r["B"], r["d"]) == row]
        panels += [(row, field) for field in ("median_ms", "mem_extra_mib") if any(r.get(field) for r in of_row)]
    fig, axes = plt.subplots(len(panels), len(cols), figsize=(4.5 * len(cols), 3.6 * len(panels)), squeeze=False)
    for (row, field), ax_row in zip(panels, axes):
        for col, ax in zip(cols, ax_row):
            sub = [r for r in recs if (r["level"], r["B"], r["d"]) == row and (r["causal"], r["pass"]) == col]
            for method in sorted({r["method"] for r in sub}):
                pts = sorted((r["N"], r[field], bool(r.get("extrapolated"))) for r in sub
                             if r["method"] == method and (r.get(field) or 0) > 0)
                measured, tail = [p for p in pts if not p[2]], [p for p in pts if p[2]]
                if measured:
                    line, = ax.loglog([p[0] for p in measured], [p[1] for p in measured], marker="o", label=method)
                    if tail:
                        ax.loglog([p[0] for p in measured[-1:] + tail], [p[1] for p in measured[-1:] + tail],
                                  linestyle="--", color=line.get_color())
            ax.set_title(f"{row[0]} B={row[1]} d={row[2]} {'causal' if col[0] else 'full'} {col[1]}", fontsize=9)
            ax.set_xlabel("N")
            ax.set_ylabel("time [ms] (dashed: extrapolated)" if field == "median_ms" else "extra memory [MiB]")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


