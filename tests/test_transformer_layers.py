"""Inside nn.TransformerEncoderLayer / DecoderLayer / Encoder our forward runs in eval + no_grad too: torch's fast
path must not run exact softmax on in_proj_weight behind our back, and a NestedTensor from an encoder built
before the swap must be handled."""
import warnings

import pytest
import torch
from torch import nn

from linear_mha import LinearMultiheadAttention
from linear_mha import attention as attention_module

E, H = 16, 2


def swap(layer, attr="self_attn", **options):
    setattr(layer, attr, LinearMultiheadAttention.from_torch(getattr(layer, attr), **options))
    return layer


def count_attend_calls(monkeypatch):
    """The names of the methods LinearMultiheadAttention's forward reaches, in call order."""
    calls = []
    original = attention_module.attend_heads

    def spy(method, *args, **kwargs):
        calls.append(method.name)
        return original(method, *args, **kwargs)

    monkeypatch.setattr(attention_module, "attend_heads", spy)
    return calls


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["kernel", "softmax"])
def test_encoder_layer_eval_no_grad_runs_our_forward(monkeypatch, batch_first, mode):
    torch.manual_seed(0)
    layer = swap(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=batch_first), mode=mode).eval()
    src = torch.randn(2, 7, E) if batch_first else torch.randn(7, 2, E)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    calls = count_attend_calls(monkeypatch)
    with_grad = layer(src, src_key_padding_mask=kpm)
    with torch.no_grad():
        no_grad = layer(src, src_key_padding_mask=kpm)
    assert calls == [mode, mode]
    torch.testing.assert_close(no_grad, with_grad.detach())


def test_decoder_layer_and_transformer_with_causal_masks_run_our_forward(monkeypatch):
    torch.manual_seed(0)
    model = nn.Transformer(E, H, 1, 1, 32, dropout=0.0, batch_first=True)
    for layer in model.encoder.layers:
        swap(layer, mode="kernel")
    for layer in model.decoder.layers:
        swap(layer, "self_attn", mode="taylor")
        swap(layer, "multihead_attn", mode="efficient")
    model.eval()
    src, tgt = torch.randn(2, 9, E), torch.randn(2, 6, E)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(6)
    calls = count_attend_calls(monkeypatch)
    with torch.no_grad():
        out = model(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
    assert sorted(calls) == ["efficient", "kernel", "taylor"]
    # causal decoder: changing the last target token leaves earlier outputs alone
    tgt2 = tgt.clone()
    tgt2[:, -1] += 1.0
    with torch.no_grad():
        out2 = model(src, tgt2, tgt_mask=tgt_mask, tgt_is_causal=True)
    torch.testing.assert_close(out2[:, :-1], out[:, :-1])


def test_nested_tensor_from_an_encoder_built_before_the_swap():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 2,
                                        enable_nested_tensor=True)
    assert encoder.use_nested_tensor
    for layer in encoder.layers:
        swap(layer, mode="kernel")
    encoder.eval()
    src = torch.randn(3, 8, E)
    kpm = torch.zeros(3, 8, dtype=torch.bool)
    kpm[1, 6:] = True
    kpm[2, 3:] = True
    reference = encoder(src, src_key_padding_mask=kpm)  # grad enabled: no nested path
    with torch.no_grad():
        nested_path = encoder(src, src_key_padding_mask=kpm)
    valid = ~kpm
    torch.testing.assert_close(nested_path[valid], reference.detach()[valid], rtol=1e-5, atol=1e-5)
    # and it really was the linear attention, not a softmax fallback
    for layer in encoder.layers:
        layer.self_attn = LinearMultiheadAttention.from_torch(layer.self_attn.to_torch(), mode="softmax").eval()
    with torch.no_grad():
        exact = encoder(src, src_key_padding_mask=kpm)
    assert not torch.allclose(exact[valid], nested_path[valid], atol=1e-3)


def test_nested_inputs_directly():
    m = LinearMultiheadAttention(E, H, mode="taylor", batch_first=True).eval()
    seqs = [torch.randn(n, E) for n in (3, 5)]
    nested = torch.nested.nested_tensor(seqs)
    with torch.no_grad():
        out, _ = m(nested, nested, nested)
        for got, x in zip(out.unbind(), seqs):
            expected, _ = m(x, x, x)
            torch.testing.assert_close(got, expected)
