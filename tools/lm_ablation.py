#!/usr/bin/env python
"""LM variants over seeds at one budget: train_lm's attention variants (baseline / conv / gate / full linear heads,
hybrid local + linear heads, and a softmax Transformer with the same parameters), each optionally with the global
heads on another registry method, on the same corpus, token budget and seeds.

A variant is ``VARIANT`` or ``VARIANT:METHOD``: train_lm's --variant (several joined by '+'), and --global-mode
METHOD for its global heads (e.g. ``softmax``, ``softmax+conv``, ``baseline:gated_deltanet``,
``hybrid+conv:gated_deltanet``). Every argument after ``--`` goes to every run (model size, steps, data,
--shift-tokens), so the variants differ in their attention only.

Each run is ``python -m linear_mha.tools.train_lm`` in OUT/<variant>_seed<S>; re-running reuses finished runs and
resumes an interrupted one from its checkpoint. Prints mean +- sample standard deviation of test bits per byte over
seeds with the parameter counts, and writes OUT/ablation.json and OUT/ablation.png. ``--records FILE`` also adds
each finished run to FILE at once (and skips runs FILE holds), so a comparison too long for one session adds up in
a file committed with the code; FILE's .png is redrawn beside it.

Example:  python -m linear_mha.tools.lm_ablation --seeds 0 1 2 --out runs/ablation -- --steps 2000 --dim 256 --depth 4
          python -m linear_mha.tools.lm_ablation --variants softmax baseline:gated_deltanet --records lm.json \\
              -- --shift-tokens --steps 2500 --dim 128
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter
from . import train_lm
from .measure import cpu_name
from .records_file import add_record, find_record, read_results

LABELS = {"baseline": "Baseline", "conv": "Conv_Only", "gate": "Gate_Only", "full": "Full_Improved",
          "softmax": "Softmax", "hybrid": "Hybrid", "shortconv": "Short_Conv", "norm": "Head_Norm",
          "rotary": "Rotary"}
RUN_KEY = ("variant", "seed")


def variant_argv(spec: str) -> list:
    """train_lm's arguments for a variant ``VARIANT[+VARIANT...][:METHOD]``."""
    variant, _, method = spec.partition(":")
    if not all(name in LABELS for name in variant.split("+")):
        raise ValueError(f"--variants {spec!r}: the part before ':' must be one of {', '.join(LABELS)}, or several "
                         "joined by '+'")
    return ["--variant", variant] + (["--global-mode", method] if method else [])


def label(spec: str) -> str:
    variant, _, method = spec.partition(":")
    return " + ".join(LABELS[name] for name in variant.split("+")) + (f" ({method})" if method else "")


def run_once(trainer, extra, spec, seed, out):
    """One training run; re-running after an interruption reuses a finished run and resumes the interrupted one
    from its checkpoint, as long as the training arguments are the same."""
    argv = extra + variant_argv(spec) + ["--seed", str(seed), "--no-progress", "--out", out]
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


def record_of(spec, seed, results, extra) -> dict:
    return {"variant": spec, "seed": seed, "train_args": extra, "params": results["params"],
            "tokens_seen": results["tokens_seen"], "val_bpc": results["val_bpc"], "test_bpc": results["test_bpc"],
            "seconds": results.get("seconds"), "curve": results.get("curve", [])}


def summarize(records) -> list:
    """Per variant, in first-seen order: mean and sample std of test BPC over its seeds, and its mean against the
    plain softmax variant's (``vs_softmax``) and against the best softmax variant's, the one of lowest mean among
    those whose heads are all softmax (``vs_best_softmax``, e.g. softmax+conv), each on the seeds both have, as a
    relative difference (None without such a row)."""
    rows = []
    for spec in dict.fromkeys(r["variant"] for r in records):
        of = sorted((r for r in records if r["variant"] == spec), key=lambda r: r["seed"])
        bpc = [r["test_bpc"] for r in of]
        rows.append({"variant": spec, "label": label(spec), "seeds": [r["seed"] for r in of], "params": of[0]["params"],
                     "tokens_seen": of[0]["tokens_seen"], "test_bpc": bpc, "mean": statistics.mean(bpc),
                     "std": statistics.stdev(bpc) if len(bpc) > 1 else 0.0})
    all_softmax = [row for row in rows if train_lm.variant_options(row["variant"].partition(":")[0]).get("softmax")]
    best = min(all_softmax, key=lambda row: row["mean"], default=None)
    for row in rows:
        row["vs_softmax"] = relative(row, records, "softmax")
        row["best_softmax"] = best and best["variant"]
        row["vs_best_softmax"] = best and relative(row, records, best["variant"])
    return rows


