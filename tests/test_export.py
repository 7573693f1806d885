"""A recorded graph computes what eager computes. torch.jit.trace (which the legacy ONNX exporter uses) and
torch.export (which the dynamo ONNX exporter uses) of LinearMultiheadAttention, key padding included, give eager's
outputs on other values and other masks; what a graph cannot record is refused with an error that says so."""
import json
import warnings

import pytest
import torch
from torch import nn

import linear_mha
import modes

EXPORT_VARIANTS = modes.ALL_VARIANTS
# Checks that read mask values step aside only when torch says it is exporting (torch.compiler.is_exporting, from
# torch 2.6); on older torch such an export stops with torch's data-dependent error instead (never a wrong graph).
needs_is_exporting = pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"),
                                        reason="torch.export of masked attention needs torch >= 2.6")
# The dynamo of torch < 2.6 breaks the graph inside the attention path (dict updates, vars()), so fullgraph needs more.
needs_recent_dynamo = pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"),
                                         reason="one graph of a patched model needs the dynamo of torch >= 2.6")


class SelfAttention(nn.Module):
    """The module as a graph's root: tensors in, the output tensor out (a grid, if any, fixed at build)."""

    def __init__(self, options, tokens):
        super().__init__()
        self.attn = linear_mha.LinearMultiheadAttention(32, 4, batch_first=True, **modes.sized_variant(options, tokens))
        self.grid = modes.grid_for(self.attn, tokens)

    def forward(self, x, key_padding_mask=None):
        return self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False, token_grid=self.grid,
                         **modes.causal_if_required(self.attn))[0]


def _inputs(tokens, seed, padded_rows):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, 32, generator=g)
    kpm = torch.zeros(2, tokens, dtype=torch.bool)
    for row, start in padded_rows.items():
        kpm[row, start:] = True
    return x, kpm


def _model(name, tokens=16):
    torch.manual_seed(0)
    return SelfAttention(EXPORT_VARIANTS[name], tokens).eval()


@pytest.mark.parametrize("name", EXPORT_VARIANTS)
def test_a_trace_computes_what_eager_does_on_other_inputs(name):
    """The compiled CPU kernels run through ctypes, which a trace does not see (it would save a model returning
    uninitialised memory); and a trace made on an unpadded batch must not bake in 'no padding'."""
    model = _model(name)
    x, unpadded = _inputs(16, 0, {})
    x2, padded = _inputs(16, 1, {0: 10, 1: 13})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's TracerWarnings
        plain = torch.jit.trace(model, (x,), check_trace=False)
        torch.testing.assert_close(plain(x2), model(x2), rtol=1e-5, atol=1e-5)
        masked = torch.jit.trace(model, (x, unpadded), check_trace=False)
        torch.testing.assert_close(masked(x2, padded), model(x2, padded), rtol=1e-5, atol=1e-5)


@needs_is_exporting
@pytest.mark.parametrize("name", EXPORT_VARIANTS)
def test_torch_export_with_key_padding_computes_what_eager_does(name):
    model = _model(name)
    x, kpm = _inputs(16, 0, {1: 12})
    x2, kpm2 = _inputs(16, 1, {0: 5})
    with torch.no_grad():
        exported = torch.export.export(model, (x, kpm)).module()
        torch.testing.assert_close(exported(x2, kpm2), model(x2, kpm2), rtol=1e-5, atol=1e-5)


MAX_LENGTH = 256


@needs_is_exporting
@pytest.mark.parametrize("name", [name for name, options in modes.VARIANTS.items()
                                  if modes.method_of(options).exports_dynamic_length])
