"""The trainers' console helpers: the busy-cores warning reads what runs now, --help shows defaults, a rerun never
clobbers a run."""
import argparse

import pytest
import torch

from linear_mha.integrations.console import HelpFormatter, choose_threads, eta, other_runnable_tasks, refuse_overwrite


def test_other_tasks_are_the_runnable_count_now_less_this_process(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("3.90 2.10 1.00 3/412 12345\n")  # a high 1-minute average from a finished run: ignored
    assert other_runnable_tasks(samples=2, interval=0, path=str(loadavg)) == 2
    loadavg.write_text("3.90 2.10 1.00 1/412 12345\n")
    assert other_runnable_tasks(samples=2, interval=0, path=str(loadavg)) == 0
    assert other_runnable_tasks(path=str(tmp_path / "absent")) is None


def test_threads_warn_only_when_other_work_leaves_fewer_cores_than_threads(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert "WARNING" not in choose_threads(busy=0)
    assert "with --threads 1" in choose_threads(busy=1)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert choose_threads(1, busy=5) == "1 (--threads), 2 core(s)" and set_to == [1]
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        choose_threads(0)


def test_help_shows_every_default_once():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=5e-4, help="learning rate")
    p.add_argument("--out", default="runs/x", help="folder (default: a new one)")
    p.add_argument("--flag", action="store_true", help="a switch")
    text = " ".join(p.format_help().split())
    assert "--steps STEPS default: 2000" in text and "learning rate (default: 0.0005)" in text
    assert "(default: a new one)" in text and "runs/x" not in text and "a switch (default" not in text


def test_eta_is_the_mean_pace_times_what_is_left():
    assert eta(2, 6, 120.0) == "4m00s" and eta(0, 6, 1.0) == "?" and eta(6, 6, 100.0) == "0s"


def test_a_run_stopped_before_its_first_checkpoint_is_started_again_and_a_run_with_records_is_refused(tmp_path):
    """A trainer killed during its first epoch leaves an empty log.jsonl and no checkpoint: the same command must
    start it again (it used to refuse and point at a checkpoint.pth that did not exist); one log record is a run."""
    (tmp_path / "log.jsonl").write_text("")
    (tmp_path / "args.json").write_text("{}")
    refuse_overwrite(tmp_path, ("checkpoint.pth", "log.jsonl"), resume_hint="--resume", out_flag="--output-dir")
    (tmp_path / "log.jsonl").write_text('{"epoch": 0}\n')
    with pytest.raises(FileExistsError, match=r"already holds a run \(log.jsonl\)"):
        refuse_overwrite(tmp_path, ("checkpoint.pth", "log.jsonl"), resume_hint="--resume", out_flag="--output-dir")
