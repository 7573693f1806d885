"""Backbone pretraining for the small DETR backbones: cell labels, weights that DETR loads, exact resume."""
import json
from pathlib import Path

import pytest
import torch

from linear_mha.integrations.detr import pretrain
from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.detr import build_model

DATA = ["--", "--synthetic-train", "16", "--synthetic-val", "4", "--scales", "64,80", "--max-size", "96",
        "--no-crop", "--val-size", "64"]


def test_cell_labels():
    # A 64x32 (h x w) image at stride 16: 4 x 2 cells, centres at x in {8, 24}, y in {8, 24, 40, 56}.
    big = [8 / 32, 24 / 64, 16 / 32, 48 / 64]     # cxcywh normalised: x 0..16, y 0..48 -> cells (0..2, 0)
    small = [24 / 32, 56 / 64, 4 / 32, 4 / 64]    # 4x4 px around (24, 56): no centre inside, its own cell (3, 1)
    inner = [8 / 32, 8 / 64, 8 / 32, 8 / 64]      # inside the big one, covers centre (8, 8): smaller wins
    target = {"size": torch.tensor([64, 32]), "boxes": torch.tensor([big, small, inner]),
              "labels": torch.tensor([2, 3, 1])}
    padding = torch.zeros(1, 5, 2, dtype=torch.bool)
    padding[0, 4] = True  # a padded row below the image
    labels = pretrain.cell_labels([target], padding, stride=16)
    expected = torch.tensor([[1, 0], [2, 0], [2, 0], [0, 3], [pretrain.IGNORE, pretrain.IGNORE]])
    assert torch.equal(labels[0], expected)


CPU = "--device", "cpu"  # resume is bit-exact where kernels are deterministic (CUDA's atomic adds are not)


def _run(tmp_path, *extra):
    return pretrain.main(["--backbone", "tiny", "--iters", "4", "--batch-size", "4", "--save-every", "2",
                          "--output-dir", str(tmp_path), "--num-workers", "0", "--no-progress", "--lr", "1e-2",
                          *extra, *DATA])


def test_weights_load_into_detr_and_change_with_training(tmp_path):
    path = _run(tmp_path)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert log[-1]["iter"] == 4 and 0 <= log[-1]["val_cell_acc"] <= 1
    args = parse_args(["--backbone", "tiny", "--backbone-weights", str(path), "--num-classes", "5"])
    model, _, _ = build_model(args)
    state = torch.load(path, weights_only=True)
    body = model.backbone[0].body.state_dict()
    assert state.keys() == body.keys() and all(torch.equal(state[k], body[k]) for k in state)
    fresh, _, _ = build_model(parse_args(["--backbone", "tiny", "--num-classes", "5"]))
    assert not torch.equal(fresh.backbone[0].body.state_dict()["layers.0.weight"], state["layers.0.weight"])
    with pytest.raises(ValueError, match="does not fit backbone 'small'"):
        build_model(parse_args(["--backbone", "small", "--backbone-weights", str(path), "--num-classes", "5"]))


def test_resume_after_interruption_repeats_the_run(tmp_path, monkeypatch):
    reference = torch.load(_run(tmp_path / "whole", *CPU), weights_only=True)
    real_batch, calls = pretrain._batch, []

    def interrupted(*args):
        if len(calls) == 3:  # dies during iteration 3, after the checkpoint of iteration 2
            raise KeyboardInterrupt
        calls.append(1)
        return real_batch(*args)
    monkeypatch.setattr(pretrain, "_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "split", *CPU)
    monkeypatch.setattr(pretrain, "_batch", real_batch)
    resumed = torch.load(_run(tmp_path / "split", *CPU, "--resume"), weights_only=True)
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=0, atol=0, msg=key)
    iters = [json.loads(line)["iter"] for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert iters == sorted(iters) and iters[-1] == 4


def test_a_signal_stops_after_a_step_with_a_checkpoint_that_resumes_exactly(tmp_path, monkeypatch):
    import os
    import signal
    reference = torch.load(_run(tmp_path / "whole", *CPU), weights_only=True)
    real_batch, calls = pretrain._batch, []

    def signalled(*args):
        calls.append(1)
        if len(calls) == 3:  # during iteration 3, between the checkpoints of iterations 2 and 4
            os.kill(os.getpid(), signal.SIGINT)
        return real_batch(*args)
    monkeypatch.setattr(pretrain, "_batch", signalled)
    assert _run(tmp_path / "split", *CPU) is None
    assert torch.load(tmp_path / "split" / "checkpoint.pth", weights_only=False)["iter"] == 3
    monkeypatch.setattr(pretrain, "_batch", real_batch)
    resumed = torch.load(_run(tmp_path / "split", *CPU, "--resume"), weights_only=True)
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=0, atol=0, msg=key)
    logs = [(tmp_path / d / "log.jsonl").read_text() for d in ("whole", "split")]
    assert logs[0] == logs[1]


@pytest.mark.slow
def test_the_trainer_pretrains_its_backbone_once_per_data_and_reuses_it(tmp_path, monkeypatch, capsys):
    from linear_mha.integrations.detr.train import main
    from test_detr_train import TINY
    monkeypatch.setenv("LINEAR_MHA_CACHE", str(tmp_path / "cache"))
    calls, real = [], pretrain.main
    monkeypatch.setattr(pretrain, "main", lambda argv: calls.append(argv) or real(argv))
    run = TINY + ["--pretrain-backbone", "3", "--epochs", "1", "--max-iters", "1"]
    main(run + ["--output-dir", str(tmp_path / "a")])
    # the pretrainer reads the run's images as the run does (given files alone, it would take COCO's 800 px preset)
    data = parse_args(calls[0][calls[0].index("--") + 1:])
    assert (data.scales, data.max_size, data.val_size, data.crop) == ([96, 112, 128, 144, 160], 192, 128, True)
    first = json.loads((tmp_path / "a" / "args.json").read_text())["backbone_weights"]
    assert "pretraining the tiny backbone for 3 iterations" in capsys.readouterr().out
    assert first.startswith(str(tmp_path / "cache" / "detr-backbones")) and Path(first).exists()
    main(run + ["--output-dir", str(tmp_path / "b")])  # same data (same seed): the cached backbone, no pretraining
    assert len(calls) == 1
    assert json.loads((tmp_path / "b" / "args.json").read_text())["backbone_weights"] == first
    losses = lambda run: [json.loads(line)["train_loss"]  # noqa: E731
                          for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
    assert losses("a") == losses("b")  # pretraining in the first run's process must not change what it trains
    assert "pretraining" not in capsys.readouterr().out
    main(run + ["--output-dir", str(tmp_path / "c"), "--seed", "7"])  # other images: another backbone
    assert json.loads((tmp_path / "c" / "args.json").read_text())["backbone_weights"] != first
    with pytest.raises(ValueError, match="--pretrain-backbone pretrains the small backbones .* --backbone-weights"):
        main(run + ["--output-dir", str(tmp_path / "d"), "--backbone", "resnet18"])
