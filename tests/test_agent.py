"""mode='agent' (Agent Attention): a float64 reference written from the paper's formula, exact padding of images
in a batch, gradients, and the grid reaching it through patch."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linear_mha.functional as LF
from linear_mha import LinearMultiheadAttention, TokenGrid, patch


def reference(q, k, v, a, height, width, prefix=0):
    """Unpadded: agents = adaptive average pooling of the grid queries; softmax(A K^T s) V, then softmax(Q A^T s)."""
    b, h, n, d = q.shape
    grid = q[:, :, prefix:].transpose(2, 3).reshape(b, h * d, height, width)
    agents = F.adaptive_avg_pool2d(grid, a).reshape(b, h, d, a * a).transpose(2, 3)
    s = d ** -0.5
    values = torch.softmax(agents @ k.transpose(-1, -2) * s, -1) @ v
    return torch.softmax(q @ agents.transpose(-1, -2) * s, -1) @ values


@pytest.mark.parametrize("a,prefix", [(1, 0), (2, 1), (3, 0), (5, 2)])  # 5 > the 3 x 4 grid's side: bins overlap
def test_agent_attention_matches_the_formula(a, prefix):
    g = torch.Generator().manual_seed(a)
    q, k, v = (torch.randn(2, 3, prefix + 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = LF.agent_attention(q, k, v, agents_per_side=a, height=3, width=4, prefix=prefix)
    torch.testing.assert_close(out, reference(q, k, v, a, 3, 4, prefix), rtol=1e-12, atol=1e-12)


def test_a_padded_image_gets_its_own_outputs_and_padding_gets_no_gradient():
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3)]  # a 3 x 3 image
    alone = LF.agent_attention(*small, agents_per_side=2, height=3, width=3)
    padded = []
    for t in small:  # padded to 4 x 5 with NaN: the batch's largest image sets the grid
        grid = torch.full((1, 2, 4, 5, 4), float("nan"), dtype=torch.float64)
        grid[:, :, :3, :3] = t.view(1, 2, 3, 3, 4)
        padded.append(grid.view(1, 2, 20, 4).requires_grad_())
    kpm = torch.ones(1, 4, 5, dtype=torch.bool)
    kpm[:, :3, :3] = False
    out = LF.agent_attention(*padded, agents_per_side=2, height=4, width=5, key_padding_mask=kpm.view(1, 20))
    valid = ~kpm.view(20)
    torch.testing.assert_close(out[:, :, valid], alone, rtol=1e-12, atol=1e-12)
    out[:, :, valid].sum().backward()
    for t in padded:
        assert torch.all(t.grad[:, :, ~valid] == 0) and torch.isfinite(t.grad).all()


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(1, 7, dtype=torch.bool)
    kpm[0, 5:] = True  # the grid is 2 x 3 after one prefix token; its last row is half padding
    assert torch.autograd.gradcheck(
        lambda q, k, v: LF.agent_attention(q, k, v, agents_per_side=2, height=2, width=3, prefix=1,
                                           key_padding_mask=kpm), (q, k, v))


def test_the_module_needs_the_grid_and_patch_gives_it():
    m = LinearMultiheadAttention(8, 2, mode="agent", batch_first=True)
    x = torch.randn(1, 6, 8)
    with pytest.raises(ValueError, match="mode='agent' needs the token grid"):
        m(x, x, x)
    assert m(x, x, x, token_grid=TokenGrid(2, 3))[0].shape == (1, 6, 8)
    from linear_mha.integrations.detr.transformer import Transformer
    wrapper = nn.Module()
    wrapper.transformer = Transformer(d_model=16, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                                      dim_feedforward=32, dropout=0.0)
    patch(wrapper, "agent", include=["transformer.encoder.layers.*.self_attn"], agents_per_side=2)
    src = torch.randn(2, 16, 3, 4)
    hs, memory = wrapper.transformer(src, torch.zeros(2, 3, 4, dtype=torch.bool), torch.randn(5, 16),
                                     torch.randn(2, 16, 3, 4))
    assert torch.isfinite(hs).all() and memory.shape == src.shape
