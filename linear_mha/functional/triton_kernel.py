"""Fused Triton kernels for non-causal kernel attention with the elu, relu or taylor map, forward and backward:

    out_i = phi(q_i) S / phi(q_i) z,   S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)   (masked keys left out)

Composed from PyTorch ops each step (the map, the key sums, the products, the normaliser) reads and writes whole
N-sized tensors; here one pass over the keys applies the map and accumulates S and z in float32 (the sequence
split over programs, their partial sums added), and one pass over the queries applies the map, multiplies and
divides. The backward is two more passes of the same shape: the queries (d q, and G = sum_i phi(q_i)^T r_i for
r_i the gradient of [num_i, den_i]), then the keys (d k, d v from G).

Written for CUDA; the tests run them on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).
``backend.kernel_backend`` sends non-causal elu/relu calls on CUDA here (``LINEAR_MHA_TRITON=0`` or
``set_enabled(False)`` switches that off): on an H100 they ran 5.8x the PyTorch path's speed forward and 19-23x
SDPA's at N = 16k in bfloat16 (docs/cuda.md). taylor's kernel has run only under the interpreter: CUDA calls take
it with ``LINEAR_MHA_TRITON=all``.
"""
import importlib.util
import os
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._common import compiling, functorch_active

HAS_TRITON = importlib.util.find_spec("triton") is not None  # imported only when the kernels are first used


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


MAPS = {"elu": 0, "relu": 1, "taylor": 2}  # taylor: [x / |x|, 1], one feature more than x has values
# Maps whose kernels have run on a GPU (docs/cuda.md); the others have run under the interpreter only, and are
# taken on CUDA with LINEAR_MHA_TRITON=all until they have.
GPU_CHECKED = ("elu", "relu")
_setting = os.environ.get("LINEAR_MHA_TRITON", "1")
_enabled, _all_maps = _setting != "0", _setting == "all"


def set_enabled(enabled: bool, all_maps: Optional[bool] = None) -> bool:
    """Switch the Triton path on or off for CUDA calls (default on for the maps in GPU_CHECKED; ``LINEAR_MHA_TRITON=0``
    turns it off, ``=all`` on for every map in MAPS, as ``all_maps=True`` does; None keeps that setting); returns
    the previous on/off."""
    global _enabled, _all_maps
    previous, _enabled = _enabled, bool(enabled)
    if all_maps is not None:
        _all_maps = bool(all_maps)
    return previous


def enabled() -> bool:
    return _enabled


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors), as the tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_not(q: Tensor, k: Tensor, v: Tensor, feature_map, initial_state: Optional[Tensor]) -> Optional[str]:
    """Why these tensors cannot take the Triton kernels, or None."""
    if not HAS_TRITON:
        return "triton is not installed"
    if not isinstance(feature_map, str) or feature_map not in MAPS:
        return f"feature_map {getattr(feature_map, '__name__', feature_map)!r}: the Triton kernels take {tuple(MAPS)}"
    if feature_map not in GPU_CHECKED and not (_all_maps or interpreted()):
        return (f"feature_map {feature_map!r}: its Triton kernel has run only under Triton's interpreter so far "
                f"(LINEAR_MHA_TRITON=all takes it)")
    if initial_state is not None:
        return "an initial_state: the Triton kernels take none yet"
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "an empty tensor"
    if compiling() or functorch_active():
        return "inside torch.compile, torch.export, torch.jit.trace or a torch.func transform"
    if not (q.is_cuda or interpreted()):
        return "the tensors are not on a CUDA device"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: the Triton kernels take float32, float16 and bfloat16"
    if max(q.shape[-1], v.shape[-1]) > 256:
        return "head sizes above 256"
    return None


def _kernels():
    """triton_jit.py, imported on first use so that triton itself is imported only when the kernels run. Whether they
    run compiled or interpreted is fixed when triton is first imported in the process (TRITON_INTERPRET then)."""
    from . import triton_jit
    return triton_jit


BLOCK = None  # positions per tile; None: _rows_per_tile's choice (the benchmark sets it to compare)


def _rows_per_tile(dtype: torch.dtype) -> int:
    """Positions per tile. Measured on an H100 (docs/cuda.md): half inputs run fastest with 64 (0.84 ms against 1.39
    with 16 at N = 16k), float32's exact products with 16 (1.6 ms against 17 with 64, whose tiles spill). tl.dot
    needs at least 16; the interpreter (tests) runs 16, the smallest."""
    if BLOCK is not None:
        return BLOCK
    return 64 if dtype != torch.float32 and not interpreted() else 16


def _precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot's input precision: exact float32 products for float32 inputs (and in the interpreter); TF32 tensor
    cores for half inputs on GPUs that have them (compute capability 8.0 and up), TF32's 10 bits being finer than
    the inputs' own rounding (bfloat16: 8)."""
    if dtype == torch.float32 or interpreted() or torch.cuda.get_device_capability(device) < (8, 0):
        return "ieee"
    return "tf32"


def _block(n: int) -> int:
    """The tile width for n values: a power of two (tl.arange), at least 16 (tl.dot)."""
    return max(16, 1 << (n - 1).bit_length())


