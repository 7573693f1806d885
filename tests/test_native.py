"""The compiled CPU code (functional/native.py, csrc/kernel_attention.c) against float64 attention composed
from tensor ops, and how ``kernel`` / ``kernel_step`` choose them."""
import ctypes
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import backend, native, native_build, native_library
from linear_mha.functional._common import append_ones, split_normalise
from linear_mha.functional.feature_maps import apply_feature_map

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def reference(q, k, v, feature_map, key_padding_mask=None, initial_state=None):
    """Non-causal kernel attention in float64 from tensor ops."""
    q, k, v = q.double(), k.double(), v.double()
    phi_q, phi_k = apply_feature_map(feature_map, q, k, key_padding_mask=key_padding_mask)
    if key_padding_mask is not None:
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    state = phi_k.transpose(-2, -1) @ append_ones(v)
    if initial_state is not None:
        state = state + initial_state.double()
    return split_normalise(phi_q @ state)


def relative_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def test_kernels_build_where_a_compiler_exists():
    # Guards the skips below: with a C compiler on the machine (as on CI) the compiled code must be in use.
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    assert native.available(), native.build_error()


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("b,h,n_q,n_k,d,dv", [(1, 8, 300, 300, 64, 64), (2, 3, 37, 70, 13, 5), (1, 1, 1200, 1100, 16, 40)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_attention_matches_float64(feature_map, b, h, n_q, n_k, d, dv, masked, with_state):
    g = torch.Generator().manual_seed(n_q + d)
    q, k = torch.randn(b, h, n_q, d, generator=g), torch.randn(b, h, n_k, d, generator=g)
    v = torch.randn(b, h, n_k, dv, generator=g)
    mask = torch.rand(b, n_k, generator=g) < 0.3 if masked else None
    state = torch.rand(b, h, d, dv + 1, generator=g) if with_state else None
    out = native.kernel_attention(q, k, v, feature_map, mask, state)
    assert out.shape == (b, h, n_q, dv) and out.dtype == torch.float32
    assert relative_error(out, reference(q, k, v, feature_map, mask, state)) < 2e-6


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("b,h,n,d,dv", [(1, 8, 300, 64, 64), (2, 3, 37, 13, 5), (1, 2, 48, 8, 8), (1, 2, 97, 8, 8),
                                        (1, 1, 1300, 16, 8)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_attention_matches_float64(feature_map, b, h, n, d, dv, masked, with_state):
    # n = 48, 97: a whole number of the kernel's 48-position blocks, and one position past two; (1, 1, 1300):
    # fewer heads than threads, so the sequence is cut into parts that start from scanned key sums.
    g = torch.Generator().manual_seed(n + d)
    q, k = (torch.randn(b, h, n, d, generator=g) for _ in range(2))
    v = torch.randn(b, h, n, dv, generator=g)
    mask = torch.rand(b, n, generator=g) < 0.3 if masked else None
    state = torch.rand(b, h, d, dv + 1, generator=g) if with_state else None
    out = native.kernel_attention(q, k, v, feature_map, mask, state, causal=True)
    ref = LF.kernel(q.double(), k.double(), v.double(), feature_map, causal=True, key_padding_mask=mask,
                    initial_state=None if state is None else state.double())
    assert relative_error(out, ref) < 2e-6


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_in_an_unmasked_query_or_key_propagates_as_in_pytorch_ops(feature_map, causal):
    """An upstream NaN must show, whichever backend runs: the compiled relu once mapped NaN to 0 and hid it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    q[0, 0, 5, 3] = float("nan")
    k[0, 1, 7, 2] = float("nan")
    with backend.override(native_kernels=True):
        compiled = LF.kernel(q, k, v, feature_map, causal=causal)
    with backend.override(native_kernels=False):
        composed = LF.kernel(q, k, v, feature_map, causal=causal)
    assert torch.isnan(composed).any()
    assert torch.equal(torch.isnan(compiled), torch.isnan(composed))
    with backend.override(native_kernels=True):
        step, _ = LF.kernel_step(q[:, :, 5], k[:, :, 5], v[:, :, 5], None, feature_map)
    assert torch.isnan(step[0, 0]).all() and not torch.isnan(step[0, 1]).any()


@needs_native
def test_causal_attention_never_sees_the_future():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 130, 16, generator=g) for _ in range(3))
    out = native.kernel_attention(q, k, v, "elu", causal=True)
    for t in (0, 47, 48, 100):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t + 1:] = torch.randn(k2[:, :, t + 1:].shape, generator=g) * 5
        v2[:, :, t + 1:] = 1e4
        out2 = native.kernel_attention(q, k2, v2, "elu", causal=True)
        assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1])
    # Masked keys may hold garbage (NaN, inf): it reaches no output, earlier or later.
    mask = torch.zeros(1, 130, dtype=torch.bool)
    mask[:, 50:60] = True
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:60], v2[:, :, 50:60] = float("nan"), float("inf")
    out2 = native.kernel_attention(q, k2, v2, "elu", mask, causal=True)
    assert torch.isfinite(out2).all()
    assert relative_error(out2, LF.kernel(q.double(), k.double(), v.double(), "elu", causal=True,
                                          key_padding_mask=mask)) < 2e-6


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("b,h", [(2, 4), (1, 1)])
def test_attention_strided_inputs_and_thread_counts(threads, b, h):
    # A module's q, k, v are (B, N, H, D) projections seen as (B, H, N, D): strided, not copied. With one head
    # the sequence is split among the threads.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, 1200, h, 24, generator=g).transpose(1, 2) for _ in range(3))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native.kernel_attention(q, k, v, "elu")
        causal = native.kernel_attention(q, k, v, "elu", causal=True)
    finally:
        torch.set_num_threads(previous)
    assert relative_error(out, reference(q, k, v, "elu")) < 2e-6
    assert relative_error(causal, LF.kernel(q.double(), k.double(), v.double(), "elu", causal=True)) < 2e-6


@needs_native
def test_masked_keys_leak_nothing_and_empty_rows_give_zero():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 1::2] = True
    mask[1] = True  # batch 1 sees no key at all
    k[0, :, 1::2] = float("nan")
    v[0, :, 1::2] = float("inf")
    out = native.kernel_attention(q, k, v, "relu", mask)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()
    assert relative_error(out[:1], reference(q[:1], k[:1], v[:1], "relu", mask[:1])) < 2e-6
    # Features of very negative inputs underflow to 0, as float32 elu(x) + 1 does: output 0, not NaN.
    far = torch.full((1, 1, 3, 8), -200.0)
    assert (native.kernel_attention(far, far, torch.ones(1, 1, 3, 8), "elu") == 0).all()


def squared_relu(x):
    """A user's map of elementwise steps: read as a program, the compiled code runs it (elementwise_program)."""
    return torch.relu(x) ** 2 + 0.01


def gated_relu(x):
    """A user's map that is not one chain of steps (x is used twice): PyTorch makes it, the compiled code
    multiplies."""
    return torch.relu(x) * torch.sigmoid(x) + 0.01


def focused_p3(x):
    """focused's map, made by its own compiled pass (float32 CPU rows), its features to the compiled products."""
    return LF.focused_feature_map(x, 3.0)


@needs_native
def test_kernel_dispatches_float32_cpu_inference_to_the_kernels(monkeypatch):
    calls = []
    real = native.kernel_attention
    monkeypatch.setattr(native, "kernel_attention", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    mask = torch.rand(1, 40, generator=g) < 0.2
    with torch.inference_mode():
        fast = LF.kernel(q, k, v, "elu", key_padding_mask=mask)
        LF.kernel(q, k, v, "relu", causal=True, chunk_size=16)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="chunk_size"):
        LF.kernel(q, k, v, "elu", causal=True, chunk_size=0)
    # Autograd too: the compiled code has its backward.
    LF.kernel(q.requires_grad_(), k, v, "elu")
    LF.kernel(q, k, v, "elu", causal=True)
    assert len(calls) == 4
    # Not taken: float64.
    LF.kernel(q.detach().double(), k.double(), v.double(), "elu")
    assert len(calls) == 4
    # taylor's map is computed there too, and a user's map of elementwise steps; another map is made by PyTorch
    # ops, and its features go to the compiled products.
    LF.kernel(q.detach(), k, v, "taylor")
    LF.kernel(q.detach(), k, v, squared_relu)
    LF.kernel(q.detach(), k, v, gated_relu)
    assert calls[4] == "taylor" and calls[5].fn is squared_relu and calls[6] is None
    previous = native.set_enabled(False)
    try:
        with torch.inference_mode():
            composed = LF.kernel(q.detach(), k, v, "elu", key_padding_mask=mask)
    finally:
        native.set_enabled(previous)
    assert len(calls) == 7
    assert torch.allclose(fast, composed, rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("odd_map", ["transposed_view", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_user_map_s_odd_features_reach_the_compiled_products_as_float32_rows(odd_map, causal):
    """A user's map may return a transposed view or float64 features: the compiled code reads contiguous float32
    rows, so they are converted, never read as they lie."""
    def user_map(x):
        if odd_map == "float64":
            return torch.nn.functional.elu(x.double()) + 1
        return (torch.nn.functional.elu(x.transpose(-1, -2).contiguous()) + 1).transpose(-1, -2)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert backend.kernel_backend(*leaves, user_map, causal=causal).backend == backend.NATIVE_FEATURES
    out = LF.kernel(*leaves, user_map, causal=causal)
    out.square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = LF.kernel(*ref_leaves, user_map, causal=causal)
    ref.square().sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor", "taylor2", squared_relu, gated_relu, focused_p3],
                         ids=lambda f: getattr(f, "__name__", f))  # ids equal in every process (pytest-xdist)
@pytest.mark.parametrize("b,h,n_q,n_k,d,dv", [(1, 4, 200, 200, 64, 64), (2, 3, 37, 70, 13, 5), (1, 1, 1300, 1100, 16, 9)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_float64(feature_map, b, h, n_q, n_k, d, dv, masked, causal):
    if causal:
        n_k = n_q
    features = native.feature_count(feature_map, d) if isinstance(feature_map, str) else d
    g = torch.Generator().manual_seed(n_q + dv)
    # q, k, v as a module makes them: (B, N, H, D) projections seen as (B, H, N, D).
    q = torch.randn(b, n_q, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, n_k, h, d, generator=g).transpose(1, 2)
    v = torch.randn(b, n_k, h, dv, generator=g).transpose(1, 2)
    state = torch.rand(b, h, features, dv + 1, generator=g)
    mask = torch.rand(b, n_k, generator=g) < 0.3 if masked else None
    grad_out = torch.randn(b, h, n_q, dv, generator=g)

    def grads(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, state)]
        out = LF.kernel(*leaves[:3], feature_map, key_padding_mask=mask, initial_state=leaves[3], causal=causal)
        out.backward(grad_out.to(dtype))
        return out, [t.grad for t in leaves]

    out, got = grads(torch.float32)
    assert type(out.grad_fn).__name__ == "_KernelAttentionBackward"  # the compiled backward ran
    ref_out, ref = grads(torch.float64)
    # float32 sums over F features: rounding grows as sqrt(F) (taylor2 has 2,145 at d = 64); squared features span
    # a wider range, and one thread sums 1,100 of them in one accumulator (2.3e-6 seen against float64)
    sums = max(1.0, features / 64) ** 0.5 * (2.0 if feature_map in (squared_relu, gated_relu) else 1.0)
    assert relative_error(out, ref_out) < 2e-6 * sums
    for name, a, r in zip(("q", "k", "v", "initial_state"), got, ref):
        assert relative_error(a, r) < 1e-5 * sums, name
    if masked:
        assert (got[1][mask[:, None, :, None].expand_as(got[1])] == 0).all()


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
def test_causal_gradients_with_the_sequence_split_among_threads(threads):
    # One head and 1300 positions: with 3 threads the backward cuts the sequence into 3 parts, each starting
    # from scanned key sums (for d q) and gradient sums (for d k, d v).
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, 1300, 8, generator=g) for _ in range(3))
    state = torch.rand(1, 1, 8, 9, generator=g)
    mask = torch.rand(1, 1300, generator=g) < 0.2
    grad_out = torch.randn(1, 1, 1300, 8, generator=g)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, state)]
        LF.kernel(*leaves[:3], "relu", causal=True, key_padding_mask=mask, initial_state=leaves[3]).backward(grad_out)
    finally:
        torch.set_num_threads(previous)
    ref = [t.double().requires_grad_() for t in (q, k, v, state)]
    LF.kernel(*ref[:3], "relu", causal=True, key_padding_mask=mask, initial_state=ref[3]).backward(grad_out.double())
    for name, a, r in zip(("q", "k", "v", "initial_state"), leaves, ref):
        assert relative_error(a.grad, r.grad) < 1e-5, name


@needs_native
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_a_subset_of_inputs(causal):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 100, 8, generator=g) for _ in range(3))
    v.requires_grad_()
    v64 = v.detach().double().requires_grad_()
    for loss in (torch.square, lambda out: out):  # the latter hands the backward an expanded (stride 0) gradient
        (grad_v,) = torch.autograd.grad(loss(LF.kernel(q, k, v, "elu", causal=causal)).sum(), v)
        (ref,) = torch.autograd.grad(loss(LF.kernel(q.double(), k.double(), v64, "elu", causal=causal)).sum(), v64)
        assert relative_error(grad_v, ref) < 1e-5


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("d,dv", [(64, 64), (13, 40), (8, 3)])
def test_step_matches_the_composed_step_and_causal_attention(feature_map, d, dv):
    g = torch.Generator().manual_seed(d + dv)
    q, k = (torch.randn(2, 3, 5, d, generator=g) for _ in range(2))
    v = torch.randn(2, 3, 5, dv, generator=g)
    outs, state = [], None
    with torch.inference_mode():
        for i in range(5):
            out, new_state = LF.kernel_step(q[:, :, i], k[:, :, i], v[:, :, i], state, feature_map)
            previous = native.set_enabled(False)
            try:
                out_ref, state_ref = LF.kernel_step(q[:, :, i], k[:, :, i], v[:, :, i], state, feature_map)
            finally:
                native.set_enabled(previous)
            assert torch.allclose(new_state, state_ref, rtol=1e-5, atol=1e-6)
            assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-6)
            outs.append(out)
            state = new_state
    causal = LF.kernel(q.double(), k.double(), v.double(), feature_map, causal=True)
    assert relative_error(torch.stack(outs, 2), causal) < 2e-6


