"""linear_mha.tools.outside_suites: another project's test file runs as it is and with every nn.MultiheadAttention built as
LinearMultiheadAttention, and the table names what the stand-in changed (here a stand-in suite made for the test:
the real ones are clones the user gives)."""
import json

import pytest

from linear_mha.tools import outside_suites

SUITE = '''
import torch
from torch.nn import MultiheadAttention  # bound at import, as torch's own file does


def test_attention_runs():
    m = MultiheadAttention(8, 2)
    x = torch.randn(3, 1, 8)
    assert m(x, x, x)[0].shape == (3, 1, 8)


def test_the_class_is_torchs():
    assert type(MultiheadAttention(8, 2)).__module__.startswith("torch.")


def test_multihead_self_attn_two_masks_fast_path_mock():
    assert type(torch.nn.MultiheadAttention(8, 2)).__name__ == "MultiheadAttention"
'''


@pytest.mark.slow  # two pytest processes
def test_a_suite_runs_twice_and_its_regressions_are_named(tmp_path):
    checkout = tmp_path / "pytorch"
    (checkout / "test" / "nn").mkdir(parents=True)
    (checkout / outside_suites.SUITES["torch"][0]).write_text(SUITE)
    code = outside_suites.main(["torch", "--checkout", str(checkout), "--out", str(tmp_path / "runs"), "--json",
                                str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    outcomes = {row["test"].split("::")[-1]: (row["original"], row["linear_mha"], row["by_design"])
                for row in result["tests"]}
    assert outcomes["test_attention_runs"] == ("passed", "passed", None)
    assert outcomes["test_the_class_is_torchs"] == ("passed", "failed", None)  # the stand-in built ours
    assert outcomes["test_multihead_self_attn_two_masks_fast_path_mock"][:2] == ("passed", "failed")
    assert outcomes["test_multihead_self_attn_two_masks_fast_path_mock"][2]  # listed as by design
    assert [r.split("::")[-1] for r in result["regressions"]] == ["test_the_class_is_torchs"]
    assert code == 1  # softmax mode lost a test the original passes


MODEL_SUITE = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_the_model_runs():
    assert torch.isfinite(build()(torch.randint(0, 32, (1, 5))).logits).all()


def test_the_model_runs_transformers_attention():
    assert build().config._attn_implementation != "linear_mha"
'''


@pytest.mark.slow
def test_every_transformers_model_a_suite_builds_is_patched(tmp_path):
    pytest.importorskip("transformers")
    checkout = tmp_path / "transformers"
    (checkout / "tests" / "models" / "llama").mkdir(parents=True)
    (checkout / "tests/models/llama/test_modeling_llama.py").write_text(MODEL_SUITE)
    outside_suites.main(["transformers", "--checkout", str(checkout), "--families", "llama", "--out",
                         str(tmp_path / "runs"), "--json", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    outcomes = {row["test"].split("::")[-1]: (row["original"], row["linear_mha"]) for row in result["tests"]}
    assert outcomes == {"test_the_model_runs": ("passed", "passed"),
                        "test_the_model_runs_transformers_attention": ("passed", "failed")}
