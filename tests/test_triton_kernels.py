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
from linear_mha.functional.focused import FocusedMap
from linear_mha.functional.grid_rope import grid_rope_kernel
from linear_mha.functional.hedgehog import hedgehog_state


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


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's functions are not JITFunctions; the suite's process checks")
def test_the_kernels_read_no_plain_module_globals():
    """Compiled, a @triton.jit function may read a module global only if it is a tl.constexpr (or a function or
    module); the interpreter reads a plain int as well, so the tests below cannot see it. A plain global made every
    map fail to compile on an H100 while all of them passed here."""
    triton = pytest.importorskip("triton")
    import ast
    import types

    import triton.language as tl
    from linear_mha.functional import triton_jit
    allowed = (tl.constexpr, triton.runtime.JITFunction, types.ModuleType)
    kernels = {name: fn for name, fn in vars(triton_jit).items() if isinstance(fn, triton.runtime.JITFunction)}
    assert len(kernels) >= 10
    plain = sorted({f"{name} reads {node.id}" for name, fn in kernels.items()
                    for node in ast.walk(ast.parse(textwrap.dedent(fn.src)))
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in fn.fn.__globals__
                    and not isinstance(fn.fn.__globals__[node.id], allowed)})
    assert not plain, plain


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
    assert max(row["dparams"] for row in record["exactness"] if row["method"] == "hedgehog") > 0
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
    assert "TritonAttention" in type(out.grad_fn).__name__
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


@inside
@pytest.mark.parametrize("case", ["focused p=3, scale", "focused p=2.5", "hedgehog, bias", "hedgehog m=5"])
@pytest.mark.parametrize("shape", [(2, 3, 37, 45, 8, 5), (1, 1, 3, 70, 20, 33)], ids=str)
def test_maps_with_parameters_match_float64(case, shape):
    """focused's power and scale, hedgehog's learned projections and softmaxes, computed inside the kernels: outputs,
    q / k / v gradients and the parameters' gradients (summed over programs and the batch) against float64; masked
    keys get no gradient."""
    q, k, v, g = inputs(*shape, seed=sum(shape) + len(case))
    b, h, l, s, d, dv = shape
    mask = torch.rand(b, s, generator=g) < 0.3
    grad = torch.randn(b, h, l, dv, generator=g)
    if case.startswith("focused"):
        power = 3.0 if "p=3" in case else 2.5
        params = [torch.rand(h, 1, d, generator=g) + 0.5] if "scale" in case else []
        fn = lambda q, k, v, *p: LF.focused(q, k, v, focusing_factor=power, scale=p[0] if p else None,  # noqa: E731
                                            key_padding_mask=mask)
    else:
        m = 5 if "m=5" in case else d
        params = [t for t in learned_maps(h, d, m, "bias" in case, seed=b + s) if t is not None]
        pairs = (lambda p: ((p[0], p[1]), (p[2], p[3]))) if "bias" in case else (lambda p: ((p[0], None), (p[1], None)))
        fn = lambda q, k, v, *p: LF.hedgehog(q, k, v, *pairs(p), key_padding_mask=mask)  # noqa: E731
    got = compare(fn, [q, k, v, *params], grad)
    gone = mask[:, None, :, None]
    assert (got[1].masked_select(gone) == 0).all() and (got[2].masked_select(gone) == 0).all()


@inside
@pytest.mark.parametrize("feature_map, d", [("elu", 8), ("taylor", 8), ("taylor", 7), ("relu", 13), ("focused", 8)])
def test_rotary_position_matches_float64(feature_map, d):
    """grid_rope_kernel through the kernels: the last 4 floor(F / 4) features turned in the numerator only, the
    normaliser plain; taylor at d = 7 (F = 8) turns its constant feature too, d = 13 leaves one feature as it is;
    a prefix token at no position; masked keys."""
    g = torch.Generator().manual_seed(d)
    grid = (3, 6, 1)
    n, b, h, dv = 19, 2, 3, 5
    q, k, v = (torch.randn(b, n, h, w, generator=g).transpose(1, 2) for w in (d, d, dv))
    mask = torch.rand(b, n, generator=g) < 0.3
    grad = torch.randn(b, h, n, dv, generator=g)
    if feature_map == "focused":
        fn = lambda q, k, v, scale: grid_rope_kernel(q, k, v, FocusedMap(3.0, scale), grid,  # noqa: E731
                                                     key_padding_mask=mask)
        tensors = [q, k, v, torch.rand(h, 1, d, generator=g) + 0.5]
        assert backend.rope_backend(q, k, v, FocusedMap(3.0, tensors[-1])).backend == backend.TRITON
    else:
        fn = lambda q, k, v: grid_rope_kernel(q, k, v, feature_map, grid, key_padding_mask=mask)  # noqa: E731
        tensors = [q, k, v]
        assert backend.rope_backend(q, k, v, feature_map).backend == backend.TRITON
    got = compare(fn, tensors, grad)
    assert (got[1].masked_select(mask[:, None, :, None]) == 0).all()