def relative(row, records, reference: str):
    """row's mean test BPC over the seeds ``reference`` also has, against reference's over them, minus 1."""
    theirs = {r["seed"]: r["test_bpc"] for r in records if r["variant"] == reference}
    pairs = [(b, theirs[s]) for s, b in zip(row["seeds"], row["test_bpc"]) if s in theirs]
    return statistics.mean(b for b, _ in pairs) / statistics.mean(s for _, s in pairs) - 1 if pairs else None


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # Horizontal bars, best at the top: labels such as "Hybrid + Conv_Only (gated_deltanet)" stay readable however
    # many variants the file holds
    rows = sorted(rows, key=lambda r: -r["mean"])
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.4 * len(rows)))
    labels = [f"{r['label']} ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})" for r in rows]
    ax.barh(labels, [r["mean"] for r in rows], xerr=[r["std"] for r in rows], capsize=3)
    ax.set_xlim(min(r["mean"] - r["std"] for r in rows) - 0.05, max(r["mean"] + r["std"] for r in rows) + 0.02)
    ax.set_xlabel("test bits per byte (mean ± std over seeds)")
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.lm_ablation", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(LABELS), metavar="VARIANT[:METHOD]",
                   help=f"train_lm variants ({', '.join(LABELS)}), each optionally ':' a global-heads method")
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--records", metavar="FILE", help="add each finished run to this JSON file, skip the runs it holds")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments for train_lm.py (after --)")
    args = p.parse_args(argv)
    for spec in args.variants:
        try:
            variant_argv(spec)
        except ValueError as err:
            p.error(str(err))
    extra = [a for a in args.train_args if a != "--"]
    threads = train_lm.parse_args(extra).threads or torch.get_num_threads()
    setup = {"machine": f"{cpu_name()}, {threads} threads", "torch": torch.__version__}
    path = Path(args.records) if args.records else None
    command = "python -m linear_mha.tools.lm_ablation " + " ".join(sys.argv[1:] if argv is None else argv)
    records = []
    for spec in args.variants:
        for seed in args.seeds:
            wanted = {"variant": spec, "seed": seed, "train_args": extra}
            kept = None if path is None else find_record(read_results(path, setup).get("records", []), wanted,
                                                         RUN_KEY, wanted, (), path)
            if kept is not None and kept["train_args"] != extra:
                raise ValueError(f"--records {path} holds {spec} seed {seed} trained with "
                                 f"`-- {' '.join(kept['train_args'])}`; this call passes `-- {' '.join(extra)}`. One "
                                 "file is one budget: pass the same training arguments, or give another --records")
            if kept is None:
                results = run_once(train_lm, extra, spec, seed, os.path.join(args.out, f"{spec.replace(':', '_')}"
                                                                                      f"_seed{seed}"))
                kept = record_of(spec, seed, results, extra)
                if path is not None:
                    add_record(path, kept, RUN_KEY, setup, command, summarize,
                               draw=lambda file: plot(file["summary"], path.with_suffix(".png")))
            records.append(kept)
    rows = summarize(records)
    best = label(rows[0]["best_softmax"]) if rows[0]["best_softmax"] else "best softmax"
    print(f"{'variant':<36} {'params':>9} {'tokens':>11}  test BPC (mean +- std, seeds)  vs softmax  vs {best}")
    for r in rows:
        ratios = ["" if r[key] is None else f"{r[key]:+.2%}" for key in ("vs_softmax", "vs_best_softmax")]
        print(f"{r['label']:<36} {r['params']:>9,} {r['tokens_seen']:>11,}  {r['mean']:>10.4f} +- {r['std']:.4f}"
              f" ({len(r['seeds'])})   {ratios[0]:>9}  {ratios[1]:>9}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ablation.json"), "w") as f:
        json.dump({**setup, "train_args": extra, "seeds": args.seeds, "rows": rows}, f, indent=2)
    plot(rows, os.path.join(args.out, "ablation.png"))
    return rows


if __name__ == "__main__":
    main()
