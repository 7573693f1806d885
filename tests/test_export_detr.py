"""Our DETR recorded as a graph computes what eager computes, with the recommended encoder (taylor + DWC + rope)
and the softmax baselines: torch.export and the ONNX exporter with height and width dynamic (run by onnxruntime at
other sizes), torch.jit.trace of the model called with an image tensor, and a trace run at another size refused
with a message that says so instead of failing inside TorchScript or computing on the traced grid."""
import warnings

import pytest
import torch
from torch import nn

from compile_checks import needs_recent_dynamo

ENCODERS = {  # what a user exports: the recommended Linear-DETR, softmax with its options, and plain methods
    "taylor_dwc3_rope": ["--attention", "taylor", "--dwc-kernel", "3", "--attention-option", "rope=True"],
    "softmax_dwc3_rope": ["--attention", "softmax", "--dwc-kernel", "3", "--attention-option", "rope=True"],
    "linformer": ["--attention", "linformer"],
    "softmax": ["--attention", "softmax"],
}


def build_detr(attention):
    from linear_mha.integrations.detr.attention import apply_attention
    from linear_mha.integrations.detr.config import parse_args
    from linear_mha.integrations.detr.detr import build_model
    args = parse_args(["--backbone", "tiny", "--hidden-dim", "32", "--nheads", "4", "--enc-layers", "1",
                       "--dec-layers", "1", "--dim-feedforward", "64", "--num-queries", "5",
                       "--num-classes", "4", *attention])
    torch.manual_seed(0)
    detr, _, _ = build_model(args)
    apply_attention(detr, args, max_tokens=4096)
    return detr.eval()


class Detector(nn.Module):
    """DETR on (images, mask): tensors in, tensors out, as graphs take them."""

    def __init__(self, detr):
        super().__init__()
        self.detr = detr

    def forward(self, images, mask):
        from linear_mha.integrations.detr.misc import NestedTensor
        out = self.detr(NestedTensor(images, mask))
        return out["pred_logits"], out["pred_boxes"]


def padded_batch(height, width, seed, pad):
    g = torch.Generator().manual_seed(seed)
    images, mask = torch.randn(2, 3, height, width, generator=g), torch.zeros(2, height, width, dtype=torch.bool)
    mask[1, :, width - pad:] = mask[1, height - pad:, :] = True
    return images.masked_fill(mask[:, None], 0.0), mask


def dynamic_image_shapes():
    rows, cols = torch.export.Dim("rows", min=4, max=64), torch.export.Dim("cols", min=4, max=64)
    return ({2: 8 * rows, 3: 8 * cols}, {1: 8 * rows, 2: 8 * cols})  # sizes in steps of 8 pixels


@needs_recent_dynamo
@pytest.mark.parametrize("encoder", ["taylor_dwc3_rope", "softmax_dwc3_rope", "linformer"])
def test_detr_exports_padded_batches_at_any_size(encoder):
    """DETR's encoder over a padded batch, height and width dynamic: the token grid stays symbolic."""
    detector = Detector(build_detr(ENCODERS[encoder]))
    with torch.no_grad():
        exported = torch.export.export(detector, padded_batch(64, 64, 0, 16),
                                       dynamic_shapes=dynamic_image_shapes()).module()
        other = padded_batch(96, 80, 1, 24)
        for got, expected in zip(exported(*other), detector(*other)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_recent_dynamo
@pytest.mark.slow
@pytest.mark.parametrize("encoder", ["taylor_dwc3_rope", "softmax_dwc3_rope"])
def test_onnx_export_with_dynamic_height_and_width_runs_in_onnxruntime_at_three_sizes(encoder, tmp_path):
    """The rotary angles of a symbolic grid once exported to an Expand that onnxruntime could not run at any size."""
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    detector = Detector(build_detr(ENCODERS[encoder]))
    path = tmp_path / "detr.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(detector, padded_batch(64, 64, 0, 16), dynamo=True, dynamic_shapes=dynamic_image_shapes(),
                          verbose=False).save(str(path))
    session = onnxruntime.InferenceSession(str(path))
    names = [i.name for i in session.get_inputs()]
    for size, seed in (((64, 64), 1), ((96, 80), 2), ((48, 112), 3)):
        images, mask = padded_batch(*size, seed, 16)
        with torch.no_grad():
            expected = detector(images, mask)
        got = session.run(None, {names[0]: images.numpy(), names[1]: mask.numpy()})
        for g, e in zip(got, expected):
            torch.testing.assert_close(torch.from_numpy(g), e, rtol=1e-4, atol=1e-4)


