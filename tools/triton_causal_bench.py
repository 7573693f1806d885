"""Causal kernel attention on a GPU: our Triton causal kernels (linear_mha/functional/triton_causal.py) against
flash-linear-attention's chunk kernel (when fla-core is installed), the PyTorch path they would replace, and causal
SDPA, in one run: exactness against float64, float16 at long N, then time. Then the same for our kernel of the
product with one decay per position (functional/triton_decayed.py: retention, a Mamba-2-style gate) against the
PyTorch chunked form it would replace, float32, its gate's gradient included.

    python -m linear_mha.tools.triton_causal_bench --json runs/cuda/triton_causal_bench.json

Exactness: ``functional.kernel(..., causal=True)`` with each map (elu, relu, taylor) and a key padding mask, output
and q, k, v gradients against float64, per path and dtype (fla: bfloat16 elu/relu only, as our chooser sends it).
Long N: float16 output finite at --long-n (the normaliser passes float16's largest value within a few thousand
positions). Timings: medians of CUDA-event times after warm-up, forward (no autograd) and forward + backward of a
fixed random output gradient, at every --n and --batch, for each --chunks size of ours. On CPU (tests) it runs under
Triton's interpreter (TRITON_INTERPRET=1) at tiny sizes.
"""
import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import linear_mha.functional as LF
from linear_mha.functional import backend, triton_causal, triton_kernel
from linear_mha.functional.gated_linear import gated_linear_attention
from linear_mha.integrations.console import HelpFormatter

from .triton_bench import DTYPES, relative_error, timer

MAPS = ("elu", "relu", "taylor")


@contextlib.contextmanager
def path(name, chunk=None):
    """Causal kernel attention through one path: "ours" (the Triton causal kernels, ``chunk`` positions per chunk),
    "fla", or "pytorch" (neither)."""
    previous_chunk, triton_causal.BLOCK_T = triton_causal.BLOCK_T, chunk
    previous = triton_causal.set_enabled(name == "ours")
    try:
        with backend.override(fla=name == "fla"):
            yield
    finally:
        triton_causal.set_enabled(previous)
        triton_causal.BLOCK_T = previous_chunk


def took_path(name, q, k, v, feature_map, chunk=None):
    """(whether the chooser sends this call where ``path(name)`` asks, the chooser's reason), asked inside it."""
    with path(name, chunk):
        choice = backend.kernel_backend(q, k, v, feature_map, causal=True)
    taken = {"ours": choice.backend == backend.TRITON, "fla": choice.backend == backend.FLA}.get(
        name, choice.backend not in (backend.TRITON, backend.FLA))
    return taken, choice.reason


def exactness(device, dtype, name, feature_map, shape):
    b, h, n, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, n, d, generator=g, device=device) for _ in range(4))
    mask = torch.rand(b, n, generator=g, device=device) < 0.2
    runs = []
    for run_dtype, run_path in ((dtype, name), (torch.float64, "pytorch")):
        leaves = [t.detach().to(run_dtype).requires_grad_() for t in (q, k, v)]
        taken, _ = took_path(run_path, *leaves, feature_map)
        with path(run_path):
            out = LF.kernel(*leaves, feature_map, causal=True, key_padding_mask=mask)
            out.backward(grad.to(run_dtype))
        runs.append((taken, out, [t.grad for t in leaves]))
    (taken, out, grads), (_, ref, ref_grads) = runs
    return dict(taken=taken, out=relative_error(out, ref),
                **{f"d{x}": relative_error(a, r) for x, a, r in zip("qkv", grads, ref_grads)})


def finite_at_long_n(device, n, d):
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(1, 1, n, d, generator=g, device=device, dtype=torch.float16) for _ in range(3))
    with torch.no_grad(), path("ours"):
        return bool(torch.isfinite(LF.kernel(q, k, v, "elu", causal=True)).all())


