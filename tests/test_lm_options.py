"""Every LinearAttentionTransformerLM option changes behaviour, and the attention pieces match float64 references."""
import pytest
import torch

from linear_mha.lm import FeedForward, LinearAttentionTransformerLM, LinformerSelfAttention, SelfAttention
from linear_mha import method_class
from linear_mha.attend import attend_heads
from linear_mha.functional import block_local_attention
from linear_mha.lm.blindspot import bucket_attention
import modes
from lm_checks import assert_causal, assert_masked_tokens_reach_nothing, assert_steps_equal_full

V, N = 16, 24


def lm(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("heads", 4)
    kw.setdefault("dim_head", 8)
    return LinearAttentionTransformerLM(V, 32, 2, 64, **kw).double().eval()


def tokens(seed=1, n=N):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


def differs(a, b):
    return (a - b).abs().max().item() > 1e-6


# Options without parameters of their own: same weights, the option alone must change the output.
@pytest.mark.parametrize("option", [
    dict(causal=True), dict(n_local_attn_heads=2, local_attn_window_size=4), dict(shift_tokens=True),
    dict(reversible=True), dict(causal=True, blindspot_size=4), dict(one_kv_head=False),
])
def test_parameter_free_option_changes_output(option):
    base_kw = {"causal": True} if "blindspot_size" in option else {}
    base = lm(**base_kw)
    other = lm(**{**base_kw, **option})
    if option == dict(one_kv_head=False):  # compare one shared kv head with per-head kv instead
        base, other = lm(one_kv_head=True), lm()
        assert other.transformer.layers.layers[0][0].fn.to_k.out_features == 4 * 8
        assert base.transformer.layers.layers[0][0].fn.to_k.out_features == 8
        return
    other.load_state_dict(base.state_dict())
    x = tokens()
    assert differs(base(x), other(x))


def test_window_size_and_per_layer_local_heads():
    x = tokens(n=40)
    a, b = lm(n_local_attn_heads=2, local_attn_window_size=4), lm(n_local_attn_heads=2, local_attn_window_size=16)
    b.load_state_dict(a.state_dict())
    assert differs(a(x), b(x))
    c = lm(n_local_attn_heads=(4, 0))
    assert [blk[0].fn.n_local for blk in c.transformer.layers.layers] == [4, 0]
    with pytest.raises(ValueError, match="n_local_attn_heads"):
        lm(n_local_attn_heads=(1, 2, 3))


def test_rotary_replaces_absolute_positions_and_is_used():
    m = lm(use_rotary_emb=True)
    assert m.pos_emb is None
    x = tokens()
    out = m(x)
    for blk in m.transformer.layers.layers:
        blk[0].fn.rotary = False
    assert differs(out, m(x))


@pytest.mark.parametrize("option,param", [("attn_gate", "gate"), ("local_conv", "conv"),
                                          ("head_norm", "head_norm")])
def test_gate_conv_and_norm_parameters_reach_the_output(option, param):
    m = lm(causal=True, **{option: True})
    x = tokens()
    out = m(x)
    with torch.no_grad():
        getattr(m.transformer.layers.layers[0][0].fn, param).weight.mul_(3.0)
    assert differs(out, m(x))


@pytest.mark.parametrize("n_local, local_conv", [(0, False), (1, False), (1, True)])
def test_head_norm_gives_each_heads_output_unit_rms_times_its_scale(n_local, local_conv):
    """Normalising over all heads together, or over positions, would leave single heads off unit RMS; so would
    normalising after the local term is added."""
    torch.manual_seed(0)
    layer = SelfAttention(16, heads=2, causal=True, head_norm=True, n_local_attn_heads=n_local,
                          local_attn_window_size=4, local_conv=local_conv).double()
    with torch.no_grad():
        layer.head_norm.weight.uniform_(0.5, 2.0)
    layer.head_norm.eps = 1e-12  # its 1e-5 shifts a small head's RMS by up to eps / mean square
    seen = []
    layer.to_out.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    layer(x)
    heads = seen[0].reshape(2, 7, 2, 8)  # (B, N, H, D)
    if local_conv:
        heads = heads - layer._conv(layer._project(x)[2], None).transpose(1, 2)
    heads = heads / layer.head_norm.weight
    torch.testing.assert_close(heads.pow(2).mean(-1), torch.ones(2, 7, 2, dtype=torch.float64), rtol=1e-8, atol=1e-8)


def test_glu_and_ff_dropout_reach_every_feed_forward():
    m = lm(ff_glu=True, ff_dropout=0.5, attend_axially=True, local_attn_window_size=4, receives_context=True)
    ffs = [mod for mod in m.modules() if isinstance(mod, FeedForward)]
    assert len(ffs) == 6 and all(f.glu and f.dropout.p == 0.5 for f in ffs)
    m.train()
    x, ctx = tokens(), torch.randn(2, 5, 32, dtype=torch.float64)
    assert differs(m(x, context=ctx), m(x, context=ctx))


@pytest.mark.parametrize("kw", [dict(attn_layer_dropout=0.5),
                                dict(attn_dropout=0.5, n_local_attn_heads=4, local_attn_window_size=4),
                                dict(attn_dropout=0.5), dict(attn_dropout=0.5, causal=True)])
def test_attention_dropouts_are_active_in_training_only(kw):
    m = lm(**kw)
    x = tokens()
    assert not differs(m(x), m(x))
    m.train()
    assert differs(m(x), m(x))


def test_ff_chunks_equal_unchunked():
    a, b = lm(ff_chunks=1), lm(ff_chunks=5)
    b.load_state_dict(a.state_dict())
    x = tokens()
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=1e-12)
    assert b.transformer.layers.layers[0][1].fn.chunks == 5


