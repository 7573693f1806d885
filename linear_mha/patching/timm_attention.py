"""Linear attention for timm ViTs: ``timm.layers.Attention`` (and the older
``timm.models.vision_transformer.Attention``) swapped for an adapter that REUSES the original qkv / q_norm /
k_norm / norm / gate / proj / dropout submodules, so state_dict keys and tensors are unchanged and timm
checkpoints load strictly. Only the softmax(q k^T) v step changes; it runs through ``attend.attend_heads`` with a
method from the registry, as in LinearMultiheadAttention, so both classes approximate attention identically.
"""
import sys
from typing import Optional

import torch
from torch import Tensor, nn

from .. import masks
from ..adapters import AttentionAdapter, UnknownLength, register_adapter, traced_whole
from ..attend import attend_heads, split_for_options
from ..local_term import add_local_term
from ..output_gate import apply_output_gate
from ..plain_linear import call_linear
from ..registry import DEFAULT_MODE, create_method
from ..token_grid import PatchConvolution, feature_map_grid, resolve_token_grid

_REUSED = ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "gate", "proj", "proj_drop")


def supported_timm_classes() -> tuple:
    """timm's plain ViT attention classes, looked up only if timm is already imported (a timm model implies it),
    so patching a non-timm model never pays timm's import time."""
    classes = []
    for module_name in ("timm.layers.attention", "timm.models.vision_transformer"):
        cls = getattr(sys.modules.get(module_name), "Attention", None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in classes:
            classes.append(cls)
    return tuple(classes)


def timm_token_count(model: nn.Module) -> Optional[int]:
    """Tokens a timm ViT feeds its attention (patch grid + class/register tokens), or None if the model does not
    say or its token count varies (dynamic_img_size)."""
    patch_embed = getattr(model, "patch_embed", None)
    num_patches = getattr(patch_embed, "num_patches", None)
    if getattr(model, "dynamic_img_size", False) or not isinstance(num_patches, int):
        return None
    return num_patches + int(getattr(model, "num_prefix_tokens", 0))


def _timm_mask_to_nn(attn_mask: Tensor, batch: int, heads: int, n: int, method):
    """timm passes SDPA masks (bool True = MAY attend, or additive float), broadcastable to (B, H, N, N).
    Returns (key_padding_mask (B, N) or None, attn_mask (B, H, N, N) or None) in nn.MultiheadAttention's
    convention (True = masked). A mask that is the same for every query and head is key padding, which every
    mode honours; anything else goes to the shared path (softmax: any mask; kernel/taylor: causal; else error)."""
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask must be broadcastable to (B, H, N, N) = {(batch, heads, n, n)}, "
                         f"got shape {tuple(attn_mask.shape)}")
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    mask = (~mask) if mask.dtype == torch.bool else mask
    try:
        mask = mask.expand(batch, heads, n, n)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, N, N) = "
                         f"{(batch, heads, n, n)}") from None
    if method.any_mask:
        return None, mask
    forbidden = masks.to_forbidden(mask, "attn_mask", method.name)
    if bool((forbidden == forbidden[:, :1, :1, :]).all()):
        return forbidden[:, 0, 0, :], None
    return None, forbidden


