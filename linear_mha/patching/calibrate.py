"""calibrate(model, batches): fit a patched model's linear attention to the softmax attention it replaced.

Stage 1, attention transfer (as LoLCATs does): the model is frozen except the tensors linear_mha added (a learnable
method's feature maps, e.g. ``mode="hedgehog"``, and the ``dwc_kernel`` term). In every forward, each patched module
also runs the original softmax attention that ``patch`` kept for ``unpatch``, on the very same inputs, under
no_grad and without attention weights; the loss is the squared error of the linear output against it, relative to
the softmax output's size, summed over layers; and the softmax output is what flows on to the next layer, so each
layer learns on the inputs of the model it replaces. Stage 2 (optional): a short fine-tune of the whole model, with
the user's own loss or by distillation: fitting the patched model's outputs to the original model's on the same
batch (the original = the same model running the kept softmax attention, with its weights as stage 2 found them).
Stage 1 leaves each layer a small error, and the errors compound through the layers; distillation fits what the
model finally outputs, with no labels and none of a task loss's noise.

    report = linear_mha.calibrate(model, batches, steps=200, lr=1e-2)
    print(report)                                   # per-layer attention error before and after
    calibrate(model, batches, steps=150, finetune_steps=50, finetune_lr=3e-5, distill=True)   # stage 2: distil
"""
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Union

import torch
from torch import nn

from ..adapters import adapter_classes
from ..progress import progress_bar


@dataclass
class CalibrationReport:
    """Per patched module: relative error ||linear - softmax|| / ||softmax|| of its output on the same inputs,
    before and after stage 1 (mean over the evaluation batches); the loss of every step of both stages."""
    layers: List[dict] = field(default_factory=list)
    steps: int = 0
    finetune_steps: int = 0
    losses: List[float] = field(default_factory=list)
    finetune_losses: List[float] = field(default_factory=list)
    trained_parameters: int = 0
    distilled: bool = False  # stage 2 fitted the original model's outputs instead of a task loss

    def table(self) -> str:
        width = max([len("module")] + [len(layer["name"]) for layer in self.layers])
        lines = [f"calibrated {len(self.layers)} attention module(s), {self.trained_parameters} parameters, "
                 f"{self.steps} step(s)" + (f", then {self.finetune_steps} fine-tuning step(s)" +
                                            (" distilling the original's outputs" if self.distilled else "")
                                            if self.finetune_steps else ""),
                 f"{'module':<{width}}  error before  error after"]
        for layer in self.layers:
            lines.append(f"{layer['name']:<{width}}  {layer['error_before']:>12.4f}  {layer['error_after']:>11.4f}")
        return "\n".join(lines)

    __str__ = table


def _linear_modules(model: nn.Module):
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, adapter_classes())]
    if not found:
        raise ValueError("calibrate() found no linear attention in the model: patch it first, e.g. "
                         "linear_mha.patch(model, mode='hedgehog')")
    missing = [name for name, m in found if m.original is None]
    if missing:
        raise ValueError(f"calibrate() needs the softmax attention each module replaced, which patch() keeps; "
                         f"{missing[:3]} were built directly. Patch the original model instead of building "
                         f"LinearMultiheadAttention yourself")
    return found


def _added_parameters(modules) -> List[nn.Parameter]:
    """The parameters linear_mha added (each method's own state and the local term), once each (shared ones too)."""
    seen, params = set(), []
    for _, m in modules:
        for p in m.added_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _padding_rows(module: nn.Module, args, kwargs):
    """The output rows that are padding's own in this call (the module says which), or None."""
    rows = getattr(module, "output_padding", None)
    return None if rows is None else rows(*args, **kwargs)


def _relative_error(student, teacher, padding_rows):
    """||student - teacher||^2 / ||teacher||^2 over the rows that are not padding: padded positions' own outputs
    are read by no later layer, and a linear mode does not compute them as softmax does (DETR's feature maps are
    often half padding, and fitting those rows would pull the maps away from the rows that matter)."""
    diff, target = student - teacher, teacher.detach()
    if padding_rows is not None:
        keep = ~padding_rows
        diff, target = diff * keep, target * keep
    return diff.pow(2).sum() / target.pow(2).sum().clamp_min(torch.finfo(teacher.dtype).tiny)


