"""mode='kernel' (Katharopoulos et al., 2020; Performer's FAVOR+): phi(q) (phi(k)ᵀ v) / phi(q) sum phi(k), O(N·F·d),
with a chunked causal form whose memory is O(N·d). ``FeatureMapMethod`` is what every method of this family shares
(taylor, focused, hedgehog, a user's own map): a method of it only says what its feature map is."""
from typing import Optional

import torch

from .. import functional, naive
from ..functional.kernel import CHUNK_SIZE, check_chunk_size
from ..functional._common import compiling, drop_keys
from ..functional.elementwise_program import program_for
from ..functional.feature_maps import elementwise_feature_map
from ..functional.grid_rope import grid_rope_kernel
from ..functional.key_reweight import key_weights, unweight, weighted_values
from ..functional.triton_kernel import map_name
from ..registry import (AttentionMethod, Option, append_extra_keys, boolean, optional, positive_int,
                        register_method)

CHUNK_OPTION = Option(None, optional(lambda value, name: check_chunk_size(value)),
                      "chunk length of the causal product")


ROPE_OPTION = Option(False, boolean, "2-D rotary position of the token grid on the features, numerator only (MLLA); "
                                    "needs the grid, self-attention, non-causal")
KEY_REWEIGHT_OPTION = Option(False, boolean, "RALA's key reweighting: key j's weights times N softmax_j(mean q . k_j / "
                                           "sqrt(d)); self-attention, non-causal")


