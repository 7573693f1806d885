"""The tools on transformers models, tiny runs: the generation benchmark (the state's size flat, the KV cache's
growing) and calibrate_bench's Hugging Face ViT and Llama."""
import json

import pytest

pytest.importorskip("transformers")

from linear_mha.tools import calibrate_bench, hf_generation_bench  # noqa: E402


def test_generation_bench_shows_a_flat_state_and_a_growing_kv_cache(tmp_path):
    result = hf_generation_bench.main(["--contexts", "16", "64", "--steps", "2", "--dim", "32", "--depth", "1",
                                       "--threads", "1", "--json", str(tmp_path / "g.json"), "--png",
                                       str(tmp_path / "g.png")])
    rows = {(r["method"], r["context"]): r for r in result["records"]}
    kv = {c: rows[("sdpa + KV cache", c)]["cache_bytes"] for c in (16, 64)}
    assert kv[64] / (64 + 2) == kv[16] / (16 + 2)  # keys and values of every token: the prompt and the 2 decoded
    for method in (name for name, options in hf_generation_bench.METHODS.items() if options is not None):
        assert rows[(method, 64)]["cache_bytes"] == rows[(method, 16)]["cache_bytes"] > 0
    assert all(r["ms_per_token"] > 0 and r["tokens_per_s"] == pytest.approx(1e3 / r["ms_per_token"])
               for r in result["records"])
    assert json.loads((tmp_path / "g.json").read_text())["records"] == result["records"]
    assert (tmp_path / "g.png").stat().st_size > 10_000


@pytest.mark.parametrize("model", [["vit", "--vit", "hf"], ["lm", "--lm", "hf", "--option", "window=4"]],
                         ids=["vit", "llama"])
def test_calibrate_bench_converts_the_transformers_models(model, tmp_path):
    result = calibrate_bench.main(model + ["--seeds", "0", "--train-steps", "6", "--calibration-steps", "2",
                                           "--finetune-after", "2", "--finetune-steps", "1", "--threads", "1",
                                           "--out", str(tmp_path)])
    stages = {r["stage"] for r in result["records"]}
    assert {"softmax (original)", "patch", "calibrated", "calibrated + fine-tuned"} <= stages
    assert result[model[1].lstrip("-")] == "hf"
