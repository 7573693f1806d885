"""Causal kernel attention through flash-linear-attention's chunked Triton kernel (``pip install fla-core``), opt-in.

fla's ``chunk_linear_attn(..., normalize=True)`` computes the normalised causal product of ``kernel/chunked.py``,
``out_i = phi(q_i) . sum_{j<=i} phi(k_j) v_j^T / phi(q_i) . sum_{j<=i} phi(k_j)``, in fused Triton kernels, forward
and backward. With ``LINEAR_MHA_FLA=1`` in the environment (or inside ``backend.override(fla=True)``),
``functional.kernel`` sends causal elu/relu attention here when all of this holds:

* bfloat16 CUDA tensors. In float32 fla's products run in TF32 (a 10-bit mantissa), which would make float32
  results ~1e-3 off instead of ~1e-6. In float16 fla's normaliser, a float16 running sum of the key features
  times the query, passes float16's largest value (65,504) within a few thousand positions (non-finite rows at
  N = 65,536, docs/cuda.md). Both stay on our own path, which accumulates half inputs in float32.
* no ``initial_state`` (fla keeps the normaliser's key sum apart from the state; ours is one (F, Dv + 1) tensor),
  and even head dims (fla's half-precision backward asserts even K and V);
* fla imports and has the ``(B, T, H, K)`` + ``cu_seqlens`` interface (fla-core 0.6.0 was tested);
* not inside a torch.func transform, not being compiled.

Why opt-in: its outputs are about twice as far from float64 as ours (fla's normaliser is a bfloat16 cumulative
sum, ours accumulates in float32), and its speed was measured against our path at one batch size only;
docs/cuda.md has the numbers.

Key padding stays exact: masked keys' features and values are zeroed before the call (``masked_fill``, so
non-finite padding neither leaks nor gets gradient), and a query that sees only masked keys gets 0 as on our path
(fla divides by the normaliser plus 1e-10, where we divide 0 by 1).
"""
import functools
import importlib
import inspect
from typing import Callable, Optional

import torch
from torch import Tensor

from ._common import PathSwitch, compiling, functorch_active, has_tangent
from .feature_maps import apply_feature_map

FLA_MAPS = ("elu", "relu")
_switch = PathSwitch("LINEAR_MHA_FLA")
enabled, set_enabled = _switch.enabled, _switch.set  # whether this process may take the path; switch it


@functools.lru_cache(maxsize=None)
def _chunk_linear_attn():
    """(fla's chunk_linear_attn, None) or (None, why it cannot be used). Imported once, on first use."""
    try:
        op = importlib.import_module("fla.ops.linear_attn").chunk_linear_attn
    except Exception as exc:  # noqa: BLE001 - absent or broken (e.g. a Triton it cannot use): our path runs
        return None, f"fla is not importable ({type(exc).__name__}: {str(exc)[:120]})"
    if "cu_seqlens" not in inspect.signature(op).parameters:
        return None, "this fla's chunk_linear_attn predates the (B, T, H, K) layout; pip install -U fla-core"
    return op, None


def why_not(q: Tensor, k: Tensor, v: Tensor, feature_map, initial_state: Optional[Tensor],
            dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when causal kernel attention on these inputs can run on fla's kernel, else the reason it cannot.
    ``dtype``: the dtype the caller passed, when q is already a float32 copy of it."""
    if not _switch.on:
        return "the fla path is off (the default; LINEAR_MHA_FLA=1 or backend.override(fla=True) turns it on)"
    if q.device.type != "cuda":
        return f"fla's Triton kernels run on CUDA, the tensors are on {q.device.type}"
    dtype = dtype or q.dtype
    if dtype is not torch.bfloat16:
        why = "products run in TF32" if dtype is torch.float32 else "normaliser overflows float16 at long N"
        return f"{dtype} inputs: fla's {why}; only bfloat16 inputs take fla"
    if not (isinstance(feature_map, str) and feature_map in FLA_MAPS):
        return f"feature_map {getattr(feature_map, '__name__', feature_map)!r}: the fla path takes {FLA_MAPS}"
    if initial_state is not None:
        return "an initial_state: fla keeps the normaliser's key sum apart from its state"
    if q.shape[-1] % 2 or v.shape[-1] % 2:
        return f"odd head dims ({q.shape[-1]}, {v.shape[-1]}): fla's half-precision backward needs even ones"
    if functorch_active() or compiling():
        return "inside a torch.func transform or torch.compile"
    if has_tangent(q, k, v):
        return "a tensor carries a forward-mode AD tangent (torch.autograd.forward_ad), for which fla has no formula"
    return _chunk_linear_attn()[1]


def causal_kernel_fla(q: Tensor, k: Tensor, v: Tensor, feature_map: str,
                      key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """q, k (B, H, N, D), v (B, H, N, Dv) in bfloat16 on CUDA, v already key-dropped -> (B, H, N, Dv).
    Callers check ``why_not`` first."""
    op: Callable = _chunk_linear_attn()[0]
    phi_q, phi_k = apply_feature_map(feature_map, q, k, key_padding_mask=key_padding_mask, causal=True)
    if key_padding_mask is not None:
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    # fla takes (B, T, H, K); the transposed views are copied by fla where its kernels need contiguity.
    out, _ = op(phi_q.transpose(1, 2), phi_k.transpose(1, 2), v.transpose(1, 2), scale=1.0, normalize=True)
    return out.transpose(1, 2)
