"""linear_mha: linear-time drop-in replacements for torch.nn.MultiheadAttention."""
from . import functional

__version__ = "0.1.0"
