"""The method registry: a method defined outside the library (tests/user_method.py) and registered with one call
works in LinearMultiheadAttention, patch, the DETR trainer and the benchmark; the built-in methods and every entry
point read the same list."""
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import linear_mha
import modes
import user_method

from linear_mha.integrations.detr import config as detr_config
from linear_mha import LinearMultiheadAttention, patch, registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def registered():
    linear_mha.register_method(user_method.ScaledRelu)
    yield user_method.NAME
    linear_mha.unregister_method(user_method.NAME)


def test_a_user_method_in_the_module_matches_its_reference_with_padding_and_causality(registered):
    torch.manual_seed(0)
    m = LinearMultiheadAttention(12, 3, mode=registered, eps=0.01, batch_first=True).double()
    with torch.no_grad():
        m.feature_scale.copy_(torch.tensor([0.5, 1.0, 2.0]).view(3, 1, 1))
    assert "feature_scale" in dict(m.named_parameters()) and m.method.eps == 0.01
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    for causal in (False, True):
        out, weights = m(x, x, x, key_padding_mask=kpm, is_causal=causal)
        # linear modes zero the masked positions' inputs before projecting (so garbage there reaches no gradient);
        # in self-attention those positions are queries too, and their outputs are those of a zero input
        unmasked = x.masked_fill(kpm[:, :, None], 0.0)
        q, k, v = (t.reshape(2, 9, 3, 4).transpose(1, 2) for t in torch.nn.functional.linear(
            unmasked, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1))
        expected = user_method.reference(q, k, v, m.feature_scale, 0.01, kpm, causal)
        expected = m.out_proj(expected.transpose(1, 2).reshape(2, 9, 12))
        assert weights is None
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    out.sum().backward()
    assert m.feature_scale.grad is not None and m.feature_scale.grad.abs().sum() > 0  # its state trains


def test_a_user_method_is_checked_like_a_built_in(registered):
    with pytest.raises(ValueError, match=r"mode='scaled_relu' has no option 'proj_k' \(an option of 'linformer'\)"):
        LinearMultiheadAttention(8, 2, mode=registered, proj_k=4)
    with pytest.raises(ValueError, match="eps must be a positive float"):
        LinearMultiheadAttention(8, 2, mode=registered, eps=-1.0)
    m = LinearMultiheadAttention(8, 2, mode=registered)
    x = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="does not handle the extra keys"):
        LinearMultiheadAttention(8, 2, mode=registered, add_bias_kv=True)(x, x, x)
    arbitrary = torch.zeros(4, 4, dtype=torch.bool)
    arbitrary[0, 2] = True
    with pytest.raises(ValueError, match="cannot apply"):
        m(x, x, x, attn_mask=arbitrary)
    # A checkpoint of the original nn.MultiheadAttention has no feature_scale: it loads strictly.
    m.load_state_dict(nn.MultiheadAttention(8, 2).state_dict())


