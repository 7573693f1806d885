"""tools/detr_compare.py end to end at a toy budget: a shared pretrained backbone, every variant, resume."""
import json

import pytest
import torch

from linear_mha.tools import detr_compare, detr_records, detr_variants

TRAIN = ["--synthetic-train", "8", "--synthetic-val", "4", "--batch-size", "4", "--hidden-dim", "32",
         "--backbone", "tiny", "--pretrain-backbone", "0",
         "--dim-feedforward", "64", "--num-queries", "6", "--scales", "64", "--max-size", "96", "--no-crop",
         "--val-size", "64"]


# Two variants: one plain, one with a local term and a quoted option (each variant x seed is a training run).
VARIANTS = ["softmax", "kernel-dwc3:feature_map='relu'"]


@pytest.mark.slow
def test_compare_runs_every_variant_and_seed_from_one_pretrained_backbone_and_resumes(tmp_path):
    records = tmp_path / "records.json"
    argv = ["--out", str(tmp_path), "--epochs", "1", "--max-iters", "1", "--num-workers", "0",
            "--pretrain-iters", "2", "--timing-iters", "1", "--seeds", "3", "4", "--variants", *VARIANTS,
            "--time-also", "kernel", "--records", str(records), "--"] + TRAIN
    detr_compare.main(argv)
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["training"]
    assert [(r["variant"], r["seed"]) for r in rows] == [(v, s) for s in (3, 4) for v in VARIANTS]
    weights = str(tmp_path / "backbone" / "backbone.pth")
    for r in rows:
        assert 0 <= r["AP"] <= 1 and r["peak_mib"] > 0 and r["sec_per_iter"] > 0
        args = json.loads((tmp_path / r["variant"] / f"seed{r['seed']}" / "args.json").read_text())
        assert args["backbone_weights"] == weights and args["seed"] == r["seed"]
    args = json.loads((tmp_path / "kernel-dwc3:feature_map='relu'" / "seed3" / "args.json").read_text())
    assert args["attention"] == "kernel" and args["dwc_kernel"] == 3
    assert args["attention_option"] == ["feature_map='relu'"]
    summary = {s["variant"]: s for s in result["summary"]}
    assert summary["softmax"]["seeds"] == [3, 4]
    assert summary["softmax"]["AP"] == 0 or summary["softmax"]["AP_vs_softmax"] == pytest.approx(1.0)
    saved = json.loads(records.read_text())
    assert set(saved) >= {"machine", "torch", "command", "records"} and len(saved["records"]) == 4
    assert set(saved["records"][0]) == {"variant", "seed", "epochs", "AP", "AP50", "AP75", "APs", "APm", "APl",
                                        "sec_per_iter", "peak_mib", "machine", "AP_per_epoch"}
    assert saved["records"][0]["epochs"] == 1 and len(saved["records"][0]["AP_per_epoch"]) == 1
    assert (tmp_path / "ap_curves.png").stat().st_size > 0
    # --time-also: timed, not trained, and the reference of every variant's ratio
    timing = {t["variant"]: t for t in saved["timing"]}
    assert list(timing) == [*VARIANTS, "kernel"] and not (tmp_path / "kernel").exists()
    assert timing["kernel"]["x_kernel"] == 1.0 and timing["softmax"]["sec_per_iter"] == rows[0]["sec_per_iter"]
    assert timing["softmax"]["x_kernel"] == pytest.approx(rows[0]["sec_per_iter"] / timing["kernel"]["sec_per_iter"])

    # A second call finds every run finished: it resumes instead of training again, same table.
    mtime = (tmp_path / "softmax" / "seed3" / "checkpoint.pth").stat().st_mtime
    detr_compare.main(argv)
    again = json.loads((tmp_path / "results.json").read_text())["training"]
    assert [(r["variant"], r["AP"]) for r in again] == [(r["variant"], r["AP"]) for r in rows]
    assert (tmp_path / "softmax" / "seed3" / "checkpoint.pth").stat().st_mtime == mtime

    # --finished-only reports what is done and trains nothing: a seed never run is named and left out.
    partial = list(argv)
    partial[partial.index("--seeds") + 2] = "5"  # seeds 3 and 5
    partial.insert(partial.index("--"), "--finished-only")
    reported = detr_compare.main(partial)
    assert [(r["variant"], r["seed"]) for r in reported["training"]] == [(v, 3) for v in VARIANTS]
    assert not (tmp_path / "softmax" / "seed5").exists()


