"""Batched prompt prefill: one parallel pass leaves exactly the decoding state of P single-token steps (float64),
for every head type and option; generate() gives the same tokens with and without it, in fewer model calls."""
import pytest
import torch

from linear_mha.lm import AutoregressiveWrapper, LinearAttentionTransformerLM
from lm_checks import DECODING_CONFIGS, tiny_lm

V = 16

CONFIGS = {
    **DECODING_CONFIGS,
    "everything": dict(DECODING_CONFIGS["everything"], ff_chunks=2),
    "axial_pos_pkm": dict(use_axial_pos_emb=True, pkm_layers=(1,), pkm_num_keys=32, emb_dim=8,
                          n_local_attn_heads=1, local_attn_window_size=4, local_conv=True),
}


def tokens(n, seed=1):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("prompt_len", [1, 3, 13])
def test_prefill_then_steps_equal_steps_only(name, prompt_len):
    model = tiny_lm(**CONFIGS[name])
    x = tokens(prompt_len + 9)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(2, x.shape[1], generator=g) > 0.25
    for m in (None, mask):
        mt = (lambda t: None) if m is None else (lambda t: m[:, t])
        ref_cache = {}
        ref = torch.stack([model.step(x[:, t], ref_cache, mt(t)) for t in range(x.shape[1])], dim=1)
        cache = {}
        head = model.prefill(x[:, :prompt_len], cache, None if m is None else m[:, :prompt_len])
        tail = [model.step(x[:, t], cache, mt(t)) for t in range(prompt_len, x.shape[1])]
        torch.testing.assert_close(torch.cat([head, torch.stack(tail, dim=1)], dim=1), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [dict(), dict(head_norm=True, short_conv=3)])
def test_prefill_with_context_decoder(options):
    torch.manual_seed(0)
    dec = LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, causal=True, receives_context=True,
                                       n_local_attn_heads=1, local_attn_window_size=4, **options).double().eval()
    x, ctx = tokens(12), torch.randn(2, 7, 32, dtype=torch.float64)
    cmask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    full = dec(x, context=ctx, context_mask=cmask)
    cache = {}
    head = dec.prefill(x[:, :5], cache, context=ctx, context_mask=cmask)
    tail = [dec.step(x[:, t], cache, context=ctx, context_mask=cmask) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat([head, torch.stack(tail, dim=1)], dim=1), full, rtol=1e-10, atol=1e-10)


class CallCounter:
    def __init__(self, model):
        self.calls = {"step": 0, "prefill": 0}
        for name in self.calls:
            original = getattr(model, name)

            def counted(*a, _original=original, _name=name, **k):
                self.calls[_name] += 1
                return _original(*a, **k)

            setattr(model, name, counted)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_with_prefill_equals_token_by_token(temperature):
    model = tiny_lm(**CONFIGS["everything"])
    wrapper = AutoregressiveWrapper(model)
    prompt = tokens(11)
    mask = torch.ones_like(prompt, dtype=torch.bool)
    mask[1, :3] = False

    def run(prefill):
        g = torch.Generator().manual_seed(5)
        return wrapper.generate(prompt, 8, temperature=temperature, top_k=8, input_mask=mask, generator=g,
                                prefill=prefill)

    assert torch.equal(run(True), run(False))


def test_prefill_logits_feed_the_first_sample():
    """The first generated token comes from the prompt's last logits, identical on both paths."""
    model = tiny_lm(**CONFIGS["local"])
    prompt = tokens(9)
    ref_cache = {}
    for t in range(9):
        ref = model.step(prompt[:, t], ref_cache)
    torch.testing.assert_close(model.prefill(prompt, {})[:, -1], ref, rtol=1e-10, atol=1e-10)


def test_prefill_replaces_per_token_calls_for_a_long_prompt():
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(V, 16, 1, 300, heads=2, dim_head=8, causal=True, n_local_attn_heads=1,
                                         local_attn_window_size=16).double().eval()
    counter = CallCounter(model)
    wrapper = AutoregressiveWrapper(model)
    prompt = tokens(256)
    fast = wrapper.generate(prompt, 4, temperature=0.0)
    assert counter.calls == {"step": 3, "prefill": 1}
    counter.calls.update(step=0, prefill=0)
    slow = wrapper.generate(prompt, 4, temperature=0.0, prefill=False)
    assert counter.calls == {"step": 256 + 3, "prefill": 0}
    assert torch.equal(fast, slow)


def test_prefill_errors():
    model = tiny_lm()
    cache = {}
    model.prefill(tokens(3), cache)
    with pytest.raises(ValueError, match="empty cache"):
        model.prefill(tokens(3), cache)
    with pytest.raises(ValueError, match="causal=True"):
        LinearAttentionTransformerLM(V, 32, 1, 64, heads=4).prefill(tokens(3), {})
