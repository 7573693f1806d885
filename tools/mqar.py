#!/usr/bin/env python
"""Multi-query associative recall (MQAR, Zoology: Arora, Eyuboglu et al. 2023): can a causal LM whose global heads
run a given method recall, at each query, the value bound to a key earlier in the sequence? Exact softmax attention
(``softmax``) is the ceiling; a linear method holds the whole context in a fixed-size state and may not.

    linear-mha-mqar                                   # softmax and kernel, sequence 64 with 8 pairs, seed 0
    linear-mha-mqar --methods softmax kernel focused hedgehog:window=16 kernel-dwc3 --kv-pairs 64:8 128:16 256:32 \\
        --seeds 0 1 2 --threads 1 --out runs/mqar --json docs/results/mqar.json

Data (tools/mqar_data.py): --train-examples sequences for training (drawn from the run's seed) and a held-out set of
--test-examples (its own seed, the same for every run of a task). Model: ``linear_mha.lm``'s causal
LinearAttentionTransformerLM of --vocab tokens, width --dim, --depth layers of --heads heads, learned positions, every
head global and running the method. Methods are named as in detr_compare, '<method>[-dwc3][-sc<K>][:option=value,
...]': a registry method (any with a causal form), '-dwc3' adding the LM's local term (``local_conv``: a causal 3-tap
depthwise convolution of the values beside attention), '-sc<K>' the short convolution of queries, keys and values
before the heads (``short_conv``, K taps; DeltaNet's and Gated DeltaNet's is -sc4), options going to the method.
Training: AdamW (--lr, --weight-decay), a linear warm-up over the first 2% of --steps then a cosine decay to 0,
gradients clipped at 1, the cross-entropy of the query positions only. Score: recall accuracy, the fraction of the
test set's query positions whose most likely next token is the bound value.

Learning rates: MQAR is learnt in a sudden drop of the loss after a plateau, and at too low a rate a seed may not
leave the plateau within the budget. With several --lr values every method and task trains at each (as Zoology
sweeps them), and the table takes, per method and task, the rate whose final training loss (the mean over the last
5% of the steps), averaged over the seeds that every rate has run, is lowest: the choice never looks at the test set.
Every rate's accuracy stays in the records and the summary.

Every (method, seq_len, pairs, lr, seed) run lives in OUT/<method>/seq<L>_kv<P>/lr<lr>/seed<S>/: log.jsonl (step,
training loss, learning rate, seconds; the test accuracy every --eval-every steps) and checkpoint.pt (every
--checkpoint-every steps) as it trains, and record.json when it is done. A later call skips every run that has its
record and continues a run cut short from its checkpoint (refusing either if written with other settings), so an
interrupted grid continues where it stopped, losing at most --checkpoint-every steps. At the end: a table of
accuracy (mean ± std over seeds, at the chosen rate) per method and task, OUT/mqar.png (accuracy against sequence
length per method), and OUT/results.json (with --json, also there): the records, each with steps, lr, final loss,
seconds, machine and torch version, and the summary.

--records FILE (e.g. docs/results/mqar.json) keeps a table that takes longer than one machine's session: the runs
it holds count as done, and every run that finishes is added to it at once, with the summary of all its records and
FILE's .png beside it. Processes may share one file (give each its own --methods); a file from another machine or
torch version is refused, and so is a run it holds with other settings.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

from linear_mha.integrations.checkpoint_io import check_same_args, write_text_atomic
from linear_mha.integrations.console import HelpFormatter, banner, choose_threads, duration
from linear_mha.integrations.detr.attention import parse_attention_options
from linear_mha.lm.self_attention import SelfAttention
from linear_mha.registry import method_class

from .mqar_data import check_task
from .mqar_train import CHECKPOINT, RUN_SETTINGS, Method, machine, run_settings, train_run
from .records_file import add_record, find_record, read_results
from .variant_names import split_variant

LOCAL_CONV_TAPS = 3  # SelfAttention's local_conv: a fixed 3-tap causal depthwise convolution
RUN_KEY = ("method", "seq_len", "num_kv_pairs", "lr", "seed")  # one run of the grid


def split_short_conv(name: str):
    """'gated_deltanet-dwc3-sc4:chunk_size=32' -> ('gated_deltanet-dwc3:chunk_size=32', 4): the name without its
    short convolution, as split_variant reads it, and the convolution's taps (0 without '-sc<K>')."""
    base, colon, options = name.partition(":")
    short = re.fullmatch(r"(.+)-sc(\d+)", base)
    return (short.group(1) + colon + options, int(short.group(2))) if short else (name, 0)


