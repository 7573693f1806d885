"""Two builds of the compiled CPU code timed in one process: another checkout's csrc/ against this one's.

On a shared machine the speed of a run drifts by 10-25% from one process to the next, more than most kernel
changes gain, so before/after tables from separate runs mostly measure the machine. Here the other checkout's
library is built with its own build rules (its native_build.py), loaded beside this one's, and both are called
through this checkout's Python wrappers on the same inputs, interleaved round by round (measure.round_robin).
The entry points' C signatures must agree between the two checkouts.

    git worktree add /tmp/before <commit>
    python -m linear_mha.tools.ab_builds --before /tmp/before --methods kernel_elu taylor --json runs/ab.json

Besides the benchmark's core methods, --methods takes ``output_gate`` and ``local_term``: the modules' compiled
output gate, or their 3 x 3 local term on a square token grid, alone, on an attention output and the queries or
values laid out as a module's (views of its projections), forward and backward.
``--layout module`` hands the core methods q, k and v as a module's self-attention does, views of one (B, N, 3 H d)
projection (split_heads), where the benchmark's core level makes them contiguous (B, H, N, d) tensors.
``--level module`` times the benchmark's module rows instead (LinearMultiheadAttention, projections included:
``kernel_elu``, ``taylor+dwc3``, ``taylor+gate`` ...), where what a kernel change gains is set against the whole
module's time.
"""
import argparse
import importlib.util
import json
import math
import subprocess
from pathlib import Path

import torch

from linear_mha.functional import native, native_library, native_maps, output_cache
from linear_mha.functional.packed_heads import split_heads
from linear_mha.tools import measure
from linear_mha.tools.benchmark_cases import build_runner, methods

CASES = {"fwd": (False, "fwd"), "fwdbwd": (False, "fwdbwd"), "causal_fwd": (True, "fwd"),
         "causal_fwdbwd": (True, "fwdbwd")}


