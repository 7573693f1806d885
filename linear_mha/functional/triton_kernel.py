"""Fused Triton kernels for non-causal kernel attention with the elu, relu, taylor or focused map or hedgehog's
learned maps (rotary position optional), forward and backward:

    out_i = phi(q_i) S / phi(q_i) z,   S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)   (masked keys left out)

Composed from PyTorch ops each step (the map, the key sums, the products, the normaliser) reads and writes whole
N-sized tensors; here one pass over the keys applies the map and accumulates S and z in float32 (the sequence
split over programs, their partial sums added), and one pass over the queries applies the map, multiplies and
divides. The backward is two more passes of the same shape: the queries (d q, and G = sum_i phi(q_i)^T r_i for
r_i the gradient of [num_i, den_i]), then the keys (d k, d v from G).

Written for CUDA; the tests run them on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).
``backend.kernel_backend`` sends non-causal elu/relu calls on CUDA here (``LINEAR_MHA_TRITON=0`` or
``set_enabled(False)`` switches that off): on an H100 they ran 5.4-5.8x the PyTorch path's speed forward and
19-23x SDPA's at N = 16k in bfloat16 (docs/cuda.md). taylor, focused and hedgehog's maps and rotary position take
them too (2-9x their PyTorch path's speed there); a map added to MAPS waits for ``LINEAR_MHA_TRITON=all`` until it
has run on a GPU (GPU_CHECKED).
"""
import contextlib
import functools
import importlib.util
import os
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._common import compiling, functorch_active, has_tangent, needs_grad, why_not_fused_map_pair

HAS_TRITON = importlib.util.find_spec("triton") is not None  # imported only when the kernels are first used


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


MAPS = {"elu": 0, "relu": 1, "taylor": 2, "focused": 3, "hedgehog": 4}  # triton_maps_jit's codes
# Maps whose kernels have run on a GPU against float64 (docs/cuda.md: an H100, taylor with rotary position too); a
# map added to MAPS runs under the interpreter only until it has, and is taken on CUDA with LINEAR_MHA_TRITON=all.
GPU_CHECKED = ("elu", "relu", "taylor", "focused", "hedgehog")
# Where the kernels are taken by default, from the shared memory they ask for (compiled offline for sm_90) against
# what a GPU has per block (an H100 232,448 bytes, an A100 166,912, consumer cards about 101 KB): a kernel that
# asks for more fails to launch. elu/relu: up to 65,536 bytes at head size 64, taken on any GPU; 196,608 at 128,
# taken with an H100's memory; at 256 more than an H100 has. The other maps hold more tiles: up to 188,416 bytes
# at head size 64 (taylor + rope's key gradients), so they are taken at head sizes (and hedgehog features) up to
# 64 with an H100's memory, as they ran. Everything else is left to LINEAR_MHA_TRITON=all.
CHECKED_WIDTH = 64
CHECKED_SHARED_MEMORY = 232448
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


@contextlib.contextmanager
def switched(enabled: bool, all_maps: Optional[bool] = None):
    """``set_enabled(enabled, all_maps)`` within the block, both settings restored on exit."""
    global _enabled, _all_maps
    previous = _enabled, _all_maps
    set_enabled(enabled, all_maps)
    try:
        yield
    finally:
        _enabled, _all_maps = previous


def enabled() -> bool:
    return _enabled


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors), as the tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def map_name(feature_map) -> Optional[str]:
    """The Triton kernels' name for a feature map ("elu", "relu", "taylor"; a ``focused.FocusedMap`` is "focused"),
    or None."""
    if isinstance(feature_map, str):
        return feature_map if feature_map in ("elu", "relu", "taylor") else None
    return "focused" if getattr(feature_map, "compiled_map", None) == "focused" else None


