"""Attention in the compiled CPU code of ``csrc/`` (native code: C with OpenMP), called through ctypes on torch
tensors.

Kernel attention with an elementwise map spends most of its CPU time in elementwise passes over N-sized
tensors, not in its two GEMMs; the C functions fuse those passes into the GEMMs (see kernel_attention.c). They
cover float32 CPU tensors: kernel attention with elu/relu/taylor/taylor2 maps, the focused map (its scales'
gradient too), a user's elementwise map read as a program of steps (``elementwise_program.py``), hedgehog's learned
maps (``hedgehog_map.HedgehogMap``, their weights' gradients too), or features made already (non-causal and causal,
with gradients; elu/relu also the recurrent decoding step), Efficient Attention (with gradients), the focused and
hedgehog feature maps on their own (with gradients, through ``native_maps.py``), and the decaying and delta-rule
recurrences' chunked steps (with gradients, through ``native_decayed.py``). Everything else (other dtypes,
accelerators) stays in PyTorch, and so does everything when the compiled code is unavailable; ``backend.py`` decides
which calls come here.

``native_library.py`` builds, loads and switches the library and gives the outputs (large ones kept between calls by
``output_cache.py``); its public names are handed on here: ``LINEAR_MHA_NATIVE=0`` (or ``set_enabled(False)``) turns
it off, ``available()`` says whether it is in use, ``build_error()`` why not.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import packed_heads
from ._common import compiling, functorch_active
from .native_library import (PREFAULT_BYTES, available, build_error, call, count, enabled, library_path,  # noqa: F401
                             output, pointer, row_strides, rows_like, rows_readable, set_enabled, why_not)

MAPS = {"elu": 0, "relu": 1}  # the elementwise feature maps the C code computes, the decoding step included
# Maps of a whole row the C attention computes: taylor [1, x / |x|], one feature more than x, and taylor2
# [1, x', x'_i x'_j], 1 + D + D (D + 1) / 2 features.
ROW_MAPS = {"taylor": 4, "taylor2": 5}
FEATURES_GIVEN = 3  # the C code's map for features made already (any map, made by PyTorch ops)
# Maps with settings, passed beside the map code, given as objects that carry them (``compiled_map`` names the map,
# ``compiled_settings(q)`` gives (power, data)), not by a name: focused (FLatten, a focused.FocusedMap: its power and
# per-head scales), and a user's elementwise map read as a program of steps (an elementwise_program.ProgramMap).
FOCUSED = 6
PROGRAM = 7
HEDGEHOG = 8  # hedgehog's learned maps (a hedgehog_map.HedgehogMap): 2m features from d inputs, projections included
HEDGEHOG_MAX_M = 256  # csrc/hedgehog.h's HEDGEHOG_MAX_M
HEDGEHOG_MAX_D = 1024  # csrc/hedgehog.h's HEDGEHOG_MAX_D
SETTINGS_MAPS = {"focused": FOCUSED, "program": PROGRAM, "hedgehog": HEDGEHOG}


def why_not_kernel(feature_map, *tensors: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why kernel attention with ``feature_map`` on these tensors cannot run in the compiled code, or None if it
    can (the caller has a backward for it). ``dtype``: the dtype they will be computed in, if not their own."""
    if getattr(feature_map, "compiled_map", None) in SETTINGS_MAPS:  # a map with settings
        return feature_map.why_not_compiled(tensors[0]) or why_not(*tensors, dtype=dtype)
    if not isinstance(feature_map, str) or (feature_map not in MAPS and feature_map not in ROW_MAPS):
        name = getattr(feature_map, "__name__", feature_map)
        return f"feature_map {name!r} is not one the compiled code computes ({', '.join([*MAPS, *ROW_MAPS])})"
    return why_not(*tensors, dtype=dtype)


