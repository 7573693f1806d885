"""Padding masks in the LM stack: converted once, where a caller hands them in.

The public classes take the keep-masks of the projects this stack descends from (``input_mask``,
``context_mask``, ``mask_t``: True = keep). Everything below them speaks the library's convention, that of
nn.MultiheadAttention's ``key_padding_mask`` (True = padding, ignored): layers, wrappers and functions receive
``padding`` (B, N), ``context_padding`` (B, S) or ``padding_t`` (B,) and never invert a mask they were given.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


def padding_from_keep(name: str, keep: Optional[Tensor], shape: Tuple[int, ...]) -> Optional[Tensor]:
    """The padding mask (True = padding) of a public keep-mask ``keep`` (True = keep) of ``shape``; None stays
    None. ``name`` is the caller's keyword, for the error a wrong mask gets."""
    if keep is None:
        return None
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = keep), got {getattr(keep, 'dtype', type(keep))}")
    if tuple(keep.shape) != tuple(shape):
        dims = "(batch,)" if len(shape) == 1 else "(batch, seq)"
        raise ValueError(f"{name} must have shape {dims} = {tuple(shape)}, got {tuple(keep.shape)}")
    return ~keep


def padding_of_layer(name: str, keep: Optional[Tensor], padding: Optional[Tensor],
                     shape: Tuple[int, ...]) -> Optional[Tensor]:
    """A public layer's padding mask from either of its keywords: ``name`` (a keep-mask, True = keep, as a user
    calls the layer) or the padding mask the layer stack passes (True = padding); not both."""
    if keep is not None and padding is not None:
        raise ValueError(f"pass {name} (True = keep) or the stack's padding mask (True = padding), not both")
    if padding is not None:
        return padding
    return padding_from_keep(name, keep, shape)
