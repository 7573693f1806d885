"""patch()/unpatch() on timm ViTs: the adapter reuses timm's submodules, so checkpoints stay interchangeable."""
import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")
from timm.layers import Attention  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from linear_mha import method_class  # noqa: E402
from linear_mha.patching import LinearTimmAttention, patch, unpatch  # noqa: E402
import modes

LINEAR_MODES = modes.LINEAR
TINY = dict(img_size=32, depth=2, embed_dim=32, num_heads=2, num_classes=10)


def _vit(**kw):
    return VisionTransformer(patch_size=8, **{**TINY, **kw})


FAMILIES = {
    "vit": lambda: _vit(),
    "vit_noqkvbias_qknorm": lambda: _vit(qkv_bias=False, qk_norm=True),
    "deit_distilled": lambda: timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, **TINY),
    "hybrid": lambda: timm.create_model("vit_tiny_r_s16_p8_224", pretrained=False, img_size=32, depth=2,
                                        num_classes=10),
    "registers": lambda: timm.create_model("vit_base_patch16_reg4_gap_256", pretrained=False, **TINY),
    "dynamic_img_size": lambda: _vit(dynamic_img_size=True),
}
SIZES = {"dynamic_img_size": (32, 48)}


def _build(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().double()
    for m in model.modules():  # timm zero-inits some heads, which would cut every gradient
        if isinstance(m, nn.Linear) and not m.weight.any():
            nn.init.normal_(m.weight, std=0.1)
    torch.manual_seed(1)
    inputs = [torch.randn(2, 3, s, s, dtype=torch.float64) for s in SIZES.get(family, (32,))]
    return model, inputs


def _run(model, x):
    out = model(x)
    return out[0] if isinstance(out, tuple) else out


def _timm_count(model):
    return sum(type(m) is Attention for m in model.modules())


def _options(family, mode):
    """Small projections for the methods that have them; a sequence length where the model's token count varies
    (the others read it off the model)."""
    cls = method_class(mode)
    options = {"proj_k": 4} if "proj_k" in cls.options else {}
    if family == "dynamic_img_size" and cls.sequence_length_option is not None:
        options[cls.sequence_length_option] = (48 // 8) ** 2 + 1
    return options


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", LINEAR_MODES)
def test_linear_modes(family, mode):
    model, inputs = _build(family)
    model.train()
    n_attn, sd = _timm_count(model), {k: v.clone() for k, v in model.state_dict().items()}
    report = patch(model, mode, **_options(family, mode))
    assert report.num_replaced == n_attn > 0 and _timm_count(model) == 0
    new_sd = model.state_dict()
    assert all(torch.equal(new_sd[k], v) for k, v in sd.items())
    extra = set(new_sd) - set(sd)
    own = {f"{name}.{key}" for name, m in model.named_modules() if isinstance(m, LinearTimmAttention)
           for key, tensor in m.method.state(m).items() if tensor is not None}
    assert extra == own  # the method's own tensors (Linformer's E/F, focused's scale), nothing else
    model.load_state_dict(sd, strict=True)  # a timm checkpoint loads strictly
    for x in inputs:
        out = _run(model, x)
        assert out.shape == (2, 10) and torch.isfinite(out).all()
        out.square().sum().backward()
    for m in model.modules():
        if isinstance(m, LinearTimmAttention):
            assert m.training and m.qkv.weight.grad.abs().sum() > 0 and m.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_equals_original_and_unpatch_restores(family):
    model, inputs = _build(family)
    model.eval()
    originals = {n: m for n, m in model.named_modules() if type(m) is Attention}
    with torch.no_grad():
        refs = [_run(model, x) for x in inputs]
        patch(model, "softmax")
        for x, ref in zip(inputs, refs):
            torch.testing.assert_close(_run(model, x), ref, rtol=1e-12, atol=1e-12)
        for m in model.modules():
            if isinstance(m, LinearTimmAttention):
                m.proj.weight.mul_(0.5)  # "fine-tuning"
        tuned = [_run(model, x) for x in inputs]
        assert unpatch(model).num_replaced == len(originals)
        assert {n: m for n, m in model.named_modules() if type(m) is Attention} == originals
        for x, ref in zip(inputs, tuned):
            torch.testing.assert_close(_run(model, x), ref, rtol=1e-12, atol=1e-12)


def test_linformer_seq_len_is_the_token_count():
    model, (x,) = _build("registers")
    tokens = model.forward_features(x).shape[1]  # 4 patches + 4 registers (this model has no class token)
    assert tokens == 8
    patch(model, "linformer", proj_k=4)
    assert {m.method.seq_len for m in model.modules() if isinstance(m, LinearTimmAttention)} == {tokens}
    with pytest.raises(ValueError, match=f"seq_len >= {tokens}"):
        patch(_build("registers")[0], "linformer", seq_len=tokens - 1)
    with pytest.raises(ValueError, match="dynamic_img_size"):
        patch(_build("dynamic_img_size")[0], "linformer")
    wrapped = nn.Sequential(_build("registers")[0])  # a ViT used as a backbone: its own count, not an error
    patch(wrapped, "linformer", proj_k=4)
    assert {m.method.seq_len for m in wrapped.modules() if isinstance(m, LinearTimmAttention)} == {tokens}


def test_layerwise_and_favor_state():
    model, (x,) = _build("vit")
    report = patch(model, "linformer", param_sharing="layerwise", proj_k=3)
    mods = [m for m in model.modules() if isinstance(m, LinearTimmAttention)]
    assert mods[0].e_proj is mods[1].e_proj and report.parameters_added == 3 * ((32 // 8) ** 2 + 1)
    _run(model, x).sum().backward()
    assert mods[0].e_proj.grad.abs().sum() > 0
    model, _ = _build("vit")
    report = patch(model, "kernel", feature_map="favor", num_features=8)
    assert report.buffers_added == 2 * 8 * 16 and report.parameters_added == 0


def _attn(**kw):
    torch.manual_seed(0)
    return Attention(16, num_heads=2, qkv_bias=True, **kw).double().eval()


def test_gated_and_scale_norm_reuse_submodules():
    attn = _attn(gated=True, scale_norm=True, norm_layer=nn.LayerNorm)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    model = nn.Sequential(attn)
    ref = attn(x)
    patch(model, "softmax")
    assert model[0].gate is attn.gate and model[0].norm is attn.norm and model[0].qkv is attn.qkv
    torch.testing.assert_close(model(x), ref, rtol=1e-12, atol=1e-12)


def test_attn_mask_in_timm_convention():
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 4:] = False
    x2 = x.masked_fill(~keep[..., None], 5.0)
    masks = {"bool": keep[:, None, None, :],
             "float": torch.zeros(2, 1, 1, 6, dtype=torch.float64).masked_fill(~keep[:, None, None, :], -torch.inf)}
    for mode in ["softmax"] + LINEAR_MODES:
        attn = _attn()
        model = nn.Sequential(attn)
        patch(model, mode, **modes.sized(mode, 6, proj_k=3))
        for mask in masks.values():
            out = model[0](x, attn_mask=mask)
            if method_class(mode).exact:
                torch.testing.assert_close(out, attn(x, attn_mask=mask), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(model[0](x2, attn_mask=mask)[keep], out[keep])  # padding is ignored
    causal = _attn()
    model = nn.Sequential(causal)
    patch(model, "softmax")
    torch.testing.assert_close(model[0](x, is_causal=True), causal(x, is_causal=True), rtol=1e-12, atol=1e-12)
    model = nn.Sequential(_attn())
    patch(model, "kernel")
    future = torch.randn(2, 6, 16, dtype=torch.float64)
    future[:, :3] = x[:, :3]
    torch.testing.assert_close(model[0](x, is_causal=True)[:, :3], model[0](future, is_causal=True)[:, :3])
    model = nn.Sequential(_attn())
    patch(model, "efficient")
    with pytest.raises(ValueError, match="cannot apply"):
        model[0](x, attn_mask=torch.rand(6, 6) > 0.5)


def test_unsupported_attention_is_reported_and_untouched():
    from timm.layers import AttentionRope, DiffAttention
    from timm.models import beit, cait, eva, pvt_v2, swin_transformer, xcit

    class MyAttention(Attention):
        pass

    class AttnBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    zoo = nn.ModuleDict({
        "eva": eva.EvaAttention(16, 2, scale_norm=False), "rope": AttentionRope(16, 2), "beit": beit.Attention(16, 2, window_size=(2, 2)),
        "swin": swin_transformer.WindowAttention(16, 2, window_size=2), "pvt": pvt_v2.Attention(16, 2, sr_ratio=2),
        "talking": cait.TalkingHeadAttn(16, 2), "class_attn": cait.ClassAttn(16, 2), "diff": DiffAttention(16, 2),
        "subclass": MyAttention(16, 2), "plain": Attention(16, 2), "xca": xcit.XCA(16, 2),
        "cait_block": cait.LayerScaleBlockClassAttn(16, 2),  # a block: only its inner ClassAttn is reported
        "attn_block": AttnBlock(),  # named like a block, but attention itself (as in a diffusion VAE)
    })
    before = dict(zoo.items())
    report = patch(zoo, "kernel")
    assert [n for n, _, _ in report.replaced] == ["plain"]
    reasons = {n: r for n, _, r in report.skipped}
    assert set(reasons) == set(before) - {"plain", "cait_block"} | {"cait_block.attn"}
    assert "unsupported attention class" in reasons["attn_block"]
    before["cait_block.attn"] = zoo["cait_block"].attn
    for name, words in {"eva": "RoPE", "rope": "RoPE", "beit": "relative position", "swin": "window",
                        "pvt": "spatial-reduction", "talking": "talking heads", "class_attn": "class token",
                        "diff": "differential", "subclass": "exact class", "xca": "cross-covariance",
                        "cait_block.attn": "class token"}.items():
        assert words in reasons[name] and zoo.get_submodule(name) is before[name], name


def test_hooks_on_timm_s_qkv_and_proj_still_fire():
    """The adapter applies timm's qkv and proj Linears as their function (plain_linear.call_linear) unless something
    relies on calling them: a hook on either must fire and act."""
    model, _ = _build("vit")
    patch(model, mode="kernel")
    block = model.blocks[0].attn
    seen = []
    block.qkv.register_forward_hook(lambda mod, args, out: seen.append("qkv"))
    block.proj.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x), block.proj.bias.expand(2, 5, 32).detach())
    assert seen == ["qkv"]