def _feature_block(map_code: int, d: int) -> int:
    """The tile width of the features: d of them, taylor's d + 1."""
    return _block(d + 1 if map_code == MAPS["taylor"] else d)


def _split(g: int, n: int, rows: int):
    """(programs per head, tiles per program) for the sums over a sequence of n: enough programs to fill a GPU's
    multiprocessors at small B * H, each walking a power-of-two number of tiles (a compile-time trip count, so
    few distinct kernels whatever n is)."""
    wanted = max(1, min(cdiv(n, 4 * rows), cdiv(256, g)))
    tiles = 1 << (cdiv(max(n, 1), wanted * rows) - 1).bit_length()
    return cdiv(max(n, 1), tiles * rows), tiles


def _key_state(k, v, mask, map_code, rows):
    b, h, s, d = k.shape
    dv = v.shape[-1]
    bd, bdv = _feature_block(map_code, d), _block(dv)
    splits, tiles = _split(b * h, s, rows)
    state = torch.empty(b * h, splits, bd, bdv, device=k.device, dtype=torch.float32)
    z = torch.empty(b * h, splits, bd, device=k.device, dtype=torch.float32)
    _kernels().key_sums[(b * h, splits)](k, v, k if mask is None else mask, state, z, h, s, *k.stride()[:3],
                                         *v.stride()[:3], D=d, DV=dv, BLOCK_N=rows, BLOCK_D=bd, BLOCK_DV=bdv,
                                         MAP=map_code, HAS_MASK=mask is not None, TILES=tiles,
                                         PRECISION=_precision(k.dtype, k.device))
    return state.sum(1).contiguous(), z.sum(1).contiguous()


def _forward(q, k, v, mask, map_code, rows):
    b, h, n_q, d = q.shape
    dv = v.shape[-1]
    state, z = _key_state(k, v, mask, map_code, rows)
    out = torch.empty(b, h, n_q, dv, device=q.device, dtype=q.dtype)
    den = torch.empty(b, h, n_q, device=q.device, dtype=torch.float32)
    _kernels().queries[(b * h, cdiv(n_q, rows))](q, state, z, out, den, h, n_q, *q.stride()[:3], D=d,
                                                         DV=dv, BLOCK_M=rows, BLOCK_D=_feature_block(map_code, d),
                                                         BLOCK_DV=_block(dv), MAP=map_code,
                                                         PRECISION=_precision(q.dtype, q.device))
    return out, state, z, den


class _TritonKernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, map_code):
        ctx.rows = rows = _rows_per_tile(q.dtype)
        out, state, z, den = _forward(q, k, v, mask, map_code, rows)
        ctx.save_for_backward(q, k, v, mask, out, state, z, den)
        ctx.map_code = map_code
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, mask, out, state, z, den = ctx.saved_tensors
        b, h, n_q, d = q.shape
        n_k, dv = k.shape[2], v.shape[-1]
        bd, bdv = _feature_block(ctx.map_code, d), _block(dv)
        grad_out = grad_out.contiguous()
        out = out.contiguous()
        dq = torch.empty(b, h, n_q, d, device=q.device, dtype=torch.float32)
        rows = ctx.rows
        splits, tiles = _split(b * h, n_q, rows)
        gs = torch.empty(b * h, splits, bd, bdv, device=q.device, dtype=torch.float32)
        gz = torch.empty(b * h, splits, bd, device=q.device, dtype=torch.float32)
        _kernels().query_grads[(b * h, splits)](q, state, z, out, den, grad_out, dq, gs, gz, h, n_q,
                                                *q.stride()[:3], D=d, DV=dv, BLOCK_M=rows, BLOCK_D=bd,
                                                BLOCK_DV=bdv, MAP=ctx.map_code, NEED_DQ=ctx.needs_input_grad[0],
                                                TILES=tiles, PRECISION=_precision(q.dtype, q.device))
        gs, gz = gs.sum(1).contiguous(), gz.sum(1).contiguous()
        dk = torch.empty(b, h, n_k, d, device=q.device, dtype=torch.float32)
        dvv = torch.empty(b, h, n_k, dv, device=q.device, dtype=torch.float32)
        _kernels().key_grads[(b * h, cdiv(n_k, rows))](k, v, k if mask is None else mask, gs, gz, dk,
                                                               dvv, h, n_k, *k.stride()[:3], *v.stride()[:3],
                                                               D=d, DV=dv, BLOCK_N=rows, BLOCK_D=bd, BLOCK_DV=bdv,
                                                               MAP=ctx.map_code, HAS_MASK=mask is not None,
                                                               PRECISION=_precision(k.dtype, k.device))
        return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), None, None


def kernel_attention(q: Tensor, k: Tensor, v: Tensor, feature_map: str,
                     key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Non-causal kernel attention through the Triton kernels: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv), any
    strides with a contiguous last dimension, float32 or half (accumulated in float32); key_padding_mask (B, S)
    bool, True = ignore. Returns (B, H, L, Dv) in q's dtype. Callers check ``why_not``."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    return _TritonKernelAttention.apply(q, k, v, mask, MAPS[feature_map])
