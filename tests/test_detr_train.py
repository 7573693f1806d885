"""End-to-end training on the synthetic set: the loss falls, resume is exact (also after a signal stopped the run
in the middle of an epoch), --eval reproduces the log."""
import json
import os
import signal

import pytest
import torch

from linear_mha.integrations.detr import engine
from linear_mha.integrations.detr.train import main

TINY = ["--synthetic-train", "16", "--synthetic-val", "4", "--batch-size", "4", "--num-workers", "0",
        "--backbone", "tiny", "--pretrain-backbone", "0", "--attention", "softmax", "--crop", "--lr", "3e-4",
        "--lr-backbone", "3e-4", "--lr-drop", "25",  # the small test model's schedule, not the default run's
        "--hidden-dim", "32", "--dim-feedforward", "64", "--num-queries", "6", "--no-progress"]


def _states_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_resume_after_interruption_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    # dropout + crop use every RNG; on the CPU, whose kernels are deterministic (CUDA's atomics are not)
    common = TINY + ["--dropout", "0.1", "--lr-drop", "1", "--seed", "5", "--device", "cpu"]
    full = main(common + ["--epochs", "2", "--output-dir", str(tmp_path / "full")])
    main(common + ["--epochs", "1", "--output-dir", str(tmp_path / "cut")])
    resumed = main(common + ["--epochs", "2", "--output-dir", str(tmp_path / "cut"),
                             "--resume", str(tmp_path / "cut" / "checkpoint.pth")])
    assert _states_equal(full["model"].state_dict(), resumed["model"].state_dict())
    ckpt_full = torch.load(tmp_path / "full" / "checkpoint.pth", weights_only=False)
    ckpt_cut = torch.load(tmp_path / "cut" / "checkpoint.pth", weights_only=False)
    assert ckpt_full["epoch"] == ckpt_cut["epoch"] == 1
    assert ckpt_full["lr_scheduler"] == ckpt_cut["lr_scheduler"]
    assert ckpt_cut["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-6)  # 3e-4 dropped twice by 0.1 (lr-drop 1)
    log_full = [json.loads(line) for line in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    log_cut = [json.loads(line) for line in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in log_cut] == [0, 1]
    for a, b in zip(log_full, log_cut):
        assert a["train_loss"] == b["train_loss"] and a["test_AP"] == b["test_AP"]
    assert (tmp_path / "cut" / "curves.png").stat().st_size > 0

    evaluated = main(common + ["--eval", "--output-dir", str(tmp_path / "eval"),
                               "--resume", str(tmp_path / "cut" / "checkpoint.pth")])
    assert evaluated["coco"]["coco_eval_bbox"] == log_cut[-1]["test_coco_eval_bbox"]

    # Ctrl-C in the middle of epoch 1: the run stops after that step with a checkpoint, and --resume continues
    # with the next batch to the same weights and log as the uninterrupted run.
    real_targets_to, calls, signal_at = engine._targets_to, [], [7]

    def targets_to_then_signal(targets, device):
        calls.append(1)
        if len(calls) == signal_at[0]:  # epoch 0: 4 training batches + 1 eval batch; 7: epoch 1's second batch
            os.kill(os.getpid(), signal.SIGINT)
        return real_targets_to(targets, device)
    monkeypatch.setattr(engine, "_targets_to", targets_to_then_signal)
    stopped = main(common + ["--epochs", "2", "--output-dir", str(tmp_path / "signal")])
    monkeypatch.setattr(engine, "_targets_to", real_targets_to)
    assert stopped["stopped_at"] == (1, 2)
    ckpt = torch.load(tmp_path / "signal" / "checkpoint.pth", weights_only=False)
    assert (ckpt["epoch"], ckpt["iteration"]) == (1, 2) and ckpt["train_meter"]["counts"]["loss"] == 2
    resumed = main(common + ["--epochs", "2", "--output-dir", str(tmp_path / "signal"),
                             "--resume", str(tmp_path / "signal" / "checkpoint.pth")])
    assert resumed["stopped_at"] is None
    assert _states_equal(full["model"].state_dict(), resumed["model"].state_dict())
    log_signal = [json.loads(line) for line in (tmp_path / "signal" / "log.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in log_signal] == [0, 1]
    for a, b in zip(log_full, log_signal):  # epoch 1's mean loss covers the batches before and after the stop
        assert a["train_loss"] == b["train_loss"] and a["test_AP"] == b["test_AP"]

    # During epoch 0's evaluation (call 5): the evaluation is dropped, the trained epoch saved, and resumed runs
    # it again; a resume with another --batch-size would skip the wrong images, so it is refused.
    calls.clear()
    signal_at[0] = 5
    monkeypatch.setattr(engine, "_targets_to", targets_to_then_signal)
    stopped = main(common + ["--epochs", "2", "--output-dir", str(tmp_path / "eval_signal")])
    monkeypatch.setattr(engine, "_targets_to", real_targets_to)
    assert stopped["stopped_at"] == (0, 4) and stopped["log"] == []
    ckpt_path = str(tmp_path / "eval_signal" / "checkpoint.pth")
    with pytest.raises(ValueError, match="same --batch-size"):
        main([a if a != "4" else "2" for a in common] + ["--epochs", "2", "--output-dir",
                                                          str(tmp_path / "eval_signal"), "--resume", ckpt_path])
    resumed = main(common + ["--epochs", "2", "--output-dir", str(tmp_path / "eval_signal"), "--resume", ckpt_path])
    assert _states_equal(full["model"].state_dict(), resumed["model"].state_dict())
    log_eval = [json.loads(line) for line in (tmp_path / "eval_signal" / "log.jsonl").read_text().splitlines()]
    assert [(e["train_loss"], e["test_AP"]) for e in log_eval] == [(e["train_loss"], e["test_AP"]) for e in log_full]


@pytest.mark.slow
def test_tiny_training_lowers_the_loss(tmp_path):
    args = [a if a != "16" else "8" for a in TINY]  # 8 training images: 2 steps per epoch
    run = main(args + ["--epochs", "10", "--lr", "1e-3", "--lr-backbone", "1e-3", "--no-crop",
                       "--output-dir", str(tmp_path)])
    train = [e["train_loss"] for e in run["log"]]
    val = [e["test_loss"] for e in run["log"]]
    assert train[-1] < 0.9 * train[0], train
    assert val[-1] < val[0], val


def test_bad_resume_path_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--resume"):
        main(TINY + ["--epochs", "1", "--output-dir", str(tmp_path), "--resume", str(tmp_path / "missing.pth")])


def test_a_run_stopped_between_its_checkpoint_and_its_log_line_keeps_the_record(tmp_path):
    """The checkpoint of epoch 1 was written, then the process died before the log line: the resumed run must not
    lose epoch 1's record (it is in the checkpoint)."""
    common = TINY + ["--max-iters", "1", "--output-dir", str(tmp_path)]
    main(common + ["--epochs", "2"])
    log_path = tmp_path / "log.jsonl"
    lines = log_path.read_text().splitlines()
    log_path.write_text(lines[0] + "\n")  # epoch 1's line never made it to the file
    main(common + ["--epochs", "3", "--resume", str(tmp_path / "checkpoint.pth")])
    log = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [e["epoch"] for e in log] == [0, 1, 2]
    assert log[1] == json.loads(lines[1])


def test_bad_setups_are_refused_with_the_flag_to_change(tmp_path):
    with pytest.raises(ValueError, match="--eval evaluates trained weights: pass --resume .* or --pretrained"):
        main(TINY + ["--eval", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"category id 4, but --num-classes is 3 .*pass --num-classes 5"):
        main(TINY + ["--num-classes", "3", "--epochs", "1", "--max-iters", "1", "--output-dir", str(tmp_path)])
    data = tmp_path / "synthetic-coco" / "annotations" / "instances_train.json"
    content = json.loads(data.read_text())
    content["categories"] = content["categories"][:2]  # ids 3 and 4 used but not listed
    data.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"category ids \[3, 4\] that their file's 'categories' does not list"):
        main(TINY + ["--epochs", "1", "--max-iters", "1", "--output-dir", str(tmp_path), "--train-images",
                     str(data.parents[1] / "train"), "--train-ann", str(data), "--val-images",
                     str(data.parents[1] / "val"), "--val-ann", str(data.parents[1] / "annotations" /
                                                                    "instances_val.json")])


def test_the_console_shows_a_banner_progress_and_one_summary_and_a_second_run_never_clobbers_the_first(
        tmp_path, capsys):
    run = TINY + ["--epochs", "2", "--max-iters", "1", "--output-dir", str(tmp_path), "--attention", "efficient"]
    main(run)
    out = capsys.readouterr().out
    assert "attention  encoder: efficient; the rest softmax" in out and f"output     {tmp_path}/" in out
    assert "epoch 1/2:" in out and "epoch 2/2:" in out and "ETA" in out
    # COCOeval's own 12-line table (it says "Average Precision") only with --verbose; ours once, at the end
    assert "Average Precision" not in out and out.count("AP75") == 1 and "s per training iteration" in out
    log = (tmp_path / "log.jsonl").read_text()
    with pytest.raises(FileExistsError, match=r"already holds a run .* --resume .*checkpoint.pth, .* another "
                                              r"--output-dir, or pass --overwrite"):
        main(run)
    assert (tmp_path / "log.jsonl").read_text() == log  # the refused run changed nothing
    main(run[:-4] + ["--epochs", "1", "--output-dir", str(tmp_path), "--overwrite", "--verbose"])
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 1
    assert "Average Precision" in capsys.readouterr().out
