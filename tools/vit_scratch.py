"""A second task for the attention methods, so that no method is chosen by one benchmark: a small ViT trained from
scratch on scikit-learn's handwritten digits (the data and ViT of ``tools.calibrate_bench vit``: 1,797 8 x 8 images
upsampled to 32 x 32, an 80/20 split by seed; timm's VisionTransformer, patch 4 -> an 8 x 8 grid and a class token,
d = 96, 4 layers, 4 heads), with each variant's attention in every layer from the first step. Same data, steps,
learning rate and seeds for every variant; top-1 on the held-out fifth.

    python -m linear_mha.tools.vit_scratch --variants softmax taylor-dwc3 inline-dwc3 --seeds 0 1 2 \\
        --out runs/vit_scratch --json docs/results/vit_scratch.json

A variant is 'softmax' (timm's own attention) or '<method>[-dwc<K>][:<option>=<value>,...]' as in
``tools.detr_compare`` (e.g. 'taylor-dwc3:output_gate=True'). Every run writes <out>/<variant>/seed<S>.json when it
finishes, and a later call reuses it (one of other --steps or --lr is refused; an interrupted run starts again).
With --records FILE the runs add up in one committed file across machines' sessions (as ``tools.mqar``'s). The table
gives mean ± std over the seeds and the ratio to softmax's mean top-1 on the same seeds; --json writes every record
with the command, machine and torch version; --plot a bar chart.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

from linear_mha.integrations.checkpoint_io import check_same_args, write_text_atomic
from linear_mha.integrations.console import HelpFormatter
from linear_mha.integrations.detr.attention import parse_attention_options
from linear_mha import method_class, patch

from . import measure
from .calibrate_bench import build_vit, digits, top1, train_vit
from .records_file import add_record, find_record, read_results


def parse_variant(name: str):
    """'taylor-dwc3:output_gate=True' -> ('taylor', {'dwc_kernel': 3, 'output_gate': True}); 'softmax' -> (None, {}):
    a method that computes the ViT's own attention, with no option, leaves it as it is."""
    base, _, options = name.partition(":")
    local = re.fullmatch(r"(.+)-dwc(\d+)", base)
    mode = local.group(1) if local else base
    method = method_class(mode)  # an unknown method raises, listing the registered ones
    found = parse_attention_options(filter(None, options.split(",")))
    if local:
        found["dwc_kernel"] = int(local.group(2))
    if not found and method().computes_torch_attention:
        return None, {}
    return mode, found


RUN_KEY = ("variant", "seed")  # one run of a table; its steps and lr must be the table's (one budget per file)


def run(variant: str, seed: int, steps: int, lr: float, out: Path, records=None) -> dict:
    """Train one ViT with ``variant``'s attention for ``steps`` and test it, or read the record a finished run left
    in ``out`` or in the --records file (``records``: its path, setup and command, or None)."""
    wanted = {"variant": variant, "seed": seed, "steps": steps, "lr": lr}
    done = out / variant / f"seed{seed}.json"
    if records is not None:
        path, setup, command = records
        kept = find_record(read_results(path, setup).get("records", []), wanted, RUN_KEY, wanted, ("steps", "lr"),
                           path)
        if kept is not None:
            return kept
    if done.is_file():
        record = json.loads(done.read_text())
        check_same_args(record, wanted, ("steps", "lr"), "--out", done)  # a 600-step run is no 1,800-step run
    else:
        mode, options = parse_variant(variant)
        x_train, y_train, x_test, y_test = digits(seed)
        model = build_vit(seed)
        if mode is not None:
            patch(model, mode, **options)
        done.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = done.with_suffix(".checkpoint.pt")  # a killed run continues from its last 100 steps
        seconds = train_vit(model, x_train, y_train, steps, lr, seed, label=variant, checkpoint=checkpoint)
        record = {**wanted, "top1": top1(model, x_test, y_test), "sec_per_step": seconds / steps}
        write_text_atomic(done, json.dumps(record))
        checkpoint.unlink(missing_ok=True)
    if records is not None:
        add_record(path, record, RUN_KEY, setup, command, summarize,
                   draw=lambda results: plot(results["summary"], path.with_suffix(".png")))
    return record


def summarize(records):
    summary = []
    for name in dict.fromkeys(r["variant"] for r in records):
        of = [r for r in records if r["variant"] == name]
        values = [r["top1"] for r in of]
        summary.append({"variant": name, "seeds": [r["seed"] for r in of], "top1": statistics.mean(values),
                        "top1_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                        "sec_per_step": statistics.mean(r["sec_per_step"] for r in of)})
    for entry in summary:  # against softmax on the same seeds
        base = [r["top1"] for r in records if r["variant"] == "softmax" and r["seed"] in entry["seeds"]]
        entry["vs_softmax"] = entry["top1"] / statistics.mean(base) if base else None
    return summary


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.45 * len(summary) + 1.5))
    names = [s["variant"] for s in summary]
    ax.barh(names, [s["top1"] for s in summary], xerr=[s["top1_std"] for s in summary], color="tab:blue")
    ax.set(xlabel="top-1 on the held-out digits (mean, ±1 std over seeds)", xlim=(min(s["top1"] for s in summary)
                                                                                   - 0.05, 1.0))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.vit_scratch", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--variants", nargs="+", default=["softmax", "taylor-dwc3"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=2000, help="training steps of every run (batch 64)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (one-cycle AdamW)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="runs/vit_scratch", help="one record per finished run, reused by a later call")
    p.add_argument("--json", help="write every record, the summary, command, machine and torch version here")
    p.add_argument("--plot", help="write a bar chart (PNG) here")
    p.add_argument("--records", metavar="FILE",
                   help="a results file that runs add up in across calls, processes and machines' sessions: a run "
                        "it holds (same steps and lr) is not trained again, a finished run is added at once, with "
                        "the summary and FILE's .png redrawn; a file of another machine or torch is refused")
    a = p.parse_args(argv)
    for name in a.variants:
        try:
            parse_variant(name)
        except ValueError as err:
            p.error(f"--variants {name!r}: {err}")
    return a


def main(argv=None):
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    command = "python -m linear_mha.tools.vit_scratch " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = f"{measure.cpu_name()}, {torch.get_num_threads()} threads"
    records_file = None
    if a.records:
        records_file = (Path(a.records), {"machine": machine, "torch": torch.__version__}, command)
    print(f"ViT from scratch on digits: {len(a.variants)} variant(s) x {len(a.seeds)} seed(s), {a.steps} steps each; "
          f"runs in {out}/")
    records = [run(name, seed, a.steps, a.lr, out, records_file) for seed in a.seeds for name in a.variants]
    summary = summarize(records)
    print("variant | seeds | top-1 | std | vs softmax | s / step")
    print("---|---|---|---|---|---")
    for s in summary:
        ratio = "-" if s["vs_softmax"] is None else f"{s['vs_softmax']:.1%}"
        print(f"{s['variant']} | {len(s['seeds'])} | {s['top1']:.4f} | {s['top1_std']:.4f} | {ratio} | "
              f"{s['sec_per_step']:.4f}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.json, json.dumps({"machine": machine, "torch": torch.__version__, "command": command,
                                              "records": records, "summary": summary}, indent=1))
        print(f"records: {a.json}")
    if a.plot:
        plot(summary, a.plot)
        print(f"plot: {a.plot}")
    return summary


if __name__ == "__main__":
    main()
