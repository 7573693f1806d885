"""The attention step every linear_mha module shares: (q, k, v) heads and nn.MultiheadAttention's masks in, the
method's output out. Masks are turned here, once, into what the method declares it honours (``registry``), and
anything it cannot honour exactly is refused before it runs."""
from typing import Mapping, Optional, Tuple

from torch import Tensor

from . import masks
from .registry import AttentionMethod, causal_methods


def attend_heads(method: AttentionMethod, state: Mapping[str, Optional[Tensor]], q: Tensor, k: Tensor, v: Tensor, *,
                 key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                 is_causal: bool = False, extra_keys: Optional[Tuple[Tensor, Tensor]] = None,
                 need_weights: bool = False, dropout_p: float = 0.0) -> Tuple[Tensor, Optional[Tensor]]:
    """q (B, H, L, d), k (B, H, S, d), v (B, H, S, d_v) -> (out (B, H, L, d_v), weights (B, H, L, S + n) or None).

    key_padding_mask (B, S) and attn_mask (L, S) or (B, H, L, S) as ``masks.check_*`` return them (bool, True =
    forbidden, or float, additive). extra_keys: (k, v) of n keys every query sees (add_bias_kv / add_zero_attn).
    Weights come back only from methods that form them, and only when asked.
    """
    L, S = q.shape[2], k.shape[2]
    kwargs = {}
    if extra_keys is not None:
        if not method.extra_keys:
            raise ValueError(f"mode={method.name!r} does not handle the extra keys of add_bias_kv / add_zero_attn")
        kwargs["extra_keys"] = extra_keys
    if method.any_mask:
        n_extra = 0 if extra_keys is None else extra_keys[0].shape[2]
        kwargs["attn_bias"] = masks.additive_bias(key_padding_mask, attn_mask, is_causal, L, S, n_extra, q.dtype,
                                                  q.device)
    else:
        if key_padding_mask is not None:
            key_padding_mask = masks.to_forbidden(key_padding_mask, "key_padding_mask", method.name)
        causal = masks.classify_attn_mask_for_linear(attn_mask, is_causal, method.name, causal_methods())
        if causal and not method.causal:
            raise ValueError(f"mode={method.name!r} has no causal form (its keys are mixed across the sequence); "
                             f"causal attention is supported by modes {causal_methods()}")
        if causal and L != S:
            raise ValueError(f"causal attention needs as many queries as keys, got L={L}, S={S}")
        kwargs.update(key_padding_mask=key_padding_mask, causal=causal)
    if need_weights and method.returns_weights:
        return method.attend_with_weights(q, k, v, state, dropout_p=dropout_p, **kwargs)
    return method.attend(q, k, v, state, dropout_p=dropout_p, **kwargs), None


def drop_missing_state(method: AttentionMethod, prefix: str, state_dict, missing_keys: list) -> None:
    """After ``_load_from_state_dict``: a checkpoint of the original model (nn.MultiheadAttention, timm) has none of
    the method's own tensors, which then keep their initialisation instead of being reported missing."""
    owned = [prefix + name for name in method.state_names]
    if owned and not any(key in state_dict for key in owned):
        missing_keys[:] = [key for key in missing_keys if key not in owned]
