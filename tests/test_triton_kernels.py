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
import torch.autograd.forward_ad as fwAD

import linear_mha.functional as LF
from linear_mha.functional import backend, triton_kernel
from linear_mha.functional.focused import FocusedMap
from triton_checks import (FILES, INTERPRETED, compare, inputs, inside, interpreter_runs_on_cpu_tensors,
                           learned_maps, relative_error)


@pytest.mark.skipif(INTERPRETED, reason="this is the process it starts")
def test_the_kernels_under_the_interpreter():
    if not interpreter_runs_on_cpu_tensors():
        pytest.skip("no triton, or its interpreter does not run kernels on CPU tensors (triton 3.1's)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = os.path.dirname(__file__)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(os.path.join(here, name) for name in FILES)], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(here))
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20 and "failed" not in summary, summary  # the kernels' tests all ran


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's functions are not JITFunctions; the suite's process checks")
def test_the_kernels_read_no_plain_module_globals():
    """Compiled, a @triton.jit function may read a module global only if it is a tl.constexpr (or a function or
    module); the interpreter reads a plain int as well, so the tests below cannot see it. A plain global made every
    map fail to compile on an H100 while all of them passed here."""
    triton = pytest.importorskip("triton")
    import ast
    import types

    import triton.language as tl
    from linear_mha.functional import triton_causal_jit, triton_jit, triton_maps_jit
    allowed = (tl.constexpr, triton.runtime.JITFunction, types.ModuleType)
    kernels = {name: fn for module in (triton_maps_jit, triton_jit, triton_causal_jit)
               for name, fn in vars(module).items() if isinstance(fn, triton.runtime.JITFunction)}
    assert len(kernels) >= 15
    plain = sorted({f"{name} reads {node.id}" for name, fn in kernels.items()
                    for node in ast.walk(ast.parse(textwrap.dedent(fn.src)))
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in fn.fn.__globals__
                    and not isinstance(fn.fn.__globals__[node.id], allowed)})
    assert not plain, plain


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
    assert "TritonAttention" in type(out.grad_fn).__name__
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
        with fwAD.dual_level():  # the kernels have no forward-mode formula (test_triton_methods checks the tangents)
            dual = fwAD.make_dual(q, torch.ones_like(q))
            assert "tangent" in backend.kernel_backend(dual, k, v, "elu", causal=False).reason
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

    from linear_mha.tools import triton_bench
    triton_bench.main(["--device", "cpu", "--n", "32", "--batch", "1", "--heads", "2", "--dim", "16", "--blocks",
                       "16", "--repeats", "1", "--dtypes", "float32", "--exact-shape", "1", "2", "21", "19", "16", "16",
                       "--json", str(tmp_path / "r.json")])
    record = json.loads((tmp_path / "r.json").read_text())
    assert len(record["exactness"]) == 2 * len(triton_bench.METHODS)
    assert all(row["triton"] for row in record["exactness"])
    assert all(max(row[key] for key in ("out", "dq", "dk", "dv", "dparams")) < 1e-5 for row in record["exactness"])
    learns = {name for name in triton_bench.METHODS if triton_bench.method(name, 2, 16, torch.device("cpu"))[1]}
    assert learns and all(row["dparams"] > 0 for row in record["exactness"] if row["method"] in learns)
    assert [row["variant"] for row in record["timings"]] == ["pytorch path", "triton, 16-row tiles"]
    assert all(row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 for row in record["timings"])


@inside
def test_a_map_not_yet_run_on_a_gpu_waits_for_all(monkeypatch):
    """A map whose kernel has run only under the interpreter (here taylor, focused and hedgehog, as they were before
    the H100 run): off the interpreter the chooser takes it only with LINEAR_MHA_TRITON=all
    (set_enabled(True, all_maps=True)), and says so."""
    q, k, v, _ = inputs(seed=6)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton_kernel, "GPU_CHECKED", ("elu", "relu"))
    previous = triton_kernel.set_enabled(True)
    try:
        for ask in (lambda: triton_kernel.why_not(q, k, v, "taylor", None),
                    lambda: triton_kernel.why_not(q, k, v, FocusedMap(3.0), None),
                    lambda: triton_kernel.why_not_hedgehog(q, k, v, *[(torch.eye(8).repeat(3, 1, 1), None)] * 2)):
            assert "LINEAR_MHA_TRITON=all" in ask()
        triton_kernel.set_enabled(True, all_maps=True)
        assert "CUDA" in triton_kernel.why_not(q, k, v, "taylor", None)  # CPU tensors: only the device is left
    finally:
        triton_kernel.set_enabled(previous, all_maps=os.environ.get("LINEAR_MHA_TRITON") == "all")