@needs_native
def test_step_rejects_a_state_of_the_wrong_shape():
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=r"state must have shape \(B, H, F, Dv \+ 1\) = \(1, 2, 8, 9\)"):
        LF.kernel_step(q, q, q, torch.zeros(1, 2, 8, 8), "elu")


def test_a_failed_build_warns_once_and_falls_back(tmp_path):
    script = textwrap.dedent("""
        import warnings, torch
        import linear_mha.functional as LF
        from linear_mha.functional import backend, native, native_build, native_library
        q = torch.randn(1, 2, 16, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.inference_mode():
                out = LF.kernel(q, q, q, "elu")
                LF.kernel(q, q, q, "elu")
        assert not native.available() and "no C compiler could build" in native.build_error()
        assert [str(w.message).count("compiled CPU code unavailable") for w in caught] == [1], caught
        assert torch.isfinite(out).all()
    """)
    env = dict(os.environ, CC="/bin/false", LINEAR_MHA_CACHE=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature_map", ["elu", "taylor"])
@pytest.mark.parametrize("n,dv", [(0, 4), (5, 0)])
def test_empty_sequences_and_values_give_empty_outputs(use_native, causal, feature_map, n, dv):
    q = torch.randn(1, 2, n, 3, requires_grad=True)
    v = torch.randn(1, 2, n, dv, requires_grad=True)
    previous = native.set_enabled(use_native)
    try:
        out = LF.kernel(q, q, v, feature_map, causal=causal)
        out.sum().backward()
    finally:
        native.set_enabled(previous)
    assert out.shape == (1, 2, n, dv)
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature_map", ["elu", "taylor"])
def test_torch_func_transforms_use_plain_torch_ops(causal, feature_map):
    # vmap's batched tensors have no data pointer and support no out=, and custom autograd.Functions need
    # functorch rules: under torch.func every path falls back to plain differentiable ops.
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 1, 2, 70, 4, generator=g) for _ in range(3))
    state = torch.rand(1, 2, native.feature_count(feature_map, 4), 5, generator=g)

    def attend(a, b, c):
        return LF.kernel(a, b, c, feature_map, causal=causal, initial_state=state, chunk_size=16)

    batched = torch.func.vmap(attend)(q, k, v)
    looped = torch.stack([attend(a, b, c) for a, b, c in zip(q, k, v)])
    assert torch.allclose(batched, looped, rtol=1e-5, atol=1e-6)
    grad = torch.func.grad(lambda a: attend(a, k[0], v[0]).square().sum())(q[0])
    q0 = q[0].clone().requires_grad_()
    attend(q0, k[0], v[0]).square().sum().backward()
    assert torch.allclose(grad, q0.grad, rtol=1e-4, atol=1e-6)


