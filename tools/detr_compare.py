"""DETR (softmax) vs Linear-DETR on the synthetic set with the same budget and seeds, plus an encoder
memory/time table at growing image sizes through DETR's real call path.

    python tools/detr_compare.py --out runs/detr_compare --epochs 30            # training table + plots
    python tools/detr_compare.py --out runs/detr_compare --encoder-only --sizes 256,512,800 --dc5
    python tools/detr_compare.py --out runs/detr_cmp --epochs 16 --pretrain-iters 2000 --timing-iters 40 \
        -- --backbone small --synthetic-train 2000 --no-crop --lr 3e-4 --lr-backbone 3e-5 --lr-drop 12

From scratch DETR barely leaves AP 0 on a CPU budget; the last form (the README's setup in one command) first
pretrains the small backbone once and starts every variant from it. Options after `--` go to every training
run; --variants splits the runs over processes sharing one --out.

Peak memory is CUDA's max_memory_allocated. On CPU it is the peak extra RSS measured by tools/measure.py in a
fresh process: for the training table, of a short probe run of the same variant (1 epoch, 2 iterations, no data
workers: model, optimizer state, activations and evaluation); for the encoder table, of one encoder forward.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
from integrations.detr.attention import apply_attention  # noqa: E402
from integrations.detr.backbone import backbone_stride  # noqa: E402
from integrations.detr.config import parse_args  # noqa: E402
from integrations.detr.detr import build_model  # noqa: E402
from integrations.detr.plots import read_log  # noqa: E402
from integrations.detr.pretrain import main as pretrain_main  # noqa: E402
from integrations.detr.train import main as train_main  # noqa: E402
from integrations.detr.transforms import feature_tokens, resized_hw  # noqa: E402

VARIANTS = {"softmax": ["--attention", "softmax"],
            "linformer-shared": ["--attention", "linformer", "--param-sharing", "layerwise", "--proj-k", "64"],
            "kernel": ["--attention", "kernel", "--feature-map", "elu"],
            "efficient": ["--attention", "efficient"]}


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device):
    return torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else float("nan")


def _cpu_peak_mib(builder, **kwargs):
    """Peak extra RSS (MiB) of one call of a case of this file, in a fresh process (tools/measure.py)."""
    mem = measure.peak_extra_memory({"builder": f"detr_compare:{builder}", "kwargs": kwargs})
    if "error" in mem:
        print(f"CPU memory measurement failed ({builder} {kwargs}): {mem['error']}", file=sys.stderr)
        return float("nan")
    return mem["extra_bytes"] / 2 ** 20


def training_case(argv):
    """Builder for the CPU memory probe: a short training run in a throwaway output directory."""
    out = tempfile.TemporaryDirectory(prefix="detr_mem_")

    def run():
        train_main(argv + ["--output-dir", out.name])  # run holds `out`, so the directory lives as long as it
    return run


def _build_encoder(size, name, batch, dc5, device):
    """DETR's encoder for one variant at one image size, with its inputs."""
    stride = backbone_stride("resnet18", dc5)
    h, w = resized_hw((size, int(size * 1333 / 800)), size, 1333)
    tokens = feature_tokens((h, w), stride)
    args = parse_args(["--coco-path", "unused", "--num-classes", "91", "--backbone", "resnet18"] + VARIANTS[name])
    model, _, _ = build_model(args)
    apply_attention(model, args, max_tokens=tokens)
    enc = model.transformer.encoder.to(device).eval()
    hf, wf = -(-h // stride), -(-w // stride)
    src = torch.randn(hf * wf, batch, 256, device=device)
    pos = torch.randn_like(src)
    mask = torch.zeros(batch, hf * wf, dtype=torch.bool, device=device)
    return (h, w), tokens, enc, (src, mask, pos)


def encoder_case(size, name, batch, dc5):
    """Builder for the CPU memory probe: one encoder forward."""
    _, _, enc, (src, mask, pos) = _build_encoder(size, name, batch, dc5, torch.device("cpu"))

    def run():
        with torch.no_grad():
            enc(src, src_key_padding_mask=mask, pos=pos)
    return run


def _run_args(a, device, num_workers, extra):
    """Options every training run of a variant shares: seed, device, the options after `--`, the variant's."""
    return (["--seed", str(a.seed), "--device", str(device), "--no-progress", "--num-workers", str(num_workers)]
            + a.train_args + extra)


def pretrained_backbone(a):
    """With --pretrain-iters, pretrains the backbone the training runs use, once, on their training data;
    returns the options that load it (none without)."""
    if not a.pretrain_iters:
        return []
    train_args = parse_args(a.train_args)
    path = pretrain_main(["--backbone", train_args.backbone, "--batch-size", str(train_args.batch_size),
                          "--iters", str(a.pretrain_iters), "--seed", str(a.seed),
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


def training_table(a, device):
    """Trains every variant (resuming any whose checkpoint exists) and tabulates the last epoch."""
    rows, weights = [], pretrained_backbone(a)
    for name in a.variants:
        extra = VARIANTS[name]
        _peak_reset(device)
        run_dir = Path(a.out) / name
        argv = ["--epochs", str(a.epochs), "--output-dir", str(run_dir)] + _run_args(a, device, a.num_workers,
                                                                                     extra + weights)
        if a.max_iters:
            argv += ["--max-iters", str(a.max_iters)]
        if (run_dir / "checkpoint.pth").exists():
            argv += ["--resume", str(run_dir / "checkpoint.pth")]
        if train_main(argv)["stopped_at"]:
            _stopped(f"training of {name!r}")
        log = read_log(run_dir / "log.jsonl")
        peak_file = run_dir / "peak_memory.json"  # measured once per run directory, kept across resumes
        if peak_file.exists():
            peak = json.loads(peak_file.read_text())["peak_MiB"]
        else:
            peak = _peak_mib(device) if device.type == "cuda" else _cpu_peak_mib(
                "training_case", argv=["--epochs", "1", "--max-iters", "2"] + _run_args(a, "cpu", 0, extra + weights))
            peak_file.write_text(json.dumps({"peak_MiB": peak}))
        last = log[-1]
        iters = a.max_iters or None
        per_iter = sum(e["epoch_train_seconds"] for e in log) / (len(log) * (iters or 1))
        rows.append({"variant": name, "AP": last["test_AP"], "AP50": last["test_AP50"],
                     "train_s_per_iter" if iters else "train_s_per_epoch": per_iter,
                     "peak_MiB": peak, "log": [e["test_AP"] for e in log]})
    if a.timing_iters:
        for row in rows:
            row["timed_s_per_iter"] = _timed_iterations(a, device, VARIANTS[row["variant"]] + weights)
    return rows


def _timed_iterations(a, device, extra):
    """Seconds per training iteration of a short run on its own (the training runs of the table may have
    shared the machine): one epoch of --timing-iters iterations in a throwaway directory."""
    with tempfile.TemporaryDirectory(prefix="detr_time_") as tmp:
        run = train_main(["--epochs", "1", "--max-iters", str(a.timing_iters), "--output-dir", tmp]
                         + _run_args(a, device, 0, extra))
    if run["stopped_at"]:
        _stopped("the timing run")
    return run["log"][-1]["epoch_train_seconds"] / a.timing_iters


@torch.no_grad()
def encoder_table(a, device):
    """Encoder forward (DETR-R50 width: 6 layers, d=256) on feature maps of real image sizes."""
    rows = []
    for size in a.sizes:
        for name in VARIANTS:
            (h, w), tokens, enc, (src, mask, pos) = _build_encoder(size, name, a.batch, a.dc5, device)
            enc(src, src_key_padding_mask=mask, pos=pos)  # warm-up
            _peak_reset(device)
            t0 = time.perf_counter()
            for _ in range(a.repeats):
                enc(src, src_key_padding_mask=mask, pos=pos)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = 1000 * (time.perf_counter() - t0) / a.repeats
            peak = _peak_mib(device) if device.type == "cuda" else _cpu_peak_mib(
                "encoder_case", size=size, name=name, batch=a.batch, dc5=a.dc5)
            rows.append({"image": f"{h}x{w}", "tokens": tokens, "variant": name, "ms": ms, "peak_MiB": peak})
    return rows


def _print(rows, keys):
    print(" | ".join(keys))
    print(" | ".join("---" for _ in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/detr_compare")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-iters", type=int, default=0)
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                   help=f"comma list of {','.join(VARIANTS)}; runs of one --out can go in parallel processes "
                        "(after the backbone is pretrained) and a last call with all of them makes the table")
    p.add_argument("--timing-iters", type=int, default=0,
                   help="also time this many training iterations of each variant, one variant at a time, "
                        "after training (clean s/iter when the training runs shared the machine)")
    p.add_argument("--pretrain-iters", type=int, default=0,
                   help="pretrain the (tiny/small) backbone this long first, shared by every variant "
                        "(integrations/detr/pretrain.py); from scratch DETR stays at AP ~ 0 on CPU budgets")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--encoder-only", action="store_true")
    p.add_argument("--skip-encoder", action="store_true")
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[256, 480, 800])
    p.add_argument("--dc5", action="store_true", help="stride-16 feature maps (800x1333 -> 4200 tokens)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: options passed to every training run, e.g. -- --synthetic-train 4000 --no-crop")
    a = p.parse_args(argv)
    a.train_args = [t for t in a.train_args if t != "--"]
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": str(device), "torch": torch.__version__}
    if not a.encoder_only:
        result["training"] = training_table(a, device)
        _print(result["training"], [k for k in result["training"][0] if k != "log"])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in result["training"]:
            ax.plot(range(len(r["log"])), r["log"], marker="o", label=r["variant"])
        ax.set(xlabel="epoch", ylabel="val AP", title="synthetic set, same budget and seed")
        ax.legend()
        fig.savefig(out / "ap_curves.png", dpi=100)
    if not a.skip_encoder:
        result["encoder"] = encoder_table(a, device)
        _print(result["encoder"], ["image", "tokens", "variant", "ms", "peak_MiB"])
    (out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
