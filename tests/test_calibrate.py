"""linear_mha.calibrate: attention transfer from the softmax attention patch() replaced to a learnable linear
method; only the tensors linear_mha added train, everything is restored afterwards, runs are reproducible, and it
works where users are (nn.MultiheadAttention models, timm ViTs, the DETR trainer)."""
import copy

import pytest
import torch
from torch import nn

import linear_mha
from linear_mha import calibrate, patch

E, H = 32, 4


def encoder(seed=0):
    torch.manual_seed(seed)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 64, dropout=0.1, batch_first=True), 2,
                                 enable_nested_tensor=False)


def data(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 12, E, generator=g)
    # Inputs with structure (a shared pattern plus noise), so softmax attention is peaked, not uniform.
    return [base * 3 + torch.randn(3, 12, E, generator=g) for _ in range(n)]


def test_attention_transfer_fits_the_added_maps_and_touches_nothing_else():
    model = encoder()
    model.layers[0].linear1.weight.requires_grad_(False)  # a user's own frozen parameter stays frozen
    batches = data()
    reference = [model.eval()(b).detach() for b in batches]
    model.train()
    patch(model, "hedgehog")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "hedgehog" not in n}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    report = calibrate(model, batches, steps=100, lr=1e-2, progress=False)
    assert [layer["name"] for layer in report.layers] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(layer["error_after"] < 0.8 * layer["error_before"] for layer in report.layers), report.table()
    assert report.losses[-1] < report.losses[0] and report.trained_parameters == 2 * 2 * H * (E // H + 1) * (E // H)  # layers x q/k maps x heads x (W, b)
    for name, p in model.named_parameters():
        assert p.requires_grad == flags[name]
        if name in frozen:
            assert torch.equal(p, frozen[name]), name  # only the feature maps moved
    assert model.training  # its train/eval mode is back
    model.eval()
    after = sum(float((model(b) - r).norm() / r.norm()) for b, r in zip(batches, reference))
    unpatched = encoder().eval()
    patch(unpatched, "hedgehog")
    before = sum(float((unpatched(b) - r).norm() / r.norm()) for b, r in zip(batches, reference))
    assert after < 0.8 * before  # the whole model's output moves toward the original's
    assert "layers.0.self_attn" in str(report) and "error before" in report.table()


def test_the_teacher_is_the_original_softmax_without_its_weights_and_runs_are_reproducible():
    model = encoder()
    patch(model, "hedgehog")
    calls = []
    for layer in model.layers:
        original = layer.self_attn.__dict__["_linear_mha_original"]
        original.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("need_weights")), with_kwargs=True)
    twin = copy.deepcopy(model)
    first = calibrate(model, data(), steps=5, progress=False, seed=3)
    second = calibrate(twin, data(), steps=5, progress=False, seed=3)
    assert first.losses == second.losses and calls and set(calls) == {False}
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch_first", [True, False])
def test_padded_positions_own_outputs_are_not_fitted(batch_first):
    """With key padding in self-attention, a linear mode zeroes padded positions as queries too, so their own
    outputs differ from softmax's, and no later layer reads them. A window covering the whole sequence with all the
    weight on it is exact softmax on every other row: the error must be 0, not the padded rows' difference
    (counted, half-padded DETR feature maps kept calibration's error above 0.5 where a fit reaches 0.15)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=batch_first), 2,
                                  enable_nested_tensor=False)
    patch(model, "hedgehog", window=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("hedgehog_window_logit"):
                p.fill_(1e4)
    padding = torch.zeros(3, 12, dtype=torch.bool)
    padding[1, 7:] = padding[2, 3:] = True
    x = [b if batch_first else b.transpose(0, 1) for b in data(2)]
    report = calibrate(model, [{"src": b, "src_key_padding_mask": padding} for b in x], steps=0, progress=False)
    assert all(layer["error_before"] < 1e-5 for layer in report.layers), report.table()
    with torch.no_grad():  # what the rows hold: the padded ones do differ from softmax's
        layer = model.layers[0].self_attn
        out = layer(x[0], x[0], x[0], key_padding_mask=padding)[0]
        teacher = layer.__dict__["_linear_mha_original"].eval()(x[0], x[0], x[0], key_padding_mask=padding)[0]
        rows = layer.output_padding(x[0], x[0], x[0], key_padding_mask=padding)
        assert rows.shape == ((3, 12, 1) if batch_first else (12, 3, 1))
        assert (out - teacher).masked_fill(rows, 0).abs().max() < 1e-5 < (out - teacher).abs().max()


def test_a_second_stage_fine_tunes_the_whole_model_with_the_users_loss():
    model = encoder()
    patch(model, "hedgehog")
    target = torch.randn(3, 12, E)
    before = model.layers[0].linear1.weight.detach().clone()
    report = calibrate(model, data(), steps=2, finetune_steps=3, progress=False,
                       loss_fn=lambda m, b: (m(b) - target).pow(2).mean())
    assert len(report.finetune_losses) == 3 and not torch.equal(model.layers[0].linear1.weight, before)


def test_what_calibrate_cannot_do_is_refused():
    with pytest.raises(ValueError, match="found no linear attention"):
        calibrate(encoder(), data(), progress=False)
    direct = nn.Sequential(linear_mha.LinearMultiheadAttention(E, H, mode="hedgehog"))
    with pytest.raises(ValueError, match="built directly"):
        calibrate(direct, data(), progress=False)
    model = encoder()
    patch(model, "kernel")
    with pytest.raises(ValueError, match="nothing to train.*hedgehog"):
        calibrate(model, data(), progress=False)
    model = encoder()
    patch(model, "hedgehog")
    with pytest.raises(ValueError, match="a generator"):
        calibrate(model, (b for b in data(2)), steps=5, eval_batches=0, progress=False)
    with pytest.raises(ValueError, match="finetune_steps needs loss_fn"):
        calibrate(model, data(), finetune_steps=2, progress=False)


def test_a_timm_vit_is_calibrated_against_its_own_attention():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=3).eval()
    images = [torch.randn(2, 3, 32, 32) for _ in range(3)]
    patch(vit, "hedgehog")
    report = calibrate(vit, images, steps=30, lr=1e-2, progress=False)
    assert all(layer["error_after"] < layer["error_before"] for layer in report.layers), report


@pytest.mark.slow
def test_the_detr_trainer_calibrates_a_pretrained_softmax_detr(tmp_path):
    import json
    from integrations.detr.train import main
    from test_detr_train import TINY
    main(TINY + ["--epochs", "1", "--max-iters", "2", "--output-dir", str(tmp_path / "softmax")])
    with pytest.raises(ValueError, match="--calibrate-steps .*--pretrained"):
        main(TINY + ["--attention", "hedgehog", "--calibrate-steps", "2", "--epochs", "1", "--max-iters", "1",
                     "--output-dir", str(tmp_path / "unpretrained")])
    result = main(TINY + ["--pretrained", str(tmp_path / "softmax" / "checkpoint.pth"), "--attention", "hedgehog",
                          "--calibrate-steps", "4", "--eval", "--output-dir", str(tmp_path / "hedgehog")])
    saved = json.loads((tmp_path / "hedgehog" / "calibration.json").read_text())
    assert saved["steps"] == 4 and len(saved["losses"]) == 4 and len(saved["layers"]) == 2
    assert 0 <= result["coco"]["AP"] <= 1


def test_the_bench_reports_accuracy_kept_on_a_vit_trained_here(tmp_path):
    pytest.importorskip("sklearn")
    from tools import calibrate_bench
    result = calibrate_bench.main(["vit", "--seeds", "0", "--train-steps", "20", "--calibration-steps", "3",
                                   "--finetune-after", "3", "--finetune-steps", "2", "--out", str(tmp_path),
                                   "--json", str(tmp_path / "records.json")])
    stages = [r["stage"] for r in result["records"]]
    assert stages == ["softmax (original)", "patch", "calibrated", "calibrated + fine-tuned"]
    assert all(0 <= r["top1"] <= 1 and r["kept"] > 0 for r in result["records"])
    assert result["records"][-1]["fraction_of_training_steps"] == pytest.approx(5 / 20)
    assert (tmp_path / "calibrate_vit.png").stat().st_size > 0 and (tmp_path / "records.json").exists()


@pytest.mark.slow
def test_the_bench_resumes_with_the_earlier_seeds_records_and_refuses_other_options(tmp_path):
    pytest.importorskip("sklearn")
    from tools import calibrate_bench
    common = ["vit", "--train-steps", "20", "--calibration-steps", "3", "--finetune-after", "3",
              "--finetune-steps", "2", "--out", str(tmp_path)]
    first = calibrate_bench.main(common + ["--seeds", "0"])
    second = calibrate_bench.main(common + ["--seeds", "1", "--resume"])
    assert [r for r in second["records"] if r["seed"] == 0] == first["records"]  # kept, not re-run
    assert {r["seed"] for r in second["records"]} == {0, 1}
    assert [r["n"] for r in second["summary"]] == [2, 2, 2, 2]
    again = calibrate_bench.main(common + ["--seeds", "1", "--resume"])  # a re-run seed replaces its records
    assert len(again["records"]) == len(second["records"])
    with pytest.raises(SystemExit, match="other options"):
        calibrate_bench.main(common[:-1] + [str(tmp_path), "--lr", "0.5", "--seeds", "2", "--resume"])
    with pytest.raises(SystemExit, match="does not exist"):
        calibrate_bench.main(common[:-1] + [str(tmp_path / "new"), "--seeds", "2", "--resume"])


@pytest.mark.parametrize("lm", ["torch", "stack"])
def test_the_bench_calibrates_a_causal_lm(lm, tmp_path):
    """--lm torch: built on nn.TransformerEncoder; --lm stack: linear_mha.lm's exact-softmax LM."""
    from tools import calibrate_bench
    result = calibrate_bench.main(["lm", "--lm", lm, "--seeds", "0", "--train-steps", "6", "--calibration-steps", "2",
                                   "--finetune-after", "2", "--finetune-steps", "2", "--out", str(tmp_path),
                                   "--option", "window=3"])
    assert result["options"] == {"window": 3} and result["lm"] == lm
    stages = [r["stage"] for r in result["records"]]
    assert stages == ["softmax (original)", "patch", "calibrated", "calibrated + fine-tuned",
                      "window alone (softmax over the window, far keys dropped)", "fine-tuned without calibration"]
    window_alone, plain = result["records"][4]["bpb"], result["records"][1]["bpb"]
    assert window_alone != plain  # the ablation really dropped the far keys
    assert all(0 < r["bpb"] < 9 and r["kept"] == pytest.approx(result["records"][0]["bpb"] / r["bpb"])
               for r in result["records"])
    assert result["records"][3]["fraction_of_training_steps"] == pytest.approx(4 / 6)


