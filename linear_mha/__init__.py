"""linear_mha: linear-time drop-in replacements for torch.nn.MultiheadAttention.

Layers: ``functional`` (pure attention functions) -> ``registry`` / ``methods`` (attention methods by name) ->
``LinearMultiheadAttention`` (the module) -> ``patching`` (model surgery) -> ``lm`` (language models and image
attention built on the layers below).
"""
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
