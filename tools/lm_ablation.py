#!/usr/bin/env python
"""Attention ablation for the LM: Baseline (plain linear attention) vs Conv_Only vs Gate_Only vs Full_Improved
(gate + conv) vs a softmax transformer with the same parameters; same corpus, same token budget, several seeds.

Each run is ``python -m linear_mha.tools.train_lm`` with --variant baseline/conv/gate/full/softmax; this script prints a table of
mean +- sample standard deviation of test BPC over seeds and the parameter counts, and writes
OUT/ablation.json and OUT/ablation.png. Every extra argument is passed to train_lm.py (model size, steps, data).

Example:  python -m linear_mha.tools.lm_ablation --seeds 0 1 2 --out runs/ablation -- --steps 2000 --dim 256 --depth 4
"""
import argparse
import json
import os
import statistics

from linear_mha.integrations.console import HelpFormatter
from . import train_lm

LABELS = {"baseline": "Baseline", "conv": "Conv_Only", "gate": "Gate_Only", "full": "Full_Improved",
          "softmax": "Softmax"}


def run_once(trainer, extra, variant, seed, out):
    """One training run; re-running the ablation after an interruption reuses finished runs and resumes the
    interrupted one from its checkpoint, as long as the training arguments are the same."""
    argv = extra + ["--variant", variant, "--seed", str(seed), "--no-progress", "--out", out]
    done, marker = os.path.join(out, "results.json"), os.path.join(out, "ablation_argv.json")
    if os.path.exists(done) and os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == argv:
                with open(done) as g:
                    return json.load(g)
    results = trainer.main(argv + ["--resume"])
    with open(marker, "w") as f:
        json.dump(argv, f)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.lm_ablation", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(LABELS), choices=list(LABELS))
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments for train_lm.py (after --)")
    args = p.parse_args(argv)
    extra = [a for a in args.train_args if a != "--"]
    trainer = train_lm
    rows = []
    for variant in args.variants:
        runs = [run_once(trainer, extra, variant, seed, os.path.join(args.out, f"{variant}_seed{seed}"))
                for seed in args.seeds]
        bpc = [r["test_bpc"] for r in runs]
        rows.append({"variant": LABELS[variant], "params": runs[0]["params"], "test_bpc": bpc,
                     "mean": statistics.mean(bpc), "std": statistics.stdev(bpc) if len(bpc) > 1 else 0.0,
                     "tokens_seen": runs[0]["tokens_seen"]})
    print(f"{'variant':<14} {'params':>9} {'test BPC (mean +- std over ' + str(len(args.seeds)) + ' seeds)':>40}")
    for r in rows:
        print(f"{r['variant']:<14} {r['params']:>9} {r['mean']:>30.4f} +- {r['std']:.4f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ablation.json"), "w") as f:
        json.dump({"train_args": extra, "seeds": args.seeds, "rows": rows}, f, indent=2)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["variant"] for r in rows], [r["mean"] for r in rows], yerr=[r["std"] for r in rows], capsize=4)
    lo = min(r["mean"] - r["std"] for r in rows)
    ax.set_ylim(lo - 0.1, max(r["mean"] + r["std"] for r in rows) + 0.05)
    ax.set_ylabel("test BPC")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ablation.png"), dpi=100)
    return rows


if __name__ == "__main__":
    main()
