"""Attention classes other than nn.MultiheadAttention that patch() can swap, each with its adapter.

An adapter is an nn.Module class that runs the original module's projections (the very same submodules, so
state_dict keys and tensors stay as they were) and a registry method in place of the softmax step. It subclasses
``AttentionAdapter`` (which provides ``original``, calibrate()'s teacher, ``to_original()``, ``mode`` and checkpoint
loading), calls ``keep_original`` in its constructor, sets ``method``, and provides:

    kind, reused                       a short name for reports and lookups ("timm", "lm"); the submodules it takes
    unsupported_reason(module)         classmethod: why this instance cannot be patched, or None
    from_original(module, **options)   classmethod: the adapter, holding ``mode`` and the method's options
    output_padding(*args, **kwargs)    optional: which output rows of that call are padding's own (calibrate
                                       leaves them out of the error), or None

timm's Attention registers here (timm_attention.py), and so does the LM stack's SelfAttention
(``linear_mha.lm.patched_attention``): this layer never imports the layers that use it.
"""
from typing import Callable, List, Optional, Tuple, Type

from torch import nn

from ..attend import MethodState

class AttentionAdapter(MethodState):
    """What every adapter shares (a mixin, before its nn.Module base): the replaced module kept unregistered (not in
    state_dict or parameters(), so ``to_original`` returns the user's module itself), handing the ``reused``
    submodules back, ``mode``, FAVOR+ redraws, and checkpoints of the original model loading without the tensors
    the method added."""

    kind = ""
    reused: Tuple[str, ...] = ()  # submodules taken over from the original, given back by to_original()

    def keep_original(self, module: nn.Module) -> None:
        self.__dict__["_adapter_original"] = module

    @property
    def original(self) -> nn.Module:
        return self.__dict__["_adapter_original"]

    @property
    def mode(self) -> str:
        return self.method.name

    def to_original(self) -> nn.Module:
        """The replaced module, holding this adapter's current submodules (and so its trained weights)."""
        original = self.original
        for name in self.reused:
            if name in original._modules:
                original._modules[name] = getattr(self, name)
        return original.train(self.training)



# (function returning the original classes, matched by exact type, adapter class)
_ADAPTERS: List[Tuple[Callable[[], tuple], Type[nn.Module]]] = []


def register_adapter(originals: Callable[[], tuple], adapter: Type[nn.Module]) -> None:
    """Let patch() swap every module whose exact class is in ``originals()`` for ``adapter``. ``originals`` is a
    function so a library can be looked up only when it is already imported (timm)."""
    if not (issubclass(adapter, AttentionAdapter) and issubclass(adapter, nn.Module)):
        raise TypeError(f"register_adapter(): {adapter.__name__} must subclass AttentionAdapter and nn.Module")
    for name in ("unsupported_reason", "from_original"):
        if not hasattr(adapter, name):
            raise TypeError(f"register_adapter(): {adapter.__name__} has no {name!r}; see linear_mha.patching.adapters")
    if all(a is not adapter for _, a in _ADAPTERS):
        _ADAPTERS.append((originals, adapter))


def adapter_for(module: nn.Module) -> Optional[Type[nn.Module]]:
    """The adapter that replaces ``module`` (exact class match: a subclass may change forward), or None."""
    for originals, adapter in _ADAPTERS:
        if type(module) in originals():
            return adapter
    return None


def adapter_classes() -> tuple:
    return tuple(adapter for _, adapter in _ADAPTERS)


def original_classes() -> tuple:
    return tuple(cls for originals, _ in _ADAPTERS for cls in originals())
