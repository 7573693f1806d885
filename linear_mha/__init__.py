"""linear_mha: linear-time drop-in replacements for torch.nn.MultiheadAttention."""
from . import functional
from .attention import MODES, LinearMultiheadAttention

__version__ = "0.1.0"
__all__ = ["LinearMultiheadAttention", "MODES", "functional"]