class _Transfer:
    """Forward hooks that compare each module's output with its teacher's and hand the teacher's on.

    train=True: the errors must reach the added parameters. A model that runs its layers without autograd (a
    reversible stack recomputes them in its backward) gives outputs with no graph; those modules are run again
    under autograd on the same inputs. Each error depends only on its own module's parameters (the teacher's
    output, not the student's, flows on), so this is the same loss and the same gradient."""

    def __init__(self, modules, train: bool = False):
        self.modules, self.train, self.errors, self.handles = modules, train, {}, []
        self.rerunning = set()

    def __enter__(self):
        for name, module in self.modules:
            def hook(mod, args, kwargs, output, name=name):
                if name in self.rerunning:
                    return None
                with torch.no_grad():
                    teacher = mod.original_output(args, kwargs)
                student = output[0] if isinstance(output, tuple) else output
                if self.train and not student.requires_grad:
                    self.rerunning.add(name)
                    try:
                        with torch.enable_grad():
                            again = mod(*args, **kwargs)
                    finally:
                        self.rerunning.discard(name)
                    student = again[0] if isinstance(again, tuple) else again
                with torch.enable_grad() if self.train else contextlib.nullcontext():
                    self.errors[name] = _relative_error(student, teacher, _padding_rows(mod, args, kwargs))
                return (teacher, *output[1:]) if isinstance(output, tuple) else teacher
            self.handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return False


def output_distance(output, target) -> torch.Tensor:
    """``distill=True``'s loss: sum over the floating-point tensors of a model's output (a tensor, or tuples, lists
    and dicts of them, nested) of ||output - target||^2 / ||target||^2, each relative to its own size so that no
    output outweighs another by its scale alone."""
    pairs = list(_float_leaves(output, target))
    if not pairs:
        raise ValueError("calibrate(distill=True) found no floating-point tensor in the model's output to fit; pass "
                         "distill=a function (output, original_output) -> scalar loss")
    return sum(_relative_error(o, t, None) for o, t in pairs)


def _float_leaves(output, target):
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield output, target
    elif isinstance(output, dict):
        for key in output:
            yield from _float_leaves(output[key], target[key])
    elif isinstance(output, (tuple, list)):
        for o, t in zip(output, target):
            yield from _float_leaves(o, t)


@contextlib.contextmanager
def _values_of(params, values):
    """The parameters hold ``values`` inside the block (the same Parameter objects, so every module sharing one,
    the kept originals included, sees them), and their own again after it."""
    live = [p.data for p in params]
    try:
        for p, v in zip(params, values):
            p.data = v
        yield
    finally:
        for p, v in zip(params, live):
            p.data = v


def _distillation(model, modules, forward, tuned, added_ids, distance):
    """stage 2's loss with distill: the patched model's output against the original model's on the same batch.
    The original is this model with each patched module's kept softmax attention, and with the weights stage 2
    started from: the kept modules share their Parameters with the patched ones, and stage 2 trains them, so
    without the copy the target would move with the student (and could be met by moving the weights instead of
    fitting the attention). The copy holds only the trained parameters the original uses."""
    own = [p for p in tuned if id(p) not in added_ids]
    start = [p.detach().clone() for p in own]

    def loss(m, batch):
        with torch.no_grad(), _values_of(own, start), _Transfer(modules):
            # the linear modules also run here and are discarded: hooks can replace an output, not skip a forward
            target = _call(m, batch, forward)
        return distance(_call(m, batch, forward), target)
    return loss