@register_adapter
class LinearTimmAttention(AttentionAdapter, nn.Module):
    """timm ``Attention`` with linear attention. Options are LinearMultiheadAttention's keyword options: ``mode``
    and that method's options. Build it with :meth:`from_timm`; :meth:`to_timm` gives the timm module back."""

    def __init__(self, attn: nn.Module, mode: str = DEFAULT_MODE, dwc_kernel=None, output_gate=False, **options):
        method = create_method(mode, options)
        super().__init__()
        self.num_heads = attn.num_heads
        self.head_dim = getattr(attn, "head_dim", None) or attn.qkv.in_features // attn.num_heads
        self.attn_dim = getattr(attn, "attn_dim", self.num_heads * self.head_dim)
        self.batch_first = True
        for name in _REUSED:
            module = getattr(attn, name, None)
            if name in ("q_norm", "k_norm", "norm") and module is None:
                module = nn.Identity()  # older timm: no such step
            setattr(self, name, module)
        weight = attn.qkv.weight
        self.init_method(method, self.num_heads, self.head_dim, {"device": weight.device, "dtype": weight.dtype},
                         dwc_kernel, output_gate)
        self.keep_original(attn)
        self.train(attn.training)

    kind, reused = "timm", _REUSED

    @classmethod
    def from_timm(cls, attn: nn.Module, **options) -> "LinearTimmAttention":
        if type(attn) not in supported_timm_classes():
            raise TypeError(f"from_timm expects timm.layers.Attention (exact class), got {type(attn).__name__}")
        return cls(attn, **options)

    from_original = from_timm

    @classmethod
    def matches(cls, module):
        return isinstance(module, supported_timm_classes())

    @classmethod
    def unsupported_reason(cls, attn):
        if type(attn) in supported_timm_classes():
            return None
        return (f"subclass of {supported_timm_classes()[0].__module__}.Attention: matched by exact class only, "
                f"since a subclass may change forward")

    @classmethod
    def sequence_length(cls, owner):
        if getattr(owner, "patch_embed", None) is None:
            return None
        tokens = timm_token_count(owner)
        if tokens is None:
            raise UnknownLength("timm attention in a model whose token count varies (dynamic_img_size=True) or is "
                                "unknown")
        return tokens

    @classmethod
    def grid_source(cls, owner_name, owner, name):
        patch_embed = getattr(owner, "patch_embed", None)
        if patch_embed is None:
            return None
        path = f"{owner_name}.patch_embed" if owner_name else "patch_embed"
        prefix = int(getattr(owner, "num_prefix_tokens", 0))
        if isinstance(getattr(patch_embed, "proj", None), nn.Conv2d):  # its output is the grid, padded or hybrid
            return path, PatchConvolution("proj", prefix)
        stride = getattr(patch_embed, "patch_size", (1,))[0]
        return path, feature_map_grid(prefix, stride, round_up=bool(getattr(patch_embed, "dynamic_img_pad", False)))

    def extra_repr(self) -> str:
        s = f"attn_dim={self.attn_dim}, num_heads={self.num_heads}, {self.method.describe()}"
        return s + self.extras_repr()

    def to_timm(self) -> nn.Module:
        """The original timm module, holding this adapter's current submodules (and so its trained weights)."""
        return self.to_original()

    def output_padding(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False):
        """For ``calibrate``: (B, N, 1) True on the padded tokens' own outputs (a key-padding ``attn_mask``), or
        None. No token reads them, and the linear method does not compute them as softmax does."""
        if attn_mask is None:
            return None
        kpm, _ = _timm_mask_to_nn(attn_mask, x.shape[0], self.num_heads, x.shape[1], self.method)
        return None if kpm is None else masks.to_forbidden(kpm, "attn_mask", self.mode)[:, :, None]

    @traced_whole
    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        """x (B, N, C) -> (B, N, C_out), as timm's Attention.forward (attn_mask in SDPA's convention)."""
        self.method.before_forward(self)
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        # (B, H, N, d) each; q and v again for the output gate and the local term, where they read them as they are
        (q, k, v), q_gate, v_local = split_for_options(self, call_linear(self.qkv, x), 3, q_at=0, v_at=2,
                                                       gate_reads_q=isinstance(self.q_norm, nn.Identity))
        q, k = self.q_norm(q), self.k_norm(k)
        kpm, mask = (None, None) if attn_mask is None else _timm_mask_to_nn(attn_mask, B, self.num_heads, N,
                                                                           self.method)
        grid = resolve_token_grid(self, None)
        out, _ = attend_heads(self.method, self.method.state(self), q, k, v, key_padding_mask=kpm, attn_mask=mask,
                              is_causal=is_causal, dropout_p=self.attn_drop.p if self.training else 0.0,
                              token_grid=grid)
        out = apply_output_gate(self, add_local_term(self, out, v if v_local is None else v_local, kpm, mask,
                                                     is_causal, grid), q if q_gate is None else q_gate, inplace=True)
        out = self.norm(out.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            out = out * gate
        return self.proj_drop(call_linear(self.proj, out))