def feature_attention_flops(batch_heads: int, tokens: int, features: int, head_dim: int, causal: bool,
                            chunk_size: Optional[int] = None) -> float:
    """FLOPs of normalised kernel attention on features made already: non-causal, phi(K)ᵀ V, phi(Q) S and the
    normaliser phi(Q) sum phi(K), 2 N F (2 d + 1) per head; causal, the chunk states and the inter-chunk product with
    the ones column that yields the normaliser (Dv = d + 1) over N rounded up to whole chunks of C, plus the C x C
    products inside each chunk."""
    if not causal:
        return 2.0 * batch_heads * tokens * features * (2 * head_dim + 1)
    chunk = max(1, min(chunk_size or CHUNK_SIZE, tokens))
    padded = -(-tokens // chunk) * chunk
    width = head_dim + 1
    return 4.0 * batch_heads * padded * features * width + 2.0 * batch_heads * padded * chunk * (features + width)


class FeatureMapMethod(AttentionMethod):
    """Kernel attention with a feature map: the weight of key j for query i is phi(q_i)·phi(k_j) >= 0, normalised
    over the keys. A subclass gives its map as ``features(x, state)`` (any function of the last dimension that
    returns non-negative features), or overrides ``kernel_map(state)`` to name a map ``functional.kernel`` knows;
    attention, its causal form, extra keys, the naive reference and the FLOP count come from here."""

    options = {"chunk_size": CHUNK_OPTION, "key_reweight": KEY_REWEIGHT_OPTION, "rope": ROPE_OPTION}
    causal = True
    extra_keys = True

    def __init__(self, **options):
        super().__init__(**options)
        if getattr(self, "key_reweight", False) or getattr(self, "rope", False):  # no causal form
            self.causal = self.recurrent = False
        if getattr(self, "rope", False):
            self.needs_grid = True

    def features(self, x, state):
        """phi(x): (..., d) -> (..., F), non-negative."""
        raise NotImplementedError(f"method {self.name!r} defines neither features() nor kernel_map()")

    def kernel_map(self, state):
        """The map ``functional.kernel`` applies: a name it knows, or a callable x -> phi(x). A ``features`` made of
        elementwise steps (``elementwise_program``) is read once per method and runs inside the compiled kernels."""
        def phi(x):
            return self.features(x, state)
        phi.__name__ = self.name
        return program_for(self, phi)

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None,
               token_grid=None):
        return kernel_attend(q, k, v, self.kernel_map(state), key_padding_mask=key_padding_mask, causal=causal,
                             dropout_p=dropout_p, extra_keys=extra_keys, chunk_size=self.chunk_size,
                             key_reweight=getattr(self, "key_reweight", False),
                             token_grid=token_grid if getattr(self, "rope", False) else None)

    @property
    def self_attention_only(self):  # the mean query and the grid positions are the keys' own
        return getattr(self, "key_reweight", False) or self.needs_grid

    @property
    def triton_map(self):
        if getattr(self, "rope", False) and getattr(self, "key_reweight", False):
            return None  # rotary position with key weights runs in PyTorch ops (backend.rope_backend)
        return map_name(self.kernel_map({}))

    # ------------------------------------------------------------------ decoding: the (B, H, F, d_v + 1) sums
    recurrent = True

    def key_state(self, k, v, state, key_padding_mask=None):
        """sum_j phi(k_j) [v_j, 1]ᵀ over the unmasked keys: (B, H, F, d_v + 1)."""
        return functional.kernel_state(k, v, self.kernel_map(state), key_padding_mask=key_padding_mask,
                                       projection=state.get("favor_projection"))

    def feature_pair(self, q, k, state, key_padding_mask=None):
        """phi(q) (B, H, L, F), phi(k) (B, H, S, F) with masked keys' features zero, as the causal form makes them
        (FAVOR+'s key stabiliser does not depend on the data)."""
        return functional.apply_feature_map(self.kernel_map(state), q, k, key_padding_mask=key_padding_mask,
                                            causal=True, projection=state.get("favor_projection"))

    def step_features(self, q, k, state):
        """phi(q), phi(k) of one position each: (B, H, d) -> (B, H, F)."""
        phi_q, phi_k = self.feature_pair(q[:, :, None], k[:, :, None], state)  # (B, H, 1, d): maps act per head
        return phi_q[:, :, 0], phi_k[:, :, 0]

    def prefill(self, q, k, v, state, cache, *, key_padding_mask=None):
        cache["state"] = self.key_state(k, v, state, key_padding_mask)
        return self.attend(q, k, v, state, key_padding_mask=key_padding_mask, causal=True)

    def step(self, q, k, v, state, cache, *, padding=None):
        previous = cache.get("state")
        fn = self.kernel_map(state)
        padded = padding is not None and (compiling() or bool(padding.any()))  # a graph takes the masked path
        if isinstance(fn, str) and not padded:  # a map kernel_step knows: the compiled step where it can run
            owned = previous is not None and not (torch.is_grad_enabled() and previous.requires_grad)
            out, cache["state"] = functional.kernel_step(q, k, v, previous, fn, inplace=owned,
                                                         projection=state.get("favor_projection"))
            return out
        phi_q, phi_k = self.step_features(q, k, state)
        if padded:  # a padded position's key joins no state, its own query's included
            phi_k = phi_k.masked_fill(padding[:, None, None], 0.0)
        num_den, cache["state"] = functional.causal_linear_step(phi_q, phi_k, functional.append_ones(v), previous)
        return functional.split_normalise(num_den)

    # ------------------------------------------------------------------ facts
    def similarity(self, q, k, state):
        """phi(q) phi(k)ᵀ (B, H, L, S), multiplied out (a subclass may give its closed form instead)."""
        fn = self.kernel_map(state)
        fn = fn if callable(fn) else elementwise_feature_map(fn)
        return fn(q) @ fn(k).transpose(-1, -2)

    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        seen = naive.visible(q.shape[-2], k.shape[-2], key_padding_mask, causal, q.device)
        if getattr(self, "rope", False):
            return self._rope_reference(q, k, state, seen, token_grid)
        return naive.normalised(self.similarity(q, k, state) * self._reference_key_weights(q, k, seen), seen)

    def _reference_key_weights(self, q, k, seen):
        """alpha_j, (B, H, 1, L): with key_reweight the softmax over the seen keys of the mean valid query's scores
        (self-attention, so the valid queries are the valid keys), else ones."""
        if not getattr(self, "key_reweight", False):
            return torch.ones_like(seen[..., :1, :], dtype=q.dtype)
        valid = seen[..., :1, :].transpose(-1, -2)  # (B, 1, L, 1)
        q_mean = (q * valid).sum(-2, keepdim=True) / valid.sum(-2, keepdim=True).clamp(min=1)
        return naive.softmax_weights(naive.scaled_scores(q_mean, k), seen[..., :1, :])

    def _rope_reference(self, q, k, state, seen, grid):
        """Explicit rotation matrices per position: (R_i phi(q_i)) . (R_j phi(k_j)) alpha_j / sum_j phi.phi alpha_j."""
        fn = self.kernel_map(state)
        fn = fn if callable(fn) else elementwise_feature_map(fn)
        phi_q, phi_k = fn(q), fn(k).masked_fill(~seen[..., :1, :].transpose(-1, -2), 0.0)
        weights = self._reference_key_weights(q, k, seen)
        numerator = naive.rotated_similarity(phi_q, phi_k, grid) * weights * seen
        normaliser = ((phi_q @ phi_k.transpose(-1, -2)) * weights * seen).sum(-1, keepdim=True)
        return numerator / torch.where(normaliser == 0, torch.ones_like(normaliser), normaliser)

    def feature_count(self, head_dim: int) -> int:
        """F, the features per query or key: read off the map applied to one vector."""
        fn = self.kernel_map({})
        fn = fn if callable(fn) else elementwise_feature_map(fn)
        return fn(torch.zeros(1, head_dim)).shape[-1]

    def map_flops(self, batch_heads: int, tokens: int, head_dim: int) -> float:
        """FLOPs of making the features of the queries and keys (elementwise maps: none counted)."""
        return 0.0

    def flops(self, batch_heads, tokens, head_dim, causal):
        reweight = getattr(self, "key_reweight", False)
        value_dim = head_dim + 1 if reweight and not getattr(self, "rope", False) else head_dim  # [alpha v, alpha]
        return (feature_attention_flops(batch_heads, tokens, self.feature_count(head_dim), value_dim, causal,
                                        getattr(self, "chunk_size", None))
                + self.map_flops(batch_heads, tokens, head_dim)
                + (2.0 * batch_heads * tokens * head_dim if reweight else 0.0))  # the mean query times the keys