def why_not(q: Tensor, k: Tensor, v: Tensor, feature_map, initial_state: Optional[Tensor] = None,
            rope: bool = False) -> Optional[str]:
    """Why these tensors cannot take the Triton kernels (``kernel_attention``), or None. rope: with rotary
    position tables (``grid_rope``)."""
    name = map_name(feature_map)
    if name is None:
        return (f"feature_map {getattr(feature_map, '__name__', feature_map)!r}: the Triton kernels take "
                f"{tuple(m for m in MAPS if m != 'hedgehog')} (hedgehog through hedgehog())")
    if name == "focused":
        why_not_rows = feature_map.why_not_rows(q)
        if why_not_rows is not None:
            return why_not_rows
        if feature_map.scale is not None and feature_map.scale.device != q.device:
            return f"focused's scale is on {feature_map.scale.device}, the inputs on {q.device}"
    if rope and initial_state is not None:
        return "rotary position with an initial_state"
    if rope and name == "taylor" and (q.shape[-1] + 1) % 4 == 0:  # rotary position turns 4 floor(F / 4) features
        return (f"taylor with rotary position at head size {q.shape[-1]}: all d + 1 = {q.shape[-1] + 1} features "
                f"turn, the constant one too, which the kernels keep out of their tiles")
    return _why_not_tensors(name, q, k, v, initial_state)


def why_not_hedgehog(q: Tensor, k: Tensor, v: Tensor, q_map, k_map,
                     initial_state: Optional[Tensor] = None) -> Optional[str]:
    """Why hedgehog's call cannot take the Triton kernels (``hedgehog_attention``), or None. q_map / k_map:
    (weight (H, d, m), bias (H, m) or None), shapes checked by the caller."""
    devices = {t.device for pair in (q_map, k_map) for t in pair if t is not None}
    if devices - {q.device}:
        return f"the feature maps' weights are on {sorted(map(str, devices))}, the inputs on {q.device}"
    why_not_pair = why_not_fused_map_pair(q_map, k_map)
    if why_not_pair is not None:
        return why_not_pair
    if q_map[0].shape[-1] > 128:
        return "hedgehog maps of more than 128 features"
    return _why_not_tensors("hedgehog", q, k, v, initial_state, q_map[0].shape[-1])


def _why_not_tensors(name: str, q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor],
                     width: Optional[int] = None) -> Optional[str]:
    """width: the features per map tile when not the head size (hedgehog's m)."""
    if not HAS_TRITON:
        return "triton is not installed"
    if not (_all_maps or interpreted()):
        if name not in GPU_CHECKED:
            return (f"feature_map {name!r}: its Triton kernel has run only under Triton's interpreter so far "
                    f"(LINEAR_MHA_TRITON=all takes it)")
        if q.is_cuda:
            why_not_here = outside_checked(name, max(q.shape[-1], v.shape[-1], width or 0), _shared_memory(q.device))
            if why_not_here is not None:
                return why_not_here
    if initial_state is not None and initial_state.device != q.device:
        return f"the initial_state is on {initial_state.device}, the inputs on {q.device}"
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "an empty tensor"
    if compiling() or functorch_active():
        return "inside torch.compile, torch.export, torch.jit.trace or a torch.func transform"
    if has_tangent(q, k, v, initial_state):
        return "a tensor carries a forward-mode AD tangent (torch.autograd.forward_ad), for which the Triton kernels " \
               "have no formula"
    if not (q.is_cuda or interpreted()):
        return "the tensors are not on a CUDA device"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: the Triton kernels take float32, float16 and bfloat16"
    if max(q.shape[-1], v.shape[-1]) > 256:
        return "head sizes above 256"
    return None


