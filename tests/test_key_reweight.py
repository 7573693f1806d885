"""key_reweight (RALA's key weights alpha_j = N softmax_j(q̄ . k_j / sqrt(d))) against a per-query loop written
from the definition, with padding, extra keys and garbage; what it cannot do is refused by name."""
import math

import pytest
import torch

import linear_mha.functional as LF
import linear_mha.functional.key_reweight  # noqa: F401
from linear_mha import LinearMultiheadAttention


def loop_reference(q, k, v, phi, mask, extra=None):
    B, H, L, d = q.shape
    out = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        valid = [j for j in range(k.shape[2]) if not mask[b, j]]
        for h in range(H):
            q_mean = q[b, h, valid].mean(0)
            ks, vs = k[b, h, valid], v[b, h, valid]
            if extra is not None:
                ks, vs = torch.cat([ks, extra[0][b, h]]), torch.cat([vs, extra[1][b, h]])
            alpha = torch.softmax(ks @ q_mean / math.sqrt(d), 0)
            for i in range(L):
                w = (phi(q[b, h, i]) @ phi(ks).T) * alpha
                out[b, h, i] = w @ vs / w.sum()
    return out


@pytest.mark.parametrize("mode, phi", [("taylor", LF.taylor_feature_map), ("kernel", LF.elu_feature_map)])
@pytest.mark.parametrize("extras", [False, True])
def test_matches_the_definition_with_padding_and_extra_keys(mode, phi, extras):
    torch.manual_seed(0)
    m = LinearMultiheadAttention(8, 2, mode=mode, key_reweight=True, batch_first=True,
                                 add_bias_kv=extras).double()
    x = torch.randn(2, 7, 8, dtype=torch.float64) * 2
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 4:] = True
    heads = []
    m.out_proj.register_forward_pre_hook(lambda mod, args: heads.append(args[0]))
    m(x, x, x, key_padding_mask=mask)
    q, k, v = (torch.nn.functional.linear(x * ~mask[..., None], w, b).view(2, 7, 2, 4).transpose(1, 2)
               for w, b in zip(m.in_proj_weight.chunk(3), m.in_proj_bias.chunk(3)))
    extra = (m.bias_k.view(1, 2, 1, 4).expand(2, 2, 1, 4), m.bias_v.view(1, 2, 1, 4).expand(2, 2, 1, 4)) \
        if extras else None
    want = loop_reference(q, k, v, phi, mask, extra)
    got = heads[0].view(2, 7, 2, 4).transpose(1, 2)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1, :, :4], want[1, :, :4], rtol=1e-10, atol=1e-10)


def test_padding_garbage_changes_nothing_and_gets_no_gradient():
    torch.manual_seed(1)
    m = LinearMultiheadAttention(8, 2, mode="taylor", key_reweight=True, batch_first=True).double()
    valid = torch.randn(1, 6, 8, dtype=torch.float64)
    small, _ = m(valid, valid, valid)
    padded = torch.cat([valid, 1e3 * torch.randn(1, 4, 8, dtype=torch.float64)], 1).requires_grad_()
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[:, 6:] = True
    out, _ = m(padded, padded, padded, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :6], small, rtol=1e-10, atol=1e-10)
    out[:, :6].sum().backward()
    assert torch.all(padded.grad[:, 6:] == 0)


def test_key_weights_give_zero_not_nan_when_every_key_is_masked():
    q = torch.randn(2, 1, 3, 4)
    mask = torch.tensor([[True] * 3, [False, True, False]])
    alpha = LF.key_reweight.key_weights(q, q, mask, mask)
    assert torch.isfinite(alpha).all() and alpha[0].abs().max() == 0
    torch.testing.assert_close(alpha[1].sum(), torch.tensor(2.0))


def test_what_it_cannot_do_is_refused_by_name():
    m = LinearMultiheadAttention(8, 2, mode="taylor", key_reweight=True, batch_first=True)
    x = torch.randn(1, 5, 8)
    causal_mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="has no causal form with these options"):
        m(x, x, x, attn_mask=causal_mask, is_causal=True)
    with pytest.raises(ValueError, match="needs self-attention"):
        m(x[:, :3], x, x)
    with pytest.raises(ValueError, match="key_reweight must be True or False"):
        LinearMultiheadAttention(8, 2, mode="taylor", key_reweight=1)


def test_nan_padding_reaches_no_valid_output_nor_gradient_without_the_modules_zeroing():
    """Through the method itself (timm and Hugging Face adapters do not zero padded inputs as
    LinearMultiheadAttention does): NaN in padded keys and values, large garbage in padded queries (NaN there makes
    their own rows NaN, as in nn.MultiheadAttention), change nothing valid."""
    from linear_mha.registry import create_method
    method = create_method("taylor", {"key_reweight": True})
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    clean = method.attend(q, k, v, {})
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[:, 6:] = True
    padded = [torch.cat([t, torch.full((1, 2, 3, 4), fill, dtype=torch.float64)], 2).requires_grad_()
              for t, fill in ((q, 1e3), (k, float("nan")), (v, float("nan")))]
    out = method.attend(*padded, {}, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :, :6], clean, rtol=1e-10, atol=1e-10)
    out[:, :, :6].sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad[:, :, 6:].abs().max() == 0 for t in padded)


def test_half_precision_sums_of_queries_do_not_overflow():
    q = torch.full((1, 1, 5000, 4), 20.0, dtype=torch.float16)
    mask = torch.zeros(1, 5000, dtype=torch.bool)
    mask[:, -1] = True
    alpha = LF.key_reweight.key_weights(q, q, mask, mask)
    assert torch.isfinite(alpha).all() and alpha[0, 0, :-1].min() > 0.5
