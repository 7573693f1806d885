"""Trackers of the token grid for the attention modules that read it (``dwc_kernel``, methods such as ``agent``):
``patch`` attaches them for the models it knows, ``track_token_grid`` for any other."""
from torch import nn

from ..attend import reads_token_grid
from ..token_grid import GridTracker, attach_tracker, feature_map_grid


def track_token_grid(model: nn.Module, source: str, *, prefix: int = 0, stride: int = 1) -> GridTracker:
    """Make every attention module in ``model`` that needs the token grid (a local convolution term, or a method
    such as ``agent``) read it from ``source`` (a submodule name) whose first input is a (B, C, H, W) feature map:
    grid H / stride x W / stride after ``prefix`` tokens. Returns the tracker (``tracker.remove()`` detaches it)."""
    tracker = GridTracker(source, feature_map_grid(prefix, stride)).watch(model.get_submodule(source))
    attach_tracker([m for m in model.modules() if hasattr(m, "method") and reads_token_grid(m)], tracker)
    return tracker
