"""The --attention choice applied to DETR through linear_mha's patcher."""
import pytest
import torch
from torch import nn

from linear_mha.integrations.detr.attention import apply_attention, parse_targets
from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.detr import build_model
from linear_mha.integrations.detr.misc import NestedTensor
from linear_mha.integrations.detr.position_encoding import PositionEmbeddingSine
from linear_mha.integrations.detr.transformer import Transformer
import modes
from linear_mha import method_class

ARGS = ["--backbone", "tiny", "--hidden-dim", "32", "--nheads", "4", "--enc-layers", "2", "--dec-layers", "2",
        "--dim-feedforward", "64", "--num-queries", "5", "--num-classes", "4"]


def test_softmax_leaves_multihead_attention_untouched_and_targets_parse():
    model, _, _ = build_model(parse_args(ARGS))
    report = apply_attention(model, {"attention": "softmax", "attention_on": "all"})
    assert [r["target"] for r in report] == ["encoder", "decoder", "cross"]
    assert all(type(m) is nn.MultiheadAttention for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    roped = build_model(parse_args(ARGS))[0]  # an option that changes softmax's scores is not dropped
    report = apply_attention(roped, {"attention": "softmax", "attention_option": ["rope=True"]})
    assert report[0]["patch_report"] is not None and roped.transformer.encoder.layers[0].self_attn.method.rope
    assert parse_targets("cross,encoder") == ["encoder", "cross"]
    with pytest.raises(ValueError, match="--attention-on"):
        parse_targets("encoder,memory")


def test_the_synthetic_default_is_taylor_with_its_local_term_and_rope_and_an_explicit_method_comes_plain():
    """The default run is the most accurate Linear-DETR of docs/detr.md; the kernel and the options belong to the
    default method, so `--attention efficient` means plain Efficient Attention, as the measured variants did."""
    default = parse_args([])
    assert (default.attention, default.dwc_kernel, default.attention_option) == ("taylor", 3, ["rope=True"])
    report = apply_attention(build_model(parse_args(ARGS))[0], default, max_tokens=20)
    assert report[0]["mode"] == "taylor" and report[0]["options"]["dwc_kernel"] == 3
    assert report[0]["options"]["rope"] is True
    explicit = parse_args(["--attention", "efficient"])
    assert (explicit.dwc_kernel, explicit.attention_option) == (0, [])
    assert parse_args(["--attention", "efficient", "--dwc-kernel", "5"]).dwc_kernel == 5
    assert parse_args(["--attention", "taylor", "--attention-option", "rope=True"]).attention_option == ["rope=True"]
    assert parse_args(["--dwc-kernel", "5"]).attention == "taylor"
    # options given without --attention refine the preset's method, and a later value wins
    refined = parse_args(["--attention-option", "rope=False"])
    assert refined.attention == "taylor" and refined.attention_option == ["rope=True", "rope=False"]
    report = apply_attention(build_model(parse_args(ARGS))[0], refined, max_tokens=20)
    assert report[0]["options"]["rope"] is False
    # COCO takes the same attention (--coco-path alone must not turn it into softmax); --attention softmax is DETR
    coco = parse_args(["--coco-path", "/data/coco"])
    assert (coco.preset, coco.attention, coco.dwc_kernel, coco.attention_option) == ("coco", "taylor", 3, ["rope=True"])
    official = parse_args(["--coco-path", "/data/coco", "--attention", "softmax"])
    assert (official.attention, official.dwc_kernel, official.attention_option, official.output_gate) == \
        ("softmax", 0, [], False)
    coco.attention_option.append("eps=0.1")  # a run's lists are its own: the next run still gets the preset's
    assert parse_args(["--coco-path", "/data/coco"]).attention_option == ["rope=True"]


def test_the_banner_names_the_preset_the_attention_and_where_the_backbone_starts(capsys):
    from linear_mha.integrations.detr.run_report import start_banner

    def banner(argv, report):
        args = parse_args(argv)
        start_banner(args, {"train": [0] * 3, "val": [0] * 2}, report, "cpu", 2, 1, 10, "out", 0)
        return capsys.readouterr().out
    linear = [{"target": "encoder", "mode": "taylor", "options": {"dwc_kernel": 3, "rope": True},
               "patch_report": object()}]  # apply_attention's entries: the patch's report, None where nothing was
    out = banner(["--coco-path", "/data/coco", "--backbone-weights", "imagenet"], linear)
    assert "preset     coco: the official DETR-R50 recipe" in out
    assert "backbone resnet50 (ImageNet: torchvision's ResNet50_Weights.IMAGENET1K_V1)" in out
    assert ("attention  encoder: taylor (dwc_kernel=3, rope=True); the rest softmax. The recommended Linear-DETR, "
            "by default (--attention softmax: DETR as released)") in out
    softmax = [{"target": "encoder", "mode": "softmax", "options": {}, "patch_report": None}]
    out = banner(["--coco-path", "/data/coco", "--attention", "softmax", "--backbone-weights", "none"], softmax)
    assert "softmax everywhere (nn.MultiheadAttention, as in DETR)" in out
    assert "backbone resnet50 (random init: --backbone-weights none)" in out
    assert "preset     synthetic: a small DETR" in banner([], linear)


def test_a_pretrained_softmax_detr_is_not_given_the_default_linear_attention_silently(tmp_path):
    """The official release records no --attention: it is softmax. The default linear attention would load into it
    (its added weights start at zero) and score near zero, so the run refuses, naming --attention softmax."""
    import argparse
    from linear_mha.integrations.detr.checkpoint import check_pretrained_attention
    release = tmp_path / "detr-r50.pth"
    torch.save({"model": {}, "args": argparse.Namespace(lr=1e-4, backbone="resnet50")}, release)
    with pytest.raises(ValueError, match=r"--pretrained .*detr-r50.pth holds a DETR trained with --attention "
                                         r"'softmax'.* Pass --attention softmax"):
        check_pretrained_attention(parse_args(["--coco-path", "c", "--eval", "--pretrained", str(release)]))
    check_pretrained_attention(parse_args(["--coco-path", "c", "--pretrained", str(release), "--attention", "softmax"]))
    check_pretrained_attention(parse_args(["--coco-path", "c", "--pretrained", str(release), "--attention", "hedgehog"]))
    ours = tmp_path / "checkpoint.pth"  # this trainer's checkpoint of the default run: its attention is the default
    torch.save({"model": {}, "args": vars(parse_args(["--coco-path", "c"]))}, ours)
    check_pretrained_attention(parse_args(["--coco-path", "c", "--pretrained", str(ours)]))
    with pytest.raises(ValueError, match="--attention-option \\['rope=True', 'rope=False'\\]"):
        check_pretrained_attention(parse_args(["--coco-path", "c", "--pretrained", str(ours),
                                               "--attention-option", "rope=False"]))


def test_the_output_gate_flag_pairs_with_the_method_and_reaches_every_patched_module():
    from linear_mha.integrations.detr.config import RECOMMENDED_OUTPUT_GATE
    assert parse_args([]).output_gate is RECOMMENDED_OUTPUT_GATE  # the preset's gate belongs to its method
    assert parse_args(["--attention", "efficient"]).output_gate is False
    assert parse_args(["--coco-path", "/data/coco"]).output_gate is RECOMMENDED_OUTPUT_GATE
    args = parse_args(ARGS + ["--attention", "taylor", "--output-gate", "--attention-on", "encoder,cross"])
    model = build_model(args)[0]
    report = apply_attention(model, args, max_tokens=20)
    assert all(r["options"]["output_gate"] is True for r in report)
    gated = [m for m in model.modules() if getattr(m, "gate_weight", None) is not None]
    assert len(gated) == args.enc_layers + args.dec_layers  # encoder self-attention and decoder cross-attention
    softmax = build_model(parse_args(ARGS))[0]  # softmax with a gate: its modules are patched to hold one
    apply_attention(softmax, {"attention": "softmax", "output_gate": True})
    assert any(getattr(m, "gate_weight", None) is not None for m in softmax.modules())


def test_linformer_on_encoder_uses_the_data_bound_and_one_shared_projection():
    model, _, _ = build_model(parse_args(ARGS))
    report = apply_attention(model, parse_args(ARGS + ["--attention", "linformer", "--proj-k", "4"]), max_tokens=20)
    assert report[0]["options"] == {"seq_len": 20, "proj_k": 4, "param_sharing": "layerwise"}
    enc = [layer.self_attn for layer in model.transformer.encoder.layers]
    assert all(type(m).__name__ == "LinearMultiheadAttention" for m in enc)
    assert enc[0].e_proj is enc[1].e_proj
    assert all(type(layer.self_attn) is nn.MultiheadAttention for layer in model.transformer.decoder.layers)
    out = model([torch.rand(3, 160, 128), torch.rand(3, 100, 96)])  # 5 x 4 = 20 tokens: the bound itself
    assert out["pred_boxes"].shape == (2, 5, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        apply_attention(build_model(parse_args(ARGS))[0], {"attention": "linformer"})


@pytest.mark.parametrize("mode", modes.LINEAR)
def test_padding_stays_exact_with_linear_attention(mode):
    torch.manual_seed(0)
    model = Transformer(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=32,
                        dropout=0.0, return_intermediate_dec=True)
    wrapper = nn.Module()
    wrapper.transformer, wrapper.num_queries = model, 3  # the module paths apply_attention targets
    # a method that pairs queries with keys' positions (block_local) cannot run the decoder's cross-attention
    targets = "encoder" if method_class(mode)().self_attention_only else "encoder,cross"
    apply_attention(wrapper, {"attention": mode, "attention_on": targets, "proj_k": 8}, max_tokens=30)
    model = model.double().eval()
    g = torch.Generator().manual_seed(1)
    src = torch.randn(2, 16, 5, 6, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 5, 6, dtype=torch.bool)
    mask[0, 3:, :] = True
    mask[1, :, 4:] = True
    pos = PositionEmbeddingSine(8, normalize=True)(NestedTensor(src, mask)).double()
    query = torch.randn(3, 16, generator=g, dtype=torch.float64)
    hs, _ = model(src, mask, query, pos)
    other = src.masked_fill(mask.unsqueeze(1), 0.0) + 50 * mask.unsqueeze(1) * torch.randn(
        src.shape, generator=g, dtype=torch.float64)
    hs2, _ = model(other, mask, query, pos)
    torch.testing.assert_close(hs2, hs, rtol=0, atol=1e-10)
