"""What every model of tools.calibrate_bench shares: training a model one cycle, and the rows a converted model gets
after its original (plain patch, calibrated, fine-tuned, distilled)."""
import copy
import itertools
import time
from pathlib import Path

import torch

from linear_mha import calibrate, patch
from linear_mha.integrations.checkpoint_io import check_same_args, safe_load, save_atomic
from linear_mha.progress import progress_bar


def train_one_cycle(model, batches_, loss_fn, steps, lr, weight_decay, desc="training the softmax model"):
    """Train ``model`` for ``steps`` batches of the iterable ``batches_`` with AdamW under a one-cycle schedule
    (10% warm-up) at peak ``lr``; ``loss_fn(model, batch)`` is the loss. Returns the model."""
    train_resumable(model, batches_, loss_fn, steps, lr, weight_decay, desc)
    return model


def train_resumable(model, batches_, loss_fn, steps, lr, weight_decay, desc, checkpoint=None, every=100):
    """``train_one_cycle``, and with ``checkpoint`` (a path) its state (weights, optimiser, schedule, torch's RNG,
    the step and the seconds spent) is saved there every ``every`` steps; a call that finds the file continues from
    it and ends with the weights an uninterrupted run has, provided ``batches_`` yields the same batches on every
    call. The file is left for the caller to remove. Returns the seconds spent training, over every call."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    settings = {"steps": steps, "lr": lr, "weight_decay": weight_decay}
    start, seconds = 0, 0.0
    if checkpoint is not None and Path(checkpoint).is_file():
        state = safe_load(checkpoint, "the run's checkpoint")
        check_same_args(state["settings"], settings, settings, "the run's checkpoint", checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])
        start, seconds = state["step"], state["seconds"]
    bar = progress_bar(itertools.islice(batches_, start, steps), total=steps, initial=start, desc=desc)
    began = time.perf_counter()
    for i, batch in enumerate(bar, start):
        loss = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if i % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        if checkpoint is not None and (i + 1) % every == 0 and i + 1 < steps:
            save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "schedule": schedule.state_dict(), "rng": torch.get_rng_state(), "step": i + 1,
                         "seconds": seconds + time.perf_counter() - began, "settings": settings}, checkpoint)
    return seconds + time.perf_counter() - began


def calibration_stages(a, seed, original, inputs, finetune, metric, score):
    """The records every model's table has after its original: ``original`` patched with --mode, then calibrated
    on ``inputs`` for each of --calibration-steps (0: the plain patch), at --finetune-after also fine-tuned by
    ``finetune(model, steps)`` for --finetune-steps, and at --distill-after distilled from the original for
    --distill-steps (calibrate's distill=True); ``score(model)`` is the value stored under ``metric``."""
    records = []
    for steps in [0] + a.calibration_steps:
        model = copy.deepcopy(original)
        patch(model, a.mode, **a.options)
        if steps:
            calibrate(model, inputs, steps=steps, lr=a.lr, seed=seed, progress=False)
        records.append(dict(seed=seed, stage="patch" if not steps else "calibrated", calibration_steps=steps,
                            finetune_steps=0, **{metric: score(model)}))
        if steps == a.distill_after and a.distill_steps:
            distilled = copy.deepcopy(model)
            calibrate(distilled, inputs, steps=0, eval_batches=0, finetune_steps=a.distill_steps,
                      finetune_lr=a.distill_lr, distill=True, seed=seed, progress=False)
            records.append(dict(seed=seed, stage="calibrated + distilled", calibration_steps=steps,
                                finetune_steps=a.distill_steps, **{metric: score(distilled)}))
        if steps == a.finetune_after:
            finetune(model, a.finetune_steps)
            records.append(dict(seed=seed, stage="calibrated + fine-tuned", calibration_steps=steps,
                                finetune_steps=a.finetune_steps, **{metric: score(model)}))
    if a.options.get("window"):  # the ablation: how much comes from the exact window and how much from the maps
        model = copy.deepcopy(original)
        patch(model, a.mode, **a.options)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("hedgehog_window_logit"):
                    p.fill_(1e4)  # sigmoid = 1: all weight on the window, far keys dropped
        records.append(dict(seed=seed, stage="window alone (softmax over the window, far keys dropped)",
                            calibration_steps=0, finetune_steps=0, **{metric: score(model)}))
    return records
