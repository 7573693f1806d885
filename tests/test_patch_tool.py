"""tools/patch_model.py end to end on a tiny timm ViT: softmax patching reproduces the model, JSON and PNG are
written, linear modes give finite outputs."""
import json

import pytest

pytest.importorskip("timm")
from linear_mha.tools import patch_model

TINY = ["vit_tiny_patch16_224", "--model-arg", "depth=1", "--model-arg", "img_size=32", "--batch-sizes", "1", "2",
        "--repeats", "1", "--threads", "1"]


@pytest.mark.slow
def test_softmax_reproduces_and_files_are_written(tmp_path, capsys):
    # one batch size: each point's memory takes two fresh processes (the loop over points is
    # test_linear_mode_and_dynamic_sizes', without memory)
    one_batch = TINY[:TINY.index("--batch-sizes")] + ["--batch-sizes", "2"] + TINY[TINY.index("--repeats"):]
    result = patch_model.main(one_batch + ["--mode", "softmax", "--json", str(tmp_path / "r.json"),
                                           "--png", str(tmp_path / "r.png")])
    assert [r["batch"] for r in result["rows"]] == [2] and all(r["tokens"] == 5 for r in result["rows"])
    assert all(r["max_rel_dev"] < 1e-5 and r["cosine"] > 0.99999 for r in result["rows"])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["report"]["replaced"] == ["blocks.0.attn"] and len(saved["rows"]) == 1
    assert (tmp_path / "r.png").stat().st_size > 0
    assert "blocks.0.attn" in capsys.readouterr().out
    # memory from a fresh process per point: the same model in both, so the numbers are comparable
    assert all(r["peak_mib_before"] > 0 and r["peak_mib_after"] > 0 for r in result["rows"])


def test_linear_mode_and_dynamic_sizes():
    result = patch_model.main(TINY[:5] + ["--model-arg", "dynamic_img_size=True", "--img-sizes", "32", "48",
                                          "--batch-sizes", "1", "--repeats", "1", "--mode", "linformer",
                                          "--option", "proj_k=4", "--no-memory"])
    assert result["options"]["seq_len"] == (48 // 16) ** 2 + 1  # the largest input's token count
    assert [r["tokens"] for r in result["rows"]] == [5, 10]
    assert all(r["finite"] and r["max_rel_dev"] > 0 for r in result["rows"])


def test_a_zero_initialised_head_is_not_read_as_a_perfect_match():
    """torchvision zero-initialises its ViT head: equal all-zero logits say nothing, the head's input does."""
    result = patch_model.main(["torchvision:vit_b_16", "--model-arg", "image_size=32",
                               "--batch-sizes", "2", "--repeats", "1", "--threads", "1", "--mode", "efficient",
                               "--no-memory"])
    row = result["rows"][0]
    assert row["max_rel_dev"] is None and row["cosine"] is None
    assert row["head_input_max_rel_dev"] > 1e-3 and row["head_input_cosine"] < 1.0


def test_linformer_seq_len_covers_a_single_non_native_size_and_padded_grids():
    base = TINY[:5] + ["--model-arg", "dynamic_img_size=True", "--batch-sizes", "1", "--repeats", "1",
                       "--mode", "linformer", "--option", "proj_k=4", "--no-memory"]
    assert patch_model.main(base + ["--img-sizes", "48"])["options"]["seq_len"] == (48 // 16) ** 2 + 1
    padded = patch_model.main(base + ["--model-arg", "dynamic_img_pad=True", "--img-sizes", "40"])
    assert padded["options"]["seq_len"] == 3 ** 2 + 1 and padded["rows"][0]["tokens"] == 10  # 40 px pads to 48


def test_calibration_is_reported_and_brings_the_patched_model_closer():
    result = patch_model.main(TINY[:5] + ["--batch-sizes", "4", "--repeats", "1", "--mode", "hedgehog",
                                          "--calibrate-steps", "30", "--no-memory"])
    row = result["rows"][0]
    assert result["calibration"]["steps"] == 30
    assert row["calibrated_head_input_max_rel_dev"] < row["head_input_max_rel_dev"]
    assert row["calibrated_head_input_cosine"] > row["head_input_cosine"]
