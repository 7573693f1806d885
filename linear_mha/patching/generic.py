"""nn.MultiheadAttention (and subclasses that keep its forward) <-> LinearMultiheadAttention, sharing the Parameter
objects both ways, and the nn.TransformerEncoder nested-tensor switch that must be off once an encoder holds linear
attention."""
from torch import nn

from ..attention import LinearMultiheadAttention

# torch's class, captured at import: inside patched() the name nn.MultiheadAttention builds linear modules.
TORCH_MHA = nn.MultiheadAttention

# The replaced module is kept (unregistered: not in state_dict, parameters() or .to()) so unpatch() can give back
# the user's own class, subclasses included, with the Parameters the linear module trained.
ORIGINAL_ATTR = "_linear_mha_original"
_NESTED_ATTR = "_linear_mha_use_nested_tensor"
_PARAM_NAMES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k",
                "bias_v")


def to_linear(mha: TORCH_MHA, options: dict) -> LinearMultiheadAttention:
    """The same Parameter objects (so state_dict tensors are equal and an optimizer holding them keeps working),
    device, dtype and train/eval state, with linear attention."""
    new = LinearMultiheadAttention.from_torch(mha, copy=False, **options)
    new.__dict__[ORIGINAL_ATTR] = mha
    return new


def to_torch(linear: LinearMultiheadAttention) -> TORCH_MHA:
    """The module patch() replaced (or a new nn.MultiheadAttention for one built as linear), holding the linear
    module's current Parameters."""
    original = linear.__dict__.get(ORIGINAL_ATTR)
    if original is None:
        ref = linear.in_proj_weight if linear._qkv_same_embed_dim else linear.q_proj_weight
        original = TORCH_MHA(
            linear.embed_dim, linear.num_heads, dropout=linear.dropout, bias=linear.in_proj_bias is not None,
            add_bias_kv=linear.bias_k is not None, add_zero_attn=linear.add_zero_attn, kdim=linear.kdim,
            vdim=linear.vdim, batch_first=linear.batch_first, device=ref.device, dtype=ref.dtype)
    for name in _PARAM_NAMES:
        if getattr(linear, name) is not None:
            setattr(original, name, getattr(linear, name))
    original.out_proj = linear.out_proj
    original.dropout = linear.dropout
    return original.train(linear.training)


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
