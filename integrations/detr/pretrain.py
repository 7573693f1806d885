"""Pretrain a small backbone (`tiny` or `small`) on a COCO-format detection set, as ImageNet does for DETR's ResNet.

    python -m linear_mha.integrations.detr.pretrain --iters 3000 --output-dir runs/backbone -- --synthetic-train 4000
    python -m linear_mha.integrations.detr.train --backbone small --backbone-weights runs/backbone/backbone.pth ...

DETR trained with a backbone learned from scratch stays stuck where every query predicts the mean box
and the class prior (a well-known failure on small data; the released models start from ImageNet). The
small backbones have no released weights, so this gives them a pretext task on the training images:
label each cell of the backbone's feature map with the category of the object covering its centre
(the smallest one where objects overlap; 0 = background; padding ignored) and train the backbone
with a 1x1 classifier on top. The features then say what is where; learning the set prediction is
left to DETR. Options after `--` choose the data, exactly as for `linear-mha-detr-train`.
Writes backbone.pth (the body's state_dict), log.jsonl (loss and cell accuracy) and checkpoint.pth
(every --save-every iterations, and when Ctrl-C or SIGTERM stops the run after a step; --resume continues
from it).
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from linear_mha.progress import progress_bar

from ..checkpoint_io import save_atomic
from ..console import HelpFormatter
from ..stop import StopRequest
from .backbone import SMALL_BODIES, TinyBody, backbone_stride
from .checkpoint import load_checkpoint, rng_state, set_rng_state
from .config import parse_args
from .datasets import build_dataset
from .misc import collate_fn
from .plots import read_log
from .run_setup import prepare_data_args, seed_everything

IGNORE = -100


def cell_labels(targets, padding_mask, stride):
    """(B, h, w) long: category of the object covering each cell centre, 0 for none, IGNORE on padding.

    targets: DETR targets (boxes normalised cxcywh of the unpadded image of size target["size"]);
    padding_mask: (B, h, w) bool at feature resolution, True = padding. A cell containing an object's
    centre gets it even if the object covers no cell centre (objects smaller than the stride).
    """
    b, h, w = padding_mask.shape
    labels = torch.zeros(b, h, w, dtype=torch.long)
    centres_y = (torch.arange(h, dtype=torch.float32) + 0.5) * stride
    centres_x = (torch.arange(w, dtype=torch.float32) + 0.5) * stride
    for i, t in enumerate(targets):
        img_h, img_w = (float(v) for v in t["size"])
        boxes = t["boxes"].float() * torch.tensor([img_w, img_h, img_w, img_h])
        areas = boxes[:, 2] * boxes[:, 3]
        for j in torch.argsort(areas, descending=True).tolist():  # smaller objects drawn last win
            cx, cy, bw, bh = boxes[j].tolist()
            inside_y = (centres_y >= cy - bh / 2) & (centres_y < cy + bh / 2)
            inside_x = (centres_x >= cx - bw / 2) & (centres_x < cx + bw / 2)
            label = int(t["labels"][j])
            labels[i][inside_y[:, None] & inside_x[None, :]] = label
            labels[i, min(int(cy // stride), h - 1), min(int(cx // stride), w - 1)] = label
    return labels.masked_fill(padding_mask.cpu(), IGNORE)


class CellClassifier(nn.Module):
    def __init__(self, backbone, num_classes):
        super().__init__()
        self.body = TinyBody(**SMALL_BODIES[backbone])
        self.head = nn.Conv2d(self.body.num_channels, num_classes, 1)

    def forward(self, images):
        return self.head(self.body(images)["0"])


def _batch(samples, targets, stride, device):
    images, mask = samples.decompose()
    feat_hw = (-(-images.shape[-2] // stride), -(-images.shape[-1] // stride))
    small_mask = F.interpolate(mask[None].float(), size=feat_hw).to(torch.bool)[0]
    return images.to(device), cell_labels(targets, small_mask, stride).to(device)


def _hits(pred, labels):
    """(correct cells, cells, correct object cells, object cells), padding excluded."""
    valid = labels != IGNORE
    objects = valid & (labels > 0)
    return (int((pred[valid] == labels[valid]).sum()), int(valid.sum()),
            int((pred[objects] == labels[objects]).sum()), int(objects.sum()))


def _rates(hits, empty=float("nan")):
    """(cell accuracy, object-cell accuracy) from summed _hits; ``empty`` where there was nothing to count."""
    return tuple(right / total if total else empty for right, total in (hits[:2], hits[2:]))


def get_args_parser():
    p = argparse.ArgumentParser("python -m linear_mha.integrations.detr.pretrain", description=__doc__, formatter_class=HelpFormatter)
    a = p.add_argument
    a("--backbone", default="small", choices=tuple(SMALL_BODIES))
    a("--iters", type=int, default=3000)
    a("--lr", type=float, default=1e-3)
    a("--batch-size", type=int, default=16)
    a("--output-dir", default="runs/backbone")
    a("--save-every", type=int, default=500, help="iterations between checkpoints")
    a("--resume", action="store_true", help="continue from output-dir/checkpoint.pth")
    a("--seed", type=int, default=42)
    a("--num-workers", type=int, default=2)
    a("--device", default=None)
    a("--no-progress", dest="progress", action="store_false")
    a("data_args", nargs=argparse.REMAINDER, help="after --: data options of linear-mha-detr-train")
    return p


def main(argv=None):
    """Returns the path of the written backbone.pth."""
    args = get_args_parser().parse_args(argv)
    data_args = [t for t in args.data_args if t != "--"]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dargs = parse_args(data_args + ["--output-dir", str(out), "--backbone", args.backbone, "--seed", str(args.seed)])
    prepare_data_args(dargs)
    seed_everything(args.seed)
    datasets = {split: build_dataset(split, dargs) for split in ("train", "val")}
    num_classes = max(c["id"] for c in datasets["train"].coco.dataset["categories"]) + 1
    stride = backbone_stride(args.backbone, False)
    model = CellClassifier(args.backbone, num_classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.iters, pct_start=0.1)
    start, ckpt_path, log_path = 0, out / "checkpoint.pth", out / "log.jsonl"
    if args.resume and ckpt_path.exists():
        ckpt = load_checkpoint(ckpt_path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        set_rng_state(ckpt["rng"])
        start, running = ckpt["iter"], ckpt.get("running", [])
        if log_path.exists():  # entries past the checkpoint are redone
            kept = [e for e in read_log(log_path) if e.get("iter", start + 1) <= start]
            log_path.write_text("".join(json.dumps(e) + "\n" for e in kept))
    else:
        running = []
        if log_path.exists():
            log_path.unlink()

    # Each epoch's order comes from its own seed, and a resumed run starts at the next unseen batch
    # without loading the ones before it: with --num-workers 0 it repeats the original run exactly.
    per_epoch = len(datasets["train"]) // args.batch_size
    if per_epoch == 0:
        raise ValueError(f"--batch-size {args.batch_size} exceeds the {len(datasets['train'])} training images")
    model.train()
    it, bar = start, progress_bar(total=args.iters, initial=start, disable=not args.progress, desc="pretrain")
    with StopRequest() as stop:
        stopped = _train(model, optimizer, scheduler, datasets["train"], per_epoch, stride, device, args, it, bar,
                         running, log_path, ckpt_path, stop)
    bar.close()
    if stopped is not None:
        print(f"stopped after iteration {stopped}; --resume continues from {ckpt_path}", file=sys.stderr)
        return None
    it = args.iters
    val = evaluate(model, datasets["val"], stride, device, args)
    with open(log_path, "a") as f:
        f.write(json.dumps({"iter": it, **val}) + "\n")
    print(f"pretrained {args.backbone} for {it} iterations: val cell accuracy {val['val_cell_acc']:.3f}, "
          f"object cells {val['val_object_cell_acc']:.3f}", file=sys.stderr)
    path = out / "backbone.pth"
    save_atomic({k: t.cpu() for k, t in model.body.state_dict().items()}, path)  # loads on any device
    return path


def _train(model, optimizer, scheduler, dataset, per_epoch, stride, device, args, it, bar, running, log_path,
           ckpt_path, stop):
    """Iterations ``it`` .. --iters. Returns None when done, or the iteration after which ``stop`` ended the run
    (its checkpoint written, with the losses since the last log line, so the resumed log reads the same)."""
    while it < args.iters:
        epoch, skip = divmod(it, per_epoch)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed + epoch))
        batches = order[: per_epoch * args.batch_size].view(per_epoch, args.batch_size)[skip:].tolist()
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn,
                                             num_workers=args.num_workers)
        for samples, targets in loader:
            images, labels = _batch(samples, targets, stride, device)
            logits = model(images)
            loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            running.append((loss.item(), *_rates(_hits(logits.detach().argmax(1), labels))))
            bar.update(1)
            if it % 50 == 0 or it == args.iters:
                loss_avg, acc, obj_acc = (sum(v) / len(v) for v in zip(*running))
                running.clear()
                bar.set_postfix(loss=f"{loss_avg:.3f}", object_cells=f"{obj_acc:.2f}")
                with open(log_path, "a") as f:
                    f.write(json.dumps({"iter": it, "loss": loss_avg, "cell_acc": acc, "object_cell_acc": obj_acc})
                            + "\n")
            stopping = it < args.iters and stop.agreed(device)
            if it % args.save_every == 0 or it == args.iters or stopping:
                save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict(), "iter": it, "rng": rng_state(),
                             "running": list(running)}, ckpt_path)
            if stopping:
                return it
            if it == args.iters:
                break
    return None


@torch.no_grad()
def evaluate(model, dataset, stride, device, args):
    model.eval()
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, collate_fn=collate_fn,
                                         num_workers=args.num_workers)
    hits = [0, 0, 0, 0]
    for samples, targets in loader:
        images, labels = _batch(samples, targets, stride, device)
        hits = [a + b for a, b in zip(hits, _hits(model(images).argmax(1), labels))]
    model.train()
    acc, obj_acc = _rates(hits, empty=0.0)
    return {"val_cell_acc": acc, "val_object_cell_acc": obj_acc}


if __name__ == "__main__":
    if main() is None:
        sys.exit(130)  # stopped by a signal, checkpoint written
