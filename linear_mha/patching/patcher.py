"""patch(model) / unpatch(model): swap attention modules for linear ones in place, and back."""
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..attention import LinearMultiheadAttention
from ..attend import needs_token_grid, validate_options
from ..registry import DEFAULT_MODE, method_class
from ..token_grid import GridTracker, attach_tracker, feature_map_grid
from .generic import disable_nested_tensor, restore_nested_tensor, to_linear, to_torch
from .report import PatchReport
from .selection import Selection
from .adapters import adapter_classes, adapter_for
from .timm_attention import supported_timm_classes, timm_token_count
from .unsupported import mha_subclass_reason, unsupported_reason


def _is_linear(module) -> bool:
    return isinstance(module, (LinearMultiheadAttention, *adapter_classes()))


@dataclass
class _Plan:
    name: str
    module: nn.Module
    adapter: Optional[type]  # None: an nn.MultiheadAttention, swapped for LinearMultiheadAttention
    options: dict

    @property
    def kind(self) -> str:
        return "mha" if self.adapter is None else self.adapter.kind


def _default_seq_len(model: nn.Module, plan: _Plan) -> Optional[int]:
    """Tokens this module is fed, where the nearest enclosing model says so: a timm ViT (patch grid + prefix
    tokens; None when its size varies), torchvision's VisionTransformer (seq_length) or the LM stack's transformer
    (max_seq_len). The nearest one, not the root: a ViT is often a backbone inside a user's wrapper."""
    parts = plan.name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:depth]))
        if plan.kind == "timm" and hasattr(owner, "patch_embed"):
            return timm_token_count(owner)
        if plan.kind == "lm" and isinstance(getattr(owner, "max_seq_len", None), int):
            return owner.max_seq_len
        if (type(owner).__module__.startswith("torchvision.models.vision_transformer")
                and isinstance(getattr(owner, "seq_length", None), int)):
            return owner.seq_length
    return None


def _resolve_sequence_lengths(model: nn.Module, plans) -> None:
    """Methods whose keys are bounded by an option (Linformer's seq_len) get the token count the model feeds the
    module when the option is left out, and an error when it is too small."""
    for plan in plans:
        option = method_class(plan.options["mode"]).sequence_length_option
        if option is None:
            continue
        opts = plan.options
        tokens = _default_seq_len(model, plan)
        if option not in opts:
            if tokens is not None:
                opts[option] = tokens
            elif plan.kind == "timm":
                raise ValueError(f"patch(): {plan.name!r} is timm attention in a model whose token count varies "
                                 f"(dynamic_img_size=True) or is unknown; pass {option}= the largest token count "
                                 f"you will feed (patch grid + class/register tokens)")
        elif tokens is not None and opts[option] < tokens:
            raise ValueError(f"patch(): {option}={opts[option]} for {plan.name!r}, but the model feeds it "
                             f"{tokens} tokens; pass {option} >= {tokens} (or leave it out to use {tokens})")


def _build(plan: _Plan) -> nn.Module:
    try:
        if plan.adapter is None:
            return to_linear(plan.module, plan.options)
        return plan.adapter.from_original(plan.module, **plan.options)
    except (ValueError, TypeError) as err:
        raise type(err)(f"patch(): cannot patch {plan.name!r} ({type(plan.module).__name__}): {err}") from err


def _layer_shared(plan: _Plan):
    """(state name, option name) of a tensor this plan's method shares across layers, or None."""
    return method_class(plan.options["mode"]).layer_shared(plan.options)


def _build_all(plans) -> list:
    """One new module per plan. A method that shares one tensor across layers (Linformer's param_sharing=
    'layerwise') gets ONE for all of them: the first module draws it (with the method's initialisation) and the
    others receive it through the method's option."""
    tied = [p for p in plans if _layer_shared(p) is not None]
    shared, state_name, option = None, None, None
    if tied:
        modes = sorted({p.options["mode"] for p in tied})
        if len(modes) > 1:
            raise ValueError(f"patch(): one shared tensor cannot serve modes {modes}")
        state_name, option = _layer_shared(tied[0])
        length_option = method_class(modes[0]).sequence_length_option
        defaults = {key: opt.default for key, opt in method_class(modes[0]).options.items()}
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
            longest = max(p.options.get(length_option, method_class(modes[0]).options[length_option].default)
                          for p in tied)
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
    """(name of the module whose input is the image-shaped tensor, reader of its grid) for a module with a local
    term: the nearest enclosing timm ViT (its patch embedding), torchvision VisionTransformer, or DETR-style
    transformer (a module with an encoder and a decoder, fed a (B, C, H, W) feature map); None if there is none."""
    parts = plan.name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        name = ".".join(parts[:depth])
        owner = model.get_submodule(name)
        patch_embed = getattr(owner, "patch_embed", None)
        if plan.kind == "timm" and patch_embed is not None:
            stride = getattr(patch_embed, "patch_size", (1,))[0]
            return (f"{name}.patch_embed" if name else "patch_embed",
                    feature_map_grid(int(getattr(owner, "num_prefix_tokens", 0)), stride,
                                     round_up=bool(getattr(patch_embed, "dynamic_img_pad", False))))
        if (type(owner).__module__.startswith("torchvision.models.vision_transformer")
                and isinstance(getattr(owner, "patch_size", None), int)):
            return name, feature_map_grid(1, owner.patch_size)  # the class token comes first
        if (isinstance(getattr(owner, "encoder", None), nn.Module) and isinstance(getattr(owner, "decoder", None),
                                                                                 nn.Module)
                and plan.name.startswith(f"{name}.encoder." if name else "encoder.")):
            return name, feature_map_grid(0)
    return None


