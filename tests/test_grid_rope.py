"""rope=True: 2-D rotary position on the token grid in the kernel numerator. The float64 reference of every variant
is in test_linear_modes; here what a detector needs: a padded image attends as the unpadded one does, weights
depend on relative grid position only, and what rope cannot do is refused by name."""
import pytest
import torch

import linear_mha.functional as LF
import linear_mha.functional.grid_rope  # noqa: F401
from linear_mha import LinearMultiheadAttention, TokenGrid
from linear_mha.functional.grid_rope import grid_angles, rotate

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


def test_a_query_whose_normaliser_vanishes_gets_zero_not_the_rotated_numerator():
    # relu features: the query's only feature is 0 on every key's, but the rotation mixes it into a non-zero one
    q = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64).expand(1, 1, 4, 4)
    k = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64).expand(1, 1, 4, 4)
    out = LF.grid_rope.grid_rope_kernel(q, k, torch.ones(1, 1, 4, 4, dtype=torch.float64), "relu", (2, 2, 0))
    assert out.abs().max() == 0