def test_ratios_are_taken_against_the_first_and_the_best_softmax_variant():
    rows = [{"variant": name, "seed": seed, "AP": ap} for name, by_seed in (
        ("softmax", (0.50, 0.54)), ("taylor-dwc3:rope=True", (0.64, 0.68)), ("softmax-dwc3:rope=True", (0.58, 0.62)),
        ("kernel", (0.70, 0.74))) for seed, ap in zip((1, 2), by_seed)]
    summary = {entry["variant"]: entry for entry in detr_records.summarize(rows)}
    # the best softmax-family row is the baseline, whatever its place in the list; kernel is not softmax
    assert summary["taylor-dwc3:rope=True"]["best_softmax"] == "softmax-dwc3:rope=True"
    assert summary["taylor-dwc3:rope=True"]["AP_vs_best_softmax"] == pytest.approx(0.66 / 0.60)
    assert summary["taylor-dwc3:rope=True"]["AP_vs_softmax"] == pytest.approx(0.66 / 0.52)
    assert summary["softmax-dwc3:rope=True"]["AP_vs_best_softmax"] == pytest.approx(1.0)
    # an untrained plain softmax (AP 0) gives no ratio to it, rather than one to another row
    untrained = detr_records.summarize([{**r, "AP": 0.0} for r in rows[:2]] + rows[2:])  # plain softmax's two seeds
    assert all("AP_vs_softmax" not in entry for entry in untrained)
    assert {e["variant"]: e for e in untrained}["kernel"]["best_softmax"] == "softmax-dwc3:rope=True"


def test_records_of_two_budgets_merge_into_one_file_from_one_machine(tmp_path):
    import argparse
    path = tmp_path / "records.json"
    merge = argparse.Namespace(records_merge=True, device="cpu")

    def rows(epochs, ap):
        return [{"variant": name, "seed": seed, "epochs": epochs, "AP": ap + seed / 100, "log": [ap]}
                for name in ("softmax", "taylor-dwc3:rope=True") for seed in (1, 2)]

    detr_records.write_records(merge, rows(16, 0.3), path, ["--epochs", "16"],
                               [{"variant": "kernel", "sec_per_iter": 1}])
    detr_records.write_records(merge, rows(48, 0.5), path, ["--epochs", "48"], [])
    detr_records.write_records(merge, rows(48, 0.6), path, ["--epochs", "48"], [])  # a rerun replaces its rows
    saved = json.loads(path.read_text())
    assert sorted({(r["epochs"], r["AP"]) for r in saved["records"]}) == [
        (16, 0.31), (16, 0.32), (48, 0.61), (48, 0.62)]
    assert len(saved["records"]) == 8 and len(saved["commands"]) == 2
    by_budget = {(e["epochs"], e["variant"]): e for e in saved["summary"]}
    assert by_budget[(16, "softmax")]["AP"] == pytest.approx(0.315)
    assert by_budget[(48, "softmax")]["AP"] == pytest.approx(0.615)
    assert path.with_suffix(".png").stat().st_size > 0  # a panel per budget
    # a rerun of plain softmax keeps its place: the first softmax row is what AP_vs_softmax divides by
    reruns = [r for r in rows(48, 0.7) if r["variant"] == "softmax"]
    detr_records.write_records(merge, reruns, path, ["--rerun"], [])
    saved = json.loads(path.read_text())
    assert [e["variant"] for e in saved["summary"] if e["epochs"] == 48] == ["softmax", "taylor-dwc3:rope=True"]
    assert {e["variant"]: e for e in saved["summary"] if e["epochs"] == 48}["taylor-dwc3:rope=True"][
        "AP_vs_softmax"] == pytest.approx(0.615 / 0.715)
    assert saved["timing"] == [{"variant": "kernel", "sec_per_iter": 1}]  # calls that timed nothing keep it
    # a timing pass of its own times the records that earlier calls left, not only its own runs'
    detr_records.write_records(merge, [], path, ["--finished-only"], [{"variant": "softmax", "sec_per_iter": 2}])
    saved = json.loads(path.read_text())
    assert {r["sec_per_iter"] for r in saved["records"] if r["variant"] == "softmax"} == {2}
    assert {r["sec_per_iter"] for r in saved["records"] if r["variant"] != "softmax"} == {None}
    assert {e["variant"]: e.get("sec_per_iter") for e in saved["summary"]}["softmax"] == 2
    # without the flag the file is this call's alone; from another machine it is refused
    detr_records.write_records(argparse.Namespace(records_merge=False, device="cpu"), rows(48, 0.6), path, [], [])
    assert {r["epochs"] for r in json.loads(path.read_text())["records"]} == {48}
    for key, other in (("machine", "another machine"), ("torch", "0.1"), ("device", "cuda")):
        path.write_text(json.dumps({**json.loads(path.read_text()), key: other}))
        with pytest.raises(SystemExit, match="--records-merge"):
            detr_records.write_records(merge, rows(16, 0.3), path, [], [])
        detr_records.write_records(argparse.Namespace(records_merge=False, device="cpu"), rows(48, 0.6), path, [], [])
    detr_records.plot_curves([], tmp_path / "none.png")  # nothing finished: no figure, no error



