"""rope=True: 2-D rotary position on the token grid in the kernel numerator. The float64 reference of every variant
is in test_linear_modes; here what a detector needs: a padded image attends as the unpadded one does, weights
depend on relative grid position only, and what rope cannot do is refused by name."""
import pytest
import torch

import linear_mha.functional as LF
import linear_mha.functional.grid_rope  # noqa: F401
from linear_mha import LinearMultiheadAttention, TokenGrid
from linear_mha.functional import backend, feature_maps, native, native_library
from linear_mha.functional.grid_rope import grid_angles, rotate, rotated_product

E, H = 16, 2


def rope_module(mode="taylor", **options):
    torch.manual_seed(0)
    return LinearMultiheadAttention(E, H, mode=mode, rope=True, batch_first=True, **options).double()


@pytest.mark.parametrize("mode, options", [("taylor", {}), ("taylor", {"key_reweight": True}),
                                           ("taylor", {"dwc_kernel": 3, "output_gate": True}), ("mala", {}),
                                           ("inline", {"dwc_kernel": 3})])
def test_a_padded_image_attends_as_the_unpadded_one_and_padding_gets_no_gradient(mode, options):
    m = rope_module(mode, **options)
    g = torch.Generator().manual_seed(3)
    valid = torch.randn(1, 3, 3, E, generator=g, dtype=torch.float64)
    small, _ = m(valid.view(1, 9, E), valid.view(1, 9, E), valid.view(1, 9, E), token_grid=TokenGrid(3, 3))
    padded = 1e3 * torch.randn(1, 4, 5, E, generator=g, dtype=torch.float64)
    padded[:, :3, :3] = valid
    padded = padded.view(1, 20, E).requires_grad_()
    kpm = torch.ones(1, 4, 5, dtype=torch.bool)
    kpm[:, :3, :3] = False
    out, _ = m(padded, padded, padded, key_padding_mask=kpm.view(1, 20), token_grid=TokenGrid(4, 5))
    torch.testing.assert_close(out.view(1, 4, 5, E)[:, :3, :3], small.view(1, 3, 3, E), rtol=1e-10, atol=1e-10)
    out.view(1, 4, 5, E)[:, :3, :3].sum().backward()
    assert torch.all(padded.grad.view(1, 4, 5, E)[kpm] == 0) and torch.isfinite(padded.grad).all()


def test_rotated_products_depend_on_the_offset_between_positions_only():
    angles = grid_angles(5, 6, 1, 3, dtype=torch.float64)  # 1 prefix token, 3 pairs per axis: 12 of 13 features
    a, b = torch.randn(2, 13, dtype=torch.float64)
    at = lambda f, n: rotate(f.expand(1, 1, 31, 13), angles)[0, 0, n]  # noqa: E731
    pos = lambda y, x: 1 + y * 6 + x  # noqa: E731
    same_offset = [at(a, pos(0, 0)) @ at(b, pos(2, 1)), at(a, pos(2, 3)) @ at(b, pos(4, 4))]
    torch.testing.assert_close(same_offset[0], same_offset[1], rtol=1e-12, atol=1e-12)
    assert abs(at(a, pos(0, 0)) @ at(b, pos(1, 2)) - same_offset[0]) > 1e-6
    torch.testing.assert_close(at(a, 0), a)  # the prefix token and taylor's leading constant are not rotated
    torch.testing.assert_close(at(a, pos(3, 2))[0], a[0])


def test_gradcheck_with_the_grid():
    m = rope_module()
    x = torch.randn(1, 6, E, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: m(x, x, x, token_grid=TokenGrid(2, 3))[0], (x,))


def test_what_rope_cannot_do_is_refused_by_name():
    m = rope_module()
    x = torch.randn(1, 6, E, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs the token grid"):
        m(x, x, x)
    with pytest.raises(ValueError, match="has no causal form with these options"):
        m(x, x, x, is_causal=True, attn_mask=torch.ones(6, 6, dtype=torch.bool).triu(1), token_grid=TokenGrid(2, 3))
    with pytest.raises(ValueError, match="needs self-attention"):
        m(x[:, :4], x, x, token_grid=TokenGrid(2, 3))
    with pytest.raises(ValueError, match="extra keys"):
        rope_module(add_bias_kv=True)(x, x, x, token_grid=TokenGrid(2, 3))
    with pytest.raises(ValueError, match="grid rope needs self-attention over the grid's 9 tokens"):
        LF.grid_rope.grid_rope_kernel(*torch.randn(3, 1, 1, 6, 4), "elu", (3, 3, 0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["pytorch", "compiled"])
def test_a_query_whose_normaliser_vanishes_gets_zero_not_the_rotated_numerator(dtype):
    # relu features: the query's only feature (0) is 0 on every key, whose only feature (2) is its rotation partner,
    # so the rotated numerator sin(theta_i - theta_j) is not 0 while the normaliser is
    q = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=dtype).expand(1, 1, 4, 4).clone().requires_grad_()
    k = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=dtype).expand(1, 1, 4, 4).clone().requires_grad_()
    v = torch.ones(1, 1, 4, 4, dtype=dtype, requires_grad=True)
    assert rotated_product(q, k, v, (2, 2, 0)).abs().max() > 0.1
    expected = "composed" if dtype == torch.float64 else "native"
    assert backend.rope_backend(q, k, v, "relu").backend == expected
    out = LF.grid_rope.grid_rope_kernel(q, k, v, "relu", (2, 2, 0))
    assert out.abs().max() == 0
    (out * torch.randn_like(out)).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert q.grad.abs().max() == 0  # no query sees a key, so no gradient reaches the queries


