"""Which implementation runs an attention call, and why: the one place that decides.

    native             the compiled C code of ``native.py`` (float32 CPU, or half CPU inputs once copied to float32;
                       kernel attention with elu/relu/taylor/taylor2 maps, focused attention, a user's
                       elementwise map read as steps (``elementwise_program.py``) and hedgehog's maps at inference,
                       each map computed inside the kernels' row loaders, Efficient Attention, causal linear
                       attention with one decay per position (``native_decayed.py``)), forward and backward, and the
                       decoding step
    native_features    any other feature map (hedgehog's learned maps, a user's map): the map made by PyTorch ops or
                       by its own compiled pass; the products and the division by the compiled code
    fla                ``fla_causal.py``: causal elu/relu kernel attention on bfloat16 CUDA tensors through
                       flash-linear-attention's Triton kernel, when fla-core is installed and the path is enabled
    triton             ``triton_kernel.py``: non-causal kernel attention in fused Triton kernels, forward and backward,
                       on CUDA: elu, relu, taylor, focused, hedgehog's learned maps, rotary position
                       (LINEAR_MHA_TRITON=0 switches them off; =all adds maps not yet run on a GPU);
                       ``triton_causal.py``: the causal product in Triton kernels of our own, any map's features,
                       and ``triton_decayed.py`` that product with one decay per position (gated linear attention
                       with a scalar gate) (off until timed on a GPU: LINEAR_MHA_TRITON_CAUSAL=1 switches them on)
    fused_causal       ``kernel/fused.py``: causal elu/relu kernel attention as one autograd Function, the feature
                       map and the division done block by block in reused buffers
    blocked_inference  ``kernel/fused.py``: non-causal elu/relu inference without autograd, a block of positions at a
                       time (CPU)
    chunked            ``kernel/chunked.py``: the causal product on features made already, with its own backward
    composed           plain PyTorch ops (any map, dtype and device, torch.func, autograd through every op)

``kernel_backend`` / ``rope_backend`` / ``hedgehog_backend`` / ``product_backend`` / ``efficient_backend`` /
``decay_backend`` / ``delta_rule_backend`` / ``step_backend`` return a :class:`Choice` naming
the backend and the reason, so a user can ask why a call was not fast (``str(choice)``), as torch's
``why_not_fast_path`` does; each function is asked once per call, and the caller runs what it names.
:func:`override` switches choices for a block of code (tests, comparisons): ``native=False`` runs PyTorch ops
instead of the compiled code; ``block_positions=None`` runs CPU work as one block, as on accelerators.
"""
import contextlib
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from . import fla_causal, native, triton_causal, triton_decayed, triton_kernel
from ._common import compiling, compute_dtype, fixed_graph, functorch_active, has_tangent, needs_grad
from .elementwise_program import program_map
from .feature_maps import IN_PLACE_FEATURE_MAPS
from .hedgehog_map import HedgehogMap

NATIVE, NATIVE_FEATURES, FLA, TRITON, FUSED_CAUSAL, BLOCKED, CHUNKED, COMPOSED = (
    "native", "native_features", "fla", "triton", "fused_causal", "blocked_inference", "chunked", "composed")
FUSED_FEATURE_MAPS = tuple(IN_PLACE_FEATURE_MAPS)  # the maps causal_kernel.py and the blocked path apply in place


class Choice:
    """A backend and the reason it was chosen. The reason may be given as a function, spelled out only when read:
    the decoding step asks for a choice every token, and only a person reads why."""
    __slots__ = ("backend", "_reason")

    def __init__(self, backend: str, reason: Union[str, Callable[[], str]]):
        self.backend, self._reason = backend, reason

    @property
    def reason(self) -> str:
        return self._reason if isinstance(self._reason, str) else self._reason()

    def __str__(self):
        return f"{self.backend}: {self.reason}"

    def __repr__(self):
        return f"Choice({self.backend!r}, {self.reason!r})"


# Positions per block of work on CPU. Every temporary (scores, chunk states) is sized to one block
# and reused, so it is not a fresh multi-megabyte allocation (page faults cost as much as the
# matmuls) and transient memory does not grow with N. Single-threaded, a few thousand positions keep
# the temporaries in cache and still give each bmm a large batch. With several threads every op is a
# fork/join of the thread pool, and on a shared machine each join can wait a scheduler tick, so blocks
# are 8x larger: few joins, temporaries still bounded. The measurements: docs/benchmarks.md, "Why the
# code is shaped as it is".
BLOCK_POSITIONS = 2048
BLOCK_POSITIONS_THREADED = 16384

