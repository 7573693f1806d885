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
@pytest.mark.parametrize("split_of,method", [("qkv", "elu"), ("kv", "elu"), ("qk", "elu"), ("qkv", "efficient")])
def test_the_compiled_backward_writes_the_split_gradients_side_by_side(split_of, method):
    """The gradients reaching the split must be views of one tensor (else the projection gets a copy), with the
    same numbers as through torch's chunk. "qk": DETR's encoder, whose queries and keys share their input."""
    g = torch.Generator().manual_seed(4)
    parts = len(split_of)
    packed = torch.randn(1, 300, parts * 4 * 16, generator=g)
    other = torch.randn(1, 4, 300, 16, generator=g)
    grad = torch.randn(1, 4, 300, 16, generator=g)
    runs = []
    for split in (packed_heads.split_heads, chunked):
        leaf = packed.clone().requires_grad_()
        views = list(split(leaf, parts, 4))
        seen = []
        for v in views:
            v.register_hook(seen.append)
        named = dict(zip(split_of, views))
        inputs = named.get("q", other), named["k"], named.get("v", other)
        if method == "efficient":
            out = LF.efficient_attention(*inputs)
            assert "Efficient" in type(out.grad_fn).__name__
        else:
            out = LF.kernel(*inputs, feature_map="elu")
            assert "Kernel" in type(out.grad_fn).__name__
        out.backward(grad)
        runs.append((leaf.grad, seen))
    (got, seen), (want, _) = runs
    by_pointer = sorted(seen, key=lambda t: t.data_ptr())
    assert packed_heads.gathered(by_pointer) is not None, "the compiled backward wrote the gradients apart"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("inputs", ["x, x, x", "x, x, y", "x, y, y"])
def test_a_module_step_matches_float64_through_the_split(inputs):
    """Self-attention, DETR's encoder (query is key, the value apart) and k, v of one input."""
    torch.manual_seed(0)
    m = LinearMultiheadAttention(64, 4, mode="kernel")
    x, y = torch.randn(50, 2, 64), torch.randn(50, 2, 64)
    grads = []
    for dtype in (torch.float32, torch.float64):
        mm = m.to(dtype)
        leaves = {"x": x.to(dtype).detach().requires_grad_(), "y": y.to(dtype).detach().requires_grad_()}
        out, _ = mm(*(leaves[name] for name in inputs.split(", ")))
        out.square().sum().backward()
        grads.append((leaves["x"].grad.clone(), leaves["y"].grad, mm.in_proj_weight.grad.clone(),
                      mm.in_proj_bias.grad.clone()))
        mm.zero_grad()
    for a, b in zip(*grads):
        if a is not None or b is not None:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_second_order_gradients_through_the_split():
    """Gradients that are themselves differentiated (create_graph) and happen to lie side by side, as stacking
    the heads back makes them: every part's history must survive the split's backward."""
    packed = torch.randn(1, 4, 3 * 2 * 3, dtype=torch.float64, requires_grad=True)

    def stacked_squares(p):
        q, k, v = packed_heads.split_heads(p, 3, 2)
        return torch.stack([t.transpose(1, 2) for t in (q, k, v)], 2) ** 2
    assert torch.autograd.gradcheck(stacked_squares, (packed,))
    assert torch.autograd.gradgradcheck(stacked_squares, (packed,))


def test_forward_mode_gradients_of_a_module_through_the_split():
    """torch.func.jvp / forward_ad on a module whose q, k, v come from one projection (PyTorch ops path)."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    m = LinearMultiheadAttention(16, 2, mode="taylor").double()
    x, tangent = torch.randn(5, 1, 16, dtype=torch.float64), torch.randn(5, 1, 16, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        got = fwAD.unpack_dual(m(dual, dual, dual)[0]).tangent
    eps = 1e-6
    with torch.no_grad():
        plus, minus = x + eps * tangent, x - eps * tangent
        want = (m(plus, plus, plus)[0] - m(minus, minus, minus)[0]) / (2 * eps)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
