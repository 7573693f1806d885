"""mode='softmax' with rope=True: the strongest softmax baseline a user can build gets the rotary position the
linear methods take. q and k are rotated before the softmax, 2-D on the token grid (the linear methods' rotation)
or 1-D along a sequence; held to float64 references formed with explicit rotation matrices (naive.rotated_similarity),
with masks, causality, gradients, and in a patched DETR."""
import math

import pytest
import torch

import linear_mha
from linear_mha import LinearMultiheadAttention, TokenGrid, naive
from linear_mha.functional.grid_rope import grid_tables, rotate

E, H = 16, 2


def rope_softmax(**kwargs):
    torch.manual_seed(0)
    return LinearMultiheadAttention(E, H, mode="softmax", rope=True, batch_first=True, **kwargs).double()


def heads(m, x):
    """The module's q, k, v heads of self-attention input x (B, N, E)."""
    q, k, v = torch.nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
    return (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in (q, k, v))


def reference_output(m, x, grid, key_padding_mask=None, causal=False):
    """softmax((R q)(R k)^T / sqrt(d)) v through out_proj, the rotations as explicit matrices."""
    q, k, v = heads(m, x)
    seen = naive.visible(x.shape[1], x.shape[1], key_padding_mask, causal)
    weights = naive.softmax_weights(naive.rotated_similarity(q, k, grid) / math.sqrt(q.shape[-1]), seen)
    return m.out_proj(((weights @ v).transpose(1, 2)).flatten(2))


@pytest.mark.parametrize("grid", [TokenGrid(3, 4), TokenGrid(2, 3, prefix=1), None], ids=["grid", "prefix", "sequence"])
@pytest.mark.parametrize("masked", [False, True])
def test_outputs_match_explicit_rotation_matrices_in_float64(grid, masked):
    m = rope_softmax()
    n = 12 if grid is None else grid.prefix + grid.height * grid.width
    x = torch.randn(2, n, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    kpm = None
    if masked:
        kpm = torch.zeros(2, n, dtype=torch.bool)
        kpm[1, -3:] = True
    out, weights = m(x, x, x, key_padding_mask=kpm, token_grid=grid, average_attn_weights=False)
    expected = reference_output(m, x, grid, kpm)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    fast, _ = m(x, x, x, key_padding_mask=kpm, token_grid=grid, need_weights=False)  # the SDPA path
    torch.testing.assert_close(fast, expected, rtol=1e-10, atol=1e-10)
    if masked:
        assert torch.all(weights[1, :, :, -3:] == 0)


def test_the_rotation_is_the_linear_methods_on_the_grid_and_changes_the_output():
    """On a grid, q and k turn as taylor's features do (the same tables), and rope is not a no-op."""
    m = rope_softmax()
    x = torch.randn(1, 12, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    q, k, _ = heads(m, x)
    tables = grid_tables((3, 4, 0), E // H, q)
    scores = rotate(q, None, tables) @ rotate(k, None, tables).transpose(-1, -2)
    torch.testing.assert_close(scores, naive.rotated_similarity(q, k, TokenGrid(3, 4)))
    plain = LinearMultiheadAttention(E, H, mode="softmax", batch_first=True).double()
    plain.load_state_dict(m.state_dict())
    assert not torch.allclose(plain(x, x, x)[0], m(x, x, x, token_grid=TokenGrid(3, 4))[0])


def test_scores_depend_on_relative_position_along_a_sequence():
    """1-D RoPE: the same q and k at positions (i, j) and (i + t, j + t) give the same score."""
    m = rope_softmax()
    x = torch.randn(1, 10, E, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[:, 5:] = x[:, :5]  # the same tokens again, five positions later
    _, weights = m(x, x, x, average_attn_weights=False)
    q, k, _ = heads(m, x)
    turned = naive.rotated_similarity(q, k, None)
    torch.testing.assert_close(turned[..., 5:, 5:], turned[..., :5, :5])
    assert weights.shape == (1, H, 10, 10)


def test_causal_rope_never_sees_the_future_and_gradients_check():
    m = rope_softmax()
    x = torch.randn(1, 7, E, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    out, _ = m(x, x, x, is_causal=True, attn_mask=torch.ones(7, 7, dtype=torch.bool).triu(1))
    torch.testing.assert_close(out, reference_output(m, x, None, causal=True), rtol=1e-10, atol=1e-10)
    out[:, 3].sum().backward()
    assert torch.all(x.grad[:, 4:] == 0) and x.grad[:, :4].abs().sum() > 0
    assert torch.autograd.gradcheck(lambda t: m(t, t, t, is_causal=True, need_weights=False)[0],
                                    (x.detach()[:, :5].clone().requires_grad_(),))
    grid = TokenGrid(2, 2)
    y = x.detach()[:, :4].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: m(t, t, t, token_grid=grid, need_weights=False)[0], (y,))


def test_decoding_token_by_token_gives_the_full_causal_output():
    m = rope_softmax()
    x = torch.randn(1, 6, E, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    q, k, v = heads(m, x)
    method = m.method
    full = linear_mha.attend.attend_heads(method, {}, q, k, v, is_causal=True)[0]
    cache = {}
    steps = [linear_mha.attend.step_heads(method, {}, q[:, :, t], k[:, :, t], v[:, :, t], cache) for t in range(6)]
    torch.testing.assert_close(torch.stack(steps, dim=2), full, rtol=1e-10, atol=1e-10)


def test_rope_needs_self_attention_and_says_so():
    m = rope_softmax()
    with pytest.raises(ValueError, match="needs self-attention"):
        m(torch.randn(1, 4, E, dtype=torch.float64), torch.randn(1, 6, E, dtype=torch.float64),
          torch.randn(1, 6, E, dtype=torch.float64))


def test_detr_runs_softmax_with_rope_and_the_local_term_on_the_grid():
    """`--attention softmax --attention-option rope=True --dwc-kernel 3`: the baseline issue 62's table needs."""
    from linear_mha.integrations.detr.attention import apply_attention
    from linear_mha.integrations.detr.config import parse_args
    from linear_mha.integrations.detr.detr import build_model
    from linear_mha.integrations.detr.misc import NestedTensor
    base = ["--backbone", "tiny", "--hidden-dim", "32", "--nheads", "4", "--enc-layers", "1", "--dec-layers", "1",
            "--dim-feedforward", "64", "--num-queries", "5", "--num-classes", "4"]
    torch.manual_seed(0)
    detr = build_model(parse_args(base))[0].eval()
    report = apply_attention(detr, parse_args(base + ["--attention", "softmax", "--attention-option", "rope=True",
                                                      "--dwc-kernel", "3"]), max_tokens=300)
    assert report[0]["mode"] == "softmax" and report[0]["options"]["rope"] is True
    attn = detr.transformer.encoder.layers[0].self_attn
    assert isinstance(attn, LinearMultiheadAttention) and attn.method.rope
    seen = []
    attn.register_forward_hook(lambda mod, args, kwargs_out: seen.append(linear_mha.token_grid.resolve_token_grid(
        mod, None)))
    images = torch.randn(2, 3, 64, 48)
    mask = torch.zeros(2, 64, 48, dtype=torch.bool)
    mask[1, :, 32:] = True
    out = detr(NestedTensor(images, mask))
    assert torch.isfinite(out["pred_boxes"]).all()
    assert seen and seen[0] is not None and seen[0].height * seen[0].width > 1  # the 2-D grid, not a sequence
