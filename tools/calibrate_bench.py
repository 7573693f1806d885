"""How much of a softmax model's accuracy linear attention keeps after ``linear_mha.calibrate``, on models trained
here (nothing is downloaded): plain patch, attention transfer alone, and transfer plus a short fine-tune.

    python -m linear_mha.tools.calibrate_bench vit --seeds 0 1 2 --out runs/calib_vit --json docs/results/calibrate_vit.json
    python -m linear_mha.tools.calibrate_bench detr --checkpoints runs/detr_cmp/softmax/seed42/checkpoint.pth ... \\
        --out runs/calib_detr --json docs/results/calibrate_detr.json -- --backbone small --synthetic-train 2000 ...

    python -m linear_mha.tools.calibrate_bench lm --seeds 0 1 2 --out runs/calib_lm --json docs/results/calibrate_lm.json

vit: a small timm ViT (--vit timm) or transformers ViT (--vit hf) trained from scratch on scikit-learn's handwritten
digits (1,797 8 x 8 images, upsampled to 32 x 32; 80/20 split by seed), then patched with --mode (hedgehog) and
calibrated. detr: softmax DETR checkpoints written by integrations.detr.train (e.g. tools.detr_compare's softmax
runs), patched in the encoder and calibrated through the trainer's --calibrate-steps, on its training images; the
options after `--` are the trainer's. lm: a byte-level causal LM on torch.nn.TransformerEncoder (--lm torch),
linear_mha.lm's own exact-softmax LM (--lm stack) or transformers' LlamaForCausalLM (--lm hf), trained on the
standard library's sources (tools/calibrate_lm.py), measured in bits per byte (lower is better; kept = original /
patched). All three report accuracy against the number of calibration steps, the budget as a fraction of the
original training steps, the table, a JSON of every record and a PNG (accuracy against calibration steps).
"""
import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from linear_mha.integrations.checkpoint_io import write_text_atomic
from linear_mha.integrations.console import HelpFormatter
from linear_mha.integrations.detr.attention import parse_attention_options
from linear_mha import calibrate, method_class

from . import measure as M
from .calibrate_stages import calibration_stages, train_resumable
from .hf_models import vit_classifier


