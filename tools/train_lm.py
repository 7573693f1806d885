#!/usr/bin/env python
"""Train a byte-level causal LinearAttentionTransformerLM; report bits per character (BPC).

Data:
  --enwik8 PATH   the first 100M bytes of enwik8, split 90M / 5M / 5M (train / val / test), the standard split.
  default         a deterministic corpus of --corpus-bytes bytes (default 12,000,000) made of the Python standard
                  library's own .py sources (``sysconfig.get_paths()["stdlib"]``, walked in sorted order, skipping
                  site-packages and __pycache__), concatenated in that order and split 90% / 5% / 5%. Every Python
                  install has them and nothing is downloaded; the bytes (so the numbers) depend on the Python version.

Outputs in --out: log.jsonl (one JSON object per eval, the checkpoint's own records), checkpoint.pt (resumed
with --resume; written every --checkpoint-every steps and when Ctrl-C or SIGTERM stops the run), curves.png,
results.json (final val/test BPC, parameter count, config, and the curve: step, train and validation BPC at each eval).

Several processes (DDP): ``torchrun --nproc_per_node=N -m linear_mha.tools.train_lm ...`` (gloo on the CPU, nccl
on CUDA with one GPU per process). --batch-size stays the global batch, split evenly over the processes, and every
process draws the same global batches from --seed: N processes train as one does, and --resume continues a run on
any number of processes that divides --batch-size. Process 0 alone prints and writes the files.

Variants (--variant, several joined by '+', e.g. hybrid+conv) for the attention ablation: baseline (plain global
linear heads), conv (local_conv), gate (attn_gate), full (gate + conv), softmax (every head local with window =
seq_len, i.e. exact causal softmax attention with the same parameters), hybrid (half the heads local softmax within
blocks of --local-window positions, each seeing the W to 2W - 1 positions before it, the others global: a sliding
window beside the linear heads, as Based pairs them; linear in the sequence length), shortconv (a causal 4-tap
depthwise convolution of the queries, keys and values before every head, as DeltaNet and Mamba-2 have; softmax heads
take it too: softmax+shortconv), norm (each head's output RMS-normalised, head_norm, as Gated DeltaNet does before
its output gate; with gate, the gated norm of those layers), rotary (rotary position embeddings on every head's
queries and keys in place of the learned absolute positions, as softmax Transformers now have; the global heads
take it too). The global heads run --global-mode, any registry method with a causal form (default: the LM's,
`kernel`; e.g. deltanet, gated_deltanet, gla, retention), with --global-option NAME=VALUE.

Example:  python -m linear_mha.tools.train_lm --steps 2000 --out runs/lm_baseline
"""
import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from linear_mha.integrations.checkpoint_io import check_same_args, safe_load, save_atomic, write_text_atomic
from linear_mha.integrations.detr.attention import parse_attention_options
from linear_mha.integrations.console import HelpFormatter, banner, choose_threads, duration, refuse_overwrite
from linear_mha.integrations.distributed import (all_reduce_mean_, init_distributed_mode, launched_world_size,
                                                 leave_process_group)
from linear_mha.integrations.stop import StopRequest
from linear_mha.lm import AutoregressiveWrapper, LinearAttentionTransformerLM
from linear_mha.progress import progress_bar

SHORT_CONV_TAPS = 4  # --variant shortconv: flash-linear-attention's conv_size for DeltaNet and Gated DeltaNet
VARIANTS = {
    "baseline": {},
    "conv": {"local_conv": True},
    "gate": {"attn_gate": True},
    "full": {"attn_gate": True, "local_conv": True},
    "softmax": {"softmax": True},
    "hybrid": {"hybrid": True},
    "shortconv": {"short_conv": SHORT_CONV_TAPS},
    "norm": {"head_norm": True},
    "rotary": {"use_rotary_emb": True},
}
HYBRID_WINDOW = 32  # --local-window's default: at --seq-len 256 a local head sees an eighth to a quarter of it


def variant_options(variant: str) -> dict:
    """The LM options of a --variant, 'NAME' or 'NAME+NAME...' (the names' options together)."""
    names = variant.split("+")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or len(set(names)) < len(names):
        raise ValueError(f"--variant {variant}: expected names from {', '.join(VARIANTS)}, each once, joined by '+' "
                         f"(e.g. hybrid+conv)")
    options = {}
    for name in names:
        options.update(VARIANTS[name])
    if options.get("softmax") and options.get("hybrid"):
        raise ValueError(f"--variant {variant}: softmax makes every head local and hybrid half of them; pick one")
    return options


