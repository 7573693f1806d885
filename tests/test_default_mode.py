"""The one-line import change works at any length with no argument added, and the Linformer call this package
descends from (seq_len=, proj_k=, param_sharing=) keeps running Linformer."""
import pytest
import torch

import linear_mha
from linear_mha import LinearMultiheadAttention as MultiheadAttention


@pytest.mark.parametrize("tokens", [10, 1000, 10000])
def test_a_bare_module_takes_any_length(tokens):
    attn = MultiheadAttention(64, 8)
    x = torch.randn(tokens, 2, 64)
    padding = torch.zeros(2, tokens, dtype=torch.bool)
    padding[1, tokens // 2:] = True
    out, weights = attn(x, x, x, key_padding_mask=padding)
    assert out.shape == (tokens, 2, 64) and weights is None and torch.isfinite(out).all()
    assert attn.mode == linear_mha.registry.SEQUENCE_DEFAULT
    causal, _ = attn(x, x, x, is_causal=True)  # and causal
    assert torch.isfinite(causal).all()


def test_linformers_options_choose_linformer_as_they_did():
    seed_call = MultiheadAttention(64, 8, seq_len=256, proj_k=32, param_sharing="layerwise")
    assert seed_call.mode == "linformer" and seed_call.method.seq_len == 256 and seed_call.method.proj_k == 32
    assert MultiheadAttention(64, 8, seq_len=100).mode == "linformer"
    x = torch.randn(300, 1, 64)
    with pytest.raises(ValueError, match="seq_len"):
        MultiheadAttention(64, 8, seq_len=100)(x, x, x)  # Linformer's bound is its own, and says so


def test_patch_and_patched_choose_the_same_default():
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, 64), 1, enable_nested_tensor=False)
    report = linear_mha.patch(model)
    assert report.mode == "taylor" and model.layers[0].self_attn.mode == "taylor"
    with linear_mha.patched():
        assert torch.nn.MultiheadAttention(32, 4).mode == "taylor"
    with linear_mha.patched(seq_len=16):
        assert torch.nn.MultiheadAttention(32, 4).mode == "linformer"