def _track_grids(model: nn.Module, plans, built, grid_source, grid_prefix, grid_stride) -> list:
    """Give every new module with a local term a tracker of its token grid; returns the trackers."""
    trackers = {}
    for plan, new in zip(plans, built):
        if not needs_token_grid(new):
            continue
        found = ((grid_source, feature_map_grid(grid_prefix, grid_stride)) if grid_source is not None
                 else _grid_source(model, plan))
        if found is None:
            raise ValueError(f"patch(): {plan.name!r} needs the token grid (dwc_kernel, or mode={new.mode!r}), and no "
                             f"DETR transformer or "
                             f"timm / torchvision ViT encloses it; pass grid_source='<module whose first input is the "
                             f"(B, C, H, W) feature map>' (with grid_prefix= tokens before the grid and grid_stride= "
                             f"pixels per token)")
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
                        f"never run); {fn} the Python model first, then script or trace it")
    if isinstance(model, nn.MultiheadAttention) or _is_linear(model) or adapter_for(model) is not None:
        raise TypeError(f"{fn}() replaces submodules in place, but the model itself is a {type(model).__name__}; "
                        f"convert a bare module with LinearMultiheadAttention.from_torch(module) or wrap it in a "
                        f"container (e.g. nn.Sequential(module))")


def patch(model: nn.Module, mode: str = DEFAULT_MODE, *, include=None, exclude=None,
          filter: Optional[Callable] = None, options_for: Optional[Callable] = None, grid_source: Optional[str] = None,
          grid_prefix: int = 0, grid_stride: int = 1, **options) -> PatchReport:
    """Replace, in place, every selected nn.MultiheadAttention (and subclass that keeps its forward) with
    LinearMultiheadAttention, every timm.layers.Attention with LinearTimmAttention and the softmax heads of every
    ``linear_mha.lm`` SelfAttention with the method (PatchedSelfAttention), reusing the original Parameter objects.

    include / exclude: fnmatch patterns over qualified module names ("encoder.layers.*.self_attn");
    filter(name, module) -> bool; options_for(name, module) -> dict merged over ``options`` for that module.
    options: LinearMultiheadAttention's keyword options. For Linformer, seq_len defaults to the model's token
    count for timm ViTs and torchvision's VisionTransformer. With ``dwc_kernel`` the token grid is read from the
    enclosing DETR transformer, timm or torchvision ViT, or from ``grid_source``: a submodule name whose first input
    is (B, C, H, W), giving an H / grid_stride x W / grid_stride grid after ``grid_prefix`` tokens. Returns a PatchReport. Modules already linear are
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
        adapter = adapter_for(module)
        mha = isinstance(module, nn.MultiheadAttention) and mha_subclass_reason(module) is None
        reason = (None if mha else adapter.unsupported_reason(module) if adapter is not None
                  else unsupported_reason(module, timm_classes))
        if reason or not (mha or adapter is not None):
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
    _swap(model, {id(plan.module): new for plan, new in zip(plans, built)})
    report.parameters_added = sum(p.numel() for p in model.parameters() if id(p) not in before)
    report.buffers_added = sum(b.numel() for b in model.buffers() if id(b) not in before)
    for plan, new in zip(plans, built):
        report.replaced.append((plan.name, type(plan.module), type(new)))
        if plan.module._forward_hooks or plan.module._forward_pre_hooks:
            report.notes.append(f"forward hooks on {plan.name!r} stay on the replaced module; register them again")
    for tracker in trackers:
        report.notes.append(f"token grid for dwc_kernel read from the input of {tracker.source_name or '<root>'!r}")
    for name in disable_nested_tensor(model, _is_linear):
        report.notes.append(f"nn.TransformerEncoder {name or '<root>'!r}: use_nested_tensor set to False (its "
                            f"nested-tensor fast path would run softmax attention)")
    return report


def unpatch(model: nn.Module) -> PatchReport:
    """Put back, in place, the module each linear attention replaced (its own class, subclasses included; a plain
    nn.MultiheadAttention for a LinearMultiheadAttention built directly), holding the current, possibly
    fine-tuned, Parameters. The mode's extra parameters (Linformer E/F, FAVOR+ projection, the dwc_kernel term)
    are dropped, and the hooks that read token grids removed."""
    _check_model(model, "unpatch")
    report = PatchReport(mode="unpatch")
    olds, news, trackers = [], [], set()
    for name, module in model.named_modules():
        if _is_linear(module):
            if module.__dict__.get("token_grid_source") is not None:
                trackers.add(module.__dict__.pop("token_grid_source"))
            new = to_torch(module) if isinstance(module, LinearMultiheadAttention) else module.to_original()
            olds.append(module)
            news.append(new)
            report.replaced.append((name, type(module), type(new)))
    before = {id(p) for p in model.parameters()}
    _swap(model, {id(old): new for old, new in zip(olds, news)})
    removed = len(before - {id(p) for p in model.parameters()})
    if removed:
        report.notes.append(f"{removed} parameter tensor(s) of the linear modes removed")
    for tracker in trackers:  # the hooks that read token grids for dwc_kernel
        tracker.remove()
    for name in restore_nested_tensor(model, _is_linear):
        report.notes.append(f"nn.TransformerEncoder {name or '<root>'!r}: use_nested_tensor restored to True")
    return report