def outside_checked(name: str, widest: int, shared_memory: int) -> Optional[str]:
    """Why a map's kernels are not taken by default at this width (the widest of the head sizes and hedgehog's
    features) on a GPU with this much shared memory per block (see CHECKED_WIDTH), or None."""
    large = shared_memory >= CHECKED_SHARED_MEMORY
    if name in ("elu", "relu"):
        if widest <= CHECKED_WIDTH or (widest <= 2 * CHECKED_WIDTH and large):
            return None
        where = f"head sizes up to {CHECKED_WIDTH}, or {2 * CHECKED_WIDTH} with {CHECKED_SHARED_MEMORY} bytes"
    else:
        if widest <= CHECKED_WIDTH and large:
            return None
        where = f"head sizes up to {CHECKED_WIDTH} with {CHECKED_SHARED_MEMORY} bytes"
    return (f"feature_map {name!r}: its Triton kernels fit in a GPU's shared memory per block at {where}; here "
            f"{widest} wide with {shared_memory} bytes, where they may not launch (LINEAR_MHA_TRITON=all takes it)")


@functools.lru_cache(maxsize=None)
def _shared_memory(device: torch.device) -> int:
    """Shared memory per block a kernel can ask for on this CUDA device (0 where torch does not say)."""
    properties = torch.cuda.get_device_properties(device)
    return int(getattr(properties, "shared_memory_per_block_optin", 0))


def _kernels():
    """triton_jit.py, imported on first use so that triton itself is imported only when the kernels run. Whether they
    run compiled or interpreted is fixed when triton is first imported in the process (TRITON_INTERPRET then)."""
    from . import triton_jit
    return triton_jit


BLOCK = None  # positions per tile; None: _rows_per_tile's choice (the benchmark sets it to compare)


def _rows_per_tile(dtype: torch.dtype, name: str = "elu", rotated: bool = False, backward: bool = False) -> int:
    """Positions per tile, measured on an H100 at N = 16k (docs/cuda.md). Half inputs: 64 (elu's forward 1.01 ms
    against 1.16 with 32; in an earlier run 0.84 against 1.39 with 16), but 32 with rotary position (at head size 64,
    64 rows ask for more shared memory than an H100 has) and for taylor, focused and hedgehog when a backward follows
    (forward + backward 8.2 against 10.3 ms for taylor, 7.2 / 8.4 focused, 8.5 / 10.1 hedgehog). float32's exact
    products: 16 (1.6 ms against 17 with 64, whose tiles spill). tl.dot needs at least 16; the interpreter (tests)
    runs 16, the smallest."""
    if BLOCK is not None:
        return BLOCK
    if dtype == torch.float32 or interpreted():
        return 16
    return 32 if rotated or (backward and name not in ("elu", "relu")) else 64


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



def _split(g: int, n: int, rows: int):
    """(programs per head, tiles per program) for the sums over a sequence of n: enough programs to fill a GPU's
    multiprocessors at small B * H, each walking a power-of-two number of tiles (a compile-time trip count, so
    few distinct kernels whatever n is)."""
    wanted = max(1, min(cdiv(n, 4 * rows), cdiv(256, g)))
    tiles = 1 << (cdiv(max(n, 1), wanted * rows) - 1).bit_length()
    return cdiv(max(n, 1), tiles * rows), tiles


class _Setting(NamedTuple):
    """What the kernels are compiled for, beyond the tensors."""
    name: str
    d: int
    dv: int
    features: int   # F: per position, in the reference order (a state's third size)
    width: int      # features per tile: hedgehog's m per softmax, d for the other maps
    rotated: int    # R: the last R features turn with rotary position; 0 without
    power: float    # focused's
    rows: int       # positions per tile

    @property
    def halves(self) -> int:
        return 2 if self.name == "hedgehog" else 1

    @property
    def constant(self) -> int:
        """1 where the first feature is a constant kept out of the tiles (taylor's)."""
        return 1 if self.name == "taylor" else 0

    def constants(self, device: torch.device, dtype: torch.dtype) -> dict:
        # SWAP: every column of a tile turns, so a column's partner is the one half a tile away
        return dict(D=self.d, DV=self.dv, F=self.features - self.constant, M=self.width, R=self.rotated,
                    SWAP=int(self.rotated == _block(self.width)), BLOCK_D=_block(self.d), BLOCK_F=_block(self.width),
                    BLOCK_DV=_block(self.dv),
                    MAP=MAPS[self.name], CONST=self.constant, PRECISION=_precision(dtype, device))


