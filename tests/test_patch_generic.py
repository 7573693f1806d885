"""patch()/unpatch() on nn.MultiheadAttention models: nn.TransformerEncoder, nn.Transformer, torchvision's
VisionTransformer and a user model with a subclass and kdim/vdim; selection, layerwise sharing, nested tensors."""
import warnings

import pytest
import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from linear_mha import attention as attention_module
from linear_mha import method_class
from linear_mha.attention import LinearMultiheadAttention
from linear_mha.patching import PatchReport, patch, unpatch
import modes

LINEAR_MODES = modes.LINEAR
OPTIONS = {"linformer": {"seq_len": 20, "proj_k": 4}}


class MyMHA(nn.MultiheadAttention):
    """A user subclass: patch() must handle it and unpatch() must give it back."""


class CrossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MyMHA(12, 3, kdim=5, vdim=7)  # separate q/k/v projections, sequence-first
        self.head = nn.Linear(12, 2)

    def forward(self, x):  # x: (L, N, 12)
        mem_k, mem_v = x[..., :5].flip(0), x[..., 5:12].cos()
        return self.head(self.attn(x, mem_k, mem_v, need_weights=False)[0])


def _encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), lambda: torch.randn(2, 9, 16)


def _transformer():
    model = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0)
    src, tgt = torch.randn(9, 2, 16), torch.randn(6, 2, 16)
    return model, lambda: (src, tgt)


def _torchvision_vit():
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                              num_classes=10)
    nn.init.normal_(model.heads.head.weight)  # torchvision zero-inits the head, which would cut every gradient
    return model, lambda: torch.randn(2, 3, 32, 32)


def _cross():
    return CrossModel(), lambda: torch.randn(6, 2, 12)


FAMILIES = {"encoder": _encoder, "transformer": _transformer, "torchvision_vit": _torchvision_vit,
            "subclass_kdim": _cross}


def _build(family, dtype=torch.float64):
    torch.manual_seed(0)
    model, make_input = FAMILIES[family]()
    model = model.to(dtype)
    torch.manual_seed(1)
    inp = make_input()
    inp = tuple(t.to(dtype) for t in inp) if isinstance(inp, tuple) else (inp.to(dtype),)
    return model, inp


def _mha_count(model):
    return sum(isinstance(m, nn.MultiheadAttention) for m in model.modules())