def parse_method(name: str, dim: int, heads: int) -> Method:
    """A --methods entry checked by building the attention layer it names: an unknown method or option, or a method
    without a causal form, raises ValueError naming the entry (and the layer's reason, from the registry)."""
    variant, short_conv = split_short_conv(name)
    if variant != name and short_conv < 1:
        raise ValueError(f"--methods {name!r}: -sc<K> adds a short convolution of K >= 1 taps; write e.g. -sc4 or "
                         f"leave it out")
    mode, dwc_kernel, items = split_variant(variant)
    if dwc_kernel not in (None, LOCAL_CONV_TAPS):
        raise ValueError(f"--methods {name!r}: the LM's local term (local_conv) is a causal convolution of "
                         f"{LOCAL_CONV_TAPS} taps; write -dwc{LOCAL_CONV_TAPS} or leave it out")
    options = parse_attention_options(items, flag=f"--methods {name!r}:")
    try:
        SelfAttention(dim, heads=heads, causal=True, local_conv=dwc_kernel is not None, short_conv=short_conv,
                      global_mode=mode, global_options=options)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--methods {name!r}: {err}") from None
    return Method(name, mode, options, dwc_kernel is not None, short_conv)


def task_grid(seq_lens, kv_pairs, vocab):
    """[(seq_len, pairs)]: --kv-pairs counts crossed with --seq-lens (default 64), or --kv-pairs items 'L:P'."""
    explicit = [item for item in kv_pairs if ":" in item]
    if explicit:
        if len(explicit) != len(kv_pairs):
            raise ValueError(f"--kv-pairs {' '.join(kv_pairs)}: give pair counts (crossed with --seq-lens) or "
                             f"seq_len:pairs items, not both")
        if seq_lens is not None:
            raise ValueError("--seq-lens and seq_len:pairs items in --kv-pairs both set the lengths; give one")
        if not all(re.fullmatch(r"\d+:\d+", item) for item in kv_pairs):
            raise ValueError(f"--kv-pairs {' '.join(kv_pairs)}: expected seq_len:pairs items such as 64:8 128:16")
        tasks, seq_name = [tuple(int(v) for v in item.split(":")) for item in kv_pairs], "--kv-pairs"
    else:
        if not all(item.isdigit() for item in kv_pairs):
            raise ValueError(f"--kv-pairs {' '.join(kv_pairs)}: expected pair counts such as 8 16, or seq_len:pairs")
        tasks, seq_name = [(seq_len, int(p)) for seq_len in (seq_lens or [64]) for p in kv_pairs], "--seq-lens"
    for seq_len, pairs in tasks:
        check_task(vocab, seq_len, pairs, names=("--vocab", seq_name, "--kv-pairs"))
    return list(dict.fromkeys(tasks))


def run_dir_of(out, method: Method, seq_len: int, pairs: int, lr: float, seed: int) -> Path:
    # the method name as a folder name: ':' and ',' (options) become '_'
    return (Path(out) / re.sub(r"[^\w.=+-]", "_", method.name) / f"seq{seq_len}_kv{pairs}" / f"lr{lr:g}"
            / f"seed{seed}")


def run_grid(args, methods, tasks, device, command):
    """Every (method, task, seed) run's record: read where it exists (with the same settings) in --out or the
    --records file, else trained (and added to the --records file at once)."""
    runs = [(method, seq_len, pairs, lr, seed) for method in methods for seq_len, pairs in tasks for lr in args.lr
            for seed in args.seeds]
    setup = {"machine": machine(device), "torch": torch.__version__, "device": str(device)}
    records_path = Path(args.records) if args.records else None
    records = []
    for number, (method, seq_len, pairs, lr, seed) in enumerate(runs, start=1):
        run_dir = run_dir_of(args.out, method, seq_len, pairs, lr, seed)
        record_path = run_dir / "record.json"
        label = f"[{number}/{len(runs)}] {method.name}, seq {seq_len}, {pairs} pairs, lr {lr:g}, seed {seed}"
        settings = run_settings(args, method, lr)
        kept = in_file = None
        if records_path:  # read again for every run: another process may have added it meanwhile
            wanted = {**settings, "seq_len": seq_len, "num_kv_pairs": pairs, "seed": seed}
            kept = in_file = find_record(read_results(records_path, setup).get("records", []), wanted, RUN_KEY,
                                         settings, RUN_SETTINGS, records_path)
        if kept is None and record_path.exists():
            kept = json.loads(record_path.read_text())
            check_same_args(kept, settings, RUN_SETTINGS, "--out", record_path)
        if kept is not None:
            record = kept
            print(f"{label}: done before (accuracy {record['acc']:.4f}), skipped", file=sys.stderr)
        else:
            print(f"{label}: training", file=sys.stderr)
            record = train_run(args, method, seq_len, pairs, lr, seed, run_dir, device)
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(record_path, json.dumps(record, indent=1))
            (run_dir / CHECKPOINT).unlink(missing_ok=True)  # only now: a run killed before its record resumes
            print(f"{label}: accuracy {record['acc']:.4f} in {duration(record['seconds'])}", file=sys.stderr)
        if records_path and in_file is None:  # a run of --out that the file lacks joins it too
            add_record(records_path, record, RUN_KEY, setup, command, summarize,
                       draw=lambda results: plot(results["summary"], records_path.with_suffix(".png")))
        records.append(record)
    return records