_UNSET = object()
_block_override = _UNSET


def block_positions(device: torch.device) -> Optional[int]:
    """Positions per block of CPU work, or None for a single block: on accelerators (caching allocators, launch
    overhead favours few large kernels), while compiling (a traced graph would unroll the loop once per block) and
    under torch.func (blocks write into buffers with out=)."""
    if device.type != "cpu" or compiling() or functorch_active():
        return None
    if _block_override is not _UNSET:
        return _block_override
    return BLOCK_POSITIONS if torch.get_num_threads() == 1 else BLOCK_POSITIONS_THREADED


@contextlib.contextmanager
def override(*, native_kernels: Optional[bool] = None, block_positions=_UNSET, fla: Optional[bool] = None):
    """Within the block: ``native_kernels`` True/False switches the compiled CPU code on/off; ``block_positions``
    None makes CPU work one block (the code path CUDA runs), an int sets the block size; ``fla`` True/False switches
    flash-linear-attention's kernel on/off for causal bfloat16 CUDA attention. Restored on exit."""
    global _block_override
    previous_native = None if native_kernels is None else native.set_enabled(native_kernels)
    previous_fla = None if fla is None else fla_causal.set_enabled(fla)
    previous_block = _block_override
    if block_positions is not _UNSET:
        if block_positions is not None and (not isinstance(block_positions, int) or block_positions < 1):
            raise ValueError(f"block_positions must be None or a positive int, got {block_positions!r}")
        _block_override = block_positions
    try:
        yield
    finally:
        _block_override = previous_block
        if previous_fla is not None:
            fla_causal.set_enabled(previous_fla)
        if previous_native is not None:
            native.set_enabled(previous_native)


def kernel_backend(q: Tensor, k: Tensor, v: Tensor, feature_map, *, causal: bool,
                   initial_state: Optional[Tensor] = None) -> Choice:
    """The backend ``functional.kernel`` runs for these tensors, as the caller passes them: half inputs go to fla as
    they are, everywhere else they are computed in float32 copies (so the compiled code takes bfloat16 CPU
    inputs too). A user's callable is judged as ``kernel`` runs it: read as a program of steps where it is one."""
    feature_map = program_map(feature_map)
    if not causal and triton_kernel.enabled() and triton_kernel.why_not(q, k, v, feature_map, initial_state) is None:
        return Choice(TRITON, "non-causal kernel attention on CUDA: the fused Triton kernels "
                              "(LINEAR_MHA_TRITON=0 switches them off)")
    why_not_fla = fla_causal.why_not(q, k, v, feature_map, initial_state) if causal else None
    if causal and why_not_fla is None:
        return Choice(FLA, "causal elu/relu attention on bfloat16 CUDA tensors, with fla enabled (LINEAR_MHA_FLA=1)")
    if causal and triton_causal.why_not(q, k, v, initial_state) is None:
        return Choice(TRITON, "causal kernel attention on CUDA: the map by PyTorch ops, the product in the Triton "
                              "causal kernels (LINEAR_MHA_TRITON_CAUSAL=1)")
    why_not_native = native.why_not_kernel(feature_map, q, k, v, initial_state, dtype=compute_dtype(q.dtype))
    if why_not_native is None:
        return Choice(NATIVE, f"float32 CPU tensors and the {feature_map!r} map, which the compiled code fuses")
    fused = isinstance(feature_map, str) and feature_map in FUSED_FEATURE_MAPS
    if not fused:
        name = getattr(feature_map, "__name__", feature_map)
        why_not_products = native.why_not(q, k, v, initial_state, dtype=compute_dtype(q.dtype))
        if why_not_products is None:
            return Choice(NATIVE_FEATURES, f"float32 CPU tensors: feature_map {name!r} is made by PyTorch ops (not in "
                                           f"the kernels because {why_not_native}), the products and the division "
                                           f"run in the compiled code (in PyTorch ops where the features carry "
                                           f"forward-mode tangents of the map's own parameters)")
        return Choice(COMPOSED, f"feature_map {name!r} has no fused path (only {FUSED_FEATURE_MAPS}), and its "
                                f"features cannot go to the compiled code because {why_not_products}")
    if causal:
        if functorch_active():
            return Choice(COMPOSED, "inside a torch.func transform, which custom autograd Functions do not support")
        if has_tangent(q, k, v, initial_state):
            return Choice(COMPOSED, "forward-mode AD tangents, which the fused causal Function does not carry")
        if compiling() and (needs_grad(q, k, v, initial_state) or fixed_graph()):
            return Choice(COMPOSED, "recorded into a graph (with gradients, or by torch.export / torch.jit.trace): "
                                    "the fused causal Function writes with out=, which exporters cannot read")
        return Choice(FUSED_CAUSAL, f"not native because {why_not_native}; not fla because {why_not_fla}")
    if needs_grad(q, k, v, initial_state) or has_tangent(q, k, v, initial_state):
        return Choice(COMPOSED, f"not native because {why_not_native}; gradients are needed (or forward-mode "
                                f"tangents), and the blocked path has neither")
    if block_positions(q.device) is None:
        return Choice(COMPOSED, f"not native because {why_not_native}; work on {q.device.type} is one block")
    return Choice(BLOCKED, f"not native because {why_not_native}; inference, a block of positions at a time")


