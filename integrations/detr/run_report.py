"""What the DETR trainer prints before and after a run: the banner (data, model, attention, schedule, machine,
where the files go) and the end summary (COCOeval table, time per iteration, peak memory, the files)."""
from pathlib import Path

from ..console import banner, duration, peak_memory_mib
from .backbone_weights import describe as describe_backbone_weights
from .coco_eval import format_stats
from .config import RECOMMENDED_ATTENTION

_PRESETS = {"coco": "the official DETR-R50 recipe (ResNet-50, 300 epochs, batch 2), as data was given",
            "synthetic": "a small DETR that learns in minutes on CPU, as no data was given"}


def _data_line(args, datasets):
    sizes = f"{len(datasets['train']):,} training / {len(datasets['val']):,} validation images"
    if args.coco_path:
        return f"{sizes} (COCO at {args.coco_path})"
    if args.train_ann and Path(args.train_ann).parent.name == "annotations" and \
            Path(args.train_ann).parent.parent.name == "synthetic-coco":
        return f"{sizes} (synthetic shapes, generated in {Path(args.train_ann).parent.parent})"
    return f"{sizes} ({args.train_ann}, {args.val_ann})"


def _attention_line(args, attention_report):
    if all(entry["patch_report"] is None for entry in attention_report):  # nothing patched
        return "softmax everywhere (nn.MultiheadAttention, as in DETR)"
    parts = []
    for entry in attention_report:
        shown = ", ".join(f"{k}={v}" for k, v in entry["options"].items())
        parts.append(f"{entry['target']}: {entry['mode']}" + (f" ({shown})" if shown else ""))
    untouched = "" if args.attention_on == "all" else "; the rest softmax"
    return "; ".join(parts) + untouched + _attention_origin(args)


def _attention_origin(args):
    """Whether the attention is the recommended one, and whether the run chose it or took the default."""
    recommended = args.attention_on == "encoder" and all(getattr(args, k) == v
                                                         for k, v in RECOMMENDED_ATTENTION.items())
    if args.attention_is_default:
        what = "The recommended Linear-DETR" if recommended else "The recommended method, with the options given"
        return f". {what}, by default (--attention softmax: DETR as released)"
    return ". The recommended Linear-DETR" if recommended else ""


def start_banner(args, datasets, attention_report, device, threads, world, iterations_per_epoch, out_dir, start_epoch):
    rows = {
        "data": _data_line(args, datasets),
        "preset": f"{args.preset}: {_PRESETS[args.preset]}; options given override it",
        "model": f"DETR, backbone {args.backbone} ({describe_backbone_weights(args)}), d={args.hidden_dim}, "
                 f"{args.enc_layers} encoder + {args.dec_layers} decoder layers, {args.nheads} heads, "
                 f"{args.num_queries} queries",
        "attention": _attention_line(args, attention_report),
    }
    if args.eval:
        rows["run"] = f"evaluation of {args.resume or args.pretrained}"
    else:
        rows["schedule"] = (f"{args.epochs} epochs x {iterations_per_epoch} iterations of batch {args.batch_size}"
                            f"{f' x {world} processes' if world > 1 else ''}; AdamW lr {args.lr:g} (backbone "
                            f"{args.lr_backbone:g}), x0.1 after epoch {args.lr_drop}")
        if start_epoch:
            rows["resume"] = f"{args.resume}: continues at epoch {start_epoch + 1}/{args.epochs}"
        if args.calibrate_steps:
            rows["calibrate"] = f"{args.calibrate_steps} attention-transfer steps from {args.pretrained} first"
        if args.distill:
            rows["loss"] = f"distillation from {args.pretrained}'s predictions (softmax attention), not the labels"
    rows["device"] = f"{device}, threads {threads}"
    rows["output"] = f"{out_dir}/ (checkpoint.pth, log.jsonl, curves.png{', eval.json' if args.eval else ''})"
    banner("DETR / Linear-DETR" + (" evaluation" if args.eval else " training"), rows)


def end_summary(args, coco, entries, device, out_dir, stopped_at):
    """Printed once at the end (main process): the last evaluation's 12 numbers, the pace, the memory, the files."""
    if coco is None:
        return
    what = "evaluation" if args.eval else f"after epoch {entries[-1]['epoch'] + 1}/{args.epochs}" if entries else ""
    print(f"\nCOCO bbox AP on the validation set, {what}:")
    print(format_stats(coco))
    mib, measured = peak_memory_mib(device)
    rows = {}
    timed = [e for e in entries if e.get("train_iterations")]
    if timed:
        iterations = sum(e["train_iterations"] for e in timed)
        seconds = sum(e["epoch_train_seconds"] for e in timed)
        rows["time"] = (f"{seconds / iterations:.3f} s per training iteration ({iterations} iterations in "
                        f"{duration(seconds)}, evaluation not included)")
    rows["memory"] = f"{mib:,.0f} MiB ({measured})"
    files = ["checkpoint.pth", "log.jsonl", "curves.png", "eval.json", "calibration.json"]
    rows["files"] = ", ".join(str(Path(out_dir) / f) for f in files if (Path(out_dir) / f).exists())
    if stopped_at:
        rows["resume"] = f"--resume {Path(out_dir) / 'checkpoint.pth'}"
    banner("", rows)
