"""The output gate every attention module can multiply its heads' output by (``output_gate=True``): per head,
out ⊙ 2·sigmoid(q W + b), from the head's own query (RALA's and MLLA's multiplicative gate, made per head so that every
adapter has its input: a Hugging Face attention function receives the projected queries, never the layer input).
``gate_weight`` (H, d, d_v) and ``gate_bias`` (H, 1, d_v) start at zero, where the gate is exactly 1: a patched
pretrained model is unchanged until it trains, and a checkpoint of the original model loads without them.
2·sigmoid rather than SiLU for that reason (SiLU(0) = 0), and it can still shut a channel (→ 0) or double it.
The gate acts per position, so it has a causal form and needs no mask: padded queries' rows are padding's own."""
from typing import Optional

import torch
from torch import Tensor, nn

from .registry import boolean

OUTPUT_GATE_STATE = ("gate_weight", "gate_bias")


def check_output_gate(output_gate) -> bool:
    return boolean(output_gate, "output_gate")


def install_output_gate(module: nn.Module, num_heads: int, head_dim: int, value_dim: int, output_gate: bool,
                        factory_kwargs: dict) -> None:
    """Register ``gate_weight`` (H, d, d_v) and ``gate_bias`` (H, 1, d_v) on ``module``, zero (or None without a
    gate)."""
    if not check_output_gate(output_gate):
        for name in OUTPUT_GATE_STATE:
            module.register_parameter(name, None)
        return
    module.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim, value_dim, **factory_kwargs))
    module.gate_bias = nn.Parameter(torch.zeros(num_heads, 1, value_dim, **factory_kwargs))


def apply_output_gate(module: nn.Module, out: Tensor, q: Tensor) -> Tensor:
    """out (B, H, L, d_v) gated by the queries q (B, H, L, d) of the same call (a no-op without a gate)."""
    weight: Optional[Tensor] = getattr(module, "gate_weight", None)
    if weight is None:
        return out
    logits = q @ weight.to(q.dtype) + module.gate_bias.to(q.dtype)  # (B, H, L, d_v)
    return out * (2.0 * torch.sigmoid(logits)).to(out.dtype)
