"""linear_mha: linear-time drop-in replacements for torch.nn.MultiheadAttention.

Layers: ``functional`` (pure attention functions) -> ``LinearMultiheadAttention`` (the module) -> ``patching``
(model surgery) -> ``lm`` (language models and image attention built on the layers below).
"""
from . import functional
from .attention import LinearMultiheadAttention
from .cpu_malloc import keep_freed_memory
from .mode_attention import MODES
from .lm import (AutoregressiveWrapper, ImageLinearAttention, LinearAttentionTransformer,
                 LinearAttentionTransformerLM, LinearImageAttention, LinearSelfAttention, Linformer,
                 LinformerContextSettings, LinformerLM, LinformerSelfAttention, LinformerSettings)
from .patching import PatchReport, patch, patched, unpatch

__version__ = "0.1.0"
__all__ = [
    "LinearMultiheadAttention", "MODES", "functional",
    "patch", "unpatch", "patched", "PatchReport",
    "LinearAttentionTransformerLM", "LinearAttentionTransformer", "AutoregressiveWrapper", "LinformerSettings",
    "LinformerContextSettings", "Linformer", "LinformerLM", "LinformerSelfAttention", "LinearSelfAttention",
    "ImageLinearAttention", "LinearImageAttention", "keep_freed_memory",
]