def test_an_unwritable_home_builds_in_the_temporary_directory(tmp_path):
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    script = textwrap.dedent("""
        import tempfile
        from linear_mha.functional import backend, native, native_build, native_library
        assert native.available(), native.build_error()
        assert native.library_path().startswith(tempfile.gettempdir()), native.library_path()
    """)
    env = {key: value for key, value in os.environ.items() if key != "LINEAR_MHA_CACHE"}
    env.update(HOME="/dev/null", TMPDIR=str(tmp_path))  # ~/.cache cannot be created under a file
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr


def efficient_reference(q, k, v, mask=None):
    """Efficient Attention in float64 from its definition."""
    logits = k.double()
    if mask is not None:
        logits = logits.masked_fill(mask[:, None, :, None], float("-inf"))
    weights = torch.softmax(logits, dim=-2).nan_to_num(0.0)  # a sample with every key masked: no weights
    return torch.softmax(q.double(), dim=-1) @ (weights.transpose(-2, -1) @ v.double())


@needs_native
@pytest.mark.parametrize("b,h,n_q,n_k,d,dv", [(1, 4, 200, 200, 64, 64), (2, 3, 37, 70, 13, 5), (1, 1, 1300, 1100, 16, 9)])
@pytest.mark.parametrize("masked", [False, True])
def test_efficient_attention_and_gradients_match_float64(b, h, n_q, n_k, d, dv, masked):
    g = torch.Generator().manual_seed(n_k + d)
    q = torch.randn(b, n_q, h, d, generator=g).transpose(1, 2) * 3  # strided, as a module makes them
    k = torch.randn(b, n_k, h, d, generator=g).transpose(1, 2) * 3
    v = torch.randn(b, n_k, h, dv, generator=g).transpose(1, 2)
    mask = torch.rand(b, n_k, generator=g) < 0.3 if masked else None
    grad_out = torch.randn(b, h, n_q, dv, generator=g)
    with torch.inference_mode():
        assert relative_error(LF.efficient_attention(q, k, v, key_padding_mask=mask), efficient_reference(q, k, v, mask)) < 2e-6

    def grads(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = LF.efficient_attention(*leaves, key_padding_mask=mask)
        out.backward(grad_out.to(dtype))
        return out, [t.grad for t in leaves]

    out, got = grads(torch.float32)
    assert type(out.grad_fn).__name__ == "_EfficientAttentionBackward"
    _, ref = grads(torch.float64)
    for name, a, r in zip("qkv", got, ref):
        assert relative_error(a, r) < 1e-5, name


@needs_native
def test_efficient_attention_masked_garbage_and_empty_samples():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, ::3] = True
    mask[1] = True  # batch 1 sees no key: output 0
    k[0, :, ::3], v[0, :, ::3] = float("nan"), float("inf")
    k.requires_grad_(), v.requires_grad_()
    out = LF.efficient_attention(q, k, v, key_padding_mask=mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert (k.grad[0, :, ::3] == 0).all() and (v.grad[0, :, ::3] == 0).all()
    clean = [t.detach().clone() for t in (k, v)]
    for t in clean:
        t[0, :, ::3] = 0.0
    assert relative_error(out.detach()[:1], efficient_reference(q[:1], clean[0][:1], clean[1][:1], mask[:1])) < 2e-6


@needs_native
def test_step_takes_the_compiled_path_for_valid_inputs_only(monkeypatch):
    calls = []
    real = native.kernel_step
    monkeypatch.setattr(native, "kernel_step", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    state = torch.rand(2, 3, 8, 9, generator=g)
    with torch.inference_mode():
        out, new_state = LF.kernel_step(q, k, v, state, "elu")
        assert calls == [1]
        # Strided, double or grad-requiring inputs take the PyTorch step, with the same result.
        strided = torch.randn(3, 2, 8, generator=g).transpose(0, 1).copy_(q)
        assert torch.allclose(LF.kernel_step(strided, k, v, state, "elu")[0], out, rtol=1e-5, atol=1e-6)
        double = LF.kernel_step(q.double(), k.double(), v.double(), state.double(), "elu")[0]
        assert torch.allclose(double.float(), out, rtol=1e-5, atol=1e-6)
    assert calls == [1]
    LF.kernel_step(q.clone().requires_grad_(), k, v, state, "elu")
    assert calls == [1]
    with pytest.raises(ValueError, match="kernel_step takes one position per call"):
        LF.kernel_step(q[:, :, None], k, v, state, "elu")


@pytest.mark.parametrize("use_native", [True, False])
def test_step_in_place_updates_the_given_state(use_native):
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    state = torch.rand(2, 3, 8, 9, generator=g)
    previous = native.set_enabled(use_native)
    try:
        with torch.inference_mode():
            out, new_state = LF.kernel_step(q, k, v, state, "elu")
            out_inplace, same = LF.kernel_step(q, k, v, state.clone(), "elu", inplace=True)
            first_out, first_state = LF.kernel_step(q, k, v, None, "elu", inplace=True)  # no state yet: a new one
    finally:
        native.set_enabled(previous)
    assert torch.allclose(out_inplace, out, rtol=1e-6, atol=1e-7) and torch.allclose(same, new_state, rtol=1e-6)
    assert first_state.shape == state.shape
    trained = state.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"inplace=True\) overwrites the state"):
        LF.kernel_step(q, k, v, trained, "elu", inplace=True)


def test_step_in_place_returns_the_same_tensor():
    state = torch.rand(1, 2, 4, 5)
    with torch.inference_mode():
        _, new_state = LF.kernel_step(torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 4), state, "elu",
                                      inplace=True)
    assert new_state.data_ptr() == state.data_ptr()