def _feature_map(value, name):
    return "elu" if value is None else functional.resolve_feature_map(value)


@register_method
class Kernel(FeatureMapMethod):
    name = "kernel"
    options = {
        "feature_map": Option("elu", _feature_map, "'elu' (elu+1), 'relu', 'favor' (FAVOR+ random features), "
                                                   "'taylor', 'taylor2' or a callable psi(x) -> non-negative "
                                                   "features"),
        "num_features": Option(None, optional(positive_int), "FAVOR+'s random-feature count (default d log d)"),
        "redraw_interval": Option(None, optional(positive_int),
                                  "FAVOR+: redraw the features every that many training forwards"),
        "chunk_size": CHUNK_OPTION,
        "key_reweight": KEY_REWEIGHT_OPTION,
        "rope": ROPE_OPTION,
    }
    presets = {"elu": {"feature_map": "elu"}, "favor": {"feature_map": "favor"}}
    variants = {"relu": {"feature_map": "relu"}}
    cost = "O(N·F·d)"
    summary = "normalised phi(q) (phi(k)ᵀ v) with a feature map; causal in chunks, O(N·d) memory"

    @classmethod
    def check_options(cls, options):
        favor = options["feature_map"] == "favor"
        for key in ("num_features", "redraw_interval"):
            if options[key] is not None and not favor:
                raise ValueError(f"{key} only applies to feature_map='favor'")

    def describe(self):
        extras = "".join(f", {key}=True" for key in ("key_reweight", "rope") if getattr(self, key, False))
        return f"mode='kernel', feature_map={getattr(self.feature_map, '__name__', self.feature_map)!r}{extras}"

    def kernel_map(self, state):  # the option is the map itself
        return self.feature_map

    def init_state(self, num_heads, head_dim, factory_kwargs):
        self._forwards_since_redraw = 0
        if self.feature_map != "favor":
            return {}
        self.num_features = self.num_features or functional.default_num_favor_features(head_dim)
        projection = functional.orthogonal_random_features(self.num_features, head_dim,
                                                           device=factory_kwargs["device"])
        dtype = factory_kwargs.get("dtype")  # drawn the same way whatever the dtype, then stored in the module's
        return {"favor_projection": projection if dtype is None else projection.to(dtype)}

    def before_forward(self, module):
        if module.training and self.redraw_interval is not None:
            self._forwards_since_redraw += 1
            if self._forwards_since_redraw >= self.redraw_interval:
                self.redraw(module)

    @torch.no_grad()
    def redraw(self, module, generator: Optional[torch.Generator] = None):
        """Draw a new FAVOR+ random projection."""
        if self.feature_map != "favor":
            super().redraw(module, generator)
        projection = module.favor_projection
        projection.copy_(functional.orthogonal_random_features(
            self.num_features, projection.shape[-1], generator=generator, device=projection.device))
        self._forwards_since_redraw = 0

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0, extra_keys=None,
               token_grid=None):
        return kernel_attend(q, k, v, self.kernel_map(state), key_padding_mask=key_padding_mask, causal=causal,
                             dropout_p=dropout_p, extra_keys=extra_keys, projection=state.get("favor_projection"),
                             chunk_size=self.chunk_size, key_reweight=self.key_reweight,
                             token_grid=token_grid if self.rope else None)

    # ------------------------------------------------------------------ facts
    def similarity(self, q, k, state):
        if self.kernel_map(state) != "favor":
            return super().similarity(q, k, state)
        # Performer's positive random features exp(w.x~ - |x~|^2 / 2), x~ = x d^(-1/4): their stabilisers are
        # constants per query row and per (batch, head) of keys, which the normalisation cancels.
        w = state["favor_projection"].to(q.dtype)

        def phi(x):
            x = x * x.shape[-1] ** -0.25
            return torch.exp(x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True))
        return phi(q) @ phi(k).transpose(-1, -2)

    def feature_count(self, head_dim):
        if self.kernel_map({}) == "favor":
            return self.num_features or functional.default_num_favor_features(head_dim)
        return super().feature_count(head_dim)

    def map_flops(self, batch_heads, tokens, head_dim):
        if self.kernel_map({}) != "favor":
            return 0.0
        return 4.0 * batch_heads * tokens * head_dim * self.feature_count(head_dim)  # q and k times the projection


