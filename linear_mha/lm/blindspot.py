"""``blindspot_size``: causal global heads in which a query does not see its own bucket of positions.

With b > 1 the positions are grouped in buckets of b and a query sees only the keys of earlier buckets (none of its
own bucket); queries with no visible key (the first bucket) output 0. b = 1 is ordinary causal attention, which the
layer runs through its method directly. The original grew its state per bucket; here every bucket is computed in one
causal product over 2N positions, each bucket's queries interleaved before its keys, so memory stays linear in N.
Any feature-map method of the registry (``FeatureMapMethod``: the default ``feature_softmax``, taylor, hedgehog,
...) gives the features.

The original linear-attention transformer's causal heads used phi_q = softmax(q over features), phi_k = exp(k);
the default here is softmax over the features for both: softmax(k) is exp(k) re-weighted per key by 1 / sum(exp(k)),
and exp(k) overflows float32 once a key logit passes ~88 and makes the weights depend on the raw scale of k.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import append_ones, causal_linear_product, causal_linear_state, drop_keys, split_normalise


def bucket_attention(method, state, q: Tensor, k: Tensor, v: Tensor, padding: Optional[Tensor], bucket: int,
                     dropout_p: float = 0.0) -> Tensor:
    """q, k (B, H, N, D), v (B, H, N, Dv) -> (B, H, N, Dv); padding (B, N) True = padding; dropout_p: key dropout."""
    phi_q, phi_k = method.feature_pair(q, k, state, key_padding_mask=padding)
    v1 = append_ones(drop_keys(v, dropout_p))
    bsz, h, n, _ = phi_q.shape
    n_buckets = -(-n // bucket)
    pad = n_buckets * bucket - n
    # Zero-padded tail positions have phi_k = 0 and cannot change any earlier output.
    phi_q, phi_k, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v1))

    def buckets(t: Tensor) -> Tensor:
        return t.reshape(bsz, h, n_buckets, 1, bucket, t.shape[-1])

    def interleave(first: Tensor, second: Tensor) -> Tensor:  # -> (B, H, 2 * N_pad, D)
        return torch.cat([first, second], dim=3).reshape(bsz, h, 2 * n_buckets * bucket, first.shape[-1])

    zq, zv = torch.zeros_like(buckets(phi_q)), torch.zeros_like(buckets(v1))
    num_den = causal_linear_product(
        interleave(buckets(phi_q), zq), interleave(zq, buckets(phi_k)), interleave(zv, buckets(v1))
    )
    num_den = num_den.reshape(bsz, h, n_buckets, 2, bucket, -1)[:, :, :, 0].reshape(bsz, h, n_buckets * bucket, -1)
    return split_normalise(num_den[:, :, :n])


def bucket_step(method, state, q: Tensor, k: Tensor, v: Tensor, cache: dict, t: int, padding_t: Optional[Tensor],
                bucket: int) -> Tensor:
    """Position t of ``bucket_attention``: q, k (B, H, D), v (B, H, Dv) -> (B, H, Dv). The cache holds the sums of the
    completed buckets and of the current one, (B, H, F, Dv + 1) each, whatever t is."""
    phi_q, phi_k = method.step_features(q, k, state)
    if padding_t is not None:
        phi_k = phi_k.masked_fill(padding_t[:, None, None], 0.0)
    update = phi_k[..., :, None] * append_ones(v)[..., None, :]
    done = cache.get("done", torch.zeros_like(update))
    out = torch.matmul(phi_q[..., None, :], done)[..., 0, :]
    current = cache.get("current", torch.zeros_like(update)) + update
    if (t + 1) % bucket == 0:
        done, current = done + current, torch.zeros_like(current)
    cache["done"], cache["current"] = done, current
    return split_normalise(out)


def bucket_prefill(method, state, q: Tensor, k: Tensor, v: Tensor, cache: dict, padding: Optional[Tensor],
                   bucket: int) -> Tensor:
    """``bucket_attention`` over positions 0..N-1 that also fills ``cache`` with the sums ``bucket_step`` holds after
    them: one matrix product per sum instead of N steps."""
    _, phi_k = method.feature_pair(q, k, state, key_padding_mask=padding)
    v1 = append_ones(v)
    closed = (k.shape[2] // bucket) * bucket  # completed buckets: "done"; the partly filled last one: "current"
    cache["done"] = causal_linear_state(phi_k[:, :, :closed], v1[:, :, :closed])
    cache["current"] = causal_linear_state(phi_k[:, :, closed:], v1[:, :, closed:])
    return bucket_attention(method, state, q, k, v, padding, bucket)