def test_package_data_ships_every_kernel_source():
    # A wheel carries only what setup.cfg's package_data names; a missing header would fail every build.
    import configparser
    import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    patterns = [p.strip() for p in config["options.package_data"]["linear_mha.functional"].split(",")]
    csrc = root / "linear_mha" / "functional" / "csrc"
    for path in csrc.iterdir():
        assert any(fnmatch.fnmatch(f"csrc/{path.name}", p) for p in patterns), path.name
    assert set(native_build.SOURCES) <= {p.name for p in csrc.iterdir()}


@needs_native
def test_a_build_without_openmp_leaves_threaded_sequences_to_torch(monkeypatch):
    q = torch.randn(1, 2, 32, 8)
    assert native.why_not_kernel("elu", q) is None
    monkeypatch.setattr(native_library, "_threaded", False)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert "without OpenMP" in native.why_not_kernel("elu", q)
        torch.set_num_threads(1)
        assert native.why_not_kernel("elu", q) is None
    finally:
        torch.set_num_threads(previous)
    with torch.inference_mode():  # the one-thread decoding step is worth it whatever the thread count
        token = q[:, :, 0].contiguous()
        assert native.step_ready("elu", token, token, token, None)


PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
"""

LOADS_THE_KERNELS = textwrap.dedent("""
    import warnings
    from linear_mha.functional import native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.available(), native.build_error()
    print(native.library_path())
    print(" | ".join(str(w.message) for w in caught))
