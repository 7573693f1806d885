"""tools.detr_diagnose on a tiny trained softmax DETR: every linear method of the registry (a user's too) is
compared with softmax on the encoder's own q, k, with no list of methods in the tool."""
import json

import torch

import linear_mha
import user_method
from linear_mha.integrations.detr.train import main as train
from linear_mha.tools import detr_diagnose

TINY = ["--synthetic-train", "8", "--synthetic-val", "4", "--batch-size", "4", "--num-workers", "0",
        "--backbone", "tiny", "--pretrain-backbone", "0", "--attention", "softmax", "--hidden-dim", "32",
        "--dim-feedforward", "64", "--num-queries", "6", "--enc-layers", "2", "--dec-layers", "1", "--no-progress",
        "--epochs", "1"]


def test_every_registered_linear_method_is_diagnosed_against_softmax(tmp_path):
    train(TINY + ["--output-dir", str(tmp_path / "run")])
    linear_mha.register_method(user_method.ScaledRelu)
    try:
        layers = detr_diagnose.main([str(tmp_path / "run" / "checkpoint.pth"), "--images", "2", "--json",
                                     str(tmp_path / "diag.json")])
        expected = set(detr_diagnose.registry_variants())
    finally:
        linear_mha.unregister_method(user_method.NAME)
    assert len(layers) == 2 and json.loads((tmp_path / "diag.json").read_text())["layers"] == layers
    for layer in layers:
        assert set(layer["methods"]) == expected and user_method.NAME in expected
        assert "kernel_elu" in expected and "agent" in expected  # a method over the token grid gets the grid
        for name, m in layer["methods"].items():
            # rows sum to 1, so 1/2 sum |w - p| <= 1 + the row's negative weight (0 for a non-negative method)
            assert 0 <= m["tv_distance"] <= 1 + m["negative_mass"] + 1e-9 and m["output_rel_err"] >= 0, name
            assert m["float32_rel_err"] < 1e-3, name  # the same method in float32 computes the same weights


def test_the_weights_are_the_method_s_own():
    """An identity value matrix through the method gives its reference weights."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    kpm = torch.zeros(1, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    eye = torch.eye(6, dtype=torch.float64).expand(1, 2, 6, 6)
    w = detr_diagnose.method_output("taylor", {}, q, k, eye, kpm, None)
    ref = linear_mha.method_class("taylor")().reference_weights(q, k, {}, key_padding_mask=kpm)
    torch.testing.assert_close(w, ref)