def test_patch_and_patched_build_a_user_method(registered):
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                  enable_nested_tensor=False)
    report = patch(model, registered, eps=0.1)
    assert report.num_replaced == 2 and report.parameters_added == 2 * 2  # one scale per head per layer
    assert all(layer.self_attn.mode == registered for layer in model.layers)
    assert model(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    with linear_mha.patched(registered):
        built = nn.MultiheadAttention(8, 2)
    assert isinstance(built, LinearMultiheadAttention) and built.mode == registered


def test_the_detr_trainer_trains_with_a_user_method(registered, tmp_path):
    from linear_mha.integrations.detr.train import main
    from test_detr_train import TINY
    result = main(TINY + ["--attention", registered, "--attention-option", "eps=0.05", "--epochs", "1",
                          "--max-iters", "2", "--output-dir", str(tmp_path)])
    encoder = result["model"].transformer.encoder.layers
    assert all(layer.self_attn.mode == registered and layer.self_attn.method.eps == 0.05 for layer in encoder)
    assert len(result["log"]) == 1


def test_the_benchmark_measures_a_user_method(tmp_path, monkeypatch):
    """`--import user_method_plugin` registers it in the benchmark and in the fresh processes that measure memory."""
    from linear_mha.tools import benchmark
    monkeypatch.chdir(Path(__file__).parent)  # where the user's module lies
    monkeypatch.delitem(sys.modules, "user_method_plugin", raising=False)
    try:
        result = benchmark.main(["--quick", "--threads", "1", "--rows", "module:1x16", "--import", "user_method_plugin",
                                 "--methods", user_method.NAME, "--memory-rows", "module:1x16", "--memory-methods",
                                 user_method.NAME, "--json", str(tmp_path / "bench.json")])
    finally:
        linear_mha.unregister_method(user_method.NAME)
    rows = [r for r in result["records"] if r["method"] == user_method.NAME]
    assert {r["causal"] for r in rows} == {False, True} and all(r["median_ms"] > 0 for r in rows)
    measured = [r for r in rows if "mem_extra_mib" in r]  # --quick: N = 64, forward
    assert len(measured) == 2 and all(0 <= r["mem_extra_mib"] < 50 for r in measured)
    assert not any("mem_error" in r for r in rows)
    assert all(r["rel_err"] < 1e-4 for r in rows if "rel_err" in r)  # against itself in float64
    assert all("gflops" not in r for r in rows)  # no FLOP formula: none is made up


def test_registration_refuses_what_would_break_later():
    class Nameless(linear_mha.AttentionMethod):
        def attend(self, q, k, v, state, **kw):
            return v
    with pytest.raises(ValueError, match="name must be"):
        linear_mha.register_method(Nameless)
    with pytest.raises(ValueError, match="already registered"):
        linear_mha.register_method(type("Kernel2", (user_method.ScaledRelu,), {"name": "kernel"}))
    assert linear_mha.method_class("kernel").__name__ == "Kernel"
    with pytest.raises(TypeError, match="must implement attend"):
        linear_mha.register_method(type("NoAttend", (linear_mha.AttentionMethod,), {"name": "no_attend"}))
    with pytest.raises(ValueError, match=r"mode must be one of .*did you mean 'kernel'"):
        LinearMultiheadAttention(8, 2, mode="kernal")


def test_every_entry_point_reads_the_registry(registered):
    assert registered in linear_mha.available_methods()
    attention = next(a for a in detr_config.get_args_parser()._actions if a.dest == "attention")
    assert tuple(attention.choices) == linear_mha.available_methods()
    causal = {m for m in modes.BUILT_IN if linear_mha.method_class(m).causal}
    assert set(registry.causal_methods()) == causal | {registered} and {"kernel", "softmax"} <= causal


@pytest.mark.parametrize("mode", modes.BUILT_IN)
def test_every_built_in_method_carries_its_facts(mode):
    """What the tests, the benchmark and the docs read from a method instead of a list of names: its naive
    reference, its FLOP count, its documentation row."""
    cls = linear_mha.method_class(mode)
    assert cls.reference_weights is not linear_mha.AttentionMethod.reference_weights
    flops = cls(**modes.sized(mode, 64)).flops(4, 64, 16, False)
    assert isinstance(flops, float) and flops > 0
    assert cls.cost and cls.summary


def test_the_readme_modes_table_lists_the_built_in_methods():
    """The README's table is checked against the registry: a method added to the library appears in it."""
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"\| method \(`mode=`\) \| cost.*?\n\n", readme, flags=re.S).group(0)
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert sorted(listed) == sorted(modes.BUILT_IN)
    for name in listed:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert ("| yes" in row) == linear_mha.method_class(name).causal, row


def test_a_class_defined_again_replaces_itself_as_a_rerun_notebook_cell_does():
    def define():
        class Again(user_method.ScaledRelu):
            name = "again"
        return Again
    first, second = define(), define()
    linear_mha.register_method(first)
    try:
        linear_mha.register_method(second)
        assert linear_mha.method_class("again") is second
    finally:
        linear_mha.unregister_method("again")


@pytest.mark.parametrize("name", sorted(modes.ALL_VARIANTS))
def test_every_method_s_tensors_take_the_module_s_dtype(name):
    """A method's state computed in float64 (decay rates) or drawn in float32 (FAVOR+'s projection) is stored in the
    dtype the module is built with, as nn.MultiheadAttention's own parameters are."""
    options = modes.sized_variant(modes.ALL_VARIANTS[name], 16)
    for dtype in (None, torch.float64):
        module = linear_mha.LinearMultiheadAttention(16, 2, **options, **({"dtype": dtype} if dtype else {}))
        wrong = {key: t.dtype for key, t in module.state_dict().items()
                 if t.is_floating_point() and t.dtype != (dtype or torch.get_default_dtype())}
        assert not wrong, wrong