def test_records_files_of_one_setup_join_into_one_table(tmp_path):
    """The per-budget files (filled run by run in separate lanes) become the one table of both budgets."""
    import argparse
    merge = argparse.Namespace(records_merge=True, device="cpu")

    def rows(epochs, ap, seeds=(1, 2)):
        return [{"variant": name, "seed": seed, "epochs": epochs, "AP": ap + seed / 100, "log": [ap]}
                for name in ("softmax", "taylor-dwc3:rope=True") for seed in seeds]

    short, long = tmp_path / "e16.json", tmp_path / "e48.json"
    detr_records.write_records(merge, rows(16, 0.3), short, ["--epochs", "16"], [])
    detr_records.write_records(merge, rows(48, 0.5), long, ["--epochs", "48"],
                               [{"variant": "softmax", "sec_per_iter": 2}])
    stale = tmp_path / "stale.json"  # an older file holding a run the long file has again: the last file given wins
    detr_records.write_records(merge, rows(48, 0.1, seeds=(1,)), stale, ["--stale"], [])
    joined = detr_records.join_records([stale, short, long], tmp_path / "both.json")
    assert sorted((r["epochs"], r["variant"], r["AP"]) for r in joined["records"]) == sorted(
        (r["epochs"], r["variant"], r["AP"]) for r in rows(16, 0.3) + rows(48, 0.5))
    # the long budget's timing pass times the same model's runs at 16 epochs too
    timed = {(r["epochs"], r["sec_per_iter"]) for r in joined["records"] if r["variant"] == "softmax"}
    assert timed == {(16, 2), (48, 2)}
    assert {(e["epochs"], e["variant"]): e["AP"] for e in joined["summary"]}[(16, "softmax")] == pytest.approx(0.315)
    assert len(joined["commands"]) == 3 and (tmp_path / "both.png").stat().st_size > 0
    long.write_text(json.dumps({**json.loads(long.read_text()), "machine": "another machine"}))
    with pytest.raises(SystemExit, match="one setup"):
        detr_records.join_records([short, long], tmp_path / "mixed.json")
    assert not (tmp_path / "mixed.json").exists()
    detr_records.main([str(short), "--out", str(tmp_path / "cli.json")])
    assert len(json.loads((tmp_path / "cli.json").read_text())["records"]) == 4

def test_time_also_needs_timing_iters_and_a_known_variant():
    with pytest.raises(SystemExit):
        detr_compare.parse(["--time-also", "kernel"])
    with pytest.raises(SystemExit):
        detr_compare.parse(["--timing-iters", "2", "--time-also", "kernal"])


def test_variant_names_become_trainer_options():
    assert detr_variants.variant_args("focused-dwc5:focusing_factor=2,learnable_scale=False") == [
        "--attention", "focused", "--dwc-kernel", "5", "--attention-option", "focusing_factor=2",
        "--attention-option", "learnable_scale=False"]
    assert detr_variants.variant_args("linformer-shared")[:2] == ["--attention", "linformer"]
    assert detr_variants.variant_args("softmax-dwc3:rope=True") == [  # the strongest softmax baseline
        "--attention", "softmax", "--dwc-kernel", "3", "--attention-option", "rope=True"]
    with pytest.raises(ValueError, match="mode must be one of"):
        detr_variants.variant_args("kernal")