def rope_backend(q: Tensor, k: Tensor, v: Tensor, feature_map, key_weights: Optional[Tensor] = None) -> Choice:
    """The backend ``grid_rope.grid_rope_kernel`` runs: the compiled code rotates the features and runs the products
    and the division (native: it makes the map too; native_features: PyTorch ops make the features), else PyTorch
    ops."""
    why_not_triton = "key weights" if key_weights is not None else \
        triton_kernel.why_not(q, k, v, feature_map, rope=True)
    if triton_kernel.enabled() and why_not_triton is None:
        return Choice(TRITON, "the map, the rotation, the products and the division in the fused Triton kernels "
                              "(LINEAR_MHA_TRITON=0 switches them off)")
    why_not_native = native.why_not(q, k, v, key_weights, dtype=compute_dtype(q.dtype))
    if why_not_native is not None:
        return Choice(COMPOSED, f"not native because {why_not_native}")
    name = getattr(feature_map, "__name__", feature_map)
    if key_weights is None and getattr(feature_map, "compiled_map", None) is None \
            and native.why_not_kernel(feature_map, q, dtype=compute_dtype(q.dtype)) is None:  # no settings with rope
        return Choice(NATIVE, f"float32 CPU tensors and the {name!r} map: the map, the rotation, the products and "
                              f"the division in the compiled code")
    made_by = "key weights" if key_weights is not None else f"feature_map {name!r}"
    return Choice(NATIVE_FEATURES, f"float32 CPU tensors: the features made by PyTorch ops ({made_by}), the "
                                   f"rotation, the products and the division in the compiled code")


def hedgehog_backend(q: Tensor, k: Tensor, v: Tensor, q_map, k_map, *, causal: bool,
                     initial_state: Optional[Tensor] = None, window: bool = False) -> Choice:
    """The backend ``hedgehog.hedgehog`` runs: the fused Triton kernels (the maps inside them), or features made by
    ``hedgehog_features`` and given to ``feature_attention`` (``features_backend`` then picks its products)."""
    why_not_triton = "causal" if causal else "a sliding window" if window else \
        triton_kernel.why_not_hedgehog(q, k, v, q_map, k_map, initial_state)
    if triton_kernel.enabled() and why_not_triton is None:
        return Choice(TRITON, "non-causal hedgehog attention: the maps, the products and the division in the fused "
                              "Triton kernels (LINEAR_MHA_TRITON=0 switches them off)")
    why_not_triton = "it is switched off" if why_not_triton is None else why_not_triton
    why_not_native = native.why_not(q, k, v, initial_state, dtype=compute_dtype(q.dtype))
    why_not_maps = "a sliding window" if window else HedgehogMap(q_map, k_map).why_not_compiled(q)
    if why_not_native is None and why_not_maps is None:
        return Choice(NATIVE, f"float32 CPU tensors: the maps' projections and double softmaxes, the products and the "
                              f"division in the compiled code, forward and backward; not triton because "
                              f"{why_not_triton}")
    if why_not_native is None:
        return Choice(NATIVE_FEATURES, f"the features made by their own pass, the products and the division in the "
                                       f"compiled code; the maps not inside it because {why_not_maps}; not triton "
                                       f"because {why_not_triton}")
    return Choice(COMPOSED, f"not triton because {why_not_triton}; not native because {why_not_native}")


