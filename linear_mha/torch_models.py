"""torch.nn.MultiheadAttention's side of LinearMultiheadAttention: the constructor arguments it accepts, and what
models built on it tell ``patch`` about the attention inside them: whether a module can be swapped at all, how many
tokens torchvision's VisionTransformer feeds it, and where the token grid of a ViT or a DETR-style transformer comes
from (``LinearMultiheadAttention``'s adapter class methods call these)."""
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from .token_grid import PatchConvolution, feature_map_grid

# torch's class, captured at import: inside patched() the name nn.MultiheadAttention builds linear modules.
TORCH_MHA = nn.MultiheadAttention


def check_arguments(embed_dim, num_heads, dropout, kdim, vdim, dtype):
    """nn.MultiheadAttention's arguments, each named in its error (torch's own errors name none of them)."""
    for name, value, optional in (("embed_dim", embed_dim, False), ("num_heads", num_heads, False),
                                  ("kdim", kdim, True), ("vdim", vdim, True)):
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a number in [0, 1], got {type(dropout).__name__} {dropout!r}")
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout must be in [0, 1], got {dropout}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (or None), got {dtype!r}")


def mha_subclass_reason(module: nn.Module) -> Optional[str]:
    """Why an nn.MultiheadAttention cannot be swapped for LinearMultiheadAttention, or None if it can: the swap
    reruns torch's forward on the same Parameters, so a subclass must keep both."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        return ("its weights are parametrized (torch.nn.utils.parametrize); the linear module takes plain "
                "Parameters, so patch before adding the parametrization")
    if cls.forward is not TORCH_MHA.forward:
        return (f"subclass {cls.__module__}.{cls.__qualname__} overrides forward; a linear drop-in would run "
                f"torch's forward instead and drop that code")
    return None


def _is_torchvision_vit(owner: nn.Module) -> bool:
    return type(owner).__module__.startswith("torchvision.models.vision_transformer")


def sequence_length(owner: nn.Module) -> Optional[int]:
    """The tokens torchvision's VisionTransformer feeds its encoder (patches + class token), or None."""
    if _is_torchvision_vit(owner) and isinstance(getattr(owner, "seq_length", None), int):
        return owner.seq_length
    return None


def grid_source(owner_name: str, owner: nn.Module, name: str):
    """(source module name, grid reader) for attention ``name`` inside ``owner``: a torchvision VisionTransformer
    (its input image, the class token first), or a DETR-style transformer (a module with an encoder and a decoder,
    fed a (B, C, H, W) feature map) whose encoder holds it; else None."""
    if _is_torchvision_vit(owner) and isinstance(getattr(owner, "conv_proj", None), nn.Conv2d):
        return owner_name, PatchConvolution("conv_proj", 1)
    if _is_torchvision_vit(owner) and isinstance(getattr(owner, "patch_size", None), int):
        return owner_name, feature_map_grid(1, owner.patch_size)
    encoder, decoder = getattr(owner, "encoder", None), getattr(owner, "decoder", None)
    if (isinstance(encoder, nn.Module) and isinstance(decoder, nn.Module)
            and name.startswith(f"{owner_name}.encoder." if owner_name else "encoder.")):
        return owner_name, feature_map_grid(0)
    return None