def _trace(model, example):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's deprecation and TracerWarnings
        return torch.jit.trace(model, (example,), strict=False, check_trace=False)


@pytest.mark.parametrize("encoder", ["softmax", "linformer"])
def test_a_trace_of_detr_called_with_an_image_tensor_computes_what_eager_does_at_other_sizes(encoder):
    """A (B, 3, H, W) tensor is a batch of one size, nothing padded: the form a trace takes (the official DETR has a
    tracing path for it); methods without a grid follow the traced sizes."""
    detr = build_detr(ENCODERS[encoder])  # one decoder layer: no aux_outputs, whose list of dicts a trace refuses
    traced = _trace(detr, torch.randn(1, 3, 64, 64))
    for size in [(64, 64), (96, 64)]:
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            got, expected = traced(x), detr(x)
        torch.testing.assert_close(got["pred_boxes"], expected["pred_boxes"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("encoder", ["taylor_dwc3_rope", "softmax_dwc3_rope"])
def test_a_trace_on_a_token_grid_runs_at_its_size_and_refuses_another_by_name(encoder):
    """The grid's sizes are fixed in a trace: at the traced size the trace is eager's; at another, even one with as
    many tokens in another shape (which would silently attend over the traced grid), it stops and says why."""
    detr = build_detr(ENCODERS[encoder])
    traced = _trace(detr, torch.randn(1, 3, 128, 192))  # a 4 x 6 grid (the tiny backbone's stride is 32)
    x = torch.randn(1, 3, 128, 192)
    with torch.no_grad():
        torch.testing.assert_close(traced(x)["pred_boxes"], detr(x)["pred_boxes"], rtol=1e-5, atol=1e-5)
        for size in [(192, 128), (64, 64)]:  # 6 x 4: the same 24 tokens; 2 x 2
            with pytest.raises(Exception, match="traced \\(torch.jit.trace\\) at a 4 x 6 input .*torch.export"):
                traced(torch.randn(1, 3, *size))


def test_a_trace_of_a_patched_vit_refuses_another_patch_grid_by_name():
    timm = pytest.importorskip("timm")
    import linear_mha
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                            embed_dim=32, num_heads=2, num_classes=0, dynamic_img_size=True).eval()
    linear_mha.patch(vit, mode="taylor", dwc_kernel=3, rope=True)
    traced = _trace(vit, torch.randn(1, 3, 32, 24))
    x = torch.randn(1, 3, 32, 24)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), vit(x), rtol=1e-5, atol=1e-5)
        with pytest.raises(Exception, match="at a 4 x 3 patch grid"):
            traced(torch.randn(1, 3, 24, 32))


@needs_recent_dynamo
def test_torch_export_takes_a_token_grid_among_the_inputs():
    """TokenGrid passed as a keyword input is a constant of the graph; another grid is refused by the program."""
    import linear_mha
    attn = linear_mha.LinearMultiheadAttention(32, 4, mode="taylor", dwc_kernel=3, rope=True, batch_first=True)
    attn.eval()
    x = torch.randn(2, 12, 32)
    grid = linear_mha.TokenGrid(3, 4)
    with torch.no_grad():
        exported = torch.export.export(attn, (x, x, x), kwargs={"token_grid": grid}).module()
        x2 = torch.randn(2, 12, 32)
        torch.testing.assert_close(exported(x2, x2, x2, token_grid=grid)[0], attn(x2, x2, x2, token_grid=grid)[0],
                                   rtol=1e-5, atol=1e-5)
        with pytest.raises(Exception, match="TokenGrid"):
            exported(x2, x2, x2, token_grid=linear_mha.TokenGrid(4, 3))
