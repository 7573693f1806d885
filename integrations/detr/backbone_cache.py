"""--pretrain-backbone N: a small backbone (`tiny`, `small`) pretrained on the run's own training images before DETR
trains (integrations.detr.pretrain, N iterations), cached, so another run on the same data starts at once.

DETR learns nothing from a backbone trained from scratch on small data (every query predicts the mean box), and
the small backbones have no released weights; this is what makes the trainer's default run learn in minutes. The
cache lives under ``$LINEAR_MHA_CACHE`` (default ``~/.cache/linear_mha``) in ``detr-backbones/``, one folder per
backbone, iteration count, seed and training set (the annotation file's contents decide, not its path); weights are
loaded with ``weights_only=True``, like every checkpoint here.
"""
import hashlib
import json
from pathlib import Path

import torch

from linear_mha.functional.native_build import configured_cache_dir

from .. import distributed as dist_utils
from .backbone import SMALL_BODIES


def cache_root() -> Path:
    return configured_cache_dir() / "detr-backbones"


def _digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_folder(args) -> Path:
    key = {"backbone": args.backbone, "iters": args.pretrain_backbone, "seed": args.seed,
           "train": _digest(args.train_ann), "val": _digest(args.val_ann),
           "transforms": same_data_args(args)[8:]}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"{args.backbone}-{args.pretrain_backbone}it-{name}"


def same_data_args(args) -> list:
    """The trainer options that make the pretrainer read this run's images exactly as the run does: its files, and
    the transforms' settings (given explicitly: with files given, the preset would be COCO's)."""
    ints = lambda values: ",".join(map(str, values))  # noqa: E731
    return ["--train-images", args.train_images, "--train-ann", args.train_ann, "--val-images", args.val_images,
            "--val-ann", args.val_ann, "--scales", ints(args.scales), "--max-size", str(args.max_size),
            "--val-size", str(args.val_size), "--crop-sizes", ints(args.crop_sizes), "--crop-min", str(args.crop_min),
            "--crop-max", str(args.crop_max), "--crop" if args.crop else "--no-crop"]


def wants_pretraining(args) -> bool:
    """Whether this run pretrains (or reuses) a backbone: asked for, and nothing else gives the backbone weights."""
    if not args.pretrain_backbone or args.backbone_weights or args.pretrained or args.resume or args.eval:
        return False
    if args.backbone not in SMALL_BODIES:
        raise ValueError(f"--pretrain-backbone pretrains the small backbones ({', '.join(SMALL_BODIES)}); a ResNet "
                         f"starts from torchvision's ImageNet weights by default, or from a file with --backbone-weights "
                         f"PATH: leave --pretrain-backbone out")
    return True


def pretrained_backbone(args) -> Path:
    """The cached backbone.pth for this run's backbone and data, pretrained first if there is none (on the main
    process; the others wait). Data paths must be resolved already (prepare_data_args)."""
    from .pretrain import main as pretrain_main  # the pretrainer imports the trainer's helpers
    folder = cache_folder(args)
    path = folder / "backbone.pth"
    if dist_utils.is_main_process() and not path.exists():
        print(f"pretraining the {args.backbone} backbone for {args.pretrain_backbone} iterations on the training "
              f"images (once; cached in {folder})", flush=True)
        pretrain_main(["--backbone", args.backbone, "--iters", str(args.pretrain_backbone), "--seed", str(args.seed),
                       "--output-dir", str(folder), "--num-workers", str(args.num_workers), "--resume"]
                      + (["--device", args.device] if args.device else []) + ([] if args.progress else ["--no-progress"])
                      + ["--"] + same_data_args(args))
    if dist_utils.is_dist_avail_and_initialized():
        torch.distributed.barrier()
    if not path.exists():
        raise RuntimeError(f"backbone pretraining stopped before writing {path}; run the same command again to "
                           "continue it")
    return path
