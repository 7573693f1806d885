"""Linformer layers/models (variable lengths, masks, context, options), LinearSelfAttention, image attention."""
import math

import pytest
import torch

from linear_mha.lm import (ImageLinearAttention, LinearImageAttention, LinearSelfAttention, Linformer, LinformerLM,
                           LinformerSelfAttention)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_linformer_attention_matches_float64_reference():
    torch.manual_seed(0)
    attn = LinformerSelfAttention(16, seq_len=12, k=5, heads=2).double()
    x = rand(2, 9, 16)
    q = attn.to_q(x).reshape(2, 9, 2, 8).transpose(1, 2)
    k = attn.to_k(x).reshape(2, 9, 2, 8).transpose(1, 2)
    v = attn.to_v(x).reshape(2, 9, 2, 8).transpose(1, 2)
    kp, vp = attn.proj_k[:, :9] @ k, attn.proj_v[:, :9] @ v
    ref = torch.softmax(q @ kp.transpose(-1, -2) / math.sqrt(8), -1) @ vp
    ref = attn.to_out(ref.transpose(1, 2).reshape(2, 9, 16))
    torch.testing.assert_close(attn(x), ref, rtol=1e-12, atol=1e-12)


def test_linformer_padding_equals_shorter_sequence_and_length_limit():
    torch.manual_seed(0)
    attn = LinformerSelfAttention(16, seq_len=12, k=4, heads=2).double()
    x = rand(1, 7, 16)
    padded = torch.cat([x, rand(1, 3, 16, seed=5)], dim=1)
    mask = torch.tensor([[True] * 7 + [False] * 3])
    torch.testing.assert_close(attn(padded, input_mask=mask)[:, :7], attn(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="seq_len"):
        attn(rand(1, 13, 16))


def test_linformer_context_one_kv_head_and_share_kv():
    torch.manual_seed(0)
    attn = LinformerSelfAttention(16, seq_len=10, k=4, heads=2).double()
    x, ctx = rand(2, 6, 16), rand(2, 9, 16, seed=1)
    out = attn(x, context=ctx)
    assert out.shape == (2, 6, 16)
    assert (out - attn(x, context=rand(2, 9, 16, seed=2))).abs().max() > 1e-6
    cmask = torch.ones(2, 9, dtype=torch.bool)
    cmask[:, 5:] = False
    ctx2 = ctx.clone()
    ctx2[:, 5:] += 1.0
    torch.testing.assert_close(attn(x, context=ctx, context_mask=cmask), attn(x, context=ctx2, context_mask=cmask))
    shared = LinformerSelfAttention(16, seq_len=10, k=4, heads=2, one_kv_head=True, share_kv=True)
    assert shared.to_k.out_features == 8 and shared.to_v is None and shared.proj_v is None
    assert shared(x.float()).shape == (2, 6, 16)


@pytest.mark.parametrize("reversible", [False, True])
def test_linformer_lm_variable_lengths_and_masks(reversible):
    torch.manual_seed(0)
    model = LinformerLM(20, 32, seq_len=16, depth=2, k=4, heads=4, reversible=reversible).double().eval()
    x = torch.randint(0, 20, (2, 11), generator=torch.Generator().manual_seed(1))
    assert model(x).shape == (2, 11, 20)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[:, 8:] = False
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 20
    torch.testing.assert_close(model(x, input_mask=mask)[:, :8], model(y, input_mask=mask)[:, :8], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    assert Linformer(32, 16, 2, k=4, heads=4)(torch.randn(1, 16, 32)).shape == (1, 16, 32)


@pytest.mark.parametrize("psi", ["elu", torch.exp])
def test_linear_self_attention_causal_step_and_psi(psi):
    torch.manual_seed(0)
    attn = LinearSelfAttention(16, heads=2, causal=True, psi_fn=psi).double()
    x = rand(2, 10, 16)
    full = attn(x)
    cache = {}
    steps = torch.stack([attn.step(x[:, t], cache) for t in range(10)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)
    y = x.clone()
    y[:, 6] += 1.0
    torch.testing.assert_close(attn(y)[:, :6], full[:, :6], rtol=0, atol=1e-12)
    other = LinearSelfAttention(16, heads=2, causal=True, psi_fn="relu").double()
    other.load_state_dict(attn.state_dict())
    assert (other(x) - full).abs().max() > 1e-6  # psi_fn is really used


def test_linear_self_attention_decodes_in_place_without_autograd():
    torch.manual_seed(0)
    attn = LinearSelfAttention(16, heads=2, causal=True).eval()
    x = torch.randn(2, 10, 16)
    cache, states = {}, []
    with torch.inference_mode():
        full = attn(x)
        steps = []
        for t in range(10):
            steps.append(attn.step(x[:, t], cache))
            states.append(cache["state"].data_ptr())
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert len(set(states)) == 1  # one state tensor, updated step after step


def test_linear_self_attention_one_kv_head_and_mask():
    torch.manual_seed(0)
    attn = LinearSelfAttention(16, heads=4, one_kv_head=True).double()
    assert attn.to_kv.out_features == 2 * 4
    x = rand(2, 8, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[:, 5:] = False
    y = x.clone()
    y[:, 5:] += 2.0
    torch.testing.assert_close(attn(x, input_mask=mask)[:, :5], attn(y, input_mask=mask)[:, :5], rtol=0, atol=1e-12)


def test_image_attention_reference_shapes_and_context():
    torch.manual_seed(0)
    attn = ImageLinearAttention(chan=6, heads=2, key_dim=4, value_dim=5).double()
    x = rand(2, 6, 5, 7)
    out = attn(x)
    assert out.shape == (2, 6, 5, 7)
    q = attn.to_q(x).reshape(2, 2, 4, 35) * 4 ** -0.25
    k = attn.to_k(x).reshape(2, 2, 4, 35) * 4 ** -0.25
    v = attn.to_v(x).reshape(2, 2, 5, 35)
    ref = torch.einsum("bhdn,bhde->bhen", q.softmax(dim=-2), torch.einsum("bhdn,bhen->bhde", k.softmax(-1), v))
    torch.testing.assert_close(out, attn.to_out(ref.reshape(2, 10, 5, 7)), rtol=1e-12, atol=1e-12)
    ctx = rand(2, 6, 9, seed=3)
    assert (attn(x, context=ctx) - out).abs().max() > 1e-6
    strided = ImageLinearAttention(chan=6, heads=2, key_dim=4, value_dim=4, kernel_size=3, padding=1, stride=2)
    assert strided(x.float()).shape == (2, 6, 3, 4)
    assert LinearImageAttention is ImageLinearAttention
    assert LinearImageAttention(chan=6, heads=2, key_dim=4)(x.float()).shape == (2, 6, 5, 7)
    with pytest.raises(ValueError, match="chan"):
        attn(rand(2, 5, 4, 4))
