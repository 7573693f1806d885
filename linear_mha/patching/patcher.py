"""patch(model) / unpatch(model): swap attention modules for linear ones in place, and back."""
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from ..attention import LinearMultiheadAttention
from ..mode_attention import OPTION_DEFAULTS as _DEFAULTS
from .generic import disable_nested_tensor, restore_nested_tensor, to_linear, to_torch
from .report import PatchReport
from .selection import Selection
from .timm_attention import LinearTimmAttention, supported_timm_classes, timm_token_count
from .unsupported import mha_subclass_reason, unsupported_reason

_LINEAR_CLASSES = (LinearMultiheadAttention, LinearTimmAttention)


def _is_linear(module) -> bool:
    return isinstance(module, _LINEAR_CLASSES)


@dataclass
class _Plan:
    name: str
    module: nn.Module
    kind: str  # "mha" or "timm"
    options: dict


def _default_seq_len(model: nn.Module, plan: _Plan) -> Optional[int]:
    """Tokens this module is fed, where the nearest enclosing model says so: a timm ViT (patch grid + prefix
    tokens; None when its size varies) or torchvision's VisionTransformer (seq_length). The nearest one, not the
    root: a ViT is often a backbone inside a user's wrapper."""
    parts = plan.name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:depth]))
        if plan.kind == "timm" and hasattr(owner, "patch_embed"):
            return timm_token_count(owner)
        if (type(owner).__module__.startswith("torchvision.models.vision_transformer")
                and isinstance(getattr(owner, "seq_length", None), int)):
            return owner.seq_length
    return None


def _resolve_linformer_lengths(model: nn.Module, plans) -> None:
    for plan in plans:
        opts = plan.options
        if opts.get("mode", _DEFAULTS["mode"]) != "linformer":
            continue
        tokens = _default_seq_len(model, plan)
        if "seq_len" not in opts:
            if tokens is not None:
                opts["seq_len"] = tokens
            elif plan.kind == "timm":
                raise ValueError(f"patch(): {plan.name!r} is timm attention in a model whose token count varies "
                                 f"(dynamic_img_size=True) or is unknown; pass seq_len= the largest token count "
                                 f"you will feed (patch grid + class/register tokens)")
        elif tokens is not None and opts["seq_len"] < tokens:
            raise ValueError(f"patch(): seq_len={opts['seq_len']} for {plan.name!r}, but the model feeds it "
                             f"{tokens} tokens; pass seq_len >= {tokens} (or leave it out to use {tokens})")


def _build(plan: _Plan) -> nn.Module:
    try:
        if plan.kind == "mha":
            return to_linear(plan.module, plan.options)
        return LinearTimmAttention(plan.module, **plan.options)
    except (ValueError, TypeError) as err:
        raise type(err)(f"patch(): cannot patch {plan.name!r} ({type(plan.module).__name__}): {err}") from err


def _build_all(plans) -> list:
    """One new module per plan. param_sharing='layerwise' gets ONE projection for all of them: the first module
    draws it (with the core's initialisation) and the others receive it as shared_projection."""
    shared = None
    layerwise = [p for p in plans if p.options.get("mode", _DEFAULTS["mode"]) == "linformer"
                 and p.options.get("param_sharing") == "layerwise"]
    if layerwise:
        proj_ks = sorted({p.options.get("proj_k", _DEFAULTS["proj_k"]) for p in layerwise})
        if len(proj_ks) > 1:
            raise ValueError(f"patch(): param_sharing='layerwise' ties one (proj_k, seq_len) projection across "
                             f"modules, but they were given proj_k values {proj_ks}; use a single proj_k")
        seq_len = max(p.options.get("seq_len", _DEFAULTS["seq_len"]) for p in layerwise)
        devices = {next(p.module.parameters()).device for p in layerwise}
        if len(devices) > 1:
            raise ValueError(f"patch(): param_sharing='layerwise' needs all patched modules on one device, found "
                             f"{sorted(map(str, devices))}; patch before splitting the model across devices")
        shared = layerwise[0].options.get("shared_projection")
        for plan in layerwise:
            plan.options["seq_len"] = seq_len  # a shared projection must cover the longest sequence
    tied = {id(p) for p in layerwise}
    built = []
    for plan in plans:
        if id(plan) in tied and shared is not None:
            plan.options["shared_projection"] = shared
        new = _build(plan)
        if id(plan) in tied and shared is None:
            shared = new.e_proj
        built.append(new)
    return built


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
    if isinstance(model, nn.MultiheadAttention) or _is_linear(model) or type(model) in supported_timm_classes():
        raise TypeError(f"{fn}() replaces submodules in place, but the model itself is a {type(model).__name__}; "
                        f"convert a bare module with LinearMultiheadAttention.from_torch(module) or wrap it in a "
                        f"container (e.g. nn.Sequential(module))")


