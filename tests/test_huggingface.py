"""linear_mha.patch on Hugging Face transformers models (tiny random configs of ViT, DeiT, BERT, GPT-2, Llama and
DETR), through transformers' attention interface: softmax through the same path reproduces each model, padding and
causality stay exact for every linear method, unpatch restores outputs and implementations, checkpoints load both
ways, and features a linear method cannot apply are refused."""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import modes  # noqa: E402
from hf_models import CAUSAL, FAMILIES, build, inputs, output  # noqa: E402
from linear_mha import calibrate, method_class, output_distance, patch, unpatch  # noqa: E402
from linear_mha.patching import LinearHFAttention  # noqa: E402

# Methods that run every family's attention: Linformer needs S <= seq_len and the others run cross-attention too.
CROSS = [m for m in modes.LINEAR if not method_class(m)().self_attention_only]


def _run(model, x):
    with torch.no_grad():
        return output(model(**x))


def _valid_rows(family, x):
    """(B, L) True where the output row belongs to a real token (text models) or None."""
    mask = x.get("attention_mask")
    return None if mask is None or family == "detr" else mask.bool()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_through_the_interface_reproduces_the_model_and_unpatch_restores_it(family, padded):
    model, x = build(family), inputs(family, padded)
    reference = _run(model, x)
    implementations = {id(c): c._attn_implementation for m in model.modules() for c in [getattr(m, "config", None)]
                       if c is not None}
    report = patch(model, "softmax")
    assert report.num_replaced == sum(isinstance(m, LinearHFAttention) for m in model.modules()) > 0
    assert all(new is LinearHFAttention for _, _, new in report.replaced)
    got = _run(model, x)
    rows = _valid_rows(family, x)
    if rows is not None:  # a padded query's own row is padding's (sdpa and softmax differ only there)
        got, reference_rows = got[rows], reference[rows]
    else:
        reference_rows = reference
    torch.testing.assert_close(got, reference_rows, rtol=1e-12, atol=1e-12)
    back = unpatch(model)
    assert back.num_replaced == report.num_replaced and not any(isinstance(m, LinearHFAttention)
                                                                for m in model.modules())
    assert torch.equal(_run(model, x), reference)
    after = {id(c): c._attn_implementation for m in model.modules() for c in [getattr(m, "config", None)]
             if c is not None}
    assert after == implementations  # DETR's ResNet backbone keeps its own (eager) too


