"""Smoke test of tools/train_lm.py: outputs, finite BPC, and resume == uninterrupted training."""
import importlib.util
import json
import os

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "train_lm.py")


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARGS = ["--corpus-bytes", "60000", "--dim", "16", "--depth", "1", "--heads", "2", "--seq-len", "16",
        "--batch-size", "2", "--eval-every", "2", "--val-bytes", "400", "--test-bytes", "400", "--no-progress",
        "--variant", "full"]


def test_train_resume_equals_uninterrupted_run(train_lm, tmp_path):
    straight = train_lm.main(ARGS + ["--steps", "4", "--out", str(tmp_path / "a")])
    train_lm.main(ARGS + ["--steps", "2", "--out", str(tmp_path / "b")])
    resumed = train_lm.main(ARGS + ["--steps", "4", "--out", str(tmp_path / "b"), "--resume"])
    assert resumed["test_bpc"] == straight["test_bpc"] and 4.0 < straight["test_bpc"] < 12.0
    for name in ("log.jsonl", "checkpoint.pt", "curves.png", "results.json"):
        assert (tmp_path / "a" / name).exists()
    records = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]


def test_stdlib_corpus_is_deterministic_and_large_enough(train_lm):
    assert train_lm.stdlib_corpus(50_000) == train_lm.stdlib_corpus(50_000)
    assert len(train_lm.stdlib_corpus(10_000_000)) == 10_000_000
