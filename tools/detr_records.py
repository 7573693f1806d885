"""detr_compare's records files: the runs of a table with the machine, torch version and commands, the summary (mean
and std over seeds, per budget), the AP curves beside them (the same name, .png); and joining files of one setup
(say one per budget) into one table:

    python -m linear_mha.tools.detr_records --out docs/results/linear_detr.json \
        docs/results/detr_budget_e16.json docs/results/detr_long_budget_e48.json
"""
import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter

from . import measure
from .detr_variants import computes_softmax


def summarize(rows):
    """Mean and std over seeds of each variant's numbers."""
    summary = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        of = [r for r in rows if r["variant"] == name]
        entry = {"variant": name, "seeds": [r["seed"] for r in of]}
        for key in ("AP", "AP50", "AP75", "APs", "APm", "APl", "sec_per_iter", "peak_mib"):
            values = [r[key] for r in of if r.get(key) is not None]
            if values:
                entry[key] = statistics.mean(values)
                entry[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        summary.append(entry)
    # The ratios: against the first exact-softmax variant of the table (plain DETR, as listed first) and against the
    # best of them (the strongest baseline a user could build from the same options)
    exact = [entry for entry in summary if computes_softmax(entry["variant"])]
    if exact:
        best = max(exact, key=lambda entry: entry["AP"])
        for entry in summary:
            if exact[0]["AP"] > 0:  # at AP 0 (an untrained model) there is no ratio, rather than one to another row
                entry["AP_vs_softmax"] = entry["AP"] / exact[0]["AP"]
            if best["AP"] > 0:
                entry["AP_vs_best_softmax"] = entry["AP"] / best["AP"]
                entry["best_softmax"] = best["variant"]
    return summary


def plot_curves(rows, path):
    """Mean val AP per epoch of every variant (band: +-1 std over seeds), a panel per budget where the rows
    ("log": AP per epoch) come from several --epochs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({len(r["log"]) if r.get("epochs") is None else r["epochs"] for r in rows})
    if not budgets:  # nothing finished yet: no figure
        return
    fig, axes = plt.subplots(1, len(budgets), figsize=(7 * len(budgets), 4.5), squeeze=False)
    colours = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(r["variant"] for r in rows))}  # across panels
    for ax, budget in zip(axes[0], budgets):
        of = [r for r in rows if (len(r["log"]) if r.get("epochs") is None else r["epochs"]) == budget]
        for name in dict.fromkeys(r["variant"] for r in of):
            logs = [r["log"] for r in of if r["variant"] == name]
            epochs = min(len(log) for log in logs)
            mean = [statistics.mean(log[e] for log in logs) for e in range(epochs)]
            std = [statistics.stdev(log[e] for log in logs) if len(logs) > 1 else 0.0 for e in range(epochs)]
            ax.plot(range(epochs), mean, marker="o", markersize=3, color=colours[name], label=f"{name} (n={len(logs)})")
            ax.fill_between(range(epochs), [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=colours[name], alpha=0.15)
        ax.set(xlabel="epoch", ylabel="val AP (mean, band: ±1 std over seeds)",
               title=f"{budget} epochs: same data, backbone and seeds for every row")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SETUP = ("machine", "torch", "device")  # a table comes from one of each
RUN = ("variant", "seed", "epochs")  # names a record: a later one of the same run replaces it


def _replace(earlier, later, key):
    """``earlier`` with each entry that ``later`` has a newer one of (by ``key``) replaced in its place, then the
    rest of ``later``: a rerun keeps its row's place, and the first softmax row stays plain DETR (``summarize``)."""
    newer = {tuple(entry[k] for k in key): entry for entry in later}
    return [newer.pop(tuple(entry[k] for k in key), entry) for entry in earlier] + list(newer.values())


def save(path, setup, commands, records, timing):
    """Write the table: every record of a variant the timing pass timed takes its seconds per iteration (also those
    earlier calls left), the summary is per budget, the AP curves go beside it (the same name, .png)."""
    seconds = {t["variant"]: t["sec_per_iter"] for t in timing}
    records = [{**r, "sec_per_iter": seconds.get(r["variant"], r.get("sec_per_iter"))} for r in records]
    summary = [{"epochs": epochs, **entry} for epochs in sorted({r["epochs"] for r in records})
               for entry in summarize([r for r in records if r["epochs"] == epochs])]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**setup, "command": commands[-1] if commands else None, "commands": commands,
                                "records": records, "summary": summary, "timing": timing}, indent=1))
    plot_curves([{**r, "log": r["AP_per_epoch"]} for r in records if r.get("AP_per_epoch")], path.with_suffix(".png"))