def strided_elu(x):  # a user's map whose features are a transposed view: the compiled code must get them contiguous
    return (torch.nn.functional.elu(x.transpose(-1, -2).contiguous()) + 1).transpose(-1, -2)


def float64_elu(x):  # a user's map that returns float64 features from float32 rows
    return feature_maps.elu_feature_map(x.double())


needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")
ROPE_MAPS = ["taylor", "elu", "taylor2", "relu", feature_maps.elu_feature_map, strided_elu, float64_elu]


@needs_native
@pytest.mark.parametrize("feature_map", ROPE_MAPS, ids=lambda m: getattr(m, "__name__", m))
@pytest.mark.parametrize("shape", [(2, 3, 3, 5, 1, 8, 5), (1, 2, 4, 4, 0, 16, 16), (1, 1, 24, 26, 2, 13, 7)],
                         ids=["prefix", "square", "long_odd"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_compiled_path_matches_float64_outputs_and_gradients(feature_map, shape, masked):
    """float32 CPU calls go to the compiled code (rotation inside the row loaders, the split state), checked
    against the float64 PyTorch path; relu adds key weights, which the compiled code takes as features."""
    b, h, height, width, prefix, d, dv = shape
    n = prefix + height * width
    g = torch.Generator().manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, size, generator=g, dtype=torch.float64) for size in (d, d, dv))
    weights = torch.rand(b, h, n, generator=g, dtype=torch.float64) if feature_map == "relu" else None
    mask = torch.rand(b, n, generator=g) < 0.3 if masked else None
    if masked:
        k[mask[:, None, :, None].expand_as(k)] = float("nan")  # a masked key's values must reach nothing
        v[mask[:, None, :, None].expand_as(v)] = float("nan")
    grad_out = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    results = []
    for dtype in (torch.float64, torch.float32):
        inputs = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        w = None if weights is None else weights.to(dtype).clone().requires_grad_()
        expected = "composed" if dtype == torch.float64 else ("native_features" if w is not None or callable(
            feature_map) else "native")
        assert backend.rope_backend(*inputs, feature_map, w).backend == expected
        out = LF.grid_rope.grid_rope_kernel(*inputs, feature_map, (height, width, prefix), key_padding_mask=mask,
                                            key_weights=w)
        (out * grad_out.to(dtype)).sum().backward()
        results.append([out] + [t.grad for t in inputs] + ([] if w is None else [w.grad]))
    for name, ref, got in zip(["out", "q", "k", "v", "weights"], *results):
        if mask is not None and name in ("k", "v", "weights"):
            assert torch.all(got.transpose(1, 2)[mask] == 0), name  # masked keys get no gradient
            ref = ref.transpose(1, 2).masked_fill(mask[..., None, None] if ref.dim() == 4 else mask[..., None], 0)
            got = got.transpose(1, 2)
        torch.testing.assert_close(got.double(), ref, rtol=2e-4, atol=2e-5, msg=name)


@needs_native
def test_the_compiled_entry_refuses_tables_it_cannot_use():
    q = torch.randn(1, 1, 6, 8)
    tables = LF.grid_rope.grid_tables((2, 3, 0), 8, q)
    with pytest.raises(ValueError, match="rope_tables need non-causal self-attention"):
        native.kernel_attention(q, q, q, "elu", causal=True, rope_tables=tables)
    with pytest.raises(ValueError, match="rope_tables need"):
        native.kernel_attention(q, q, q, "elu", rope_tables=tuple(t[:5] for t in tables))  # 5 rows for 6 positions
    with pytest.raises(ValueError, match="rope_tables need"):
        native.kernel_attention(q, q, q, "elu", initial_state=torch.zeros(1, 1, 8, 9), rope_tables=tables)


@needs_native
def test_the_compiled_path_splits_work_among_threads_as_one_thread_does_on_strided_inputs():
    if not native_library._threaded:
        pytest.skip("a build without OpenMP leaves several threads to PyTorch ops (native.why_not)")
    g = torch.Generator().manual_seed(0)
    # two heads, their rows split into parts; q, k, v strided views of a (N, B, H, D) layout, as a module passes them
    q, k, v = (torch.randn(600, 2, 1, 16, generator=g).permute(1, 2, 0, 3) for _ in range(3))
    assert not q.is_contiguous()
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 3):
            torch.set_num_threads(count)
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            assert backend.rope_backend(*x, "taylor").backend == "native"
            out = LF.grid_rope.grid_rope_kernel(*x, "taylor", (20, 30, 0))
            out.square().sum().backward()
            outs.append([out] + [t.grad for t in x])
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(*outs):
        torch.testing.assert_close(one, three, rtol=1e-5, atol=1e-6)
    reference = [t.double().requires_grad_() for t in (q, k, v)]  # and both equal the float64 PyTorch path
    out = LF.grid_rope.grid_rope_kernel(*reference, "taylor", (20, 30, 0))
    out.square().sum().backward()
    for one, ref in zip(outs[0], [out] + [t.grad for t in reference]):
        torch.testing.assert_close(one.double(), ref, rtol=2e-4, atol=2e-5)
