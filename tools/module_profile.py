"""Where a LinearMultiheadAttention's time goes: torch.profiler over forward + backward (or forward alone) of
self-attention at one size, the ops' own CPU time per step, one column per module variant.

    python -m linear_mha.tools.module_profile --n 16384 --variants kernel kernel+gate taylor+dwc3 --json runs/profile.json

A variant is a mode, optionally with module options: "+gate" (output_gate=True), "+dwc3" (dwc_kernel=3, on a square
token grid). Rows are profiler op names (the compiled kernels show as their autograd Functions, e.g.
_KernelAttention and _KernelAttentionBackward); ops under --min-ms in every variant are summed into "other". The
profile adds overhead of its own, so compare the columns, and time with tools.benchmark.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

from linear_mha import LinearMultiheadAttention

from .benchmark import HelpFormatter


def build(variant: str, embed_dim: int, heads: int, n: int):
    mode, *options = variant.split("+")
    kwargs = {}
    for option in options:
        if option == "gate":
            kwargs["output_gate"] = True
        elif option.startswith("dwc"):
            kwargs["dwc_kernel"] = int(option[3:])
        else:
            raise SystemExit(f"linear_mha.tools.module_profile: unknown option {option!r} in {variant!r} (gate, dwc<k>)")
    module = LinearMultiheadAttention(embed_dim, heads, mode=mode, batch_first=True, **kwargs)
    if "output_gate" in kwargs:
        with torch.no_grad():  # a trained gate, not the identity it starts as
            module.gate_weight.normal_(0.0, 0.1)
    side = math.isqrt(n)
    grid = None
    if "dwc_kernel" in kwargs:
        if side * side != n:
            raise SystemExit(f"linear_mha.tools.module_profile: dwc variants need a square token grid; {n} is not a square")
        from linear_mha.token_grid import TokenGrid
        grid = TokenGrid(side, side)
    return module, grid


def profile_variant(variant, embed_dim, heads, n, steps, backward):
    """{op name: own CPU ms per step} for one variant."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    module, grid = build(variant, embed_dim, heads, n)
    x = torch.randn(1, n, embed_dim, requires_grad=backward)

    def step():
        with torch.set_grad_enabled(backward):
            out, _ = module(x, x, x, need_weights=False, token_grid=grid)
            if backward:
                out.sum().backward()

    step()  # warm-up: builds the compiled code, faults the allocator in
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.module_profile", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--variants", nargs="+", default=["kernel", "kernel+gate"])
    p.add_argument("--n", type=int, default=16384, help="tokens")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per variant, after one warm-up")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's current)")
    p.add_argument("--min-ms", type=float, default=2.0, help="rows below this in every variant go into 'other'")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    columns = {}
    for variant in a.variants:
        print(f"profiling {variant} ...", file=sys.stderr, flush=True)
        columns[variant] = profile_variant(variant, a.embed_dim, a.heads, a.n, a.steps, not a.forward_only)
    def most(name):
        return max(c.get(name, 0.0) for c in columns.values())

    shown = [k for k in sorted({k for c in columns.values() for k in c}, key=most, reverse=True) if most(k) >= a.min_ms]
    passes = "forward" if a.forward_only else "forward + backward"
    print(f"own CPU ms per step, {passes}, {a.n} tokens of {a.embed_dim}, {a.heads} heads, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| op | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name in shown:
        print(f"| {name} | " + " | ".join(f"{c.get(name, 0.0):.1f}" for c in columns.values()) + " |")
    other = {v: sum(ms for k, ms in c.items() if k not in shown) for v, c in columns.items()}
    print("| other | " + " | ".join(f"{ms:.1f}" for ms in other.values()) + " |")
    print("| total | " + " | ".join(f"{sum(c.values()):.1f}" for c in columns.values()) + " |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        command = "python -m linear_mha.tools.module_profile " + " ".join(sys.argv[1:] if argv is None else argv)
        a.json.write_text(json.dumps(dict(command=command, torch=torch.__version__, threads=torch.get_num_threads(),
                                          n=a.n, embed_dim=a.embed_dim, heads=a.heads, backward=not a.forward_only,
                                          ms_per_step=columns), indent=1))
        print(f"wrote {a.json}", file=sys.stderr)
    return columns


if __name__ == "__main__":
    main()
