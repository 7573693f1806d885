"""Train or evaluate DETR / Linear-DETR.

    python -m linear_mha.integrations.detr.train                                   # synthetic set, tiny model, CPU minutes
    python -m linear_mha.integrations.detr.train --coco-path /data/coco            # DETR-R50 recipe, linear encoder
    python -m linear_mha.integrations.detr.train --coco-path /data/coco --attention softmax   # DETR as released
    torchrun --nproc_per_node=2 -m linear_mha.integrations.detr.train --coco-path /data/coco
    python -m linear_mha.integrations.detr.train --resume runs/detr/checkpoint.pth   # continue exactly
    python -m linear_mha.integrations.detr.train --eval --pretrained detr-r50.pth --coco-path /data/coco --attention softmax

A ResNet backbone starts from torchvision's ImageNet weights, downloaded once (offline: --backbone-weights PATH).

A checkpoint is written after every epoch, and when a signal (Ctrl-C, SIGTERM; torchrun passes the one it gets on
to its workers) stops the run: every process finishes its step, or drops the evaluation under way, the
checkpoint records how far into the epoch it got, and --resume continues with the next batch or the evaluation
(bit-for-bit with --num-workers 0; with workers the remaining batches see other augmentation draws). That takes
one step and one checkpoint write; torchrun kills workers still running after its --shutdown-timeout (30 s by
default), so raise it where writing a checkpoint takes longer.
"""
import itertools
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

from linear_mha import calibrate, method_class
from linear_mha.progress import progress_bar

from ..console import choose_threads, duration, eta, refuse_overwrite
from ..stop import StopRequest
from .. import distributed as dist_utils
from .attention import apply_attention
from .backbone import backbone_stride
from .backbone_cache import pretrained_backbone, wants_pretraining
from .backbone_weights import resolve_backbone_weights
from ..checkpoint_io import check_same_args, save_atomic
from .checkpoint import check_pretrained_attention, load_checkpoint, load_pretrained, rng_state, set_rng_state
from .distill import DistillationCriterion, build_teacher
from .config import parse_args
from .datasets import build_dataset
from .detr import build_model
from .engine import Meter, evaluate, train_one_epoch
from .misc import collate_fn
from .plots import append_log, plot_curves, read_log, truncate_log
from .run_report import end_summary, start_banner
from .run_setup import prepare_data_args, seed_everything
from .transforms import feature_tokens, max_padded_hw


# Options that change the model a checkpoint holds: --resume refuses a run that changes any of them.
MODEL_ARGS = ("backbone", "dilation", "position_embedding", "enc_layers", "dec_layers", "dim_feedforward",
              "hidden_dim", "nheads", "num_queries", "pre_norm", "aux_loss", "num_classes", "attention", "attention_on",
              "proj_k", "param_sharing", "feature_map", "attention_option", "dwc_kernel", "output_gate")


def check_categories(datasets, num_classes):
    """Every annotation's category must be < --num-classes (the classifier's size): else the matcher fails deep
    inside with an index error naming neither. (That it is listed in its file is load_coco's check.)"""
    for split, dataset in datasets.items():
        used = {a["category_id"] for a in dataset.coco.dataset.get("annotations", [])}
        if used and max(used) >= num_classes:
            raise ValueError(f"the {split} annotations use category id {max(used)}, but --num-classes is "
                             f"{num_classes} (ids must be < --num-classes); pass --num-classes {max(used) + 1} or more")


def max_tokens_for(args, datasets):
    """Largest encoder sequence any padded batch of these datasets can produce (sets Linformer's seq_len)."""
    stride = backbone_stride(args.backbone, args.dilation)
    return max(feature_tokens(max_padded_hw(ds.image_sizes(), args, split), stride) for split, ds in datasets.items())


def param_groups(model, args):
    backbone = [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]
    groups = [{"params": rest, "lr": args.lr}]
    if backbone:
        groups.append({"params": backbone, "lr": args.lr_backbone})
    return groups


