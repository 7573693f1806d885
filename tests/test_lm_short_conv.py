"""short_conv: the causal depthwise convolution of queries, keys and values before the heads (DeltaNet's and Mamba-2's
short convolution). It is the convolution it says it is (float64, by the definition), its weights are used, a
padded position reaches nothing through it, and bad values are refused. Causality and decoding (prefill and
single steps against the full forward) run in test_lm_causality.py, test_lm_prefill.py and test_lm_generation.py,
whose configurations include it."""
import pytest
import torch

from linear_mha.lm import LinearAttentionTransformerLM, LinformerSettings, SelfAttention
from lm_checks import assert_masked_tokens_reach_nothing

V, N = 16, 24


def lm(**kw):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, causal=True, **kw).double().eval()


def tokens(seed=1):
    return torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(seed))


def differs(a, b):
    return (a - b).abs().max().item() > 1e-6


@pytest.mark.parametrize("taps", [1, 2, 4])
@pytest.mark.parametrize("one_kv_head", [False, True])
def test_queries_keys_and_values_are_the_causal_convolution_of_their_projections(taps, one_kv_head):
    torch.manual_seed(0)
    layer = SelfAttention(16, heads=2, causal=True, short_conv=taps, one_kv_head=one_kv_head).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    projections = torch.cat([layer.to_q(x), layer.to_k(x), layer.to_v(x)], dim=-1)  # (B, N, C)
    weight = layer.short_conv.weight[:, 0]  # (C, K): tap K - 1 weighs the position itself
    expected = torch.zeros_like(projections)
    for t in range(x.shape[1]):
        for back in range(taps):
            if t - back >= 0:
                expected[:, t] += weight[:, taps - 1 - back] * projections[:, t - back]
    q, k, v = layer._project(x)
    # rows of contiguous channels, as the compiled maps and the delta rule take them (Conv1d's transpose is not)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    widths = [layer.to_q.out_features, layer.to_k.out_features, layer.to_v.out_features]
    want = expected.split(widths, dim=-1)
    torch.testing.assert_close(q, layer._heads(want[0], layer.heads), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, layer._heads(want[1], layer.kv_heads), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, layer._heads(want[2], layer.kv_heads), rtol=1e-12, atol=1e-12)


def test_the_convolution_weights_reach_the_output():
    model = lm(short_conv=4)
    x = tokens()
    out = model(x)
    with torch.no_grad():
        model.transformer.layers.layers[0][0].fn.short_conv.weight[:, :, 0].add_(0.5)  # the oldest tap only
    assert differs(out, model(x))


@pytest.mark.parametrize("global_mode", [None, "gated_deltanet"])
def test_a_padded_position_reaches_no_later_one_through_the_convolution(global_mode):
    """The three positions after a masked token read it through a 4-tap convolution unless it enters as zeros."""
    assert_masked_tokens_reach_nothing(lm(short_conv=4, global_mode=global_mode), tokens(), V)


@pytest.mark.parametrize("value", [True, -1, 2.0, "4"])
def test_a_bad_number_of_taps_is_refused(value):
    with pytest.raises(ValueError, match="short_conv is the causal convolution's number of taps"):
        SelfAttention(16, heads=2, causal=True, short_conv=value)


def test_a_non_causal_layer_refuses_it():
    with pytest.raises(ValueError, match="short_conv .* causal self-attention; build the layer with causal=True"):
        SelfAttention(16, heads=2, short_conv=4)
    with pytest.raises(ValueError, match="a context-attention layer .* has no local_conv or short_conv"):
        SelfAttention(16, heads=2, receives_context=True, short_conv=4)
    with pytest.raises(ValueError, match="short_conv.* do not apply"):
        LinearAttentionTransformerLM(V, 32, 1, 64, heads=4, short_conv=4, linformer_settings=LinformerSettings(k=8))


def test_zero_taps_is_no_convolution():
    assert lm(short_conv=0).transformer.layers.layers[0][0].fn.short_conv is None