# ---------------------------------------------------------------------------------------------------- the ViT
def digits(seed):
    """(train images, train labels, test images, test labels): 32 x 32, one channel, 80/20 split by ``seed``."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    x = (F.interpolate(x, size=32, mode="bilinear", align_corners=False) - 0.3) / 0.35
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def build_vit(seed, kind="timm"):
    if kind == "hf":
        return vit_classifier(seed)
    import timm
    torch.manual_seed(seed)
    return timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=4, in_chans=1, num_classes=10,
                                                            embed_dim=96, depth=4, num_heads=4, mlp_ratio=2.0)


def batches(x, y, size, seed):
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return [(x[order[i:i + size]], y[order[i:i + size]]) for i in range(0, len(y) - size + 1, size)]


@torch.no_grad()
def top1(model, x, y):
    model.eval()
    return float((model(x).argmax(-1) == y).float().mean())


def train_vit(model, x, y, steps, lr, seed, label="softmax", checkpoint=None):
    """Train ``model`` on (x, y) in place; with ``checkpoint`` a killed run continues where it was saved (every 100
    steps). Returns the seconds spent training, over every call."""
    def epochs():  # a fresh shuffle per epoch, the last batch of each first
        for epoch in itertools.count():
            yield from reversed(batches(x, y, 64, seed * 1000 + epoch))
    return train_resumable(model, epochs(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), steps, lr, 0.05,
                           desc=f"{label} ViT, seed {seed}", checkpoint=checkpoint)


def vit_records(a, seed):
    x_train, y_train, x_test, y_test = digits(seed)
    original = build_vit(seed, a.vit)
    train_vit(original, x_train, y_train, a.train_steps, 2e-3, seed)
    base = top1(original, x_test, y_test)
    records = [dict(seed=seed, stage="softmax (original)", calibration_steps=0, finetune_steps=0, top1=base)]
    train_batches = [images for images, _ in batches(x_train, y_train, 64, seed + 7)]
    pairs = batches(x_train, y_train, 64, seed + 11)

    def finetune(model, steps):
        calibrate(model, pairs, steps=0, eval_batches=0, finetune_steps=steps, finetune_lr=a.finetune_lr,
                  forward=lambda m, b: m(b[0]), seed=seed, progress=False,
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    records += calibration_stages(a, seed, original, train_batches, finetune, "top1",
                                  lambda model: top1(model, x_test, y_test))
    for r in records:
        r["kept"] = r["top1"] / base
        r["fraction_of_training_steps"] = (r["calibration_steps"] + r["finetune_steps"]) / a.train_steps
    return records


# ---------------------------------------------------------------------------------------------------- DETR
def original_training_steps(args: dict, last_epoch: int):
    """The steps a DETR checkpoint trained for, from its saved arguments: epochs x batches per epoch (training
    images // batch size, at most --max-iters), as one process counts them; None when its images cannot be
    counted. The synthetic set's annotation file is counted like any other (the trainer writes --train-ann for
    it), falling back to --synthetic-train when the file is gone."""
    ann = args.get("train_ann")
    generated = Path(args.get("output_dir") or ".") / "synthetic-coco"  # where prepare_data_args writes the set
    if ann and Path(ann).is_file():
        images = len(json.loads(Path(ann).read_text())["images"])
    elif args.get("synthetic_train") and (not ann or Path(ann).is_relative_to(generated)):
        images = args["synthetic_train"]
    else:
        return None
    per_epoch = images // args["batch_size"]
    if args.get("max_iters"):
        per_epoch = min(per_epoch, args["max_iters"])
    return (last_epoch + 1) * per_epoch


def detr_records(a, seed, checkpoint):
    from linear_mha.integrations.detr.checkpoint import load_checkpoint
    from linear_mha.integrations.detr.plots import read_log
    from linear_mha.integrations.detr.train import main as train_main
    saved = load_checkpoint(checkpoint, "--checkpoints")
    log = read_log(Path(checkpoint).with_name("log.jsonl"))
    base, args = log[-1]["test_AP"], saved["args"]
    iterations = original_training_steps(args, saved["epoch"])
    common = ["--seed", str(seed), "--no-progress", "--num-workers", "0", "--pretrained", str(checkpoint),
              "--attention", a.mode] + [f"--attention-option={o}" for o in a.option] + a.train_args
    records = [dict(seed=seed, stage="softmax (original)", calibration_steps=0, finetune_steps=0, AP=base)]

    def run(stage, calibration, finetune, distill=False):
        with tempfile.TemporaryDirectory(prefix="calib_detr_") as out:
            extra = ["--calibrate-steps", str(calibration), "--calibrate-lr", str(a.lr)] if calibration else []
            lr = a.distill_lr if distill else a.finetune_lr
            extra += (["--epochs", "1", "--max-iters", str(finetune), "--lr", str(lr),
                       "--lr-backbone", str(lr / 10)] if finetune else ["--eval"])
            extra += ["--distill"] if distill else []
            result = train_main(common + extra + ["--output-dir", out])
        coco = result["coco"]
        records.append(dict(seed=seed, stage=stage, calibration_steps=calibration, finetune_steps=finetune,
                            AP=coco["AP"], AP50=coco["AP50"], AP75=coco["AP75"]))
    for steps in [0] + a.calibration_steps:
        run("patch" if not steps else "calibrated", steps, 0)
    run("calibrated + fine-tuned", a.finetune_after, a.finetune_steps)
    if a.distill_steps:
        run("calibrated + distilled", a.distill_after, a.distill_steps, distill=True)
    run("fine-tuned without calibration", 0, a.finetune_after + a.finetune_steps)
    for r in records:
        r["kept"] = r["AP"] / base
        r["fraction_of_training_steps"] = (r["calibration_steps"] + r["finetune_steps"]) / iterations \
            if iterations else None
    return records


# ----------------------------------------------------------------------------------------------------- resume
RECORD_KEYS = {"seed", "stage", "calibration_steps", "finetune_steps", "kept", "fraction_of_training_steps"}
METRICS = {"vit": "top1", "lm": "bpb", "detr": "AP"}  # what each model's table measures
PER_SEED_FLAGS = {"--seeds", "--checkpoints", "--checkpoint-seeds", "--resume", "--json", "--threads"}


def _options(argv, also=()):
    """The tokens of a command that must match for records to be combined: all but the per-seed flags (and
    ``also``)."""
    kept, skipping = [], False
    for token in argv:
        if token.startswith("--") and token != "--":
            skipping = token in PER_SEED_FLAGS or token in also
        if not skipping:
            kept.append(token)
    return kept


def previous_records(path: Path, argv):
    """The records of an earlier run in ``path``; exits when that run's options (everything but seeds,
    checkpoints, threads and output files) differ from this one's."""
    if not path.exists():
        raise SystemExit(f"--resume: {path} does not exist; run without --resume first (or give the same --out)")
    try:
        old = json.loads(path.read_text())
        before = _options(old.get("argv") or old["command"].split()[3:])  # files before "argv" was stored
        records = old["records"]
        if not (isinstance(records, list) and all(isinstance(r, dict) and RECORD_KEYS <= r.keys() for r in records)):
            raise TypeError(f"'records' is not a list of objects with {sorted(RECORD_KEYS)}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, or not a results.json
        raise SystemExit(f"--resume: {path} is not a results.json this tool wrote ({type(exc).__name__}: {exc}); "
                         f"move it aside and run the seeds again") from None
    if before != _options(list(argv)):
        raise SystemExit(f"--resume: {path} was made with other options:\n  {' '.join(before)}\nthis run has\n  "
                         f"{' '.join(_options(list(argv)))}\nrun with the same options or another --out")
    return records


def combine(paths, model):
    """One table of the results files ``paths`` (seeds run as separate commands, each into its own --out): their
    options but the per-seed ones and --out must agree, as must machine and torch, and each seed appear once."""
    files = [json.loads(Path(path).read_text()) for path in paths]
    setups = {(tuple(_options(f["argv"], also={"--out"})), f["machine"], f["torch"]) for f in files}
    if {f["model"] for f in files} != {model}:
        raise SystemExit(f"--combine: {[str(p) for p in paths]} hold {sorted({f['model'] for f in files})} "
                         f"results; this is {model}")
    if len(setups) != 1:
        raise SystemExit(f"--combine: {[str(p) for p in paths]} differ in options (but seeds, checkpoints, --out), "
                         f"machine or torch; a table comes from one recipe on one machine")
    records = [r for f in files for r in f["records"]]
    seeds = [seed for f in files for seed in dict.fromkeys(r["seed"] for r in f["records"])]
    if len(seeds) != len(set(seeds)):
        raise SystemExit(f"--combine: a seed is in more than one of {[str(p) for p in paths]} (seeds {seeds})")
    first = {key: value for key, value in files[0].items() if key not in ("command", "argv", "records", "summary")}
    return {**first, "commands": [f["command"] for f in files], "records": records,
            "summary": summarize(records, METRICS[model])}


# ----------------------------------------------------------------------------------------------------- report
def summarize(records, metric):
    rows = []
    for key in dict.fromkeys((r["stage"], r["calibration_steps"], r["finetune_steps"]) for r in records):
        of = [r for r in records if (r["stage"], r["calibration_steps"], r["finetune_steps"]) == key]
        values, kept = [r[metric] for r in of], [r["kept"] for r in of]
        rows.append(dict(stage=key[0], calibration_steps=key[1], finetune_steps=key[2], n=len(of),
                         mean=statistics.mean(values), std=statistics.stdev(values) if len(of) > 1 else 0.0,
                         kept=statistics.mean(kept), fraction=of[0]["fraction_of_training_steps"]))
    return rows


def print_table(rows, metric):
    print(f"| stage | calibration steps | fine-tune steps | % of training steps | {metric} (mean ± std) | kept |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fraction = "-" if r["fraction"] is None else f"{100 * r['fraction']:.1f}%"
        print(f"| {r['stage']} | {r['calibration_steps']} | {r['finetune_steps']} | {fraction} | "
              f"{r['mean']:.4f} ± {r['std']:.4f} (n={r['n']}) | {100 * r['kept']:.1f}% |")


def plot(records, metric, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    curve = [r for r in summarize(records, metric) if r["stage"] in ("patch", "calibrated")]
    ax.errorbar([r["calibration_steps"] for r in curve], [r["mean"] for r in curve], [r["std"] for r in curve],
                marker="o", capsize=3, label="linear, after calibration (stage 1)")
    base = [r for r in summarize(records, metric) if r["stage"] == "softmax (original)"][0]
    ax.axhline(base["mean"], color="k", linestyle="--", label="softmax (original)")
    alone = [r for r in summarize(records, metric) if r["stage"].startswith("window alone")]
    if alone:
        ax.axhline(alone[0]["mean"], color="C1", linestyle=":", label="the window alone (far keys dropped)")
    for stage, marker, color, what in (("calibrated + fine-tuned", "s", "C2", "fine-tuning steps (task loss)"),
                                       ("calibrated + distilled", "D", "C3", "distillation steps")):
        row = [r for r in summarize(records, metric) if r["stage"] == stage]
        if row:  # drawn a little to the right when both start from the same calibration, so neither hides
            shift = 2 if stage.endswith("distilled") else 0
            ax.errorbar([row[0]["calibration_steps"] + shift], [row[0]["mean"]], [row[0]["std"]], marker=marker,
                        color=color, linestyle="none", capsize=3, label=f"+ {row[0]['finetune_steps']} {what}")
    ax.set(xlabel="calibration steps", ylabel=metric, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(a, argv, metric, records):
    """Write --out's results.json (every record, the summary, the command and machine) and return it."""
    result = {"model": a.model, **({"lm": a.lm} if a.model == "lm" else {}),
              **({"vit": a.vit} if a.model == "vit" else {}), "mode": a.mode, "options": a.options,
              "machine": f"{M.cpu_name()} ({platform.machine()})", "threads": torch.get_num_threads(),
              "torch": torch.__version__, **_transformers_version(a),
              "command": "python -m linear_mha.tools.calibrate_bench " + " ".join(argv), "argv": list(argv), "records": records,
              "summary": summarize(records, metric)}
    write_text_atomic(a.out / "results.json", json.dumps(result, indent=1))
    return result


def _transformers_version(a):
    if getattr(a, a.model, None) != "hf":  # --lm hf or --vit hf: transformers' models
        return {}
    import transformers
    return {"transformers": transformers.__version__}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.calibrate_bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", choices=["vit", "detr", "lm"])
    p.add_argument("--mode", default="hedgehog", help="the linear method patched in (a learnable one)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an option of --mode, e.g. window=16 (repeatable; values are Python literals or strings)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="vit, lm: one trained model per seed")
    p.add_argument("--lm", choices=["torch", "stack", "hf"], default="torch",
                   help="lm: the nn.TransformerEncoder LM, linear_mha.lm's own exact-softmax LM, or transformers' "
                        "LlamaForCausalLM")
    p.add_argument("--vit", choices=["timm", "hf"], default="timm",
                   help="vit: timm's VisionTransformer, or transformers' ViTForImageClassification")
    p.add_argument("--checkpoints", nargs="+", default=[], help="detr: softmax checkpoints, one per seed")
    p.add_argument("--checkpoint-seeds", type=int, nargs="+", default=None, help="detr: their seeds (default 42..)")
    p.add_argument("--train-steps", type=int, default=2000, help="vit, lm: training steps of the softmax model")
    p.add_argument("--calibration-steps", type=int, nargs="+", default=[25, 50, 100])
    p.add_argument("--lr", type=float, default=1e-2, help="calibration learning rate")
    p.add_argument("--finetune-after", type=int, default=50, help="the calibration steps the fine-tune follows")
    p.add_argument("--finetune-steps", type=int, default=50)
    p.add_argument("--finetune-lr", type=float, default=3e-4)
    p.add_argument("--distill-steps", type=int, default=0,
                   help="also fine-tune by distillation from the original model (its outputs, not the labels) for "
                        "this many steps after --distill-after calibration steps (0: no such row)")
    p.add_argument("--distill-after", type=int, default=None,
                   help="the calibration steps the distillation follows (default --finetune-after)")
    p.add_argument("--distill-lr", type=float, default=None, help="the distillation's learning rate (default "
                                                                  "--finetune-lr)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/calibrate"), help="results.json and the PNG go here")
    p.add_argument("--json", type=Path, help="also write the records here")
    p.add_argument("--combine", type=Path, nargs="+", metavar="RESULTS",
                   help="run nothing: the table of these results.json files (the same recipe, other seeds) goes "
                        "to --json and --out")
    p.add_argument("--resume", action="store_true",
                   help="keep the records of --out's results.json for seeds not given now and run only the given "
                        "ones (refused when the earlier run's other options differ)")
    p.epilog = "detr: the trainer's data and model options follow a --"
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = p.parse_args(own)
    a.train_args = train_args
    a.distill_after = a.finetune_after if a.distill_after is None else a.distill_after
    a.distill_lr = a.finetune_lr if a.distill_lr is None else a.distill_lr
    for flag, after, steps in (("--finetune-after", a.finetune_after, a.finetune_steps),
                               ("--distill-after", a.distill_after, a.distill_steps)):
        if a.model != "detr" and steps and after not in a.calibration_steps:  # detr calibrates each row afresh
            p.error(f"{flag} {after} must be one of --calibration-steps {a.calibration_steps}: the fine-tune starts "
                    f"from that calibrated model")
    if a.combine:
        if not a.json:
            p.error("--combine writes the joined table to --json FILE: give it")
        return report(a, combine(a.combine, a.model))
    a.options = parse_attention_options(a.option)
    method_class(a.mode).validate(a.options)  # a misspelt option fails now, not after the softmax model trained
    M.pin_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.resume and a.model == "detr" and a.checkpoints and a.checkpoint_seeds is None:
        p.error("--resume with detr needs --checkpoint-seeds: the default seeds (42, ...) would replace the "
                "earlier run's records of those seeds")
    earlier = previous_records(a.out / "results.json", argv) if a.resume else []  # refused before hours of work
    if a.model == "vit":
        metric, runs = METRICS[a.model], [(seed, lambda seed=seed: vit_records(a, seed)) for seed in a.seeds]
    elif a.model == "lm":
        from .calibrate_lm import lm_records
        metric, runs = METRICS[a.model], [(seed, lambda seed=seed: lm_records(a, seed)) for seed in a.seeds]
    else:
        if not a.checkpoints:
            p.error("detr needs --checkpoints (softmax DETRs trained by linear-mha-detr-train)")
        seeds = a.checkpoint_seeds or list(range(42, 42 + len(a.checkpoints)))
        metric = METRICS[a.model]
        runs = [(seed, lambda seed=seed, ckpt=ckpt: detr_records(a, seed, ckpt))
                for seed, ckpt in zip(seeds, a.checkpoints)]
    print(f"calibrate_bench: {len(runs)} seed(s); {a.out / 'results.json'} is rewritten after each one, so an "
          f"interrupted run resumes with --resume --seeds <the seeds not yet in it>", file=sys.stderr)
    records = [r for r in earlier if r["seed"] not in {seed for seed, _ in runs}]
    for seed, run in runs:
        records += run()
        result = write_results(a, argv, metric, records)
        print(f"calibrate_bench: seed {seed} done, {len(records)} records in {a.out / 'results.json'}",
              file=sys.stderr)
    return report(a, result)


def report(a, result):
    """Print ``result``'s table, draw its figure into --out and write it to --json (if given); return it."""
    metric = METRICS[a.model]
    print_table(result["summary"], metric)
    a.out.mkdir(parents=True, exist_ok=True)
    plot(result["records"], metric, a.out / f"calibrate_{a.model}.png",
         f"{a.model}: accuracy against calibration steps")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
