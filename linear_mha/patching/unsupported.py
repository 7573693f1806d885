"""Attention modules patch() recognises but will not touch, each with the reason: their forward computes more
than softmax(q k^T) v on plain projections, so a linear drop-in would silently change the model. (Classes that have
an adapter say themselves which of their instances they refuse: ``AttentionAdapter.unsupported_reason``.)"""
import re
from typing import Optional

from torch import nn

# (class name, module path fragment or None) -> reason
_KNOWN = {
    ("EvaAttention", None): "applies rotary position embeddings (RoPE) to q and k inside forward (EVA)",
    ("AttentionRope", None): "applies rotary position embeddings (RoPE) to q and k inside forward",
    ("Attention", "beit"): "adds a learned relative position bias to the attention scores (BEiT)",
    ("RelPosAttention", None): "adds a relative position bias to the attention scores",
    ("WindowAttention", None): "windowed attention with a relative position bias (Swin); already linear in the "
                               "image size",
    ("WindowAttention3D", None): "windowed attention with a relative position bias; already linear in the size",
    ("Attention", "pvt_v2"): "spatial-reduction attention: keys/values come from a downsampled map (PVT)",
    ("TalkingHeadAttn", None): "talking heads: mixes attention maps across heads before and after the softmax "
                               "(CaiT)",
    ("ClassAttn", None): "class attention: only the class token queries (CaiT); already linear in the tokens",
    ("DiffAttention", None): "differential attention: the difference of two softmax maps",
    ("AttentionPoolLatent", None): "attention pooling with learned latent queries; already linear in the tokens",
    ("XCA", None): "cross-covariance attention: attends across channels, not tokens (XCiT); already linear in "
                   "the tokens",
}


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """The reason a module no adapter takes is left alone, or None if it does not look like attention."""
    cls = type(module)
    for (name, where), reason in _KNOWN.items():
        if cls.__name__ == name and (where is None or where in cls.__module__):
            return reason
    inner = (m for m in module.modules() if m is not module)
    if not _looks_like_attention(cls) or any(_looks_like_attention(type(m)) for m in inner):
        return None  # a block holding attention (CaiT's LayerScaleBlockClassAttn): the attention inside is reported
    return ("unsupported attention class; patch() replaces nn.MultiheadAttention (and subclasses that keep its "
            "forward), timm.layers.Attention and the LM stack's SelfAttention, whose computation it reproduces "
            "exactly, and the classes of any adapter registered with linear_mha.adapters.register_adapter")


def _looks_like_attention(cls) -> bool:
    return bool(re.search(r"attention|attn", cls.__name__, re.IGNORECASE)) or any(
        cls.__name__ == name for name, _ in _KNOWN)
