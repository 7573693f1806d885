"""Attention modules patch() recognises but will not touch, each with the reason: their forward computes more
than softmax(q k^T) v on plain projections, so a linear drop-in would silently change the model."""
import re
from typing import Optional

from torch import nn
from torch.nn.utils import parametrize

from .generic import TORCH_MHA

_SUPPORTED = "patch() replaces nn.MultiheadAttention (and subclasses that keep its forward) and timm.layers.Attention"

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


def mha_subclass_reason(module: nn.Module) -> Optional[str]:
    """Why an nn.MultiheadAttention cannot be swapped for LinearMultiheadAttention, or None if it can: the swap
    reruns torch's forward on the same Parameters, so a subclass must keep both."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        return ("its weights are parametrized (torch.nn.utils.parametrize); the linear module takes plain "
                "Parameters, so patch before adding the parametrization")
    if cls.forward is not TORCH_MHA.forward:
        return (f"subclass {cls.__module__}.{cls.__qualname__} overrides forward; a linear drop-in would run "
                f"torch's forward instead and drop that code")
    return None


def unsupported_reason(module: nn.Module, timm_classes: tuple) -> Optional[str]:
    """The reason an attention-like module is left alone, or None if it does not look like attention."""
    cls = type(module)
    if isinstance(module, TORCH_MHA):
        return mha_subclass_reason(module)
    if any(issubclass(cls, c) for c in timm_classes):
        return (f"subclass of {timm_classes[0].__module__}.Attention: matched by exact class only, since a "
                f"subclass may change forward")
    for (name, where), reason in _KNOWN.items():
        if cls.__name__ == name and (where is None or where in cls.__module__):
            return reason
    inner = (m for m in module.modules() if m is not module)
    if not _looks_like_attention(cls) or any(_looks_like_attention(type(m)) for m in inner):
        return None  # a block holding attention (CaiT's LayerScaleBlockClassAttn): the attention inside is reported
    return f"unsupported attention class; {_SUPPORTED}, whose computation it reproduces exactly"


def _looks_like_attention(cls) -> bool:
    return bool(re.search(r"attention|attn", cls.__name__, re.IGNORECASE)) or cls is TORCH_MHA or any(
        cls.__name__ == name for name, _ in _KNOWN)
