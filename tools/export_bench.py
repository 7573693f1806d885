"""Speed of DETR's transformer encoder exported to ONNX and run by onnxruntime: softmax against Linear-DETR's
encoders, at the feature maps of an 800 x 1333 image (CPU). Each variant is also timed in eager PyTorch, and each
exported graph is checked against eager on a second padded batch.

    python -m linear_mha.tools.export_bench --threads 2 --json docs/results/export_detr_encoder.json --png r.png

The encoder is DETR's (6 layers of 256 by default, --layers; 8 heads, feed-forward 2048, random weights) over the
backbone's last feature map: 25 x 42 tokens for ResNet-50 (stride 32) and 50 x 84 with DC5 (stride 16), batch 1.
The local term reads the grid from the module that receives the feature map (patch's grid_source=).
"""
import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from linear_mha.integrations.console import HelpFormatter
from linear_mha.integrations.detr.transformer import TransformerEncoder, TransformerEncoderLayer
from linear_mha import patch

from . import measure as M

VARIANTS = {"softmax": None, "taylor + 3x3 local term": {"mode": "taylor", "dwc_kernel": 3},
            "kernel (elu)": {"mode": "kernel"}}
GRIDS = {"R50 (25 x 42)": (25, 42), "DC5 (50 x 84)": (50, 84)}  # the default --grid


def parse_grid(text):
    """'HxW' -> ('H x W', (H, W))."""
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid takes HEIGHTxWIDTH in tokens, e.g. 25x42; got {text!r}") from None
    if height < 2 or width < 2:
        raise argparse.ArgumentTypeError(f"--grid needs at least 2 x 2 tokens; got {text!r}")
    return f"{height} x {width}", (height, width)


class Encoder(nn.Module):
    """DETR's encoder on a (B, C, H, W) feature map, its padding mask (B, H, W) and position embedding."""

    def __init__(self, d_model=256, heads=8, layers=6, feedforward=2048):
        super().__init__()
        self.feature_map = nn.Identity()  # the module whose input is image-shaped: the grid's source
        layer = TransformerEncoderLayer(d_model, heads, feedforward, dropout=0.0)
        self.encoder = TransformerEncoder(layer, layers)

    def forward(self, src, mask, pos):
        src = self.feature_map(src)
        memory = self.encoder(src.flatten(2).permute(2, 0, 1), src_key_padding_mask=mask.flatten(1),
                              pos=pos.flatten(2).permute(2, 0, 1))
        return memory.permute(1, 2, 0)


def build(options, seed=0, layers=6):
    torch.manual_seed(seed)
    model = Encoder(layers=layers)
    if options is not None:
        patch(model, **options, **({"grid_source": "feature_map"} if options.get("dwc_kernel") else {}))
    return model.eval()


def inputs(height, width, seed, padded_columns=0):
    g = torch.Generator().manual_seed(seed)
    src, pos = (torch.randn(1, 256, height, width, generator=g) for _ in range(2))
    mask = torch.zeros(1, height, width, dtype=torch.bool)
    if padded_columns:
        mask[:, :, width - padded_columns:] = True
    return src, mask, pos


def export_onnx(model, example, path):
    dims = torch.export.Dim("rows", min=2, max=256), torch.export.Dim("cols", min=2, max=256)
    shapes = ({2: dims[0], 3: dims[1]}, {1: dims[0], 2: dims[1]}, {2: dims[0], 3: dims[1]})
    with torch.no_grad():
        torch.onnx.export(model, example, dynamo=True, dynamic_shapes=shapes, verbose=False).save(str(path))


def run(a):
    import onnxruntime
    threads = M.pin_threads(a.threads)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    records = []
    for variant, method in VARIANTS.items():
        model = build(method, layers=a.layers)
        with tempfile.TemporaryDirectory(prefix="export_bench_") as work:
            path = Path(work) / "encoder.onnx"
            export_onnx(model, inputs(8, 10, 0), path)
            session = onnxruntime.InferenceSession(str(path), options)
        names = [i.name for i in session.get_inputs()]
        for grid, (height, width) in a.grids.items():
            check = inputs(height, width, 1, padded_columns=width // 4)  # another size and a padded batch
            with torch.no_grad():
                expected = model(*check)
            got = torch.from_numpy(session.run(None, dict(zip(names, (t.numpy() for t in check))))[0])
            error = float((got - expected).abs().max() / expected.abs().max())
            x = inputs(height, width, 2)
            feeds = dict(zip(names, (t.numpy() for t in x)))
            with torch.no_grad():
                times = M.round_robin({"onnxruntime": lambda: session.run(None, feeds), "eager": lambda: model(*x)},
                                      repeats=a.repeats, warmup=1)
            record = dict(variant=variant, grid=grid, tokens=height * width, onnx_ms=times["onnxruntime"]["median_ms"],
                          eager_ms=times["eager"]["median_ms"], onnx_relative_error=error)
            records.append(record)
            print(f"{variant:26s} {grid:15s} {record['tokens']:6d} {record['onnx_ms']:10.1f} "
                  f"{record['eager_ms']:10.1f} {error:12.1e}", flush=True)
    return records, threads


def plot(records, grids, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    grids, width = list(grids), 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        ms = [next(r["onnx_ms"] for r in records if r["variant"] == variant and r["grid"] == g) for g in grids]
        ax.bar([j + i * width for j in range(len(grids))], ms, width, label=variant)
    ax.set_xticks([j + width * (len(VARIANTS) - 1) / 2 for j in range(len(grids))], grids)
    ax.set_ylabel("ms per image (onnxruntime, median)")
    ax.set_title("DETR's encoder exported to ONNX (batch 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.export_bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch and onnxruntime intra-op threads")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=6, help="encoder layers (DETR's 6; fewer export faster)")
    p.add_argument("--grid", type=parse_grid, action="append", dest="grid_list", metavar="HxW",
                   help="feature maps to time, in tokens (repeatable; default: 25x42 and 50x84, ResNet-50 and DC5 "
                        "at 800 x 1333)")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    a = p.parse_args(argv)
    if a.layers < 1:
        p.error(f"--layers takes 1 or more encoder layers; got {a.layers}")
    a.grids = dict(a.grid_list) if a.grid_list else GRIDS
    print(f"{'variant':26s} {'feature map':15s} {'tokens':>6s} {'onnx ms':>10s} {'eager ms':>10s} "
          f"{'onnx error':>12s}", flush=True)
    records, threads = run(a)
    if a.json:
        import onnxruntime
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(dict(
            command="python -m linear_mha.tools.export_bench " + " ".join(argv), machine=f"{M.cpu_name()} ({platform.machine()})",
            threads=threads, layers=a.layers, torch=torch.__version__, onnxruntime=onnxruntime.__version__,
            records=records), indent=1))
        print(f"wrote {a.json}", file=sys.stderr)
    if a.png:
        plot(records, a.grids, a.png)
        print(f"wrote {a.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
