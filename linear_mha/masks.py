"""The mask half of nn.MultiheadAttention's contract, turned into what the functional layer expects.

nn.MultiheadAttention accepts ``key_padding_mask`` (B, S) and ``attn_mask`` (L, S) or (B * H, L, S), each bool
(True = may NOT attend) or float (added to the scores; -inf forbids). The linear modes cannot add an arbitrary
bias to scores they never form, so this module sorts masks into what every mode can honour exactly:
padding (a bool per key) and causality. Anything else is reported, naming the modes that support it.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import InputError
from .functional._common import compiling, fixed_graph


def require_values(ok: Tensor, error: type, message: str) -> None:
    """Raise ``error(message)`` unless the 0-d bool tensor ``ok`` is True: a check on a mask's values.

    Eager, it raises at once. Under torch.compile it becomes an assertion inside the graph (torch._assert_async),
    which raises RuntimeError(message) when the compiled code runs: a Python branch on a value would split the
    graph (and fail under fullgraph=True). torch.export and torch.jit.trace (fixed_graph) record no check at all,
    as they cannot carry one into every exporter's format: there the caller vouches for the mask (docs/modes.md)."""
    if fixed_graph():
        return
    if compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise error(message)


def _check_dtype(mask: Tensor, name: str) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be a bool tensor (True = masked) or a float tensor (additive), got {mask.dtype}; "
            f"convert it with {name}.bool()"
        )


def _check_device(mask: Tensor, name: str, device: Optional[torch.device]) -> None:
    if device is not None and mask.device != device:
        raise InputError(f"{name} is on {mask.device} but the inputs are on {device}; move it with "
                         f"{name}.to({str(device)!r})")


def check_key_padding_mask(mask: Optional[Tensor], batch: int, src_len: int, unbatched: bool,
                           device: Optional[torch.device] = None) -> Optional[Tensor]:
    """Validate shape, dtype and (given the inputs' ``device``) device; returns the mask as (B, S)."""
    if mask is None:
        return None
    _check_device(mask, "key_padding_mask", device)
    _check_dtype(mask, "key_padding_mask")
    expected = (src_len,) if unbatched else (batch, src_len)
    if tuple(mask.shape) != expected:
        raise InputError(f"key_padding_mask must have shape {expected} (batch, source length), got {tuple(mask.shape)}")
    return mask.reshape(batch, src_len)


def check_attn_mask(mask: Optional[Tensor], batch: int, heads: int, tgt_len: int, src_len: int,
                    unbatched: bool, device: Optional[torch.device] = None) -> Optional[Tensor]:
    """Validate shape, dtype and (given the inputs' ``device``) device; returns the mask as (L, S) or (B, H, L, S)."""
    if mask is None:
        return None
    _check_device(mask, "attn_mask", device)
    _check_dtype(mask, "attn_mask")
    per_sample = (heads, tgt_len, src_len) if unbatched else (batch * heads, tgt_len, src_len)
    if tuple(mask.shape) == (tgt_len, src_len):
        return mask
    if tuple(mask.shape) == per_sample:
        return mask.reshape(batch, heads, tgt_len, src_len)
    raise InputError(
        f"attn_mask must have shape {(tgt_len, src_len)} or {per_sample}, got {tuple(mask.shape)}"
    )