""")


# A stand-in for the C compiler in the cache-trust tests below, which are about which folder and which file the
# build trusts, not about compiling (a real build from scratch is test_an_unwritable_home_...'s, ~15 s on two
# cores): its objects are empty files and its link copies the library this process loaded.
STAND_IN_COMPILER = """#!/bin/sh
out=""; shared=0
while [ $# -gt 0 ]; do
    case "$1" in -o) out="$2"; shift ;; -shared) shared=1 ;; esac
    shift
done
if [ "$shared" = 1 ]; then cp "$LINEAR_MHA_TEST_LIBRARY" "$out"; else : > "$out"; fi
"""


@pytest.fixture
def stand_in_compiler(tmp_path):
    """The stand-in compiler's path; the children that _run_with_cache starts build with it."""
    if not native.available():
        pytest.skip(f"kernels not built: {native.build_error()}")
    path = tmp_path / "stand-in-cc"
    path.write_text(STAND_IN_COMPILER)
    path.chmod(0o755)
    if subprocess.run([str(path), "-c", "x.c", "-o", str(tmp_path / "x.o")], capture_output=True).returncode != 0:
        pytest.skip(f"a script in {tmp_path} cannot be run (a noexec temporary folder?)")
    return str(path)


def _plant(folder, marker, compiler):
    """A library that writes ``marker`` when loaded, under every name a build with ``compiler`` looks for in
    ``folder``."""
    real = next((c for c in native_build.compilers() if c != compiler), None)
    if real is None:
        pytest.skip("no C compiler on this machine")
    source = folder / "planted.c"
    source.write_text(PLANTED)
    planted = folder / "planted.so"
    subprocess.run([real, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(planted), str(source)], check=True)
    for flags in native_build.FLAG_SETS:
        shutil.copy(planted, folder / native_build.library_name(compiler, flags))


