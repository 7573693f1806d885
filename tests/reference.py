"""Naive float64 references: explicit L x S weight matrices, written independently of linear_mha."""
import math

import torch
import torch.nn.functional as F


def _visible(L, S, key_padding_mask, causal, device):
    """bool (B or 1, 1, L, S): True where query i may see key j."""
    vis = torch.ones(1, 1, L, S, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        vis = vis & ~key_padding_mask[:, None, None, :]
    if causal:
        vis = vis & torch.ones(L, S, dtype=torch.bool, device=device).tril()
    return vis


def normalised(weights, vis):
    w = weights.masked_fill(~vis, 0.0)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, w / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(w))


def kernel_weights(phi, q, k, key_padding_mask=None, causal=False):
    w = phi(q) @ phi(k).transpose(-1, -2)
    return normalised(w, _visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device))


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
    w = phi_q @ phi_k.transpose(-1, -2)
    return normalised(w, _visible(phi_q.shape[-2], phi_k.shape[-2], key_padding_mask, causal, phi_q.device))


def taylor_weights(q, k, key_padding_mask=None, causal=False):
    w = 1 + F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    return normalised(w, _visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device))


def taylor2_weights(q, k, key_padding_mask=None, causal=False):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return normalised(1 + s + s * s / 2, _visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device))


def softmax_weights(q, k, key_padding_mask=None, causal=False):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    vis = _visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device)
    w = torch.exp(s - s.masked_fill(~vis, -1e300).amax(-1, keepdim=True))
    return normalised(w, vis)


def efficient_weights(q, k, key_padding_mask=None):
    qs = torch.softmax(q, dim=-1)
    logits = k if key_padding_mask is None else k.masked_fill(key_padding_mask[:, None, :, None], -1e300)
    ks = torch.softmax(logits, dim=-2)
    if key_padding_mask is not None:
        ks = ks.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return qs @ ks.transpose(-1, -2)


def linformer_weights(q, k, e, f, key_padding_mask=None):
    """Implied (L, S) matrix of Linformer: softmax(q (E k)^T / sqrt d) F, masked keys' columns zero."""
    S = k.shape[-2]
    e, f = e[..., :S], f[..., :S]
    if key_padding_mask is not None:
        keep = (~key_padding_mask)[:, None, None, :].to(q.dtype)  # (B, 1, 1, S)
        e, f = e * keep, f * keep
    kp = e @ k
    p = torch.softmax(q @ kp.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return p @ f


def relative_error(got, ref):
    """||got - ref|| / ||ref||, with ``got`` brought to ``ref``'s device and dtype (e.g. float32 CUDA against a
    float64 CPU reference)."""
    return ((got.to(ref.device, ref.dtype) - ref).norm() / ref.norm()).item()


def sliding_window_weights(q, k, phi_q, phi_k, window, mix, key_padding_mask=None, causal=False):
    """LoLCATs' hybrid: weight mix * exp(s_ij - max near s_i) for keys at most ``window`` positions away and
    (1 - mix) * phi_q phi_k^T for the rest, normalised together; mix (H,)."""
    L, S = q.shape[-2], k.shape[-2]
    vis = _visible(L, S, key_padding_mask, causal, q.device)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    near = vis & ((i - j).abs() <= window)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    top = s.masked_fill(~near, -1e300).amax(-1, keepdim=True)
    f = mix[None, :, None, None]
    w = torch.where(near, f * torch.exp(s - top), (1 - f) * (phi_q @ phi_k.transpose(-1, -2)))
    return normalised(w, vis)