def kernel_attend(q, k, v, feature_map, *, key_padding_mask, causal, dropout_p, extra_keys, projection=None,
                  chunk_size=None, key_reweight=False, token_grid=None):
    """functional.kernel with extra keys: appended when non-causal; the state every query starts from when causal.
    ``key_reweight``: RALA's weights on the keys (``functional.key_reweight``), through the values. ``token_grid``
    (given only by methods with ``rope``): the 2-D rotary position of ``functional.grid_rope``."""
    if token_grid is not None:
        if extra_keys is not None:
            raise ValueError("rope places every key on the token grid; the extra keys of add_bias_kv / add_zero_attn "
                             "have no place there: build the module without them or without rope")
        alpha = key_weights(q, k, key_padding_mask, key_padding_mask) if key_reweight else None
        return grid_rope_kernel(q, k, v, feature_map, (token_grid.height, token_grid.width, token_grid.prefix),
                                key_padding_mask=key_padding_mask, key_weights=alpha, dropout_p=dropout_p,
                                projection=projection)
    if key_reweight:
        if causal:
            raise ValueError("key_reweight weighs keys by the mean query of the whole sequence, which a causal query "
                             "has not seen: it has no causal form; build the module without it")
        queries_padding = key_padding_mask
        if extra_keys is not None:
            k, v, key_padding_mask = append_extra_keys(k, v, key_padding_mask, extra_keys)
        alpha = key_weights(q, k, key_padding_mask, queries_padding)
        out = functional.kernel(q, k, weighted_values(drop_keys(v, dropout_p), alpha), feature_map,
                                key_padding_mask=key_padding_mask, projection=projection, chunk_size=chunk_size)
        return unweight(out)
    initial_state = None
    if extra_keys is not None:
        if causal:
            initial_state = functional.kernel_state(*extra_keys, feature_map, projection=projection)
        else:
            k, v, key_padding_mask = append_extra_keys(k, v, key_padding_mask, extra_keys)
    return functional.kernel(q, k, v, feature_map, causal=causal, key_padding_mask=key_padding_mask,
                             dropout_p=dropout_p, projection=projection, initial_state=initial_state,
                             chunk_size=chunk_size)
