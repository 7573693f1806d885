"""Encoder/decoder usage of the original API (masks exact, gradients reach the encoder) and reversible layers
(custom backward == plain autograd of the same function, dropout included)."""
import pytest
import torch

from linear_mha.lm import LinearAttentionTransformerLM, LinformerContextSettings

V = 16


def enc_dec(dec_kw=None, seed=0):
    torch.manual_seed(seed)
    enc = LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, return_embeddings=True)
    dec = LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, causal=True, receives_context=True,
                                       **(dec_kw or {}))
    return enc.double(), dec.double()


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 10), generator=g)
    src_mask = torch.ones(2, 12, dtype=torch.bool)
    src_mask[1, 8:] = False
    tgt_mask = torch.ones(2, 10, dtype=torch.bool)
    tgt_mask[0, 7:] = False
    return src, tgt, src_mask, tgt_mask


@pytest.mark.parametrize("dec_kw", [dict(), dict(context_linformer_settings=LinformerContextSettings(seq_len=12, k=4)),
                                    dict(reversible=True, attn_gate=True)])
def test_encoder_decoder_masks_are_exact(dec_kw):
    enc, dec = enc_dec(dec_kw)
    enc.eval(), dec.eval()
    src, tgt, src_mask, tgt_mask = data()
    out = dec(tgt, context=enc(src, input_mask=src_mask), input_mask=tgt_mask, context_mask=src_mask)
    assert out.shape == (2, 10, V)
    src2, tgt2 = src.clone(), tgt.clone()
    src2[1, 8:] = (src2[1, 8:] + 1) % V  # masked source tokens
    tgt2[0, 7:] = (tgt2[0, 7:] + 1) % V  # masked target tokens
    out2 = dec(tgt2, context=enc(src2, input_mask=src_mask), input_mask=tgt_mask, context_mask=src_mask)
    torch.testing.assert_close(out2[1], out[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(out2[0, :7], out[0, :7], rtol=0, atol=1e-12)
    src3 = src.clone()
    src3[1, 0] = (src3[1, 0] + 1) % V  # a kept source token must matter
    out3 = dec(tgt, context=enc(src3, input_mask=src_mask), input_mask=tgt_mask, context_mask=src_mask)
    assert (out3[1] - out[1]).abs().max() > 1e-6


def test_decoder_gradient_reaches_the_encoder_and_context_is_required():
    enc, dec = enc_dec(dict(reversible=True))
    src, tgt, src_mask, tgt_mask = data()
    loss = dec(tgt, context=enc(src, input_mask=src_mask), input_mask=tgt_mask, context_mask=src_mask).sum()
    loss.backward()
    assert enc.token_emb.weight.grad is not None and enc.token_emb.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="context"):
        dec(tgt)


@pytest.mark.parametrize("kw", [dict(causal=True, shift_tokens=True, n_local_attn_heads=2, local_attn_window_size=4,
                                     attend_axially=True),
                                dict(causal=True, receives_context=True, local_conv=True)])
def test_reversible_gradients_equal_plain_autograd(kw):
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, reversible=True, ff_dropout=0.3,
                                         attn_layer_dropout=0.2, **kw).double().train()
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (2, 16), generator=g)
    ctx = torch.randn(2, 5, 32, dtype=torch.float64, generator=g) if kw.get("receives_context") else None
    grads = []
    for memory_efficient in (True, False):
        model.transformer.layers.memory_efficient = memory_efficient
        model.zero_grad()
        c = None if ctx is None else ctx.clone().requires_grad_(True)
        torch.manual_seed(7)  # same dropout masks in both runs
        out = model(x, context=c) if c is not None else model(x)
        (out * torch.linspace(-1, 1, V, dtype=torch.float64)).sum().backward()
        grads.append(([p.grad.clone() for p in model.parameters()], out.detach(), None if c is None else c.grad))
    (g_eff, out_eff, c_eff), (g_ref, out_ref, c_ref) = grads
    torch.testing.assert_close(out_eff, out_ref, rtol=0, atol=1e-12)
    for a, b in zip(g_eff, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    if c_ref is not None:
        torch.testing.assert_close(c_eff, c_ref, rtol=1e-9, atol=1e-10)


def test_reversible_layers_get_gradients_when_nothing_below_them_needs_one():
    """Frozen embeddings (or a raw input) leave no input of the reversible stack asking for a gradient; the
    layers' own weights must still get theirs, equal to plain autograd's."""
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, causal=True, reversible=True).double()
    model.token_emb.requires_grad_(False)
    model.pos_emb.requires_grad_(False)
    x = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    layer_params = list(model.transformer.parameters())
    grads = []
    for memory_efficient in (True, False):
        model.transformer.layers.memory_efficient = memory_efficient
        model.zero_grad()
        model(x).square().sum().backward()
        assert all(p.grad is not None for p in layer_params), "a layer weight got no gradient"
        grads.append([p.grad.clone() for p in layer_params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert model.token_emb.weight.grad is None  # frozen stays frozen


def test_a_linformer_context_decoder_generates_with_prefill_like_without():
    from linear_mha.lm import AutoregressiveWrapper
    enc, dec = enc_dec(dict(context_linformer_settings=LinformerContextSettings(seq_len=12, k=4)))
    src, tgt, src_mask, _ = data()
    ctx = enc(src, input_mask=src_mask)
    lm = AutoregressiveWrapper(dec)
    fast = lm.generate(tgt[:, :4], 5, temperature=0, context=ctx, context_mask=src_mask)
    slow = lm.generate(tgt[:, :4], 5, temperature=0, context=ctx, context_mask=src_mask, prefill=False)
    assert torch.equal(fast, slow)