class _SkipFirst(torch.utils.data.Sampler):
    """The indices of ``sampler`` after its first ``count``: the rest of an interrupted epoch, in the same order."""

    def __init__(self, sampler, count):
        self.sampler, self.count = sampler, count

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.count)


def train_loader(args, dataset, sampler, epoch, rank, skip_batches=0):
    """The epoch's training batches, from batch ``skip_batches`` on (whole batches: drop_last). Its own generator
    seeds the workers, so making the loader draws nothing from the global RNG and a resumed epoch continues the
    same random stream as an uninterrupted one."""
    generator = torch.Generator().manual_seed((args.seed + rank) * 100_003 + epoch)
    if skip_batches:
        sampler = _SkipFirst(sampler, skip_batches * args.batch_size)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, generator=generator,
                      collate_fn=collate_fn, num_workers=args.num_workers, persistent_workers=False)


def check_conversion_args(args):
    """--calibrate-steps and --distill convert a --pretrained softmax DETR to a linear --attention: refused without
    either, before any data or model is built. A resumed run's checkpoint is calibrated already; its distillation
    still needs the teacher."""
    for flag, wanted in (("--calibrate-steps", args.calibrate_steps and not args.resume), ("--distill", args.distill)):
        if not wanted:
            continue
        if not args.pretrained:
            raise ValueError(f"{flag} fits linear attention to a trained softmax DETR: pass its checkpoint with "
                             "--pretrained")
        if args.attention is None or method_class(args.attention).exact:
            raise ValueError(f"{flag} needs a linear --attention to fit to the --pretrained softmax DETR, e.g. "
                             "--attention hedgehog; with softmax attention the model would be its own teacher")


def calibrate_attention(model, args, dataset, device, out_dir):
    """--calibrate-steps: fit the linear attention of a model patched from a --pretrained softmax DETR to the softmax
    attention it replaced, on training images (linear_mha.calibrate, attention transfer), before any training.
    Every process calibrates on the same batches; DDP then starts every process from the first one's weights."""
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, collate_fn=collate_fn,
                        num_workers=args.num_workers, generator=torch.Generator().manual_seed(args.seed))
    report = calibrate(model, loader, steps=args.calibrate_steps, lr=args.calibrate_lr, seed=args.seed,
                       forward=lambda m, batch: m(batch[0].to(device)), progress=args.progress)
    if dist_utils.is_main_process():
        print(report.table())
        (out_dir / "calibration.json").write_text(json.dumps({"steps": report.steps, "layers": report.layers,
                                                              "losses": report.losses}, indent=1))
    return report


def make_loaders(args, datasets, rank, world):
    train_sampler = DistributedSampler(datasets["train"], num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=False)
    val_sampler = DistributedSampler(datasets["val"], num_replicas=world, rank=rank, shuffle=False)
    if len(datasets["train"]) // world < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} exceeds the {len(datasets['train']) // world} training "
                         "images per process; lower --batch-size")
    # Its own generator, as the training loader's: an evaluation, whole or dropped by a signal, draws nothing from
    # the global RNG, so a run that redoes it after a resume continues the same random stream.
    val = DataLoader(datasets["val"], batch_size=args.batch_size, sampler=val_sampler, drop_last=False,
                     collate_fn=collate_fn, num_workers=args.num_workers, persistent_workers=False,
                     generator=torch.Generator().manual_seed(args.seed + rank))
    return val, train_sampler


