"""Linformer (Wang et al., 2020): keys and values are projected along the sequence to a fixed length k by
E, F (k x seq_len), then exact softmax attention runs over the k projected positions: O(N k).

Sequences shorter than seq_len use the first S columns of E and F. Masked keys are zeroed before the
projection, so they add nothing to it, and padding a sequence with masked garbage changes nothing.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import check_qkv, compiling, mask_keys
from .softmax import softmax


def linformer(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e_proj: Tensor,
    f_proj: Optional[Tensor] = None,
    *,
    key_padding_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    scale: Optional[float] = None,
    extra_k: Optional[Tensor] = None,
    extra_v: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); e_proj, f_proj: (k, seq_len) shared by the heads or
    (H, k, seq_len) one per head; f_proj defaults to e_proj (shared key/value projection).
    extra_k (B, H, n, D), extra_v (B, H, n, Dv): keys every query sees as they are, appended after the
    projection (nn.MultiheadAttention's add_bias_kv / add_zero_attn), so they neither count towards seq_len nor
    depend on S or on padding.
    Returns out (B, H, L, Dv) and, if need_weights, the weights over the k projected keys, then the extra keys
    (B, H, L, k + n). Raises ValueError if S > seq_len.
    """
    check_qkv(q, k, v, key_padding_mask)
    for name, proj in (("e_proj", e_proj), ("f_proj", f_proj)):
        if proj is not None and proj.dim() not in (2, 3):
            raise ValueError(f"{name} must be (k, seq_len) shared by the heads or (H, k, seq_len), got a "
                             f"{proj.dim()}-D tensor of shape {tuple(proj.shape)}")
    f_proj = e_proj if f_proj is None else f_proj
    S, seq_len = k.shape[-2], e_proj.shape[-1]
    if S > seq_len:
        raise ValueError(
            f"Linformer got a key sequence of length S={S} but its projections cover seq_len={seq_len}; "
            f"build the module with seq_len >= {S}"
        )
    if f_proj.shape[-1] != seq_len:
        raise ValueError(f"e_proj covers seq_len={seq_len} but f_proj covers {f_proj.shape[-1]}")
    for name, proj in (("e_proj", e_proj), ("f_proj", f_proj)):
        if proj.dim() == 3 and proj.shape[0] != q.shape[1]:
            raise ValueError(f"{name} has {proj.shape[0]} per-head projections but there are {q.shape[1]} heads")
    k, v = mask_keys(k, key_padding_mask), mask_keys(v, key_padding_mask)
    if compiling():
        # In a graph S may be symbolic: E[:, :S] is a view whose layout changes at S == seq_len, a branch export
        # would fix to one side. Zero keys appended up to seq_len project to the same sums with E and F whole.
        k, v = (F.pad(t, (0, 0, 0, seq_len - S)) for t in (k, v))
        e, f = e_proj.to(k.dtype), f_proj.to(v.dtype)
    else:
        e, f = e_proj[..., :S].to(k.dtype), f_proj[..., :S].to(v.dtype)
    # (k, S) @ (B, H, S, D) and (H, k, S) @ (B, H, S, D) both broadcast to (B, H, k, D).
    k_proj = torch.matmul(e, k)
    v_proj = torch.matmul(f, v)
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v come together: pass both or neither")
    if extra_k is not None:
        k_proj = torch.cat([k_proj, extra_k.to(k_proj.dtype)], dim=2)
        v_proj = torch.cat([v_proj, extra_v.to(v_proj.dtype)], dim=2)
    return softmax(q, k_proj, v_proj, dropout_p=dropout_p, need_weights=need_weights, scale=scale)
