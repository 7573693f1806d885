"""One MQAR run (tools/mqar.py runs the grid): the recall model, its training and its score.

A run at sequence 256 takes about half an hour on one core, so it checkpoints: its state goes to
``RUN_DIR/checkpoint.pt`` every ``--checkpoint-every`` steps, a later call continues from there with the batches,
weights and log an uninterrupted run has at that step, and the file is removed once the record is written."""
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from linear_mha.integrations.checkpoint_io import check_same_args, safe_load, save_atomic, write_text_atomic
from linear_mha.integrations.detr.plots import read_log
from linear_mha.lm import LinearAttentionTransformerLM
from linear_mha.progress import progress_bar

from .measure import cpu_name
from .mqar_data import IGNORE, POWER_A, mqar_examples

TEST_DATA_SEED = 1   # odd: never the seed of a training set (2 x the run's seed)
# Settings that change a run's result: a record (or checkpoint) written with others is refused, not reused
RUN_SETTINGS = ("method", "vocab", "dim", "depth", "heads", "steps", "batch_size", "lr", "weight_decay",
                "train_examples", "test_examples", "power_a", "shift_tokens")
CHECKPOINT = "checkpoint.pt"


class Method(NamedTuple):
    name: str        # as written in --methods: the runs' label
    mode: str        # the registry method of the global heads
    options: dict    # its options
    local_conv: bool
    short_conv: int = 0  # taps of the short convolution of queries, keys and values (0: none)


class RecallModel(nn.Module):
    """``linear_mha.lm``'s causal LM up to its normalised hidden states, then the next-token head (the LM's own:
    LayerNorm, then Linear) applied only where a target is scored: at width 64 projecting every position onto the
    vocabulary costs about as much as the layers, and 7 positions in 8 have no target."""

    def __init__(self, method: Method, vocab: int, seq_len: int, dim: int, depth: int, heads: int,
                 shift_tokens: bool = False):
        super().__init__()
        self.lm = LinearAttentionTransformerLM(vocab, dim, depth, seq_len, heads=heads, dim_head=dim // heads,
                                               causal=True, return_embeddings=True, global_mode=method.mode,
                                               global_options=method.options, local_conv=method.local_conv,
                                               short_conv=method.short_conv, shift_tokens=shift_tokens)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets):
        """tokens, targets (B, N) -> logits (Q, vocab) at the Q query positions, and their targets (Q,)."""
        hidden = self.lm(tokens)  # (B, N, dim), normalised
        scored = targets != IGNORE
        return self.head(hidden[scored]), targets[scored]


