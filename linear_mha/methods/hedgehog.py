"""mode='hedgehog': learnable feature maps per head (Hedgehog, ICLR 2024), phi(x) = [softmax(x W + b),
softmax(-(x W + b))], one map for the queries and one for the keys, W starting as the identity. Trained with the
model, or fitted to a pretrained model's softmax attention by ``linear_mha.calibrate``. O(N·m·d); causal in chunks.
With ``window=w`` (LoLCATs): exact softmax weights for the keys at most w positions away, the maps for the rest,
mixed under one normaliser by a learnable weight per head; O(N·(w + m)·d)."""
import torch
from torch import nn

from .. import functional, naive
from ..functional._common import mask_keys, normalise
from ..functional.hedgehog import hedgehog_state
from ..registry import Option, append_extra_keys, non_negative_int, one_of, optional, positive_int, register_method
from .kernel import CHUNK_OPTION, FeatureMapMethod


@register_method
class Hedgehog(FeatureMapMethod):
    name = "hedgehog"
    options = {
        "feature_dim": Option(None, optional(positive_int), "m: features per softmax (2m in all); default head_dim, "
                                                            "so W starts as the identity"),
        "init": Option("identity", one_of("identity", "favor"),
                       "W's start: identity (a fixed spiky map, m = d), or favor: q and k share W ~ N(0, d^-1/2), "
                       "Performer's positive random features, so the maps start as an estimate of softmax's weights"),
        "window": Option(0, non_negative_int, "softmax over the keys at most this many positions away (causal: "
                                              "before), the feature maps for the rest (LoLCATs); 0 = maps only"),
        "chunk_size": CHUNK_OPTION,
    }
    variants = {"m3": {"feature_dim": 3}, "window": {"window": 2}}
    cost = "O(N·m·d); O(N·(w + m)·d) with window=w"
    summary = "learnable per-head feature maps [softmax(xW), softmax(-xW)], fitted to softmax by calibrate()"

    def init_state(self, num_heads, head_dim, factory_kwargs):
        m = self.feature_dim or head_dim
        if self.init == "favor":
            # softmax(k W) = exp(k W) / sum_j exp(k w_j), and sum_j exp(k w_j) ~ m exp(|k|^2 / (2 sqrt(d))) for
            # Gaussian w_j: the key map is Performer's exp(k w - |k|^2 / (2 sqrt d)) up to a constant, the query's
            # normaliser cancels, so phi(q).phi(k) estimates exp(q.k / sqrt(d)) when q and k share the draw.
            start = torch.randn(num_heads, head_dim, m, **factory_kwargs) * head_dim ** -0.25
        else:
            start = torch.zeros(num_heads, head_dim, m, **factory_kwargs)
            start[:, torch.arange(min(head_dim, m)), torch.arange(min(head_dim, m))] = 1.0  # the identity map
        state = {}
        for side in ("q", "k"):
            state[f"hedgehog_{side}_weight"] = nn.Parameter(start.clone())
            state[f"hedgehog_{side}_bias"] = nn.Parameter(torch.zeros(num_heads, m, **factory_kwargs))
        if self.window:  # sigmoid(0) = 1/2: window and maps start on an equal footing
            state["hedgehog_window_logit"] = nn.Parameter(torch.zeros(num_heads, **factory_kwargs))
        return state

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None):
        q_map = (state["hedgehog_q_weight"], state["hedgehog_q_bias"])
        k_map = (state["hedgehog_k_weight"], state["hedgehog_k_bias"])
        initial_state = None
        if extra_keys is not None:
            if causal or self.window:  # extra keys have no position: far keys of every query
                initial_state = hedgehog_state(*extra_keys, k_map)
            else:
                k, v, key_padding_mask = append_extra_keys(k, v, key_padding_mask, extra_keys)
        window = (self.window, torch.sigmoid(state["hedgehog_window_logit"])) if self.window else None
        return functional.hedgehog(q, k, v, q_map, k_map, causal=causal, key_padding_mask=key_padding_mask,
                                   dropout_p=dropout_p, initial_state=initial_state, chunk_size=self.chunk_size,
                                   window=window)

    @property
    def self_attention_only(self):
        return self.window > 0  # the window pairs query i with the keys near position i

    @property
    def triton_map(self):
        return None if self.window else "hedgehog"  # the window's exact softmax runs in PyTorch ops

    # ------------------------------------------------------------------ decoding
    def _maps(self, state):
        return ((state["hedgehog_q_weight"], state["hedgehog_q_bias"]),
                (state["hedgehog_k_weight"], state["hedgehog_k_bias"]))

    def key_state(self, k, v, state, key_padding_mask=None):
        return hedgehog_state(k, v, self._maps(state)[1], key_padding_mask)

    def feature_pair(self, q, k, state, key_padding_mask=None):
        phi_k = self.features(mask_keys(k, key_padding_mask), state, "k")
        return self.features(q, state, "q"), mask_keys(phi_k, key_padding_mask)

    def prefill(self, q, k, v, state, cache, *, key_padding_mask=None):
        if not self.window:
            return super().prefill(q, k, v, state, cache, key_padding_mask=key_padding_mask)
        # After N positions the next one, t = N, finds the keys t - w - 1 .. t - 1 in the window buffer (its first
        # slot leaves the window at that step) and every earlier key in the far state.
        n, span = k.shape[2], self.window + 1
        split = max(0, n - span)
        far_mask = None if key_padding_mask is None else key_padding_mask[:, :split]
        cache["far"] = self.key_state(k[:, :, :split], v[:, :, :split], state, far_mask)
        valid = (torch.ones(k.shape[0], n, dtype=torch.bool, device=k.device) if key_padding_mask is None
                 else ~key_padding_mask)
        front = span - (n - split)  # empty slots before the first position, when N < w + 1
        pad = lambda x: torch.nn.functional.pad(x[:, :, split:], (0, 0, front, 0))  # noqa: E731
        cache.update(near_k=pad(k), near_v=pad(v), near_valid=torch.nn.functional.pad(valid[:, split:], (front, 0)))
        return self.attend(q, k, v, state, key_padding_mask=key_padding_mask, causal=True)

    def step(self, q, k, v, state, cache, *, padding=None):
        if not self.window:
            return super().step(q, k, v, state, cache, padding=padding)
        if not cache:  # nothing seen yet: an empty window and no far keys
            b, h, d = k.shape
            span = self.window + 1
            cache.update(far=self.key_state(k.new_zeros(b, h, 0, d),
                                            v.new_zeros(b, h, 0, v.shape[-1]), state),
                         near_k=k.new_zeros(b, h, span, d), near_v=v.new_zeros(b, h, span, v.shape[-1]),
                         near_valid=torch.zeros(b, span, dtype=torch.bool, device=k.device))
        leaving = cache["near_valid"][:, :1]  # the oldest slot leaves the window and joins the far keys
        cache["far"] = cache["far"] + self.key_state(cache["near_k"][:, :, :1], cache["near_v"][:, :, :1], state,
                                                     ~leaving)
        valid = torch.ones_like(leaving[:, 0]) if padding is None else ~padding
        cache["near_k"] = torch.cat([cache["near_k"][:, :, 1:], k[:, :, None]], dim=2)
        cache["near_v"] = torch.cat([cache["near_v"][:, :, 1:], v[:, :, None]], dim=2)
        cache["near_valid"] = torch.cat([cache["near_valid"][:, 1:], valid[:, None]], dim=1)
        scores = torch.einsum("bhd,bhwd->bhw", q, cache["near_k"]) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~cache["near_valid"][:, None, :], float("-inf"))
        top = scores.amax(-1, keepdim=True)
        near = torch.exp(scores - top.masked_fill(torch.isinf(top), 0.0))  # (B, H, w + 1), at most 1
        phi_q = self.features(q[:, :, None], state, "q")[:, :, 0]
        far = torch.einsum("bhf,bhfe->bhe", phi_q.to(cache["far"].dtype), cache["far"])
        mix = torch.sigmoid(state["hedgehog_window_logit"]).to(far.dtype)[None, :, None]
        num = mix * torch.einsum("bhw,bhwe->bhe", near.to(far.dtype), cache["near_v"].to(far.dtype)) + (1 - mix) * far[..., :-1]
        den = mix * near.sum(-1, keepdim=True).to(far.dtype) + (1 - mix) * far[..., -1:]
        return normalise(num, den).to(q.dtype)

    # ------------------------------------------------------------------ facts
    def features(self, x, state, side="q"):
        """[softmax(x W + b), softmax(-(x W + b))] over the m features, with the query's or the key's map."""
        z = torch.einsum("bhnd,hdm->bhnm", x, state[f"hedgehog_{side}_weight"].to(x.dtype))
        z = z + state[f"hedgehog_{side}_bias"].to(x.dtype)[None, :, None, :]
        return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)

    def similarity(self, q, k, state):
        return self.features(q, state, "q") @ self.features(k, state, "k").transpose(-1, -2)

    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        if not self.window:
            return super().reference_weights(q, k, state, key_padding_mask=key_padding_mask, causal=causal)
        # LoLCATs: mix * exp(s_ij - max near s_i) for keys at most `window` positions away, (1 - mix) phi_q phi_k^T
        # for the rest, normalised together.
        seen = naive.visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device)
        i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        near = seen & ((i - j).abs() <= self.window).to(q.device)
        s = naive.scaled_scores(q, k)
        top = s.masked_fill(~near, -1e300).amax(-1, keepdim=True)
        mix = torch.sigmoid(state["hedgehog_window_logit"]).to(q.dtype)[None, :, None, None]
        weights = torch.where(near, mix * torch.exp(s - top), (1 - mix) * self.similarity(q, k, state))
        return naive.normalised(weights, seen)

    def feature_count(self, head_dim):
        return 2 * (self.feature_dim or head_dim)

    def map_flops(self, batch_heads, tokens, head_dim):
        return 4.0 * batch_heads * tokens * head_dim * (self.feature_dim or head_dim)  # q and k times their W
