"""The fused Triton kernels (linear_mha/functional/triton_kernel.py), run on CPU tensors by Triton's interpreter:
outputs and gradients against float64 kernel attention, key padding exact (masked keys reach no output and no
gradient, a batch element with every key masked gives 0), odd lengths and head sizes, strided and half inputs, and
the chooser sending calls there only when switched on."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import backend, triton_kernel


def _interpreter_runs_on_cpu_tensors():
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
# (torch.compile) imports it first: the tests below run in a process of their own that starts with the interpreter
# on (test_the_kernels_under_the_interpreter), and are skipped in the suite's own process.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETED, reason="run by test_the_kernels_under_the_interpreter in a process "
                                                   "that starts with TRITON_INTERPRET=1")


@pytest.mark.skipif(INTERPRETED, reason="this is the process it starts")
def test_the_kernels_under_the_interpreter():
    if not _interpreter_runs_on_cpu_tensors():
        pytest.skip("no triton, or its interpreter does not run kernels on CPU tensors (triton 3.1's)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20 and "failed" not in summary, summary  # the kernels' tests all ran


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


@inside
@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor"])
@pytest.mark.parametrize("shape", [(2, 3, 37, 45, 8, 5), (1, 2, 16, 16, 16, 16), (1, 1, 3, 70, 20, 33)], ids=str)
@pytest.mark.parametrize("masked", [False, True])
def test_outputs_and_gradients_match_float64(feature_map, shape, masked):
    q, k, v, g = inputs(*shape, seed=sum(shape))
    b, s = shape[0], shape[3]
    mask = torch.rand(b, s, generator=g) < 0.3 if masked else None
    grad = torch.randn(*shape[:3], shape[5], generator=g)

    def run(dtype, fn):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, feature_map, key_padding_mask=mask)
        out.backward(grad.to(dtype))
        return out, [t.grad for t in leaves]

    out, got = run(torch.float32, triton_kernel.kernel_attention)
    assert "TritonKernelAttention" in type(out.grad_fn).__name__
    ref, expected = run(torch.float64, LF.kernel)
    assert relative_error(out, ref) < 2e-6
    for name, a, r in zip("qkv", got, expected):
        assert relative_error(a, r) < 1e-5, name
    if masked:
        gone = mask[:, None, :, None]
        assert (got[1].masked_select(gone) == 0).all() and (got[2].masked_select(gone) == 0).all()


@inside
def test_masked_keys_reach_nothing_and_an_all_masked_row_gives_zero():
    q, k, v, g = inputs(seed=3)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[0, 30:] = True
    mask[1] = True  # every key of batch element 1 is padding
    out = triton_kernel.kernel_attention(q, k, v, "elu", key_padding_mask=mask)
    junk = k.clone(), v.clone()
    junk[0][0, :, 30:], junk[1][0, :, 30:] = 1e4, float("nan")
    junk[0][1], junk[1][1] = 1e4, float("nan")
    again = triton_kernel.kernel_attention(q, *junk, "elu", key_padding_mask=mask)
    torch.testing.assert_close(again, out)
    assert (out[1] == 0).all()


@inside
def test_half_inputs_accumulate_in_float32():
    q, k, v, _ = inputs(seed=4)
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in (q, k, v)]
        out = triton_kernel.kernel_attention(*low, "elu")
        ref = LF.kernel(*(t.double() for t in low), "elu")
        assert out.dtype == dtype and relative_error(out, ref) < 2e-2


@inside
def test_the_chooser_sends_calls_there_unless_switched_off():
    """On by default (LINEAR_MHA_TRITON=0 switches it off) for non-causal elu/relu calls the kernels can run: here CPU
    tensors under the interpreter stand in for CUDA ones."""
    q, k, v, _ = inputs(seed=5)
    assert triton_kernel.enabled() == (os.environ.get("LINEAR_MHA_TRITON", "1") != "0")
    previous = triton_kernel.set_enabled(True)
    try:
        chosen = backend.kernel_backend(q, k, v, "elu", causal=False)
        assert chosen.backend == backend.TRITON
        assert backend.kernel_backend(q, k, v, "elu", causal=True).backend != backend.TRITON
        assert backend.kernel_backend(q, k, v, "taylor", causal=False).backend == backend.TRITON  # interpreted
        assert backend.kernel_backend(q, k, v, "taylor2", causal=False).backend != backend.TRITON
        out = LF.kernel(q, k, v, "elu")
        triton_kernel.set_enabled(False)
        assert backend.kernel_backend(q, k, v, "elu", causal=False).backend != backend.TRITON
        composed = LF.kernel(q, k, v, "elu")
    finally:
        triton_kernel.set_enabled(previous)
    torch.testing.assert_close(out, composed, rtol=1e-5, atol=1e-6)
    assert "taylor2" in triton_kernel.why_not(q, k, v, "taylor2", None)


@inside
def test_the_gpu_benchmark_checks_exactness_and_writes_its_table(tmp_path):
    """tools.triton_bench at a tiny size on CPU (the interpreter): every exactness row within float32 rounding, a
    timing row for the PyTorch path and the Triton kernels, and the JSON written."""
    import json

    from tools import triton_bench
    triton_bench.main(["--device", "cpu", "--n", "32", "--batch", "1", "--heads", "2", "--dim", "16", "--blocks",
                       "16", "--repeats", "1", "--dtypes", "float32", "--json", str(tmp_path / "r.json")])
    record = json.loads((tmp_path / "r.json").read_text())
    assert len(record["exactness"]) == 2 * len(triton_kernel.MAPS)
    assert all(max(row[key] for key in ("out", "dq", "dk", "dv")) < 1e-5 for row in record["exactness"])
    assert [row["variant"] for row in record["timings"]] == ["pytorch path", "triton, 16-row tiles"]
    assert all(row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 for row in record["timings"])


@inside
def test_a_map_not_yet_run_on_a_gpu_waits_for_all(monkeypatch):
    """taylor's kernel has run only under the interpreter: off the interpreter the chooser takes it only with
    LINEAR_MHA_TRITON=all (set_enabled(True, all_maps=True)), and says so."""
    q, k, v, _ = inputs(seed=6)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    previous = triton_kernel.set_enabled(True)
    try:
        assert "LINEAR_MHA_TRITON=all" in triton_kernel.why_not(q, k, v, "taylor", None)
        triton_kernel.set_enabled(True, all_maps=True)
        assert "CUDA" in triton_kernel.why_not(q, k, v, "taylor", None)  # CPU tensors: only the device is left
    finally:
        triton_kernel.set_enabled(previous, all_maps=os.environ.get("LINEAR_MHA_TRITON") == "all")
