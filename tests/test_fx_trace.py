"""torch.fx symbolic tracing of patched models: every attention module is recorded as one call_module node (as FX
records the nn.MultiheadAttention it replaced), the graph computes what the model does, and the token grid of a
local term reaches the attention modules when the graph runs (torchvision's and timm's feature extractors)."""
import pytest
import torch
from torch import nn

import linear_mha
from linear_mha import LinearMultiheadAttention


class Block(nn.Module):
    """A user's block (not a torch.nn class, so FX traces through it) around nn.MultiheadAttention."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, key_padding_mask):
        out, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return self.norm(x + out)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x, key_padding_mask):
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return x.sum(1)


@pytest.mark.parametrize("mode", ["softmax", "kernel", "taylor", "hedgehog"])
def test_traced_model_records_each_attention_as_one_node_and_matches(mode):
    torch.manual_seed(0)
    model = Net().double()
    linear_mha.patch(model, mode=mode)
    graph = torch.fx.symbolic_trace(model)
    called = [node.target for node in graph.graph.nodes if node.op == "call_module"]
    assert "blocks.0.attn" in called and "blocks.1.attn" in called
    assert not any(target.startswith("blocks.0.attn.") for target in called)  # not traced through
    assert isinstance(graph.get_submodule("blocks.0.attn"), LinearMultiheadAttention)

    x = torch.randn(3, 7, 16, dtype=torch.double, requires_grad=True)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True  # a padded sequence: the mask is a graph input, not a constant of the trace
    expected = model(x, pad)
    got = graph(x, pad)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    grads = torch.autograd.grad(got.sum(), [x] + list(graph.parameters()))
    expected_grads = torch.autograd.grad(expected.sum(), [x] + list(model.parameters()))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    other = torch.zeros(3, 7, dtype=torch.bool)
    torch.testing.assert_close(graph(x, other), model(x, other), rtol=0, atol=0)


def test_hooks_run_when_the_graph_runs_and_constant_inputs_are_kept():
    # As for nn.MultiheadAttention: the module is a leaf before its hooks run, so a hook that changes the inputs is
    # neither recorded into the graph nor run twice; attention over a buffer (no symbolic input at all) is a node too.
    class Memory(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn
            self.register_buffer("memory", torch.randn(1, 4, 16))

        def forward(self, x):
            read, _ = self.attn(self.memory, self.memory, self.memory, need_weights=False)
            return self.attn(x, x, x, need_weights=False)[0] + read.mean()

    steps = []
    for attn in (nn.MultiheadAttention(16, 2, batch_first=True), LinearMultiheadAttention(16, 2, batch_first=True,
                                                                                           mode="kernel")):
        model = Memory(attn).eval()
        model.attn.register_forward_pre_hook(lambda module, args: tuple(2 * a for a in args))
        graph = torch.fx.symbolic_trace(model)
        steps.append([(node.op, str(node.target)) for node in graph.graph.nodes])
        x = torch.randn(2, 5, 16)
        torch.testing.assert_close(graph(x), model(x), rtol=0, atol=0)
    assert steps[1] == steps[0] and ("call_module", "attn") in steps[0]

def test_a_tracer_that_traces_through_still_gets_one_node():
    # FX quantization's tracer decides leaves without torch.fx.Tracer's is_leaf_module: the adapter then records its
    # own call_module node when symbolic values reach its forward.
    class TorchNnLeaves(torch.fx.Tracer):
        def is_leaf_module(self, m, module_qualified_name):
            return type(m).__module__.startswith("torch.nn")

    torch.manual_seed(0)
    model = Net().double()
    linear_mha.patch(model, mode="kernel")
    graph = torch.fx.GraphModule(model, TorchNnLeaves().trace(model))
    assert "blocks.1.attn" in [node.target for node in graph.graph.nodes if node.op == "call_module"]
    x, pad = torch.randn(2, 6, 16, dtype=torch.double), torch.zeros(2, 6, dtype=torch.bool)
    torch.testing.assert_close(graph(x, pad), model(x, pad), rtol=0, atol=0)
    # Such a tracer has run the module's hooks into the graph already; its node would run them a second time.
    model.blocks[0].attn.register_forward_hook(lambda module, args, out: (2 * out[0], out[1]))
    with pytest.raises(TypeError, match="set_non_traceable_module_classes"):
        TorchNnLeaves().trace(model)


def test_modules_built_before_a_reload_stay_whole_and_keep_their_grid():
    # Jupyter's autoreload re-executes a module: the rule and the tracker must not test against the class objects of
    # before (a fresh interpreter, so that this process keeps its classes).
    pytest.importorskip("timm")
    script = """
import importlib, torch, timm, linear_mha
from linear_mha import adapters, token_grid
vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                        embed_dim=32, num_heads=2, num_classes=0)
importlib.reload(token_grid)
linear_mha.patch(vit, "kernel", dwc_kernel=3)
importlib.reload(adapters)
graph = torch.fx.symbolic_trace(vit)
x = torch.randn(1, 3, 32, 32)
torch.testing.assert_close(graph(x), vit(x))
print("ok")
"""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]

def test_tracing_the_module_itself_says_what_to_trace():
    with pytest.raises(TypeError, match="Trace the model that holds it"):
        torch.fx.symbolic_trace(LinearMultiheadAttention(16, 2, mode="kernel"))


def test_forward_keeps_its_signature():
    # calibrate and output_padding bind a call's arguments to it.
    import inspect
    params = inspect.signature(LinearMultiheadAttention.forward).parameters
    assert list(params)[:4] == ["self", "query", "key", "value"] and "token_grid" in params


def test_torchvision_feature_extractor_on_a_patched_vit_with_a_local_term():
    pytest.importorskip("torchvision")
    from torchvision.models import VisionTransformer
    from torchvision.models.feature_extraction import create_feature_extractor
    torch.manual_seed(0)
    vit = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16,
                            mlp_dim=32).double().eval()
    linear_mha.patch(vit, mode="kernel", dwc_kernel=3)
    extractor = create_feature_extractor(vit, return_nodes={"encoder.ln": "tokens", "heads": "logits"})
    x = torch.randn(2, 3, 32, 32, dtype=torch.double)
    torch.testing.assert_close(extractor(x)["logits"], vit(x), rtol=0, atol=0)


def test_timm_feature_extractor_reads_each_images_grid():
    # The grid comes from a hook on the patch convolution, which the graph calls; a hook on a module the trace went
    # through would not run, leaving no grid, or the one of an earlier image: 4 x 3 and 3 x 4 patches are both 12
    # tokens, and the transposed grid would mix the wrong neighbours without an error.
    timm = pytest.importorskip("timm")
    from timm.models import create_feature_extractor
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2, num_classes=0, dynamic_img_size=True).double().eval()
    linear_mha.patch(model, mode="kernel", dwc_kernel=3)
    extractor = create_feature_extractor(model, return_nodes={"norm": "tokens"})
    for size in [(32, 24), (24, 32), (40, 24)]:
        x = torch.randn(2, 3, *size, dtype=torch.double)
        expected = model.forward_features(x)
        model.forward_features(torch.randn(1, 3, *reversed(size), dtype=torch.double))  # a different last grid
        torch.testing.assert_close(extractor(x)["tokens"], expected, rtol=0, atol=0)