def _mean_std(values):
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(records):
    """Per (method, seq_len, pairs), in the order of the runs: every learning rate's accuracy (mean and sample std
    over seeds) and mean final training loss, and the rate chosen by that loss, whose accuracy is the row's. The
    rates are compared on the seeds every one of them has run (``chosen_on``; all of each rate's seeds where they
    share none): a rate that so far ran only an easy seed must not win over one that also ran a hard one."""
    exact = {name: method_class(split_variant(split_short_conv(name)[0]).base).exact
             for name in dict.fromkeys(r["method"] for r in records)}
    summary = []
    for method, seq_len, pairs in dict.fromkeys((r["method"], r["seq_len"], r["num_kv_pairs"]) for r in records):
        task = [r for r in records if (r["method"], r["seq_len"], r["num_kv_pairs"]) == (method, seq_len, pairs)]
        by_lr = {}
        for lr in dict.fromkeys(r["lr"] for r in task):
            runs = [r for r in task if r["lr"] == lr]
            acc, acc_std = _mean_std([r["acc"] for r in runs])
            by_lr[lr] = {"acc": acc, "acc_std": acc_std, "final_loss": statistics.mean(r["final_loss"] for r in runs),
                         "seeds": len(runs)}
        shared = set.intersection(*({r["seed"] for r in task if r["lr"] == lr} for lr in by_lr))
        compared = [r for r in task if r["seed"] in shared] if shared else task
        chosen = min(by_lr, key=lambda lr: statistics.mean(r["final_loss"] for r in compared if r["lr"] == lr))
        summary.append({"method": method, "exact": exact[method], "seq_len": seq_len, "num_kv_pairs": pairs,
                        "lr": chosen, **by_lr[chosen], "chosen_on": sorted({r["seed"] for r in compared}),
                        "by_lr": [{"lr": lr, **row} for lr, row in by_lr.items()]})
    return summary


def print_table(summary):
    print("method | seq_len | kv pairs | lr (lowest final loss) | recall accuracy (mean ± std over seeds) | seeds | "
          "accuracy at each lr")
    print("--- | --- | --- | --- | --- | --- | ---")
    for row in summary:
        name = row["method"] + (" (exact)" if row["exact"] else "")
        each = ", ".join(f"{r['lr']:g}: {r['acc']:.4f}" for r in row["by_lr"])
        print(f"{name} | {row['seq_len']} | {row['num_kv_pairs']} | {row['lr']:g} | {row['acc']:.4f} ± "
              f"{row['acc_std']:.4f} | {row['seeds']} | {each}")