def kernel_attention(q: Tensor, k: Tensor, v: Tensor, feature_map,
                     key_padding_mask: Optional[Tensor] = None, initial_state: Optional[Tensor] = None,
                     causal: bool = False, rope_tables: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """Kernel attention, differentiable through the compiled backward. Shapes as ``kernel.kernel``: q (B, H, L, D),
    k (B, H, S, D), v (B, H, S, Dv), any strides with a contiguous last dimension (L == S when causal);
    key_padding_mask (B, S) bool, True = ignore; initial_state (B, H, D, Dv + 1). Returns a (B, H, L, Dv) tensor laid
    out as q is (``rows_like``), and the input gradients as their inputs. ``feature_map`` None: q and k are features
    made already (phi(q), phi(k), D = their count), and the gradients returned are those of the features.
    ``rope_tables``: (cos, sin), each (L, R) contiguous float32 from ``grid_rope.rotation_tables``, for
    ``grid_rope_kernel``'s rotary position (non-causal self-attention, L == S, no initial_state). ``feature_map`` a
    ``focused.FocusedMap``: the focused map with its power and scales, differentiable in the scales too. Callers
    check ``why_not_kernel`` and the shapes."""
    power, scale = 0.0, None  # a map's settings (focused's power and scales, a program); the other maps have none
    own_features = getattr(feature_map, "feature_count", lambda d: None)(q.shape[-1])  # a map that says its own
    if getattr(feature_map, "compiled_map", None) in SETTINGS_MAPS:
        if rope_tables is not None:  # the rope entry points take no map settings
            raise ValueError(f"rope_tables take a map without settings; give the {feature_map.compiled_map} map's "
                             f"features made already (feature_map None), as grid_rope_kernel does")
        (power, scale), feature_map = feature_map.compiled_settings(q), feature_map.compiled_map
    if rope_tables is not None:
        map_features = feature_count(feature_map, q.shape[-1])
        rotated = rope_tables[0].shape[-1]
        if causal or initial_state is not None or q.shape[2] != k.shape[2] or rope_tables[0].shape[0] != q.shape[2] \
                or rotated % 4 or rotated > map_features:
            raise ValueError(f"rope_tables need non-causal self-attention without an initial state and (L, R) tables "
                             f"for L positions, R a multiple of 4 up to the {map_features} features; got "
                             f"L={q.shape[2]}, "
                             f"S={k.shape[2]}, tables {tuple(rope_tables[0].shape)}, causal={causal}")
    features = own_features or _feature_rows(feature_map, q.shape[-1], rope_tables)  # per row of the C code
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    init = None if initial_state is None else initial_state.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, init, scale)):
        return _KernelAttention.apply(q, k, v, init, mask, feature_map, causal, rope_tables, scale, power, features)
    return _forward(q, k, v, mask, init, feature_map, causal, False, rope_tables, scale, power, features)[0]


def _map_code(feature_map: Optional[str]) -> int:
    if feature_map is None:
        return FEATURES_GIVEN
    if feature_map in SETTINGS_MAPS:
        return SETTINGS_MAPS[feature_map]
    return MAPS[feature_map] if feature_map in MAPS else ROW_MAPS[feature_map]


def feature_count(feature_map: Optional[str], d: int) -> int:
    """Features per position the compiled code makes from d values: the size of a state's third dimension."""
    if feature_map == "taylor2":
        return 1 + d + d * (d + 1) // 2
    return d + 1 if feature_map == "taylor" else d


def _sizes(q, k, v, one_length, features=None):
    """The size and stride arguments of the C entry points; ``one_length``: L == S is passed once (causal, rope);
    ``features``: per position, if not q's last size."""
    b, h, n_q, d = q.shape
    lengths = (n_q,) if one_length else (n_q, k.shape[2])
    return (b, h, *lengths, features or d, v.shape[-1], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3])


def _feature_rows(feature_map, d, rope):
    """Features per position in the compiled code's rows: the map's, twice with rope ([R phi, phi])."""
    return feature_count(feature_map, d) * (2 if rope is not None else 1)


def _rope_arguments(rope):
    cos, sin = rope
    return cos.data_ptr(), sin.data_ptr(), cos.shape[-1]


def _forward(q, k, v, mask, init, feature_map, causal, keep, rope, scale, power, features):
    """(out, state, den): the state (B, H, F, Dv + 1, non-causal only) and the normalisers den (B, H, L) are
    returned for the backward when ``keep``, else None. ``features``: F, per row of the C code (kernel_attention's)."""
    b, h, n_q, d = q.shape
    dv = v.shape[-1]
    out = rows_like(q, b, h, n_q, dv)
    den = output(q, b, h, n_q) if keep else None
    state = q.new_empty(b, h, features, dv + 1) if keep and not causal else None
    tail = (*_sizes(q, k, v, causal or rope is not None, features), _map_code(feature_map), torch.get_num_threads())
    inputs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), pointer(mask))
    if rope is not None:
        call("lm_rope_kernel_attention_f32", *inputs, out.data_ptr(), pointer(state), pointer(den), *tail,
             *_rope_arguments(rope), row_strides(out))
    elif causal:
        call("lm_causal_kernel_attention_f32", *inputs, pointer(init), out.data_ptr(), pointer(den), *tail, power,
             pointer(scale), row_strides(out))
    else:
        call("lm_kernel_attention_f32", *inputs, pointer(init), out.data_ptr(), pointer(state), pointer(den), *tail,
             power, pointer(scale), row_strides(out))
    return out, state, den