@pytest.mark.parametrize("mode", modes.LINEAR)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "detr"])
def test_every_linear_method_keeps_padding_out_of_the_real_tokens(family, mode):
    """Garbage in padded positions (tokens, for text) changes no real token's output."""
    if family in CAUSAL and not method_class(mode).causal:
        pytest.skip(f"{mode} has no causal form")
    model = build(family)
    patch(model, mode, **modes.sized(mode, 64, proj_k=8))
    x = inputs(family, padded=family not in ("vit", "deit"))
    base = _run(model, x)
    assert torch.isfinite(base).all()
    if "attention_mask" not in x:
        return
    other = dict(x, input_ids=torch.where(x["attention_mask"].bool(), x["input_ids"], (x["input_ids"] * 7 + 3) % 64))
    rows = x["attention_mask"].bool()
    torch.testing.assert_close(_run(model, other)[rows], base[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", CROSS)
def test_detr_padded_pixels_reach_no_real_output(mode):
    """DETR's encoder with the padded half of a feature map filled with garbage: every real position's output, and the
    decoder's queries through the cross-attention, are unchanged."""
    model = build("detr")
    patch(model, mode, **modes.sized(mode, 64, proj_k=8))
    g = torch.Generator().manual_seed(3)
    features = torch.randn(2, 16, 32, generator=g, dtype=torch.float64)
    position = torch.randn(2, 16, 32, generator=g, dtype=torch.float64)
    real = torch.ones(2, 16, dtype=torch.long)
    real[1, 10:] = 0
    garbage = features.clone()
    garbage[1, 10:] = 1e3 * torch.randn(6, 32, generator=g, dtype=torch.float64)
    encoder = model.model.encoder
    with torch.no_grad():
        out = encoder(inputs_embeds=features, attention_mask=real, spatial_position_embeddings=position)[0]
        out2 = encoder(inputs_embeds=garbage, attention_mask=real, spatial_position_embeddings=position)[0]
    torch.testing.assert_close(out2[real.bool()], out[real.bool()], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", modes.LINEAR_CAUSAL)
@pytest.mark.parametrize("family", CAUSAL)
def test_causal_models_never_see_the_future(family, mode):
    model = build(family)
    patch(model, mode)
    x = inputs(family)
    base = _run(model, x)
    for t in (0, 4, 7):
        changed = x["input_ids"].clone()
        changed[:, t] = (changed[:, t] + 1) % 64
        out = _run(model, {"input_ids": changed})
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t], base[:, t])


def test_the_model_s_scaling_is_honoured():
    """GPT-2 without 1/sqrt(d) scaling (scale_attn_weights=False): softmax through linear_mha is still the model."""
    model, x = build("gpt2", scale_attn_weights=False), inputs("gpt2")
    reference = _run(model, x)
    patch(model, "softmax")
    torch.testing.assert_close(_run(model, x), reference, rtol=1e-12, atol=1e-12)


def test_state_dict_keys_stay_and_an_original_checkpoint_loads_strictly():
    model = build("llama")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    patch(model, "hedgehog")
    keys = set(model.state_dict())
    assert set(original) <= keys and all(".linear_mha.hedgehog_" in k for k in keys - set(original))
    model.load_state_dict(original, strict=True)  # the added maps keep their initialisation
    trained = build("llama")
    patch(trained, "hedgehog")
    trained.load_state_dict(model.state_dict(), strict=True)  # and a patched checkpoint loads into a patched model


def test_include_converts_only_the_encoder_and_the_rest_runs_its_own_implementation():
    model, x = build("detr"), inputs("detr", padded=True)
    reference = _run(model, x)
    report = patch(model, "softmax", include=["model.encoder.*"])
    assert [name for name, _, _ in report.replaced] == [f"model.encoder.layers.{i}.self_attn" for i in range(2)]
    torch.testing.assert_close(_run(model, x), reference, rtol=1e-12, atol=1e-12)


def test_linformer_reads_the_token_count_of_the_model():
    vit, bert = build("vit"), build("bert")
    patch(vit, "linformer", proj_k=4)
    patch(bert, "linformer", proj_k=4)
    assert {m.method.seq_len for m in vit.modules() if isinstance(m, LinearHFAttention)} == {(32 // 8) ** 2 + 1}
    assert {m.method.seq_len for m in bert.modules() if isinstance(m, LinearHFAttention)} == {64}
    with pytest.raises(ValueError, match="token count follows the image size"):
        patch(build("detr"), "linformer")


@pytest.mark.parametrize("family", ["vit", "deit", "detr"])
def test_the_local_term_finds_the_image_grid(family, monkeypatch):
    model = build(family)
    report = patch(model, "taylor", dwc_kernel=3, **({"include": ["model.encoder.*"]} if family == "detr" else {}))
    assert any("token grid" in note for note in report.notes)
    seen = []
    import linear_mha.local_term as local_term
    real = local_term.token_grid_conv

    def spy(v, weight, bias, height, width, prefix, kpm=None):
        seen.append((height, width, prefix, v.shape[2]))
        return real(v, weight, bias, height, width, prefix, kpm)
    monkeypatch.setattr(local_term, "token_grid_conv", spy)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LinearHFAttention):
                m.dwc_weight.normal_()  # the term starts at zero; make it count
        out = _run(model, inputs(family))
    expected = {"vit": (4, 4, 1, 17), "deit": (4, 4, 2, 18), "detr": (8, 8, 0, 64)}[family]
    assert seen and set(seen) == {expected} and torch.isfinite(out).all()


def test_what_linear_attention_cannot_apply_is_refused_by_name():
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    model = transformers.MistralForCausalLM(config).eval()
    patch(model, "kernel")
    with pytest.raises(ValueError, match="sliding attention window"):
        model(torch.randint(0, 64, (1, 6)))
    unpatch(model)
    model(torch.randint(0, 64, (1, 6)))  # back to the model's own attention


def test_a_decoder_never_tested_converts():
    """Qwen2 without its sliding window: a model this file has no builder for converts through the interface."""
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).double().eval()
    ids = torch.randint(0, 64, (1, 7))
    reference = _run(model, {"input_ids": ids})
    assert patch(model, "softmax").num_replaced == 2
    torch.testing.assert_close(_run(model, {"input_ids": ids}), reference, rtol=1e-12, atol=1e-12)


def test_calibrate_fits_a_transformers_model_with_its_model_output():
    """calibrate's teacher is the module's original implementation on the same call (the error falls as the maps
    fit it), and distillation compares the tensors of the ModelOutput the model returns."""
    model = build("vit")
    with torch.no_grad():  # peaked attention, as a trained model has (random weights attend almost uniformly)
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    original = build("vit")
    original.load_state_dict(model.state_dict())
    patch(model, "hedgehog")
    batches = [inputs("vit", seed=s)["pixel_values"] for s in range(4)]

    def distance():
        with torch.no_grad():
            return sum(float(output_distance(model(pixel_values=b), original(pixel_values=b))) for b in batches)
    before = distance()
    report = calibrate(model, batches, steps=40, lr=3e-2, progress=False, forward=lambda m, b: m(pixel_values=b))
    assert all(layer["error_after"] < 0.7 * layer["error_before"] for layer in report.layers)
    assert distance() < 0.7 * before
    tuned = calibrate(model, batches, steps=0, finetune_steps=2, finetune_lr=1e-4, distill=True, progress=False,
                      forward=lambda m, b: m(pixel_values=b))
    assert tuned.distilled and all(0 < loss < 1 for loss in tuned.finetune_losses)


@pytest.mark.parametrize("mode", modes.CAUSAL_ONLY)
@pytest.mark.parametrize("family", CAUSAL)
def test_calibrate_fits_the_causal_only_methods_in_a_decoder_which_then_generates_with_its_state(family, mode):
    """The recurrences (decays, gates, the delta rule's write strength) are calibration targets of a causal model:
    their own parameters fit the softmax the module had, and generate() afterwards decodes with their state what a
    full forward per token gives. A method with nothing of its own to train is refused by name."""
    model = build(family)
    with torch.no_grad():  # peaked attention, as a trained model has
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight")):
                p.mul_(4.0)
    patch(model, mode)
    batches = [inputs(family, seed=s, length=12)["input_ids"] for s in range(4)]
    if not any("linear_mha." in name for name, _ in model.named_parameters()):
        with pytest.raises(ValueError, match=f"method \\({mode!r}\\) has nothing to train"):
            calibrate(model, batches, steps=1, progress=False, forward=lambda m, b: m(input_ids=b))
        return
    report = calibrate(model, batches, steps=30, lr=3e-2, progress=False, forward=lambda m, b: m(input_ids=b))
    assert all(layer["error_after"] < 0.97 * layer["error_before"] for layer in report.layers)
    ids = batches[0][:1, :5]
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        recomputed = ids
        for _ in range(6):
            step = model(recomputed, use_cache=False).logits[:, -1:].argmax(-1)
            recomputed = torch.cat([recomputed, step], dim=1)
    assert torch.equal(tokens, recomputed)


@pytest.mark.parametrize("mode", modes.GRID)
@pytest.mark.parametrize("family", ["vit", "detr"])
def test_methods_over_the_image_grid_get_it_from_the_model(family, mode):
    """agent attends over the token grid: patch finds it (ViT's patches after the class token, DETR's feature map),
    on padded images too."""
    model = build(family)
    patch(model, mode, **({"include": ["model.encoder.*"]} if family == "detr" else {}))
    out = _run(model, inputs(family, padded=True))
    assert torch.isfinite(out).all()


class _Positional(torch.nn.Module):
    """A transformers model behind positional tensor inputs, its judged output out: what torch.export records."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors):
        return output(self.model(**dict(zip(self.names, tensors))))


@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"), reason="torch.export of masks needs torch >= 2.6")
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_model_exports_and_computes_what_eager_does(family, padded):
    """torch.export of a patched model, run on other values and another padding: "no padding" in the example batch
    must not be baked in, and padding must not stop the export (docs/deploy.md)."""
    if padded and family in ("vit", "deit"):
        pytest.skip("image classifiers take no mask")
    model = build(family)
    patch(model, "hedgehog")
    x, other = inputs(family, padded=padded), inputs(family, padded=padded, seed=5)
    if "attention_mask" in other:
        other["attention_mask"] = other["attention_mask"].roll(1, 0)  # the other sample is the padded one
    names = list(x)
    wrapped = _Positional(model, names).eval()
    with torch.no_grad():
        exported = torch.export.export(wrapped, tuple(x[n] for n in names)).module()
        got, expected = exported(*(other[n] for n in names)), wrapped(*(other[n] for n in names))
    rows = _valid_rows(family, other)
    if rows is not None:  # padded tokens' own outputs are padding's
        got, expected = got[rows], expected[rows]
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
