"""tools/detr_compare.py end to end at a toy budget: a shared pretrained backbone, every variant, resume."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import detr_compare  # noqa: E402

TRAIN = ["--synthetic-train", "8", "--synthetic-val", "4", "--batch-size", "4", "--hidden-dim", "32",
         "--dim-feedforward", "64", "--num-queries", "6", "--scales", "64", "--max-size", "96", "--no-crop",
         "--val-size", "64"]


@pytest.mark.slow
def test_compare_runs_every_variant_from_one_pretrained_backbone_and_resumes(tmp_path):
    argv = ["--out", str(tmp_path), "--epochs", "1", "--max-iters", "1", "--skip-encoder", "--num-workers", "0",
            "--pretrain-iters", "2", "--timing-iters", "1", "--"] + TRAIN
    detr_compare.main(argv)
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["training"]
    assert [r["variant"] for r in rows] == list(detr_compare.VARIANTS)
    weights = str(tmp_path / "backbone" / "backbone.pth")
    for r in rows:
        assert 0 <= r["AP"] <= 1 and r["peak_MiB"] > 0 and r["timed_s_per_iter"] > 0
        args = json.loads((tmp_path / r["variant"] / "args.json").read_text())
        assert args["backbone_weights"] == weights
    assert (tmp_path / "ap_curves.png").stat().st_size > 0

    # A second call finds every run finished: it resumes instead of training again, same table.
    mtime = (tmp_path / "softmax" / "checkpoint.pth").stat().st_mtime
    detr_compare.main(argv)
    again = json.loads((tmp_path / "results.json").read_text())["training"]
    assert [(r["variant"], r["AP"]) for r in again] == [(r["variant"], r["AP"]) for r in rows]
    assert (tmp_path / "softmax" / "checkpoint.pth").stat().st_mtime == mtime


def test_a_run_stopped_by_a_signal_stops_the_comparison(tmp_path, monkeypatch):
    """Ctrl-C checkpoints the running variant; the comparison must not read its half-done log and go on."""
    monkeypatch.setattr(detr_compare, "train_main", lambda argv: {"stopped_at": (0, 1)})
    with pytest.raises(SystemExit) as stopped:
        detr_compare.main(["--out", str(tmp_path), "--epochs", "1", "--skip-encoder", "--num-workers", "0", "--"]
                          + TRAIN)
    assert stopped.value.code == 130
    monkeypatch.setattr(detr_compare, "pretrain_main", lambda argv: None)
    with pytest.raises(SystemExit, match="130"):
        detr_compare.main(["--out", str(tmp_path), "--epochs", "1", "--skip-encoder", "--pretrain-iters", "2",
                           "--num-workers", "0", "--"] + TRAIN)