def test_a_misspelt_method_option_fails_before_any_training(tmp_path):
    from tools import calibrate_bench
    with pytest.raises(ValueError, match="windw"):
        calibrate_bench.main(["lm", "--seeds", "0", "--train-steps", "100000", "--out", str(tmp_path),
                              "--option", "windw=3"])


@pytest.mark.parametrize("options", [{}, {"window": 3}], ids=["maps", "window"])
def test_a_patched_causal_lm_never_sees_the_future(options):
    from tools.calibrate_lm import TorchCausalLM
    torch.manual_seed(0)
    model = TorchCausalLM(dim=32, depth=1, heads=2, seq_len=16).eval()
    patch(model, "hedgehog", **options)
    assert model.encoder.layers[0].self_attn.mode == "hedgehog"  # the test is about linear attention, not softmax
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 9:] = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_the_detr_bench_hands_its_calibration_options_to_the_trainer(monkeypatch, tmp_path):
    """--lr is calibration's learning rate for every model: for DETR it must reach the trainer's --calibrate-lr
    (it once fell back silently to the trainer's default)."""
    import integrations.detr.checkpoint as checkpoint
    import integrations.detr.plots as plots
    import integrations.detr.train as train
    from tools import calibrate_bench
    calls = []
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda path, what: {
        "epoch": 0, "args": {"synthetic_train": 80, "batch_size": 8, "max_iters": None, "train_ann": None}})
    monkeypatch.setattr(plots, "read_log", lambda path: [{"test_AP": 0.5}])
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv) or {"coco": {"AP": 0.4, "AP50": 0.6,
                                                                                     "AP75": 0.4}})
    calibrate_bench.main(["detr", "--checkpoints", str(tmp_path / "c.pth"), "--lr", "0.03", "--calibration-steps",
                          "7", "--finetune-after", "7", "--finetune-steps", "3", "--out", str(tmp_path),
                          "--option", "init=favor"])
    calibrated = [argv for argv in calls if "--calibrate-steps" in argv]
    assert calibrated and all(argv[argv.index("--calibrate-lr") + 1] == "0.03" for argv in calibrated)
    assert all("--attention-option=init=favor" in argv for argv in calls)


def test_a_detr_resume_without_explicit_seeds_is_refused(tmp_path, capsys):
    from tools import calibrate_bench
    with pytest.raises(SystemExit):
        calibrate_bench.main(["detr", "--checkpoints", str(tmp_path / "c.pth"), "--resume", "--out", str(tmp_path)])
    assert "--checkpoint-seeds" in capsys.readouterr().err


def test_calibration_trains_the_window_mix_with_the_maps():
    model = encoder()
    patch(model, "hedgehog", window=3)  # exact softmax over 7 of 12 keys, the maps for the rest
    start = {n: p.detach().clone() for n, p in model.named_parameters() if "window_logit" in n}
    report = calibrate(model, data(), steps=60, lr=1e-2, progress=False)
    assert len(start) == 2
    assert all(not torch.equal(p, start[n]) for n, p in model.named_parameters() if n in start)
    assert all(layer["error_after"] < 0.8 * layer["error_before"] for layer in report.layers), report.table()