def _input_grads(q: Tensor, k: Tensor, v: Tensor, need_q: bool, need_k: bool, need_v: bool):
    """Fresh tensors for the gradients of q, k, v (None where not needed), laid out as their inputs: side by side in
    one tensor where the inputs are one projection's split (packed_heads), whose backward then needs no copy."""
    (b, h, n_q, d), n_k, dv = q.shape, k.shape[2], v.shape[-1]
    if need_q and need_k and need_v and n_q == n_k and dv == d and packed_heads.is_split((q, k, v)):
        return packed_heads.packed_outputs(q, 3, b, h, n_q, d, output, (q, k, v))
    if need_q and need_k and n_q == n_k and packed_heads.is_split((q, k)):  # q and k of one projection (DETR)
        grad_v = rows_like(v, b, h, n_k, dv) if need_v else None
        return (*packed_heads.packed_outputs(q, 2, b, h, n_q, d, output, (q, k)), grad_v)
    grad_q = rows_like(q, b, h, n_q, d) if need_q else None
    if need_k and need_v and dv == d and packed_heads.is_split((k, v)):
        return (grad_q, *packed_heads.packed_outputs(k, 2, b, h, n_k, d, output, (k, v)))
    return grad_q, rows_like(k, b, h, n_k, d) if need_k else None, rows_like(v, b, h, n_k, dv) if need_v else None


class _KernelAttention(torch.autograd.Function):
    """Kernel attention with the compiled backward (kernel_attention_backward.c), which recomputes the features
    and keeps only the output, the normalisers and, non-causal, the (B, H, D, Dv + 1) state."""

    @staticmethod
    def forward(ctx, q, k, v, init, mask, feature_map, causal, rope, scale, power, features):
        out, state, den = _forward(q, k, v, mask, init, feature_map, causal, True, rope, scale, power, features)
        ctx.features = features
        ctx.save_for_backward(q, k, v, init, mask, out, state, den, scale, *(rope or ()))
        ctx.feature_map, ctx.causal, ctx.rope, ctx.power = feature_map, causal, rope is not None, power
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, init, mask, out, state, den, scale, *rope = ctx.saved_tensors
        need_q, need_k, need_v, need_init = ctx.needs_input_grad[:4]
        need_scale = scale is not None and ctx.needs_input_grad[8]
        b, h, dv, features = q.shape[0], q.shape[1], v.shape[-1], ctx.features
        threads = torch.get_num_threads()
        # The scales' gradient is summed from the rows whose input gradients the kernels write: those of q and k.
        partial = q.new_zeros(threads, *scale.shape) if need_scale else None
        need_q, need_k = need_q or need_scale, need_k or need_scale
        grads = (*_input_grads(q, k, v, need_q, need_k, need_v),
                 q.new_empty(b, h, features, dv + 1) if need_init else None)
        grad_out = rows_readable(grad_out)  # held in a name: a temporary's memory would be freed before the call
        strides = row_strides(out, grad_out, *grads[:3])
        pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), pointer(mask))
        if ctx.rope:
            sizes = _sizes(q, k, v, True, features)
            call("lm_rope_kernel_attention_backward_f32", *pointers, state.data_ptr(), den.data_ptr(), out.data_ptr(),
                 grad_out.data_ptr(), *map(pointer, grads[:3]), *sizes, _map_code(ctx.feature_map),
                 torch.get_num_threads(), *_rope_arguments(rope), strides)
            return (*grads, None, None, None, None, None, None, None)
        tail = (out.data_ptr(), grad_out.data_ptr(), *map(pointer, grads),
                *_sizes(q, k, v, ctx.causal, features), _map_code(ctx.feature_map), threads, ctx.power,
                pointer(scale), pointer(partial), strides)
        if ctx.causal:
            call("lm_causal_kernel_attention_backward_f32", *pointers, pointer(init), den.data_ptr(), *tail)
        else:
            call("lm_kernel_attention_backward_f32", *pointers, state.data_ptr(), den.data_ptr(), *tail)
        needed = ctx.needs_input_grad
        return (grads[0] if needed[0] else None, grads[1] if needed[1] else None, *grads[2:], None, None, None, None,
                None if partial is None else partial.sum(0), None, None)


