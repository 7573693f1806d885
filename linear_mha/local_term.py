"""The local term every attention module can add to its method's output (``dwc_kernel``): a depthwise k x k
convolution of the values over the image's token grid (FLatten's DWC, MLLA's LePE), the neighbourhood mixing that
linear attention lacks. Its parameters ``dwc_weight`` and ``dwc_bias`` start at zero, so a patched model starts as
its linear attention alone, and a checkpoint of the original model loads without them."""
from typing import Optional

import torch
from torch import Tensor, nn

from . import masks
from .functional import native_maps
from .functional._common import compiling, functorch_active, needs_grad
from .functional.backend import NATIVE, local_term_backend
from .functional.grid_conv import check_grid_shapes, token_grid_conv
from .token_grid import NO_GRID, TokenGrid, check_traced_grid, resolve_token_grid

LOCAL_TERM_STATE = ("dwc_weight", "dwc_bias")


def check_dwc_kernel(dwc_kernel) -> Optional[int]:
    if dwc_kernel is not None and (isinstance(dwc_kernel, bool) or not isinstance(dwc_kernel, int)
                                   or dwc_kernel < 1 or dwc_kernel % 2 == 0):
        raise ValueError(f"dwc_kernel must be None or an odd positive int (the k of a k x k convolution), "
                         f"got {dwc_kernel!r}")
    return dwc_kernel


def install_local_term(module: nn.Module, channels: int, dwc_kernel: Optional[int], factory_kwargs: dict) -> None:
    """Register the local term's parameters on ``module``: ``dwc_weight`` (channels, 1, k, k) and ``dwc_bias``
    (channels,), zero at first (or None without one)."""
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
    # In a graph (compiling) an all-allowed mask cannot be told from another without a branch: any mask is refused.
    forbidding = attn_mask is not None and (attn_mask.dtype != torch.bool or compiling() or bool(attn_mask.any()))
    if is_causal or forbidding:
        raise ValueError("dwc_kernel mixes neighbouring tokens in every direction over the grid: it has no causal "
                         "form and applies no attn_mask; use key_padding_mask for padding, or build the module "
                         "without dwc_kernel")
    grid = resolve_token_grid(module, token_grid)
    if grid is None:
        raise ValueError(f"dwc_kernel {NO_GRID}")
    v = check_traced_grid(v, grid)
    if key_padding_mask is not None:
        key_padding_mask = masks.to_forbidden(key_padding_mask, "key_padding_mask", "with dwc_kernel")
    weight, bias = module.dwc_weight, module.dwc_bias
    if grid.height * grid.width > 0 and local_term_backend(out, v, weight, bias).backend == NATIVE:
        check_grid_shapes(v, weight, grid.height, grid.width, grid.prefix)
        return native_maps.local_term(out, v, weight, bias, grid.height, grid.width, grid.prefix, key_padding_mask,
                                      inplace=True)
    local = token_grid_conv(v, weight, bias, grid.height, grid.width, grid.prefix, key_padding_mask).to(out.dtype)
    # For a module's values the convolution's output is (B, S, H, d) in memory, and the sum keeps that layout (local
    # comes first), so merging the heads after it is a view. Without autograd the sum goes into that fresh output
    # itself; with it, in place on a view would cost autograd a copy of the whole tensor backward.
    if needs_grad(local, out) or compiling() or functorch_active():  # vmap may batch out alone
        return local + out
    return local.add_(out)
