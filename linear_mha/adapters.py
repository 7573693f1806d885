"""Attention adapters: every attention module of linear_mha holds a registry method in place of an attention
step, and every one is an adapter of the class it stands in for (nn.MultiheadAttention, timm's Attention, the LM
stack's SelfAttention, ...). ``patch`` reads this file's registry of adapters to find what it can replace; nothing
in patching or calibration knows one class from another.

An adapter is an nn.Module class deriving from ``AttentionAdapter`` (a mixin, before nn.Module). Its constructor
calls ``init_method`` (the method, its state, the local term); ``from_original`` builds it around a module it
replaces, reusing that module's Parameters (so state_dict keys and tensors stay as they were) and keeping it for
``to_original`` and for ``calibrate``'s teacher. A class registered with ``register_adapter`` says:

    kind                               a short name for reports ("mha", "timm", "lm", "hf")
    attaches                           True: added to the module it converts, as ``module.linear_mha``, which keeps
                                       running (Hugging Face models call the adapter through their attention
                                       interface); False: replaces it
    matches(module)                    classmethod: whether this adapter is the one for ``module``
    unsupported_reason(module)         classmethod: why this matched instance cannot be replaced, or None
    from_original(module, **options)   classmethod: the adapter around ``module``, running ``mode`` and its options
    to_original()                      the replaced module again, holding the adapter's current weights
    sequence_length(owner)             classmethod: the tokens an enclosing model ``owner`` feeds this kind of
                                       attention (None: it does not say; raises UnknownLength if it varies)
    grid_source(owner_name, owner, name)  classmethod: (module whose input is the image, grid reader) when ``owner``
                                       encloses the module ``name`` and says where its token grid comes from
    output_padding(*args, **kwargs)    optional: which output rows of that call are padding's own
    original_output(args, kwargs)      the replaced module's attention output on the same call (the teacher)
    prepare_model(model, modules)      classmethod: model-wide changes once its adapters are in place (none by default)
    restore_model(model)               classmethod: undo them once unpatch has taken the adapters out
"""
import functools
import itertools
from typing import Iterable, List, Optional, Tuple, Type

import torch
import torch.fx
from torch import nn

from .local_term import LOCAL_TERM_STATE, install_local_term
from .output_gate import OUTPUT_GATE_STATE, install_output_gate


ATTACHED = "linear_mha"  # the submodule name of an adapter that ``attaches``


class UnknownLength(ValueError):
    """An enclosing model feeds an attention module a number of tokens that varies, so no length can be read off it;
    the message says which model."""


