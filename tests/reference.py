"""Float64 references for the functional tests: explicit L x S weight matrices. Each method's own naive form lives
with the method (``AttentionMethod.reference_weights``); these are those forms called the way the functional API is
(feature maps and projections as arguments), and the building blocks the tests share."""
import torch
import torch.nn.functional as F

import linear_mha
from linear_mha.naive import normalised, visible  # noqa: F401  (shared by the tests)


def _weights(mode, q, k, key_padding_mask=None, causal=False, state=None, **options):
    method = linear_mha.method_class(mode)(**options)
    return method.reference_weights(q, k, state or {}, key_padding_mask=key_padding_mask, causal=causal)


def kernel_weights(phi, q, k, key_padding_mask=None, causal=False):
    return _weights("kernel", q, k, key_padding_mask, causal, feature_map=phi)


def elu1(x):
    return F.elu(x) + 1


def focused_features(x, p, scale=None):
    """FLatten's focused map as the paper writes it: (|y| / |y**p|) y**p with y = (relu(x) + 1e-6) / scale."""
    y = torch.relu(x) + 1e-6
    if scale is not None:
        y = y / scale
    return y.norm(dim=-1, keepdim=True) / (y ** p).norm(dim=-1, keepdim=True) * y ** p


def hedgehog_features(x, weight, bias):
    """[softmax(x W + b), softmax(-(x W + b))] over the features, per head: x (B, H, N, d), W (H, d, m), b (H, m)."""
    z = torch.einsum("bhnd,hdm->bhnm", x, weight) + bias[None, :, None, :]
    return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


def two_map_weights(phi_q, phi_k, key_padding_mask=None, causal=False):
    """Normalised phi_q phi_k^T for feature maps of their own (B, H, L, F), (B, H, S, F)."""
    seen = visible(phi_q.shape[-2], phi_k.shape[-2], key_padding_mask, causal, phi_q.device)
    return normalised(phi_q @ phi_k.transpose(-1, -2), seen)


def taylor_weights(q, k, key_padding_mask=None, causal=False):
    return _weights("taylor", q, k, key_padding_mask, causal)


def taylor2_weights(q, k, key_padding_mask=None, causal=False):
    return _weights("taylor2", q, k, key_padding_mask, causal)


def softmax_weights(q, k, key_padding_mask=None, causal=False):
    return _weights("softmax", q, k, key_padding_mask, causal)


def efficient_weights(q, k, key_padding_mask=None):
    return _weights("efficient", q, k, key_padding_mask)


def linformer_weights(q, k, e, f, key_padding_mask=None):
    """Implied (L, S) matrix of Linformer: softmax(q (E k)^T / sqrt d) F, masked keys' columns zero."""
    return _weights("linformer", q, k, key_padding_mask, state={"e_proj": e, "f_proj": f})


def relative_error(got, ref):
    """||got - ref|| / ||ref||, with ``got`` brought to ``ref``'s device and dtype (e.g. float32 CUDA against a
    float64 CPU reference)."""
    return ((got.to(ref.device, ref.dtype) - ref).norm() / ref.norm()).item()
