"""patch(model) / unpatch(model): swap attention modules for linear ones in place, and back.

Every attention class patch can replace has an adapter (``linear_mha.adapters``): LinearMultiheadAttention for
nn.MultiheadAttention, LinearTimmAttention for timm's Attention, PatchedSelfAttention for the LM stack's
SelfAttention, and any a user registers. This file knows none of them by name."""
from dataclasses import dataclass
from typing import Callable, Optional, Type

import torch
from torch import nn

from ..adapters import ATTACHED, UnknownLength, adapter_classes, adapter_for
from ..attend import needs_token_grid, reads_token_grid, validate_options
from ..registry import DEFAULT_MODE, AttentionMethod, method_class, resolve_mode
from ..token_grid import GridTracker, attach_tracker, feature_map_grid
from .nested_tensor import disable_nested_tensor, restore_nested_tensor
from .report import PatchReport
from .selection import Selection
from .unsupported import unsupported_reason


@dataclass
class _Plan:
    """One module to replace, resolved once: its adapter, its method's class and the options it gets."""
    name: str
    module: nn.Module
    adapter: Type[nn.Module]
    options: dict

    def __post_init__(self):
        try:
            self.method: Type[AttentionMethod] = method_class(self.options["mode"])
        except ValueError as err:
            raise ValueError(f"patch(): cannot patch {self.name!r} ({type(self.module).__name__}): {err}") from None


def _is_adapter(module) -> bool:
    return isinstance(module, adapter_classes())


def _holds_adapter(module) -> bool:
    """Whether an adapter that attaches sits in ``module`` (the module it converts)."""
    return _is_adapter(module._modules.get(ATTACHED))


