"""Checks shared by the LM tests: causality by perturbation, masked tokens hidden, incremental decoding against the
full forward, and the tiny models and option sets the decoding tests run."""
import torch

from linear_mha.lm import LinearAttentionTransformerLM


def assert_causal(model, x, vocab, positions, name="", **forward_kwargs):
    """Changing token t leaves every logit before t unchanged (float64) and does change logits from t on."""
    base = model(x, **forward_kwargs)
    for t in positions:
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % vocab
        out = model(y, **forward_kwargs)
        assert torch.allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-12), f"{name}: future token {t} leaked"
        assert (out[:, t:] - base[:, t:]).abs().max() > 1e-6, f"{name}: perturbation at {t} had no effect"


def assert_masked_tokens_reach_nothing(model, x, vocab, hidden=(3, 4, 11, 17)):
    """Changing the tokens an input_mask hides leaves every kept position's logits as they were (float64); without
    the mask the change is seen, so the check is not vacuous."""
    keep = torch.ones(x.shape, dtype=torch.bool)
    keep[:, list(hidden)] = False
    y = x.clone()
    y[:, list(hidden)] = (y[:, list(hidden)] + 5) % vocab
    a, b = model(x, input_mask=keep), model(y, input_mask=keep)
    torch.testing.assert_close(a[:, keep[0]], b[:, keep[0]], rtol=0, atol=1e-12)
    assert (model(x) - model(y)).abs().max() > 1e-6, "the changed tokens are not seen even without the mask"


def assert_steps_equal_full(model, x, input_mask=None):
    """Feeding tokens one by one through model.step gives the logits of one full forward."""
    full = model(x, input_mask=input_mask)
    cache = {}
    steps = torch.stack([model.step(x[:, t], cache, None if input_mask is None else input_mask[:, t])
                         for t in range(x.shape[1])], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)


# Head types and options every incremental-decoding test runs (tiny causal LMs).
DECODING_CONFIGS = {
    "global": dict(),
    "local": dict(n_local_attn_heads=(4, 2), local_attn_window_size=4),
    "blindspot": dict(blindspot_size=3),
    "blindspot_short_conv": dict(blindspot_size=3, short_conv=4, head_norm=True),
    "everything": dict(n_local_attn_heads=2, local_attn_window_size=4, attn_gate=True, local_conv=True,
                       shift_tokens=True, attend_axially=True, reversible=True, use_rotary_emb=True, ff_glu=True,
                       one_kv_head=True, short_conv=3, head_norm=True),
    "delta_block": dict(short_conv=4, head_norm=True, attn_gate=True, n_local_attn_heads=(1, 2),
                        local_attn_window_size=4, local_conv=True, use_rotary_emb=True, global_mode="gated_deltanet"),
}


def tiny_lm(vocab=16, **kw):
    """A seeded 2-layer causal LM in float64 and eval mode, for exact decoding comparisons."""
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(vocab, 32, 2, 64, heads=4, dim_head=8, causal=True, **kw).double().eval()
