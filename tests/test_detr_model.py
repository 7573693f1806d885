"""DETR model: checkpoint-compatible state_dict, padding exactness of the transformer, heads and post-processing."""
from pathlib import Path

import pytest
import torch

from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.detr import PostProcess, build_model
from linear_mha.integrations.detr.misc import NestedTensor, nested_tensor_from_tensor_list
from linear_mha.integrations.detr.position_encoding import PositionEmbeddingLearned, PositionEmbeddingSine
from linear_mha.integrations.detr.transformer import Transformer

# The official DETR-R50 checkpoint's keys and shapes (facts copied from the release into the repository).
REFERENCE = Path(__file__).with_name("data") / "detr_r50_state_dict.txt"


def _reference_entries():
    entries = []
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, shape = line.split(" ", 1)
        entries.append((name, tuple(int(s) for s in shape.strip("()").split(",") if s.strip())))
    return entries


def _entries(model):
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def test_r50_state_dict_equals_official_checkpoint_keys_and_shapes():
    args = parse_args(["--coco-path", "unused", "--num-classes", "91"])
    model, _, _ = build_model(args)
    reference = _reference_entries()
    assert len(reference) == 458
    assert _entries(model) == reference
    # A checkpoint with exactly these keys loads strictly (fresh weights stand in for the release).
    fresh, _, _ = build_model(args)
    fresh.load_state_dict({"model": model.state_dict()}["model"], strict=True)
    # DC5 has the same keys/shapes; pre-norm adds the encoder's final LayerNorm.
    dc5, _, _ = build_model(parse_args(["--coco-path", "unused", "--num-classes", "91", "--dilation"]))
    assert _entries(dc5) == reference
    pre, _, _ = build_model(parse_args(["--coco-path", "unused", "--num-classes", "91", "--pre-norm"]))
    extra = set(_entries(pre)) - set(reference)
    assert extra == {("transformer.encoder.norm.weight", (256,)), ("transformer.encoder.norm.bias", (256,))}


def _tiny_transformer(pre_norm):
    torch.manual_seed(0)
    return Transformer(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32,
                       dropout=0.0, normalize_before=pre_norm, return_intermediate_dec=True).double().eval()


@pytest.mark.parametrize("pre_norm", [False, True])
def test_transformer_ignores_values_at_padded_positions(pre_norm):
    model = _tiny_transformer(pre_norm)
    pos_enc = PositionEmbeddingSine(8, normalize=True)
    g = torch.Generator().manual_seed(1)
    src = torch.randn(2, 16, 5, 6, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 5, 6, dtype=torch.bool)
    mask[0, 3:, :] = True
    mask[1, :, 4:] = True
    pos = pos_enc(NestedTensor(src, mask)).double()
    query = torch.randn(3, 16, generator=g, dtype=torch.float64)
    hs, memory = model(src, mask, query, pos)
    other = src.clone()
    other[mask.unsqueeze(1).expand_as(src)] = 1e3 * torch.randn(int(mask.sum()) * 16, generator=g, dtype=torch.float64)
    hs2, memory2 = model(other, mask, query, pos)
    assert not torch.equal(src, other)
    torch.testing.assert_close(hs2, hs, rtol=0, atol=1e-12)
    valid = (~mask).unsqueeze(1).expand_as(memory)
    torch.testing.assert_close(memory2[valid], memory[valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize("pos_cls", [PositionEmbeddingSine, PositionEmbeddingLearned])
def test_padded_batch_equals_each_image_alone(pos_cls):
    """Position encoding + transformer: an image inside a padded batch gives what it gives alone."""
    model = _tiny_transformer(False)
    torch.manual_seed(3)
    pos_enc = pos_cls(8, normalize=True) if pos_cls is PositionEmbeddingSine else pos_cls(8).double()
    sizes = [(3, 4), (5, 2)]
    images = [torch.randn(16, h, w, dtype=torch.float64) for h, w in sizes]
    batch = nested_tensor_from_tensor_list(images)
    query = torch.randn(4, 16, dtype=torch.float64)
    hs, _ = model(batch.tensors, batch.mask, query, pos_enc(batch).double())
    for i, img in enumerate(images):
        alone = NestedTensor(img[None], torch.zeros(1, *img.shape[1:], dtype=torch.bool))
        hs_alone, _ = model(alone.tensors, alone.mask, query, pos_enc(alone).double())
        torch.testing.assert_close(hs[:, i], hs_alone[:, 0], rtol=0, atol=1e-12)


def _tiny_args(*extra):
    return parse_args(["--backbone", "tiny", "--hidden-dim", "32", "--nheads", "4", "--enc-layers", "1",
                       "--dec-layers", "2", "--dim-feedforward", "64", "--num-queries", "5", "--num-classes", "4",
                       *extra])


def test_detr_forward_shapes_and_aux_outputs():
    torch.manual_seed(0)
    model, _, post = build_model(_tiny_args())
    out = model([torch.rand(3, 64, 80), torch.rand(3, 48, 96)])
    assert out["pred_logits"].shape == (2, 5, 5)
    assert out["pred_boxes"].shape == (2, 5, 4)
    assert ((out["pred_boxes"] > 0) & (out["pred_boxes"] < 1)).all()
    assert len(out["aux_outputs"]) == 1 and out["aux_outputs"][0]["pred_boxes"].shape == (2, 5, 4)
    no_aux, _, _ = build_model(_tiny_args("--no-aux-loss"))
    assert "aux_outputs" not in no_aux([torch.rand(3, 64, 64)])


def test_postprocess_scales_boxes_to_original_size_and_drops_no_object():
    logits = torch.tensor([[[0.0, 5.0, 9.0], [4.0, 0.0, 1.0]]])  # 2 classes + no-object
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.4], [0.25, 0.75, 0.5, 0.5]]])
    (res,) = PostProcess()({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[200, 100]]))
    assert res["labels"].tolist() == [1, 0]  # the no-object logit (9.0) is never the label
    expected = torch.tensor([[40.0, 60.0, 60.0, 140.0], [0.0, 100.0, 50.0, 200.0]])  # x by width 100, y by height 200
    torch.testing.assert_close(res["boxes"], expected)
    torch.testing.assert_close(res["scores"][0], torch.softmax(logits[0, 0], -1)[1])
    with pytest.raises(ValueError, match="target_sizes"):
        PostProcess()({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([200, 100]))


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="backbone"):
        build_model(_tiny_args("--backbone", "vgg"))
    with pytest.raises(ValueError, match="dilation"):
        build_model(_tiny_args("--dilation"))
    with pytest.raises(ValueError, match="nheads"):
        build_model(_tiny_args("--nheads", "5"))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_small_backbones_have_the_stride_the_data_bound_assumes(name):
    from linear_mha.integrations.detr.backbone import Backbone, backbone_stride
    from linear_mha.integrations.detr.misc import nested_tensor_from_tensor_list
    from linear_mha.integrations.detr.transforms import feature_tokens
    body = Backbone(name, train_backbone=True, dilation=False)
    images = nested_tensor_from_tensor_list([torch.rand(3, 100, 70), torch.rand(3, 64, 129)])
    feature = body(images)["0"].tensors
    stride = backbone_stride(name, False)
    assert feature.shape[-2:] == (-(-100 // stride), -(-129 // stride))
    assert feature.shape[-2] * feature.shape[-1] == feature_tokens((100, 129), stride)
    assert body.num_channels == feature.shape[1]