def test_the_kernels_are_taken_by_default_only_where_their_shared_memory_fits():
    """A kernel asking for more shared memory than the GPU has fails to launch: the chooser takes the kernels by
    default only where they fit (compiled offline for sm_90): taylor, focused and hedgehog ask for up to 188,416
    bytes at head size 64, more than an A100 has, so only there on an H100, as they ran; elu and relu at 64
    anywhere and at 128 with an H100's memory."""
    h100, a100 = 232448, 166912
    for name in ("taylor", "focused", "hedgehog"):
        assert triton_kernel.outside_checked(name, 64, h100) is None
        assert "LINEAR_MHA_TRITON=all" in triton_kernel.outside_checked(name, 128, h100)
        assert "166912 bytes" in triton_kernel.outside_checked(name, 64, a100)
    for name in ("elu", "relu"):  # 65,536 bytes at 64 (any GPU), 196,608 at 128, more than an H100 has at 256
        assert triton_kernel.outside_checked(name, 64, 101376) is None
        assert triton_kernel.outside_checked(name, 128, h100) is None
        assert "166912 bytes" in triton_kernel.outside_checked(name, 128, a100)
        assert "LINEAR_MHA_TRITON=all" in triton_kernel.outside_checked(name, 256, h100)


@inside
def test_half_inputs_with_the_new_maps():
    q, k, v, _ = inputs(seed=15)
    maps = learned_maps(3, 8, 8, True, seed=16)
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in (q, k, v)]
        for fn in (lambda *t: LF.focused(*t), lambda *t: LF.hedgehog(*t, tuple(maps[:2]), tuple(maps[2:]))):
            out = fn(*low)
            ref = fn(*(t.double() for t in low))
            assert out.dtype == dtype and relative_error(out, ref) < 2e-2


@inside
def test_the_choosers_send_the_new_maps_there_and_say_why_not():
    q, k, v, _ = inputs(seed=17)
    maps = learned_maps(3, 8, 8, True, seed=18)
    q_map, k_map = tuple(maps[:2]), tuple(maps[2:])
    with triton_kernel.switched(True):
        assert backend.kernel_backend(q, k, v, FocusedMap(3.0), causal=False).backend == backend.TRITON
        assert backend.hedgehog_backend(q, k, v, q_map, k_map, causal=False).backend == backend.TRITON
        assert "causal" in backend.hedgehog_backend(q, k, v, q_map, k_map, causal=True).reason
        assert "window" in backend.hedgehog_backend(q, k, v, q_map, k_map, causal=False, window=True).reason
        wide_bias = (maps[2], maps[3][:1])
        assert "bias of shape" in backend.hedgehog_backend(q, k, v, q_map, wide_bias, causal=False).reason
        assert "scale of shape" in triton_kernel.why_not(q, k, v, FocusedMap(3.0, torch.ones(2, 3, 1, 8)))
        n = 19
        qs, ks, vs = (torch.randn(1, 3, n, 8) for _ in range(3))
        assert backend.rope_backend(qs, ks, vs, "taylor").backend == backend.TRITON
        assert backend.rope_backend(qs, ks, vs, "taylor", torch.ones(1, 3, n)).backend != backend.TRITON
        out = LF.hedgehog(q, k, v, q_map, k_map)
    with triton_kernel.switched(False):
        assert backend.hedgehog_backend(q, k, v, q_map, k_map, causal=False).backend != backend.TRITON
        torch.testing.assert_close(LF.hedgehog(q, k, v, q_map, k_map), out, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        LF.hedgehog(q, k, v, (maps[0][:, :4], None), k_map)


@inside
def test_hedgehog_maps_without_a_bias_match_float64():
    """LF.hedgehog takes maps without a bias (the registry's method always has one), of m != d features."""
    q, k, v, g = inputs(seed=23)
    mask = torch.rand(2, 45, generator=g) < 0.3
    q_w, _, k_w, _ = learned_maps(3, 8, 5, False, seed=24)
    fn = lambda q, k, v, q_w, k_w: LF.hedgehog(q, k, v, (q_w, None), (k_w, None), key_padding_mask=mask)  # noqa: E731
    compare(fn, [q, k, v, q_w, k_w], torch.randn(2, 3, 37, 5, generator=g))
