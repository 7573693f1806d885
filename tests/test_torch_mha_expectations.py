"""What PyTorch's own MultiheadAttention tests (test/nn/test_multihead_attention.py) expect of the class, held
against LinearMultiheadAttention in every mode where it applies: torch's error classes and messages for inputs of the
wrong rank, empty nested tensors refused, a bias of another dtype than the weights, per-sample 3-D masks, and a
compiled encoder with a padding mask. (tools.outside_suites runs torch's file itself against a checkout.)"""
import pytest
import torch
from torch import nn

import modes
from linear_mha import LinearMultiheadAttention

MODES = ["softmax", "kernel", "taylor"]


def _module(mode, *args, **kwargs):
    return LinearMultiheadAttention(*args, mode=mode, **modes.sized(mode, 8), **kwargs)


BATCHED = [  # (query, key, value, masks) -> torch's message
    (lambda: ((4, 4, 4), (4, 4), (4, 4, 4), {}),
     "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors respectively"),
    (lambda: ((4, 4, 4), (4, 4, 4), (4, 4), {}),
     "expected `key` and `value` to be 3-D but found 3-D and 2-D tensors respectively"),
    (lambda: ((4, 4, 4), (4, 4, 4), (4, 4, 4), {"key_padding_mask": torch.tensor([False, False, True, True])}),
     "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead"),
    (lambda: ((4, 4, 4), (4, 4, 4), (4, 4, 4), {"attn_mask": torch.tensor([False, False, True, True])}),
     "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"),
    (lambda: ((4, 4), (4, 4, 4), (4, 4), {}),
     "expected `key` and `value` to be 2-D but found 3-D and 2-D tensors respectively"),
    (lambda: ((4, 4), (4, 4), (4, 4, 4), {}),
     "expected `key` and `value` to be 2-D but found 2-D and 3-D tensors respectively"),
    (lambda: ((4, 4), (4, 4), (4, 4), {"key_padding_mask": torch.tensor([[False, False, True, True] * 2])}),
     "expected `key_padding_mask` to be `None` or 1-D but found 2-D tensor instead"),
    (lambda: ((4, 4), (4, 4), (4, 4), {"attn_mask": torch.tensor([False, False, True, True])}),
     "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"),
    (lambda: ((4, 4), (4, 4), (4, 4), {"attn_mask": torch.zeros(5, 4, 4, dtype=torch.bool)}),
     r"Expected `attn_mask` shape to be \(4, 4, 4\)"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", range(len(BATCHED)))
@pytest.mark.parametrize("inference", [False, True])
def test_inputs_of_the_wrong_rank_raise_torchs_assertion_and_message(mode, case, inference):
    make, message = BATCHED[case]
    q, k, v, masks = make()
    mha = _module(mode, 4, 4)
    torch_mha = nn.MultiheadAttention(4, 4)
    if inference:  # where torch's fast path could be tried
        mha, torch_mha = mha.eval(), torch_mha.eval()
    with torch.inference_mode(inference):
        for module in (torch_mha, mha):  # torch's class first: the expectation is torch's own
            with pytest.raises(AssertionError, match=message):
                module(torch.randn(q), torch.randn(k), torch.randn(v), **masks)


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_nested_tensor_is_refused_and_jagged_ones_are_attended(mode):
    mha = _module(mode, 10, 5, batch_first=True).eval()
    sequences = [torch.randn(4, 10), torch.randn(6, 10)]
    for layout in (torch.strided, torch.jagged):
        nested = torch.nested.nested_tensor(sequences, layout=layout)
        out, _ = mha(nested, nested, nested)
        assert out.is_nested and out.layout == layout
        for got, seq in zip(out.unbind(), sequences):  # each sequence attends to itself alone, padding unseen
            alone, _ = mha(seq[None], seq[None], seq[None])
            torch.testing.assert_close(got, alone[0])
    empty = torch.nested.nested_tensor([])
    with pytest.raises(AssertionError, match="query should be unbatched 2D or batched 3D tensor but received 1-D"):
        mha(empty, empty, empty)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("separate", [False, True])
def test_an_in_proj_bias_of_another_dtype_is_added_in_the_weights_dtype(mode, separate):
    """torch's test swaps a float16 in_proj_bias into a float64 module; torch then computes in float64."""
    torch.manual_seed(0)
    kdim = {"kdim": 3, "vdim": 3} if separate else {}
    mha = _module(mode, 4, 2, batch_first=True, dtype=torch.float64, **kdim).eval()
    reference = _module(mode, 4, 2, batch_first=True, dtype=torch.float64, **kdim).eval()
    reference.load_state_dict(mha.state_dict())
    mha.in_proj_bias = nn.Parameter(mha.in_proj_bias.half())
    reference.in_proj_bias.data.copy_(mha.in_proj_bias.double())
    query = torch.randn(2, 4, 4, dtype=torch.float64)
    key = torch.randn(2, 4, 3 if separate else 4, dtype=torch.float64)
    with torch.no_grad():
        out, _ = mha(query, key, key)
        torch.testing.assert_close(out, reference(query, key, key)[0])
    assert out.dtype == torch.float64


def test_a_3d_attn_mask_gives_each_sample_its_own_mask():
    torch.manual_seed(0)
    batch, heads, tgt, src = 8, 4, 2, 3
    query, key = torch.rand(batch, tgt, 8), torch.rand(batch, src, 8)
    mask = torch.randint(0, 2, (batch, tgt, src)).float()
    mask = mask.masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, 0.0)
    mha = LinearMultiheadAttention(8, heads, mode="softmax")
    together = mha(query.transpose(0, 1), key.transpose(0, 1), key.transpose(0, 1),
                   attn_mask=mask.repeat_interleave(heads, dim=0))[0].transpose(0, 1)
    for i in range(batch):
        alone = mha(query[i, :, None], key[i, :, None], key[i, :, None], attn_mask=mask[i])[0]
        torch.testing.assert_close(together[i, :, None], alone, equal_nan=True)


@pytest.mark.parametrize("mode", MODES)
def test_no_bias_and_separate_projections(mode):
    mha = _module(mode, 8, 4, bias=False)
    assert mha.in_proj_bias is None and mha.out_proj.bias is None
    mha(torch.rand(2, 2, 8), torch.rand(2, 2, 8), torch.rand(2, 2, 8))
    separate = _module(mode, 4, 4, kdim=2, vdim=2, dtype=torch.float64)
    assert separate.in_proj_weight is None
    key = torch.rand(4, 4, 2, dtype=torch.float64)
    separate(torch.rand(4, 4, 4, dtype=torch.float64), key, key)


@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"), reason="needs the dynamo of torch >= 2.6")
@pytest.mark.parametrize("mode", ["softmax", "kernel"])
def test_an_encoder_with_a_padding_mask_compiles_with_fullgraph(mode):
    """torch's test: TransformerEncoder in eval, a bool src_key_padding_mask, torch.compile(fullgraph=True)."""
    import linear_mha
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=8, batch_first=True, dtype=torch.float64)
    encoder = nn.TransformerEncoder(layer, num_layers=2).eval()
    linear_mha.patch(encoder, mode=mode)
    x = torch.randn(1, 41, 64, dtype=torch.float64)
    padding = torch.rand(1, 41) > 0.5
    padding[..., 0] = True
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(encoder, fullgraph=True, backend="aot_eager")(x, src_key_padding_mask=padding)
        torch.testing.assert_close(compiled, encoder(x, src_key_padding_mask=padding))
