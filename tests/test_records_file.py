"""The --records file (tools/records_file.py) of MQAR and the ViT from scratch: runs of several calls, output folders
and processes add up in one table, a run the file holds is never trained again, and a file of another machine or
other settings is refused."""
import json
import multiprocessing

import pytest

from linear_mha.tools import mqar
from linear_mha.tools.records_file import add_record

from test_mqar import TINY


def test_runs_add_up_in_the_records_file_across_calls_and_output_folders(tmp_path, monkeypatch):
    records = tmp_path / "results" / "mqar.json"
    kernel = mqar.main(TINY + ["--out", str(tmp_path / "a"), "--records", str(records)])
    softmax = mqar.main(TINY + ["--methods", "softmax", "--out", str(tmp_path / "b"), "--records", str(records)])
    table = json.loads(records.read_text())
    assert table["records"] == kernel["records"] + softmax["records"]
    assert [row["method"] for row in table["summary"]] == ["kernel", "softmax"]
    assert [row["exact"] for row in table["summary"]] == [False, True]
    assert len(table["commands"]) == 2 and records.with_suffix(".png").stat().st_size > 0

    def no_training(*args, **kwargs):
        raise AssertionError("a run the --records file holds was trained again")
    monkeypatch.setattr(mqar, "train_run", no_training)
    both = mqar.main(TINY + ["--methods", "kernel", "softmax", "--out", str(tmp_path / "c"), "--records",
                             str(records)])
    assert both["records"] == table["records"] and json.loads(records.read_text()) == table
    with pytest.raises(ValueError, match="--records .*--steps 4.*--steps 5"):
        mqar.main(TINY + ["--out", str(tmp_path / "d"), "--records", str(records), "--steps", "5"])


def test_a_run_finished_in_the_output_folder_joins_the_records_file(tmp_path, monkeypatch):
    out, records = tmp_path / "mqar", tmp_path / "mqar.json"
    first = mqar.main(TINY + ["--out", str(out)])
    monkeypatch.setattr(mqar, "train_run", lambda *a, **k: pytest.fail("trained again"))
    mqar.main(TINY + ["--out", str(out), "--records", str(records)])
    assert json.loads(records.read_text())["records"] == first["records"]


def test_a_records_file_of_another_machine_is_refused(tmp_path):
    records = tmp_path / "mqar.json"
    mqar.main(TINY + ["--out", str(tmp_path / "a"), "--records", str(records)])
    table = json.loads(records.read_text())
    records.write_text(json.dumps({**table, "machine": "another CPU, 1 threads"}))
    with pytest.raises(ValueError, match="one machine"):
        mqar.main(TINY + ["--methods", "softmax", "--out", str(tmp_path / "b"), "--records", str(records)])
    setup = {key: table[key] for key in ("machine", "torch", "device")}
    with pytest.raises(ValueError, match="one machine"):
        add_record(records, {**table["records"][0], "torch": "0.1"}, mqar.RUN_KEY,
                   {**setup, "machine": "another CPU, 1 threads"}, "cmd", lambda records: [])


SETUP = {"machine": "cpu, 1 threads", "torch": "x", "device": "cpu"}


def _add_runs(path, seeds):
    for seed in seeds:
        record = {"method": "kernel", "seq_len": 8, "num_kv_pairs": 2, "lr": 1e-3, "seed": seed, "acc": 0.5}
        add_record(path, record, mqar.RUN_KEY, SETUP, f"lane {seeds[0]}", lambda records: {"runs": len(records)})


def test_processes_adding_to_one_file_at_once_lose_no_run(tmp_path):
    """Without the lock two processes read the same file, each adds its run and the later write drops the other's."""
    path = tmp_path / "mqar.json"
    context = multiprocessing.get_context("fork")
    lanes = [context.Process(target=_add_runs, args=(path, range(start, start + 40))) for start in (0, 1000)]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    assert all(lane.exitcode == 0 for lane in lanes)
    table = json.loads(path.read_text())
    assert sorted(r["seed"] for r in table["records"]) == [*range(40), *range(1000, 1040)]
    assert table["summary"] == {"runs": 80} and sorted(table["commands"]) == ["lane 0", "lane 1000"]