def main(argv=None):
    """Runs training (or --eval); returns {'log': [...epoch entries], 'coco': last stats, 'model': model,
    'stopped_at': (epoch, batches done) when a signal stopped it, else None, 'attention': apply_attention's report}."""
    args = parse_args(argv)
    check_conversion_args(args)
    check_pretrained_attention(args)
    if args.eval and not (args.resume or args.pretrained):
        raise ValueError("--eval evaluates trained weights: pass --resume (a checkpoint of this trainer) or --pretrained "
                         "(a DETR checkpoint); without one it would score a random model")
    threads = choose_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world, local = dist_utils.init_distributed_mode(device.type)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", local)
    amp = args.amp and device.type == "cuda"
    out_dir = Path(args.output_dir)
    if not (args.resume or args.eval or args.overwrite):
        refuse_overwrite(out_dir, ("checkpoint.pth", "log.jsonl"), resume_hint=f"--resume {out_dir / 'checkpoint.pth'}",
                         out_flag="--output-dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(args.seed + rank)

    resolve_backbone_weights(args)  # a ResNet's ImageNet weights, fetched now: offline, stop before anything is built
    prepare_data_args(args)
    if wants_pretraining(args):
        args.backbone_weights = str(pretrained_backbone(args))
        # Pretraining draws random numbers only when the cache is cold: seed again so that a first run and a second
        # (cache warm) build, shuffle and train the same model.
        seed_everything(args.seed + rank)
    datasets = {"train": build_dataset("train", args), "val": build_dataset("val", args)}
    if args.num_classes is None:
        args.num_classes = max(c["id"] for c in datasets["train"].coco.dataset["categories"]) + 1
    check_categories(datasets, args.num_classes)

    model, criterion, postprocessors = build_model(args)
    max_tokens = max_tokens_for(args, datasets)
    attention_report = apply_attention(model, args, max_tokens=max_tokens)
    if args.pretrained:
        load_pretrained(model, args.pretrained)
    model.to(device)
    criterion.to(device)
    if args.calibrate_steps and not args.resume:  # a resumed run's checkpoint holds the calibrated model already
        calibrate_attention(model, args, datasets["train"], device, out_dir)
    teacher, train_criterion = None, criterion
    if args.distill:
        teacher = build_teacher(args, device)
        train_criterion = DistillationCriterion(criterion.weight_dict)
    model_without_ddp = model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if device.type == "cuda" else None)
    n_parameters = sum(p.numel() for p in model_without_ddp.parameters() if p.requires_grad)

    optimizer = torch.optim.AdamW(param_groups(model_without_ddp, args), lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    val_loader, train_sampler = make_loaders(args, datasets, rank, world)
    coco_gt = datasets["val"].coco

    start_epoch, start_iter, meter_state, seconds_before, logged_entry = 0, 0, None, 0.0, None
    if args.resume:
        ckpt = load_checkpoint(args.resume)
        check_same_args(ckpt.get("args"), vars(args), MODEL_ARGS, "--resume", args.resume)
        model_without_ddp.load_state_dict(ckpt["model"], strict=True)
        if not args.eval:
            optimizer.load_state_dict(ckpt["optimizer"])
            lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
            if scaler is not None and ckpt.get("scaler"):
                scaler.load_state_dict(ckpt["scaler"])
            start_epoch = ckpt["epoch"] + 1
            logged_entry = ckpt.get("log_entry")
            if ckpt.get("iteration"):  # stopped inside that epoch: continue it with the next batch
                done = (ckpt.get("world"), ckpt.get("batch_size"))
                if done != (world, args.batch_size):
                    raise ValueError(f"--resume {args.resume} stopped inside epoch {ckpt['epoch']} after "
                                     f"{ckpt['iteration']} batches of --batch-size {done[1]} on {done[0]} process(es); "
                                     f"continue it with the same --batch-size and process count (now "
                                     f"{args.batch_size} on {world}), or the batches left would be the wrong ones")
                start_epoch, start_iter = ckpt["epoch"], ckpt["iteration"]
                meter_state, seconds_before = ckpt.get("train_meter"), ckpt.get("train_seconds", 0.0)
            states = ckpt.get("rng", [])
            if len(states) == world:
                set_rng_state(states[rank])
            else:
                print(f"warning: checkpoint has RNG states for {len(states)} processes, running {world}; "
                      "reseeding (the run continues but is not bit-identical)", file=sys.stderr)
                seed_everything(args.seed + rank + 1000 * start_epoch)

    log_path = out_dir / "log.jsonl"
    per_epoch = len(datasets["train"]) // world // args.batch_size
    per_epoch = min(per_epoch, args.max_iters) if args.max_iters else per_epoch
    if dist_utils.is_main_process():
        start_banner(args, datasets, attention_report, device, threads, world, per_epoch, out_dir, start_epoch)
        (out_dir / "args.json").write_text(json.dumps({**vars(args), "max_tokens": max_tokens,
                                                       "attention_report": str(attention_report)}, indent=1))
    if args.eval:
        test_stats, coco = evaluate(model, criterion, postprocessors, val_loader, coco_gt, device, amp, args.progress,
                                    verbose=args.verbose)
        if dist_utils.is_main_process():
            (out_dir / "eval.json").write_text(json.dumps({**{f"test_{k}": v for k, v in test_stats.items()},
                                                           **coco}, indent=1))
            end_summary(args, coco, [], device, out_dir, None)
        return {"log": [], "coco": coco, "model": model_without_ddp, "stopped_at": None, "attention": attention_report}

    if dist_utils.is_main_process():
        truncate_log(log_path, start_epoch)
        if logged_entry and all(e.get("epoch") != logged_entry["epoch"] for e in read_log(log_path)):
            append_log(log_path, logged_entry)  # stopped between the checkpoint and its log line: the record is kept
    run = _Run(model, model_without_ddp, criterion, postprocessors, val_loader, coco_gt, device, amp, args, out_dir,
               optimizer, lr_scheduler, scaler, n_parameters)
    entries, coco, stopped_at = [], None, None
    started = time.time()
    bar = progress_bar(total=args.epochs * per_epoch, initial=start_epoch * per_epoch + start_iter, unit="it",
                       disable=not (args.progress and dist_utils.is_main_process()), dynamic_ncols=True)
    with StopRequest() as stop, bar:
        for epoch in range(start_epoch, args.epochs):
            bar.set_description(f"epoch {epoch + 1}/{args.epochs}")
            train_sampler.set_epoch(epoch)
            t0 = time.time() - seconds_before
            meter, done, stopped = train_one_epoch(
                model, train_criterion, train_loader(args, datasets["train"], train_sampler, epoch, rank, start_iter),
                optimizer, device, epoch, args.clip_max_norm, scaler, amp, args.max_iters, args.progress,
                start_iter=start_iter, meter=Meter(meter_state), stop=stop, bar=bar, teacher=teacher)
            start_iter, meter_state, seconds_before = 0, None, 0.0
            trained = rng_state()  # the evaluation's transforms draw from it; a redone evaluation must start here
            finished = None if stopped else _finish_epoch(run, epoch, meter, time.time() - t0, done, stop)
            if finished is None:  # stopped during training or the evaluation: resume at the next batch or the eval
                _save(run, epoch, rng=trained, iteration=done, train_meter=meter.state(),
                      train_seconds=time.time() - t0, world=world, batch_size=args.batch_size)
                stopped_at = (epoch, done)
                if dist_utils.is_main_process():
                    print(f"stopped in epoch {epoch} after {done} batches{'' if stopped else ', before its evaluation'}"
                          f"; --resume {out_dir / 'checkpoint.pth'} continues from there", file=sys.stderr)
                break
            entry, coco = finished
            entries.append(entry)
            if dist_utils.is_main_process():
                elapsed = time.time() - started
                bar.write(f"epoch {epoch + 1}/{args.epochs}: train loss {entry.get('train_loss', float('nan')):.4f} "
                          f"val loss {entry.get('test_loss', float('nan')):.4f} AP {coco['AP']:.4f} AP50 "
                          f"{coco['AP50']:.4f} ({duration(entry['epoch_train_seconds'])} training; "
                          f"{duration(elapsed)} so far, ETA {eta(len(entries), args.epochs - start_epoch, elapsed)})")
                sys.stdout.flush()  # a log file being tailed gets the line now, not when a buffer fills
            if stop.agreed(device):  # asked after the evaluation's last batch: the epoch is saved, stop here
                stopped_at = (epoch + 1, 0)
                if dist_utils.is_main_process():
                    print(f"stopped after epoch {epoch}; --resume {out_dir / 'checkpoint.pth'} continues with the "
                          "next one", file=sys.stderr)
                break
    if dist_utils.is_main_process():
        end_summary(args, coco, entries, device, out_dir, stopped_at)
    return {"log": entries, "coco": coco, "model": model_without_ddp, "stopped_at": stopped_at,
            "attention": attention_report}


@dataclass
class _Run:
    """What evaluating and checkpointing an epoch needs."""
    model: torch.nn.Module  # DDP-wrapped when distributed
    model_without_ddp: torch.nn.Module
    criterion: torch.nn.Module
    postprocessors: dict
    val_loader: DataLoader
    coco_gt: object
    device: torch.device
    amp: bool
    args: object
    out_dir: Path
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    scaler: object
    n_parameters: int


def _save(run, epoch, rng=None, **extra):
    """The checkpoint --resume reads; every process contributes its RNG state (``rng``, else the current one), the
    main one writes."""
    states = dist_utils.all_gather_json(rng_state() if rng is None else rng)
    if dist_utils.is_main_process():
        save_atomic({"model": run.model_without_ddp.state_dict(), "optimizer": run.optimizer.state_dict(),
                     "lr_scheduler": run.lr_scheduler.state_dict(), "epoch": epoch, "args": vars(run.args),
                     "rng": states, "scaler": run.scaler.state_dict() if run.scaler else None, **extra},
                    run.out_dir / "checkpoint.pth")


def _finish_epoch(run, epoch, meter, train_time, iterations, stop):
    """Evaluate, checkpoint and log a finished epoch; returns its log entry and COCO stats, or None when a signal
    stopped the evaluation (nothing saved: the caller checkpoints the epoch as trained but not evaluated)."""
    evaluated = evaluate(run.model, run.criterion, run.postprocessors, run.val_loader, run.coco_gt, run.device,
                         run.amp, run.args.progress, stop=stop, verbose=run.args.verbose)
    if evaluated is None:
        return None
    test_stats, coco = evaluated
    train_stats = meter.averages()
    with warnings.catch_warnings():
        # A run resumed between an epoch's last step and its evaluation steps the schedule before this process
        # has stepped the optimizer, which the epoch's checkpointed optimizer already did.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        run.lr_scheduler.step()
    entry = {"epoch": epoch, **{f"train_{k}": v for k, v in train_stats.items()},
             **{f"test_{k}": v for k, v in test_stats.items()},
             **{f"test_{k}": v for k, v in coco.items()}, "n_parameters": run.n_parameters,
             "epoch_train_seconds": train_time, "train_iterations": iterations}
    # Checkpoint before the log line, with the line inside it: a run stopped in between finds its record in the
    # checkpoint on --resume, and the reverse order could log an epoch the checkpoint does not hold.
    _save(run, epoch, log_entry=entry)
    if dist_utils.is_main_process():
        log_path = run.out_dir / "log.jsonl"
        append_log(log_path, entry)
        plot_curves(log_path, run.out_dir / "curves.png")
    return entry, coco


if __name__ == "__main__":
    result = main()
    dist_utils.leave_process_group()  # after main's DDP model is gone, so that gloo's threads stop before exit
    if result.get("stopped_at"):
        sys.exit(130)  # stopped by a signal, checkpoint written: the conventional status of an interrupted program