def stdlib_corpus(n_bytes: int) -> bytes:
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    chunks.append(f.read())
                total += len(chunks[-1])
                if total >= n_bytes:
                    return b"".join(chunks)[:n_bytes]
    raise RuntimeError(f"the standard library at {root} holds only {total} bytes of .py files; "
                       f"lower --corpus-bytes or pass --enwik8 PATH")


def load_splits(args):
    if args.enwik8:
        if not Path(args.enwik8).is_file():
            raise FileNotFoundError(f"--enwik8 {args.enwik8} is not a file; pass the path of enwik8 (unzipped)")
        with open(args.enwik8, "rb") as f:
            data = f.read(100_000_000)
        if len(data) < 100_000_000:
            raise ValueError(f"--enwik8 {args.enwik8} has {len(data)} bytes; enwik8 has 100,000,000")
        cut = (90_000_000, 95_000_000)
    else:
        data = stdlib_corpus(args.corpus_bytes)
        cut = (int(len(data) * 0.9), int(len(data) * 0.95))
    arr = np.frombuffer(data, dtype=np.uint8)
    return {"train": arr[:cut[0]], "val": arr[cut[0]:cut[1]], "test": arr[cut[1]:]}


# --resume keeps these: they change what the checkpoint holds or how it goes on training
MODEL_ARGS = ("variant", "dim", "depth", "heads", "seq_len", "enwik8", "corpus_bytes", "global_mode", "global_option",
              "shift_tokens", "lr_schedule", "local_window")


def run_label(args) -> str:
    """The run's name in the banner, the progress bar and results.json: the variant, and the global heads' method
    when one was chosen."""
    return args.variant if args.global_mode is None else f"{args.variant} {args.global_mode}"


def build_model(args):
    kw = variant_options(args.variant)
    if kw.pop("softmax", False):
        kw.update(n_local_attn_heads=args.heads, local_attn_window_size=args.seq_len)
    if kw.pop("hybrid", False):
        kw.update(n_local_attn_heads=args.heads // 2,
                  local_attn_window_size=HYBRID_WINDOW if args.local_window is None else args.local_window)
    if args.global_mode is not None:
        kw.update(global_mode=args.global_mode,
                  global_options=parse_attention_options(args.global_option, flag="--global-option"))
    try:
        return LinearAttentionTransformerLM(256, args.dim, args.depth, args.seq_len, heads=args.heads,
                                            dim_head=args.dim // args.heads, causal=True,
                                            shift_tokens=args.shift_tokens, **kw)
    except (ValueError, TypeError) as err:
        if args.global_mode is None:
            raise
        options = [f"--global-option {o}" for o in args.global_option or []]
        given = " ".join([f"--global-mode {args.global_mode}"] + options)
        raise ValueError(f"{given}: {err}") from None


def learning_rate(step: int, args) -> float:
    """100 warm-up steps to --lr, then --lr held (constant) or decayed along a cosine to 0 at --steps (cosine: a
    run resumed with more --steps follows the longer curve from where it stands)."""
    warmup = 100
    if step < warmup:
        return args.lr * (step + 1) / warmup
    if args.lr_schedule == "constant":
        return args.lr
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


