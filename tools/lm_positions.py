#!/usr/bin/env python
"""Where in the context a trained LM loses: bits per byte by position within the window, for runs of
``tools.train_lm`` (their ``checkpoint.pt``), over the same windows of the same split.

A linear method keeps the context in a fixed-size state, softmax attention keeps all of it, so two models with the
same mean can differ in where they lose: near the window's start (little context; every model is alike) or far
into it, where only a model that kept the early bytes can use them. The windows are the trainer's own: consecutive,
non-overlapping, --seq-len bytes each, so the mean over all positions is the BPC ``train_lm`` reports for the split.

    python -m linear_mha.tools.lm_positions runs/lm_budget/softmax_seed0 runs/lm_budget/baseline_gated_deltanet_seed0 \\
        --json runs/positions.json --png runs/positions.png

Prints a table of BPC per range of positions (the first run is the reference of the relative columns).
"""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from linear_mha.integrations.checkpoint_io import safe_load, write_text_atomic
from linear_mha.integrations.console import HelpFormatter, choose_threads

from . import train_lm

DATA_ARGS = ("seq_len", "enwik8", "corpus_bytes")  # what makes two runs' windows the same bytes


def load_run(folder: Path):
    """(train_lm's arguments, the model with the checkpoint's weights, on the CPU, in eval mode) of a run folder."""
    path = folder / "checkpoint.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no checkpoint.pt; pass folders that tools.train_lm wrote (--out)")
    state = safe_load(path, "a run folder")
    args = argparse.Namespace(**state["args"])
    model = train_lm.build_model(args)
    model.load_state_dict(state["model"])
    return args, model.eval()


@torch.no_grad()
def bits_by_position(model, split, seq_len: int, max_bytes=None, batch_size: int = 32) -> np.ndarray:
    """(seq_len,) mean bits per byte of the prediction at each position of the windows train_lm's evaluate
    scores: consecutive windows of seq_len + 1 bytes, every seq_len bytes, over the first max_bytes of split."""
    starts = train_lm.window_starts(split, seq_len, max_bytes)
    if not len(starts):
        raise ValueError(f"the split's scored bytes hold no window of --seq-len {seq_len} + 1")
    total = torch.zeros(seq_len, dtype=torch.float64)
    for i in range(0, len(starts), batch_size):
        batch = torch.from_numpy(np.stack([split[s:s + seq_len + 1] for s in starts[i:i + batch_size]])
                                 .astype(np.int64))
        logits = model(batch[:, :-1])  # (B, L, 256)
        nats = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # (B, L)
        total += nats.sum(0).double()
    return (total / len(starts) / math.log(2)).numpy()


def position_ranges(seq_len: int) -> list:
    """[(start, end)]: 0-8, 8-16, then doubling up to seq_len."""
    edges = [0] + [e for e in (8 * 2 ** i for i in range(32)) if e < seq_len] + [seq_len]
    return list(zip(edges[:-1], edges[1:]))


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run in results["runs"]:
        curve = np.asarray(run["bpc_by_position"])
        width = max(1, len(curve) // 32)  # a running mean: one position's BPC over a few hundred windows is noisy
        smooth = np.convolve(curve, np.ones(width) / width, mode="valid")
        ax.plot(np.arange(len(smooth)) + width // 2, smooth, label=f"{run['label']} ({run['bpc']:.3f})")
    ax.set_xscale("symlog", linthresh=8)
    ax.set_xlabel("position in the window (bytes of context)")
    ax.set_ylabel(f"{results['split']} bits per byte")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.lm_positions", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="folders written by tools.train_lm (each with checkpoint.pt)")
    p.add_argument("--split", choices=("test", "val"), default="test", help="the split scored")
    p.add_argument("--max-bytes", type=int, help="score only the split's first bytes (default: all of it)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", type=Path, help="write the runs' BPC at every position here")
    p.add_argument("--png", type=Path, help="draw BPC against position here")
    a = p.parse_args(argv)
    if a.max_bytes is not None and a.max_bytes < 2:
        raise ValueError(f"--max-bytes must be >= 2, got {a.max_bytes}")
    choose_threads(a.threads)
    loaded = [(folder, *load_run(folder)) for folder in a.runs]
    first = loaded[0][1]
    for folder, args, _ in loaded[1:]:
        differ = [name for name in DATA_ARGS if getattr(args, name) != getattr(first, name)]
        if differ:
            raise ValueError(f"{folder} was trained with other " + ", ".join(f"--{n.replace('_', '-')}" for n in differ)
                             + f" than {a.runs[0]}: its windows would be other bytes; compare runs of one setting")
    split = train_lm.load_splits(first)[a.split]
    runs = []
    for folder, args, model in loaded:
        bits = bits_by_position(model, split, first.seq_len, a.max_bytes)
        runs.append({"run": str(folder), "label": train_lm.run_label(args), "seed": args.seed,
                     "bpc": float(bits.mean()), "bpc_by_position": bits.tolist()})
        print(f"{folder}: {a.split} {runs[-1]['bpc']:.4f} bits per byte", file=sys.stderr)
    ranges = [{"positions": [lo, hi], "bpc": [float(np.mean(r["bpc_by_position"][lo:hi])) for r in runs]}
              for lo, hi in position_ranges(first.seq_len)]
    print(f"{'positions':<12}" + "".join(f"{r['label'][:22]:>24}" for r in runs))
    for row in ranges:
        means = row["bpc"]
        print(f"{'-'.join(map(str, row['positions'])):<12}" + f"{means[0]:>24.4f}"
              + "".join(f"{m:>15.4f} ({m / means[0] - 1:+6.1%})" for m in means[1:]))
    results = {"split": a.split, "seq_len": first.seq_len, "max_bytes": a.max_bytes, "runs": runs, "ranges": ranges}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.json, json.dumps(results, indent=1))
    if a.png:
        a.png.parent.mkdir(parents=True, exist_ok=True)
        plot(results, a.png)
    return results


if __name__ == "__main__":
    main()