def patch(model: nn.Module, mode: str = "linformer", *, include=None, exclude=None,
          filter: Optional[Callable] = None, options_for: Optional[Callable] = None, **options) -> PatchReport:
    """Replace, in place, every selected nn.MultiheadAttention (and subclass that keeps its forward) with
    LinearMultiheadAttention and every timm.layers.Attention with LinearTimmAttention, reusing the original
    Parameter objects.

    include / exclude: fnmatch patterns over qualified module names ("encoder.layers.*.self_attn");
    filter(name, module) -> bool; options_for(name, module) -> dict merged over ``options`` for that module.
    options: LinearMultiheadAttention's keyword options. For Linformer, seq_len defaults to the model's token
    count for timm ViTs and torchvision's VisionTransformer. Returns a PatchReport. Modules already linear are
    skipped (patching twice is a no-op); unsupported attention classes are reported, never touched.
    """
    _check_model(model, "patch")
    selection = Selection(include, exclude, filter, options_for)
    base = {"mode": mode, **options}
    report = PatchReport(mode=mode)
    timm_classes = supported_timm_classes()
    plans = []
    for name, module in model.named_modules():
        if _is_linear(module):
            selection.why_not(name, module, use_filter=False)  # a pattern naming it is not a typo
            report.skipped.append((name, type(module), f"already linear (mode={module.mode!r}); call "
                                                       f"unpatch(model) first to change it"))
            continue
        kind = "mha" if isinstance(module, nn.MultiheadAttention) and mha_subclass_reason(module) is None else (
            "timm" if type(module) in timm_classes else None)
        if kind is None:
            reason = unsupported_reason(module, timm_classes)
            if reason:
                selection.why_not(name, module, use_filter=False)
                report.skipped.append((name, type(module), reason))
            continue
        why = selection.why_not(name, module)
        if why:
            report.skipped.append((name, type(module), why))
            continue
        plans.append(_Plan(name, module, kind, selection.options(name, module, base)))
    selection.warn_unused()
    _resolve_linformer_lengths(model, plans)
    built = _build_all(plans)

    before = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    _swap(model, {id(plan.module): new for plan, new in zip(plans, built)})
    report.parameters_added = sum(p.numel() for p in model.parameters() if id(p) not in before)
    report.buffers_added = sum(b.numel() for b in model.buffers() if id(b) not in before)
    for plan, new in zip(plans, built):
        report.replaced.append((plan.name, type(plan.module), type(new)))
        if plan.module._forward_hooks or plan.module._forward_pre_hooks:
            report.notes.append(f"forward hooks on {plan.name!r} stay on the replaced module; register them again")
    for name in disable_nested_tensor(model, _is_linear):
        report.notes.append(f"nn.TransformerEncoder {name or '<root>'!r}: use_nested_tensor set to False (its "
                            f"nested-tensor fast path would run softmax attention)")
    return report


def unpatch(model: nn.Module) -> PatchReport:
    """Put back, in place, the module each linear attention replaced (its own class, subclasses included; a plain
    nn.MultiheadAttention for a LinearMultiheadAttention built directly), holding the current, possibly
    fine-tuned, Parameters. The mode's extra parameters (Linformer E/F, FAVOR+ projection) are dropped."""
    _check_model(model, "unpatch")
    report = PatchReport(mode="unpatch")
    olds, news = [], []
    for name, module in model.named_modules():
        if _is_linear(module):
            new = to_torch(module) if isinstance(module, LinearMultiheadAttention) else module.to_timm()
            olds.append(module)
            news.append(new)
            report.replaced.append((name, type(module), type(new)))
    before = {id(p) for p in model.parameters()}
    _swap(model, {id(old): new for old, new in zip(olds, news)})
    removed = len(before - {id(p) for p in model.parameters()})
    if removed:
        report.notes.append(f"{removed} parameter tensor(s) of the linear modes removed")
    for name in restore_nested_tensor(model, _is_linear):
        report.notes.append(f"nn.TransformerEncoder {name or '<root>'!r}: use_nested_tensor restored to True")
    return report
