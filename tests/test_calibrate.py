"""linear_mha.calibrate: attention transfer from the softmax attention patch() replaced to a learnable linear
method; only the tensors linear_mha added train, everything is restored afterwards, runs are reproducible, and it
works where users are (nn.MultiheadAttention models, timm ViTs, the DETR trainer)."""
import copy
import json

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
        original = layer.self_attn.original
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
        teacher = layer.original.eval()(x[0], x[0], x[0], key_padding_mask=padding)[0]
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


def test_distillation_fits_the_outputs_of_the_original_model_as_it_was():
    """distill=True: the target is the original model (softmax attention, the weights stage 2 started from), exact
    (eval mode) on the very batch, every step, although stage 2 moves the weights the kept softmax modules share
    (without the copy the target would follow the student); the patched model's outputs move toward it."""
    model = encoder()
    original = copy.deepcopy(model).eval()
    batches = data()
    patch(model, "hedgehog")
    targets = []

    def distance(output, target):
        targets.append(target)
        return linear_mha.output_distance(output, target)
    with torch.no_grad():
        start = sum(float(linear_mha.output_distance(model.eval()(b), original(b))) for b in batches)
    report = calibrate(model, batches, steps=0, eval_batches=0, finetune_steps=8, finetune_lr=3e-3, distill=distance,
                       progress=False)
    assert report.distilled and "distilling the original's outputs" in report.table()
    assert len(targets) == 8 and not torch.equal(model.layers[0].linear1.weight, original.layers[0].linear1.weight)
    for step, target in enumerate(targets):
        torch.testing.assert_close(target, original(batches[step % len(batches)]), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        end = sum(float(linear_mha.output_distance(model.eval()(b), original(b))) for b in batches)
    assert end < 0.7 * start and report.finetune_losses[-1] < report.finetune_losses[0]


def test_distillation_by_default_fits_every_floating_point_output():
    from linear_mha import output_distance
    t = {"logits": torch.tensor([[3.0, 4.0]]), "aux": [torch.tensor([1.0, 0.0]), torch.tensor([2])]}
    o = {"logits": torch.tensor([[0.0, 4.0]]), "aux": [torch.tensor([1.0, 1.0]), torch.tensor([5])]}
    assert float(output_distance(o, t)) == pytest.approx(9 / 25 + 1 / 1)  # each relative to its own size; ints skipped
    with pytest.raises(ValueError, match="no floating-point tensor.*distill=a function"):
        output_distance([torch.tensor([1])], [torch.tensor([1])])
    model = encoder()
    patch(model, "hedgehog", init="favor")
    report = calibrate(model, data(), steps=0, eval_batches=0, finetune_steps=4, finetune_lr=3e-3, distill=True,
                       progress=False)
    assert report.finetune_losses[-1] < report.finetune_losses[0] and model.training


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
    with pytest.raises(ValueError, match="finetune_steps needs one of loss_fn.*or distill=True"):
        calibrate(model, data(), finetune_steps=2, progress=False)
    with pytest.raises(ValueError, match="not both"):
        calibrate(model, data(), finetune_steps=2, distill=True, loss_fn=lambda m, b: m(b).sum(), progress=False)
    with pytest.raises(ValueError, match="distill must be True, False or a function"):
        calibrate(model, data(), finetune_steps=2, distill="yes", progress=False)


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
    from linear_mha.integrations.detr.train import main
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
    # --distill: the fine-tune after calibration trains against the softmax DETR's predictions, not the labels
    result = main(TINY + ["--pretrained", str(tmp_path / "softmax" / "checkpoint.pth"), "--attention", "hedgehog",
                          "--calibrate-steps", "2", "--distill", "--epochs", "1", "--max-iters", "2",
                          "--output-dir", str(tmp_path / "distilled")])
    entry = result["log"][-1]
    assert entry["train_loss_kd_giou"] >= 0 and "train_loss_giou" not in entry and "test_loss_giou" in entry
    for argv, match in ((["--attention", "hedgehog"], "--distill .*--pretrained"),
                        (["--attention", "softmax", "--pretrained", "x.pth"], "own teacher")):
        with pytest.raises(ValueError, match=match):
            main(TINY + argv + ["--distill", "--output-dir", str(tmp_path / "refused")])


def test_detr_distillation_compares_each_query_with_the_teachers():
    """--distill's loss: 0 when the student predicts what the teacher does; each term grows with its own error;
    query i is compared with query i (a permutation of the queries is an error, though a matcher would forgive it);
    auxiliary layers get their own terms."""
    from linear_mha.integrations.detr.distill import DistillationCriterion
    g = torch.Generator().manual_seed(0)

    def outputs():
        def layer():
            return {"pred_logits": torch.randn(2, 5, 4, generator=g),
                    "pred_boxes": 0.3 + 0.4 * torch.rand(2, 5, 4, generator=g)}
        return {**layer(), "aux_outputs": [layer()]}
    criterion = DistillationCriterion({"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0, "loss_ce_0": 1.0,
                                       "loss_bbox_0": 5.0, "loss_giou_0": 2.0})
    assert criterion.weight_dict == {"loss_kd_ce": 1.0, "loss_kd_bbox": 5.0, "loss_kd_giou": 2.0,
                                     "loss_kd_ce_0": 1.0, "loss_kd_bbox_0": 5.0, "loss_kd_giou_0": 2.0}
    teacher = outputs()
    same = criterion(teacher, teacher)
    assert set(same) == set(criterion.weight_dict) and all(abs(float(v)) < 1e-6 for v in same.values())
    shuffled = {k: v[:, [1, 0, 2, 3, 4]] for k, v in teacher.items() if k != "aux_outputs"}
    moved = criterion({**shuffled, "aux_outputs": teacher["aux_outputs"]}, teacher)
    assert all(float(moved[k]) > 1e-3 for k in ("loss_kd_ce", "loss_kd_bbox", "loss_kd_giou"))
    assert all(float(moved[f"{k}_0"]) < 1e-6 for k in ("loss_kd_ce", "loss_kd_bbox", "loss_kd_giou"))
    student = {**teacher, "pred_boxes": teacher["pred_boxes"] + 0.01}
    assert float(criterion(student, teacher)["loss_kd_bbox"]) == pytest.approx(0.04, rel=1e-4)  # 4 coordinates
    p = torch.softmax(teacher["pred_logits"], -1)
    q = torch.softmax(outputs()["pred_logits"], -1)
    kl = (p * (p.log() - q.log())).sum(-1).mean()
    got = criterion({**teacher, "pred_logits": q.log()}, teacher)["loss_kd_ce"]
    torch.testing.assert_close(got, kl)


def test_the_bench_reports_accuracy_kept_on_a_vit_trained_here(tmp_path):
    pytest.importorskip("sklearn")
    from linear_mha.tools import calibrate_bench
    result = calibrate_bench.main(["vit", "--seeds", "0", "--train-steps", "20", "--calibration-steps", "3",
                                   "--finetune-after", "3", "--finetune-steps", "2", "--distill-steps", "1",
                                   "--out", str(tmp_path), "--json", str(tmp_path / "records.json")])
    stages = [r["stage"] for r in result["records"]]
    assert stages == ["softmax (original)", "patch", "calibrated", "calibrated + distilled", "calibrated + fine-tuned"]
    assert result["records"][3]["fraction_of_training_steps"] == pytest.approx(4 / 20)
    assert all(0 <= r["top1"] <= 1 and r["kept"] > 0 for r in result["records"])
    assert result["records"][-1]["fraction_of_training_steps"] == pytest.approx(5 / 20)
    assert (tmp_path / "calibrate_vit.png").stat().st_size > 0 and (tmp_path / "records.json").exists()


@pytest.mark.slow
def test_the_bench_resumes_with_the_earlier_seeds_records_and_refuses_other_options(tmp_path):
    pytest.importorskip("sklearn")
    from linear_mha.tools import calibrate_bench
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


def test_the_bench_combines_seeds_run_apart_into_one_table_of_one_recipe(tmp_path):
    """Seeds of a slow model (a 48-epoch DETR each) run as separate commands into their own --out; --combine makes
    the recipe's table of them, and refuses files of another recipe, machine or model, or a seed twice."""
    from linear_mha.tools import calibrate_bench

    def results(seed, lr="3e-2", out=None, model="detr", machine="cpu A"):
        argv = ["detr", "--checkpoints", f"s{seed}.pth", "--checkpoint-seeds", str(seed), "--lr", lr,
                "--out", out or f"runs/seed{seed}", "--", "--no-crop"]
        records = [{"seed": seed, "stage": stage, "calibration_steps": steps, "finetune_steps": 0, "AP": ap,
                    "kept": ap / 0.5, "fraction_of_training_steps": steps / 100}
                   for stage, steps, ap in (("softmax (original)", 0, 0.5), ("calibrated", 5, 0.4 + seed / 100))]
        path = tmp_path / f"{seed}_{lr}_{model}_{machine}_{out}.json"
        path.write_text(json.dumps({"model": model, "mode": "hedgehog", "machine": machine, "torch": "2.x",
                                    "command": " ".join(argv), "argv": argv, "records": records}))
        return str(path)

    joined = tmp_path / "joined.json"
    result = calibrate_bench.main(["detr", "--combine", results(1), results(2), "--json", str(joined),
                                   "--out", str(tmp_path / "out")])
    assert json.loads(joined.read_text()) == result and len(result["commands"]) == 2
    calibrated = {r["stage"]: r for r in result["summary"]}["calibrated"]
    assert calibrated["n"] == 2 and calibrated["mean"] == pytest.approx(0.415)
    assert calibrated["kept"] == pytest.approx(0.83)
    assert (tmp_path / "out" / "calibrate_detr.png").stat().st_size > 0
    for files, match in (([results(1), results(2, lr="1e-2")], "differ in options"),
                         ([results(1), results(2, machine="cpu B")], "machine"),
                         ([results(1), results(1, out="elsewhere")], "more than one"),
                         ([results(1), results(2, model="vit")], "hold")):
        with pytest.raises(SystemExit, match=match):
            calibrate_bench.main(["detr", "--combine", *files, "--json", str(tmp_path / "refused.json")])
    assert not (tmp_path / "refused.json").exists()


@pytest.mark.parametrize("lm", ["torch", "stack"])
def test_the_bench_calibrates_a_causal_lm(lm, tmp_path):
    """--lm torch: built on nn.TransformerEncoder; --lm stack: linear_mha.lm's exact-softmax LM."""
    from linear_mha.tools import calibrate_bench
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
    from linear_mha.tools import calibrate_bench
    with pytest.raises(ValueError, match="windw"):
        calibrate_bench.main(["lm", "--seeds", "0", "--train-steps", "100000", "--out", str(tmp_path),
                              "--option", "windw=3"])


@pytest.mark.parametrize("options", [{}, {"window": 3}], ids=["maps", "window"])
def test_a_patched_causal_lm_never_sees_the_future(options):
    from linear_mha.tools.calibrate_lm import TorchCausalLM
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
    import linear_mha.integrations.detr.checkpoint as checkpoint
    import linear_mha.integrations.detr.plots as plots
    import linear_mha.integrations.detr.train as train
    from linear_mha.tools import calibrate_bench
    calls = []
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda path, what: {
        "epoch": 0, "args": {"synthetic_train": 80, "batch_size": 8, "max_iters": None, "train_ann": None}})
    monkeypatch.setattr(plots, "read_log", lambda path: [{"test_AP": 0.5}])
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv) or {"coco": {"AP": 0.4, "AP50": 0.6,
                                                                                     "AP75": 0.4}})
    result = calibrate_bench.main(["detr", "--checkpoints", str(tmp_path / "c.pth"), "--lr", "0.03",
                                   "--calibration-steps", "7", "--finetune-after", "7", "--finetune-steps", "3",
                                   "--distill-after", "5", "--distill-steps", "2", "--distill-lr", "1e-5",
                                   "--out", str(tmp_path), "--option", "init=favor"])
    calibrated = [argv for argv in calls if "--calibrate-steps" in argv]
    assert calibrated and all(argv[argv.index("--calibrate-lr") + 1] == "0.03" for argv in calibrated)
    assert all("--attention-option=init=favor" in argv for argv in calls)
    distilled = [argv for argv in calls if "--distill" in argv]
    assert len(distilled) == 1 and [distilled[0][distilled[0].index(f) + 1] for f in (
        "--calibrate-steps", "--max-iters", "--lr")] == ["5", "2", "1e-05"]
    distilled_record = [r for r in result["records"] if r["stage"] == "calibrated + distilled"][0]
    assert distilled_record["finetune_steps"] == 2
    assert distilled_record["fraction_of_training_steps"] == pytest.approx(7 / 10)  # 80 images / batch 8, 1 epoch


