"""linear_mha: linear-time drop-in replacements for torch.nn.MultiheadAttention.

Layers: ``functional`` (pure attention functions) -> ``registry`` / ``methods`` (attention methods by name) ->
``LinearMultiheadAttention`` (the module) -> ``patching`` (model surgery) -> ``lm`` (language models and image
attention built on the layers below).
"""
import warnings

from . import functional
from .registry import (AttentionMethod, Option, available_methods, method_class, register_method,
                       unregister_method)
from . import methods  # noqa: F401  (registers the built-in methods)
from .attention import LinearMultiheadAttention
from .token_grid import TokenGrid
from .lm import (AutoregressiveWrapper, ImageLinearAttention, LinearAttentionTransformer,
                 LinearAttentionTransformerLM, LinearImageAttention, LinearSelfAttention, Linformer,
                 LinformerContextSettings, LinformerLM, LinformerSelfAttention, LinformerSettings)
from .patching import (CalibrationReport, PatchReport, calibrate, output_distance, patch, patched,
                       track_token_grid, unpatch)

__version__ = "0.1.0"
__all__ = [
    "LinearMultiheadAttention", "functional",
    "AttentionMethod", "Option", "register_method", "unregister_method", "available_methods", "method_class",
    "TokenGrid", "track_token_grid",
    "patch", "unpatch", "patched", "PatchReport", "calibrate", "CalibrationReport", "output_distance",
    "LinearAttentionTransformerLM", "LinearAttentionTransformer", "AutoregressiveWrapper", "LinformerSettings",
    "LinformerContextSettings", "Linformer", "LinformerLM", "LinformerSelfAttention", "LinearSelfAttention",
    "ImageLinearAttention", "LinearImageAttention",
]


def __getattr__(name):
    """Names that moved, kept working with a warning (deprecated, not broken)."""
    if name == "MODES":
        warnings.warn("linear_mha.MODES is now linear_mha.available_methods(), which also lists the methods registered "
                      "since", DeprecationWarning, stacklevel=2)
        return available_methods()
    if name == "keep_freed_memory":
        raise AttributeError("linear_mha.keep_freed_memory moved out of the library (it sets the process's allocator, "
                             "it is not attention): call linear_mha.tools.cpu_allocator.keep_freed_memory(); see "
                             "docs/cpu_allocator.md")
    raise AttributeError(f"module 'linear_mha' has no attribute {name!r}")