class AttentionAdapter:
    """What every attention module shares: its method, the state the method owns, the local term, FAVOR+ redraws,
    checkpoints of the original model loading without the tensors linear_mha added, and the module it replaced."""

    kind = ""
    kept_whole_by_fx = True  # a leaf of torch.fx traces (_adapters_kept_whole)
    reused: Tuple[str, ...] = ()  # submodules taken over from the original, given back by to_original()
    attaches = False

    # ------------------------------------------------------------------ the method
    def init_method(self, method, num_heads: int, head_dim: int, factory_kwargs: dict, dwc_kernel=None,
                    output_gate: bool = False) -> None:
        """Hold ``method`` (``registry.create_method``), register its state, the local term of ``dwc_kernel`` and the
        ``output_gate``."""
        if dwc_kernel is not None and not method.bidirectional:
            raise ValueError(f"dwc_kernel mixes neighbouring tokens over an image grid in every direction, and "
                             f"mode={method.name!r} is causal only: build the module without dwc_kernel, or with a "
                             f"method that attends the whole sequence")
        self.method, self.method_heads = method, (num_heads, head_dim)
        method.install(self, num_heads, head_dim, factory_kwargs)
        install_local_term(self, num_heads * head_dim, dwc_kernel, factory_kwargs)
        install_output_gate(self, num_heads, head_dim, head_dim, output_gate, factory_kwargs)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise again what this module initialised when it was built: the method's state, the local term, the
        gate, and the projections it owns (LinearMultiheadAttention's; modules taken over from a model it patched
        keep theirs). This is what torch's meta-device recipes and FSDP call on each module once ``to_empty`` has
        given it memory. Random draws come in the constructor's order, so under one seed the result is the
        freshly built module's."""
        self.reset_own_parameters()
        owned = [getattr(self, name) for name in self.method.state_names]
        like = next((t for t in owned if t is not None), None)
        factory_kwargs = {"device": like.device, "dtype": like.dtype} if like is not None else {}
        fresh = self.method.init_state(*self.method_heads, factory_kwargs)
        for tensor, value in zip(owned, fresh.values()):
            if tensor is not None and value is not None and tensor is not value:
                tensor.copy_(value)
        for name in LOCAL_TERM_STATE + OUTPUT_GATE_STATE:  # both start at zero
            if getattr(self, name, None) is not None:
                getattr(self, name).zero_()

    def reset_own_parameters(self) -> None:
        """The projections this module built itself, in the constructor's order (none for an adapter that reuses
        the original's)."""

    def extras_repr(self) -> str:
        """The local term and the gate, for a module's repr."""
        return ((f", dwc_kernel={self.dwc_weight.shape[-1]}" if self.dwc_weight is not None else "")
                + (", output_gate=True" if self.gate_weight is not None else ""))

    @property
    def mode(self) -> str:
        return self.method.name

    def __prepare_scriptable__(self):
        """torch.jit.script calls this on every submodule before compiling: one clear error instead of TorchScript's
        complaints about the method object and properties it cannot compile."""
        raise TypeError(f"torch.jit.script cannot compile {type(self).__name__} (mode={self.mode!r}): its attention "
                        f"method is a Python object chosen at run time. Export the model with torch.export.export or "
                        f"torch.onnx.export(..., dynamo=True), or record it with torch.jit.trace (docs/deploy.md)")

    def added_parameters(self) -> List[nn.Parameter]:
        """The parameters linear_mha added to the replaced module: the method's state and the local term."""
        found = (getattr(self, name, None) for name in tuple(self.method.state_names) + LOCAL_TERM_STATE
                 + OUTPUT_GATE_STATE)
        return [p for p in found if isinstance(p, nn.Parameter)]

    def redraw_features(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new FAVOR+ random projection (mode='kernel' with feature_map='favor')."""
        self.method.redraw(self, generator)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        drop_missing_state(self.method.state_names + LOCAL_TERM_STATE + OUTPUT_GATE_STATE, prefix, state_dict,
                           missing_keys)

    # ------------------------------------------------------------------ the module it replaced
    def keep_original(self, module: Optional[nn.Module]) -> None:
        """Keep ``module`` unregistered (not in state_dict, parameters() or .to()), so ``to_original`` gives back the
        user's own module, subclasses included, and ``calibrate`` can run it as the teacher."""
        self.__dict__["_adapter_original"] = module

    @property
    def original(self) -> Optional[nn.Module]:
        """The module this one replaced, or None for a module built directly."""
        return self.__dict__.get("_adapter_original")

    def to_original(self) -> nn.Module:
        """The replaced module, holding this adapter's current submodules (and so its trained weights)."""
        original = self.original
        for name in self.reused:
            if name in original._modules:
                original._modules[name] = getattr(self, name)
        return original.train(self.training)

    def original_output(self, args: tuple, kwargs: dict):
        """The replaced module's output on this call, in this module's train/eval mode (``patch`` kept it in the
        mode the model had then, and model.eval() does not reach an unregistered module)."""
        self.original.train(self.training)
        return self.original(*args, **kwargs)

    # ------------------------------------------------------------------ what patch asks
    @classmethod
    def originals(cls) -> tuple:
        """The classes this adapter replaces, matched exactly (a subclass may change forward)."""
        return ()

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return type(module) in cls.originals()

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> Optional[str]:
        return None

    @classmethod
    def sequence_length(cls, owner: nn.Module) -> Optional[int]:
        return None

    @classmethod
    def grid_source(cls, owner_name: str, owner: nn.Module, name: str):
        return None

    @classmethod
    def prepare_model(cls, model: nn.Module, modules: List[nn.Module]) -> List[str]:
        """Model-wide changes ``patch`` makes once this class's adapters are in ``modules``; returns notes for the
        report."""
        return []

    @classmethod
    def restore_model(cls, model: nn.Module) -> List[str]:
        """Undo ``prepare_model`` after ``unpatch`` took this class's adapters out; returns notes for the report."""
        return []


def drop_missing_state(names: Iterable[str], prefix: str, state_dict, missing_keys: list) -> None:
    """After ``_load_from_state_dict``: a checkpoint of the original model (nn.MultiheadAttention, timm) has none of
    the tensors linear_mha adds (``names``: the method's state, the local term's), which then keep their
    initialisation instead of being reported missing."""
    owned = [prefix + name for name in names]
    if owned and not any(key in state_dict for key in owned):
        missing_keys[:] = [key for key in missing_keys if key not in owned]


def _adapters_kept_whole(is_leaf_module):
    """torch.fx.Tracer.is_leaf_module, extended to every attention adapter: FX records one as a single call_module
    node, as it records the torch.nn module the adapter replaced (FX keeps torch.nn modules whole), so that FX tools
    (torchvision's create_feature_extractor, timm's feature extraction) see a patched model as they saw the
    original: its hooks run when the graph runs, not while it is traced. Traced through, the adapter's checks of
    shapes and masks and its choice of backend would be Python branches on values a symbolic trace does not have.
    The mark is a class attribute, not the class, so modules built before an importlib.reload keep it."""
    @functools.wraps(is_leaf_module)
    def is_leaf_or_adapter(self, m, module_qualified_name):
        return getattr(type(m), "kept_whole_by_fx", False) or is_leaf_module(self, m, module_qualified_name)
    is_leaf_or_adapter.keeps_linear_mha_adapters = True
    return is_leaf_or_adapter


if not getattr(torch.fx.Tracer.is_leaf_module, "keeps_linear_mha_adapters", False):
    torch.fx.Tracer.is_leaf_module = _adapters_kept_whole(torch.fx.Tracer.is_leaf_module)


def traced_whole(forward):
    """Decorator for an adapter's forward, for tracers whose is_leaf_module does not call torch.fx.Tracer's (FX
    quantization's prepare_fx): when symbolic values reach forward, the module is recorded as one call_module node
    from here. Its hooks have run on the symbolic values already, so they are in the graph, and the node would run
    them again: a module with hooks of its own is refused, with what to do. So is the root of a trace, which cannot
    be a node of its own graph."""
    @functools.wraps(forward)
    def forward_or_node(self, *args, **kwargs):
        proxies = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)]  # what dynamo can trace
        if not proxies:
            return forward(self, *args, **kwargs)
        tracer = proxies[0].tracer
        try:
            path = tracer.path_of_module(self) if getattr(tracer, "root", None) is not self else ""
        except (NameError, AttributeError):  # not under the root, or a tracer that knows no modules
            path = ""
        if not path:
            raise TypeError(f"torch.fx cannot trace {type(self).__name__} on its own: its forward branches on the "
                            f"inputs' shapes and masks. Trace the model that holds it, where it is recorded as one "
                            f"call_module node (as torch.fx records nn.MultiheadAttention), or use torch.export.export")
        hooks = [hook for hook in itertools.chain(self._forward_pre_hooks.values(), self._forward_hooks.values())
                 if not getattr(hook, "idempotent", False)]
        if hooks:
            raise TypeError(f"this tracer traced into {path!r} ({type(self).__name__}) and recorded its hooks, which "
                            f"its node in the graph would run again. Keep the module whole (FX quantization: "
                            f"PrepareCustomConfig().set_non_traceable_module_classes([{type(self).__name__}])), or "
                            f"remove its hooks while tracing")
        return tracer.create_proxy("call_module", path, args, kwargs)
    return forward_or_node


# ---------------------------------------------------------------------------------------------- registry
_ADAPTERS: List[Type[nn.Module]] = []


def register_adapter(adapter: Type[nn.Module]) -> Type[nn.Module]:
    """Let ``patch`` replace every module ``adapter.matches`` with ``adapter`` (usable as a class decorator)."""
    if not (isinstance(adapter, type) and issubclass(adapter, AttentionAdapter) and issubclass(adapter, nn.Module)):
        raise TypeError(f"register_adapter(): {adapter!r} must subclass AttentionAdapter and nn.Module")
    if not hasattr(adapter, "from_original"):
        raise TypeError(f"register_adapter(): {adapter.__name__} has no from_original; see linear_mha.adapters")
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)
    return adapter


def adapter_for(module: nn.Module) -> Optional[Type[nn.Module]]:
    """The adapter that replaces ``module``, or None."""
    return next((adapter for adapter in _ADAPTERS if adapter.matches(module)), None)


def adapter_classes() -> tuple:
    """Every registered adapter class: an instance of one is linear_mha's attention module."""
    return tuple(_ADAPTERS)


__all__ = ["AttentionAdapter", "ATTACHED", "UnknownLength", "register_adapter", "adapter_for", "adapter_classes",
           "traced_whole"]
