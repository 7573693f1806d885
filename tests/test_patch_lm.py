"""patch()/calibrate() on the LM stack: SelfAttention's softmax (local) heads swapped for a registry method, the
projections, rotary embeddings, global heads, gate, conv, short convolution and head norm kept as they were."""
import copy

import pytest
import torch

import modes
from lm_checks import assert_causal, assert_steps_equal_full
from linear_mha import calibrate, patch, unpatch
from linear_mha.lm import LinearAttentionTransformerLM, PatchedSelfAttention, SelfAttention
from reference import hedgehog_features, two_map_weights

SEQ = 24
# Every softmax head sees the whole sequence (window >= max_seq_len): the layers patch() converts exactly.
CONFIGS = {
    "softmax_lm": dict(n_local_attn_heads=4, local_attn_window_size=SEQ),
    "hybrid_everything": dict(n_local_attn_heads=2, local_attn_window_size=SEQ, attn_gate=True, local_conv=True,
                              use_rotary_emb=True, one_kv_head=True, reversible=True, ff_glu=True, short_conv=3,
                              head_norm=True),
}


def lm(causal=True, **kw):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(16, 32, 2, SEQ, heads=4, dim_head=8, causal=causal, **kw).double().eval()


def tokens(batch=2, n=SEQ, seed=1):
    return torch.randint(0, 16, (batch, n), generator=torch.Generator().manual_seed(seed))


def patched(model, mode="hedgehog", **options):
    model = copy.deepcopy(model)
    report = patch(model, mode, **options)
    return model, report


def keep_mask(n=SEQ):
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - 5:] = False  # right padding: every kept query keeps its keys
    return mask


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_softmax_mode_reproduces_the_lm(config, causal):
    """mode='softmax' runs the same computation as the local heads: a wrong head slice, a lost rotary or a
    dropped gate/conv shows up as a difference."""
    kw = dict(CONFIGS[config])
    if not causal:
        kw.pop("reversible", None)
        kw.pop("short_conv", None)  # causal only
    model = lm(causal=causal, **kw)
    converted, report = patched(model, "softmax")
    assert [new for _, _, new in report.replaced] == [PatchedSelfAttention] * 2
    x, mask = tokens(), keep_mask()
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-12)
    kept = mask[:, :, None]
    torch.testing.assert_close(converted(x, input_mask=mask) * kept, model(x, input_mask=mask) * kept, rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_hedgehog_heads_match_float64_reference(causal):
    model = lm(causal=causal, **CONFIGS["hybrid_everything"] if causal else CONFIGS["softmax_lm"])
    converted, _ = patched(model, "hedgehog", feature_dim=6)
    layer = converted.transformer.layers.layers[0][0].fn
    assert isinstance(layer, PatchedSelfAttention) and layer.n_local == layer.hedgehog_q_weight.shape[0]
    with torch.no_grad():  # maps away from the identity start, so a swapped q/k map would show
        for p in (layer.hedgehog_q_weight, layer.hedgehog_k_weight, layer.hedgehog_q_bias, layer.hedgehog_k_bias):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.5)
    x = torch.randn(2, SEQ, 32, dtype=torch.float64)
    padding = ~keep_mask()
    q, k, v = layer._project(x)
    l = layer.n_local
    got = layer._local_heads(q[:, :l], k[:, :l], v[:, :l], padding, 0.0)
    weights = two_map_weights(hedgehog_features(q[:, :l], layer.hedgehog_q_weight, layer.hedgehog_q_bias),
                              hedgehog_features(k[:, :l], layer.hedgehog_k_weight, layer.hedgehog_k_bias),
                              padding, causal)
    torch.testing.assert_close(got, weights @ v[:, :l], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", [dict(mode="hedgehog"), dict(mode="hedgehog", window=3), dict(mode="taylor")],
                         ids=["hedgehog", "hedgehog_window3", "taylor"])
def test_patched_lm_decodes_as_it_forwards_and_never_sees_the_future(options):
    converted, _ = patched(lm(**CONFIGS["hybrid_everything"]), **options)
    x = tokens()
    assert_steps_equal_full(converted, x)
    assert_steps_equal_full(converted, x, input_mask=keep_mask())
    cache = {}
    prompt = converted.prefill(x[:, :10], cache)
    rest = torch.stack([converted.step(x[:, t], cache) for t in range(10, SEQ)], dim=1)
    torch.testing.assert_close(torch.cat([prompt, rest], dim=1), converted(x), rtol=1e-10, atol=1e-10)
    assert_causal(converted, x, 16, positions=[0, 7, SEQ - 1], name=options["mode"])


