"""Where the image's token grid reaches the attention modules, for the local convolution term (``dwc_kernel``).

nn.MultiheadAttention is never told the height and width of the feature map its tokens come from. A
``GridTracker`` is told instead: a hook records the grid of every forward, from the image-shaped input of the module
that receives it (DETR's transformer) or from the output of a ViT's patch convolution, and the attention modules
inside read it.
``patch`` attaches one for DETR, timm and torchvision ViTs, ``linear_mha.track_token_grid`` one to any model;
a caller can also pass ``token_grid=TokenGrid(h, w)`` to LinearMultiheadAttention's forward directly.
"""
import functools
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import SymInt, Tensor, nn

from .functional._common import _is_compiling

NO_GRID = ("needs the token grid of this call: patch() finds it for DETR, timm and torchvision ViTs; elsewhere call "
           "linear_mha.track_token_grid(model, source=...) or pass token_grid=TokenGrid(height, width, prefix) to "
           "forward")


@dataclass(frozen=True)
class TokenGrid:
    """A sequence of ``prefix`` tokens (class / register) followed by a row-major ``height x width`` grid."""
    height: int
    width: int
    prefix: int = 0

    def __post_init__(self):
        for name in ("height", "width", "prefix"):
            value = getattr(self, name)
            if isinstance(value, SymInt):  # a size torch.export keeps symbolic: the graph holds it for any value
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "prefix" else 1):
                raise ValueError(f"TokenGrid.{name} must be a {'non-negative' if name == 'prefix' else 'positive'} "
                                 f"int, got {value!r}")

    @property
    def tokens(self) -> int:
        return self.prefix + self.height * self.width


# torch.export takes a TokenGrid among a call's inputs as a constant of the graph (its sizes are fixed there, as a
# trace fixes them; a call with another grid is refused by the exported program's input check).
if hasattr(torch.utils._pytree, "register_constant"):
    torch.utils._pytree.register_constant(TokenGrid)
else:  # torch < 2.7: a node without leaves, the sizes its context
    torch.utils._pytree.register_pytree_node(
        TokenGrid, lambda grid: ([], (grid.height, grid.width, grid.prefix)), lambda _, sizes: TokenGrid(*sizes),
        serialized_type_name="linear_mha.TokenGrid",
        flatten_with_keys_fn=lambda grid: ([], (grid.height, grid.width, grid.prefix)))


@dataclass(frozen=True)
class PatchConvolution:
    """Where a model (a ViT, its patch embedding) makes its patch tokens: its submodule ``conv``, whose (B, C, h, w)
    output is the grid, after ``prefix`` tokens. Exact for any convolution, and a convolution is a module torch.fx
    records whole, so its hook also runs when an FX graph of the model does (torchvision's create_feature_extractor),
    where a hook on a module the trace went through would not."""
    conv: str
    prefix: int = 0