def _run_with_cache(folder, compiler, check=True):
    env = dict(os.environ, LINEAR_MHA_CACHE=str(folder), CC=compiler, LINEAR_MHA_TEST_LIBRARY=native.library_path())
    result = subprocess.run([sys.executable, "-c", LOADS_THE_KERNELS], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 or not check, result.stderr
    return result.stdout.splitlines()


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="user ids are POSIX")
def test_a_cache_folder_others_can_write_is_never_loaded_from(tmp_path, stand_in_compiler):
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "planted-ran"
    _plant(shared, marker, stand_in_compiler)
    os.chmod(shared, 0o777)  # a folder another local user created first, or anyone can write to
    for library in shared.glob("kernel_attention-*.so"):
        os.chmod(library, 0o755)
    path, warning = _run_with_cache(shared, stand_in_compiler)
    assert not marker.exists(), "a library from a folder others can write was loaded"
    assert not path.startswith(str(shared)) and "writable by other users" in warning
    # The control: the same planted folder, made private, is trusted; so the refusal above was the rule at work.
    os.chmod(shared, 0o700)
    # it lacks the compiled code's symbols: the child fails after loading it
    _run_with_cache(shared, stand_in_compiler, check=False)
    assert marker.exists()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="giving a folder away needs root")
def test_a_cache_folder_owned_by_another_user_is_never_loaded_from(tmp_path, stand_in_compiler):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    marker = tmp_path / "planted-ran"
    _plant(foreign, marker, stand_in_compiler)
    os.chmod(foreign, 0o755)
    os.chown(foreign, 65534, 65534)  # nobody
    path, warning = _run_with_cache(foreign, stand_in_compiler)
    assert not marker.exists() and not path.startswith(str(foreign)) and "owned by user id 65534" in warning


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="user ids are POSIX")
def test_a_library_someone_else_wrote_into_our_cache_is_replaced_not_loaded(tmp_path, stand_in_compiler):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    marker = tmp_path / "planted-ran"
    _plant(ours, marker, stand_in_compiler)
    for library in ours.glob("kernel_attention-*.so"):
        os.chmod(library, 0o777)
    path, _ = _run_with_cache(ours, stand_in_compiler)
    assert not marker.exists() and path.startswith(str(ours))  # rebuilt in place, then loaded
    # The control: planted again and made private, the same files are loaded; so the rebuild above was the rule at
    # work (made private whatever the umask: a copy takes planted.so's mode, group-writable under umask 002).
    _plant(ours, marker, stand_in_compiler)
    for library in ours.glob("kernel_attention-*.so"):
        os.chmod(library, 0o700)
    _run_with_cache(ours, stand_in_compiler, check=False)
    assert marker.exists()


@needs_native
@pytest.mark.parametrize("power", [3.0, 2.0, 2.5])
@pytest.mark.parametrize("scale_shape", [None, (3, 1, 13), (13,), (1, 3, 1, 1)], ids=str)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_compiled_focused_map_matches_float64(power, scale_shape, threads):
    """The focused map's compiled pass (integer powers by multiplication, others by powf; scales per head and
    channel) against the composed map in float64: output and gradients of x and of the scale, strided rows."""
    from linear_mha.functional import backend
    from linear_mha.functional.focused import composed_focused_map
    g = torch.Generator().manual_seed(int(power * 10) + threads)
    x = (torch.randn(2, 40, 3, 13, generator=g) * 2).transpose(1, 2)  # (B, H, N, d), a module's strided layout
    x[0, 0, :3] = -1.0  # rows whose relu is all zero: every feature from the epsilon alone
    scale = None if scale_shape is None else torch.rand(scale_shape, generator=g) + 0.5
    grad = torch.randn(2, 3, 40, 13, generator=g)

    def run(dtype, fn):
        leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in (x, scale)]
        out = fn(leaves[0], power, leaves[1])
        out.backward(grad.to(dtype))
        return out, [None if t is None else t.grad for t in leaves]

    assert backend.focused_map_backend(x, scale).backend == backend.NATIVE
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, got = run(torch.float32, LF.focused_feature_map)
    finally:
        torch.set_num_threads(previous)
    assert type(out.grad_fn).__name__ == "_FocusedMapBackward"  # the compiled backward ran
    ref, expected = run(torch.float64, composed_focused_map)
    assert relative_error(out, ref) < 2e-6
    for name, a, r in zip(("x", "scale"), got, expected):
        if r is not None:
            assert relative_error(a, r) < 1e-5, name


def test_a_focused_scale_per_position_takes_the_composed_map():
    from linear_mha.functional import backend
    x = torch.randn(1, 2, 5, 4)
    choice = backend.focused_map_backend(x, torch.rand(1, 2, 5, 4) + 0.5)
    assert choice.backend == backend.COMPOSED and "per head and channel" in choice.reason


def _compiled_exp(x: torch.Tensor) -> torch.Tensor:
    """The kernels' exp through its test-only entry point, which native_library.py does not declare."""
    entry = native_library._lib().lm_exp_nonpositive_f32
    entry.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    out = torch.empty_like(x)
    assert entry(x.data_ptr(), out.data_ptr(), x.numel()) == 0
    return out