def to_additive(mask: Optional[Tensor], dtype: torch.dtype, name: str = "mask") -> Optional[Tensor]:
    """bool (True = forbidden) -> float 0/-inf; float masks are used as they are, as nn.MultiheadAttention does, but
    NaN or +inf (which would turn whole rows of scores into NaN) is refused."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    require_values(~(torch.isnan(mask) | torch.isposinf(mask)).any(), ValueError,
                   f"{name} holds NaN or +inf, which would make the scores of whole rows NaN; a float mask adds "
                   f"finite values or -inf (forbidden), or pass a bool mask (True = forbidden)")
    return mask.to(dtype)


def additive_bias(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], is_causal: bool, tgt_len: int,
                  src_len: int, n_extra: int, dtype: torch.dtype, device) -> Optional[Tensor]:
    """All masks as one additive float bias broadcastable to (B, H, L, S + n_extra), for exact softmax: the n_extra
    columns of extra keys (add_bias_kv / add_zero_attn) are never masked, as in nn.MultiheadAttention.
    key_padding_mask (B, S) and attn_mask (L, S) or (B, H, L, S) as the ``check_*`` functions return them."""
    bias = None
    if key_padding_mask is not None:
        bias = F.pad(to_additive(key_padding_mask, dtype, "key_padding_mask"), (0, n_extra))[:, None, None, :]
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(tgt_len, src_len, dtype=torch.bool, device=device).triu(1)
    if attn_mask is not None:
        mask = F.pad(to_additive(attn_mask, dtype, "attn_mask"), (0, n_extra))
        mask = mask[None, None] if mask.dim() == 2 else mask
        bias = mask if bias is None else bias + mask
    return bias


def to_forbidden(mask: Tensor, name: str, mode: str) -> Tensor:
    """bool or 0/-inf float -> bool (True = forbidden). A float mask with other values is a score bias, which
    only exact softmax can apply."""
    if mask.dtype == torch.bool:
        return mask
    forbidden = torch.isneginf(mask)
    require_values(((mask == 0) | forbidden).all(), ValueError,
                   f"{name} holds additive float values other than 0 and -inf; mode={mode!r} can only honour masks "
                   f"that remove keys entirely. Use mode='softmax' for score biases, or pass a bool mask.")
    return forbidden


def causal_pattern(forbidden: Tensor) -> Optional[Tensor]:
    """Whether a bool (..., L, S) mask forbids exactly the future (j > i) in every slice, as a 0-d bool tensor (read
    it without a graph); None where L != S, which no causal mask has."""
    L, S = forbidden.shape[-2:]
    if L != S:
        return None
    future = torch.ones(L, S, dtype=torch.bool, device=forbidden.device).triu(1)
    return (forbidden == future).all()


def is_causal_pattern(forbidden: Tensor) -> bool:
    """True if a bool (..., L, S) mask with L == S forbids exactly the future (j > i) in every slice."""
    found = causal_pattern(forbidden)
    return found is not None and bool(found)


NOT_CAUSAL = "is_causal=True, but attn_mask is not the causal (upper-triangular) mask; pass the causal mask, or drop is_causal"


def classify_attn_mask_for_linear(attn_mask: Optional[Tensor], is_causal: bool, mode: str,
                                  causal_modes: Tuple[str, ...]) -> bool:
    """Decide whether a method without arbitrary masks runs causally, or raise if the mask cannot be honoured
    exactly (``causal_modes``: the methods with a causal form, for the message).

    Returns True for causal attention, False for none. A mask that forbids nothing is no mask.
    In a graph (torch.compile, export, trace) the answer cannot depend on the mask's values: with is_causal=True
    the mask is checked to be the causal one (in the graph, as ``require_values`` does) and the call is causal, as
    torch's own is_causal hint; without it, torch.compile reads the values outside the graph (a graph break) and
    the exporters refuse."""
    if attn_mask is None:
        return is_causal
    if is_causal and compiling():
        found = causal_pattern(to_forbidden(attn_mask, "attn_mask", mode))
        if found is None:
            raise ValueError(NOT_CAUSAL + f" (it is {tuple(attn_mask.shape[-2:])}, not square)")
        require_values(found, ValueError, NOT_CAUSAL)
        return True
    if fixed_graph():  # which pattern it is cannot be read from a graph's input, nor baked in
        raise ValueError(
            f"mode={mode!r} under torch.export or torch.jit.trace: a recorded graph cannot read attn_mask's values "
            f"to tell the causal mask from another pattern. Pass is_causal=True with the causal mask (or "
            f"attn_mask=None, is_causal=True), no attn_mask without causality, or use mode='softmax'")
    forbidden = to_forbidden(attn_mask, "attn_mask", mode)
    if is_causal_pattern(forbidden):
        return True
    if is_causal:
        raise ValueError(NOT_CAUSAL)
    if not bool(forbidden.any()):
        return False
    raise ValueError(
        f"attn_mask has a pattern (not causal, not padding) that mode={mode!r} cannot apply without forming the "
        f"L x S score matrix. Supported: key padding in every mode; causal masks in modes "
        f"{causal_modes}; any mask in mode='softmax'. For padding use key_padding_mask."
    )
