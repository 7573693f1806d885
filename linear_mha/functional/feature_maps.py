"""Feature maps phi for kernel attention: sim(q, k) = phi(q) . phi(k) >= 0.

A feature map is named by a string ("elu", "relu", "favor", "taylor", "taylor2") or given as any callable psi(x) -> features
that is applied to queries and keys alike (it must return non-negative features, or the normaliser can vanish).
``apply_feature_map`` is the single entry point: it also masks padded keys BEFORE the map (so garbage cannot reach
data-dependent stabilisers) and after it (so masked keys contribute exactly nothing).
"""
import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import mask_keys

FeatureMap = Union[str, Callable[[Tensor], Tensor]]
FEATURE_MAPS = ("elu", "relu", "favor", "taylor", "taylor2")


def elu_feature_map(x: Tensor) -> Tensor:
    """elu(x) + 1, as in "Transformers are RNNs" (Katharopoulos et al., 2020). Strictly positive."""
    if x.device.type == "cpu":
        # relu(x) + exp(min(x, 0)) is elu(x) + 1: torch's CPU elu (its expm1) takes several times exp's time.
        # min(x, 0) written x - relu(x) keeps the backward off where(), slow there too, and gives elu's slope 1 at 0
        # (+inf gives NaN, where elu gives inf: attention over an infinite query or key is NaN either way)
        positive = F.relu(x)
        return positive + torch.exp(x - positive)
    # In place on elu's fresh output (its backward saves the input, not the output): one pass less.
    return F.elu(x).add_(1.0)


def _elu_feature_map_(t: Tensor) -> Tensor:
    """elu_feature_map in place (no autograd)."""
    if t.device.type == "cpu":
        positive = F.relu(t)
        return t.sub_(positive).exp_().add_(positive)  # elu_feature_map's form, its values at +-inf included
    return F.elu(t, inplace=True).add_(1.0)


def relu_feature_map(x: Tensor) -> Tensor:
    """relu(x). Non-negative; a query whose features are all zero attends to nothing and returns 0."""
    return F.relu(x)


def taylor_feature_map(x: Tensor) -> Tensor:
    """[1, x/|x|]: phi(q).phi(k) = 1 + q'.k', the first-order Taylor expansion of exp(q'.k') on L2-normalised
    vectors. Since |q'.k'| <= 1 the similarity is >= 0. (..., D) -> (..., D + 1)."""
    return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], dim=-1)


def taylor2_feature_map(x: Tensor) -> Tensor:
    """[1, x', x'_i x'_j (i < j), x'_i^2 / sqrt(2)] with x' = x / D^(1/4): phi(q).phi(k) = 1 + s + s^2 / 2 for
    s = q.k / sqrt(D), the second-order Taylor expansion of softmax's exp(s) (Based, Arora et al. 2024). It equals
    ((s + 1)^2 + 1) / 2 >= 1/2, so every weight is positive however large s is, and it grows with s^2: attention
    can focus, unlike the first-order map on normalised vectors. Only the D (D + 1) / 2 distinct products of
    x' (x')^T are kept. (..., D) -> (..., 1 + D + D (D + 1) / 2)."""
    d = x.shape[-1]
    x = x * d ** -0.25
    i, j = torch.triu_indices(d, d, device=x.device)
    weight = torch.ones(i.shape, dtype=x.dtype, device=x.device).masked_fill(i == j, 0.5 ** 0.5)
    return torch.cat([torch.ones_like(x[..., :1]), x, x[..., i] * x[..., j] * weight], dim=-1)


def default_num_favor_features(head_dim: int) -> int:
    """Performer's choice, m = d log d (at least d)."""
    return max(head_dim, int(head_dim * math.log(max(head_dim, 2))))