@needs_native
@pytest.mark.parametrize("form", ["vectors", "scalar tails"])
def test_the_compiled_exp_is_within_two_ulp_and_zero_where_it_says(form):
    """exp_nonpositive, which every compiled map, softmax and gate takes: within 2 ulp of float64 where e^x is a
    normal float32, one rounding off in the subnormal band above n = -127, exactly 0 from there down (-inf too), 1 at
    ±0, NaN kept. "scalar tails" runs the same values 7 at a time, fewer than a vector holds."""
    torch.manual_seed(0)
    special = torch.tensor([0.0, -0.0, -1e-45, -87.6, -87.69, -88.0, -100.0, -1e30, -float("inf"), float("nan")])
    x = torch.cat([-87.34 * torch.rand(1 << 20), -torch.logspace(-30, 1.9, 20_000), torch.linspace(-87.7, -87.3, 4001)])
    if form == "vectors":  # the special values first, where whole vectors take them
        x = torch.cat([special, x])
        got = _compiled_exp(x)
    else:
        x = torch.cat([special, x[torch.randperm(x.numel())[:20_000]]])
        got = torch.cat([_compiled_exp(chunk.clone()) for chunk in x.split(7)])
    ref = torch.exp(x.double())
    normal = ref >= torch.finfo(torch.float32).tiny
    assert ((got.double() - ref).abs() / ref)[normal].max() <= 2.0 ** -23
    n = x.double() * 1.4426950408889634  # n is this rounded: within rounding of -126.5 either answer is right
    assert (got[n <= -126.55] == 0).all()
    one_rounding = (got.double() - ref).abs() <= 2.0 ** -149
    assert one_rounding[~normal & (n > -126.45)].all()
    assert ((got == 0) | one_rounding)[(n > -126.55) & (n <= -126.45)].all()
    assert (got[x == 0] == 1).all() and got[x.isnan()].isnan().all()


@needs_native
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dv", [64, 13])
def test_a_query_whose_features_are_all_but_zero_gets_zero_not_inf(causal, dv):
    """An elu query with every input near -87 has features under 1e-38 and a normaliser under FLT_MIN, whose
    reciprocal overflowed: the output was inf (1/den times a subnormal numerator). Such a normaliser counts as 0:
    the output is 0, as for features that are exactly 0, and the gradients stay finite."""
    d, n = 64, 4
    q = torch.tensor([-87.2, -87.5, -87.8, 0.5])[:, None].expand(n, d).reshape(1, 1, n, d).contiguous()
    k = torch.full((1, 1, n, d), -6.0)
    v = torch.ones(1, 1, n, dv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = native.kernel_attention(*leaves, "elu", causal=causal)
    assert torch.isfinite(out).all()
    assert (out[0, 0, :3] == 0).all() and torch.allclose(out[0, 0, 3], torch.ones(dv))
    out.backward(torch.ones_like(out))
    assert all(torch.isfinite(t.grad).all() for t in leaves)


@needs_native
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [16, 13])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("spread", [2, 12, 40])
def test_the_compiled_hedgehog_map_matches_float64(with_bias, m, threads, spread):
    """Hedgehog's double softmax as one compiled pass against the composed features in float64: output and the
    gradients of x, the projection and the bias (whose per-task partial sums must add up), strided x. spread
    scales the projection: at 2 every row's z spans well under 80 (softmax(-z) from softmax(z)'s exponentials,
    csrc/hedgehog.h), at 12 some rows span more, at 40 nearly all (their own exponentials)."""
    from linear_mha.functional import backend
    g = torch.Generator().manual_seed(m + threads)
    x = torch.randn(2, 30, 3, 8, generator=g).transpose(1, 2)  # (B, H, N, d) as a module makes it
    weight = torch.randn(3, 8, m, generator=g) * spread  # large values: softmaxes far from uniform
    bias = torch.randn(3, m, generator=g) if with_bias else None
    grad = torch.randn(2, 3, 30, 2 * m, generator=g)

    def run(dtype, native_kernels):
        leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in (x, weight, bias)]
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with backend.override(native_kernels=native_kernels):
                out = LF.hedgehog_features(*leaves)
                out.backward(grad.to(dtype))
        finally:
            torch.set_num_threads(previous)
        return out, [t for t in leaves if t is not None]

    out, got = run(torch.float32, True)
    assert "HedgehogMap" in type(out.grad_fn).__name__  # the compiled backward ran
    ref, expected = run(torch.float64, False)
    rounding = max(1.0, spread / 4)  # z itself is rounded to float32, an absolute error that grows with |z|
    assert relative_error(out, ref) < 2e-6 * rounding
    for name, a, r in zip(("x", "weight", "bias"), got, expected):
        assert relative_error(a.grad, r.grad) < 1e-5 * rounding, name