@inside
@pytest.mark.parametrize("method", ["elu", "taylor", "focused", "hedgehog"])
def test_an_initial_state_is_added_to_the_keys_sums(method):
    """initial_state (kernel_state's / hedgehog_state's layout: taylor's constant feature first, hedgehog's softmax(z)
    features before softmax(-z)) enters the sums every query sees; its gradient too."""
    q, k, v, g = inputs(seed=11)
    extra_k, extra_v = torch.randn(2, 3, 9, 8, generator=g), torch.randn(2, 3, 9, 5, generator=g)
    grad = torch.randn(2, 3, 37, 5, generator=g)
    if method == "hedgehog":
        maps = learned_maps(3, 8, 8, True, seed=12)
        state = hedgehog_state(extra_k, extra_v, tuple(maps[2:]))
        fn = lambda q, k, v, st: LF.hedgehog(q, k, v, tuple(t.to(q.dtype) for t in maps[:2]),  # noqa: E731
                                             tuple(t.to(q.dtype) for t in maps[2:]), initial_state=st)
    else:
        feature_map = FocusedMap(3.0) if method == "focused" else method
        state = LF.kernel_state(extra_k, extra_v, feature_map)
        fn = lambda q, k, v, st: LF.kernel(q, k, v, feature_map, initial_state=st)  # noqa: E731
    compare(fn, [q, k, v, state], grad)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        fn(q, k, v, state[:, :, 1:])


@inside
def test_junk_in_masked_keys_reaches_nothing_with_every_map():
    q, k, v, g = inputs(seed=13)
    q = q.detach().requires_grad_()  # so that the output says which Function made it
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[0, 30:] = True
    mask[1] = True
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[0, :, 30:], junk_v[0, :, 30:] = 1e4, float("nan")
    junk_k[1], junk_v[1] = 1e4, float("nan")
    maps = learned_maps(3, 8, 8, True, seed=14)
    runs = {"focused": lambda k, v: LF.focused(q, k, v, key_padding_mask=mask),
            "taylor": lambda k, v: LF.kernel(q, k, v, "taylor", key_padding_mask=mask),
            "hedgehog": lambda k, v: LF.hedgehog(q, k, v, tuple(maps[:2]), tuple(maps[2:]), key_padding_mask=mask)}
    for name, run in runs.items():
        clean, dirty = run(k, v), run(junk_k, junk_v)
        assert "TritonAttention" in type(clean.grad_fn).__name__, name
        torch.testing.assert_close(dirty, clean, msg=name)
        assert (clean[1] == 0).all(), name


@inside
@pytest.mark.parametrize("method", ["taylor", "focused", "hedgehog"])
def test_nan_and_inf_in_masked_keys_reach_no_gradient(method):
    """The backward reloads the keys: masked rows holding NaN or inf must be zeroed there too (hedgehog's d W_k is
    x^T d z, taylor's unit vector inf / inf), as the forward and the reference do."""
    q, k, v, g = inputs(seed=19)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[0, 30:], mask[1, :5] = True, True
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[0, :, 30:35], dirty_k[0, :, 35:], dirty_v[0, :, 30:] = float("nan"), float("inf"), float("nan")
    dirty_k[1, :, :5] = -float("inf")
    maps = learned_maps(3, 8, 8, True, seed=20)
    scale = torch.rand(3, 1, 8, generator=g) + 0.5
    grad = torch.randn(2, 3, 37, 5, generator=g)

    def run(k, v):
        params = [p.clone().requires_grad_() for p in {"hedgehog": maps, "focused": [scale]}.get(method, [])]
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if method == "hedgehog":
            out = LF.hedgehog(*leaves, tuple(params[:2]), tuple(params[2:]), key_padding_mask=mask)
        elif method == "focused":
            out = LF.focused(*leaves, scale=params[0], key_padding_mask=mask)
        else:
            out = LF.kernel(*leaves, "taylor", key_padding_mask=mask)
        assert "TritonAttention" in type(out.grad_fn).__name__
        out.backward(grad)
        return [t.grad for t in leaves + params]

    clean, dirty = run(k, v), run(dirty_k, dirty_v)
    for a, b in zip(clean, dirty):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a)


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
@pytest.mark.parametrize("case", ["elu, tangent on q", "focused, tangent on its scale",
                                  "hedgehog, tangent on a weight", "rope, tangent on k"])
def test_forward_mode_tangents_leave_the_kernels_and_are_carried(case):
    """The kernels' Function has no forward-mode formula: a call whose inputs, or whose map's own tensors, carry
    tangents (torch.autograd.forward_ad) must take PyTorch ops, with the chooser saying so, rather than raise."""
    import torch.autograd.forward_ad as fwAD
    q, k, v, g = inputs(b=1, h=3, l=12, s=12, d=8, dv=8, seed=19)
    q_w, q_b, k_w, k_b = learned_maps(3, 8, 8, True, seed=20)
    scale = torch.rand(3, 1, 8, generator=g) + 0.5
    primal = {"elu": q, "focused": scale, "hedgehog": q_w, "rope": k}[case.split(",")[0]]
    tangent = torch.randn(primal.shape, generator=g)

    def attend(x, dtype=torch.float32):
        a, b, c = (t.to(dtype) for t in (q, k, v))
        if case.startswith("elu"):
            return LF.kernel(x, b, c, "elu")
        if case.startswith("focused"):
            return LF.focused(a, b, c, scale=x)
        if case.startswith("hedgehog"):
            return LF.hedgehog(a, b, c, (x, q_b.to(dtype)), (k_w.to(dtype), k_b.to(dtype)))
        return grid_rope_kernel(a, x, c, "taylor", (3, 4, 0))

    eps = 1e-6
    ahead, behind = (primal.double() + sign * eps * tangent.double() for sign in (1, -1))
    want = (attend(ahead, torch.float64) - attend(behind, torch.float64)) / (2 * eps)
    with triton_kernel.switched(True):
        assert "Triton" in type(attend(primal.clone().requires_grad_()).grad_fn).__name__  # they run without one
        with fwAD.dual_level():
            dual = fwAD.make_dual(primal, tangent)
            if case.startswith("elu"):
                assert "tangent" in backend.kernel_backend(dual, k, v, "elu", causal=False).reason
            got = fwAD.unpack_dual(attend(dual)).tangent
    assert got is not None
    assert relative_error(got, want) < 1e-4
