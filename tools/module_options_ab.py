"""What the accuracy work's module options cost: LinearMultiheadAttention with the output gate or the 3 x 3 local
term against the same module without them, timed interleaved in one process (issue 33 asks that they add no
more than a few percent).

The benchmark's module rows (``kernel_elu+gate`` and so on) time each method in its own stretch of the run, and
on a machine whose speed drifts 10-25% between stretches their ratios mostly measure the machine. Here each
option's module and the plain one run round by round (``measure.round_robin``), projections included, and each
option's time is also set against the plain module's of the same round (``measure.paired_ratio``: the median of
those ratios, and their quartiles).

    python -m linear_mha.tools.module_options_ab --methods taylor kernel_elu --repeats 9 --json runs/options.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter
from linear_mha.tools import measure
from linear_mha.tools.benchmark_cases import MODULE_OPTION_ROWS, build_runner, methods

PASSES = (("full", False, "fwd"), ("full", False, "fwdbwd"), ("causal", True, "fwd"), ("causal", True, "fwdbwd"))


def compare(method: str, causal: bool, which: str, n: int, heads: int, dim: int, repeats: int) -> list:
    """Rows (the plain method first) for one pass: median and best ms, and each option's time over the plain one's."""
    known = methods()
    names = [method] + [f"{method}+{suffix}" for suffix, (_, has_causal, _) in MODULE_OPTION_ROWS.items()
                        if (not causal or has_causal) and ("module", f"{method}+{suffix}") in known]
    runs = {}
    for name in names:
        case = dict(level="module", method=name, B=1, H=heads, d=dim, N=n, causal=causal, proj_k=256, seed=0,
                    **{"pass": which})
        runs[name] = build_runner(case, "cpu", torch.float32)
    times = measure.round_robin(runs, repeats=repeats, warmup=1)
    plain = times[method]["median_ms"]
    rows = []
    for name in names:
        paired = measure.paired_ratio(times, name, method)
        rows.append(dict(method=name, causal=causal, pass_=which, median_ms=times[name]["median_ms"],
                         min_ms=times[name]["min_ms"], vs_plain=times[name]["median_ms"] / plain,
                         vs_plain_paired=paired["median"], vs_plain_q1=paired["q1"], vs_plain_q3=paired["q3"],
                         round_ms=times[name]["round_ms"]))
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.module_options_ab", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--methods", nargs="+", default=["taylor", "kernel_elu"],
                   help="methods with module option rows (tools.benchmark_cases.module_option_methods)")
    p.add_argument("--n", type=int, default=16384, help="tokens")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64, help="head dim (the module's width is heads x dim)")
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each module, interleaved")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    known = methods()
    for method in a.methods:
        if not any(("module", f"{method}+{suffix}") in known for suffix in MODULE_OPTION_ROWS):
            p.error(f"--methods: {method!r} has no module option rows; those with them: "
                    f"{sorted({m.split('+')[0] for (level, m) in known if level == 'module' and '+' in m})}")
    threads = measure.pin_threads(a.threads)
    print(f"torch {torch.__version__}, {measure.cpu_name()}, {threads} threads, B=1 x {a.n} tokens, "
          f"{a.heads} heads of {a.dim}, {a.repeats} calls each, interleaved")
    print("| module | mask | pass | median ms (best) | over the plain module: medians | per round: median "
          "(quartiles) |\n|---|---|---|---|---|---|")
    rows = []
    for method in a.methods:
        for mask, causal, which in PASSES:
            for row in compare(method, causal, which, a.n, a.heads, a.dim, a.repeats):
                rows.append(row)
                print(f"| {row['method']} | {mask} | {which} | {row['median_ms']:.1f} ({row['min_ms']:.1f}) | "
                      f"{row['vs_plain']:.3f}× | {row['vs_plain_paired']:.3f}× ({row['vs_plain_q1']:.3f}–"
                      f"{row['vs_plain_q3']:.3f}) |", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(command="python -m linear_mha.tools.module_options_ab " + " ".join(argv), torch=torch.__version__,
                    cpu=measure.cpu_name(), threads=threads, n=a.n, heads=a.heads, dim=a.dim, repeats=a.repeats)
        a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {a.json}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