def test_emb_dim_and_return_embeddings():
    m = lm(emb_dim=8)
    assert m.token_emb.embedding_dim == 8 and m(tokens()).shape == (2, N, V)
    e = lm(emb_dim=8, return_embeddings=True)
    assert e(tokens()).shape == (2, N, 32)


def test_attend_axially_adds_folded_layers():
    m = lm(causal=True, attend_axially=True, local_attn_window_size=4)
    assert len(m.transformer.layers.layers) == 4
    x = tokens()
    out = m(x)
    with torch.no_grad():
        m.transformer.layers.layers[1][0].fn.fn.to_out.weight.mul_(2.0)
    assert differs(out, m(x))


def test_linformer_settings_switch_self_attention():
    from linear_mha.lm import LinformerSettings
    m = lm(linformer_settings=LinformerSettings(k=8))
    assert isinstance(m.transformer.layers.layers[0][0].fn, LinformerSelfAttention)
    x, mask = tokens(), torch.ones(2, N, dtype=torch.bool)
    mask[:, -5:] = False
    y = x.clone()
    y[:, -5:] = (y[:, -5:] + 3) % V
    torch.testing.assert_close(m(x, input_mask=mask)[:, :-5], m(y, input_mask=mask)[:, :-5], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="causal"):
        lm(causal=True, linformer_settings=LinformerSettings(k=8))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(n_local_attn_heads=2, local_attn_window_size=4), dict(shift_tokens=True),
                                dict(local_conv=True), dict(attend_axially=True, local_attn_window_size=4)])
def test_input_mask_hides_masked_tokens(causal, kw):
    assert_masked_tokens_reach_nothing(lm(causal=causal, **kw), tokens(), V)