def write_records(a, rows, path, argv, timing):
    """The records of this call's runs, with the machine, torch version and command. With --records-merge the file's
    records of other runs (another budget, say) stay, this call's replace those of the same variant, seed and epochs,
    a call that timed nothing keeps the file's timing, and the file must come from this machine, torch and device."""
    machine = f"{platform.processor() or platform.machine()} ({measure.cpu_name()}), {torch.get_num_threads()} threads"
    records = [{**{key: r.get(key) for key in ("variant", "seed", "epochs", "AP", "AP50", "AP75", "APs", "APm", "APl",
                                               "sec_per_iter", "peak_mib")},
                "machine": machine, "AP_per_epoch": r.get("log")}
               for r in rows]
    setup = {"machine": machine, "torch": torch.__version__, "device": a.device}
    command = "python -m linear_mha.tools.detr_compare " + " ".join(argv)
    commands = [command]
    path = Path(path)
    if a.records_merge and path.exists():
        earlier = json.loads(path.read_text())
        there = {key: earlier.get(key) for key in SETUP}
        if there != setup:
            raise SystemExit(f"detr_compare: --records-merge: {path} holds records from {there}, this is {setup}; a "
                             f"table comes from one setup (give another --records file)")
        timing = timing or earlier.get("timing", [])  # one timing pass per file: a call that timed nothing keeps it
        records = _replace(earlier["records"], records, RUN)
        commands = [c for c in earlier.get("commands", [earlier.get("command")]) if c and c != command] + commands
    save(path, setup, commands, records, timing)


def join_records(paths, out):
    """One table of the records files ``paths``, which must share machine, torch and device: a run in several takes
    the last file's record, a variant timed in several the last file's timing (and it times every record of the
    variant, in every budget: the model is the same), the commands of every file are kept."""
    files = [json.loads(Path(p).read_text()) for p in paths]
    setups = {tuple(f.get(key) for key in SETUP) for f in files}
    if len(setups) != 1:
        raise SystemExit(f"detr_records: {list(map(str, paths))} come from {len(setups)} setups {sorted(setups)} "
                         f"(machine, torch, device); a table comes from one: join only files of one setup")
    records, timing, commands = [], [], []
    for f in files:
        records = _replace(records, f["records"], RUN)
        timing = _replace(timing, f.get("timing", []), ("variant",))
        commands += [c for c in f.get("commands", [f.get("command")]) if c and c not in commands]
    save(out, dict(zip(SETUP, setups.pop())), commands, records, timing)
    return json.loads(Path(out).read_text())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.detr_records", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("files", nargs="+", help="records files of detr_compare (--records), from one machine and torch")
    p.add_argument("--out", required=True, help="the joined table (JSON), its AP curves beside it (.png)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    joined = join_records(a.files, a.out)
    for entry in joined["summary"]:
        print(f"{entry['epochs']:>4} epochs  {entry['variant']:<28} n={len(entry['seeds'])}  AP {entry['AP']:.3f} "
              f"± {entry['AP_std']:.3f}  vs best softmax {entry.get('AP_vs_best_softmax', float('nan')):.0%}")
    print(f"wrote {a.out} and {Path(a.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