class _Sums(NamedTuple):
    """A head's sums as the kernels keep them: s (G, halves, BLOCK_F, BLOCK_DV), z (G, halves, BLOCK_F) of the tiles'
    features, and c (G, BLOCK_DV), cz (G,) of the constant feature (taylor's; unused otherwise)."""
    s: Tensor
    z: Tensor
    c: Tensor
    cz: Tensor

    @staticmethod
    def summed(s, z, c, cz) -> "_Sums":
        """The sums of the programs' partial sums (dimension 1)."""
        return _Sums(s.sum(1), z.sum(1), c.sum(1), cz.sum(1))

    def state(self, st: _Setting) -> Tensor:
        """(G, F, Dv + 1), the reference layout of a state: [S, z], the constant feature's row first, hedgehog's
        softmax(z) features before its softmax(-z) ones."""
        full = torch.cat([self.s[:, :, :st.width, :st.dv], self.z[:, :, :st.width, None]], -1)
        full = full.reshape(self.s.shape[0], st.features - st.constant, st.dv + 1)
        if st.constant:
            full = torch.cat([torch.cat([self.c[:, None, :st.dv], self.cz[:, None, None]], -1), full], 1)
        return full

    def add_(self, state: Tensor, st: _Setting) -> None:
        """+= a state (B, H, F, Dv + 1) in the reference layout."""
        state = state.to(torch.float32).reshape(self.s.shape[0], st.features, st.dv + 1)
        if st.constant:
            self.c[:, :st.dv] += state[:, 0, :st.dv]
            self.cz.add_(state[:, 0, st.dv])
        tiles = state[:, st.constant:].reshape(self.s.shape[0], st.halves, st.width, st.dv + 1)
        self.s[:, :, :st.width, :st.dv] += tiles[..., :st.dv]
        self.z[:, :, :st.width] += tiles[..., st.dv]


def _param_pointers(weight: Optional[Tensor], bias: Optional[Tensor], like: Tensor, st: _Setting):
    """The kernels' p_ptr, b_ptr (a stand-in pointer, never read, where there is no tensor) and HAS_PARAM: whether
    focused has a scale (the weight), whether hedgehog's map has a bias (it always has a weight)."""
    has = bias is not None if st.name == "hedgehog" else weight is not None
    return (like if weight is None else weight), (like if bias is None else bias), has


