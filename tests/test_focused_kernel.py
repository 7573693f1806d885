"""Focused linear attention with its map inside the compiled kernels (map 6 of csrc/kernel_attention.h): against
the same attention composed from PyTorch ops in float64, causal and not, with masks, scales, an initial state and
several threads; and how ``focused`` chooses that path."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import backend, native
from linear_mha.functional.focused import FocusedMap

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def relative_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def inputs(seed, n=45, d=13, dv=11):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, n, 3, d, generator=g) * 2).transpose(1, 2)  # (B, H, N, d) strided, as a module holds it
    k, v = torch.randn(2, 3, n, d, generator=g) * 2, torch.randn(2, 3, n, dv, generator=g)
    q[0, 0, :3] = -1.0  # rows whose relu is zero: features from the epsilon alone
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, -7:] = True
    mask[0, 5] = True
    k[1, :, -7:] = float("nan")  # masked keys' values must reach nothing
    v[1, :, -7:] = float("nan")
    k[0, :, 5] = float("nan")
    v[0, :, 5] = float("nan")
    scale = torch.rand(3, 1, d, generator=g) + 0.5
    return q, k, v, mask, scale, torch.randn(2, 3, n, dv, generator=g)


# Head sizes: 13 runs the map's scalar tail alone; 37 its vector loops (16- or 8-float) and a tail, with values
# of 16 that fill whole vectors (the normaliser's column then taken apart).
SIZES = [(13, 11), (37, 16)]


def run(q, k, v, mask, scale, grad, dtype, *, native_kernels, wanted=(True, True, True, True), **options):
    leaves = [t.detach().to(dtype).requires_grad_(w) if t is not None else None
              for t, w in zip((q, k, v, scale), wanted)]
    with backend.override(native_kernels=native_kernels):
        out = LF.focused(*leaves[:3], scale=leaves[3], key_padding_mask=mask, **options)
        out.backward(grad.to(dtype))
    return out, [None if t is None else t.grad for t in leaves]


@needs_native
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("power", [3.0, 2.5])
@pytest.mark.parametrize("with_scale", [True, False], ids=["scale", "no_scale"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("sizes", SIZES, ids=["d13", "d37"])
def test_focused_in_the_kernels_matches_float64(causal, power, with_scale, threads, sizes):
    q, k, v, mask, scale, grad = inputs(int(power * 10) + threads + 2 * causal, d=sizes[0], dv=sizes[1])
    scale = scale if with_scale else None
    assert backend.kernel_backend(q, k, v, FocusedMap(power, scale), causal=causal).backend == backend.NATIVE
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, got = run(q, k, v, mask, scale, grad, torch.float32, native_kernels=True, causal=causal,
                       focusing_factor=power)
    finally:
        torch.set_num_threads(previous)
    assert type(out.grad_fn).__name__ == "_KernelAttentionBackward"  # one compiled Function, no feature tensors
    # The reference: no NaN may be read, so its masked rows are zeroed (they must not matter to either).
    clean = [t.masked_fill(mask[:, None, :, None], 0.0) for t in (k, v)]
    ref, expected = run(q, *clean, mask, scale, grad, torch.float64, native_kernels=False, causal=causal,
                        focusing_factor=power)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < 2e-6
    # q's gradient passes the map's derivative, which float32 rounds visibly: the bound is what PyTorch's own
    # float32 ops err on the same call (1e-4 on some of these inputs), with a floor; a wrong term errs by percents.
    # Where that derivative is steep the error is rounding luck: on one causal input here an element whose
    # reference is 1.1e-5 errs by 2.8e-4 (of the largest element) in PyTorch's float32, and in the kernels by
    # 1.0e-4 to 2.8e-4 as the summation order of one dot product changes (1.9e-4 with that sum in float64). So
    # q's floor is 5e-4, still twenty times below a wrong term.
    _, composed = run(q, *clean, mask, scale, grad, torch.float32, native_kernels=False, causal=causal,
                      focusing_factor=power)
    for name, a, c, r in zip("qkv", got[:3], composed[:3], expected[:3]):
        assert torch.isfinite(a).all(), name
        assert relative_error(a, r) < max(5e-4 if name == "q" else 2e-5, 2 * relative_error(c, r)), name
    for t in got[1:3]:  # masked keys get no gradient
        assert (t.masked_select(mask[:, None, :, None]) == 0).all()
    if with_scale:
        assert relative_error(got[3], expected[3]) < 2e-5


@needs_native
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sizes", SIZES, ids=["d13", "d37"])
def test_the_scale_alone_gets_its_whole_gradient(causal, sizes):
    # With q, k, v frozen the kernels must still visit every query and key row for the scale's gradient: asking
    # only for the rows whose gradients are wanted would drop the others' shares.
    q, k, v, mask, scale, grad = inputs(7, d=sizes[0], dv=sizes[1])
    k, v = (t.masked_fill(mask[:, None, :, None], 0.0) for t in (k, v))
    wanted = (False, False, False, True)
    _, got = run(q, k, v, mask, scale, grad, torch.float32, native_kernels=True, wanted=wanted, causal=causal)
    _, expected = run(q, k, v, mask, scale, grad, torch.float64, native_kernels=False, wanted=wanted, causal=causal)
    assert got[:3] == [None, None, None]
    assert relative_error(got[3], expected[3]) < 2e-5


@needs_native
def test_focused_in_the_kernels_takes_an_initial_state():
    q, k, v, mask, scale, grad = inputs(11)
    k, v = (t.masked_fill(mask[:, None, :, None], 0.0) for t in (k, v))
    k2, v2 = torch.randn(2, 3, 9, 13) * 2, torch.randn(2, 3, 9, 11)
    phi = LF.focused_feature_map(k2.double(), 3.0, scale.double())
    state = phi.transpose(-2, -1) @ torch.cat([v2.double(), torch.ones(2, 3, 9, 1, dtype=torch.float64)], -1)
    results = []
    for dtype, native_kernels in ((torch.float32, True), (torch.float64, False)):
        init = state.to(dtype).requires_grad_()
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with backend.override(native_kernels=native_kernels):
            out = LF.focused(*leaves, scale=scale.to(dtype), initial_state=init)
            out.backward(grad.to(dtype))
        results.append((out, init.grad, leaves[0].grad))
    (out, g_init, g_q), (ref, e_init, e_q) = results
    assert relative_error(out, ref) < 2e-6
    assert relative_error(g_init, e_init) < 2e-5 and relative_error(g_q, e_q) < 2e-5
    with pytest.raises(ValueError, match="initial_state must have shape"):
        LF.focused(q, k, v, initial_state=state[:, :, :5].float())


def test_focused_says_why_it_leaves_the_kernels():
    q = k = v = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    choice = backend.kernel_backend(q, k, v, FocusedMap(), causal=False)
    assert choice.backend != backend.NATIVE and "float64" in choice.reason
    per_position = torch.rand(1, 2, 6, 4) + 0.5
    choice = backend.kernel_backend(q.float(), k.float(), v.float(), FocusedMap(3.0, per_position), causal=False)
    assert choice.backend != backend.NATIVE and "per head and channel" in choice.reason


@needs_native
def test_half_inputs_run_in_float32_and_come_back_in_their_dtype():
    q, k, v, mask, scale, _ = inputs(5)
    k, v = (t.masked_fill(mask[:, None, :, None], 0.0) for t in (k, v))
    half = [t.bfloat16() for t in (q, k, v)]
    assert backend.kernel_backend(*half, FocusedMap(3.0, scale), causal=True).backend == backend.NATIVE
    out = LF.focused(*half, scale=scale, key_padding_mask=mask, causal=True)
    with backend.override(native_kernels=False):
        ref = LF.focused(*(t.double() for t in half), scale=scale.double(), key_padding_mask=mask, causal=True)
    assert out.dtype == torch.bfloat16 and relative_error(out.float(), ref) < 1e-2


def test_a_focused_map_refuses_a_power_and_rope_tables_it_cannot_take():
    for power in (0, -1.0, True, "3"):
        with pytest.raises(ValueError, match="focusing_factor must be a positive number"):
            FocusedMap(power)
    q = torch.randn(1, 2, 4, 8)
    tables = (torch.ones(4, 4), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="rope_tables take a map without settings"):
        native.kernel_attention(q, q, q, FocusedMap(3.0), rope_tables=tables)
