"""The fused Triton kernels (linear_mha/functional/triton_kernel.py) on a GPU: exactness against float64, then time
against the PyTorch path they would replace, SDPA's own choice and SDPA's flash kernel, in one run.

    python -m linear_mha.tools.triton_bench --json docs/results/cuda/triton_bench.json

Non-causal attention of the registry's presets whose method runs in the kernels (its ``triton_map``: kernel_elu,
taylor and its key_reweight and rope presets, focused, hedgehog; --methods chooses among them) on (B, H, N, d) tensors,
forward (no autograd) and forward + backward of a fixed random output gradient, medians of CUDA-event timings after
warm-up. Every method is called as modules run it (``attend_heads``), with the kernels switched on for every map and
then off (the path they replace); the exactness rows include the gradients of what a method learns (focused's
scale, hedgehog's maps), moved off their start. "bytes"
is what one forward must move at least (q, k, v read and the output written once); "x bw" is the forward's time over
that traffic at the device-to-device copy bandwidth measured in the same run. On CPU (tests) it runs under Triton's
interpreter (TRITON_INTERPRET=1) at tiny sizes.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from linear_mha.integrations.console import HelpFormatter
from linear_mha import TokenGrid
from linear_mha.attend import attend_heads
from linear_mha.functional import triton_kernel
from linear_mha.registry import create_method, method_presets

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def timer(device):
    """ms of fn(), median over repeats after warm-up: CUDA events on a GPU, the host clock elsewhere."""
    def run(fn, repeats, warmup=2):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return run


def relative_error(got, ref):
    return float((got.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())


def _configured(options):
    return create_method(options["mode"], {key: value for key, value in options.items() if key != "mode"})


METHODS = {name: options for name, options in method_presets().items() if _configured(options).triton_map}


def method(name, h, d, device):
    """(fn(q, k, v, key_padding_mask), learnable): a preset of METHODS as modules run it, and the tensors its method
    learns (focused's per-head scale, hedgehog's maps), moved off their start, whose gradients are compared too. A
    method with rotary position gets a grid of the sequence's length (self-attention)."""
    attention = _configured(METHODS[name])
    g = torch.Generator().manual_seed(2)
    state, learnable = {}, []
    for key, t in attention.init_state(h, d, {"device": None, "dtype": torch.float32}).items():
        if isinstance(t, nn.Parameter):
            t = (t.detach() + 0.1 * torch.randn(t.shape, generator=g)).to(device).requires_grad_()
            learnable.append(t)
        state[key] = None if t is None else t.to(device)

    def run(q, k, v, mask=None):
        n = q.shape[2]
        width = max(1, int(n ** 0.5))
        grid = TokenGrid(n // width, width, n % width) if attention.needs_grid else None
        own = {key: None if t is None else t.to(q.dtype) for key, t in state.items()}
        return attend_heads(attention, own, q, k, v, key_padding_mask=mask, token_grid=grid)[0]
    return run, learnable


def exactness(device, dtype, name, masked, shape=(2, 4, 300, 257, 64, 64)):
    """Relative errors of the Triton path's output and q, k, v and parameter gradients against float64 (which the
    chooser sends to PyTorch ops) on this device, and whether the Triton kernels ran. shape: B, H, L, S, D, Dv (S = L
    for a method that needs self-attention, as rotary position and key reweighting do)."""
    g = torch.Generator().manual_seed(0)
    b, h, l, s, d, dv = shape
    s = l if _configured(METHODS[name]).self_attention_only else s
    q, k, v = (torch.randn(b, n, h, w, generator=g).transpose(1, 2).to(device)
               for n, w in ((l, d), (s, d), (s, dv)))
    mask = (torch.rand(b, s, generator=g) < 0.3).to(device) if masked else None
    grad = torch.randn(b, h, l, dv, generator=g).to(device)
    fn, params = method(name, h, d, device)
    results = []
    with triton_kernel.switched(True, all_maps=True):
        for run_dtype in (dtype, torch.float64):
            leaves = [t.detach().to(run_dtype).requires_grad_() for t in (q.to(dtype), k.to(dtype), v.to(dtype))]
            for p in params:
                p.grad = None
            out = fn(*leaves, mask)
            out.backward(grad.to(run_dtype))
            results.append([out] + [t.grad for t in leaves] + [p.grad.clone() for p in params])
    errors = [relative_error(a, r) for a, r in zip(*results)]
    row = dict(zip(("out", "dq", "dk", "dv"), errors[:4]))
    row["dparams"] = max(errors[4:], default=0.0)
    row["triton"] = ran_in_the_kernels(results[0][0])
    return row


def ran_in_the_kernels(out):
    """Whether the kernels' Function made out, or anything out was computed from (key reweighting finishes the
    kernels' output in PyTorch ops)."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        if "TritonAttention" in type(fn).__name__:
            return True
        seen.add(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return False


def copy_bandwidth(device, timed):
    x = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), repeats=10)
    return 2 * x.numel() / (ms * 1e-3)  # bytes read and written per second


def timings(device, dtype, b, h, n, d, blocks, repeats, timed, name="kernel_elu", with_sdpa=True):
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(b, h, n, d, generator=g, device=device, dtype=dtype) for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=g, device=device, dtype=dtype)
    fn, _ = method(name, h, d, device)

    def forward_backward(variant):
        def run():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            variant(*leaves).backward(grad)
        return run

    variants = {"pytorch path": lambda *t: _with_block(None, t, fn, triton=False)}
    for block in blocks:
        variants[f"triton, {block}-row tiles"] = (lambda blk: lambda *t: _with_block(blk, t, fn))(block)
    if device.type == "cuda" and with_sdpa:
        variants["SDPA"] = lambda *t: F.scaled_dot_product_attention(*t)
        if dtype != torch.float32:
            variants["SDPA flash"] = lambda *t: _flash(*t)
    rows = []
    for variant, run in variants.items():
        try:
            with torch.no_grad():
                fwd = timed(lambda: run(q, k, v), repeats)
            fwdbwd = timed(forward_backward(run), repeats)
            rows.append(dict(variant=variant, fwd_ms=fwd, fwdbwd_ms=fwdbwd))
        except Exception as exc:  # a variant this device cannot run is a row saying so
            rows.append(dict(variant=variant, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
    return rows


def _with_block(block, tensors, fn, triton=True):
    """fn through the Triton kernels with this many rows per tile (the forward's choice is kept for its backward),
    every map taken; or, triton=False, through the path they replace."""
    previous_block, triton_kernel.BLOCK = triton_kernel.BLOCK, block
    try:
        with triton_kernel.switched(triton, all_maps=True):
            return fn(*tensors)
    finally:
        triton_kernel.BLOCK = previous_block


def _flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.triton_bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64], help="rows per tile to try")
    p.add_argument("--methods", nargs="+", default=["kernel_elu"], choices=list(METHODS), help="methods to time")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--exact-shape", type=int, nargs=6, default=[2, 4, 300, 257, 64, 64],
                   metavar=("B", "H", "L", "S", "D", "DV"), help="of the exactness checks")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu" and not triton_kernel.interpreted():
        raise SystemExit("linear_mha.tools.triton_bench: on CPU the kernels run only under TRITON_INTERPRET=1 (tiny sizes)")
    timed = timer(device)
    bandwidth = copy_bandwidth(device, timed)
    record = dict(command="python -m linear_mha.tools.triton_bench " + " ".join(argv), torch=torch.__version__,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                  copy_bandwidth_gbps=bandwidth / 1e9, exactness=[], timings=[])
    print(f"{record['device']}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    for dtype_name in a.dtypes:
        for name in METHODS:
            for masked in (False, True):
                errors = exactness(device, DTYPES[dtype_name], name, masked, a.exact_shape)
                record["exactness"].append(dict(dtype=dtype_name, method=name, masked=masked, **errors))
                print(f"exact {dtype_name:8s} {name:19s} masked={masked!s:5s} " +
                      " ".join(f"{key} {value:.1e}" for key, value in errors.items() if key != "triton") +
                      ("" if errors["triton"] else "  (NOT the Triton path)"), flush=True)
    print(f"{'method':19s} {'dtype':8s} {'N':>6s} {'variant':24s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'x bw':>6s}")
    for name, dtype_name, n in ((m, t, n) for m in a.methods for t in a.dtypes for n in a.n):
        dtype = DTYPES[dtype_name]
        moved = 4 * a.batch * a.heads * n * a.dim * torch.finfo(dtype).bits // 8
        # SDPA and its flash kernel are the same whatever the method: timed with the first one only
        rows = timings(device, dtype, a.batch, a.heads, n, a.dim, a.blocks, a.repeats, timed, name,
                       with_sdpa=name == a.methods[0])
        for row in rows:
            row.update(method=name, dtype=dtype_name, N=n, B=a.batch, H=a.heads, d=a.dim, bytes=moved)
            if "fwd_ms" in row:
                row["x_bandwidth_limit"] = row["fwd_ms"] / (moved / bandwidth * 1e3)
                print(f"{name:19s} {dtype_name:8s} {n:6d} {row['variant']:24s} {row['fwd_ms']:9.3f} "
                      f"{row['fwdbwd_ms']:11.3f} {row['x_bandwidth_limit']:6.1f}", flush=True)
            else:
                print(f"{name:19s} {dtype_name:8s} {n:6d} {row['variant']:24s} {row['error']}", flush=True)
            record["timings"].append(row)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