class _TritonAttention(torch.autograd.Function):
    """Inputs: q, k (B, H, N, D), v (B, H, S, Dv); mask (B, S) uint8 or None; the query and key maps' parameters
    (focused: the scale (H, D) as weight, no bias; hedgehog: weight (H, D, m), bias (H, m) or None); initial_state
    (B, H, F, Dv + 1) or None; cos, sin (N, R) or None."""

    @staticmethod
    def forward(ctx, st, q, k, v, mask, q_weight, q_bias, k_weight, k_bias, initial_state, cos, sin):
        kernels = _kernels()
        b, h, n_q, _ = q.shape
        n_k, g = k.shape[2], b * h
        consts = st.constants(q.device, q.dtype)
        bf, bdv = consts["BLOCK_F"], consts["BLOCK_DV"]
        rope = (q if cos is None else cos), (q if sin is None else sin)
        qp, qb, q_has = _param_pointers(q_weight, q_bias, q, st)
        kp, kb, k_has = _param_pointers(k_weight, k_bias, q, st)
        splits, tiles = _split(g, n_k, st.rows)
        f32 = dict(device=q.device, dtype=torch.float32)
        partial = (torch.empty(g, splits, st.halves, bf, bdv, **f32), torch.empty(g, splits, st.halves, bf, **f32),
                   torch.zeros(g, splits, bdv, **f32), torch.zeros(g, splits, **f32))
        kernels.key_sums[(g, splits)](k, v, k if mask is None else mask, kp, kb, *rope, *partial, h, n_k,
                                      *k.stride()[:3], *v.stride()[:3], st.power, BLOCK_N=st.rows,
                                      HAS_MASK=mask is not None, HAS_PARAM=k_has, TILES=tiles, **consts)
        sums = _Sums.summed(*partial)
        if initial_state is not None:
            sums.add_(initial_state, st)
        out = torch.empty(b, h, n_q, st.dv, device=q.device, dtype=q.dtype)
        den = torch.empty(g, n_q, **f32)
        kernels.queries[(g, cdiv(n_q, st.rows))](q, qp, qb, *rope, *sums, out, den, h, n_q, *q.stride()[:3],
                                                  st.power, BLOCK_M=st.rows, HAS_PARAM=q_has, **consts)
        ctx.st = st
        ctx.save_for_backward(q, k, v, mask, q_weight, q_bias, k_weight, k_bias, initial_state, cos, sin, out,
                              sums.s, sums.z, den)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (q, k, v, mask, q_weight, q_bias, k_weight, k_bias, initial_state, cos, sin, out, s, z,
         den) = ctx.saved_tensors
        st, need = ctx.st, ctx.needs_input_grad
        kernels = _kernels()
        b, h, n_q, d = q.shape
        n_k, g = k.shape[2], b * h
        consts = st.constants(q.device, q.dtype)
        bd, bf, bdv = consts["BLOCK_D"], consts["BLOCK_F"], consts["BLOCK_DV"]
        rope = (q if cos is None else cos), (q if sin is None else sin)
        qp, qb, q_has = _param_pointers(q_weight, q_bias, q, st)
        kp, kb, k_has = _param_pointers(k_weight, k_bias, q, st)
        grad_out, out = grad_out.contiguous(), out.contiguous()
        f32 = dict(device=q.device, dtype=torch.float32)

        need_dq, need_q_params = need[1], need[5] or need[6]
        splits, tiles = _split(g, n_q, st.rows)
        dq = torch.empty(b, h, n_q, d, **f32) if need_dq else q
        partial = (torch.empty(g, splits, st.halves, bf, bdv, **f32), torch.empty(g, splits, st.halves, bf, **f32),
                   torch.zeros(g, splits, bdv, **f32), torch.zeros(g, splits, **f32))
        dp = torch.zeros(g, splits, bd, bf, **f32) if need_q_params else q
        db = torch.zeros(g, splits, bf, **f32) if need_q_params else q
        kernels.query_grads[(g, splits)](q, qp, qb, *rope, s, z, out, den, grad_out, dq, *partial, dp, db, h, n_q,
                                         *q.stride()[:3], st.power, BLOCK_M=st.rows, HAS_PARAM=q_has,
                                         NEED_DX=need_dq, NEED_DP=need_q_params, TILES=tiles, **consts)
        grads = _Sums.summed(*partial)  # of the state: G, g and the constant feature's
        q_grads = _param_grads(dp, db, b, h, d, st, q_weight, q_bias) if need_q_params else (None, None)

        need_dk, need_k_params = need[2], need[7] or need[8]
        # One tile per program unless the map has parameters, whose gradients each program sums: then as few
        # programs as fill the GPU, so those partial sums stay few.
        splits, tiles = _split(g, n_k, st.rows) if need_k_params else (cdiv(n_k, st.rows), 1)
        dk = torch.empty(b, h, n_k, d, **f32) if need_dk else q
        dv = torch.empty(b, h, n_k, st.dv, **f32)
        dp = torch.zeros(g, splits, bd, bf, **f32) if need_k_params else q
        db = torch.zeros(g, splits, bf, **f32) if need_k_params else q
        kernels.key_grads[(g, splits)](k, v, k if mask is None else mask, kp, kb, *rope, grads.s, grads.z, grads.c,
                                       dk, dv, dp, db,
                                       h, n_k, *k.stride()[:3], *v.stride()[:3], st.power, BLOCK_N=st.rows,
                                       HAS_MASK=mask is not None, HAS_PARAM=k_has, NEED_DX=need_dk,
                                       NEED_DP=need_k_params, TILES=tiles, **consts)
        k_grads = _param_grads(dp, db, b, h, d, st, k_weight, k_bias) if need_k_params else (None, None)
        d_state = None
        if initial_state is not None and need[9]:
            d_state = grads.state(st).reshape(initial_state.shape).to(initial_state.dtype)
        return (None, dq.to(q.dtype) if need_dq else None, dk.to(k.dtype) if need_dk else None, dv.to(v.dtype), None,
                *q_grads, *k_grads, d_state, None, None)


