"""tools/lm_ablation.py: variants VARIANT[:METHOD] reach train_lm as --variant / --global-mode, a --records file
adds up runs across calls (a run it holds is not trained again, one made with other training arguments is refused),
and the summary's comparison with softmax is taken on the seeds both have."""
import json

import pytest

from linear_mha.tools import lm_ablation, train_lm

TRAIN = ["--", "--corpus-bytes", "60000", "--dim", "16", "--depth", "1", "--heads", "2", "--seq-len", "16",
         "--batch-size", "2", "--steps", "2", "--eval-every", "2", "--val-bytes", "256", "--test-bytes", "256",
         "--threads", "1"]


def test_each_variant_trains_its_own_attention_and_the_file_holds_every_run(tmp_path):
    records = tmp_path / "lm.json"
    rows = lm_ablation.main(["--variants", "softmax", "baseline:deltanet", "--seeds", "0", "1", "--out",
                             str(tmp_path / "runs"), "--records", str(records)] + TRAIN)
    configs = {d.name: json.loads((d / "results.json").read_text())["config"] for d in (tmp_path / "runs").iterdir()
               if d.is_dir()}
    assert configs["baseline_deltanet_seed1"]["global_mode"] == "deltanet"
    assert configs["softmax_seed0"]["variant"] == "softmax" and configs["softmax_seed0"]["global_mode"] is None
    held = json.loads(records.read_text())
    assert sorted((r["variant"], r["seed"]) for r in held["records"]) == [
        ("baseline:deltanet", 0), ("baseline:deltanet", 1), ("softmax", 0), ("softmax", 1)]
    assert all(r["seconds"] > 0 and r["tokens_seen"] == 2 * 2 * 16 for r in held["records"])
    assert records.with_suffix(".png").is_file()
    for r in held["records"]:  # the curve kept beside the numbers is the run's own log, not another run's
        run = tmp_path / "runs" / f"{r['variant'].replace(':', '_')}_seed{r['seed']}"
        logged = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        assert r["curve"] == [{k: e[k] for k in ("step", "train_bpc", "val_bpc")} for e in logged] and logged
    by_name = {r["variant"]: r for r in rows}
    assert by_name["softmax"]["vs_softmax"] == 0.0
    deltanet = [r["test_bpc"] for r in held["records"] if r["variant"] == "baseline:deltanet"]
    softmax = [r["test_bpc"] for r in held["records"] if r["variant"] == "softmax"]
    assert by_name["baseline:deltanet"]["vs_softmax"] == pytest.approx(sum(deltanet) / sum(softmax) - 1)


def test_a_run_the_file_holds_is_not_trained_again_and_other_settings_are_refused(tmp_path, monkeypatch):
    records, out = tmp_path / "lm.json", str(tmp_path / "runs")
    first = lm_ablation.main(["--variants", "baseline", "--seeds", "0", "--out", out, "--records", str(records)]
                             + TRAIN)

    def no_training(argv):
        raise AssertionError(f"trained again: {argv}")
    monkeypatch.setattr(train_lm, "main", no_training)
    again = lm_ablation.main(["--variants", "baseline", "--seeds", "0", "--out", str(tmp_path / "elsewhere"),
                              "--records", str(records)] + TRAIN)
    assert again[0]["test_bpc"] == first[0]["test_bpc"]
    with pytest.raises(ValueError, match="same training arguments"):
        lm_ablation.main(["--variants", "baseline", "--seeds", "0", "--out", out, "--records", str(records)]
                         + TRAIN + ["--steps", "3"])


def test_the_softmax_comparison_uses_only_the_seeds_both_variants_have():
    records = [{"variant": v, "seed": s, "test_bpc": b, "params": 1, "tokens_seen": 1}
               for v, s, b in [("softmax", 0, 2.0), ("softmax", 1, 4.0), ("conv", 1, 3.0)]]
    rows = {r["variant"]: r for r in lm_ablation.summarize(records)}
    assert rows["conv"]["vs_softmax"] == pytest.approx(3.0 / 4.0 - 1)
    assert rows["softmax"]["std"] == pytest.approx(2 ** 0.5)


def test_the_best_softmax_is_the_all_softmax_variant_of_lowest_mean_and_every_row_is_also_set_against_it():
    """softmax+conv (every head softmax, with the convolution) is a softmax the linear rows must also be set against;
    hybrid (half the heads softmax) is not one."""
    records = [{"variant": v, "seed": s, "test_bpc": b, "params": 1, "tokens_seen": 1}
               for v, s, b in [("softmax", 0, 2.0), ("softmax+conv", 0, 1.6), ("hybrid+conv:deltanet", 0, 1.5),
                               ("baseline:deltanet", 0, 2.4)]]
    rows = {r["variant"]: r for r in lm_ablation.summarize(records)}
    assert {r["best_softmax"] for r in rows.values()} == {"softmax+conv"}
    assert rows["baseline:deltanet"]["vs_softmax"] == pytest.approx(0.2)
    assert rows["baseline:deltanet"]["vs_best_softmax"] == pytest.approx(0.5)
    assert rows["hybrid+conv:deltanet"]["vs_best_softmax"] == pytest.approx(1.5 / 1.6 - 1)
    assert rows["hybrid+conv:deltanet"]["label"] == "Hybrid + Conv_Only (deltanet)"


def test_a_variant_outside_train_lms_is_refused_naming_them(capsys):
    with pytest.raises(SystemExit):
        lm_ablation.main(["--variants", "linear:deltanet"] + TRAIN)
    assert f"{', '.join(train_lm.VARIANTS)}, or several joined by '+'" in capsys.readouterr().err


def test_every_variant_of_train_lm_has_a_label():
    assert list(lm_ablation.LABELS) == list(train_lm.VARIANTS)
