"""tools/train_lm.py under torchrun: two CPU processes (gloo, DDP) train as one process does on the same global
batch, a checkpoint resumes on another number of processes as if never stopped, and settings that cannot split over
the processes (or a missing backend) are refused with a clear message."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from linear_mha.integrations import distributed
from linear_mha.tools import train_lm

REPO = Path(__file__).resolve().parents[1]  # the code under test, also for the torchrun subprocesses
# Tiny and fast; --lr large enough that 6 steps move the parameters by far more than the tolerance below, so a
# wrong data split or gradients left un-averaged show; --eval-every 1 logs every step's global-batch loss.
ARGS = ["--corpus-bytes", "60000", "--dim", "32", "--depth", "1", "--heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--lr", "0.05", "--eval-every", "1", "--val-bytes", "400", "--test-bytes", "400",
        "--no-progress", "--device", "cpu"]
STEPS = 6


def torchrun(out, steps, *extra, processes=2):
    """train_lm on `processes` CPU processes, as a user starts it: python -m torch.distributed.run ..."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--standalone",
           "-m", "linear_mha.tools.train_lm", *ARGS, "--steps", str(steps), "--out", str(out), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"torchrun exited with {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def single(out, steps, *extra):
    return train_lm.main(ARGS + ["--steps", str(steps), "--out", str(out), *extra])


def assert_same_run(run_dir, reference_dir):
    """Same per-step losses, validation and test BPC, parameters and optimizer state (float tolerance: the
    processes sum in another order), and the very same batch generator state (the data order is exact)."""
    got, want = (torch.load(Path(d) / "checkpoint.pt", weights_only=False) for d in (run_dir, reference_dir))
    assert got["step"] == want["step"] == STEPS
    assert torch.equal(got["generator"], want["generator"])
    assert list(got["model"]) == list(want["model"])  # no DDP "module." prefix
    for name, value in want["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    for state_got, state_want in zip(got["optimizer"]["state"].values(), want["optimizer"]["state"].values()):
        torch.testing.assert_close(state_got["exp_avg"], state_want["exp_avg"], rtol=1e-3, atol=1e-6)
    logs = [[json.loads(line) for line in (Path(d) / "log.jsonl").read_text().splitlines()]
            for d in (run_dir, reference_dir)]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == list(range(1, STEPS + 1))
    for key in ("train_bpc", "val_bpc"):
        assert [r[key] for r in logs[0]] == pytest.approx([r[key] for r in logs[1]], rel=1e-5), key
    results = [json.loads((Path(d) / "results.json").read_text()) for d in (run_dir, reference_dir)]
    for key in ("val_bpc", "test_bpc"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-5), key


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: STEPS steps on one process, uninterrupted."""
    out = tmp_path_factory.mktemp("one_process")
    single(out, STEPS)
    torch.manual_seed(0)  # as main() seeds --seed 0 before building the model
    init = train_lm.build_model(train_lm.parse_args(ARGS))
    moved = max((p - init.state_dict()[k]).abs().max().item()
                for k, p in torch.load(out / "checkpoint.pt", weights_only=False)["model"].items())
    assert moved > 1e-3  # the comparisons' tolerance is far below what training changed
    return out


def test_two_processes_train_as_one_process_on_the_same_global_batch(one_process, tmp_path):
    done = torchrun(tmp_path, STEPS)
    assert_same_run(tmp_path, one_process)
    assert json.loads((tmp_path / "results.json").read_text())["processes"] == 2
    assert done.stderr.count("byte-level linear-attention LM training") == 1  # process 0 alone reports
    assert len(done.stdout.strip().splitlines()) == 1


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_a_run_resumed_on_another_number_of_processes_ends_as_the_uninterrupted_run(one_process, tmp_path, first,
                                                                                    then):
    for processes, steps, extra in ((first, 3, ()), (then, STEPS, ("--resume",))):
        if processes == 1:
            single(tmp_path, steps, *extra)
        else:
            done = torchrun(tmp_path, steps, *extra, processes=processes)
            if extra:
                assert f"resumed from {tmp_path / 'checkpoint.pt'} at step 3 (written by 1 process(es), " \
                       f"continued by 2)" in done.stderr
    assert_same_run(tmp_path, one_process)


def test_each_process_draws_only_its_own_share_of_the_global_batch():
    split = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    args = train_lm.parse_args(["--seq-len", "8", "--batch-size", "6"])
    whole = train_lm.random_batch(split, args, torch.Generator().manual_seed(1))
    shares = [train_lm.random_batch(split, args, torch.Generator().manual_seed(1), rank, 3) for rank in range(3)]
    assert [tuple(s.shape) for s in shares] == [(2, 9)] * 3
    assert torch.equal(torch.cat(shares), whole)


def test_a_global_batch_that_does_not_divide_by_the_processes_is_refused(tmp_path, monkeypatch):
    # torchrun's environment for process 0 of 2: the check comes before the processes meet, so none is needed.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--batch-size 3 is the global batch .* must divide by the 2 processes "
                                         r"torchrun started: pass a multiple of 2"):
        train_lm.main(ARGS + ["--batch-size", "3", "--steps", "1", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("missing,device,match", [
    ("gloo", "cpu", "on the CPU, but this torch build has no gloo backend"),
    ("cuda", "cuda", "on --device cuda, but CUDA is not available here; pass --device cpu"),
])
def test_torchrun_without_the_backend_is_a_clear_error(monkeypatch, missing, device, match):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if missing == "gloo":
        monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=f"launched by torchrun with 2 process.*{match}"):
        distributed.init_distributed_mode(device)
    assert not distributed.is_dist_avail_and_initialized()