def load_build(checkout: Path):
    """The compiled library of another checkout, built by that checkout's own build module. Declaring it attaches
    the output cache to it (native_library._declare); the caller attaches the cache back to its own library, whose cache
    then serves both builds' outputs alike."""
    path = checkout / "linear_mha" / "functional" / "native_build.py"
    if not path.is_file():
        raise SystemExit(f"--before {checkout}: no linear_mha/functional/native_build.py there")
    spec = importlib.util.spec_from_file_location("before_native_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    library, _ = module.build()
    try:
        native_library._declare(library)
    except AttributeError as exc:  # an entry point this checkout's wrappers call is missing there
        raise SystemExit(f"--before {checkout}: its compiled code lacks an entry point this checkout calls ({exc}); "
                         f"the two checkouts' C interfaces must agree") from None
    return library


GATE = "output_gate"


def gate_runner(c, device, dtype):
    """A zero-argument callable running the compiled output gate once (native_maps.output_gate), as a module runs
    it: q a view of a (B, N, 3, H, d) projection, the attention output (B, N, H, d) seen as (B, H, N, d); forward
    in place under inference_mode, or forward and backward into out, q, W and b."""
    g = torch.Generator().manual_seed(c["seed"])
    b, h, n, d = c["B"], c["H"], c["N"], c["d"]
    q = torch.randn(b, n, 3, h, d, generator=g, dtype=dtype)[:, :, 0].transpose(1, 2).to(device)
    out = torch.randn(b, n, h, d, generator=g, dtype=dtype).transpose(1, 2).to(device)
    # small logits: the in-place forward multiplies out by 2 sigmoid(z) call after call, which must not drift
    weight = (torch.randn(h, d, d, generator=g, dtype=dtype) * 0.01 * d ** -0.5).to(device)
    bias = torch.zeros(h, 1, d, dtype=dtype, device=device)
    grad = torch.randn(b, h, n, d, generator=g, dtype=dtype).to(device)
    if c["pass"] == "fwd":
        def forward():
            with torch.inference_mode():
                native_maps.output_gate(out, q, weight, bias, inplace=True)
        return forward
    leaves = [t.detach().requires_grad_() for t in (out, q, weight, bias)]

    def forward_backward():
        native_maps.output_gate(*leaves).backward(grad)
        for t in leaves:
            t.grad = None
    return forward_backward


LOCAL = "local_term"


def local_term_runner(c, device, dtype):
    """A zero-argument callable running the compiled 3 x 3 local term once (native_maps.local_term) on a square
    grid of N tokens, as a module runs it: v a view of a (B, N, 3, H, d) projection, the attention output (B, N, H,
    d) seen as (B, H, N, d); forward in place under inference_mode, or forward and backward into v, the weight and
    the bias (the output's gradient is the incoming one itself, which a module hands on to the attention)."""
    side = math.isqrt(c["N"])
    if side * side != c["N"]:
        raise SystemExit(f"--n {c['N']}: the local term runs on a square token grid; give a square N")
    g = torch.Generator().manual_seed(c["seed"])
    b, h, n, d = c["B"], c["H"], c["N"], c["d"]
    v = torch.randn(b, n, 3, h, d, generator=g, dtype=dtype)[:, :, 2].transpose(1, 2).to(device)
    out = torch.randn(b, n, h, d, generator=g, dtype=dtype).transpose(1, 2).to(device)
    weight = (torch.randn(h * d, 1, 3, 3, generator=g, dtype=dtype) * 0.01).to(device)
    bias = torch.zeros(h * d, dtype=dtype, device=device)
    grad = torch.randn(b, n, h, d, generator=g, dtype=dtype).transpose(1, 2).to(device)
    if c["pass"] == "fwd":
        def forward():
            with torch.inference_mode():
                native_maps.local_term(out, v, weight, bias, side, side, 0, None, inplace=True)
        return forward
    leaves = [t.detach().requires_grad_() for t in (v, weight, bias)]

    def forward_backward():  # autograd.grad: no copy of each gradient into a leaf's .grad, which a module has not
        torch.autograd.grad(native_maps.local_term(out, *leaves, side, side, 0, None), leaves, grad)
    return forward_backward


def module_runner(c, device, dtype):
    """build_runner's case with q, k, v as a module's self-attention hands them to the method: split_heads of one
    (B, N, 3 H d) projection, (B, H, N, d) views with a position's heads side by side and positions 3 H d floats
    apart. With the backward pass, split each call, as a module does, and the gradients freed after it."""
    g = torch.Generator().manual_seed(c["seed"])
    packed = torch.randn(c["B"], c["N"], 3 * c["H"] * c["d"], generator=g, dtype=dtype).to(device)
    if c["pass"] == "fwd":
        return build_runner(c, device, dtype, data=(split_heads(packed, 3, c["H"]), None))
    grad = torch.randn(c["B"], c["H"], c["N"], c["d"], generator=g, dtype=dtype).to(device)
    packed.requires_grad_()
    return build_runner(c, device, dtype, data=(lambda: split_heads(packed, 3, c["H"]), grad), leaves=(packed,))


def compare(before, after, method: str, case: str, n: int, heads: int, dim: int, repeats: int,
            layout: str = "contiguous", level: str = "core") -> dict:
    causal, which = CASES[case]
    c = dict(level=level, method=method, B=1, H=heads, d=dim, N=n, causal=causal, proj_k=256, seed=0,
             **{"pass": which})
    if level == "module":
        runner = build_runner
    else:
        runner = {GATE: gate_runner, LOCAL: local_term_runner}.get(method) or \
            (module_runner if layout == "module" else build_runner)
    run = runner(c, "cpu", torch.float32)

    def with_library(library):
        def call():
            native_library._library = library
            run()
        return call
    try:
        times = measure.round_robin({"before": with_library(before), "after": with_library(after)},
                                    repeats=repeats, warmup=2)
    finally:
        native_library._library = after
    row = dict(method=method, case=case, level=level, layout=layout, N=n, H=heads, d=dim,
               **{f"{k}_{s}": v[s] for k, v in times.items() for s in ("median_ms", "min_ms")})
    row["gain"] = row["before_median_ms"] / row["after_median_ms"]
    paired = measure.paired_ratio(times, "before", "after")  # round by round: the drift between rounds cancels
    row.update(gain_paired=paired["median"], gain_q1=paired["q1"], gain_q3=paired["q3"])
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--methods", nargs="+", default=["kernel_elu"])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30, help="calls of each build (interleaved)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layout", choices=["contiguous", "module"], default="contiguous",
                   help="q, k, v of the core methods: contiguous (the benchmark's) or a module's projection views")
    p.add_argument("--level", choices=["core", "module"], default="core",
                   help="core: the attention function (and the options' kernels alone); module: the benchmark's "
                        "LinearMultiheadAttention rows, projections included")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.level == "module" and a.layout != "contiguous":
        p.error("--layout sets how the core level hands q, k and v over; a module makes its own from its projection")
    known = sorted(m for level, m in methods() if level == a.level) + ([GATE, LOCAL] if a.level == "core" else [])
    unknown = [m for m in a.methods if m not in known]
    if unknown:
        raise SystemExit(f"--methods {' '.join(unknown)}: not a {a.level}-level method of the benchmark "
                         f"({', '.join(known)})")
    if not native.available():
        raise SystemExit(f"this checkout's compiled code is unavailable: {native.build_error()}")
    after, threads = native_library._library, torch.get_num_threads()
    try:
        before = load_build(a.before)
    finally:
        output_cache.attach(after)
    try:
        torch.set_num_threads(a.threads)
        rows = _run(a, before, after)
    finally:
        native_library._library = after
        torch.set_num_threads(threads)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(before=str(a.before), before_commit=_commit(a.before), after_commit=_commit(Path(__file__).parent),
                    before_library=before._name, after_library=after._name,
                    torch=torch.__version__, threads=a.threads, cpu=measure.cpu_name(), repeats=a.repeats,
                    n=a.n, heads=a.heads, dim=a.dim, layout=a.layout, level=a.level)
        a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {a.json}")
    return rows


def _run(a, before, after) -> list:
    print(f"before: {before._name}\nafter:  {after._name}\ntorch {torch.__version__}, {a.threads} threads, "
          f"B=1 H={a.heads} d={a.dim} N={a.n}, {a.level} level, {a.layout} layout, {a.repeats} calls each, "
          f"interleaved")
    print("| method | pass | before ms (min) | after ms (min) | before / after: medians | per round: median "
          "(quartiles) |\n|---|---|---|---|---|---|")
    rows = []
    for method in a.methods:
        for case in a.cases:
            if CASES[case][0] and not _has_causal(method, a.level):
                print(f"| {method} | {case} | - | - | no causal form | - |")
                continue
            r = compare(before, after, method, case, a.n, a.heads, a.dim, a.repeats, a.layout, a.level)
            rows.append(r)
            print(f"| {method} | {case} | {r['before_median_ms']:.2f} ({r['before_min_ms']:.2f}) | "
                  f"{r['after_median_ms']:.2f} ({r['after_min_ms']:.2f}) | {r['gain']:.3f} | "
                  f"{r['gain_paired']:.3f} ({r['gain_q1']:.3f}–{r['gain_q3']:.3f}) |", flush=True)
    return rows


def _has_causal(method: str, level: str = "core") -> bool:
    return method not in (GATE, LOCAL) and methods()[(level, method)].causal


def _commit(path: Path):
    """The checkout's commit, with '+' where its tree has changes, or None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


if __name__ == "__main__":
    main()