@pytest.mark.parametrize("mode", modes.LINEAR)
def test_padding_reaches_no_kept_output_or_gradient(mode):
    causal = mode in modes.LINEAR_CAUSAL
    model = lm(causal=causal, **CONFIGS["softmax_lm"])
    converted, _ = patched(model, mode, **modes.sized(mode, SEQ))
    mask = keep_mask()
    emb = converted.token_emb(tokens()).detach().requires_grad_(True)
    h = converted.transformer(emb, input_mask=mask)
    assert torch.isfinite(h).all()
    h[mask].sum().backward()
    assert emb.grad[~mask].abs().max() == 0, "a padded token reached a kept output"
    assert emb.grad[mask].abs().max() > 0


def test_checkpoints_load_both_ways_and_unpatch_keeps_trained_weights():
    model = lm(**CONFIGS["softmax_lm"])
    converted, report = patched(model, "hedgehog", window=2)
    added = set(converted.state_dict()) - set(model.state_dict())
    assert added and all(key.rsplit(".", 1)[1].startswith("hedgehog_") for key in added)
    assert report.parameters_added == sum(converted.state_dict()[key].numel() for key in added)
    assert not converted.load_state_dict(model.state_dict(), strict=True).missing_keys  # an original checkpoint
    layer = converted.transformer.layers.layers[1][0].fn
    original = layer.original
    assert layer.to_q is original.to_q  # the very same submodules, so training one trains the other
    with torch.no_grad():
        layer.to_q.weight.add_(1.0)
    trained = layer.to_q.weight.clone()
    unpatch(converted)
    back = converted.transformer.layers.layers[1][0].fn
    assert type(back) is SelfAttention and back is original
    torch.testing.assert_close(back.to_q.weight, trained, rtol=0, atol=0)
    assert set(converted.state_dict()) == set(model.state_dict())


def test_layers_without_softmax_heads_are_skipped_with_the_reason():
    model = lm()  # every head global linear attention
    report = patch(model, "hedgehog")
    assert not report.replaced and len(report.skipped) == 2
    assert all("already global linear attention" in why for _, _, why in report.skipped)


@pytest.mark.parametrize("options, message", [
    (dict(mode=modes.LINEAR_NON_CAUSAL[0]), "no causal form"),
    (dict(mode="hedgehog", dwc_kernel=3), "local_conv"),
] + [(dict(mode=m), "token grid") for m in modes.GRID], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_refusals_name_the_fix(options, message):
    model = lm(**CONFIGS["softmax_lm"])
    options = {**options, **modes.sized(options["mode"], SEQ)}
    with pytest.raises(ValueError, match=message):
        patch(model, **options)
    assert all(type(m) is not PatchedSelfAttention for m in model.modules())


def test_sequence_length_option_defaults_to_the_lms_max_seq_len():
    mode = next(m for m in modes.LINEAR_NON_CAUSAL if __import__("linear_mha").method_class(m).sequence_length_option)
    converted, _ = patched(lm(causal=False, **CONFIGS["softmax_lm"]), mode)
    option = __import__("linear_mha").method_class(mode).sequence_length_option
    layers = [m for m in converted.modules() if isinstance(m, PatchedSelfAttention)]
    assert layers and all(m.method.option_values[option] == SEQ for m in layers)
    assert torch.isfinite(converted(tokens())).all()


def test_calibrate_fits_the_lm_against_its_own_softmax():
    model = lm(**CONFIGS["hybrid_everything"])
    x = [tokens(4, seed=s) for s in range(4)]
    # The teacher IS this computation: no error to start with, also when patched in training mode with attention
    # dropout (the kept original must run in eval mode like the student, not drop weights of the target).
    exact, _ = patched(lm(**CONFIGS["hybrid_everything"], attn_dropout=0.5).train(), "softmax")
    with pytest.raises(ValueError, match="nothing to train"):
        calibrate(exact, x, steps=1, progress=False)
    report = calibrate(exact, x, steps=0, progress=False)
    assert all(layer["error_before"] < 1e-12 for layer in report.layers)
    converted, _ = patched(model, "hedgehog", window=2)
    frozen = {name: p.clone() for name, p in model.named_parameters()}
    report = calibrate(converted, x, steps=30, lr=2e-2, progress=False)
    for layer in report.layers:
        assert layer["error_after"] < 0.7 * layer["error_before"], report.table()
    for name, p in converted.named_parameters():
        if name in frozen:
            torch.testing.assert_close(p, frozen[name], rtol=0, atol=0)
        assert p.requires_grad
