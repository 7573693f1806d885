"""The models users patch compile as one graph: nn.TransformerEncoder, a timm ViT, our DETR and Hugging Face models,
with padding (and causal) masks. Graph breaks are counted with torch._dynamo.explain (none expected), and the
compiled model (fullgraph=True) computes what eager does."""
import pytest
import torch
from torch import nn

import linear_mha
import modes
from compile_checks import assert_compiled_matches_eager, graph_breaks, needs_recent_dynamo

pytestmark = needs_recent_dynamo
L, B, E, H = 12, 2, 32, 4


def _transformer_encoder(mode):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    linear_mha.patch(encoder, mode=mode, **modes.sized(mode, L))
    return encoder


@pytest.mark.parametrize("mode", [m for m in modes.SEQUENCE if linear_mha.method_class(m).causal][:3] + ["efficient"])
def test_a_patched_transformer_encoder_compiles_as_one_graph(mode):
    """nn.TransformerEncoder turns a bool src_key_padding_mask into a float one before the layers (the case that
    split every layer's graph), and passes is_causal on with a causal mask."""
    encoder = _transformer_encoder(mode)
    x = torch.randn(B, L, E)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, 8:] = True
    assert graph_breaks(encoder, x, src_key_padding_mask=padding) == (0, [])
    assert_compiled_matches_eager(lambda x: encoder(x, src_key_padding_mask=padding), [x])
    if linear_mha.method_class(mode).causal:
        causal = nn.Transformer.generate_square_subsequent_mask(L)
        assert graph_breaks(encoder, x, mask=causal, is_causal=True) == (0, [])
        assert_compiled_matches_eager(lambda x: encoder(x, mask=causal, is_causal=True), [x])


@pytest.mark.parametrize("options", [{"mode": "kernel"}, {"mode": "agent"},
                                     {"mode": "taylor", "dwc_kernel": 3, "rope": True}])
def test_a_patched_timm_vit_compiles_as_one_graph(options):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                            embed_dim=32, num_heads=2, num_classes=0).eval()
    linear_mha.patch(vit, **options)
    x = torch.randn(2, 3, 32, 32)
    assert graph_breaks(vit, x) == (0, [])
    assert_compiled_matches_eager(vit, [x])


@pytest.mark.parametrize("attention", [["--attention", "kernel"], ["--attention", "agent"],
                                       ["--attention", "taylor", "--dwc-kernel", "3", "--attention-option",
                                        "rope=True"]])
def test_our_detr_compiles_as_one_graph_with_padded_images(attention):
    from linear_mha.integrations.detr.attention import apply_attention
    from linear_mha.integrations.detr.config import parse_args
    from linear_mha.integrations.detr.detr import build_model
    from linear_mha.integrations.detr.misc import NestedTensor
    base = ["--backbone", "tiny", "--hidden-dim", "32", "--nheads", "4", "--enc-layers", "2", "--dec-layers", "1",
            "--dim-feedforward", "64", "--num-queries", "5", "--num-classes", "4"]
    torch.manual_seed(0)
    detr = build_model(parse_args(base))[0].eval()
    apply_attention(detr, parse_args(base + attention), max_tokens=300)
    images = torch.randn(2, 3, 64, 64)
    padding = torch.zeros(2, 64, 64, dtype=torch.bool)
    padding[1, :, 40:] = True

    def boxes(images):
        return detr(NestedTensor(images, padding))["pred_boxes"]
    assert graph_breaks(boxes, images) == (0, [])
    assert_compiled_matches_eager(boxes, [images])


@pytest.mark.parametrize("family,mode", [("bert", "kernel"), ("llama", "taylor"), ("gpt2", "softmax"),
                                         ("vit", "kernel")])
def test_a_patched_hugging_face_model_compiles_as_one_graph(family, mode):
    pytest.importorskip("transformers")
    import hf_models
    model = hf_models.build(family).float()
    linear_mha.patch(model, mode=mode)
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in hf_models.inputs(family, padded=True).items()}

    def first_output(**inputs):
        return model(**inputs)[0]
    assert graph_breaks(first_output, **inputs) == (0, [])
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(first_output, fullgraph=True, backend="aot_eager")(**inputs)
        torch.testing.assert_close(compiled, first_output(**inputs), rtol=1e-4, atol=1e-5)