def _clone_sd(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# nn.Transformer's decoder attends to the encoder's memory (L != S): methods that pair each query with the keys at
# its own position (block_local) refuse it, with an error that says so (tests/test_linear_modes.py).
CROSS_ATTENTION = {"transformer"}
CASES = [(f, m) for f in FAMILIES for m in LINEAR_MODES
         if not (f in CROSS_ATTENTION and method_class(m)().self_attention_only)]


@pytest.mark.parametrize("family,mode", CASES)
def test_linear_modes_keep_weights_and_train(family, mode):
    model, inp = _build(family)
    model.train()
    n_attn, sd = _mha_count(model), _clone_sd(model)
    report = patch(model, mode, **OPTIONS.get(mode, {}))
    assert isinstance(report, PatchReport) and report.num_replaced == n_attn > 0
    assert _mha_count(model) == 0
    assert all(new is LinearMultiheadAttention for _, _, new in report.replaced)
    new_sd = model.state_dict()
    for key, tensor in sd.items():  # every original tensor is still there, equal, same dtype
        assert torch.equal(new_sd[key], tensor), key
    extra = set(new_sd) - set(sd)
    own = {f"{name}.{key}" for name, m in model.named_modules() if isinstance(m, LinearMultiheadAttention)
           for key, tensor in m.method.state(m).items() if tensor is not None}
    assert extra == own  # the method's own tensors (Linformer's E/F, focused's scale), nothing else
    assert report.parameters_added == sum(new_sd[k].numel() for k in extra)
    model.load_state_dict(sd, strict=True)  # an original checkpoint still loads strictly

    out = model(*inp)
    assert torch.isfinite(out).all() and out.dtype == torch.float64
    out.square().mean().backward()
    for m in model.modules():
        if isinstance(m, LinearMultiheadAttention):
            weight = m.in_proj_weight if m._qkv_same_embed_dim else m.k_proj_weight
            assert weight.grad is not None and weight.grad.abs().sum() > 0
            assert m.training


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_mode_equals_original_and_unpatch_restores(family):
    model, inp = _build(family)
    model.eval()
    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    classes = {n: type(m) for n, m in originals.items()}
    with torch.no_grad():
        ref = model(*inp)
        report = patch(model, "softmax")
        assert report.parameters_added == 0 and report.num_replaced == len(originals)
        torch.testing.assert_close(model(*inp), ref, rtol=1e-12, atol=1e-12)
        # Fine-tune, then unpatch: the original class comes back holding the new weights.
        for m in model.modules():
            if isinstance(m, LinearMultiheadAttention):
                m.out_proj.weight.mul_(0.5)
        tuned = model(*inp)
        back = unpatch(model)
        assert back.num_replaced == len(originals)
        restored = {n: m for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
        assert {n: type(m) for n, m in restored.items()} == classes
        assert all(restored[n] is originals[n] for n in originals)
        torch.testing.assert_close(model(*inp), tuned, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(tuned, ref)


def test_device_dtype_and_per_module_train_state():
    model, inp = _build("transformer", dtype=torch.float32)
    model.train()
    model.decoder.eval()
    patch(model, "kernel")
    for name, m in model.named_modules():
        if isinstance(m, LinearMultiheadAttention):
            assert m.in_proj_weight.dtype == torch.float32 and m.in_proj_weight.device.type == "cpu"
            assert m.training == (not name.startswith("decoder"))


def test_idempotent_and_root_and_hooks():
    model, inp = _build("encoder")
    first = patch(model, "taylor")
    modules = [m for m in model.modules() if isinstance(m, LinearMultiheadAttention)]
    second = patch(model, "taylor")
    assert second.num_replaced == 0 and len(second.skipped) == first.num_replaced
    assert all("already linear" in reason for _, _, reason in second.skipped)
    assert modules == [m for m in model.modules() if isinstance(m, LinearMultiheadAttention)]
    with pytest.raises(TypeError, match="from_torch"):
        patch(nn.MultiheadAttention(8, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        patch("model")
    hooked = nn.Sequential(nn.MultiheadAttention(8, 2))
    hooked[0].register_forward_hook(lambda *a: None)
    assert any("hooks" in n for n in patch(hooked, "kernel").notes)


def test_linformer_seq_len_from_torchvision_vit():
    model, inp = _build("torchvision_vit")
    patch(model, "linformer", proj_k=4)
    assert {m.method.seq_len for m in model.modules() if isinstance(m, LinearMultiheadAttention)} == {(32 // 8) ** 2 + 1}
    assert model(*inp).shape == (2, 10)
    model2, _ = _build("torchvision_vit")
    with pytest.raises(ValueError, match="seq_len >= 17"):
        patch(model2, "linformer", seq_len=16)


def test_shared_module_stays_shared():
    mha = nn.MultiheadAttention(8, 2)
    model = nn.ModuleDict({"a": mha, "b": nn.Sequential(mha)})
    report = patch(model, "kernel")
    assert report.num_replaced == 1 and model["a"] is model["b"][0]


def test_selection_include_exclude_filter_options_for():
    model, _ = _build("transformer")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert names == ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn"]
    report = patch(model, "kernel", include=["encoder.layers.*.self_attn", "decoder.*"],
                   exclude="*.multihead_attn")
    assert [n for n, _, _ in report.replaced] == names[:2]
    assert [(n, reason) for n, _, reason in report.skipped] == [(names[2], "excluded by '*.multihead_attn'")]
    unpatch(model)

    seen = []
    report = patch(model, "linformer", filter=lambda n, m: m.kdim == m.embed_dim and n.startswith("decoder"),
                   options_for=lambda n, m: seen.append(n) or {"seq_len": 6 if "self_attn" in n else 9}, proj_k=3)
    assert seen == names[1:] and report.num_replaced == 2
    assert model.decoder.layers[0].self_attn.method.seq_len == 6 and model.decoder.layers[0].multihead_attn.method.seq_len == 9
    assert model.decoder.layers[0].self_attn.method.proj_k == 3
    assert ("encoder.layers.0.self_attn", nn.MultiheadAttention, "filter returned False") in report.skipped


def test_selection_errors():
    model, _ = _build("encoder")
    with pytest.warns(UserWarning, match="matched no attention module"):
        assert patch(model, "kernel", include=["encoder.layer.*"]).num_replaced == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # patterns naming modules that are already linear are not typos
        patch(model, "kernel", include=["layers.0.*"])
        assert patch(model, "kernel", include=["layers.0.*"], filter=lambda n, m: m.kdim > 0).num_replaced == 0
    unpatch(model)
    with pytest.raises(TypeError, match="include"):
        patch(model, "kernel", include=[3])
    with pytest.raises(TypeError, match="options_for"):
        patch(model, "kernel", options_for=lambda n, m: 5)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn.*seq_len"):
        patch(model, "linformer", seq_len=-1)
    with pytest.raises(ValueError, match="did you mean 'proj_k'"):
        patch(model, "linformer", projk=4)
    assert _mha_count(model) == 2  # a failed call changed nothing


def test_layerwise_shares_one_parameter():
    model, inp = _build("transformer")
    sizes = {"encoder.layers.0.self_attn": 9, "decoder.layers.0.self_attn": 6}
    report = patch(model, "linformer", param_sharing="layerwise", proj_k=4,
                   options_for=lambda n, m: {"seq_len": sizes.get(n, 5)})
    mods = [m for m in model.modules() if isinstance(m, LinearMultiheadAttention)]
    assert len(mods) == 3 and all(m.e_proj is mods[0].e_proj and m.f_proj is None for m in mods)
    assert tuple(mods[0].e_proj.shape) == (4, 9) and all(m.method.seq_len == 9 for m in mods)  # max seq_len
    assert report.parameters_added == 4 * 9  # counted once
    model(*inp).sum().backward()
    assert mods[0].e_proj.grad is not None
    model2, _ = _build("transformer")
    with pytest.raises(ValueError, match="single proj_k"):
        patch(model2, "linformer", param_sharing="layerwise", options_for=lambda n, m: {"proj_k": len(n)})


def _nested_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 4:] = pad[1, 6:] = True
    return enc, x, pad


def test_nested_tensor_encoder_runs_the_new_forward(monkeypatch):
    enc, x, pad = _nested_encoder()
    assert enc.use_nested_tensor
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=pad)
    report = patch(enc, "softmax")
    assert not enc.use_nested_tensor and any("use_nested_tensor" in n for n in report.notes)
    calls = []
    attend = attention_module.attend_heads
    monkeypatch.setattr(attention_module, "attend_heads", lambda *a, **kw: calls.append(1) or attend(*a, **kw))
    with torch.no_grad():
        out = enc(x, src_key_padding_mask=pad)
    assert len(calls) == 2  # the C++ fast path would have bypassed both layers
    torch.testing.assert_close(out[~pad], ref[~pad], rtol=1e-5, atol=1e-5)
    unpatch(enc)
    assert enc.use_nested_tensor


@pytest.mark.parametrize("mode", LINEAR_MODES)
def test_nested_tensor_encoder_linear_modes_respect_padding(mode):
    enc, x, pad = _nested_encoder()
    patch(enc, mode, **OPTIONS.get(mode, {}))
    x2 = x.masked_fill(pad[..., None], 7.0)  # padded tokens must not influence the others
    with torch.no_grad():
        out, out2 = enc(x, src_key_padding_mask=pad), enc(x2, src_key_padding_mask=pad)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[~pad], out2[~pad], rtol=1e-5, atol=1e-5)


class DoublingMHA(nn.MultiheadAttention):
    """A subclass that changes forward: replacing it would silently drop the doubling."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 2 * out, weights


def test_subclasses_that_change_forward_or_weights_are_reported_not_patched():
    from torch.ao.nn.quantizable import MultiheadAttention as QuantizableMHA
    from torch.nn.utils import parametrizations
    parametrized = nn.MultiheadAttention(16, 2)
    parametrizations.weight_norm(parametrized, "in_proj_weight")
    torch.manual_seed(0)
    model = nn.ModuleDict({"doubling": DoublingMHA(16, 2), "quantizable": QuantizableMHA(16, 2),
                           "parametrized": parametrized, "kept": MyMHA(16, 2)}).eval()
    x = torch.randn(5, 2, 16)
    before = {name: m(x, x, x)[0] for name, m in model.items()}
    keys = set(model.state_dict())
    report = patch(model, "softmax")
    assert [name for name, *_ in report.replaced] == ["kept"]
    reasons = {name: why for name, _, why in report.skipped}
    assert "overrides forward" in reasons["doubling"] and "overrides forward" in reasons["quantizable"]
    assert "parametrized" in reasons["parametrized"]
    assert set(model.state_dict()) == keys
    for name, m in model.items():
        torch.testing.assert_close(m(x, x, x)[0], before[name], rtol=1e-5, atol=1e-6)


def test_unpatch_inside_patched_gives_torchs_class_back():
    from linear_mha import patched
    torch_class = nn.MultiheadAttention  # inside the block the name builds linear modules
    with patched(mode="kernel"):
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        assert isinstance(layer.self_attn, LinearMultiheadAttention)
        unpatch(layer)
        assert type(layer.self_attn) is torch_class


def test_linformer_seq_len_comes_from_the_vit_inside_a_wrapper():
    vit, _ = _torchvision_vit()
    model = nn.Sequential(vit)
    patch(model, "linformer", proj_k=4)
    assert {m.method.seq_len for m in model.modules() if isinstance(m, LinearMultiheadAttention)} == {vit.seq_length}
    model(torch.randn(2, 3, 32, 32))


def test_a_torchscript_model_is_refused_not_silently_left_softmax():
    model = nn.Sequential(nn.Linear(4, 4))
    scripted = torch.jit.script(model)
    with pytest.raises(TypeError, match="cannot change a TorchScript module.*patch the Python model first"):
        patch(scripted, "kernel")
