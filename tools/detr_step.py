"""Time and peak memory of DETR training steps, softmax against linear encoders, through the trainer's own engine.

    python -m linear_mha.tools.detr_step --device cuda --variants softmax efficient taylor-dwc3 --batch 2 --dc5 \\
        --json runs/detr_step/cuda.json

Each variant is DETR-R50 (DC5 with --dc5) as `integrations.detr.train` builds it, with the variant's attention in
the encoder (names as in tools.detr_compare: a registry method, `-dwc<K>` for the local term, `:option=value`).
Weights are random (nothing is downloaded): a step costs the same whatever the weights; the backbone's frozen
batch norms are fitted to the batch so that activations have a trained network's scale (finite in float16). One batch of --batch
images of --size x round(--size * 1333 / 800) pixels (800 x 1333: the largest image DETR's COCO transforms give) with
--objects random boxes each is fed to `engine.train_one_epoch` --steps times: forward (fp16 autocast on CUDA unless
--no-amp), Hungarian matching, losses, backward, gradient clipping, AdamW. Timed after --warmup steps with CUDA
events on CUDA (the host clock on CPU); peak memory is torch.cuda.max_memory_allocated over the timed steps (CUDA
only). Variants run one after another in this process; a variant that runs out of memory is a row saying so.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter
from linear_mha.integrations.detr.attention import apply_attention
from linear_mha.integrations.detr.backbone import backbone_stride
from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.detr import build_model
from linear_mha.integrations.detr.engine import train_one_epoch
from linear_mha.integrations.detr.misc import nested_tensor_from_tensor_list
from linear_mha.integrations.detr.train import param_groups
from linear_mha.integrations.detr.transforms import feature_tokens

from . import measure
from .detr_variants import check_variants, variant_args


def make_batch(batch, hw, objects, num_classes, seed, device):
    """(samples, targets) as the trainer's loader gives them: normalised images and cxcywh boxes in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, *hw, generator=g) for _ in range(batch)]
    targets = []
    for _ in range(batch):
        centre = 0.2 + 0.6 * torch.rand(objects, 2, generator=g)
        size = 0.05 + 0.3 * torch.rand(objects, 2, generator=g)
        targets.append({"labels": torch.randint(1, num_classes, (objects,), generator=g),
                        "boxes": torch.cat([centre, size], dim=1)})
    return nested_tensor_from_tensor_list(images).to(device), targets


@torch.no_grad()
def standardise_backbone(model, samples):
    """Give the randomly initialised ResNet the activation scale of a trained one: each frozen batch norm takes
    the mean and variance of its input on this batch, layer by layer in forward order. Untrained, a ResNet-50's
    activations grow through its residual stages until float16 autocast turns them to inf and the boxes to NaN."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    def fit(module, inputs):
        x = inputs[0].float()
        module.running_mean.copy_(x.mean(dim=(0, 2, 3)))
        module.running_var.copy_(x.var(dim=(0, 2, 3)))
    hooks = [m.register_forward_pre_hook(fit) for m in model.modules() if isinstance(m, FrozenBatchNorm2d)]
    try:
        model.backbone(samples)
    finally:
        for hook in hooks:
            hook.remove()


def build(name, a, device, max_tokens):
    argv = ["--coco-path", "unused", "--num-classes", "91", "--backbone", a.backbone, "--device", str(device)]
    args = parse_args(argv + (["--dilation"] if a.dc5 else []) + (["--no-amp"] if not a.amp else [])
                      + variant_args(name))
    torch.manual_seed(a.seed)
    model, criterion, _ = build_model(args)
    apply_attention(model, args, max_tokens=max_tokens)
    model.to(device)
    criterion.to(device)
    optimizer = torch.optim.AdamW(param_groups(model, args), lr=args.lr, weight_decay=args.weight_decay)
    return model, criterion, optimizer, args


def time_variant(name, a, device, batch, tokens):
    model, criterion, optimizer, args = build(name, a, device, tokens)
    standardise_backbone(model, batch[0])
    amp = args.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if amp else None

    def steps(count):
        train_one_epoch(model, criterion, [batch] * count, optimizer, device, 0, args.clip_max_norm, scaler, amp,
                        progress=False)

    steps(a.warmup)
    measure.reset_cuda_peak(device)
    # one step per timing (CUDA events on CUDA): the median over steps is robust to a slow one
    timed = measure.round_robin({name: lambda: steps(1)}, repeats=a.steps, warmup=0, device=device)[name]
    if "error" in timed:  # e.g. out of memory at this batch: a row saying so
        return {"error": timed["error"]}
    return {"ms_median": timed["median_ms"], "ms_min": timed["min_ms"], "steps": timed["runs"],
            "peak_MiB": measure.cuda_peak_mib(device), "amp": amp}


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.detr_step", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--variants", nargs="+", default=["softmax", "efficient", "taylor-dwc3"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backbone", default="resnet50")
    p.add_argument("--dc5", action="store_true", help="dilate the last stage (stride 16: 4x the encoder's tokens)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--size", type=int, default=800, help="image height; width is round(size * 1333 / 800)")
    p.add_argument("--objects", type=int, default=8, help="boxes per image")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-amp", dest="amp", action="store_false", help="float32 on CUDA (default: the trainer's fp16 "
                                                                       "autocast)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    for flag in ("batch", "size", "objects", "steps"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False; use --device cpu")
    check_variants(p, a.variants)
    return a


def main(argv=None):
    a = parse(argv)
    device = torch.device(a.device)
    hw = (a.size, round(a.size * 1333 / 800))
    stride = backbone_stride(a.backbone, a.dc5)
    tokens = feature_tokens(hw, stride)
    batch = make_batch(a.batch, hw, a.objects, 91, a.seed, device)
    meta = {"torch": torch.__version__, "device": str(device), "backbone": a.backbone, "dc5": a.dc5,
            "batch": a.batch, "image": f"{hw[0]}x{hw[1]}", "encoder_tokens": tokens,
            "command": "python -m linear_mha.tools.detr_step " + " ".join(sys.argv[1:] if argv is None else argv)}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    else:
        meta["cpu"], meta["threads"] = measure.cpu_name(), torch.get_num_threads()
    print(f"DETR {a.backbone}{' DC5' if a.dc5 else ''} training step, batch {a.batch} of {hw[0]}x{hw[1]} "
          f"({tokens} encoder tokens per image) on {meta.get('gpu', meta.get('cpu'))}, torch {torch.__version__}",
          flush=True)
    rows = []
    for name in a.variants:
        try:
            row = dict(variant=name, **time_variant(name, a, device, batch, tokens))
        except torch.cuda.OutOfMemoryError as exc:
            row = dict(variant=name, error=f"out of memory: {str(exc).splitlines()[0][:200]}")
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {name:<18} " + (f"{row['ms_median']:9.1f} ms/step  peak {row['peak_MiB']:9.0f} MiB"
                                    if "ms_median" in row else row["error"]), flush=True)
    base = next((r for r in rows if r["variant"] == "softmax" and "ms_median" in r), None)
    if base is not None:
        for r in rows:
            if "ms_median" in r:
                r["speedup_vs_softmax"] = base["ms_median"] / r["ms_median"]
                r["memory_vs_softmax"] = r["peak_MiB"] / base["peak_MiB"] if base["peak_MiB"] > 0 else None
    result = {"meta": meta, "rows": rows}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.json}")
    return result


if __name__ == "__main__":
    main()
