"""Tests for the chunked causal linear product, its custom backward, and the decoding step."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linear_mha.functional import backend, causal_linear_product, causal_linear_state, causal_linear_step
from linear_mha.functional.kernel.naive import naive_causal_product

F64 = torch.float64


def make_inputs(b=2, h=3, n=10, dk=4, dv=5, dtype=F64, with_state=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, dk, generator=g, dtype=dtype)
    k = torch.randn(b, h, n, dk, generator=g, dtype=dtype)
    v = torch.randn(b, h, n, dv, generator=g, dtype=dtype)
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=dtype) if with_state else None
    return q, k, v, s0


# (N, chunk_size): divides, does not divide, N < C, N = 1, N = C, chunk of 1.
SHAPES = [(12, 4), (13, 4), (10, 64), (1, 64), (1, 1), (16, 16), (9, 1), (100, 32)]


@pytest.mark.parametrize("n,chunk", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_forward_matches_naive(n, chunk, with_state):
    q, k, v, s0 = make_inputs(n=n, with_state=with_state)
    out = causal_linear_product(q, k, v, s0, chunk_size=chunk)
    assert out.shape == v.shape and out.dtype == F64
    torch.testing.assert_close(out, naive_causal_product(q, k, v, s0), rtol=1e-10, atol=1e-10)


def test_non_contiguous_inputs():
    # (B, N, H, D) -> (B, H, N, D) via transpose is how attention modules hand tensors over.
    q, k, v, s0 = make_inputs(n=11)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    out = causal_linear_product(qt, kt, vt, s0.transpose(-1, -2).contiguous().transpose(-1, -2), chunk_size=4)
    torch.testing.assert_close(out, naive_causal_product(q, k, v, s0), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n,chunk", [(7, 3), (6, 3), (1, 4), (4, 8)])
def test_gradcheck_all_inputs(n, chunk):
    inputs = [t.requires_grad_() for t in make_inputs(b=1, h=2, n=n, dk=3, dv=2)]
    assert torch.autograd.gradcheck(lambda *a: causal_linear_product(*a, chunk_size=chunk), inputs)


def test_gradcheck_without_initial_state():
    inputs = [t.requires_grad_() for t in make_inputs(b=1, h=1, n=5, dk=2, dv=3, with_state=False)[:3]]
    assert torch.autograd.gradcheck(lambda *a: causal_linear_product(*a, chunk_size=2), inputs)


@pytest.mark.parametrize("n,chunk", [(13, 4), (32, 8), (5, 64)])
def test_gradients_match_naive(n, chunk):
    base = make_inputs(n=n, seed=1)
    grad_out = torch.randn(2, 3, n, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    ours = [t.clone().requires_grad_() for t in base]
    ref = [t.clone().requires_grad_() for t in base]
    causal_linear_product(*ours, chunk_size=chunk).backward(grad_out)
    naive_causal_product(*ref).backward(grad_out)
    for name, a, b in zip(("phi_q", "phi_k", "v", "initial_state"), ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10, msg=f"grad of {name}")


# Work is done in blocks of backend.block_positions() positions; tiny values force every blocking path:
# one chunk per segment, several segments per head (state carried between them, last one
# shorter), one head per block, several heads per block, everything in one block.
@pytest.mark.parametrize("block_positions", [2, 4, 6, 16, 32, None])
def test_blocking_paths_match_naive(block_positions, backends):
    backends(block_positions=block_positions)
    base = make_inputs(n=13, seed=6)
    grad_out = torch.randn(2, 3, 13, 5, dtype=F64, generator=torch.Generator().manual_seed(7))
    ours = [t.clone().requires_grad_() for t in base]
    ref = [t.clone().requires_grad_() for t in base]
    out = causal_linear_product(*ours, chunk_size=2)
    torch.testing.assert_close(out, naive_causal_product(*ref), rtol=1e-10, atol=1e-10)
    out.backward(grad_out)
    naive_causal_product(*ref).backward(grad_out)
    for name, a, b in zip(("phi_q", "phi_k", "v", "initial_state"), ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10, msg=f"grad of {name}")


def test_block_policy():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert backend.block_positions(torch.device("cpu")) == backend.BLOCK_POSITIONS
        assert backend.block_positions(torch.device("meta")) is None
        torch.set_num_threads(2)
        assert backend.block_positions(torch.device("cpu")) == backend.BLOCK_POSITIONS_THREADED
        with backend.override(block_positions=None):
            assert backend.block_positions(torch.device("cpu")) is None
        assert backend.block_positions(torch.device("cpu")) == backend.BLOCK_POSITIONS_THREADED
    finally:
        torch.set_num_threads(threads)


def test_gradcheck_with_carried_segments(backends):
    backends(block_positions=4)
    inputs = [t.requires_grad_() for t in make_inputs(b=1, h=2, n=11, dk=2, dv=3)]
    assert torch.autograd.gradcheck(lambda *a: causal_linear_product(*a, chunk_size=2), inputs)


@pytest.mark.parametrize("subset", [s for r in range(1, 5) for s in itertools.combinations(range(4), r)])
def test_requires_grad_on_any_subset(subset, backends):
    backends(block_positions=8)  # 3 chunks of 4, segments of 2
    base = make_inputs(n=9, seed=3)
    ours = [t.clone().requires_grad_(i in subset) for i, t in enumerate(base)]
    ref = [t.clone().requires_grad_(i in subset) for i, t in enumerate(base)]
    grad_out = torch.randn(2, 3, 9, 5, dtype=F64)
    causal_linear_product(*ours, chunk_size=4).backward(grad_out)
    naive_causal_product(*ref).backward(grad_out)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if i in subset:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
        else:
            assert a.grad is None


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(context):
    q, k, v, s0 = (t.requires_grad_() for t in make_inputs(n=10))
    with context():
        out = causal_linear_product(q, k, v, s0, chunk_size=3)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, naive_causal_product(q, k, v, s0).detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("with_state", [False, True])
def test_step_by_step_equals_parallel(with_state):
    q, k, v, s0 = make_inputs(n=11, with_state=with_state)
    parallel = causal_linear_product(q, k, v, s0, chunk_size=4)
    state = s0
    for t in range(q.shape[2]):
        out, state = causal_linear_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        torch.testing.assert_close(out, parallel[:, :, t], rtol=1e-10, atol=1e-10, msg=f"token {t}")
    torch.testing.assert_close(state, causal_linear_state(k, v, s0), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("with_state", [False, True])
def test_state_is_last_state_and_continues_the_sequence(with_state):
    q, k, v, s0 = make_inputs(n=15, with_state=with_state)
    expected = (s0 if with_state else 0) + torch.einsum("bhnk,bhnv->bhkv", k, v)
    state = causal_linear_state(k[:, :, :9], v[:, :, :9], s0)
    torch.testing.assert_close(causal_linear_state(k, v, s0), expected, rtol=1e-10, atol=1e-10)
    # Prefill 9 tokens, then the remaining 6 in parallel from the carried state = one full pass.
    rest = causal_linear_product(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], state, chunk_size=4)
    full = causal_linear_product(q, k, v, s0, chunk_size=4)
    torch.testing.assert_close(rest, full[:, :, 9:], rtol=1e-10, atol=1e-10)


def _assert_causal(b, h, n, dk, dv, chunk, t, seed):
    q, k, v, s0 = make_inputs(b, h, n, dk, dv, seed=seed)
    out = causal_linear_product(q, k, v, s0, chunk_size=chunk)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, t] += 100.0
    out2 = causal_linear_product(q2, k2, v2, s0, chunk_size=chunk)
    # Bitwise: earlier positions must not see the perturbation at all.
    assert torch.equal(out[:, :, :t], out2[:, :, :t])
    assert not torch.allclose(out[:, :, t:], out2[:, :, t:])


@pytest.mark.parametrize("t", [0, 3, 4, 5, 12])
def test_causality_fixed(t):
    _assert_causal(1, 2, 13, 4, 3, 4, t, seed=t)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2), h=st.integers(1, 3), n=st.integers(1, 40),
    dk=st.integers(1, 6), dv=st.integers(1, 6), chunk=st.integers(1, 48), data=st.data(),
)
def test_causality_hypothesis(b, h, n, dk, dv, chunk, data):
    t = data.draw(st.integers(0, n - 1))
    _assert_causal(b, h, n, dk, dv, chunk, t, seed=n * 31 + t)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), chunk=st.integers(1, 40), dk=st.integers(1, 5), dv=st.integers(1, 5))
def test_matches_naive_hypothesis(n, chunk, dk, dv):
    q, k, v, s0 = make_inputs(1, 2, n, dk, dv, seed=n)
    out = causal_linear_product(q, k, v, s0, chunk_size=chunk)
    torch.testing.assert_close(out, naive_causal_product(q, k, v, s0), rtol=1e-10, atol=1e-10)


def _saved_bytes(fn):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_for_backward_is_only_the_inputs(dtype):
    n, dk, dv = 512, 16, 16
    q, k, v, s0 = (t.to(dtype).requires_grad_() for t in make_inputs(1, 2, n, dk, dv))
    saved, out = _saved_bytes(lambda: causal_linear_product(q, k, v, s0, chunk_size=64))
    input_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, s0))
    per_position_state_bytes = 2 * n * dk * dv * q.element_size()
    assert saved <= input_bytes, (saved, input_bytes)
    assert saved < per_position_state_bytes / 4
    # The hooks really see saves: the naive quadratic form saves far more than the inputs.
    naive_saved, _ = _saved_bytes(lambda: naive_causal_product(q, k, v, s0))
    assert naive_saved > 4 * input_bytes
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in (q, k, v, s0))


def test_bfloat16_long_sequence_is_finite():
    g = torch.Generator().manual_seed(0)
    n, d = 65536, 16
    # Positive features as a kernel feature map would produce; the sum grows like N.
    q, k = (torch.rand(1, 1, n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 1, n, d + 1, generator=g)
    v[..., -1] = 1.0
    v = v.to(torch.bfloat16)
    out = causal_linear_product(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == v.shape
    assert torch.isfinite(out).all()
    # Denominator column at the last position: q_N . sum_j k_j, computed directly in float32.
    expected = q[0, 0, -1].float() @ k[0, 0].float().sum(0)
    torch.testing.assert_close(out[0, 0, -1, -1].float(), expected, rtol=2e-2, atol=0)


def test_half_gradients_match_float64():
    base = make_inputs(n=20, seed=4)
    ours = [t.to(torch.bfloat16).requires_grad_() for t in base]
    ref = [t.to(torch.bfloat16).double().requires_grad_() for t in base]
    causal_linear_product(*ours, chunk_size=8).float().sum().backward()
    naive_causal_product(*ref).sum().backward()
    for a, b in zip(ours, ref):
        assert a.grad.dtype == torch.bfloat16
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=2e-2, atol=2e-2)


def _compile_available():
    try:
        import torch._dynamo

        return hasattr(torch, "compile") and torch._dynamo.is_dynamo_supported()
    except Exception:
        return False


@pytest.mark.skipif(not _compile_available(), reason="torch.compile is not supported on this platform")
def test_torch_compile_matches_eager():
    torch._dynamo.reset()

    def attend(q, k, v, s0):
        return causal_linear_product(q.relu() + 0.5, k.relu() + 0.5, v, s0, chunk_size=4).square().sum()

    # aot_eager traces the autograd.Function through dynamo and AOTAutograd without a C++ toolchain.
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    base = make_inputs(1, 2, 10, 3, 4, dtype=torch.float32)
    eager_in = [t.clone().requires_grad_() for t in base]
    comp_in = [t.clone().requires_grad_() for t in base]
    attend(*eager_in).backward()
    compiled(*comp_in).backward()
    for a, b in zip(comp_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*base), attend(*base), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q_shape=(2, 3, 10)), "phi_q must be 4-D"),
        (dict(k_shape=(2, 3, 10, 5)), "phi_k has shape"),
        (dict(v_shape=(2, 3, 9, 5)), "v has shape"),
        (dict(s_shape=(2, 3, 5, 4)), "initial_state must have shape"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(chunk_size=2.0), "chunk_size must be a positive int"),
        (dict(q_shape=(2, 3, 0, 4), k_shape=(2, 3, 0, 4), v_shape=(2, 3, 0, 5)), "sequence length 0"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, match):
    shapes = dict(q_shape=(2, 3, 10, 4), k_shape=(2, 3, 10, 4), v_shape=(2, 3, 10, 5), s_shape=(2, 3, 4, 5))
    chunk = kwargs.pop("chunk_size", 4)
    shapes.update(kwargs)
    q, k, v, s = (torch.randn(*shapes[key]) for key in ("q_shape", "k_shape", "v_shape", "s_shape"))
    with pytest.raises((ValueError, TypeError), match=match):
        causal_linear_product(q, k, v, s, chunk_size=chunk)


def test_bad_dtype_mix_raises():
    q, k, v, _ = make_inputs(n=4)
    with pytest.raises(TypeError, match="v has dtype"):
        causal_linear_product(q, k, v.float())
    with pytest.raises(ValueError, match="phi_q must be 3-D"):
        causal_linear_step(q, k, v, None)
    with pytest.raises(ValueError, match="v has shape .* but phi_k has shape"):
        causal_linear_state(k, v[:, :, :3])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        causal_linear_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], torch.zeros(2, 3, 5, 4, dtype=F64))


def test_float32_state_with_bfloat16_inputs_keeps_each_dtype():
    q, k, v, s0 = make_inputs(n=12, seed=5)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    s0 = s0.float().requires_grad_()
    out = causal_linear_product(q, k, v, s0, chunk_size=4)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert s0.grad.dtype == torch.float32 and q.grad.dtype == torch.bfloat16
    # d initial_state = sum_i q_i^T do_i with do = ones.
    expected = q.detach().float().transpose(-1, -2) @ torch.ones(2, 3, 12, 5)
    torch.testing.assert_close(s0.grad, expected, rtol=1e-5, atol=1e-4)
    step_out, state = causal_linear_step(q[:, :, 0].detach(), k[:, :, 0].detach(), v[:, :, 0].detach(), s0.detach())
    assert step_out.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_double_backward_is_refused_clearly():
    q, k, v, _ = (t.requires_grad_() if t is not None else t for t in make_inputs(n=6, with_state=False))
    out = causal_linear_product(q, k, v, chunk_size=4)
    grad_out = torch.ones_like(out).requires_grad_()
    (grad_q,) = torch.autograd.grad(out, q, grad_outputs=grad_out, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_q.sum().backward()


def test_autocast_does_not_round_the_states():
    q, k, v, s0 = (t.float() for t in make_inputs(n=200, seed=8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_linear_product(q, k, v, s0, chunk_size=16)
        state = causal_linear_state(k, v, s0)
        prefix = causal_linear_state(k[:, :, :-1], v[:, :, :-1], s0)
        step_out, _ = causal_linear_step(q[:, :, -1], k[:, :, -1], v[:, :, -1], prefix)
    assert out.dtype == state.dtype == step_out.dtype == torch.float32
    ref = naive_causal_product(q.double(), k.double(), v.double(), s0.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(step_out.double(), ref[:, :, -1], rtol=1e-4, atol=1e-3)
    expected_state = s0.double() + k.double().transpose(-1, -2) @ v.double()
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-4, atol=1e-3)


def test_runs_on_a_non_cpu_device_single_block():
    # The meta device stands in for an accelerator: same code path (one block), shapes only.
    q = torch.empty(2, 3, 1000, 8, device="meta", requires_grad=True)
    v = torch.empty(2, 3, 1000, 9, device="meta", requires_grad=True)
    s0 = torch.empty(2, 3, 8, 9, device="meta", requires_grad=True)
    out = causal_linear_product(q, q, v, s0)
    assert out.shape == v.shape and out.device.type == "meta"
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape and s0.grad.shape == s0.shape