def shuffled_batches(count: int, batch_size: int, gen: torch.Generator):
    """Index batches (batch_size,) over a fresh permutation of the training set each epoch; endless."""
    while True:
        order = torch.randperm(count, generator=gen)
        for start in range(0, count - batch_size + 1, batch_size):
            yield order[start:start + batch_size]


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 2% of the steps, then a cosine decay to 0 (step counts from 0)."""
    warmup = max(1, steps // 50)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


@torch.no_grad()
def recall_accuracy(model, inputs, targets, batch_size: int, device) -> float:
    """Fraction of the query positions of (inputs, targets) (M, N) whose most likely next token is the target."""
    model.eval()
    right = total = 0
    for start in range(0, len(inputs), batch_size):
        logits, wanted = model(inputs[start:start + batch_size].to(device, torch.long),
                               targets[start:start + batch_size].to(device, torch.long))
        right += int((logits.argmax(-1) == wanted).sum())
        total += wanted.numel()
    model.train()
    return right / total


def run_settings(args, method: Method, lr: float) -> dict:
    return {"method": method.name, "vocab": args.vocab, "dim": args.dim, "depth": args.depth, "heads": args.heads,
            "steps": args.steps, "batch_size": args.batch_size, "lr": lr, "weight_decay": args.weight_decay,
            "train_examples": args.train_examples, "test_examples": args.test_examples, "power_a": POWER_A,
            "shift_tokens": args.shift_tokens}


def machine(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({cpu_name()}), {torch.get_num_threads()} threads"


def resume(run_dir: Path, settings: dict, model, opt) -> dict:
    """The training state saved in run_dir (step 0's if there is none), loaded into ``model`` and ``opt``; the log
    is cut back to the checkpoint's step, so it holds what an uninterrupted run had written by then."""
    path, log_path = run_dir / CHECKPOINT, run_dir / "log.jsonl"
    if not path.is_file():
        log_path.write_text("")  # a run without a checkpoint starts over, and so does its log
        return {"step": 0, "losses": [], "final": [], "acc": None, "seconds": 0.0}
    state = safe_load(path, "the run's checkpoint")
    check_same_args(state["settings"], settings, RUN_SETTINGS, "the run's checkpoint", path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    kept = [entry for entry in read_log(log_path) if entry["step"] <= state["step"]]  # a torn last line goes too
    write_text_atomic(log_path, "".join(json.dumps(entry) + "\n" for entry in kept))
    return state


def train_run(args, method: Method, seq_len: int, pairs: int, lr: float, seed: int, run_dir: Path, device) -> dict:
    """Train one model on one task from scratch, or on from run_dir's checkpoint; the log goes to
    run_dir/log.jsonl. Returns the run's record."""
    began = time.time()
    settings = run_settings(args, method, lr)
    train_x, train_y = mqar_examples(args.vocab, seq_len, pairs, args.train_examples, 2 * seed)
    test_x, test_y = mqar_examples(args.vocab, seq_len, pairs, args.test_examples, TEST_DATA_SEED)
    torch.manual_seed(seed)
    model = RecallModel(method, args.vocab, seq_len, args.dim, args.depth, args.heads, args.shift_tokens).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    batches = shuffled_batches(args.train_examples, args.batch_size, torch.Generator().manual_seed(seed))
    run_dir.mkdir(parents=True, exist_ok=True)
    state = resume(run_dir, settings, model, opt)
    for _ in range(state["step"]):  # the batches already trained on: drawing indices is cheap
        next(batches)
    losses, final, acc = state["losses"], state["final"], state["acc"]
    earlier = state["seconds"] - began  # + time.time(): the training seconds over every call
    bar = progress_bar(total=args.steps, initial=state["step"], disable=args.no_progress,
                       desc=f"{method.name} L{seq_len} kv{pairs} s{seed}")
    final_steps = max(1, args.steps // 20)  # the last 5% of the steps: the final training loss
    with open(run_dir / "log.jsonl", "a") as log:
        for step in range(state["step"] + 1, args.steps + 1):
            rate = learning_rate(step - 1, args.steps, lr)
            for group in opt.param_groups:
                group["lr"] = rate
            index = next(batches)
            logits, wanted = model(train_x[index].to(device, torch.long), train_y[index].to(device, torch.long))
            loss = F.cross_entropy(logits, wanted)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if step > args.steps - final_steps:
                final.append(losses[-1])
            bar.update(1)
            evaluate = step % args.eval_every == 0 or step == args.steps
            if evaluate or step % args.log_every == 0:
                entry = {"step": step, "loss": statistics.mean(losses), "lr": rate, "seconds": earlier + time.time()}
                losses = []
                if evaluate:
                    acc = entry["acc"] = recall_accuracy(model, test_x, test_y, 4 * args.batch_size, device)
                    bar.set_postfix(loss=f"{entry['loss']:.3f}", acc=f"{acc:.3f}")
                log.write(json.dumps(entry) + "\n")
                log.flush()
            if step % args.checkpoint_every == 0 and step < args.steps:
                save_atomic({"settings": settings, "model": model.state_dict(), "optimizer": opt.state_dict(),
                             "rng": torch.get_rng_state(), "step": step, "losses": losses, "final": final,
                             "acc": acc, "seconds": earlier + time.time()}, run_dir / CHECKPOINT)
    bar.close()
    return {**settings, "seed": seed, "seq_len": seq_len, "num_kv_pairs": pairs, "acc": acc,
            "final_loss": statistics.mean(final),
            "params": sum(p.numel() for p in model.parameters()), "seconds": earlier + time.time(),
            "machine": machine(device), "torch": torch.__version__, "device": str(device)}