def _call(model, batch, forward):
    if forward is not None:
        return forward(model, batch)
    if isinstance(batch, tuple):
        return model(*batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def _cycle(batches):
    """Batches, again from the start when they run out (a generator cannot start again: that is an error)."""
    for round_ in itertools.count():
        produced = False
        for batch in batches:
            produced = True
            yield batch
        if not produced:
            raise ValueError("calibrate(): batches produced nothing" + (
                " on a second pass: pass a list or a DataLoader, which can be iterated again, not a generator"
                if round_ else ""))


def _progress(total, desc, enabled):
    return progress_bar(total=total, desc=desc, disable=not enabled)


@torch.no_grad()
def _errors(model, modules, batches, count, forward):
    totals = {name: 0.0 for name, _ in modules}
    with _Transfer(modules) as transfer:
        for batch in itertools.islice(_cycle(batches), count):
            _call(model, batch, forward)
            for name in totals:
                totals[name] += float(transfer.errors[name]) ** 0.5 / count
    return totals


def calibrate(model: nn.Module, batches: Iterable, *, steps: int = 200, lr: float = 1e-2, eval_batches: int = 4,
              loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None, finetune_steps: int = 0,
              finetune_lr: float = 1e-4, forward: Optional[Callable[[nn.Module, Any], Any]] = None, seed: int = 0,
              progress: bool = True, distill: Union[bool, Callable[[Any, Any], torch.Tensor]] = False
              ) -> CalibrationReport:
    """Fit ``model``'s linear attention (patched by ``linear_mha.patch``) to the softmax attention it replaced.

    batches: model inputs, iterated again as needed (a list or a DataLoader): a tuple is called as
    ``model(*batch)``, a dict as ``model(**batch)``, anything else as ``model(batch)``; or give
    ``forward(model, batch)``. Stage 1 trains only the tensors linear_mha added for ``steps`` steps of AdamW at
    ``lr`` (model in eval mode, no dropout); the per-layer error is measured on the first ``eval_batches`` batches
    before and after. Stage 2, with ``finetune_steps`` > 0, fine-tunes every parameter that was trainable before (and
    the added ones) at ``finetune_lr``, with one of: ``loss_fn(model, batch) -> scalar``, the task's loss, in train
    mode; or ``distill=True``, fitting the model's outputs to the original model's on the same batch (its softmax
    attention, its weights as stage 2 started; :func:`output_distance`; eval mode, so the target is exact), or
    ``distill=f`` with ``f(output, original_output) -> scalar`` as the loss. Distillation keeps a copy of the
    trained parameters and runs the model twice a step (the original's pass without autograd). Every parameter's
    ``requires_grad`` and the model's train/eval mode are restored at the end. Deterministic for a given ``seed``.
    Returns a :class:`CalibrationReport` (print it for the table)."""
    for name, value in (("steps", steps), ("finetune_steps", finetune_steps), ("eval_batches", eval_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"calibrate(): {name} must be a non-negative int, got {value!r}")
    if not (isinstance(distill, bool) or callable(distill)):
        raise ValueError(f"calibrate(): distill must be True, False or a function (output, original_output) -> "
                         f"scalar loss, got {distill!r}")
    if finetune_steps and (loss_fn is None) == (distill is False):
        raise ValueError("calibrate(): finetune_steps needs one of loss_fn(model, batch) -> the task's scalar loss, "
                         "or distill=True (fit the original model's outputs)" +
                         (", not both" if loss_fn is not None else ""))
    modules = _linear_modules(model)
    added = _added_parameters(modules)
    if steps and not added:
        raise ValueError(f"calibrate(): the patched modules' method ({modules[0][1].mode!r}) has nothing to train; "
                         f"patch with a learnable method, e.g. mode='hedgehog', or add dwc_kernel=3")
    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    torch.manual_seed(seed)
    report = CalibrationReport(steps=steps, finetune_steps=finetune_steps, distilled=bool(finetune_steps and distill),
                               trained_parameters=sum(p.numel() for p in added))
    try:
        model.eval()
        before = _errors(model, modules, batches, eval_batches, forward) if eval_batches else {}
        for p in model.parameters():
            p.requires_grad_(False)
        for p in added:
            p.requires_grad_(True)
        if steps:
            optimizer = torch.optim.AdamW(added, lr=lr, weight_decay=0.0)
            with _progress(steps, "calibrate (attention transfer)", progress) as bar, \
                    _Transfer(modules, train=True) as transfer:
                for batch in itertools.islice(_cycle(batches), steps):
                    optimizer.zero_grad(set_to_none=True)
                    _call(model, batch, forward)
                    loss = sum(transfer.errors.values()) / len(transfer.errors)
                    loss.backward()
                    optimizer.step()
                    report.losses.append(float(loss.detach()))
                    bar.update(1)
                    bar.set_postfix(loss=f"{report.losses[-1]:.4f}")
        after = _errors(model, modules, batches, eval_batches, forward) if eval_batches else {}
        report.layers = [{"name": name, "error_before": before.get(name, float("nan")),
                          "error_after": after.get(name, float("nan"))} for name, _ in modules]
        if finetune_steps:
            added_ids = {id(p) for p in added}
            tuned = [p for p in model.parameters() if flags[p] or id(p) in added_ids]
            for p in tuned:
                p.requires_grad_(True)
            if report.distilled:
                step_loss = _distillation(model, modules, forward, tuned, added_ids,
                                          distill if callable(distill) else output_distance)
            else:
                model.train()
                step_loss = loss_fn
            optimizer = torch.optim.AdamW(tuned, lr=finetune_lr)
            desc = "calibrate (distillation)" if report.distilled else "calibrate (fine-tune)"
            with _progress(finetune_steps, desc, progress) as bar:
                for batch in itertools.islice(_cycle(batches), finetune_steps):
                    optimizer.zero_grad(set_to_none=True)
                    loss = step_loss(model, batch)
                    loss.backward()
                    optimizer.step()
                    report.finetune_losses.append(float(loss.detach()))
                    bar.update(1)
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(was_training)
    return report
