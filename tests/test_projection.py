"""The in-projection with kept memory (functional/projection.py): F.linear's numbers and gradients, for inputs
laid out (B, L, E) or (L, B, E) seen batch-major, second-order gradients, and F.linear wherever a block cannot
serve."""
import pytest
import torch
import torch.nn.functional as F

from linear_mha.functional import native, output_cache
from linear_mha.functional.projection import project

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def _inputs(swapped: bool, bias: bool):
    g = torch.Generator().manual_seed(int(swapped) * 2 + int(bias))
    x = torch.randn(700, 3, 64, generator=g)  # (L, B, E): big enough for a kept block (700 * 3 * 192 floats)
    x = x.transpose(0, 1) if swapped else x.transpose(0, 1).contiguous()
    weight = torch.randn(192, 64, generator=g) / 8
    return x, weight, (torch.randn(192, generator=g) if bias else None)


@needs_native
@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_with_gradients(swapped, bias):
    x, weight, b = _inputs(swapped, bias)
    grad = torch.randn(3, 700, 192)
    runs = []
    for fn in (project, F.linear):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, b)]  # x's layout kept
        misses, hits = output_cache.stats()["misses"], output_cache.stats()["hits"]
        out = fn(*leaves)
        taken = output_cache.stats()["misses"] + output_cache.stats()["hits"] > misses + hits
        out.backward(grad)
        runs.append((out.detach(), *(t.grad for t in leaves if t is not None), taken))
    (*got, taken), (*want, _) = runs
    assert taken, "the projection did not write into a kept block"
    for a, b_ in zip(got, want):  # float32 sums over 2,100 rows in another order: relative to the largest
        assert ((a - b_).abs().max() / b_.abs().max()).item() < 1e-5


@needs_native
@pytest.mark.parametrize("swapped", [False, True])
def test_second_order_gradients_match_f_linear(swapped):
    """create_graph: the backward must stay differentiable (no out= products then)."""
    x, weight, b = _inputs(swapped, True)
    results = []
    for fn in (project, F.linear):
        xx, ww = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(xx, ww, b)
        (gx,) = torch.autograd.grad(out.square().sum(), xx, create_graph=True)
        results.append(torch.autograd.grad(gx.sum(), ww))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-4)


@needs_native
def test_f_linear_where_no_block_serves():
    x, weight, b = _inputs(False, True)
    before = output_cache.stats()
    for call in (lambda: project(x.double(), weight.double(), b.double()),  # the compiled path is float32
                 lambda: project(x[:, :2], weight, b),  # under a block's worth
                 lambda: project(x.permute(2, 0, 1).contiguous().permute(1, 2, 0), weight, b)):  # no matrix view
        call()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert project(x, weight, b).dtype == torch.bfloat16  # autocast casts as it does for F.linear
    after = output_cache.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


@needs_native
def test_a_frozen_weight_keeps_no_input_and_the_output_takes_in_place_ops():
    """As F.linear: with the weight frozen (adapter fine-tuning) the input is not kept for the backward; and the
    output may be changed in place (a view made inside a custom Function may not)."""
    x, weight, b = _inputs(True, True)
    x.requires_grad_()
    out = project(x, weight, b)
    assert "Projection" in type(out.grad_fn).__name__
    assert all(t is None or t.data_ptr() != x.data_ptr() for t in out.grad_fn.saved_tensors)
    out.mul_(2.0)
    out.sum().backward()
    xx = x.detach().clone().requires_grad_()
    want = F.linear(xx, weight, b)
    want.mul_(2.0)
    want.sum().backward()
    torch.testing.assert_close(x.grad, xx.grad, rtol=1e-5, atol=1e-5)