@pytest.mark.slow
def test_encoder_table_runs_every_variant_with_the_grid(tmp_path):
    result = detr_compare.main(["--out", str(tmp_path), "--encoder-only", "--sizes", "64", "--repeats", "1",
                                "--variants", "softmax", "focused-dwc3", "--device", "cpu"])
    assert [r["variant"] for r in result["encoder"]] == ["softmax", "focused-dwc3"]
    assert all(r["ms_median"] > 0 and r["tokens"] > 0 for r in result["encoder"])


def test_a_run_stopped_by_a_signal_stops_the_comparison(tmp_path, monkeypatch):
    """Ctrl-C checkpoints the running variant; the comparison must not read its half-done log and go on."""
    monkeypatch.setattr(detr_compare, "train_main", lambda argv: {"stopped_at": (0, 1)})
    with pytest.raises(SystemExit) as stopped:
        detr_compare.main(["--out", str(tmp_path), "--epochs", "1", "--num-workers", "0", "--"]
                          + TRAIN)
    assert stopped.value.code == 130
    monkeypatch.setattr(detr_compare, "pretrain_main", lambda argv: None)
    with pytest.raises(SystemExit, match="130"):
        detr_compare.main(["--out", str(tmp_path), "--epochs", "1", "--pretrain-iters", "2",
                           "--num-workers", "0", "--"] + TRAIN)


def test_a_row_whose_model_did_not_get_its_options_is_refused(tmp_path, monkeypatch):
    """The trainer's report of what it patched must hold the variant's options: a dropped option would make the row
    another variant under this name (softmax with rope once trained as plain softmax)."""
    def trainer_dropping_options(argv):
        return {"stopped_at": None, "attention": [{"target": "encoder", "options": {}, "patch_report": None}]}
    monkeypatch.setattr(detr_compare, "train_main", trainer_dropping_options)
    with pytest.raises(RuntimeError, match=r"'softmax:rope=True'.*did not get \{'rope': True\}"):
        detr_compare.main(["--out", str(tmp_path), "--epochs", "1", "--pretrain-iters", "0", "--num-workers", "0",
                           "--variants", "softmax:rope=True", "--"] + TRAIN)
    detr_variants.check_options_reached("softmax", [{"target": "encoder", "options": {}, "patch_report": None}])
    detr_variants.check_options_reached("kernel-dwc3:feature_map='relu'", [
        {"target": "encoder", "options": {"feature_map": "relu", "dwc_kernel": 3}, "patch_report": object()}])
    with pytest.raises(RuntimeError, match="dwc_kernel"):
        detr_variants.check_options_reached("kernel-dwc3", [
            {"target": "encoder", "options": {"feature_map": "elu"}, "patch_report": object()}])


def test_timing_rounds_go_over_every_variant_in_turn_and_take_each_ones_median(monkeypatch):
    """One slow spell of the machine (9.0 s) lands in one round of one variant and is outvoted by its others."""
    a = detr_compare.parse(["--variants", "softmax", "--timing-iters", "2", "--timing-repeats", "3",
                            "--time-also", "kernel"])
    monkeypatch.setattr(detr_compare, "pretrained_backbone", lambda a: [])
    monkeypatch.setattr(detr_compare, "train_run", lambda a, name, seed, device, weights: {"variant": name})
    timed_in_turn, times = [], iter([1.0, 2.0, 9.0, 2.5, 3.0, 2.2])

    def timed_iterations(a, device, extra):
        timed_in_turn.append(extra[extra.index("--attention") + 1])
        return next(times)
    monkeypatch.setattr(detr_compare, "_timed_iterations", timed_iterations)
    rows, timed = detr_compare.training_table(a, torch.device("cpu"))
    assert timed_in_turn == ["softmax", "kernel"] * 3 and rows[0]["sec_per_iter"] == 3.0
    table = detr_compare.timing_table(timed, "kernel")
    assert table[0] == {"variant": "softmax", "sec_per_iter": 3.0, "sec_per_iter_rounds": [1.0, 9.0, 3.0],
                        "x_kernel": pytest.approx(3.0 / 2.2)}
    assert table[1]["sec_per_iter"] == 2.2 and table[1]["x_kernel"] == 1.0
    with pytest.raises(SystemExit):
        detr_compare.parse(["--timing-iters", "2", "--timing-repeats", "0"])