def plot(summary, path):
    """Accuracy against sequence length, a line per method (per method and pair count when a length has several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = any(len({r["num_kv_pairs"] for r in summary if r["seq_len"] == row["seq_len"]}) > 1 for row in summary)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for line in dict.fromkeys((r["method"], r["num_kv_pairs"] if several else None) for r in summary):
        rows = sorted((r for r in summary if (r["method"], r["num_kv_pairs"] if several else None) == line),
                      key=lambda r: r["seq_len"])
        label = line[0] if line[1] is None else f"{line[0]}, {line[1]} pairs"
        ax.errorbar([r["seq_len"] for r in rows], [r["acc"] for r in rows], yerr=[r["acc_std"] for r in rows],
                    marker="o", capsize=3, label=label)
    lengths = sorted({r["seq_len"] for r in summary})
    pairs_of = {r["seq_len"]: r["num_kv_pairs"] for r in summary}
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) if several else f"{n}\n({pairs_of[n]} pairs)" for n in lengths])
    ax.set(xlabel="sequence length", ylabel="recall accuracy (held-out, ±1 std over seeds)", ylim=(0, 1.02),
           title="MQAR: multi-query associative recall")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.mqar", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--methods", nargs="+", default=["softmax", "kernel"],
                   help="registry methods of the global heads: '<method>[-dwc3][-sc<K>][:option=value,...]'")
    p.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths, crossed with --kv-pairs (default: 64)")
    p.add_argument("--kv-pairs", nargs="+", default=["8"],
                   help="key-value pairs per sequence, or seq_len:pairs items (e.g. 64:8 128:16 256:32)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed: initialisation and data")
    p.add_argument("--vocab", type=int, default=1024, help="tokens; keys the lower half, values the upper")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--depth", type=int, default=2, help="layers")
    p.add_argument("--heads", type=int, default=1, help="heads per layer, all global (Zoology's attention has 1)")
    p.add_argument("--shift-tokens", action="store_true",
                   help="every model (softmax too) mixes half of each token's features with the previous token's "
                        "(the LM's shift_tokens): the short look-back recall models pair with a linear state")
    p.add_argument("--steps", type=int, default=4000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-3],
                   help="peak AdamW learning rate(s); with several, each is trained and the table takes the one of "
                        "lowest final training loss (see above)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (Zoology's)")
    p.add_argument("--train-examples", type=int, default=100_000, help="training sequences per run (Zoology's)")
    p.add_argument("--test-examples", type=int, default=3_000, help="held-out sequences scored (Zoology's)")
    p.add_argument("--eval-every", type=int, default=500, help="steps between test accuracies in the log")
    p.add_argument("--log-every", type=int, default=50, help="steps between training-loss entries in the log")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="steps between a run's checkpoints: a run killed meanwhile continues from the last one")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; the free cores on a shared "
                                               "machine)")
    p.add_argument("--out", default="runs/mqar", help="run folders, results.json and mqar.png")
    p.add_argument("--json", help="also write the results (records and summary) to this file")
    p.add_argument("--records", metavar="FILE",
                   help="a results file that runs add up in across calls, processes and machines' sessions: a run "
                        "it holds is not trained again, a finished run is added at once (see above)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """Clear errors, naming the option, for settings that would fail deep inside or train on nothing."""
    for name in ("vocab", "dim", "depth", "heads", "steps", "batch_size", "train_examples", "test_examples",
                 "eval_every", "log_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not all(lr > 0 for lr in args.lr) or args.weight_decay < 0:
        raise ValueError(f"--lr must be > 0 and --weight-decay >= 0, got {' '.join(map(str, args.lr))} and "
                         f"{args.weight_decay}")
    args.lr = list(dict.fromkeys(args.lr))
    if args.dim % args.heads:
        raise ValueError(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    if args.train_examples < args.batch_size:
        raise ValueError(f"--train-examples ({args.train_examples}) must hold one batch of --batch-size "
                         f"({args.batch_size})")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    tasks = task_grid(args.seq_lens, args.kv_pairs, args.vocab)
    methods = [parse_method(name, args.dim, args.heads) for name in dict.fromkeys(args.methods)]
    threads = choose_threads(args.threads)
    device = torch.device(args.device)
    banner("MQAR: multi-query associative recall", {
        "methods": ", ".join(m.name for m in methods),
        "tasks": ", ".join(f"seq {n} / {p} pairs" for n, p in tasks) + f"; seeds {' '.join(map(str, args.seeds))}",
        "model": f"vocab {args.vocab}, width {args.dim}, {args.depth} layers of {args.heads} head(s)"
                 + (", token shift" if args.shift_tokens else ""),
        "schedule": f"{args.steps} steps of {args.batch_size} sequences, lr {' '.join(f'{lr:g}' for lr in args.lr)}; "
                    f"{args.train_examples:,} "
                    f"training / {args.test_examples:,} test sequences",
        "device": f"{device}, threads {threads}",
        "output": f"{args.out}/ (a folder per run, results.json, mqar.png)"}, stream=sys.stderr)
    command = "python -m linear_mha.tools.mqar " + " ".join(argv)
    records = run_grid(args, methods, tasks, device, command)
    summary = summarize(records)
    print_table(summary)
    results = {"command": command, "machine": machine(device),
               "torch": torch.__version__, "device": str(device), "records": records, "summary": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # every run may have come from --records
    write_text_atomic(out / "results.json", json.dumps(results, indent=1))
    plot(summary, out / "mqar.png")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.json, json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