def test_causal_global_matches_quadratic_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(2, 10, generator=g) > 0.3
    method = method_class("feature_softmax")()  # the causal global heads' default
    for b in (1, 3):
        out = (attend_heads(method, {}, q, k, v, key_padding_mask=~keep, is_causal=True)[0] if b == 1
               else bucket_attention(method, {}, q, k, v, ~keep, b))
        w = torch.softmax(q, -1) @ torch.softmax(k, -1).transpose(-1, -2)
        i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
        visible = (j <= i) if b == 1 else (j // b < i // b)
        w = w * visible * keep[:, None, None, :]
        den = w.sum(-1, keepdim=True)
        ref = (w @ v) / torch.where(den > 0, den, torch.ones_like(den))
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, w", [(11, 4), (8, 8), (5, 8)])  # several blocks; one block (the softmax LM's heads)
@pytest.mark.parametrize("causal", [False, True])
def test_local_attention_matches_banded_softmax_reference(causal, n, w):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(2, n, generator=g) > 0.3
    out = block_local_attention(q, k, v, w, causal=causal, key_padding_mask=~keep)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    band = (j // w >= i // w - 1) & (j // w <= i // w + (0 if causal else 1))
    if causal:
        band = band & (j <= i)
    allowed = band & keep[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) / 2.0
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    ref = weights.nan_to_num(0.0) @ v  # a query that sees no key (a padded one) gets 0
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_blindspot_hides_own_bucket():
    torch.manual_seed(0)
    attn = SelfAttention(16, heads=2, causal=True, blindspot_size=4).double()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    y = x.clone()
    y[:, 4] += 1.0  # bucket 1 = positions 4..7; positions 5..7 must not see key 4
    a, b = attn(x), attn(y)
    torch.testing.assert_close(a[:, 5:8], b[:, 5:8], rtol=0, atol=1e-12)
    assert differs(a[:, 8:], b[:, 8:])


def test_bad_inputs_raise_clear_errors():
    m = lm()
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(TypeError, match="input_mask"):
        m(tokens(), input_mask=torch.ones(2, N))
    with pytest.raises(ValueError, match="blindspot_size"):
        lm(blindspot_size=2)
    with pytest.raises(ValueError, match="num_tokens"):
        m(torch.full((1, 3), V))


def test_a_misspelt_keyword_reaches_no_catch_all():
    """Every layer of the stack names the keywords it takes: a typo is a TypeError, never silently ignored."""
    from linear_mha.lm.feedforward import FeedForward
    from linear_mha.lm.self_attention import SelfAttention
    x = torch.randn(1, 4, 8)
    mask = torch.ones(1, 4, dtype=torch.bool)
    for layer, keyword in ((FeedForward(8), "padding"), (SelfAttention(8, heads=2, causal=True), "input_mask")):
        layer(x, **{keyword: mask})
        with pytest.raises(TypeError, match=keyword[:-1]):
            layer(x, **{keyword[:-1]: mask})


def test_a_layer_takes_a_keep_mask_from_users_and_a_padding_mask_from_the_stack():
    """The stack hands its layers padding masks (True = padding) converted once from the user's keep-mask; a
    layer reading one convention as the other would attend to exactly the wrong keys."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    for layer in (SelfAttention(8, heads=2, n_local_attn_heads=1, local_attn_window_size=2, local_conv=True),
                  LinformerSelfAttention(8, seq_len=6, k=3, heads=2)):
        layer = layer.double()
        torch.testing.assert_close(layer(x, padding=~keep), layer(x, input_mask=keep), rtol=0, atol=0)
        assert differs(layer(x, padding=keep)[1, :4], layer(x, input_mask=keep)[1, :4])
        with pytest.raises(ValueError, match="not both"):
            layer(x, input_mask=keep, padding=~keep)


def test_step_checks_its_keep_mask():
    m = LinearAttentionTransformerLM(num_tokens=V, dim=16, depth=1, max_seq_len=8, heads=2, causal=True)
    with pytest.raises(ValueError, match=r"mask_t must have shape \(batch,\) = \(2,\)"):
        m.step(torch.zeros(2, dtype=torch.long), {}, torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask_t must be a bool tensor"):
        m.step(torch.zeros(2, dtype=torch.long), {}, torch.ones(2))


@pytest.mark.parametrize("mode", modes.LINEAR_CAUSAL + ["softmax"])
def test_any_causal_method_of_the_registry_runs_the_global_heads(mode):
    """The LM's global heads get their attention from the registry: a causal LM built on any causal method decodes
    token by token exactly as it forwards, padding included, and never sees the future."""
    torch.manual_seed(0)
    m = LinearAttentionTransformerLM(16, 32, 2, 24, heads=4, dim_head=8, causal=True, n_local_attn_heads=2,
                                     local_attn_window_size=4, global_mode=mode,
                                     global_options=modes.sized(mode, 24)).double().eval()
    x = torch.randint(0, 16, (2, 24), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 24, dtype=torch.bool)
    keep[1, :3] = False  # a left-padded prompt
    assert_steps_equal_full(m, x)
    assert_steps_equal_full(m, x, input_mask=keep)
    assert_causal(m, x, 16, positions=[0, 11, 23], name=mode)


def test_global_methods_that_cannot_serve_are_refused():
    with pytest.raises(ValueError, match="no causal form"):
        SelfAttention(16, heads=2, causal=True, global_mode="linformer")
    with pytest.raises(ValueError, match="blindspot_size > 1 buckets the keys of a feature-map method"):
        SelfAttention(16, heads=2, causal=True, blindspot_size=2, global_mode="softmax")
    with pytest.raises(ValueError, match="every head is local"):
        SelfAttention(16, heads=2, n_local_attn_heads=2, global_mode="taylor")
    with pytest.raises(ValueError, match="has no option 'windw'"):
        SelfAttention(16, heads=2, global_mode="hedgehog", global_options={"windw": 2})