def _param_grads(dp: Tensor, db: Tensor, b: int, h: int, d: int, st: _Setting, weight, bias):
    """The map's parameter gradients from the programs' partial sums: (d weight, d bias) in their own dtypes."""
    db = db.reshape(b, h, -1, db.shape[-1]).sum((0, 2))
    if st.name == "focused":  # the scale travels as the weight
        return db[:, :d].to(weight.dtype), None
    dp = dp.reshape(b, h, -1, *dp.shape[-2:]).sum((0, 2))
    return dp[:, :d, :st.width].to(weight.dtype), None if bias is None else db[:, :st.width].to(bias.dtype)


def _prepared(q, k, v, key_padding_mask):
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    return q, k, v, mask


def kernel_attention(q: Tensor, k: Tensor, v: Tensor, feature_map, key_padding_mask: Optional[Tensor] = None,
                     initial_state: Optional[Tensor] = None,
                     rope_tables: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """Non-causal kernel attention through the Triton kernels: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv), any
    strides with a contiguous last dimension, float32 or half (accumulated in float32); feature_map "elu", "relu",
    "taylor" or a ``focused.FocusedMap``; key_padding_mask (B, S) bool, True = ignore; initial_state
    (B, H, F, Dv + 1) (``kernel_state``'s); rope_tables (cos, sin) (N, R) of ``grid_rope.grid_tables`` for rotary
    position (L = S = N). Returns (B, H, L, Dv) in q's dtype. Callers check ``why_not``."""
    name = map_name(feature_map)
    q, k, v, mask = _prepared(q, k, v, key_padding_mask)
    d = q.shape[-1]
    features = d + 1 if name == "taylor" else d
    cos, sin = (None, None) if rope_tables is None else (t.to(q.device, torch.float32).contiguous()
                                                         for t in rope_tables)
    scale = None
    if name == "focused":
        _, scale = feature_map.compiled_settings(q)  # (H, d) float32 or None
    rows = _rows_per_tile(q.dtype, name, cos is not None, needs_grad(q, k, v, scale, initial_state))
    st = _Setting(name, d, v.shape[-1], features, d, 0 if cos is None else cos.shape[-1],
                  float(getattr(feature_map, "focusing_factor", 0.0)), rows)
    return _TritonAttention.apply(st, q, k, v, mask, scale, None, scale, None, initial_state, cos, sin)


def hedgehog_attention(q: Tensor, k: Tensor, v: Tensor, q_map, k_map, key_padding_mask: Optional[Tensor] = None,
                       initial_state: Optional[Tensor] = None) -> Tensor:
    """Non-causal hedgehog attention through the Triton kernels, the maps' projections and softmaxes inside them:
    q_map / k_map (weight (H, D, m), bias (H, m) or None); otherwise as ``kernel_attention``, the state
    (B, H, 2m, Dv + 1). Callers check ``why_not_hedgehog``."""
    q, k, v, mask = _prepared(q, k, v, key_padding_mask)
    m = q_map[0].shape[-1]
    rows = _rows_per_tile(q.dtype, "hedgehog", False, needs_grad(q, k, v, *q_map, *k_map, initial_state))
    st = _Setting("hedgehog", q.shape[-1], v.shape[-1], 2 * m, m, 0, 0.0, rows)
    params = [None if t is None else t.to(torch.float32).contiguous() for t in (*q_map, *k_map)]
    return _TritonAttention.apply(st, q, k, v, mask, *params, initial_state, None, None)
