"""tools.detr_step on the CPU with a tiny model: every variant gets a row with a time, ratios against softmax,
and the JSON the docs' tables are made from; bad options are refused by name."""
import json

import pytest

pytest.importorskip("torchvision")
pytest.importorskip("scipy")
from linear_mha.tools import detr_step  # noqa: E402


def test_rows_for_every_variant_with_ratios_against_softmax(tmp_path, capsys):
    out = tmp_path / "step.json"
    result = detr_step.main(["--device", "cpu", "--backbone", "tiny", "--size", "64", "--batch", "1", "--steps", "2",
                             "--warmup", "1", "--objects", "2", "--variants", "softmax", "taylor-dwc3", "--json",
                             str(out)])
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["softmax", "taylor-dwc3"]
    assert all(r["ms_median"] > 0 and r["steps"] == 2 for r in rows.values())
    assert rows["softmax"]["speedup_vs_softmax"] == 1.0
    assert rows["taylor-dwc3"]["speedup_vs_softmax"] == pytest.approx(
        rows["softmax"]["ms_median"] / rows["taylor-dwc3"]["ms_median"])
    assert json.loads(out.read_text())["meta"]["image"] == "64x107"
    assert "taylor-dwc3" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--steps", "0"], "--steps must be >= 1"),
                                           (["--variants", "nonexistent"], "--variants 'nonexistent'")])
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        detr_step.main(["--device", "cpu"] + argv)
    assert message in capsys.readouterr().err
