"""The compiled feature maps (functional/native_maps.py, csrc/focused_map.c, csrc/hedgehog_map.c,
csrc/silu_unit_map.c, csrc/log_gate_map.c) and the kernels' exp against float64: outputs and gradients, strided
rows, thread counts, and the inputs they leave to PyTorch ops."""
import ctypes

import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import native, native_library

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def relative_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


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
    assert type(out.grad_fn).__name__ == "_ParameterMapBackward"  # the compiled backward ran
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


@needs_native
@pytest.mark.parametrize("d", [13, 64])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_compiled_silu_unit_map_matches_float64(d, threads):
    """The delta rule's query and key map (silu, then unit norm) in its compiled pass against F.normalize(F.silu)
    in float64: output and gradient, a module's strided rows, a vector width's tail (d = 13), large inputs whose
    sigmoid saturates, and an all-zero row, whose norm is clamped (gradient g / eps times silu'(0))."""
    import torch.nn.functional as F
    from linear_mha.functional import backend
    from linear_mha.functional.delta_rule import silu_unit
    g = torch.Generator().manual_seed(d + threads)
    x = (torch.randn(2, 40, 3, d, generator=g) * 3).transpose(1, 2)  # (B, H, N, d), positions H * d apart
    x[0, 0, 0] = 0.0
    x[1, 2, 5, :4] = torch.tensor([40.0, -40.0, 90.0, -90.0])[: min(4, d)]
    grad = torch.randn(2, 3, 40, d, generator=g)
    assert backend.silu_unit_backend(x).backend == backend.NATIVE
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaf = x.detach().requires_grad_()
        out = silu_unit(leaf)
        out.backward(grad)
    finally:
        torch.set_num_threads(previous)
    ref_leaf = x.detach().double().requires_grad_()
    ref = F.normalize(F.silu(ref_leaf), dim=-1)
    ref.backward(grad.double())
    assert relative_error(out, ref) < 1e-6
    live = torch.ones(2, 3, 40, dtype=torch.bool)
    live[0, 0, 0] = False  # the clamped row's gradient is ~1e12: compared on its own
    assert relative_error(leaf.grad[live], ref_leaf.grad[live]) < 1e-5
    torch.testing.assert_close(leaf.grad[0, 0, 0].double(), ref_leaf.grad[0, 0, 0], rtol=1e-6, atol=0)


@needs_native
@pytest.mark.parametrize("d", [13, 64])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_compiled_log_gate_map_matches_float64(d, threads):
    """GLA's log gates, logsigmoid(z + b) / T, in their compiled pass against PyTorch ops in float64: output and the
    gradients of z and of the bias per head and channel (summed over the tasks' partial sums), a module's strided
    rows, a vector width's tail, and logits far on both sides, where log(1 + e) must keep e's precision."""
    import torch.nn.functional as F
    from linear_mha.functional import backend
    from linear_mha.functional.gated_linear import log_sigmoid_gate
    g = torch.Generator().manual_seed(d + 10 * threads)
    z = (torch.randn(2, 40, 3, d, generator=g) * 4).transpose(1, 2)  # (B, H, N, d), positions H * d apart
    z[1, 2, 5, :4] = torch.tensor([30.0, -30.0, 60.0, -90.0])[: min(4, d)]
    bias = torch.randn(3, d, generator=g)
    bias[2, :4] = 0.0
    grad = torch.randn(2, 3, 40, d, generator=g)
    assert backend.log_gate_backend(z, bias).backend == backend.NATIVE
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaves = [t.detach().requires_grad_() for t in (z, bias)]
        out = log_sigmoid_gate(*leaves, temperature=16.0)
        out.backward(grad)
    finally:
        torch.set_num_threads(previous)
    refs = [t.detach().double().requires_grad_() for t in (z, bias)]
    want = F.logsigmoid(refs[0] + refs[1][:, None, :]) / 16.0
    want.backward(grad.double())
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=0)  # relative even at z = 60, e ~ 1e-26
    for name, got, ref in zip(("z", "bias"), leaves, refs):
        assert relative_error(got.grad, ref.grad) < 1e-5, name