def _owners(model: nn.Module, name: str):
    """(name, module) of every module enclosing ``name``, the nearest first: a ViT is often a backbone inside a
    user's wrapper, and the nearest enclosing model is the one that feeds the attention."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner_name = ".".join(parts[:depth])
        yield owner_name, model.get_submodule(owner_name)


def _resolve_sequence_lengths(model: nn.Module, plans) -> None:
    """Methods whose keys are bounded by an option (Linformer's seq_len) get the token count the enclosing model
    feeds the module (its adapter reads it off the model) when the option is left out, and an error when it is too
    small."""
    for plan in plans:
        option = plan.method.sequence_length_option
        if option is None:
            continue
        tokens, unknown = None, None
        for _, owner in _owners(model, plan.name):
            try:
                tokens = plan.adapter.sequence_length(owner)
            except UnknownLength as err:
                unknown = err
                break
            if tokens is not None:
                break
        opts = plan.options
        if option not in opts:
            if tokens is not None:
                opts[option] = tokens
            elif unknown is not None:
                raise ValueError(f"patch(): {plan.name!r} is {unknown}; pass {option}= the largest token count you "
                                 f"will feed (patch grid + class/register tokens)")
        elif tokens is not None and opts[option] < tokens:
            raise ValueError(f"patch(): {option}={opts[option]} for {plan.name!r}, but the model feeds it "
                             f"{tokens} tokens; pass {option} >= {tokens} (or leave it out to use {tokens})")


def _build(plan: _Plan) -> nn.Module:
    try:
        return plan.adapter.from_original(plan.module, **plan.options)
    except (ValueError, TypeError) as err:
        raise type(err)(f"patch(): cannot patch {plan.name!r} ({type(plan.module).__name__}): {err}") from err


def _build_all(plans) -> list:
    """One new module per plan. A method that shares one tensor across layers (Linformer's param_sharing=
    'layerwise') gets ONE for all of them: the first module draws it (with the method's initialisation) and the
    others receive it through the method's option."""
    tied = [p for p in plans if p.method.layer_shared(p.options) is not None]
    shared, state_name, option = None, None, None
    if tied:
        methods = {p.method for p in tied}
        if len(methods) > 1:
            raise ValueError(f"patch(): one shared tensor cannot serve modes {sorted(m.name for m in methods)}")
        method = tied[0].method
        state_name, option = method.layer_shared(tied[0].options)
        length_option = method.sequence_length_option
        defaults = {key: opt.default for key, opt in method.options.items()}
        for key in sorted({k for p in tied for k in p.options} - {length_option, option}):
            values = sorted({repr(p.options.get(key, defaults.get(key))) for p in tied})
            if len(values) > 1:
                raise ValueError(f"patch(): {option} ties one tensor across modules, which needs the same {key} in "
                                 f"each, but they were given {key} values {', '.join(values)}; use a single {key}")
        devices = {next(p.module.parameters()).device for p in tied}
        if len(devices) > 1:
            raise ValueError(f"patch(): {option} ties one tensor across modules, which needs all patched modules on "
                             f"one device; found {sorted(map(str, devices))}; patch before splitting the model")
        if length_option is not None:  # a shared tensor must cover the longest sequence
            longest = max(p.options.get(length_option, defaults[length_option]) for p in tied)
            for plan in tied:
                plan.options[length_option] = longest
        shared = tied[0].options.get(option)
    tied_ids = {id(p) for p in tied}
    built = []
    for plan in plans:
        if id(plan) in tied_ids and shared is not None:
            plan.options[option] = shared
        new = _build(plan)
        if id(plan) in tied_ids and shared is None:
            shared = getattr(new, state_name)
        built.append(new)
    return built


def _grid_source(model: nn.Module, plan: _Plan):
    """(name of the module whose input is the image-shaped tensor, reader of its grid) for a module that needs its
    token grid: what the nearest enclosing model tells the plan's adapter; None if none does."""
    for owner_name, owner in _owners(model, plan.name):
        found = plan.adapter.grid_source(owner_name, owner, plan.name)
        if found is not None:
            return found
    return None


def _track_grids(model: nn.Module, plans, built, grid_source, grid_prefix, grid_stride) -> list:
    """Give every new module that reads its token grid a tracker of it; returns the trackers."""
    trackers = {}
    for plan, new in zip(plans, built):
        if not reads_token_grid(new):
            continue
        found = ((grid_source, feature_map_grid(grid_prefix, grid_stride)) if grid_source is not None
                 else _grid_source(model, plan))
        if found is None and not needs_token_grid(new):
            continue  # it runs on the sequence alone
        if found is None:
            raise ValueError(f"patch(): {plan.name!r} needs the token grid (dwc_kernel, or mode={new.mode!r}), and no "
                             f"DETR transformer or timm / torchvision ViT encloses it; pass grid_source='<module whose "
                             f"first input is the (B, C, H, W) feature map>' (with grid_prefix= tokens before the "
                             f"grid and grid_stride= pixels per token)")
        name, grid_of = found
        if name not in trackers:
            trackers[name] = GridTracker(name, grid_of).watch(model.get_submodule(name))
        attach_tracker([new], trackers[name])
    return list(trackers.values())


def _swap(model: nn.Module, replacement: dict) -> None:
    """replacement: id(old) -> new. Every slot holding old gets new, so a module shared by two parents stays
    shared."""
    for parent in list(model.modules()):
        for key, child in list(parent._modules.items()):
            if child is not None and id(child) in replacement:
                parent._modules[key] = replacement[id(child)]


def _check_model(model, fn: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}() expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(f"{fn}() cannot change a TorchScript module (its code is compiled, so a swapped submodule would "
                        f"never run); {fn} the Python model first, then export or trace it (torch.export, "
                        f"torch.jit.trace: docs/deploy.md)")
    if _is_adapter(model) or adapter_for(model) is not None:
        raise TypeError(f"{fn}() replaces submodules in place, but the model itself is a {type(model).__name__}; "
                        f"convert a bare module with LinearMultiheadAttention.from_torch(module) or wrap it in a "
                        f"container (e.g. nn.Sequential(module))")


def patch(model: nn.Module, mode: str = DEFAULT_MODE, *, include=None, exclude=None,
          filter: Optional[Callable] = None, options_for: Optional[Callable] = None, grid_source: Optional[str] = None,
          grid_prefix: int = 0, grid_stride: int = 1, **options) -> PatchReport:
    """Replace, in place, every selected attention module that has an adapter (``linear_mha.adapters``): every
    nn.MultiheadAttention (and subclass that keeps its forward) with LinearMultiheadAttention, every
    timm.layers.Attention with LinearTimmAttention and the softmax heads of every ``linear_mha.lm`` SelfAttention
    with the method (PatchedSelfAttention), reusing the original Parameter objects.

    include / exclude: fnmatch patterns over qualified module names ("encoder.layers.*.self_attn");
    filter(name, module) -> bool; options_for(name, module) -> dict merged over ``options`` for that module.
    options: the method's keyword options and ``dwc_kernel``. For Linformer, seq_len defaults to the model's token
    count (timm ViTs, torchvision's VisionTransformer, the LM stack). With ``dwc_kernel`` the token grid is read from
    the enclosing DETR transformer, timm or torchvision ViT, or from ``grid_source``: a submodule name whose first
    input is (B, C, H, W), giving an H / grid_stride x W / grid_stride grid after ``grid_prefix`` tokens. Returns a
    PatchReport. Modules already linear are skipped (patching twice is a no-op); unsupported attention classes are
    reported, never touched.
    """
    _check_model(model, "patch")
    mode = resolve_mode(mode, options)
    selection = Selection(include, exclude, filter, options_for)
    base = {"mode": mode, **options}
    report = PatchReport(mode=mode)
    plans = []
    for name, module in model.named_modules():
        if _is_adapter(module) and type(module).attaches:
            continue  # reported with the module it is attached to
        if _is_adapter(module) or _holds_adapter(module):
            selection.why_not(name, module, use_filter=False)  # a pattern naming it is not a typo
            mode = (module if _is_adapter(module) else module._modules[ATTACHED]).mode
            report.skipped.append((name, type(module), f"already linear (mode={mode!r}); call unpatch(model) first "
                                                       f"to change it"))
            continue
        adapter = adapter_for(module)
        reason = adapter.unsupported_reason(module) if adapter is not None else unsupported_reason(module)
        if reason or adapter is None:
            if reason:
                selection.why_not(name, module, use_filter=False)
                report.skipped.append((name, type(module), reason))
            continue
        why = selection.why_not(name, module)
        if why:
            report.skipped.append((name, type(module), why))
            continue
        plans.append(_Plan(name, module, adapter, selection.options(name, module, base)))
    selection.warn_unused()
    if not plans:  # a misspelt mode or option fails even where nothing is patched (else _build names the module)
        validate_options(mode, options)
    _resolve_sequence_lengths(model, plans)
    built = _build_all(plans)
    trackers = _track_grids(model, plans, built, grid_source, grid_prefix, grid_stride)

    before = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    replacement = {}
    for plan, new in zip(plans, built):
        if plan.adapter.attaches:
            plan.module.add_module(ATTACHED, new)
        else:
            replacement[id(plan.module)] = new
    _swap(model, replacement)
    report.parameters_added = sum(p.numel() for p in model.parameters() if id(p) not in before)
    report.buffers_added = sum(b.numel() for b in model.buffers() if id(b) not in before)
    for plan, new in zip(plans, built):
        report.replaced.append((plan.name, type(plan.module), type(new)))
        if (plan.module._forward_hooks or plan.module._forward_pre_hooks) and not plan.adapter.attaches:
            report.notes.append(f"forward hooks on {plan.name!r} stay on the replaced module; register them again")
    for adapter in dict.fromkeys(plan.adapter for plan in plans):
        report.notes += adapter.prepare_model(model, [plan.module for plan in plans if plan.adapter is adapter])
    for tracker in trackers:
        if tracker.reads_convolution:
            conv = ".".join(part for part in (tracker.source_name, tracker.grid_of.conv) if part)
            report.notes.append(f"token grid (local term, rope, grid methods) read from the output of {conv!r}")
        else:
            report.notes.append(f"token grid (local term, rope, grid methods) read from the input of {tracker.source_name or '<root>'!r}")
    for name in disable_nested_tensor(model, _is_adapter):
        report.notes.append(f"nn.TransformerEncoder {name or '<root>'!r}: use_nested_tensor set to False (its "
                            f"nested-tensor fast path would run softmax attention)")
    return report


def unpatch(model: nn.Module) -> PatchReport:
    """Put back, in place, the module each linear attention replaced (its own class, subclasses included; a plain
    nn.MultiheadAttention for a LinearMultiheadAttention built directly), holding the current, possibly
    fine-tuned, Parameters. The method's extra parameters (Linformer E/F, FAVOR+ projection, the dwc_kernel term)
    are dropped, and the hooks that read token grids removed."""
    _check_model(model, "unpatch")
    report = PatchReport(mode="unpatch")
    olds, news, trackers, kinds = [], [], set(), {}
    for name, module in list(model.named_modules()):
        if _is_adapter(module):
            if module.__dict__.get("token_grid_source") is not None:
                trackers.add(module.__dict__.pop("token_grid_source"))
            new = module.to_original()
            kinds[type(module)] = None
            if type(module).attaches:  # the converted module stays; only the adapter leaves it
                del new._modules[ATTACHED]
                name = name.rpartition(".")[0]
            else:
                olds.append(module)
                news.append(new)
            report.replaced.append((name, type(module), type(new)))
    before = {id(p) for p in model.parameters()}
    _swap(model, {id(old): new for old, new in zip(olds, news)})
    for adapter in kinds:
        report.notes += adapter.restore_model(model)
    removed = len(before - {id(p) for p in model.parameters()})
    if removed:
        report.notes.append(f"{removed} parameter tensor(s) of the linear modes removed")
    for tracker in trackers:  # the hooks that read token grids for dwc_kernel
        tracker.remove()
    for name in restore_nested_tensor(model, _is_adapter):
        report.notes.append(f"nn.TransformerEncoder {name or '<root>'!r}: use_nested_tensor restored to True")
    return report