def test_torch_export_with_dynamic_batch_and_length(name):
    """Batch and length both dynamic, checked at lengths other than the example's, the longest included (Linformer,
    built for seq_len = the longest, takes E's first S columns: a slice that changes layout at S == seq_len)."""
    model = _model(name, tokens=MAX_LENGTH)
    x, kpm = _inputs(16, 0, {1: 12})
    batch, length = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("length", min=2, max=MAX_LENGTH)
    with torch.no_grad():
        exported = torch.export.export(model, (x, kpm), dynamic_shapes=({0: batch, 1: length},) * 2).module()
        for tokens in (24, 3, MAX_LENGTH):
            g = torch.Generator().manual_seed(tokens)
            x2 = torch.randn(3, tokens, 32, generator=g)
            kpm2 = torch.zeros(3, tokens, dtype=torch.bool)
            kpm2[0, tokens // 2 + 1:] = True
            torch.testing.assert_close(exported(x2, kpm2), model(x2, kpm2), rtol=1e-5, atol=1e-5)


@needs_is_exporting
@pytest.mark.parametrize("name", [name for name, options in modes.VARIANTS.items()
                                  if not modes.method_of(options).exports_dynamic_length])
def test_a_method_that_says_so_refuses_a_dynamic_length_and_exports_a_dynamic_batch(name):
    """exports_dynamic_length=False (block_local's blocks) is what export does."""
    model = _model(name)
    x, kpm = _inputs(16, 0, {1: 12})
    batch, length = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("length", min=2, max=MAX_LENGTH)
    with torch.no_grad():
        with pytest.raises(ValueError, match="fixed sequence length"):
            torch.export.export(model, (x, kpm), dynamic_shapes=({0: batch, 1: length},) * 2)
        exported = torch.export.export(model, (x, kpm), dynamic_shapes=({0: batch},) * 2).module()
        x2, kpm2 = torch.randn(5, 16, 32), torch.zeros(5, 16, dtype=torch.bool)
        kpm2[3, 4:] = True
        torch.testing.assert_close(exported(x2, kpm2), model(x2, kpm2), rtol=1e-5, atol=1e-5)


class CausalAttention(nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.attn = linear_mha.LinearMultiheadAttention(32, 4, batch_first=True, mode="kernel")
        self.is_causal = is_causal

    def forward(self, x, mask):
        return self.attn(x, x, x, attn_mask=mask, is_causal=self.is_causal, need_weights=False)[0]


@needs_is_exporting
def test_a_graph_takes_an_attn_mask_as_causal_only_when_the_caller_says_so():
    """Which pattern an attn_mask holds cannot be read inside a graph (and a trace would bake the first one in):
    with is_causal=True it is the causal mask, as torch's own hint; otherwise the export is refused."""
    x = torch.randn(2, 10, 32)
    causal = torch.ones(10, 10, dtype=torch.bool).triu(1)
    with torch.no_grad():
        model = CausalAttention(is_causal=True).eval()
        exported = torch.export.export(model, (x, causal)).module()
        torch.testing.assert_close(exported(x, causal), model(x, causal), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="is_causal=True"):
            torch.export.export(CausalAttention(is_causal=False).eval(), (x, causal))


@needs_is_exporting
def test_a_patched_transformer_encoder_exports_with_its_padding_mask():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    linear_mha.patch(model, "kernel")
    model.eval()
    x, kpm = _inputs(12, 0, {1: 8})
    x2, kpm2 = _inputs(12, 1, {0: 4})

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = model

        def forward(self, x, kpm):
            return self.encoder(x, src_key_padding_mask=kpm)

    with torch.no_grad():
        exported = torch.export.export(Encoder(), (x, kpm)).module()
        expected = model(x2, src_key_padding_mask=kpm2)
        got = exported(x2, kpm2)
    valid = ~kpm2[..., None]  # padded positions' own outputs are padding's
    torch.testing.assert_close(got * valid, expected * valid, rtol=1e-5, atol=1e-5)


@needs_is_exporting
@pytest.mark.parametrize("name", modes.VARIANTS)
def test_onnx_export_runs_in_onnxruntime_as_eager(name, tmp_path):
    """torch.onnx.export(dynamo=True) with a key padding mask, batch and length dynamic where export allows it, run
    by onnxruntime on another batch and mask."""
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    fixed = not modes.method_of(EXPORT_VARIANTS[name]).exports_dynamic_length  # refused as dynamic (test above)
    model = _model(name, tokens=MAX_LENGTH)
    x, kpm = _inputs(16, 0, {1: 12})
    g = torch.Generator().manual_seed(2)
    x2 = torch.randn(2 if fixed else 3, 16 if fixed else 24, 32, generator=g)
    kpm2 = torch.zeros(x2.shape[:2], dtype=torch.bool)
    kpm2[0, 5:] = True
    dynamic = None if fixed else ({0: "batch", 1: "length"},) * 2
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x, kpm), dynamo=True, dynamic_shapes=dynamic, verbose=False).save(
            str(tmp_path / "attention.onnx"))
        expected = model(x2, kpm2)
    session = onnxruntime.InferenceSession(str(tmp_path / "attention.onnx"))
    names = [i.name for i in session.get_inputs()]
    got = session.run(None, {names[0]: x2.numpy(), names[1]: kpm2.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-4)


def test_scripting_a_patched_model_says_to_export_or_trace_instead():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 1,
                                  enable_nested_tensor=False)
    linear_mha.patch(model, "kernel")
    with pytest.raises(TypeError, match=r"torch.jit.script cannot compile .*torch.export.export.*torch.jit.trace"):
        torch.jit.script(model)
    with pytest.raises(TypeError, match="torch.jit.script cannot compile LinearMultiheadAttention"):
        torch.jit.script(linear_mha.LinearMultiheadAttention(32, 4, mode="taylor"))


