"""Decoding token by token through the registry (attend.prefill_heads / step_heads), for every causal method: a
prompt's prefill then one step per position gives exactly what causal attention over the whole sequence gives, with
padding (left and inside) reaching no valid position; recurrent methods keep a state that does not grow."""
import pytest
import torch
from torch import nn

import linear_mha
import modes
from linear_mha.attend import attend_heads, prefill_heads, step_heads

B, H, N, D = 2, 2, 9, 4
CAUSAL = [name for name in modes.ALL_CAUSAL]


def method_and_state(name, dtype=torch.float64):
    options = modes.sized_variant(modes.ALL_VARIANTS[name], N)
    mode = options.pop("mode")
    method = linear_mha.method_class(mode)(**options)
    torch.manual_seed(0)
    state = method.init_state(H, D, {"device": None, "dtype": dtype})
    g = torch.Generator().manual_seed(1)
    for key, tensor in state.items():  # trained maps and mixes, not their start
        if isinstance(tensor, nn.Parameter):
            state[key] = torch.randn(tensor.shape, generator=g, dtype=dtype)
    return method, state


def inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))
    padding = torch.zeros(B, N, dtype=torch.bool)
    padding[0, :2] = True  # left padding, as batched prompts have
    padding[1, 5] = True
    return q, k, v, padding


@pytest.mark.parametrize("prompt", [0, 1, 4, N])
@pytest.mark.parametrize("name", CAUSAL)
def test_prefill_then_steps_equal_causal_attention(name, prompt):
    method, state = method_and_state(name)
    q, k, v, padding = inputs()
    full, _ = attend_heads(method, state, q, k, v, key_padding_mask=padding, is_causal=True)
    cache = {}
    outs = []
    if prompt:
        outs.append(prefill_heads(method, state, q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], cache,
                                  key_padding_mask=padding[:, :prompt]))
    for t in range(prompt, N):
        outs.append(step_heads(method, state, q[:, :, t], k[:, :, t], v[:, :, t], cache, padding=padding[:, t])[:, :, None])
    decoded = torch.cat(outs, dim=2)
    valid = ~padding[:, None, :, None].expand_as(full)
    torch.testing.assert_close(decoded[valid], full[valid], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", [n for n in CAUSAL if linear_mha.method_class(modes.ALL_VARIANTS[n]["mode"]).recurrent])
def test_a_recurrent_state_does_not_grow_with_the_context(name):
    method, state = method_and_state(name)
    q, k, v, _ = inputs()
    cache = {}
    sizes = []
    for t in range(N):
        step_heads(method, state, q[:, :, t], k[:, :, t], v[:, :, t], cache)
        sizes.append(sum(x.numel() for x in cache.values() if isinstance(x, torch.Tensor)))
    assert len(set(sizes[1:])) == 1, sizes


def test_methods_without_a_causal_form_refuse_to_decode():
    method = linear_mha.method_class("efficient")()
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="no causal form"):
        prefill_heads(method, {}, q, q, q, {})
