"""tools/vit_scratch.py at a toy budget: variants parse as detr_compare's do, every run leaves a record that a later
call reuses, and the table compares with softmax on the same seeds."""
import json

import pytest

pytest.importorskip("timm")
pytest.importorskip("sklearn")

from linear_mha.tools import vit_scratch  # noqa: E402


def test_variant_names_parse_and_a_wrong_one_is_refused_by_name(capsys):
    assert vit_scratch.parse_variant("softmax") == (None, {})
    assert vit_scratch.parse_variant("softmax:rope=True") == ("softmax", {"rope": True})  # an option: patched
    assert vit_scratch.parse_variant("taylor-dwc3:output_gate=True,rope=True") == (
        "taylor", {"output_gate": True, "rope": True, "dwc_kernel": 3})
    with pytest.raises(SystemExit):
        vit_scratch.parse(["--variants", "taylr"])
    assert "--variants 'taylr'" in capsys.readouterr().err


def test_runs_write_records_that_a_later_call_reuses(tmp_path):
    argv = ["--variants", "softmax", "inline-dwc3:output_gate=True", "--seeds", "0", "--steps", "2",
            "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")]
    summary = vit_scratch.main(argv)
    assert [s["variant"] for s in summary] == ["softmax", "inline-dwc3:output_gate=True"]
    assert summary[0]["vs_softmax"] == 1.0 and 0 <= summary[1]["top1"] <= 1
    written = json.loads((tmp_path / "r.json").read_text())
    assert [r["variant"] for r in written["records"]] == ["softmax", "inline-dwc3:output_gate=True"]
    assert written["command"].startswith("python -m linear_mha.tools.vit_scratch --variants softmax")
    assert (tmp_path / "p.png").stat().st_size > 0
    record = tmp_path / "runs" / "softmax" / "seed0.json"
    changed = dict(json.loads(record.read_text()), top1=0.123)
    record.write_text(json.dumps(changed))  # a finished run is read back, not trained again
    assert vit_scratch.main(argv)[0]["top1"] == 0.123


def test_a_record_of_another_budget_is_refused_not_reused(tmp_path):
    """A 600-step run's record under the same --out is no 1,800-step result."""
    argv = ["--variants", "softmax", "--seeds", "0", "--out", str(tmp_path / "runs")]
    vit_scratch.main(argv + ["--steps", "2"])
    with pytest.raises(ValueError, match="--steps 2.*--steps 3"):
        vit_scratch.main(argv + ["--steps", "3"])


def test_runs_add_up_in_a_records_file_across_output_folders(tmp_path, monkeypatch):
    records = tmp_path / "vit.json"
    common = ["--seeds", "0", "--steps", "2", "--records", str(records)]
    vit_scratch.main(["--variants", "softmax", "--out", str(tmp_path / "a")] + common)
    vit_scratch.main(["--variants", "kernel", "--out", str(tmp_path / "b")] + common)
    table = json.loads(records.read_text())
    assert [(r["variant"], r["steps"]) for r in table["records"]] == [("softmax", 2), ("kernel", 2)]
    assert [s["variant"] for s in table["summary"]] == ["softmax", "kernel"] and len(table["commands"]) == 2
    assert records.with_suffix(".png").stat().st_size > 0
    monkeypatch.setattr(vit_scratch, "train_vit", lambda *a, **k: pytest.fail("a run the file holds was trained"))
    summary = vit_scratch.main(["--variants", "softmax", "kernel", "--out", str(tmp_path / "c")] + common)
    assert [s["top1"] for s in summary] == [s["top1"] for s in table["summary"]]
    with pytest.raises(ValueError, match="--records .*--steps 2.*--steps 3"):  # one file, one budget
        vit_scratch.main(["--variants", "softmax", "--out", str(tmp_path / "d"), "--seeds", "0", "--steps", "3",
                          "--records", str(records)])


class _Killed(Exception):
    pass


def test_a_killed_run_continues_from_its_checkpoint_to_the_weights_of_an_uninterrupted_one(tmp_path):
    """A 1,800-step ViT run takes half an hour: killed at step 15 of 20 with a checkpoint every 4 steps, the same
    call continues from step 12 and ends bit for bit where an uninterrupted run ends (same batches, optimiser
    moments, schedule and dropout stream); a checkpoint of another budget is refused, not continued."""
    import torch
    from linear_mha.tools.calibrate_stages import train_resumable

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))

    data = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(20)]

    def loss(kill_at=None):
        calls = []

        def fn(m, batch):
            calls.append(1)
            if len(calls) == kill_at:
                raise _Killed
            return m(batch).pow(2).mean()
        return fn

    straight = model()
    torch.manual_seed(1)
    train_resumable(straight, iter(data), loss(), 20, 0.1, 0.05, "straight")
    ckpt = tmp_path / "run.checkpoint.pt"
    killed = model()
    torch.manual_seed(1)
    with pytest.raises(_Killed):
        train_resumable(killed, iter(data), loss(kill_at=16), 20, 0.1, 0.05, "killed", checkpoint=ckpt, every=4)
    assert torch.load(ckpt, weights_only=True)["step"] == 12
    resumed = model()
    torch.manual_seed(123)  # the RNG comes from the checkpoint, not from the caller
    seconds = train_resumable(resumed, iter(data), loss(), 20, 0.1, 0.05, "resumed", checkpoint=ckpt, every=4)
    assert seconds > 0
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="--steps 20.*--steps 24"):
        train_resumable(model(), iter(data), loss(), 24, 0.1, 0.05, "other budget", checkpoint=ckpt)
