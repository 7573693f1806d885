"""The nn.TransformerEncoder nested-tensor switch that must be off once an encoder holds linear attention."""
from torch import nn

_NESTED_ATTR = "_linear_mha_use_nested_tensor"


def disable_nested_tensor(model: nn.Module, is_linear) -> list:
    """nn.TransformerEncoder(enable_nested_tensor=True), in eval without grad, packs its input into a NestedTensor
    and runs its layers' C++ fast path on in_proj_weight; an encoder built before the swap still has the flag.
    Returns the names of encoders switched off (the old value is kept for unpatch)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            if any(is_linear(m) for m in module.modules()):
                module.__dict__[_NESTED_ATTR] = True
                module.use_nested_tensor = False
                names.append(name)
    return names


def restore_nested_tensor(model: nn.Module, is_linear) -> list:
    names = []
    for name, module in model.named_modules():
        if module.__dict__.get(_NESTED_ATTR) and not any(is_linear(m) for m in module.modules()):
            module.use_nested_tensor = module.__dict__.pop(_NESTED_ATTR)
            names.append(name)
    return names