def test_the_detr_bench_counts_the_original_training_steps(tmp_path):
    """The budget's denominator (it was None for every DETR record: a synthetic run's --train-ann is set)."""
    import json
    from linear_mha.tools.calibrate_bench import original_training_steps
    ann = tmp_path / "run" / "synthetic-coco" / "annotations" / "instances_train.json"
    ann.parent.mkdir(parents=True)
    ann.write_text(json.dumps({"images": [{"id": i} for i in range(100)]}))
    args = {"train_ann": str(ann), "synthetic_train": 2000, "batch_size": 8, "max_iters": 0,
            "output_dir": str(tmp_path / "run"), "coco_path": None}
    assert original_training_steps(args, 15) == 16 * 12  # the file's 100 images, not --synthetic-train
    assert original_training_steps({**args, "max_iters": 5}, 15) == 16 * 5
    ann.unlink()  # the generated set is gone: --synthetic-train says how many it had
    assert original_training_steps(args, 15) == 16 * 250
    assert original_training_steps({**args, "train_ann": str(tmp_path / "own.json")}, 15) is None


def test_a_fine_tune_from_a_calibration_the_bench_does_not_run_is_refused(tmp_path, capsys):
    from linear_mha.tools import calibrate_bench
    with pytest.raises(SystemExit):
        calibrate_bench.main(["vit", "--calibration-steps", "3", "--finetune-after", "3", "--distill-steps", "2",
                              "--distill-after", "5", "--out", str(tmp_path)])
    assert "--distill-after 5 must be one of --calibration-steps [3]" in capsys.readouterr().err


def test_a_detr_resume_without_explicit_seeds_is_refused(tmp_path, capsys):
    from linear_mha.tools import calibrate_bench
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


def test_the_bench_saves_each_seed_as_it_finishes_so_an_interrupted_run_keeps_them(tmp_path, monkeypatch):
    """Hours of seeds must not be lost to a crash in the last one: results.json holds every finished seed."""
    from linear_mha.tools import calibrate_bench

    def records(a, seed):
        if seed == 2:
            raise KeyboardInterrupt
        return [dict(seed=seed, stage="softmax (original)", calibration_steps=0, finetune_steps=0, top1=0.9,
                     kept=1.0, fraction_of_training_steps=0.0)]
    monkeypatch.setattr(calibrate_bench, "vit_records", records)
    with pytest.raises(KeyboardInterrupt):
        calibrate_bench.main(["vit", "--seeds", "0", "1", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["seed"] for r in saved["records"]] == [0, 1]
    assert saved["summary"][0]["n"] == 2
