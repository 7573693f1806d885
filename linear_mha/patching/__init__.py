"""Model surgery: swap linear attention into existing models, keeping their weights.

    patch(model, mode, ...)   in place; nn.MultiheadAttention (+ subclasses keeping its forward), timm Attention,
                              transformers models (through their attention interface), the LM stack
    unpatch(model)            back to the original modules, with the current weights
    patched(mode, ...)        context manager: nn.MultiheadAttention(...) builds LinearMultiheadAttention
    PatchReport               what was replaced, skipped (and why), parameters added
    calibrate(model, batches) fit the patched linear attention to the softmax attention it replaced
    output_distance           calibrate(distill=True)'s loss: the outputs against the original model's
    track_token_grid          tell the attention modules of any model where their token grid comes from
"""
from .calibrate import CalibrationReport, calibrate, output_distance
from .context import patched
from .patcher import patch, unpatch
from .report import PatchReport
from .huggingface import LinearHFAttention
from .hf_generation import LinearStateCache
from .timm_attention import LinearTimmAttention
from .token_grids import track_token_grid

__all__ = ["patch", "unpatch", "patched", "PatchReport", "LinearTimmAttention", "calibrate", "CalibrationReport",
           "output_distance", "track_token_grid",
           "LinearHFAttention", "LinearStateCache"]
