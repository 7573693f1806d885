"""tools.compare_trees on this checkout against itself: both sides run, every case gets a ratio, the JSON and the
PNG are written; a folder without linear_mha is refused clearly."""
import json
import math
from pathlib import Path

import pytest

from linear_mha.tools import compare_trees

ROOT = Path(__file__).resolve().parents[1]


def test_a_checkout_against_itself(tmp_path):
    result = compare_trees.main([str(ROOT), "--rounds", "1", "--n", "64", "--steps", "3", "--prompt", "8",
                                 "--threads", "1", "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")])
    rows = result["rows"]
    assert len(rows) == 14 and all("error" not in r for r in rows.values()), rows
    assert all(r["before"] > 0 and r["after"] > 0 and math.isfinite(r["ratio"]) and r["ratio_paired"] > 0
               for r in rows.values())
    assert sum("training step" in name for name in rows) == 3  # plain, with the gate, with the local term
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == json.loads(json.dumps(rows))
    assert (tmp_path / "r.png").stat().st_size > 5_000
    only = compare_trees.main([str(ROOT), "--rounds", "1", "--n", "64", "--steps", "3", "--prompt", "8",
                               "--threads", "1", "--only", "gate", "dwc3"])
    assert sorted(only["rows"]) == sorted(name for name in rows if "gate" in name or "dwc3" in name)
    with pytest.raises(SystemExit, match="no case's name contains"):
        compare_trees.main([str(ROOT), "--rounds", "1", "--n", "64", "--only", "nothing like it"])


def test_a_folder_without_the_package_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no linear_mha package"):
        compare_trees.import_checkout(tmp_path)


def test_an_older_checkout_without_an_option_gets_a_row_saying_so():
    """A checkout from before the output gate: its training-step case with the gate raises when run (a row with the
    error), and the others are built as usual."""
    import linear_mha

    class Older:
        TokenGrid = linear_mha.TokenGrid

        @staticmethod
        def LinearMultiheadAttention(*args, output_gate=False, **kwargs):
            if output_gate:
                raise TypeError("__init__() got an unexpected keyword argument 'output_gate'")
            return linear_mha.LinearMultiheadAttention(*args, **kwargs)
    steps = compare_trees.training_steps(Older, 16)
    assert len(steps) == 3
    gated = next(fn for name, (fn, _) in steps.items() if "gate" in name)
    with pytest.raises(TypeError, match="output_gate"):
        gated()
    for name, (fn, _) in steps.items():
        if "gate" not in name:
            fn()
