"""A depthwise convolution of the values over the token grid, added to linear attention's output: the local term
of FLatten's DWC and MLLA's LePE, which linear attention lacks (its weights are smooth over all keys, so it cannot
concentrate on a neighbourhood the way softmax attention does).

The sequence is ``prefix`` tokens (class / register tokens, which get no local term) followed by a row-major
``height x width`` grid, as DETR's flattened feature map, timm's and torchvision's ViTs lay tokens out. Masked
positions (image padding) are zeroed before the convolution, so they reach no output and no gradient, and a valid
position next to the padding sees what it would see at the border of an unpadded image.
"""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor


def check_grid_shapes(v: Tensor, weight: Tensor, height: int, width: int, prefix: int) -> None:
    """Raises ValueError unless the grid describes v's sequence and weight is (H * d, 1, k, k) with odd k."""
    b, h, s, d = v.shape
    k = weight.shape[-1]
    if s != prefix + height * width:
        raise ValueError(f"the token grid is {height} x {width} with {prefix} prefix token(s), {prefix + height * width}"
                         f" tokens, but the values have {s}; the grid must describe the sequence this call attends")
    if weight.shape != (h * d, 1, k, k) or k % 2 == 0:
        raise ValueError(f"weight must have shape (H * d, 1, k, k) = {(h * d, 1, k, k)} with odd k, got "
                         f"{tuple(weight.shape)}")


def token_grid_conv(v: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int, prefix: int = 0,
                    key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """v (B, H, S, d) with S = prefix + height * width -> (B, H, S, d): channel c = h * d + j of each grid token
    convolved over its k x k neighbourhood with weight (H * d, 1, k, k) (odd k, zero padding) and bias (H * d,);
    the prefix tokens' rows are zero. key_padding_mask: bool (B, S), True = masked."""
    check_grid_shapes(v, weight, height, width, prefix)
    b, h, s, d = v.shape
    k = int(weight.shape[-1])  # a 0-d tensor under torch.jit.trace on older torch, which conv2d's padding refuses
    # The convolution runs channels last, (B, height, width, H * d) seen as conv2d's (B, H * d, height, width): a
    # module's values are a view of its projection, already in that layout, where making them (B, H * d, height,
    # width) took a transposing copy slower than the convolution itself (72 ms against 11 at 16,384 tokens of 512).
    grid = v[:, :, prefix:].transpose(1, 2)  # (B, HW, H, d)
    if key_padding_mask is not None:
        grid = grid.masked_fill(key_padding_mask[:, prefix:, None, None], 0.0)
    grid = grid.reshape(b, height, width, h * d).permute(0, 3, 1, 2)
    local = F.conv2d(grid, weight.to(grid.dtype), None if bias is None else bias.to(grid.dtype), padding=k // 2,
                     groups=h * d)
    local = local.permute(0, 2, 3, 1).reshape(b, height * width, h, d).transpose(1, 2)
    return F.pad(local, (0, 0, prefix, 0)) if prefix else local
