"""Helpers of the fused Triton kernels' tests (test_triton_kernels.py: the kernels and their choosers;
test_triton_methods.py: the registry's methods through them), run on CPU tensors by Triton's interpreter: which
tests run there, their inputs, and float32 through the kernels against float64."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from linear_mha.functional import triton_kernel
from linear_mha.tools.triton_bench import ran_in_the_kernels


def interpreter_runs_on_cpu_tensors():
    """Whether this triton's interpreter writes its results back into CPU tensors (3.1's, which torch 2.5 brings,
    leaves them untouched); probed in a fresh process, where the interpreter is switched on before import."""
    if not triton_kernel.HAS_TRITON:
        return False
    probe = textwrap.dedent("""
        import torch, triton, triton.language as tl
        @triton.jit
        def double(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)
        x = torch.ones(5)
        double[(1,)](x, 5, BLOCK=8)
        raise SystemExit(0 if bool((x == 2).all()) else 1)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


# Triton fixes compiled or interpreted when it is first imported in a process, and in the suite something else
# (torch.compile) imports it first: the tests marked ``inside`` run in a process of their own that starts with the
# interpreter on (test_triton_kernels.py's test_the_kernels_under_the_interpreter runs every file of FILES there),
# and are skipped in the suite's own process.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETED, reason="run by test_the_kernels_under_the_interpreter in a process "
                                                   "that starts with TRITON_INTERPRET=1")
FILES = ("test_triton_kernels.py", "test_triton_methods.py", "test_triton_causal.py", "test_triton_decayed.py")


def relative_error(got, ref):
    got, ref = got.detach(), ref.detach()
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def inputs(b=2, h=3, l=37, s=45, d=8, dv=5, seed=0):
    """(B, H, N, D) views of (B, N, H, D) tensors, as a module's projections give them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, l, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, s, h, d, generator=g).transpose(1, 2)
    v = torch.randn(b, s, h, dv, generator=g).transpose(1, 2)
    return q, k, v, g


def compare(fn, tensors, grad, tolerance=1e-5):
    """fn on float32 copies of tensors (through the Triton kernels) against float64 (the chooser sends float64 to
    PyTorch ops): output and every tensor's gradient; returns the float32 gradients."""
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        runs.append((out, [t.grad for t in leaves]))
    (out, got), (ref, expected) = runs
    assert ran_in_the_kernels(out)
    assert relative_error(out, ref) < 2e-6
    for i, (a, r) in enumerate(zip(got, expected)):
        assert relative_error(a, r) < tolerance, f"gradient of input {i}"
    return got


def learned_maps(h, d, m, bias, seed):
    g = torch.Generator().manual_seed(seed)
    maps = []
    for _ in "qk":
        maps += [torch.eye(d, m).repeat(h, 1, 1) + 0.3 * torch.randn(h, d, m, generator=g),
                 0.3 * torch.randn(h, m, generator=g) if bias else None]
    return maps