def random_batch(split, args, gen, rank=0, world=1):
    """This process's share of the next global batch of --batch-size windows. Every process draws the whole
    global batch from the same generator and keeps its own slice: the global batches, and the generator state a
    checkpoint holds, are the same whatever the number of processes."""
    starts = torch.randint(0, len(split) - args.seq_len - 1, (args.batch_size,), generator=gen).numpy()
    share = args.batch_size // world
    starts = starts[rank * share:(rank + 1) * share]
    return torch.from_numpy(np.stack([split[s:s + args.seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def window_starts(split, seq_len: int, max_bytes=None) -> np.ndarray:
    """Where the scored windows start: consecutive, non-overlapping windows of seq_len + 1 bytes, every seq_len
    bytes, over the first max_bytes of split (all of it if None)."""
    n = len(split) if max_bytes is None else min(len(split), max_bytes)
    return np.arange((n - 1) // seq_len) * seq_len


def evaluate(wrapper, split, args, max_bytes, rank=0, world=1):
    """BPC over consecutive non-overlapping windows covering the first max_bytes of the split (all if None).
    Several processes share the batches round-robin and sum their totals: each batch is the one a single process
    scores, so every process gets the single-process BPC up to the order of the sum."""
    wrapper.eval()
    starts = window_starts(split, args.seq_len, max_bytes)
    total, count = 0.0, 0
    for i in range(rank * args.batch_size, len(starts), world * args.batch_size):
        batch = np.stack([split[s:s + args.seq_len + 1] for s in starts[i:i + args.batch_size]])
        x = torch.from_numpy(batch.astype(np.int64)).to(args.device)
        loss = wrapper(x, return_loss=True)
        total += loss.item() * x.shape[0] * args.seq_len
        count += x.shape[0] * args.seq_len
    wrapper.train()
    if world > 1:
        sums = torch.tensor([total, count], dtype=torch.float64, device=args.device)
        torch.distributed.all_reduce(sums)
        total, count = sums.tolist()
    return total / max(count, 1) / math.log(2)


def plot(log, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["train_bpc"] for r in log], label="train")
    ax.plot(steps, [r["val_bpc"] for r in log], label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per character")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.train_lm", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--enwik8", help="path to enwik8 (else the standard-library corpus)")
    p.add_argument("--corpus-bytes", type=int, default=12_000_000, help="size of the standard-library corpus")
    p.add_argument("--variant", default="baseline",
                   help=f"attention variant: one of {', '.join(VARIANTS)}, or several joined by '+' (see above)")
    p.add_argument("--global-mode", metavar="METHOD",
                   help="registry method of the global heads, one with a causal form (default: the LM's, kernel)")
    p.add_argument("--global-option", action="append", metavar="NAME=VALUE",
                   help="an option of --global-mode (repeat the flag for several)")
    p.add_argument("--local-window", type=int, metavar="W",
                   help=f"--variant hybrid: the local heads' block (default {HYBRID_WINDOW}); each sees W to 2W - 1 "
                        "positions back")
    p.add_argument("--shift-tokens", action="store_true",
                   help="token shift: half of each position's features come from the previous position")
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--depth", type=int, default=4, help="layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads (dim must divide by it)")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per training sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all processes under "
                                                             "torchrun (each takes an equal share)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (100 warm-up steps)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="after the warm-up: --lr held, or decayed along a cosine to 0 at --steps")
    p.add_argument("--eval-every", type=int, default=200, help="steps between validation scores")
    p.add_argument("--val-bytes", type=int, default=262_144, help="bytes of validation scored at each eval")
    p.add_argument("--test-bytes", type=int, default=None, help="bytes of test scored at the end (default: all)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and batch order")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; set it to the free cores when "
                                               "the machine is shared)")
    p.add_argument("--out", default="runs/lm", help="output folder (checkpoint, log, curves, results)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out (else refused; --resume "
                                                            "continues it)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="steps between checkpoints (default: --eval-every); Ctrl-C / SIGTERM also save one")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


def save_state(args, path, model, opt, gen, step, log, train_losses, seconds, processes=1):
    # Written to a temporary file and renamed, so an interruption never leaves a torn checkpoint. The model is the
    # one inside DDP (no "module." prefix): a checkpoint resumes on any number of processes.
    save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                 "step": step, "log": log, "train_losses": train_losses, "seconds": seconds, "args": vars(args),
                 "processes": processes}, path)
    # The log is rewritten from the checkpoint's own records: a fresh run into an old --out, or a resume after
    # a crash, never leaves records that the checkpoint does not have.
    log_path = os.path.join(os.path.dirname(path), "log.jsonl")
    write_text_atomic(log_path, "".join(json.dumps(record) + "\n" for record in log))


def check_args(args, world=1):
    """Clear errors for settings that would otherwise crash deep inside or score nothing; world: the processes
    torchrun started, checked before they meet, so that every one of them refuses at once."""
    for name in ("corpus_bytes", "dim", "depth", "heads", "seq_len", "batch_size", "steps", "eval_every",
                 "val_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.test_bytes is not None and args.test_bytes < 1:
        raise ValueError(f"--test-bytes must be >= 1, got {args.test_bytes}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.global_option and args.global_mode is None:
        raise ValueError("--global-option sets an option of --global-mode: name the method too, e.g. "
                         "--global-mode gla --global-option chunk_size=32")
    variant = variant_options(args.variant)
    if variant.get("softmax") and args.global_mode is not None:  # every head local: none global
        raise ValueError(f"--variant {args.variant} makes every head a local softmax head, so there are no global "
                         f"heads for --global-mode {args.global_mode}: leave one of the two out")
    if args.dim % args.heads:
        raise ValueError(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    if args.local_window is not None and not variant.get("hybrid"):
        raise ValueError(f"--local-window sets the local heads of --variant hybrid; --variant {args.variant} has "
                         "none of that kind: pass --variant hybrid or leave --local-window out")
    if variant.get("hybrid") and args.heads < 2:
        raise ValueError(f"--variant hybrid makes half the heads local: it needs --heads >= 2 (got {args.heads})")
    if args.local_window is not None and args.local_window < 1:
        raise ValueError(f"--local-window must be >= 1, got {args.local_window}")
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} is the global batch (sequences per step over all "
                         f"processes) and must divide by the {world} processes torchrun started: pass a multiple of "
                         f"{world}, or start a number of processes that divides {args.batch_size}")


def check_splits(splits, args):
    """Every split must hold at least one training window (and the scored part of it one evaluation window): else
    the BPC of a split is computed over nothing and would read 0.0."""
    need = args.seq_len + 1
    scored = {"train": len(splits["train"]), "val": min(len(splits["val"]), args.val_bytes),
              "test": len(splits["test"]) if args.test_bytes is None else min(len(splits["test"]), args.test_bytes)}
    for name, size in scored.items():
        if size < need:
            flag = {"val": " or --val-bytes", "test": " or --test-bytes"}.get(name, "")
            raise ValueError(f"the {name} split has {size} bytes to score, fewer than one window of --seq-len "
                             f"{args.seq_len} + 1 = {need}; raise --corpus-bytes (the {name} split is "
                             f"{'90' if name == 'train' else '5'}% of it){flag}, "
                             f"or lower --seq-len")


def main(argv=None):
    args = parse_args(argv)
    check_args(args, launched_world_size())
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    checkpoint_every = args.checkpoint_every or args.eval_every
    threads = choose_threads(args.threads)
    if not (args.resume or args.overwrite):  # before the processes meet, so before any of them has written
        refuse_overwrite(args.out, ("checkpoint.pt", "log.jsonl"), resume_hint="--resume", out_flag="--out")
    rank, world, local = init_distributed_mode(args.device)
    if world > 1 and str(args.device).startswith("cuda"):
        args.device = f"cuda:{local}"
    main_process = rank == 0
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    splits = load_splits(args)
    check_splits(splits, args)
    model = build_model(args).to(args.device)
    wrapper = AutoregressiveWrapper(model)  # every byte counts in the loss, 0 included
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    step, log, train_losses, seconds_before = 0, [], [], 0.0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if args.resume and os.path.exists(ckpt_path):  # every process loads it: --out must be on a shared filesystem
        ckpt = safe_load(ckpt_path, "--resume", map_location="cpu")
        if not isinstance(ckpt, dict) or not {"model", "optimizer", "generator", "step", "log"} <= set(ckpt):
            raise ValueError(f"--resume: {ckpt_path} is not a checkpoint written by tools/train_lm.py (it lacks "
                             f"model, optimizer, generator, step or log); point --out at a run of this tool")
        check_same_args(ckpt.get("args"), vars(args), MODEL_ARGS, "--resume", ckpt_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["generator"])
        step, log = ckpt["step"], ckpt["log"]
        train_losses, seconds_before = ckpt.get("train_losses", []), ckpt.get("seconds", 0.0)
        if main_process:
            print(f"resumed from {ckpt_path} at step {step} (written by {ckpt.get('processes', 1)} process(es), "
                  f"continued by {world})", file=sys.stderr)
    elif args.resume and main_process:
        print(f"--resume: no checkpoint at {ckpt_path} yet; starting at step 0", file=sys.stderr)
    # Under torchrun the wrapper runs inside DDP, whose backward averages the gradients over the processes: with
    # equal shares of the global batch, the gradient of the global batch's mean loss.
    train_wrapper = wrapper if world == 1 else DistributedDataParallel(
        wrapper, device_ids=[local] if str(args.device).startswith("cuda") else None)
    n_params = sum(p.numel() for p in model.parameters())
    if main_process:
        shares = f"; {world} processes (DDP), {args.batch_size // world} sequences each" if world > 1 else ""
        banner("byte-level linear-attention LM training", {
            "data": args.enwik8 or f"standard-library corpus, {len(splits['train']):,} / {len(splits['val']):,} / "
                                   f"{len(splits['test']):,} bytes (train / val / test)",
            "model": f"{run_label(args)}: dim {args.dim}, depth {args.depth}, {args.heads} heads, "
                     f"{n_params:,} parameters",
            "schedule": f"{args.steps} steps of {args.batch_size} x {args.seq_len} bytes"
                        + (f", from step {step}" if step else "") + f"; validation every {args.eval_every}",
            "device": f"{args.device}, threads {threads}{shares}",
            "output": f"{args.out}/ (checkpoint.pt, log.jsonl, curves.png, results.json)"}, stream=sys.stderr)
    bar = progress_bar(total=args.steps, initial=step, disable=args.no_progress or not main_process,
                       desc=f"{run_label(args)} seed {args.seed}")
    start = time.time() - seconds_before  # "seconds" in the log counts training time across resumes
    with StopRequest() as stop:
        while step < args.steps:
            x = random_batch(splits["train"], args, gen, rank, world).to(args.device)
            lr = learning_rate(step, args)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = train_wrapper(x, return_loss=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # of the averaged gradients: same on every process
            opt.step()
            step += 1
            train_losses.append(all_reduce_mean_(loss.detach().clone()).item())  # the global batch's loss
            bar.update(1)
            if step % args.eval_every == 0 or step == args.steps:
                record = {"step": step, "train_bpc": float(np.mean(train_losses)) / math.log(2),
                          "val_bpc": evaluate(wrapper, splits["val"], args, args.val_bytes, rank, world),
                          "seconds": time.time() - start}
                train_losses = []
                log.append(record)
                bar.set_postfix(val_bpc=f"{record['val_bpc']:.3f}")
            # Read once: a signal between two reads would exit unsaved.
            stopping = stop.agreed(args.device) and step < args.steps
            if main_process and (step % checkpoint_every == 0 or step % args.eval_every == 0 or step == args.steps
                                 or stopping):
                save_state(args, ckpt_path, model, opt, gen, step, log, train_losses, time.time() - start, world)
            if stopping:
                bar.close()
                del train_wrapper  # DDP holds the process group; see the end of main
                leave_process_group()  # after process 0 has written the checkpoint
                if main_process:
                    print(f"stopped at step {step} of {args.steps}; {ckpt_path} holds it, and --resume continues "
                          "from there", file=sys.stderr)
                raise SystemExit(130)
    bar.close()
    seconds = time.time() - start  # training only, across resumes
    results = {"variant": run_label(args), "seed": args.seed, "params": n_params, "steps": step,
               "tokens_seen": step * args.batch_size * args.seq_len,
               "val_bpc": evaluate(wrapper, splits["val"], args, args.test_bytes, rank, world),
               "test_bpc": evaluate(wrapper, splits["test"], args, args.test_bytes, rank, world),
               "seconds": seconds, "data": args.enwik8 or f"stdlib corpus, {args.corpus_bytes} bytes",
               "processes": world, "config": vars(args),
               "curve": [{key: entry[key] for key in ("step", "train_bpc", "val_bpc")} for entry in log]}
    if main_process:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        if log:
            plot(log, os.path.join(args.out, "curves.png"))
        print(f"{run_label(args)}: val {results['val_bpc']:.4f} / test {results['test_bpc']:.4f} bits per character "
              f"after {step} steps ({duration(seconds)} training); files in {args.out}/", file=sys.stderr)
        print(json.dumps({k: results[k] for k in ("variant", "seed", "params", "val_bpc", "test_bpc")}))
    # DDP holds the process group: left alive past destroy_process_group, gloo's threads would be stopped only at
    # interpreter exit, which aborts a process now and then ("terminate called without an active exception").
    del train_wrapper
    leave_process_group()
    return results


if __name__ == "__main__":
    main()
