"""Product-key memory: matches a brute-force float64 reference, gradchecks, is wired at the listed depths
(1-indexed), keeps causal LMs causal and incremental decoding exact."""
import pytest
import torch

from linear_mha.lm import PKM, LinearAttentionTransformerLM
from linear_mha.lm.feedforward import FeedForward
from lm_checks import assert_causal, assert_steps_equal_full

V, N, DIM = 16, 20, 32


def tiny_pkm(**kw):
    torch.manual_seed(0)
    args = dict(heads=2, num_keys=5, topk=3, dim_head=4)
    args.update(kw)
    return PKM(6, **args).double()


def brute_force(pkm: PKM, x):
    """Score all num_keys ** 2 slots explicitly (the product of the two halves' sub-key scores), keep topk."""
    q = pkm.norm(pkm.to_queries(x).reshape(-1, pkm.heads, pkm.dim_head)).reshape(-1, pkm.heads, 2, pkm.dim_head // 2)
    halves = torch.einsum("mhpd,hnpd->mhpn", q, pkm.keys)
    full = (halves[:, :, 0, :, None] + halves[:, :, 1, None, :]).reshape(q.shape[0], pkm.heads, -1)
    best, slots = full.topk(pkm.topk, dim=-1)
    w = best.softmax(-1)
    return (w[..., None] * pkm.values.weight[slots]).sum(dim=(1, 2))


def test_pkm_equals_brute_force_over_all_slots():
    pkm = tiny_pkm()
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    out = pkm(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, 6), brute_force(pkm, x.reshape(-1, 6)), rtol=1e-12, atol=1e-12)


def test_pkm_gradcheck():
    pkm = tiny_pkm()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    params = [pkm.to_queries.weight, pkm.keys, pkm.values.weight]

    def f(x, wq, keys, values):  # the input and every weight the memory read depends on
        return torch.func.functional_call(pkm, {"to_queries.weight": wq, "keys": keys, "values.weight": values}, (x,))

    inputs = (x,) + tuple(p.detach().clone().requires_grad_(True) for p in params)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


def lm(**kw):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(V, DIM, 2, 64, heads=4, dim_head=8, causal=True, **kw).double().eval()


def test_pkm_layers_replaces_the_feed_forward_at_listed_depths():
    x = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    base, with_pkm = lm(), lm(pkm_layers=(1,), pkm_num_keys=32)
    blocks = with_pkm.transformer.layers.layers
    assert isinstance(blocks[0][1].fn.fn, PKM) and blocks[0][1].fn.fn.num_keys == 32
    assert isinstance(blocks[1][1].fn.fn, FeedForward)
    assert not torch.allclose(with_pkm(x), base(x))
    pkm = PKM(DIM, num_keys=32)
    expected = sum(p.numel() for p in pkm.parameters()) - sum(p.numel() for p in FeedForward(DIM).parameters())
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(with_pkm) - count(base) == expected
    assert count(lm(pkm_layers=(1, 2), pkm_num_keys=32)) - count(base) == 2 * expected
    # The memory values are read: zeroing them changes the logits.
    out = with_pkm(x)
    with torch.no_grad():
        blocks[0][1].fn.fn.values.weight.zero_()
    assert (with_pkm(x) - out).abs().max() > 1e-6


@pytest.mark.parametrize("training", [False, True])
def test_pkm_lm_is_causal(training):
    model = lm(pkm_layers=(1, 2), pkm_num_keys=32, n_local_attn_heads=1, local_attn_window_size=4)
    model.train(training)  # no dropout configured; the query norm must not mix positions in training either
    x = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    assert_causal(model, x, V, (0, 9, N - 1), "pkm")


def test_pkm_lm_decoding_equals_full_forward():
    model = lm(pkm_layers=(2,), pkm_num_keys=32, n_local_attn_heads=2, local_attn_window_size=4, reversible=True)
    assert_steps_equal_full(model, torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1)))


def test_bad_pkm_options_raise_clear_errors():
    with pytest.raises(ValueError, match="pkm_layers"):
        lm(pkm_layers=(0,))
    with pytest.raises(ValueError, match="pkm_layers"):
        lm(pkm_layers=(3,))
    with pytest.raises(ValueError, match="topk"):
        lm(pkm_layers=(1,), pkm_num_keys=8)
    with pytest.raises(ValueError, match="dim_head"):
        PKM(8, dim_head=5)
