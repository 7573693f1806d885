"""Global linear-attention heads of the linear-attention transformer.

Non-causal: Efficient Attention (softmax of q over features, of k over the sequence), as in the original.

Causal: the original used phi_q = softmax(q over features), phi_k = exp(k) and a cumulative sum that kept a
d x d state per position (O(N d^2) memory). Here phi_q = phi_k = softmax over the feature dimension, and the
product runs through the core's chunked causal kernel (memory linear in N). softmax(k) equals exp(k) re-weighted
per key by 1 / sum(exp(k)); we use it because exp(k) overflows float32 once a key logit passes ~88 and makes the
weights depend on the raw scale of k, while softmax is positive and bounded.

``blindspot_size`` keeps its documented meaning: with b > 1 the positions are grouped in buckets of b and a query
sees only the keys of earlier buckets (none of its own bucket); b = 1 is ordinary causal attention. The original
grew its state per bucket (memory falling as b grew); here memory is linear in N for every b, computed by
interleaving each bucket's queries before its keys in one causal product (2N positions): the blind spot now costs
nothing and saves nothing. Queries with no visible key (the first bucket) output 0.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import (append_ones, causal_linear_product, causal_linear_state, causal_linear_step, drop_keys,
                          efficient_attention, split_normalise)


def _features(x: Tensor) -> Tensor:
    return torch.softmax(x, dim=-1)


def global_attention(
    q: Tensor, k: Tensor, v: Tensor, padding: Optional[Tensor] = None, dropout_p: float = 0.0
) -> Tensor:
    """Non-causal: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); padding (B, S) True = padding.
    dropout_p: key dropout (the linear heads have no weight matrix to drop from)."""
    return efficient_attention(q, k, v, key_padding_mask=padding, dropout_p=dropout_p)


def causal_global_attention(
    q: Tensor, k: Tensor, v: Tensor, padding: Optional[Tensor] = None, blindspot_size: int = 1,
    dropout_p: float = 0.0,
) -> Tensor:
    """q, k (B, H, N, D), v (B, H, N, Dv) -> (B, H, N, Dv); padding (B, N) True = padding; dropout_p: key
    dropout."""
    phi_q, phi_k = _features(q), _features(k)
    if padding is not None:
        phi_k = phi_k.masked_fill(padding[:, None, :, None], 0.0)
    v1 = append_ones(drop_keys(v, dropout_p))
    b = blindspot_size
    if b == 1:
        return split_normalise(causal_linear_product(phi_q, phi_k, v1))
    bsz, h, n, d = phi_q.shape
    n_buckets = -(-n // b)
    pad = n_buckets * b - n
    # Zero-padded tail positions have phi_k = 0 and cannot change any earlier output.
    phi_q, phi_k, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v1))

    def buckets(t: Tensor) -> Tensor:
        return t.reshape(bsz, h, n_buckets, 1, b, t.shape[-1])

    def interleave(first: Tensor, second: Tensor) -> Tensor:  # -> (B, H, 2 * N_pad, D)
        return torch.cat([first, second], dim=3).reshape(bsz, h, 2 * n_buckets * b, first.shape[-1])

    zq, zv = torch.zeros_like(buckets(phi_q)), torch.zeros_like(buckets(v1))
    num_den = causal_linear_product(
        interleave(buckets(phi_q), zq), interleave(zq, buckets(phi_k)), interleave(zv, buckets(v1))
    )
    num_den = num_den.reshape(bsz, h, n_buckets, 2, b, -1)[:, :, :, 0].reshape(bsz, h, n_buckets * b, -1)
    return split_normalise(num_den[:, :, :n])


def causal_global_step(
    q: Tensor, k: Tensor, v: Tensor, cache: dict, t: int, padding_t: Optional[Tensor] = None,
    blindspot_size: int = 1,
) -> Tensor:
    """Recurrent form of ``causal_global_attention`` at position t: q, k (B, H, D), v (B, H, Dv) -> (B, H, Dv).
    The state is (B, H, D, Dv + 1) (numerator and normaliser) whatever t is."""
    phi_q, phi_k = _features(q), _features(k)
    if padding_t is not None:
        phi_k = phi_k.masked_fill(padding_t[:, None, None], 0.0)
    v1 = append_ones(v)
    if blindspot_size == 1:
        out, cache["state"] = causal_linear_step(phi_q, phi_k, v1, cache.get("state"))
        return split_normalise(out)
    update = phi_k[..., :, None] * v1[..., None, :]
    done = cache.get("done", torch.zeros_like(update))
    out = torch.matmul(phi_q[..., None, :], done)[..., 0, :]
    current = cache.get("current", torch.zeros_like(update)) + update
    if (t + 1) % blindspot_size == 0:
        done, current = done + current, torch.zeros_like(current)
    cache["done"], cache["current"] = done, current
    return split_normalise(out)


def causal_global_prefill(k: Tensor, v: Tensor, cache: dict, padding: Optional[Tensor] = None,
                          blindspot_size: int = 1) -> None:
    """Fill ``cache`` with the state ``causal_global_step`` holds after positions 0..N-1 of k (B, H, N, D),
    v (B, H, N, Dv): one matrix product per state instead of N steps."""
    phi_k = _features(k)
    if padding is not None:
        phi_k = phi_k.masked_fill(padding[:, None, :, None], 0.0)
    v1 = append_ones(v)
    if blindspot_size == 1:
        cache["state"] = causal_linear_state(phi_k, v1)
        return
    # Completed buckets are in "done"; the partly filled last bucket is in "current" (zeros when none).
    closed = (k.shape[2] // blindspot_size) * blindspot_size
    cache["done"] = causal_linear_state(phi_k[:, :, :closed], v1[:, :, :closed])
    cache["current"] = causal_linear_state(phi_k[:, :, closed:], v1[:, :, closed:])
