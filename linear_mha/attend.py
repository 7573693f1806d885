"""The attention step every linear_mha module shares: (q, k, v) heads and nn.MultiheadAttention's masks in, the
method's output out. Masks are turned here, once, into what the method declares it honours (``registry``), and
anything it cannot honour exactly is refused before it runs. The optional local term (``dwc_kernel``: a depthwise
convolution of the values over the token grid, ``functional.grid_conv``) is added here too, for every method."""
from typing import Iterable, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from . import masks
from .functional.grid_conv import token_grid_conv
from .registry import AttentionMethod, causal_methods
from .token_grid import TokenGrid

LOCAL_TERM_STATE = ("dwc_weight", "dwc_bias")
NO_GRID = ("needs the token grid of this call: patch() finds it for DETR, timm and torchvision ViTs; elsewhere call "
           "linear_mha.track_token_grid(model, source=...) or pass token_grid=TokenGrid(height, width, prefix) to "
           "forward")


def needs_token_grid(module: nn.Module) -> bool:
    """Whether ``module`` (LinearMultiheadAttention, LinearTimmAttention) reads the token grid of its input."""
    return getattr(module, "dwc_weight", None) is not None or module.method.needs_grid


def resolve_token_grid(module: nn.Module, token_grid: Optional[TokenGrid]) -> Optional[TokenGrid]:
    """The grid passed to forward, else the one the module's tracker recorded for this forward, else None."""
    if token_grid is not None:
        return token_grid
    return getattr(module.__dict__.get("token_grid_source"), "grid", None)


def attend_heads(method: AttentionMethod, state: Mapping[str, Optional[Tensor]], q: Tensor, k: Tensor, v: Tensor, *,
                 key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                 is_causal: bool = False, extra_keys: Optional[Tuple[Tensor, Tensor]] = None,
                 need_weights: bool = False, dropout_p: float = 0.0,
                 token_grid: Optional[TokenGrid] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """q (B, H, L, d), k (B, H, S, d), v (B, H, S, d_v) -> (out (B, H, L, d_v), weights (B, H, L, S + n) or None).

    key_padding_mask (B, S) and attn_mask (L, S) or (B, H, L, S) as ``masks.check_*`` return them (bool, True =
    forbidden, or float, additive). extra_keys: (k, v) of n keys every query sees (add_bias_kv / add_zero_attn).
    Weights come back only from methods that form them, and only when asked. token_grid: for methods that declare
    ``needs_grid`` (None: refused with how to give it).
    """
    L, S = q.shape[2], k.shape[2]
    kwargs = {}
    if method.needs_grid:
        if token_grid is None:
            raise ValueError(f"mode={method.name!r} {NO_GRID}")
        kwargs["token_grid"] = token_grid
    if extra_keys is not None:
        if not method.extra_keys:
            raise ValueError(f"mode={method.name!r} does not handle the extra keys of add_bias_kv / add_zero_attn")
        kwargs["extra_keys"] = extra_keys
    if method.any_mask:
        n_extra = 0 if extra_keys is None else extra_keys[0].shape[2]
        kwargs["attn_bias"] = masks.additive_bias(key_padding_mask, attn_mask, is_causal, L, S, n_extra, q.dtype,
                                                  q.device)
    else:
        if key_padding_mask is not None:
            key_padding_mask = masks.to_forbidden(key_padding_mask, "key_padding_mask", method.name)
        causal = masks.classify_attn_mask_for_linear(attn_mask, is_causal, method.name, causal_methods())
        if causal and not method.causal:
            raise ValueError(f"mode={method.name!r} has no causal form (its keys are mixed across the sequence); "
                             f"causal attention is supported by modes {causal_methods()}")
        if causal and L != S:
            raise ValueError(f"causal attention needs as many queries as keys, got L={L}, S={S}")
        kwargs.update(key_padding_mask=key_padding_mask, causal=causal)
    if need_weights and method.returns_weights:
        return method.attend_with_weights(q, k, v, state, dropout_p=dropout_p, **kwargs)
    return method.attend(q, k, v, state, dropout_p=dropout_p, **kwargs), None


class MethodState:
    """Mixin for the modules that hold a method's state (LinearMultiheadAttention, the patching adapters): FAVOR+
    redraws, and checkpoints of the original model loading without the tensors the method added."""

    def redraw_features(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new FAVOR+ random projection (mode='kernel' with feature_map='favor')."""
        self.method.redraw(self, generator)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        drop_missing_state(self.method.state_names + LOCAL_TERM_STATE, prefix, state_dict, missing_keys)


def drop_missing_state(names: Iterable[str], prefix: str, state_dict, missing_keys: list) -> None:
    """After ``_load_from_state_dict``: a checkpoint of the original model (nn.MultiheadAttention, timm) has none of
    the tensors linear_mha adds (``names``: the method's state, the local term's), which then keep their
    initialisation instead of being reported missing."""
    owned = [prefix + name for name in names]
    if owned and not any(key in state_dict for key in owned):
        missing_keys[:] = [key for key in missing_keys if key not in owned]


def check_dwc_kernel(dwc_kernel) -> Optional[int]:
    if dwc_kernel is not None and (isinstance(dwc_kernel, bool) or not isinstance(dwc_kernel, int)
                                   or dwc_kernel < 1 or dwc_kernel % 2 == 0):
        raise ValueError(f"dwc_kernel must be None or an odd positive int (the k of a k x k convolution), "
                         f"got {dwc_kernel!r}")
    return dwc_kernel


def install_local_term(module: nn.Module, channels: int, dwc_kernel: Optional[int], factory_kwargs: dict) -> None:
    """Register the local term's parameters on ``module``: ``dwc_weight`` (channels, 1, k, k) and ``dwc_bias``
    (channels,), zero at first, so a patched model starts as its linear attention alone (or None without one)."""
    if check_dwc_kernel(dwc_kernel) is None:
        for name in LOCAL_TERM_STATE:
            module.register_parameter(name, None)
        return
    module.dwc_weight = nn.Parameter(torch.zeros(channels, 1, dwc_kernel, dwc_kernel, **factory_kwargs))
    module.dwc_bias = nn.Parameter(torch.zeros(channels, **factory_kwargs))


def add_local_term(module: nn.Module, out: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                   attn_mask: Optional[Tensor], is_causal: bool, token_grid: Optional[TokenGrid]) -> Tensor:
    """out + the local term of ``module`` (a no-op without one). v (B, H, S, d) are the values of this call."""
    if module.dwc_weight is None:
        return out
    if out.shape[2] != v.shape[2]:
        raise ValueError(f"dwc_kernel adds a convolution of the values at the queries' own grid positions, so it "
                         f"needs self-attention (as many queries as keys); got L={out.shape[2]}, S={v.shape[2]}")
    forbidding = attn_mask is not None and (attn_mask.dtype != torch.bool or bool(attn_mask.any()))
    if is_causal or forbidding:
        raise ValueError("dwc_kernel mixes neighbouring tokens in every direction over the grid: it has no causal "
                         "form and applies no attn_mask; use key_padding_mask for padding, or build the module "
                         "without dwc_kernel")
    grid = resolve_token_grid(module, token_grid)
    if grid is None:
        raise ValueError(f"dwc_kernel {NO_GRID}")
    if key_padding_mask is not None:
        key_padding_mask = masks.to_forbidden(key_padding_mask, "key_padding_mask", "with dwc_kernel")
    return out + token_grid_conv(v, module.dwc_weight, module.dwc_bias, grid.height, grid.width, grid.prefix,
                                 key_padding_mask).to(out.dtype)
