"""Smoke test of tools/train_lm.py: outputs, finite BPC, resume == uninterrupted training, also after a signal
stopped the run between evaluations, and a log that matches its checkpoint."""
import json
import os
import signal

import pytest
import torch

from linear_mha.lm.self_attention import SelfAttention
from linear_mha.tools import train_lm as train_lm_tool
from modes import CAUSAL_ONLY, LINEAR_NON_CAUSAL as NOT_CAUSAL


@pytest.fixture(scope="module")
def train_lm():
    return train_lm_tool


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


def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint_that_resumes_exactly(train_lm, tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM between evaluations must not lose the steps since the last one."""
    straight = train_lm.main(ARGS + ["--steps", "4", "--out", str(tmp_path / "a")])
    real_batch, calls = train_lm.random_batch, []

    def batch_then_signal(*args):
        calls.append(1)
        if len(calls) == 3:  # during step 3, after the checkpoint of the evaluation at step 2
            os.kill(os.getpid(), signal.SIGINT)
        return real_batch(*args)
    monkeypatch.setattr(train_lm, "random_batch", batch_then_signal)
    with pytest.raises(SystemExit) as stopped:
        train_lm.main(ARGS + ["--steps", "4", "--out", str(tmp_path / "b")])
    assert stopped.value.code == 130
    ckpt = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 3 and len(ckpt["train_losses"]) == 1
    monkeypatch.setattr(train_lm, "random_batch", real_batch)
    resumed = train_lm.main(ARGS + ["--steps", "4", "--out", str(tmp_path / "b"), "--resume"])
    assert resumed["test_bpc"] == straight["test_bpc"]
    logs = [[json.loads(line) for line in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in "ab"]
    assert [r["train_bpc"] for r in logs[0]] == [r["train_bpc"] for r in logs[1]]  # step 3's loss was kept


def test_a_fresh_run_into_an_old_directory_is_refused_and_with_overwrite_logs_only_itself(train_lm, tmp_path):
    train_lm.main(ARGS + ["--steps", "6", "--out", str(tmp_path)])
    with pytest.raises(FileExistsError, match="already holds a run .* --resume, .* another --out, or pass --overwrite"):
        train_lm.main(ARGS + ["--steps", "2", "--out", str(tmp_path)])
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3  # the refused run touched nothing
    train_lm.main(ARGS + ["--steps", "2", "--out", str(tmp_path), "--overwrite"])  # starts over
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2]


@pytest.mark.parametrize("extra,match", [
    (["--corpus-bytes", "0"], "--corpus-bytes must be >= 1"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--seq-len", "0"], "--seq-len must be >= 1"),
    (["--corpus-bytes", "20000", "--seq-len", "1024"], r"the val split has 1000 bytes to score, fewer than one window"),
    (["--val-bytes", "20", "--seq-len", "32"], r"the val split has 20 bytes .* or --val-bytes"),
    (["--variant", "softmax", "--global-mode", CAUSAL_ONLY[0]], "--variant softmax .* no global heads"),
    (["--global-option", "chunk_size=8"], "--global-option sets an option of --global-mode"),
    (["--local-window", "8"], "--local-window sets the local heads of --variant hybrid; --variant baseline"),
    (["--variant", "hybrid", "--heads", "1"], "--variant hybrid .* needs --heads >= 2 \\(got 1\\)"),
    (["--variant", "hybrid", "--local-window", "0"], "--local-window must be >= 1, got 0"),
    (["--variant", "softmax+hybrid"], "softmax makes every head local and hybrid half of them"),
    (["--variant", "conv+conv"], "--variant conv\\+conv: expected names from baseline, conv, .* each once"),
    (["--variant", "linear"], "--variant linear: expected names from"),
    (["--variant", "softmax+conv", "--global-mode", CAUSAL_ONLY[0]], "--variant softmax\\+conv .* no global heads"),
    (["--global-mode", NOT_CAUSAL[0]], f"--global-mode {NOT_CAUSAL[0]}: .* no causal form"),
    (["--global-mode", CAUSAL_ONLY[0], "--global-option", "spam=1"], f"--global-mode {CAUSAL_ONLY[0]} --global-option spam=1: "),
])
def test_settings_that_would_score_nothing_or_crash_are_refused(train_lm, tmp_path, extra, match):
    base = ["--corpus-bytes", "60000", "--dim", "16", "--depth", "1", "--heads", "2", "--steps", "1",
            "--no-progress", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match=match):
        train_lm.main(base + extra)


def test_global_heads_of_a_chosen_method_train_and_resume_only_with_the_same_method(train_lm, tmp_path):
    chosen = ["--global-mode", CAUSAL_ONLY[0], "--shift-tokens", "--lr-schedule", "cosine"]
    result = train_lm.main(ARGS + chosen + ["--steps", "2", "--out", str(tmp_path)])
    assert result["variant"] == f"full {CAUSAL_ONLY[0]}" and 4.0 < result["test_bpc"] < 12.0
    with pytest.raises(ValueError, match=f"--global-mode {CAUSAL_ONLY[0]!r}.*; this run has --global-mode None"):
        train_lm.main(ARGS + ["--steps", "4", "--out", str(tmp_path), "--resume"])


@pytest.mark.parametrize("window", [None, 8])
def test_the_hybrid_variant_makes_half_the_heads_local_over_its_window_and_the_rest_run_the_method(train_lm, window):
    argv = ["--variant", "hybrid", "--heads", "4", "--dim", "32", "--global-mode", CAUSAL_ONLY[0]]
    argv += [] if window is None else ["--local-window", str(window)]
    model = train_lm.build_model(train_lm.parse_args(argv))
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert layers and all(layer.n_local == 2 and layer.window == (window or train_lm.HYBRID_WINDOW) for layer in layers)
    assert all(layer.local_method.name == "block_local" and layer.global_method.name == CAUSAL_ONLY[0]
               for layer in layers)


@pytest.mark.parametrize("variant, local_heads", [("softmax+conv", 4), ("hybrid+conv", 2), ("conv", 0)])
def test_variants_joined_by_plus_take_every_part(train_lm, variant, local_heads):
    model = train_lm.build_model(train_lm.parse_args(["--variant", variant, "--heads", "4", "--dim", "32"]))
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert layers and all(layer.n_local == local_heads and layer.conv is not None for layer in layers)


@pytest.mark.parametrize("variant, local_heads", [("shortconv+norm", 0), ("softmax+shortconv+norm", 4),
                                                  ("hybrid+conv+shortconv+norm", 2)])
def test_the_short_convolution_and_the_head_norm_reach_every_layer_beside_the_others(train_lm, variant,
                                                                                    local_heads):
    model = train_lm.build_model(train_lm.parse_args(["--variant", variant, "--heads", "4", "--dim", "32"]))
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert layers and all(layer.n_local == local_heads and layer.head_norm is not None and layer.short_conv is not None
                          and layer.short_conv.kernel_size == (train_lm.SHORT_CONV_TAPS,) for layer in layers)


@pytest.mark.parametrize("variant, local_heads", [("softmax+conv+rotary", 4), ("hybrid+conv+rotary", 2)])
def test_the_rotary_variant_rotates_every_head_and_drops_the_absolute_positions(train_lm, variant, local_heads):
    model = train_lm.build_model(train_lm.parse_args(["--variant", variant, "--heads", "4", "--dim", "32"]))
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert layers and all(layer.rotary and layer.n_local == local_heads and layer.conv is not None for layer in layers)
    assert model.pos_emb is None


def test_the_cosine_schedule_warms_up_then_decays_to_zero_and_constant_holds(train_lm):
    args = train_lm.parse_args(["--steps", "1100", "--lr", "1e-3", "--lr-schedule", "cosine"])
    rates = [train_lm.learning_rate(step, args) for step in range(1100)]
    assert rates[0] == pytest.approx(1e-5) and rates[99] == pytest.approx(1e-3) and rates[100] == pytest.approx(1e-3)
    assert rates[600] == pytest.approx(5e-4) and 0 < rates[-1] < 1e-7
    assert all(a >= b for a, b in zip(rates[100:], rates[101:]))
    constant = train_lm.parse_args(["--steps", "1100", "--lr", "1e-3"])
    assert train_lm.learning_rate(1099, constant) == 1e-3