class GridTracker:
    """The token grid of the latest forward of the module it watches (None before the first, or when that input
    was not image-shaped). Shared by the attention modules inside; a plain object, not part of any state dict.

    ``grid_of`` reads the grid off the watched module's first input, or is a ``PatchConvolution`` of it. The hooks are
    the tracker's bound methods, not closures: copy.deepcopy of the model (an EMA copy, say) gives the copy's modules
    hooks into the copied tracker, the one the copied attention modules read, and torch.save(model) pickles them.
    Hooks only write the grid: DataParallel's replicas share the tracker, and each writes the same grid."""

    def __init__(self, source_name: str, grid_of):
        self.source_name, self.grid_of = source_name, grid_of
        self.grid: Optional[TokenGrid] = None
        self.handle = self.conv_handle = self.conv = None

    @property
    def reads_convolution(self) -> bool:
        return not callable(self.grid_of)  # a PatchConvolution (compared by shape: the class may be reloaded)

    def watch(self, source: nn.Module) -> "GridTracker":
        if self.reads_convolution:
            self.handle = source.register_forward_pre_hook(self.follow)
            self.follow(source, ())
        else:
            self.handle = source.register_forward_pre_hook(self.record_input, with_kwargs=True)
        return self

    def record_input(self, module, args, kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        self.grid = self.grid_of(first)
        if self.grid is not None and torch.jit.is_tracing() and args:  # the trace fixes the grid: check its input
            height, width = _size(first.shape[-2]), _size(first.shape[-1])
            checked = traced_sizes_checked(first, {-2: height, -1: width},
                                           f"a {height} x {width} input to {self.source_name or 'the model'}")
            return (checked,) + tuple(args[1:]), kwargs
        return None

    def follow(self, source: nn.Module, args) -> None:
        # Hook the convolution of now, should it have been replaced (timm's set_input_size swaps it), and let go of
        # the one it replaced. A replica's convolution shares its hooks with the original's, and already has this
        # one. torch.jit.trace runs this as Python; a graph that dynamo records (torch.compile, torch.export) runs
        # the hooks there are and cannot add one, so a convolution no eager call has seen yet is refused there.
        conv = getattr(source, self.grid_of.conv)
        if _is_compiling():  # dynamo only: torch.jit.trace runs hooks as Python
            if conv is not self.conv:
                raise RuntimeError(f"{self.source_name or 'the model'}.{self.grid_of.conv} was replaced since the "
                                   f"model last ran outside torch.compile / torch.export, so the local term's grid "
                                   f"would be the old convolution's: run the model once eagerly first")
            return
        if self.record_output not in conv._forward_hooks.values():
            if self.conv_handle is not None:
                self.conv_handle.remove()
            self.conv_handle = conv.register_forward_hook(self.record_output)
        self.conv = conv

    def record_output(self, conv, args, output):
        if isinstance(output, Tensor) and output.dim() == 4:
            self.grid = TokenGrid(_size(output.shape[-2]), _size(output.shape[-1]), self.grid_of.prefix)
            return traced_sizes_checked(output, {-2: self.grid.height, -1: self.grid.width},
                                        f"a {self.grid.height} x {self.grid.width} patch grid")
        self.grid = None
        return None

    def remove(self) -> None:
        for handle in (self.handle, self.conv_handle):
            if handle is not None:
                handle.remove()
        self.handle = self.conv_handle = self.conv = None

    def __repr__(self):
        return f"GridTracker(source={self.source_name!r}, grid={self.grid})"


def _size(n):
    """A size for TokenGrid: an int, a SymInt under torch.export, and under torch.jit.trace (where sizes are
    0-d tensors) the int the trace then fixes, as it fixes every shape."""
    return int(n) if isinstance(n, Tensor) else n


# A reader is a partial of a module-level function rather than a closure, so that a patched model pickles whole.
def feature_map_grid(prefix: int = 0, stride: int = 1, round_up: bool = False) -> Callable:
    """A grid reader for a module whose first input is (B, C, H, W): the grid is H / stride x W / stride (rounded
    up for a patch embedding that pads, else down), after ``prefix`` tokens. Any other input gives no grid."""
    return functools.partial(_feature_map_grid, prefix, stride, round_up)


def _feature_map_grid(prefix: int, stride: int, round_up: bool, x) -> Optional[TokenGrid]:
    if not isinstance(x, Tensor) or x.dim() != 4:
        return None
    h, w = _size(x.shape[-2]), _size(x.shape[-1])
    if round_up:
        return TokenGrid(-(-h // stride), -(-w // stride), prefix)
    return TokenGrid(h // stride, w // stride, prefix)


def check_traced_grid(x: Tensor, grid: TokenGrid) -> Tensor:
    """x (B, H, N, d), checked to have the grid's N tokens inside a torch.jit.trace, and returned (use the returned
    tensor: a trace keeps only what the outputs depend on). A trace fixes the grid's sizes at the traced input's, as
    it fixes every shape: with this check (and the tracker's on the image's height and width) the traced model run
    at another size stops with a message that says so, instead of a shape error inside TorchScript or a grid of the
    same count in another shape. Outside a trace x comes back as it is."""
    return traced_sizes_checked(x, {2: grid.tokens}, f"a {grid.height} x {grid.width} token grid ({grid.tokens} "
                                                      f"tokens)")


def traced_sizes_checked(x: Tensor, sizes: dict, what: str) -> Tensor:
    """x, with a check recorded in a torch.jit.trace that its sizes ({dim: size}) are the traced ones (a scripted
    function, whose branch the trace keeps); as it is outside a trace, and in the legacy ONNX exporter, which cannot
    carry the check (torch.export and torch.compile keep sizes symbolic and need none)."""
    if not torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return x
    return _size_check()(x, list(sizes), list(sizes.values()), (
        f"this model was traced (torch.jit.trace) at {what}, which a trace fixes, and was called at another size. "
        f"Trace it at each input size, or export it with dynamic sizes (torch.export, or "
        f"torch.onnx.export(..., dynamo=True); docs/deploy.md)"))


@functools.lru_cache(maxsize=None)
def _size_check():
    """Scripted on first use (a trace records a call to it, branch included), not at import."""
    return torch.jit.script(_sizes_are)


def _sizes_are(x: Tensor, dims: List[int], sizes: List[int], message: str) -> Tensor:
    for dim, size in zip(dims, sizes):
        if x.size(dim) != size:
            raise RuntimeError(message)
    return x


def resolve_token_grid(module: nn.Module, token_grid: Optional[TokenGrid]) -> Optional[TokenGrid]:
    """The grid passed to forward, else the one ``module``'s tracker recorded for this forward, else None."""
    if token_grid is not None:
        return token_grid
    return getattr(module.__dict__.get("token_grid_source"), "grid", None)


def attach_tracker(modules, tracker: GridTracker) -> None:
    """Let ``modules`` (attention modules with a local term) read ``tracker``'s grid."""
    for module in modules:
        module.__dict__["token_grid_source"] = tracker  # unregistered: not a submodule, not in any state dict