def efficient_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Efficient Attention (softmax of q over features, of k over the sequence), differentiable through the
    compiled backward (efficient_attention.c). Shapes as ``efficient.efficient``, any strides with a contiguous
    last dimension; returns a contiguous (B, H, L, Dv) tensor. Callers check ``supports``."""
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _EfficientAttention.apply(q, k, v, mask)
    return _efficient_forward(q, k, v, mask, keep=False)[0]


def _efficient_forward(q, k, v, mask, keep):
    """(out, state (B, H, D, Dv), key maxima m and inverse sums 1 / l (B, H, D)); all but out only when keep."""
    b, h, n_q, d = q.shape
    dv = v.shape[-1]
    out = rows_like(q, b, h, n_q, dv)
    saved = (q.new_empty(b, h, d, dv), q.new_empty(b, h, d), q.new_empty(b, h, d)) if keep else (None,) * 3
    call("lm_efficient_attention_f32", q.data_ptr(), k.data_ptr(), v.data_ptr(), pointer(mask), out.data_ptr(),
         *map(pointer, saved), *_sizes(q, k, v, False), torch.get_num_threads(), row_strides(out))
    return (out, *saved)


class _EfficientAttention(torch.autograd.Function):
    """Efficient Attention with the compiled backward, which recomputes softmax(q) and the key weights from q, k,
    the (B, H, D, Dv) state and the per-feature maxima and sums."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out, state, top, inv_sum = _efficient_forward(q, k, v, mask, keep=True)
        ctx.save_for_backward(q, k, v, mask, state, top, inv_sum)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, mask, state, top, inv_sum = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        grads = _input_grads(q, k, v, need_q, need_k, need_v)
        grad_out = rows_readable(grad_out)  # held in a name: a temporary's memory would be freed before the call
        call("lm_efficient_attention_backward_f32", q.data_ptr(), k.data_ptr(), v.data_ptr(), pointer(mask),
             state.data_ptr(), top.data_ptr(), inv_sum.data_ptr(), grad_out.data_ptr(), *map(pointer, grads),
             *_sizes(q, k, v, False), torch.get_num_threads(), row_strides(grad_out, *grads))
        return (*grads, None)


def step_ready(feature_map, q, k, v, state) -> bool:
    """Whether ``kernel_step`` can run in the compiled step: what ``supports`` asks, plus contiguous tensors of
    consistent shapes (q, k (B, H, D), v (B, H, Dv), state (B, H, D, Dv + 1) or None). Anything else, invalid
    input included, goes the PyTorch way, whose checks explain the problem. Decoding is bound by per-call
    overhead, so this one pass replaces the separate argument checks."""
    if feature_map not in MAPS or not available():
        return False
    grad = torch.is_grad_enabled()
    for t in (q, k, v, state):
        if t is not None and (type(t) is not Tensor or not t.is_cpu or t.dtype is not torch.float32
                              or (grad and t.requires_grad) or not t.is_contiguous()):
            return False
    shape = q.shape
    if len(shape) != 3 or k.shape != shape or v.dim() != 3 or v.shape[:2] != shape[:2] or 0 in shape:
        return False
    if state is not None and state.shape != (*shape, v.shape[2] + 1):
        return False
    return not compiling() and not functorch_active()


def kernel_step(q: Tensor, k: Tensor, v: Tensor, state: Optional[Tensor], feature_map: str, inplace: bool = False):
    """One decoding step; q, k (B, H, D), v (B, H, Dv), state (B, H, D, Dv + 1) or None, as ``step_ready``
    accepts them. Returns (out (B, H, Dv), new_state), new_state being ``state`` itself when ``inplace`` (the C
    step reads each state element before it writes it)."""
    b, h, d = q.shape
    dv = v.shape[-1]
    out = q.new_empty(b, h, dv)
    new_state = state if inplace and state is not None else q.new_empty(b, h, d, dv + 1)
    call("lm_kernel_step_f32", q.data_ptr(), k.data_ptr(), v.data_ptr(), None if state is None else state.data_ptr(),
         new_state.data_ptr(), out.data_ptr(), b * h, d, dv, MAPS[feature_map])
    return out, new_state