@pytest.mark.parametrize("name", ["kernel_elu", "efficient"])
def test_the_legacy_onnx_exporter_records_the_computation_not_a_constant(name, tmp_path):
    """The TorchScript-based exporter traces: with the compiled CPU kernels in the trace it saved a graph whose output
    ignored its inputs."""
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _model(name)
    x, kpm = _inputs(16, 0, {1: 12})
    x2, kpm2 = _inputs(16, 1, {0: 5})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x, kpm), str(tmp_path / "legacy.onnx"), dynamo=False)
        expected = model(x2, kpm2)
    session = onnxruntime.InferenceSession(str(tmp_path / "legacy.onnx"))
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), (x2, kpm2))}
    got = session.run(None, feeds)[0]
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", modes.CAUSAL_VARIANTS)
def test_a_causal_trace_computes_what_eager_does(name):
    """Causal paths run custom autograd Functions and blocked loops in eager; a trace records what they compute."""
    torch.manual_seed(0)
    model = CausalAttention(is_causal=True)
    model.attn = linear_mha.LinearMultiheadAttention(32, 4, batch_first=True,
                                                     **modes.sized_variant(EXPORT_VARIANTS[name], 40))
    model.eval()
    causal = torch.ones(40, 40, dtype=torch.bool).triu(1)
    x, x2 = torch.randn(2, 40, 32), torch.randn(2, 40, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model, (x, causal), check_trace=False)
        torch.testing.assert_close(traced(x2, causal), model(x2, causal), rtol=1e-5, atol=1e-5)


def _timm_vit():
    timm = pytest.importorskip("timm")
    return timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, depth=2, embed_dim=32,
                                                            num_heads=2, num_classes=10)


def _torchvision_vit():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=10)


@needs_is_exporting
@pytest.mark.parametrize("build", [_timm_vit, _torchvision_vit], ids=["timm", "torchvision"])
@pytest.mark.parametrize("method", [dict(mode="taylor", dwc_kernel=3), dict(mode="agent"), dict(mode="hedgehog")],
                         ids=["taylor_dwc3", "agent", "hedgehog"])
def test_a_patched_vit_exports_with_a_dynamic_batch(build, method):
    """The patch grid reaches the attention through patch's forward hook, which export runs like any module code."""
    torch.manual_seed(0)
    vit = build()
    linear_mha.patch(vit, **method)
    vit.eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.no_grad():
        exported = torch.export.export(vit, (torch.randn(2, 3, 32, 32),), dynamic_shapes=({0: batch},)).module()
        other = torch.randn(5, 3, 32, 32)
        torch.testing.assert_close(exported(other), vit(other), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [_timm_vit, _torchvision_vit], ids=["timm", "torchvision"])
def test_a_patched_vit_with_a_local_term_records_with_jit_trace(build):
    """Under torch.jit.trace sizes are 0-d tensors: the grid takes them as the ints the trace fixes, as it fixes
    every shape (a TokenGrid of tensors was refused)."""
    torch.manual_seed(0)
    vit = build().eval()
    linear_mha.patch(vit, mode="taylor", dwc_kernel=3)
    with torch.no_grad():
        for p in vit.parameters():  # the local term starts at zero, which would hide a wrong grid
            if p.dim() == 4 and p.shape[1] == 1:
                p.normal_()
        traced = torch.jit.trace(vit, (torch.randn(2, 3, 32, 32),), check_trace=False)
        other = torch.randn(3, 3, 32, 32)
        torch.testing.assert_close(traced(other), vit(other), rtol=1e-5, atol=1e-5)

@needs_recent_dynamo
def test_a_patched_vit_with_a_local_term_compiles_as_one_graph():
    """The grid's hooks add no hook while a graph is recorded: fullgraph=True, and the grid follows each size."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                            embed_dim=32, num_heads=2, num_classes=0, dynamic_img_size=True).eval()
    linear_mha.patch(vit, mode="kernel", dwc_kernel=3)
    with torch.no_grad():
        vit.blocks[0].attn.dwc_weight.normal_()
        compiled = torch.compile(vit, backend="eager", fullgraph=True)
        for size in [(32, 24), (24, 32)]:
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(compiled(x), vit(x), rtol=1e-5, atol=1e-5)
        # A patch convolution swapped since the last eager call, then recorded at once: the graph gets the new grid
        # (8 x 2 patches of 4 px, where the last eager call left 3 x 4), or with fullgraph a clear error.
        vit.set_input_size(patch_size=(4, 4))
        x = torch.randn(1, 3, 32, 8)
        with pytest.raises(Exception, match="run the model once eagerly first"):
            torch.compile(vit, backend="eager", fullgraph=True)(x)
        torch.testing.assert_close(torch.compile(vit, backend="eager")(x), vit(x), rtol=1e-5, atol=1e-5)
        vit.set_input_size(patch_size=(8, 8))  # and torch.jit.trace, which runs the hooks as Python
        x = torch.randn(1, 3, 64, 16)
        traced = torch.jit.trace(vit, (x,), check_trace=False)
        torch.testing.assert_close(traced(x), vit(x), rtol=1e-5, atol=1e-5)

@needs_is_exporting
def test_the_export_benchmark_checks_each_graph_and_writes_its_table(tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("matplotlib")
    from linear_mha.tools import export_bench

    export_bench.main(["--grid", "4x6", "--repeats", "1", "--threads", "1", "--layers", "1",
                       "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")])
    result = json.loads((tmp_path / "r.json").read_text())
    assert [r["variant"] for r in result["records"]] == list(export_bench.VARIANTS) and result["layers"] == 1
    assert all(r["onnx_relative_error"] < 1e-4 and r["onnx_ms"] > 0 and r["eager_ms"] > 0 for r in result["records"])
    assert (tmp_path / "r.png").stat().st_size > 0