def test_broadcast_features_take_the_composed_product():
    """Features whose batch broadcasts (one set of keys for every query batch) are not what the compiled code
    reads: the chooser says so, and the composed product gives the broadcast answer."""
    g = torch.Generator().manual_seed(5)
    phi_q, phi_k = torch.rand(2, 3, 7, 6, generator=g), torch.rand(1, 3, 9, 6, generator=g)
    v = torch.randn(1, 3, 9, 4, generator=g)
    from linear_mha.functional.kernel import feature_attention
    assert backend.features_backend(phi_q, phi_k, v).backend == backend.COMPOSED
    out = feature_attention(phi_q, phi_k, v)
    expected = feature_attention(phi_q, phi_k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    torch.testing.assert_close(out, expected)


def _split_heads(projection, heads):
    """q, k, v as a module makes them: (B, H, N, d) views of one (B, N, 3 H d) projection."""
    b, n, _ = projection.shape
    return [t.reshape(b, n, heads, -1).transpose(1, 2) for t in projection.chunk(3, dim=-1)]


LAYOUT_CASES = {
    "elu": lambda q, k, v: LF.kernel(q, k, v, feature_map="elu"),
    # k in the projection's layout and v contiguous: each gradient in its own input's layout
    "elu_v_contiguous": lambda q, k, v: LF.kernel(q, k, v.contiguous(), feature_map="elu"),
    "relu_causal_v_contiguous": lambda q, k, v: LF.kernel(q, k, v.contiguous(), feature_map="relu", causal=True),
    "taylor_causal": lambda q, k, v: LF.kernel(q, k, v, feature_map="taylor", causal=True),
    "padding": lambda q, k, v: LF.kernel(q, k, v, feature_map="relu",
                                         key_padding_mask=torch.arange(q.shape[2]).expand(q.shape[0], -1) >= 37),
    "focused": lambda q, k, v: LF.focused(q, k, v, scale=torch.linspace(0.5, 2, 4 * 8).reshape(4, 1, 8)),
    "hedgehog": lambda q, k, v: LF.hedgehog(q, k, v, (torch.eye(8).expand(4, 8, 8), None),
                                            (0.5 * torch.eye(8).expand(4, 8, 8), None)),
    "rope": lambda q, k, v: LF.grid_rope.grid_rope_kernel(q, k, v, "taylor", (5, 8, 1)),
    "efficient": lambda q, k, v: LF.efficient_attention(q, k, v),
    "efficient_padding_v_contiguous": lambda q, k, v: LF.efficient_attention(
        q, k, v.contiguous(), key_padding_mask=torch.arange(q.shape[2]).expand(q.shape[0], -1) >= 37),
}


@needs_native
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_outputs_and_gradients_follow_the_inputs_layout_with_the_same_numbers(case):
    """Heads that are views of one projection (a module's) get their output and input gradients written in that
    layout, (B, N, H, d) in memory, so that merging the heads and reshaping the gradients back are views; the
    numbers are those of contiguous inputs, bit for bit. A wrong stride in any kernel's reads or writes breaks it."""
    _check_split_against_contiguous(LAYOUT_CASES[case], batch=2, n=41, heads=4)


def _check_split_against_contiguous(attention, batch, n, heads, dim=8):
    g = torch.Generator().manual_seed(3)
    projection = torch.randn(batch, n, 3 * heads * dim, generator=g).requires_grad_()
    grad = torch.randn(batch, heads, n, dim, generator=g)
    split = _split_heads(projection, heads)
    plain = [t.detach().contiguous().requires_grad_() for t in split]
    out_split, out_plain = attention(*split), attention(*plain)
    assert out_split.transpose(1, 2).is_contiguous() and out_plain.is_contiguous()
    assert torch.equal(out_split, out_plain)
    (grad_projection,) = torch.autograd.grad(out_split, projection, grad.transpose(1, 2).contiguous().transpose(1, 2))
    grads = torch.autograd.grad(out_plain, plain, grad)
    assert torch.equal(grad_projection,
                       torch.cat([t.transpose(1, 2).reshape(batch, n, heads * dim) for t in grads], dim=-1))


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["relu_causal_v_contiguous", "taylor_causal"])
def test_causal_heads_walked_in_turn_over_many_chunks_give_each_heads_own_numbers(case, threads):
    """In a module's layout a causal task walks a few heads in turn, chunk by chunk, each with its own carried
    state; over several chunks (130 positions) and 8 heads the numbers are still those of contiguous inputs, bit
    for bit. A state shared between the heads of a task, or a chunk given another head's rows, breaks it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_split_against_contiguous(LAYOUT_CASES[case], batch=1, n=130, heads=8)
        # two sequences with their own padding: a group's heads never read another sequence's rows or mask
        padding = torch.arange(100) >= torch.tensor([[63], [100]])
        _check_split_against_contiguous(
            lambda q, k, v: LF.kernel(q, k, v, feature_map="relu", causal=True, key_padding_mask=padding),
            batch=2, n=100, heads=6)
        # the carried states start from each head's own initial state, and each head's gradient reaches its own
        state = torch.rand(1, 8, 8, 9, generator=torch.Generator().manual_seed(5)).requires_grad_()
        projection = torch.randn(1, 130, 3 * 8 * 8, generator=torch.Generator().manual_seed(6))
        outs, grads = [], []
        for q, k, v in (_split_heads(projection, 8), [t.contiguous() for t in _split_heads(projection, 8)]):
            out = LF.kernel(q, k, v, feature_map="elu", causal=True, initial_state=state)
            outs.append(out)
            grads.append(torch.autograd.grad(out, state, torch.ones_like(out))[0])
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    finally:
        torch.set_num_threads(before)
