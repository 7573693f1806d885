"""DETR (softmax) against Linear-DETRs on the synthetic set, with the same data, budget, backbone and seeds for every
variant, and (--encoder) an encoder time / memory table at growing image sizes through DETR's real call path.

    python -m linear_mha.tools.detr_compare          # DETR and the recommended Linear-DETR on the trainer's default run
    python -m linear_mha.tools.detr_compare --out runs/detr_cmp --epochs 16 --pretrain-iters 2000 --seeds 42 43 44 \\
        --variants softmax kernel focused focused-dwc3 --records runs/detr_cmp/records.json --timing-iters 40 \\
        -- --backbone small --synthetic-train 2000 --synthetic-val 200 --no-crop --lr 3e-4 --lr-backbone 3e-5 \\
        --lr-drop 12
    python -m linear_mha.tools.detr_compare --out runs/detr_enc --encoder-only --sizes 256,512,800 --dc5 --variants softmax focused-dwc3

A variant is a method of linear_mha's registry for the encoder's self-attention ("kernel", "focused", or your own
registered one), optionally with the local term ("-dwc3": a 3 x 3 depthwise convolution of the values over the
feature map) and method options (":focusing_factor=2"), or one of the named variants in VARIANTS. Every seed is a
separate training run of every variant, in <out>/<variant>/seed<seed>, which a later call resumes or reuses, so
runs can go in parallel processes (after the backbone is pretrained) and a last call with all of them makes the
tables. The backbone is pretrained once, on the first seed's training images, and shared by every run.

Outputs: <out>/results.json (every run, and the summary), <out>/ap_curves.png (mean val AP per epoch, one band of
+-1 std over seeds per variant), and with --records a list of {"variant", "seed", "epochs", "AP", "AP50", "AP75",
"APs", "APm", "APl", "sec_per_iter", "peak_mib", "machine", "AP_per_epoch"} records (APl is -1 where the set has no
large objects) with the machine, torch version and command. sec_per_iter comes from
--timing-iters iterations of each variant run alone after training (the training runs may share the machine);
--time-also adds variants that are timed but not trained, so that a cost can be held against a reference.
Peak memory is CUDA's max_memory_allocated, or on CPU the peak extra RSS of a 2-iteration run of the variant in a
fresh process (tools/measure.py).
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter
from linear_mha.integrations.detr.attention import apply_attention
from linear_mha.integrations.detr.backbone import backbone_stride
from linear_mha.integrations.detr.detr import build_model
from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.plots import read_log
from linear_mha.integrations.detr.pretrain import main as pretrain_main
from linear_mha.integrations.detr.train import main as train_main
from linear_mha.integrations.detr.transforms import feature_tokens, resized_hw
from linear_mha import TokenGrid

from . import measure
from .detr_records import plot_curves, summarize, write_records
from .detr_variants import DEFAULT_VARIANTS, VARIANTS, check_options_reached, check_variants, variant_args

def _cpu_peak_mib(builder, **kwargs):
    """Peak extra RSS (MiB) of one call of a case of this file, in a fresh process (tools/measure.py)."""
    return measure.peak_extra_mib({"builder": f"linear_mha.tools.detr_compare:{builder}", "kwargs": kwargs})


def training_case(argv):
    """Builder for the CPU memory probe: a short training run in a throwaway output directory."""
    out = tempfile.TemporaryDirectory(prefix="detr_mem_")

    def run():
        # run holds `out`, so the directory lives as long as it; each call (warm-up, measured) is a fresh run
        train_main(argv + ["--output-dir", out.name, "--overwrite"])
    return run


def _build_encoder(size, name, batch, dc5, device):
    """DETR-R50's encoder (6 layers, d = 256) for one variant at one image size, with its inputs."""
    stride = backbone_stride("resnet18", dc5)
    h, w = resized_hw((size, int(size * 1333 / 800)), size, 1333)
    tokens = feature_tokens((h, w), stride)
    args = parse_args(["--coco-path", "unused", "--num-classes", "91", "--backbone", "resnet18"] + variant_args(name))
    model, _, _ = build_model(args)
    apply_attention(model, args, max_tokens=tokens)
    hf, wf = -(-h // stride), -(-w // stride)
    src = torch.randn(batch, 256, hf, wf, device=device)
    mask = torch.zeros(batch, hf, wf, dtype=torch.bool, device=device)
    pos = torch.randn_like(src)
    encoder = model.transformer.encoder.to(device).eval()
    for module in encoder.modules():  # the grid the transformer's input would give the local term (dwc_kernel)
        tracker = module.__dict__.get("token_grid_source")
        if tracker is not None:
            tracker.grid = TokenGrid(hf, wf)
    seq, seq_mask, seq_pos = src.flatten(2).permute(2, 0, 1), mask.flatten(1), pos.flatten(2).permute(2, 0, 1)

    def encode():  # the encoder as DETR's transformer calls it: sequence-first, positions added to q and k
        return encoder(seq, src_key_padding_mask=seq_mask, pos=seq_pos)
    return (h, w), tokens, encode


def encoder_case(size, name, batch, dc5):
    """Builder for the CPU memory probe: one encoder forward."""
    _, _, encode = _build_encoder(size, name, batch, dc5, torch.device("cpu"))

    def run():
        with torch.no_grad():
            encode()
    return run


def _run_args(a, seed, device, num_workers, extra):
    """Options every training run of a variant shares: seed, device, the options after `--`, the variant's."""
    return (["--seed", str(seed), "--device", str(device), "--no-progress"]
            + (["--num-workers", str(num_workers)] if num_workers is not None else []) + a.train_args + extra)


def pretrained_backbone(a):
    """With --pretrain-iters, pretrains the backbone once, on the first seed's training data, for every run;
    returns the options that load it (none without)."""
    if not a.pretrain_iters:
        return []
    train_args = parse_args(a.train_args)
    path = pretrain_main(["--backbone", train_args.backbone, "--batch-size", str(train_args.batch_size),
                          "--iters", str(a.pretrain_iters), "--seed", str(a.seeds[0]),
                          "--output-dir", str(Path(a.out) / "backbone"), "--num-workers", str(a.num_workers),
                          "--resume", "--no-progress", "--"] + a.train_args)
    if path is None:
        _stopped("backbone pretraining")
    return ["--backbone-weights", str(path)]


def _stopped(what):
    """A signal stopped a run after checkpointing it: stop the comparison too; the same command resumes."""
    print(f"detr_compare: {what} was stopped by a signal and checkpointed; run the same command again to "
          "continue", file=sys.stderr)
    raise SystemExit(130)


def train_run(a, name, seed, device, weights):
    """Trains (or resumes, or reuses) one variant and seed; returns its row."""
    extra = variant_args(name) + weights
    run_dir = Path(a.out) / name / f"seed{seed}"
    argv = ["--epochs", str(a.epochs), "--output-dir", str(run_dir)] + _run_args(a, seed, device, a.num_workers, extra)
    if a.max_iters:
        argv += ["--max-iters", str(a.max_iters)]
    log_path = run_dir / "log.jsonl"
    if a.finished_only:  # report what is done; train nothing
        if not log_path.exists() or len(read_log(log_path)) < a.epochs:
            print(f"detr_compare: {run_dir} has not finished its {a.epochs} epochs; left out (--finished-only)",
                  file=sys.stderr)
            return None
    else:
        if (run_dir / "checkpoint.pth").exists():
            argv += ["--resume", str(run_dir / "checkpoint.pth")]
        measure.reset_cuda_peak(device)
        run = train_main(argv)
        if run["stopped_at"]:
            _stopped(f"training of {name!r} (seed {seed})")
        check_options_reached(name, run["attention"])
    log = read_log(log_path)[:a.epochs]
    peak_file = run_dir / "peak_memory.json"  # measured once per run directory, kept across resumes
    if peak_file.exists():
        peak = json.loads(peak_file.read_text())["peak_MiB"]
    else:
        peak = measure.cuda_peak_mib(device) if device.type == "cuda" else _cpu_peak_mib(
            "training_case", argv=["--epochs", "1", "--max-iters", "2"] + _run_args(a, seed, "cpu", 0, extra))
        peak_file.write_text(json.dumps({"peak_MiB": peak}))
    last = log[-1]
    return {"variant": name, "seed": seed, "AP": last["test_AP"], "AP50": last["test_AP50"],
            "AP75": last["test_AP75"], **{k: last.get(f"test_{k}") for k in ("APs", "APm", "APl")},
            "train_s_per_epoch": sum(e["epoch_train_seconds"] for e in log) / len(log),
            "peak_mib": peak, "epochs": len(log), "log": [e["test_AP"] for e in log]}


def _timed_iterations(a, device, extra):
    """Seconds per training iteration of a short run on its own: one epoch of --timing-iters iterations."""
    with tempfile.TemporaryDirectory(prefix="detr_time_") as tmp:
        run = train_main(["--epochs", "1", "--max-iters", str(a.timing_iters), "--output-dir", tmp]
                         + _run_args(a, a.seeds[0], device, 0, extra))
    if run["stopped_at"]:
        _stopped("the timing run")
    return run["log"][-1]["epoch_train_seconds"] / a.timing_iters


def training_table(a, device):
    """Every variant and seed trained (resumed, or reused when finished), and the clean time per iteration of each
    variant trained and each of --time-also: (rows, {variant: seconds per iteration})."""
    weights = pretrained_backbone(a)
    rows = [train_run(a, name, seed, device, weights) for seed in a.seeds for name in a.variants]
    rows = [row for row in rows if row is not None]
    timed = {}
    if a.timing_iters:
        names = list(dict.fromkeys([*(row["variant"] for row in rows), *a.time_also]))
        runs = {name: [] for name in names}
        for _ in range(a.timing_repeats):  # rounds over every variant: a slow spell of the machine hits them all
            for name in names:
                runs[name].append(_timed_iterations(a, device, variant_args(name) + weights))
        timed = {name: (statistics.median(times), times) for name, times in runs.items()}
        for row in rows:
            row["sec_per_iter"] = timed[row["variant"]][0]
    return rows, timed


def timing_table(timed, reference):
    """Seconds per iteration of every variant timed (the median of its --timing-repeats rounds, each round kept),
    and its ratio to the reference variant's (the first of --time-also, e.g. the elu kernel a Linear-DETR's cost is
    held against)."""
    return [{"variant": name, "sec_per_iter": sec, "sec_per_iter_rounds": rounds,
             **({f"x_{reference}": sec / timed[reference][0]} if reference else {})}
            for name, (sec, rounds) in timed.items()]


@torch.no_grad()
def encoder_table(a, device):
    """Encoder forward (DETR-R50 width: 6 layers, d = 256) on feature maps of real image sizes."""
    rows = []
    for size in a.sizes:
        for name in a.variants:
            (h, w), tokens, encode = _build_encoder(size, name, a.batch, a.dc5, device)
            measure.reset_cuda_peak(device)
            ms = measure.round_robin({name: encode}, repeats=a.repeats, warmup=1, device=device)[name]["median_ms"]
            peak = measure.cuda_peak_mib(device) if device.type == "cuda" else _cpu_peak_mib(
                "encoder_case", size=size, name=name, batch=a.batch, dc5=a.dc5)
            rows.append({"image": f"{h}x{w}", "tokens": tokens, "variant": name, "ms_median": ms, "peak_MiB": peak})
    return rows


def _print(rows, keys):
    print(" | ".join(keys))
    print(" | ".join("---" for _ in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys))


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.detr_compare", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", default="runs/detr_compare", help="run directories, results.json and ap_curves.png")
    p.add_argument("--epochs", type=int, help="training epochs of every run (default: the trainer's preset)")
    p.add_argument("--max-iters", type=int, default=0, help="cap on iterations per epoch (0 = whole epoch)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                   help="methods of the registry, '-dwcK' for the local term, ':opt=value,...' for options, or "
                        f"the named {list(VARIANTS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[42], help="one training run per variant and seed")
    p.add_argument("--timing-iters", type=int, default=0,
                   help="after training, time this many iterations of each variant alone (clean s/iter)")
    p.add_argument("--timing-repeats", type=int, default=1,
                   help="rounds of --timing-iters over every timed variant, in turn; the table takes each one's "
                        "median (on a shared or virtual machine single timings move by a third)")
    p.add_argument("--time-also", nargs="+", default=[], metavar="VARIANT",
                   help="variants timed with --timing-iters but not trained, the first the reference of the timing "
                        "table's ratios (e.g. kernel: the elu kernel a Linear-DETR's cost is held against)")
    p.add_argument("--pretrain-iters", type=int, default=0,
                   help="pretrain the (tiny/small) backbone this long first, shared by every run "
                        "(integrations/detr/pretrain.py); from scratch DETR stays at AP ~ 0 on CPU budgets")
    p.add_argument("--records", help="also write the runs as a list of records (JSON) here, with machine and command")
    p.add_argument("--records-merge", action="store_true",
                   help="keep the --records file's other runs (e.g. another --epochs budget, from this machine) "
                        "and replace only this call's")
    p.add_argument("--finished-only", action="store_true",
                   help="train nothing: report the runs in --out that have finished their --epochs (the others are "
                        "named and left out)")
    p.add_argument("--num-workers", type=int, help="data-loading processes per run (default: the trainer's preset)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--encoder", action="store_true", help="also time DETR-R50's encoder at --sizes (slow: minutes "
                                                          "per size at 800 px)")
    p.add_argument("--encoder-only", action="store_true", help="only the encoder table, no training")
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[256, 480, 800])
    p.add_argument("--dc5", action="store_true", help="stride-16 feature maps (800x1333 -> 4200 tokens)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: options passed to every training run, e.g. -- --synthetic-train 4000 --no-crop")
    a = p.parse_args(argv)
    a.train_args = [t for t in a.train_args if t != "--"]
    if a.epochs is None:
        a.epochs = parse_args(a.train_args).epochs
    check_variants(p, a.variants + a.time_also)
    if a.time_also and not a.timing_iters:
        p.error("--time-also times variants: give --timing-iters N as well")
    if a.timing_repeats < 1:
        p.error(f"--timing-repeats must be >= 1, got {a.timing_repeats}")
    return a


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": str(device), "torch": torch.__version__}
    if not a.encoder_only:
        rows, timed = training_table(a, device)
        result["training"], result["summary"] = rows, summarize(rows)
        _print(result["summary"], ["variant", "seeds", "AP", "AP_std", "AP50", "AP50_std", "AP75", "AP75_std",
                                   "APs", "APm", "AP_vs_softmax", "AP_vs_best_softmax", "sec_per_iter", "peak_mib"])
        reference = a.time_also[0] if a.time_also else None
        result["timing"] = timing_table(timed, reference)
        if timed:
            _print(result["timing"], ["variant", "sec_per_iter"] + ([f"x_{reference}"] if reference else []))
        plot_curves(rows, out / "ap_curves.png")
        if a.records:
            write_records(a, rows, a.records, argv, result["timing"])
    if a.encoder or a.encoder_only:
        result["encoder"] = encoder_table(a, device)
        _print(result["encoder"], ["image", "tokens", "variant", "ms_median", "peak_MiB"])
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
