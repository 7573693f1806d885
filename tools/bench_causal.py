"""Time the chunked causal linear product against causal softmax SDPA.

Forward runs under torch.inference_mode; forward+backward calls .backward() on the output with a
fixed random gradient. Both methods see the same (B, H, N, d) queries/keys; the linear product gets
values with Dv = d + 1 columns by default, because callers append a ones column for the denominator.

    python tools/bench_causal.py --threads 2 --n 256 1024 4096 16384 --json out.json --png out.png
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linear_mha.functional.causal import causal_linear_product  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[256, 1024, 4096, 16384], help="sequence lengths")
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256], help="chunk sizes to time")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64, help="head dim d (= Dk)")
    p.add_argument("--dv", type=int, default=None, help="value columns for the linear product (default d + 1)")
    p.add_argument("--sdpa-max-n", type=int, default=16384, help="skip SDPA above this length (quadratic)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point after one warm-up")
    p.add_argument("--modes", nargs="+", choices=["fwd", "fwdbwd"], default=["fwd", "fwdbwd"])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None, help="write all measurements here")
    p.add_argument("--png", type=Path, default=None, help="plot time vs N here (needs matplotlib)")
    return p.parse_args(argv)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, repeats, device):
    """(best, median) wall time in ms of fn() after one warm-up call.

    The best run is reported: on a shared machine other processes only ever add time.
    """
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def make_case(args, n, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(n)
    shape = (args.batch, args.heads, n, args.dim)
    dv = args.dv if args.dv is not None else args.dim + 1
    q = torch.randn(shape, generator=g).to(device, dtype)
    k = torch.randn(shape, generator=g).to(device, dtype)
    v = torch.randn(shape, generator=g).to(device, dtype)
    # Positive features, as a kernel feature map would give, keep the linear sums well scaled.
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    v_lin = torch.randn(args.batch, args.heads, n, dv, generator=g).to(device, dtype)
    return (q, k, v), (phi_q, phi_k, v_lin)


def bench_point(fn, inputs, mode, repeats, device):
    if mode == "fwd":
        def run():
            with torch.inference_mode():
                fn(*inputs)
        return time_call(run, repeats, device)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    grad = torch.randn_like(fn(*[t.detach() for t in inputs]))

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad)
    return time_call(run, repeats, device)


def run_benchmark(args):
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for n in args.n:
        softmax_in, linear_in = make_case(args, n, device, dtype)
        for mode in args.modes:
            sdpa_ms = None
            if n <= args.sdpa_max_n:
                sdpa_ms, sdpa_median = bench_point(
                    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    softmax_in, mode, args.repeats, device)
                rows.append(dict(method="sdpa_causal", chunk=None, mode=mode, n=n, ms=sdpa_ms,
                                 median_ms=sdpa_median, speedup=1.0))
                print_row(rows[-1])
            for chunk in args.chunks:
                ms, median = bench_point(lambda a, b, c, C=chunk: causal_linear_product(a, b, c, chunk_size=C),
                                         linear_in, mode, args.repeats, device)
                rows.append(dict(method="causal_linear", chunk=chunk, mode=mode, n=n, ms=ms, median_ms=median,
                                 speedup=None if sdpa_ms is None else sdpa_ms / ms))
                print_row(rows[-1])
    return rows


HEADER = f"{'mode':<7} {'N':>7} {'method':<14} {'chunk':>5} {'best ms':>10} {'median':>10} {'x SDPA':>8}"


def print_row(r):
    speed = "-" if r["speedup"] is None else f"{r['speedup']:.1f}"
    chunk = "-" if r["chunk"] is None else str(r["chunk"])
    print(f"{r['mode']:<7} {r['n']:>7} {r['method']:<14} {chunk:>5} {r['ms']:>10.2f} {r['median_ms']:>10.2f} "
          f"{speed:>8}", flush=True)


def summarize_best_chunk(rows, modes):
    """The chunk size with the lowest total time over all N, per mode."""
    best = {}
    for mode in modes:
        totals = {}
        for r in rows:
            if r["method"] == "causal_linear" and r["mode"] == mode:
                totals[r["chunk"]] = totals.get(r["chunk"], 0.0) + r["ms"]
        if totals:
            best[mode] = min(totals, key=totals.get)
    return best


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series = {}
        for r in rows:
            if r["mode"] == mode:
                label = "SDPA causal" if r["chunk"] is None else f"linear C={r['chunk']}"
                series.setdefault(label, []).append((r["n"], r["ms"]))
        for label, pts in series.items():
            xs, ys = zip(*sorted(pts))
            ax.loglog(xs, ys, marker="o", label=label)
        ax.set_title({"fwd": "forward (inference_mode)", "fwdbwd": "forward + backward"}[mode])
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("time [ms]")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    dv = args.dv if args.dv is not None else args.dim + 1
    print(f"torch {torch.__version__}, device {args.device}, dtype {args.dtype}, threads {args.threads}, "
          f"B={args.batch} H={args.heads} d={args.dim} Dv(linear)={dv}, best and median of {args.repeats}")
    print(HEADER)
    rows = run_benchmark(args)
    best = summarize_best_chunk(rows, args.modes)
    print("fastest chunk size over all N:", best)
    meta = dict(torch=torch.__version__, device=args.device, dtype=args.dtype, threads=args.threads,
                batch=args.batch, heads=args.heads, dim=args.dim, dv=dv, repeats=args.repeats, best_chunk=best)
    if args.json:
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
