"""q, k, v split from one projection (functional/packed_heads.py): the same views and gradients as torch's chunk,
and, through the compiled backward, gradients written side by side and handed to the projection without a copy."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha import LinearMultiheadAttention
from linear_mha.functional import native, packed_heads

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def chunked(packed, parts, heads):
    b, n, width = packed.shape
    return tuple(t.reshape(b, n, heads, width // (parts * heads)).transpose(1, 2) for t in packed.chunk(parts, -1))


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("missing", [None, 1])
def test_split_and_its_gradient_match_torch_chunk(parts, missing):
    """Separate gradients (any backward but the compiled one), one of them missing (a tensor that reached no
    output): gathered into the projection's layout as chunk's backward does, the missing one as zeros."""
    g = torch.Generator().manual_seed(parts)
    packed = torch.randn(2, 7, parts * 3 * 4, generator=g, dtype=torch.float64)
    grads = [torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64) for _ in range(parts)]
    if missing is not None:
        grads[missing] = None
    results = []
    for split in (packed_heads.split_heads, chunked):
        leaf = packed.clone().requires_grad_()
        views = split(leaf, parts, 3)
        used = [(v, gr) for v, gr in zip(views, grads) if gr is not None]
        torch.autograd.backward([v for v, _ in used], [gr for _, gr in used])
        results.append(([v.detach() for v in views], leaf.grad))
    (views, grad), (want_views, want_grad) = results
    assert all(torch.equal(a, b) for a, b in zip(views, want_views))
    assert torch.equal(grad, want_grad)


def test_gathered_takes_only_views_of_one_tensor_side_by_side():
    whole = torch.randn(2, 5, 3, 4, 6)
    grads = [whole.select(2, i).transpose(1, 2) for i in range(3)]
    found = packed_heads.gathered(grads)
    assert found is not None and found.data_ptr() == whole.data_ptr() and torch.equal(found, whole.reshape(2, 5, 72))
    assert packed_heads.gathered(grads[::-1]) is None  # out of order
    assert packed_heads.gathered([grads[0], grads[1].clone(), grads[2]]) is None  # other memory
    assert packed_heads.gathered([grads[0], None, grads[2]]) is None
    wider = torch.randn(2, 5, 4, 4, 6)  # rows wider than the parts: a strided view of the first three is right
    parts = [wider.select(2, i).transpose(1, 2) for i in range(3)]
    assert torch.equal(packed_heads.gathered(parts), wider[:, :, :3].reshape(2, 5, 72))
    assert packed_heads.gathered([wider.select(2, i).transpose(1, 2) for i in (0, 1, 3)]) is None  # a gap


@needs_native
@pytest.mark.parametrize("parts", [2, 3])
def test_the_compiled_backward_writes_the_split_gradients_side_by_side(parts):
    """The gradients reaching the split must be views of one tensor (else the projection gets a copy), with the
    same numbers as through torch's chunk."""
    g = torch.Generator().manual_seed(4)
    packed = torch.randn(1, 300, parts * 4 * 16, generator=g)
    q = torch.randn(1, 4, 300, 16, generator=g)
    grad = torch.randn(1, 4, 300, 16, generator=g)
    runs = []
    for split in (packed_heads.split_heads, chunked):
        leaf = packed.clone().requires_grad_()
        views = list(split(leaf, parts, 4))
        seen = []
        for v in views:
            v.register_hook(seen.append)
        query = views[0] if parts == 3 else q
        out = LF.kernel(query, views[-2], views[-1], feature_map="elu")
        assert "Kernel" in type(out.grad_fn).__name__
        out.backward(grad)
        runs.append((leaf.grad, seen))
    (got, seen), (want, _) = runs
    by_pointer = sorted(seen, key=lambda t: t.data_ptr())
    assert packed_heads.gathered(by_pointer) is not None, "the compiled backward wrote the gradients apart"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_native
def test_a_module_step_matches_float64_through_the_split():
    torch.manual_seed(0)
    m = LinearMultiheadAttention(64, 4, mode="kernel")
    x = torch.randn(50, 2, 64)
    grads = []
    for dtype in (torch.float32, torch.float64):
        mm = m.to(dtype)
        xx = x.to(dtype).detach().requires_grad_()
        out, _ = mm(xx, xx, xx)
        out.square().sum().backward()
        grads.append((xx.grad.clone(), mm.in_proj_weight.grad.clone(), mm.in_proj_bias.grad.clone()))
        mm.zero_grad()
    for a, b in zip(*grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