def orthogonal_random_features(
    num_features: int,
    head_dim: int,
    *,
    generator: Optional[torch.Generator] = None,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Random projection (num_features, head_dim) for FAVOR+: stacked blocks of orthogonal rows, each row
    rescaled to the norm of a Gaussian vector so that rows are marginally N(0, I) (Choromanski et al., 2021)."""
    blocks = []
    for _ in range(math.ceil(num_features / head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # Householder QR fixes signs so that Q is not uniformly distributed (its columns lean away from the
        # axes); correcting by sign(diag(R)) makes Q Haar, which the unbiased estimator relies on.
        blocks.append((q * torch.sign(torch.diagonal(r))).T)
    rows = torch.cat(blocks, dim=0)[:num_features]
    norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (rows * norms).to(device=device, dtype=dtype)


def favor_feature_map(
    x: Tensor,
    projection: Tensor,
    *,
    is_query: bool,
    key_padding_mask: Optional[Tensor] = None,
    causal: bool = False,
) -> Tensor:
    """Positive random features: phi(x) = exp(w.x~ - |x~|^2/2 - c), x~ = x d^(-1/4), so phi(q).phi(k) estimates
    exp(q.k/sqrt(d)) up to a constant factor that cancels in the normalisation.

    x: (B, H, N, D); projection: (m, D) -> (B, H, N, m). Computed in at least float32.
    The stabiliser c keeps exp() in range and must be one constant for all keys of a (batch, head):
    - queries: the row maximum (each query's own constant cancels in its own normalisation);
    - keys, non-causal: the maximum over the valid keys of the (batch, head);
    - keys, causal: the data-independent bound max_i |w_i|^2 / 2 >= w.x - |x|^2/2, so that no key's value
      can change the outputs of earlier positions (a data-dependent max over all keys would leak the future).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dtype) * x.shape[-1] ** -0.25
    projection = projection.to(device=x.device, dtype=dtype)
    logits = torch.matmul(x, projection.T) - 0.5 * (x * x).sum(-1, keepdim=True)
    if logits.numel() == 0:  # no rows to take a maximum over, and nothing it could scale
        return logits.exp()
    if is_query:
        stabiliser = logits.amax(dim=-1, keepdim=True).detach()
    elif causal:
        stabiliser = 0.5 * (projection * projection).sum(-1).max().detach()
    else:
        valid = logits
        if key_padding_mask is not None:
            valid = logits.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))
        stabiliser = valid.amax(dim=(-2, -1), keepdim=True).detach()
        stabiliser = torch.where(torch.isfinite(stabiliser), stabiliser, torch.zeros_like(stabiliser))
    return torch.exp(logits - stabiliser)


def resolve_feature_map(feature_map: FeatureMap) -> FeatureMap:
    """Validate a feature-map argument early, with a message that lists the choices."""
    if callable(feature_map):
        return feature_map
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS} or a callable psi(x) -> features, got {feature_map!r}")
    return feature_map


def elementwise_feature_map(feature_map: FeatureMap) -> Callable[[Tensor], Tensor]:
    """The per-vector function of a map that treats queries and keys alike (all but "favor")."""
    feature_map = resolve_feature_map(feature_map)
    if feature_map == "favor":
        raise ValueError("feature_map='favor' treats queries and keys differently; use apply_feature_map")
    return {"elu": elu_feature_map, "relu": relu_feature_map, "taylor": taylor_feature_map,
            "taylor2": taylor2_feature_map}.get(feature_map, feature_map)


IN_PLACE_FEATURE_MAPS = {"elu": _elu_feature_map_, "relu": torch.relu_}
"""The elementwise maps applied in place, for buffers a fast path owns (no autograd)."""


def apply_feature_map(
    feature_map: FeatureMap,
    q: Tensor,
    k: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    causal: bool = False,
    projection: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """phi(q) (B, H, L, F), phi(k) (B, H, S, F) with masked keys' features exactly zero."""
    feature_map = resolve_feature_map(feature_map)
    k = mask_keys(k, key_padding_mask)
    if feature_map != "favor":
        fn = elementwise_feature_map(feature_map)
        return fn(q), mask_keys(fn(k), key_padding_mask)
    if projection is None:
        raise ValueError("feature_map='favor' needs projection=orthogonal_random_features(m, head_dim)")
    if projection.shape[-1] != q.shape[-1]:
        raise ValueError(f"favor projection has dim {projection.shape[-1]}, but the head dim is {q.shape[-1]}")
    phi_q = favor_feature_map(q, projection, is_query=True)
    phi_k = favor_feature_map(k, projection, is_query=False, key_padding_mask=key_padding_mask, causal=causal)
    return phi_q, mask_keys(phi_k, key_padding_mask)
