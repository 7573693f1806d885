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
from typing import Callable, Optional

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

    def record_input(self, module, args, kwargs) -> None:
        first = args[0] if args else next(iter(kwargs.values()), None)
        self.grid = self.grid_of(first)

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

    def record_output(self, conv, args, output) -> None:
        if isinstance(output, Tensor) and output.dim() == 4:
            self.grid = TokenGrid(_size(output.shape[-2]), _size(output.shape[-1]), self.grid_of.prefix)
        else:
            self.grid = None

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


def resolve_token_grid(module: nn.Module, token_grid: Optional[TokenGrid]) -> Optional[TokenGrid]:
    """The grid passed to forward, else the one ``module``'s tracker recorded for this forward, else None."""
    if token_grid is not None:
        return token_grid
    return getattr(module.__dict__.get("token_grid_source"), "grid", None)


def attach_tracker(modules, tracker: GridTracker) -> None:
    """Let ``modules`` (attention modules with a local term) read ``tracker``'s grid."""
    for module in modules:
        module.__dict__["token_grid_source"] = tracker  # unregistered: not a submodule, not in any state dict
