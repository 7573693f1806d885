"""Property tests (hypothesis) over random shapes, modes and masks: batch independence, padding invariance
and causality hold for every mode, not just the shapes someone thought of."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import modes
from linear_mha import LinearMultiheadAttention

MODES = list(modes.VARIANTS)
CAUSAL = modes.CAUSAL_VARIANTS
SETTINGS = settings(max_examples=25, deadline=None)


def build(name, heads, head_dim, seq_len, seed):
    torch.manual_seed(seed)
    options = dict(modes.ALL_VARIANTS[name])
    mode = options.pop("mode")
    return LinearMultiheadAttention(heads * head_dim, heads, mode=mode,
                                    **options, **modes.sized(mode, seq_len, proj_k=4)).double()


shapes = st.fixed_dictionaries({
    "heads": st.integers(1, 3), "head_dim": st.integers(1, 5), "batch": st.integers(2, 4),
    "length": st.integers(1, 12), "seed": st.integers(0, 2 ** 16),
})


@SETTINGS
@given(name=st.sampled_from(MODES), s=shapes)
def test_batch_independence(name, s):
    m = build(name, s["heads"], s["head_dim"], s["length"], s["seed"])
    g = torch.Generator().manual_seed(s["seed"])
    x = torch.randn(s["length"], s["batch"], m.embed_dim, generator=g, dtype=torch.float64)
    out, _ = m(x, x, x)
    x2 = x.clone()
    x2[:, -1] = torch.randn(s["length"], m.embed_dim, generator=g, dtype=torch.float64)
    out2, _ = m(x2, x2, x2)
    torch.testing.assert_close(out2[:, :-1], out[:, :-1], rtol=0, atol=0)


@SETTINGS
@given(name=st.sampled_from(MODES), s=shapes, valid=st.integers(1, 12), pad=st.integers(1, 5))
def test_padding_invariance(name, s, valid, pad):
    valid = min(valid, s["length"])
    m = build(name, s["heads"], s["head_dim"], s["length"] + pad, s["seed"])
    g = torch.Generator().manual_seed(s["seed"])
    q = torch.randn(3, s["batch"], m.embed_dim, generator=g, dtype=torch.float64)
    mem = torch.randn(s["length"], s["batch"], m.embed_dim, generator=g, dtype=torch.float64)
    kpm = torch.zeros(s["batch"], s["length"], dtype=torch.bool)
    kpm[:, valid:] = True
    self_attention = m.method.self_attention_only  # the queries are the keys' positions: padding is queries too
    out, _ = m(mem if self_attention else q, mem, mem, key_padding_mask=kpm)
    junk = 100 * torch.randn(pad, s["batch"], m.embed_dim, generator=g, dtype=torch.float64)
    padded = torch.cat([mem, junk])
    kpm2 = torch.cat([kpm, torch.ones(s["batch"], pad, dtype=torch.bool)], dim=1)
    out2, _ = m(padded if self_attention else q, padded, padded, key_padding_mask=kpm2)
    if self_attention:  # the valid positions' rows; padded positions' own rows are padding's
        out, out2 = out[:valid], out2[:valid]
    torch.testing.assert_close(out2, out, rtol=1e-9, atol=1e-9)


@SETTINGS
@given(name=st.sampled_from(CAUSAL), s=shapes, t=st.integers(0, 11))
def test_causality(name, s, t):
    t = min(t, s["length"] - 1)
    m = build(name, s["heads"], s["head_dim"], s["length"], s["seed"])
    m.method.chunk_size = 4  # several chunks even for short sequences
    g = torch.Generator().manual_seed(s["seed"])
    x = torch.randn(s["length"], s["batch"], m.embed_dim, generator=g, dtype=torch.float64)
    out, _ = m(x, x, x, is_causal=True)
    x2 = x.clone()
    x2[t:] += 10 * torch.randn(x2[t:].shape, generator=g, dtype=torch.float64)
    out2, _ = m(x2, x2, x2, is_causal=True)
    torch.testing.assert_close(out2[:t], out[:t], rtol=0, atol=1e-12)
    # ... and the other direction: from t on, the outputs see the changed positions (at least their own), so a mode
    # that masked too much (the present, or everything) fails here. With one feature per head, taylor's weight
    # 1 + q.k / (|q||k|) is exactly 0 whenever q and k point apart, and a row can then be 0 before and after.
    if s["head_dim"] > 1:
        assert (out2[t:] - out[t:]).abs().amax() > 1e-6