def features_backend(phi_q: Tensor, phi_k: Tensor, v: Tensor, initial_state: Optional[Tensor] = None) -> Choice:
    """The backend ``functional.feature_attention`` runs for features made already (hedgehog's learned maps)."""
    if phi_q.dim() != 4 or phi_k.dim() != 4 or v.dim() != 4 or phi_q.shape[:2] != phi_k.shape[:2] \
            or phi_k.shape[:3] != v.shape[:3] or phi_q.shape[-1] != phi_k.shape[-1]:
        return Choice(COMPOSED, f"features {tuple(phi_q.shape)}, {tuple(phi_k.shape)} and values {tuple(v.shape)} "
                                f"are not (B, H, L, F), (B, H, S, F), (B, H, S, Dv): the compiled code reads no "
                                f"broadcast")
    why_not_native = native.why_not(phi_q, phi_k, v, initial_state)
    if why_not_native is None:
        return Choice(NATIVE_FEATURES, "float32 CPU features: the products and the division in the compiled code")
    return Choice(COMPOSED, f"not native because {why_not_native}")


def why_not_focused_rows(x: Tensor, scale: Optional[Tensor]) -> Optional[str]:
    """Why the compiled focused map cannot read x and scale as they are shaped, or None: it takes (B, H, N, d) rows
    and one scale per head and channel (or none)."""
    if x.dim() != 4:
        return f"x has {x.dim()} dimensions; the compiled map takes (B, H, N, d) rows"
    if scale is not None:
        sizes = (1,) * (4 - scale.dim()) + tuple(scale.shape)
        if scale.dim() > 4 or sizes[0] != 1 or sizes[2] != 1 or sizes[1] not in (1, x.shape[1]) \
                or sizes[3] not in (1, x.shape[3]):
            return f"scale of shape {tuple(scale.shape)} is not one value per head and channel"
    return None


def focused_map_backend(x: Tensor, scale: Optional[Tensor]) -> Choice:
    """The backend ``focused.focused_feature_map`` runs: the compiled map (``native_maps.focused_map``) for float32 CPU
    rows (B, H, N, d) whose scale is one value per head and channel, or None."""
    why_not_rows = why_not_focused_rows(x, scale)
    if why_not_rows is not None:
        return Choice(COMPOSED, why_not_rows)
    why_not_native = native.why_not(x, scale, dtype=None)
    if why_not_native is None:
        return Choice(NATIVE, "float32 CPU rows: the map in one compiled pass, forward and backward")
    return Choice(COMPOSED, f"not native because {why_not_native}")


def silu_unit_backend(x: Tensor) -> Choice:
    """The backend of the delta rule's query and key map, silu then unit norm (``delta_rule.silu_unit``):
    the compiled row pass (``native_maps.silu_unit_map``) for float32 CPU (B, H, N, d) rows, or PyTorch ops."""
    if x.dim() != 4:
        return Choice(COMPOSED, f"x has {x.dim()} dimensions; the compiled map takes (B, H, N, d) rows")
    why_not_native = native.why_not(x)
    if why_not_native is None:
        return Choice(NATIVE, "float32 CPU rows: silu and the norm in one compiled pass, forward and backward")
    return Choice(COMPOSED, f"not native because {why_not_native}")


def log_gate_backend(z: Tensor, bias: Optional[Tensor]) -> Choice:
    """The backend of GLA's log gates from the keys' projection (``gated_linear.log_sigmoid_gate``): the compiled row
    pass (``native_maps.log_gate_map``) for float32 CPU (B, H, N, d) rows and a bias per head and channel, or
    PyTorch ops."""
    if z.dim() != 4 or (bias is not None and tuple(bias.shape) != (z.shape[1], z.shape[3])):
        return Choice(COMPOSED, f"z {tuple(z.shape)} and bias {None if bias is None else tuple(bias.shape)} are not "
                                f"(B, H, N, d) rows and one bias per head and channel")
    why_not_native = native.why_not(z, bias)
    if why_not_native is None:
        return Choice(NATIVE, "float32 CPU rows: the bias, logsigmoid and temperature in one compiled pass")
    return Choice(COMPOSED, f"not native because {why_not_native}")


