"""tools/lm_positions.py: BPC by position over train_lm's own evaluation windows, so its mean is the trainer's BPC;
runs whose windows would be other bytes are refused."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from linear_mha.lm import AutoregressiveWrapper
from linear_mha.tools import lm_positions, train_lm

ARGS = ["--corpus-bytes", "60000", "--dim", "16", "--depth", "1", "--heads", "2", "--seq-len", "16",
        "--batch-size", "2", "--eval-every", "2", "--val-bytes", "400", "--test-bytes", "400", "--no-progress",
        "--steps", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("positions")
    train_lm.main(ARGS + ["--variant", "softmax", "--out", str(root / "softmax")])
    train_lm.main(ARGS + ["--variant", "hybrid", "--global-mode", "gated_deltanet", "--out", str(root / "hybrid")])
    return root


def test_the_mean_over_positions_is_the_trainers_bpc_of_the_same_bytes_and_the_files_hold_every_position(
        runs, capsys):
    result = lm_positions.main([str(runs / "softmax"), str(runs / "hybrid"), "--max-bytes", "400",
                                "--json", str(runs / "p.json"), "--png", str(runs / "p.png")])
    for run in result["runs"]:
        args, model = lm_positions.load_run(Path(run["run"]))
        split = train_lm.load_splits(args)["test"]
        expected = train_lm.evaluate(AutoregressiveWrapper(model), split, args, 400)
        assert run["bpc"] == pytest.approx(expected, rel=1e-5) and len(run["bpc_by_position"]) == 16
    assert [r["label"] for r in result["runs"]] == ["softmax", "hybrid gated_deltanet"]
    assert [r["positions"] for r in result["ranges"]] == [[0, 8], [8, 16]]
    held = json.loads((runs / "p.json").read_text())
    assert held["runs"][1]["bpc_by_position"] == result["runs"][1]["bpc_by_position"]
    assert (runs / "p.png").stat().st_size > 0
    assert "8-16" in capsys.readouterr().out


def test_position_t_is_the_loss_of_the_byte_after_t_given_the_bytes_up_to_t(runs):
    """Per position, not only on average: a reversed or shifted curve has the same mean."""
    _, model = lm_positions.load_run(runs / "hybrid")
    window = np.frombuffer(bytes([7, 99, 3, 250, 41, 8, 8, 120, 64, 65, 66, 10, 32, 35, 200, 1, 77]), dtype=np.uint8)
    bits = lm_positions.bits_by_position(model, window, 16)
    x = torch.from_numpy(window.astype(np.int64))[None]
    for t in (0, 5, 15):
        with torch.no_grad():
            logits = model(x[:, :t + 1])[0, -1]  # only the bytes up to t
        expected = torch.nn.functional.cross_entropy(logits[None], x[0, t + 1:t + 2]).item() / np.log(2)
        assert bits[t] == pytest.approx(expected, rel=1e-5)


def test_runs_of_other_windows_and_folders_without_a_checkpoint_are_refused(runs, tmp_path):
    train_lm.main(ARGS[:ARGS.index("--seq-len")] + ["--seq-len", "8"] + ARGS[ARGS.index("--seq-len") + 2:]
                  + ["--out", str(tmp_path / "short")])
    with pytest.raises(ValueError, match="trained with other --seq-len"):
        lm_positions.main([str(runs / "softmax"), str(tmp_path / "short")])
    with pytest.raises(FileNotFoundError, match="no checkpoint.pt"):
        lm_positions.main([str(tmp_path)])
    with pytest.raises(ValueError, match="--max-bytes must be >= 2"):
        lm_positions.main([str(runs / "softmax"), "--max-bytes", "1"])
