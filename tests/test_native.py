"""The compiled CPU code (functional/native.py, csrc/kernel_attention.c) against float64 attention composed
from tensor ops, and how ``kernel`` chooses it. Beside this file: building and loading it (test_native_build.py),
the decoding step (test_native_step.py), the feature maps (test_native_maps.py) and a module's layout
(test_native_layouts.py)."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import backend, native
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