def hedgehog_map_backend(z: Tensor, bias: Optional[Tensor]) -> Choice:
    """The backend ``hedgehog.hedgehog_features`` runs after its projection: the compiled double softmax
    (``native_maps.hedgehog_map``) for float32 CPU values, or PyTorch ops."""
    why_not_native = native.why_not(z, bias)
    if why_not_native is None:
        return Choice(NATIVE, "float32 CPU values: both softmaxes in one compiled pass, forward and backward")
    return Choice(COMPOSED, f"not native because {why_not_native}")


def why_not_gate_shapes(out: Tensor, q: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[str]:
    """Why these are not the shapes the compiled gate reads (the composed formula broadcasts), or None."""
    if out.dim() != 4 or q.dim() != 4 or q.shape[:3] != out.shape[:3]:
        return f"out {tuple(out.shape)} and q {tuple(q.shape)} are not (B, H, L, Dv) and (B, H, L, D)"
    h, d, dv = out.shape[1], q.shape[-1], out.shape[-1]
    if weight.shape != (h, d, dv) or (bias is not None and bias.shape != (h, 1, dv)):
        return (f"the gate's weight {tuple(weight.shape)} and bias {None if bias is None else tuple(bias.shape)} are "
                f"not ({h}, {d}, {dv}) and ({h}, 1, {dv})")
    return None


def why_not_option_pass(option: str, weight: Tensor, bias: Optional[Tensor], *rows: Tensor) -> Optional[str]:
    """Why a module option's compiled pass (the gate's, the local term's) cannot run, or None: its parameters
    must be float32 CPU tensors without forward-mode tangents (any strides: they are small and copied when needed),
    and the rows it reads must suit the compiled code (``native.why_not``)."""
    why_not = next((f"{option}'s {name} is {t.dtype} on {t.device}" for name, t in (("weight", weight),
                    ("bias", bias)) if t is not None and (t.dtype != torch.float32 or not t.is_cpu)), None)
    if why_not is None and has_tangent(weight, bias):
        why_not = f"{option}'s parameters carry forward-mode AD tangents, which the compiled code drops"
    if why_not is None:
        why_not_native = native.why_not(*rows)
        why_not = None if why_not_native is None else f"not native because {why_not_native}"
    return why_not


def output_gate_backend(out: Tensor, q: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Choice:
    """The backend ``output_gate.apply_output_gate`` runs: the compiled gate (``native_maps.output_gate``) for
    float32 CPU tensors of its shapes, or PyTorch ops. The weight and bias may have any strides (they are small and
    copied when they need to be)."""
    why_not = why_not_gate_shapes(out, q, weight, bias) or why_not_option_pass("the gate", weight, bias, out, q)
    if why_not is None:
        return Choice(NATIVE, "float32 CPU tensors: the gate made a block of rows at a time in compiled code and "
                              "never stored, forward and backward")
    return Choice(COMPOSED, why_not)


MAX_COMPILED_DWC_KERNEL = 15  # the compiled local term keeps a row pointer per tap on the stack


def local_term_backend(out: Tensor, v: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Choice:
    """The backend ``local_term.add_local_term`` runs: the compiled convolution-and-sum (``native_maps.local_term``)
    for float32 CPU tensors, or torch's depthwise conv2d and an add."""
    k = weight.shape[-1]
    if out.shape != v.shape:
        why_not = f"out {tuple(out.shape)} and v {tuple(v.shape)} differ"
    elif k > MAX_COMPILED_DWC_KERNEL:
        why_not = f"dwc_kernel {k} is above the compiled code's {MAX_COMPILED_DWC_KERNEL}"
    else:
        why_not = why_not_option_pass("the local term", weight, bias, out, v)
    if why_not is None:
        return Choice(NATIVE, "float32 CPU tensors: the convolution over the token grid and its sum with the output "
                              "in one compiled pass, forward and backward")
    return Choice(COMPOSED, why_not)


def product_backend(phi_q: Tensor, phi_k: Tensor, v: Tensor, initial_state: Optional[Tensor] = None) -> Choice:
    """The backend ``functional.causal_linear_product`` runs for features made already."""
    if functorch_active():
        return Choice(COMPOSED, "inside a torch.func transform, which supports neither custom autograd Functions "
                                "nor out=")
    if has_tangent(phi_q, phi_k, v, initial_state):
        return Choice(COMPOSED, "a tensor carries a forward-mode AD tangent, for which the chunked Function has no "
                                "formula")
    if compiling() and (needs_grad(phi_q, phi_k, v, initial_state) or fixed_graph()):
        return Choice(COMPOSED, "recorded into a graph (with gradients, or by torch.export / torch.jit.trace): "
                                "plain ops trace where the chunked Function's out= products may not")
    why_not_triton = triton_causal.why_not(phi_q, phi_k, v, initial_state)
    if why_not_triton is None:
        return Choice(TRITON, "the Triton causal kernels (LINEAR_MHA_TRITON_CAUSAL=1)")
    return Choice(CHUNKED, lambda: "the chunked product with its own backward, in blocks of reused buffers (not the "
                                   f"Triton causal kernels: {why_not_triton})")


def efficient_backend(q: Tensor, k: Tensor, v: Tensor) -> Choice:
    """The backend ``functional.efficient_attention`` runs for these tensors (in their compute dtype)."""
    why_not_native = native.why_not(q, k, v, dtype=compute_dtype(q.dtype))
    if why_not_native is None:
        return Choice(NATIVE, "float32 CPU tensors")
    return Choice(COMPOSED, f"not native because {why_not_native}")


def decay_backend(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor) -> Choice:
    """The backend ``functional.gated_linear_attention`` runs for heads already in their compute dtype and a
    (B, H, L, G) log gate."""
    why_not_native = native.why_not(q, k, v)
    why_not_triton = None if why_not_native is None else triton_decayed.why_not(q, k, v, log_gate)
    if (why_not_native is None or why_not_triton is None) and log_gate.numel() and bool(log_gate.amax() > 0):
        return Choice(COMPOSED, "the chunked form in PyTorch ops: a log gate is positive (a growing state), which "
                                "the compiled code and the Triton kernel do not take")  # one reduction, no bool copy
    if why_not_native is None:
        if log_gate.shape[-1] != 1:
            return Choice(NATIVE, "float32 CPU tensors and a gate per key dimension (GLA): the recurrence position "
                                  "by position in the compiled code, its state in cache")
        return Choice(NATIVE, "float32 CPU tensors and one gate per position: the compiled causal product, its "
                              "backward three more of the same")
    if why_not_triton is None:
        return Choice(TRITON, "one gate per position: the causal product in a Triton kernel, its backward three more "
                              "of the same (LINEAR_MHA_TRITON_CAUSAL=1)")
    return Choice(COMPOSED, f"the chunked form in PyTorch ops, not native because {why_not_native}; not the Triton "
                            f"kernel because {why_not_triton}")


def delta_rule_backend(*tensors: Optional[Tensor]) -> Choice:
    """The backend of the delta rule's chunk steps (``functional.delta_rule_attention``): every chunk's unit
    lower-triangular system and the pass from chunk to chunk."""
    why_not_native = native.why_not(*tensors)
    if why_not_native is None:
        return Choice(NATIVE, "float32 CPU: each chunk's system (its inverse by forward substitution and the "
                              "products with it) and the pass over chunks in the compiled code")
    return Choice(COMPOSED, f"torch.linalg.solve_triangular and a loop of PyTorch ops over the chunks, not native "
                            f"because {why_not_native}")


_NATIVE_STEP = Choice(NATIVE, "contiguous float32 CPU tensors without autograd and an elu/relu map")


def step_backend(q: Tensor, k: Tensor, v: Tensor, state: Optional[Tensor], feature_map) -> Choice:
    """The backend ``functional.kernel_step`` runs. Decoding is bound by per-call overhead: the compiled step's
    readiness is one pass over the arguments (``native.step_ready``), and the answer a constant; only the slower
    path spells out why."""
    if native.step_ready(feature_map, q, k, v, state):
        return _NATIVE_STEP
    return Choice(COMPOSED, lambda: "the compiled step needs contiguous float32 CPU tensors of consistent shapes, no "
                                    "autograd, an elu/relu map and a build; "
                                    + (native.why_not(q, k, v, state) or "see above"))