def timings(device, dtype, b, h, n, d, chunks, repeats, timed):
    g = torch.Generator(device=device).manual_seed(2)
    q, k, v, grad = (torch.randn(b, h, n, d, generator=g, device=device, dtype=dtype) for _ in range(4))
    variants = {f"ours, {c}-row chunks": ("ours", c) for c in chunks}
    variants.update({"fla": ("fla", None), "pytorch path": ("pytorch", None)})
    runners = {label: (lambda name, c: lambda *t: _through(name, t, c))(*how) for label, how in variants.items()}
    if device.type == "cuda":
        runners["SDPA causal"] = lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)
    rows = []
    for variant, run in runners.items():
        if variant in variants:  # a path the chooser may not take for these tensors: the row says why
            name, chunk = variants[variant]
            taken, reason = took_path(name, q, k, v, "elu", chunk)
            if not taken:
                rows.append(dict(variant=variant, error=reason))
                continue
        try:
            with torch.no_grad():
                fwd = timed(lambda: run(q, k, v), repeats)

            def forward_backward():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                run(*leaves).backward(grad)
            rows.append(dict(variant=variant, fwd_ms=fwd, fwdbwd_ms=timed(forward_backward, repeats)))
        except Exception as exc:  # a variant this device cannot run is a row saying so
            rows.append(dict(variant=variant, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
    return rows


def _through(name, tensors, chunk=None):
    with path(name, chunk):
        return LF.kernel(*tensors, "elu", causal=True)


def _decayed_inputs(device, b, h, n, d, seed=3):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, grad = (torch.randn(b, h, n, d, generator=g, device=device) for _ in range(4))
    log_gate = F.logsigmoid(torch.randn(b, h, n, 1, generator=g, device=device) + 3)  # data-dependent, ~0.95
    return q, F.normalize(k, dim=-1), v, log_gate, grad


def _decayed(name, tensors):
    with path(name), backend.override(native_kernels=False):  # CPU tensors (the interpreter) would go native
        return gated_linear_attention(*tensors)


def decayed_rows(device, shape, sizes, repeats, timed):
    """Exactness (output and the four gradients against float64, per path) at ``shape`` (B, H, N, D), then the
    forward and forward + backward time of each path at every (B, N) of ``sizes``; float32."""
    rows = []
    tensors = _decayed_inputs(device, *shape)
    want = [t.detach().double().requires_grad_() for t in tensors[:4]]
    gated_linear_attention(*want).backward(tensors[4].double())
    for name in ("ours", "pytorch"):
        with path(name), backend.override(native_kernels=False):
            taken = backend.decay_backend(*tensors[:4]).backend == backend.TRITON
        leaves = [t.detach().requires_grad_() for t in tensors[:4]]
        out = _decayed(name, leaves)
        out.backward(tensors[4])
        errors = {"out": relative_error(out, gated_linear_attention(*(t.detach() for t in want)))}
        errors.update({f"d{key}": relative_error(x.grad, ref.grad) for key, x, ref in zip("qkvg", leaves, want)})
        rows.append(dict(kind="exactness", path=name, taken=taken == (name == "ours"), **errors))
    for b, n in sizes:
        q, k, v, log_gate, grad = _decayed_inputs(device, b, shape[1], n, shape[3])
        for name in ("ours", "pytorch"):
            try:
                with torch.no_grad():
                    fwd = timed(lambda: _decayed(name, (q, k, v, log_gate)), repeats)

                def forward_backward():
                    _decayed(name, [t.detach().requires_grad_() for t in (q, k, v, log_gate)]).backward(grad)
                rows.append(dict(kind="timing", path=name, B=b, N=n, fwd_ms=fwd,
                                 fwdbwd_ms=timed(forward_backward, repeats)))
            except Exception as exc:  # a path this device cannot run is a row saying so
                rows.append(dict(kind="timing", path=name, B=b, N=n,
                                 error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.triton_causal_bench", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"], choices=list(DTYPES))
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 1])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 64], help="our positions per chunk to time")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--exact-shape", type=int, nargs=4, default=[2, 4, 1000, 64], metavar=("B", "H", "N", "D"))
    p.add_argument("--long-n", type=int, default=65536, help="float16 must stay finite at this N")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu" and not triton_kernel.interpreted():
        raise SystemExit("linear_mha.tools.triton_causal_bench: on CPU the kernels run only under TRITON_INTERPRET=1 "
                         "(tiny sizes)")
    timed = timer(device)
    record = dict(command="python -m linear_mha.tools.triton_causal_bench " + " ".join(argv), torch=torch.__version__,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                  exactness=[], timings=[])
    print(f"{record['device']}, torch {torch.__version__}", flush=True)
    for dtype_name in a.dtypes:
        for name in ("ours", "fla", "pytorch"):
            for feature_map in MAPS:
                errors = exactness(device, DTYPES[dtype_name], name, feature_map, a.exact_shape)
                record["exactness"].append(dict(dtype=dtype_name, path=name, map=feature_map, **errors))
                print(f"exact {dtype_name:8s} {name:7s} {feature_map:6s} " + " ".join(
                    f"{key} {value:.1e}" for key, value in errors.items() if key != "taken")
                    + ("" if errors["taken"] else "  (this call does not take that path here)"), flush=True)
    record["float16_finite_at_long_n"] = {"N": a.long_n, "finite": finite_at_long_n(device, a.long_n, a.dim)}
    print(f"float16 at N = {a.long_n}: {'finite' if record['float16_finite_at_long_n']['finite'] else 'NOT finite'}")
    print(f"{'dtype':8s} {'B':>3s} {'N':>6s} {'variant':22s} {'fwd ms':>9s} {'fwd+bwd ms':>11s}")
    for dtype_name, b, n in ((t, b, n) for t in a.dtypes for b in a.batch for n in a.n):
        for row in timings(device, DTYPES[dtype_name], b, a.heads, n, a.dim, a.chunks, a.repeats, timed):
            row.update(dtype=dtype_name, B=b, H=a.heads, N=n, d=a.dim)
            detail = (f"{row['fwd_ms']:9.3f} {row['fwdbwd_ms']:11.3f}" if "fwd_ms" in row else row["error"])
            print(f"{dtype_name:8s} {b:3d} {n:6d} {row['variant']:22s} {detail}", flush=True)
            record["timings"].append(row)
    record["decayed"] = decayed_rows(device, [a.exact_shape[0], a.heads, a.exact_shape[2], a.dim],
                                     [(b, n) for b in a.batch for n in a.n], a.repeats, timed)
    for row in record["decayed"]:
        detail = (" ".join(f"{key} {row[key]:.1e}" for key in ("out", "dq", "dk", "dv", "dg"))
                  + ("" if row["taken"] else "  (not the path asked for)") if row["kind"] == "exactness"
                  else f"B {row['B']} N {row['N']}: " + (f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f}"
                                                          f" ms" if "fwd_ms" in row else row["error"]))
        print(f"decayed {row['kind']:10s} {row['path']:7s} {detail}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {a.json}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
