"""The ranks nn.MultiheadAttention accepts for its inputs and masks, checked in torch's order and with torch's
messages (code and tests written against torch match them), each followed by what to do about it.

A batched call takes query / key / value of 3 dimensions, key_padding_mask (N, S) and attn_mask (L, S) or
(N * num_heads, L, S); an unbatched call 2-D inputs, key_padding_mask (S,) and attn_mask (L, S) or (num_heads, L, S).
The sizes inside those ranks are checked later (``masks.check_*``), where the batch and lengths are known.
"""
from typing import Optional

from torch import Tensor

from .errors import InputError

_LAYOUT = ("query, key and value are all batched ((L, N, E), or (N, L, E) with batch_first=True) or all unbatched "
           "((L, E))")


def is_unbatched(query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                 attn_mask: Optional[Tensor], num_heads: int) -> bool:
    """Whether this is an unbatched call (2-D query); raises InputError (a ValueError and the AssertionError torch
    raises) for a rank torch refuses."""
    if query.dim() == 3:
        kind, rank, padding_rank = "batched (3-D)", 3, 2
    elif query.dim() == 2:
        kind, rank, padding_rank = "unbatched (2-D)", 2, 1
    else:
        shape = "" if query.is_nested else f" (shape {tuple(query.shape)})"  # a nested tensor has no one shape
        raise InputError(f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query "
                         f"tensor{shape}; {_LAYOUT}")
    if key.dim() != rank or value.dim() != rank:
        raise InputError(f"For {kind} `query`, expected `key` and `value` to be {rank}-D but found {key.dim()}-D and "
                         f"{value.dim()}-D tensors respectively; {_LAYOUT}")
    if key_padding_mask is not None and key_padding_mask.dim() != padding_rank:
        raise InputError(f"For {kind} `query`, expected `key_padding_mask` to be `None` or {padding_rank}-D but found "
                         f"{key_padding_mask.dim()}-D tensor instead; it holds one flag per key: "
                         f"{'(N, S)' if rank == 3 else '(S,)'}")
    if attn_mask is not None:
        if attn_mask.dim() not in (2, 3):
            raise InputError(f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
                             f"{attn_mask.dim()}-D tensor instead; it is (L, S), or per head "
                             f"{'(N * num_heads, L, S)' if rank == 3 else '(num_heads, L, S)'}; for one flag per key "
                             f"pass key_padding_mask")
        if rank == 2 and attn_mask.dim() == 3:
            expected = (num_heads, query.shape[0], key.shape[0])
            if tuple(attn_mask.shape) != expected:
                raise InputError(f"Expected `attn_mask` shape to be {expected} but got {tuple(attn_mask.shape)}: an "
                                 f"unbatched call takes one (L, S) mask per head")
    return rank == 2
