"""One training epoch and one evaluation pass (tqdm progress, AMP on CUDA, gradient clipping)."""
import itertools
import math
from collections import defaultdict

import torch

from linear_mha.progress import progress_bar

from .coco_eval import STAT_NAMES, CocoEvaluator
from ..distributed import is_main_process, reduce_dict


def _targets_to(targets, device):
    return [{k: v.to(device) for k, v in t.items()} for t in targets]


def _weighted_total(loss_dict, weight_dict):
    return sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)


def _reduce_with_stop(values, stop, device):
    """reduce_dict over processes, with ``stop.local`` (this process was signalled) riding along: every process
    learns whether any was asked to stop from the reduction each step makes anyway, without a collective of its
    own. Returns (reduced values, whether to stop)."""
    if stop is None:
        return reduce_dict(values), False
    logged = reduce_dict({**values, "_stop": torch.tensor(1.0 if stop.local else 0.0, device=device)})
    return logged, bool(logged.pop("_stop") > 0)


class Meter:
    """Running means; ``state()`` / ``Meter(state)`` carry an interrupted epoch's sums across a resume."""

    def __init__(self, state=None):
        self.sums, self.counts = defaultdict(float), defaultdict(int)
        if state:
            self.sums.update(state["sums"])
            self.counts.update(state["counts"])

    def state(self):
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    def update(self, **values):
        for k, v in values.items():
            self.sums[k] += float(v)
            self.counts[k] += 1

    def averages(self):
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, max_norm=0.0, scaler=None,
                    amp=False, max_iters=0, progress=True, start_iter=0, meter=None, stop=None, bar=None,
                    teacher=None):
    """Trains until the loader (or --max-iters) ends, or stops after a step once any process's ``stop`` (an
    integrations.stop.StopRequest) was signalled.
    A resumed epoch passes the loader of its remaining batches, ``start_iter`` (batches already done) and the
    ``meter`` holding their losses. Returns (meter, batches done in the epoch, whether it was stopped early);
    ``meter.averages()`` is the epoch's mean of every (process-averaged) loss, `loss` the weighted total.
    ``bar``: a tqdm to advance by one per step (the trainer's bar over all epochs), else the epoch shows its own.
    ``teacher``: a model whose outputs on the batch replace the labels (--distill; ``criterion`` compares them)."""
    model.train()
    criterion.train()
    meter = Meter() if meter is None else meter
    weight_dict = criterion.weight_dict
    end = start_iter + len(data_loader)
    end = min(end, max_iters) if max_iters else end
    own_bar = bar is None  # the trainer passes one bar over the whole run; alone, the epoch gets its own
    if own_bar:
        bar = progress_bar(total=end, initial=start_iter, desc=f"epoch {epoch}",
                           disable=not (progress and is_main_process()), leave=False)
    it, stopped = start_iter, False
    # islice: with --max-iters, no batch past the last is loaded (its transforms would draw from the RNG).
    for samples, targets in itertools.islice(data_loader, end - start_iter):
        samples, targets = samples.to(device), _targets_to(targets, device)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp):
            outputs = model(samples)
            if teacher is not None:
                with torch.no_grad():
                    targets = teacher(samples)
        loss_dict = criterion(outputs, targets)  # the criterion upcasts half-precision outputs itself
        losses = _weighted_total(loss_dict, weight_dict)
        logged, stopping = _reduce_with_stop(loss_dict, stop, device)
        loss_value = float(_weighted_total(logged, weight_dict))
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at epoch {epoch} iteration {it} ({logged}); "
                                     "lower --lr or keep --clip-max-norm > 0")
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.unscale_(optimizer)
        else:
            losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        meter.update(loss=loss_value, lr=optimizer.param_groups[0]["lr"],
                     **{k: v for k, v in logged.items() if k in weight_dict or "error" in k})
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}")
        it += 1
        if stopping and it < end:
            stopped = True
            break
    if own_bar:
        bar.close()
    return meter, it, stopped


@torch.no_grad()
def evaluate(model, criterion, postprocessors, data_loader, coco_gt, device, amp=False, progress=True, stop=None,
             verbose=False):
    """Returns (mean losses, COCO stats as a dict of the 12 names plus `coco_eval_bbox` list), or None when
    ``stop`` was signalled on any process: an evaluation is redone whole, so it ends at once. ``verbose`` prints
    COCOeval's table."""
    model.eval()
    criterion.eval()
    meter = Meter()
    evaluator = CocoEvaluator(coco_gt)
    shown = progress and is_main_process()
    for samples, targets in progress_bar(data_loader, desc="eval", disable=not shown, leave=False):
        samples, targets = samples.to(device), _targets_to(targets, device)
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp):
            outputs = model(samples)
        logged, stopping = _reduce_with_stop(criterion(outputs, targets), stop, device)
        if stopping:
            return None
        meter.update(loss=float(_weighted_total(logged, criterion.weight_dict)),
                     **{k: v for k, v in logged.items() if k in criterion.weight_dict or "error" in k})
        orig_sizes = torch.stack([t["orig_size"] for t in targets])
        results = postprocessors["bbox"](outputs, orig_sizes)
        evaluator.update({int(t["image_id"]): r for t, r in zip(targets, results)})
    stats = evaluator.summarize()
    if is_main_process() and verbose:
        print(evaluator.summary)
    coco = dict(zip(STAT_NAMES, stats))
    coco["coco_eval_bbox"] = stats
    return meter.averages(), coco
