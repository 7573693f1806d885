"""The attention step every linear_mha module shares: mode options, the state a mode owns (Linformer's E/F,
FAVOR+'s projection), and (q, k, v) heads -> attention output through ``linear_mha.functional``.

``LinearMultiheadAttention`` (nn.MultiheadAttention's interface) and the timm adapter in ``patching`` both
derive from ``ModeAttention``, so the two approximate attention identically.
"""
import difflib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as LF
from . import masks as M

MODES = ("linformer", "kernel", "efficient", "taylor", "softmax")
PARAM_SHARING = ("none", "headwise", "kv", "layerwise")
CAUSAL_MODES = ("kernel", "taylor", "softmax")
OPTION_DEFAULTS = dict(mode="linformer", seq_len=100, proj_k=128, param_sharing="none", feature_map=None,
                       num_features=None, shared_projection=None, chunk_size=None, redraw_interval=None)
_OPTIONS = tuple(OPTION_DEFAULTS)


class ModeAttention(nn.Module):
    """Base class: subclasses set ``num_heads`` and ``head_dim``, call :meth:`_init_mode`, project their inputs to
    (B, H, N, head_dim) heads and call :meth:`_attend`."""

    @classmethod
    def validate_options(cls, options: dict) -> dict:
        """Keyword options completed with their defaults; unknown names and contradictions raise ValueError."""
        unknown = {k: v for k, v in options.items() if k not in OPTION_DEFAULTS}
        if unknown:
            raise ValueError(cls._unknown_options_message(unknown))
        opts = {**OPTION_DEFAULTS, **options}
        cls._check_options(opts["mode"], opts["seq_len"], opts["proj_k"], opts["param_sharing"], opts["feature_map"],
                           opts["num_features"], opts["shared_projection"], opts["redraw_interval"])
        return opts

    def _init_mode(self, options: dict, factory_kwargs: dict) -> None:
        """Validate keyword options and build the mode state."""
        opts = self.validate_options(options)
        self.mode = opts["mode"]
        self.seq_len, self.proj_k, self.param_sharing = opts["seq_len"], opts["proj_k"], opts["param_sharing"]
        self.feature_map = LF.resolve_feature_map(opts["feature_map"] or "elu") if self.mode == "kernel" else None
        self.chunk_size = opts["chunk_size"]
        self.redraw_interval = opts["redraw_interval"]
        self._forwards_since_redraw = 0
        self._extra_state_names = []
        self._build_mode_state(opts["shared_projection"], opts["num_features"], factory_kwargs)

    def _count_forward_for_redraw(self) -> None:
        if self.training and self.redraw_interval is not None:
            self._forwards_since_redraw += 1
            if self._forwards_since_redraw >= self.redraw_interval:
                self.redraw_features()

    def mode_repr(self) -> str:
        s = f"mode={self.mode!r}"
        if self.mode == "linformer":
            s += f", seq_len={self.seq_len}, proj_k={self.proj_k}, param_sharing={self.param_sharing!r}"
        if self.mode == "kernel":
            s += f", feature_map={getattr(self.feature_map, '__name__', self.feature_map)!r}"
        return s

    @staticmethod
    def _unknown_options_message(unknown) -> str:
        parts = []
        for name in unknown:
            close = difflib.get_close_matches(name, _OPTIONS, n=1)
            parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return f"unknown option(s) {', '.join(parts)}; LinearMultiheadAttention's options are {_OPTIONS}"

    @staticmethod
    def _check_options(mode, seq_len, proj_k, param_sharing, feature_map, num_features, shared_projection,
                       redraw_interval):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if param_sharing not in PARAM_SHARING:
            raise ValueError(f"param_sharing must be one of {PARAM_SHARING}, got {param_sharing!r}")
        if mode != "linformer" and param_sharing != "none":
            raise ValueError(f"param_sharing={param_sharing!r} only applies to mode='linformer' (mode={mode!r})")
        if mode == "linformer":
            for name, value in (("seq_len", seq_len), ("proj_k", proj_k)):
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be a positive int for mode='linformer', got {value!r}")
        if shared_projection is not None:
            if param_sharing != "layerwise":
                raise ValueError("shared_projection is only used with param_sharing='layerwise'")
            if not isinstance(shared_projection, nn.Parameter):
                raise TypeError(f"shared_projection must be an nn.Parameter (a plain tensor would be neither trained "
                                f"nor saved); got {type(shared_projection).__name__}, wrap it in nn.Parameter(...)")
            if tuple(shared_projection.shape) != (proj_k, seq_len):
                raise ValueError(f"shared_projection must have shape (proj_k, seq_len) = {(proj_k, seq_len)}, "
                                 f"got {tuple(shared_projection.shape)}")
        if feature_map is not None and mode != "kernel":
            raise ValueError(f"feature_map only applies to mode='kernel' (mode={mode!r}); "
                             f"use mode='taylor' for Taylor attention")
        is_favor = mode == "kernel" and feature_map == "favor"
        if num_features is not None and not is_favor:
            raise ValueError("num_features only applies to feature_map='favor'")
        if redraw_interval is not None and not is_favor:
            raise ValueError("redraw_interval only applies to feature_map='favor'")
        if num_features is not None and (not isinstance(num_features, int) or num_features < 1):
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if redraw_interval is not None and (not isinstance(redraw_interval, int) or redraw_interval < 1):
            raise ValueError(f"redraw_interval must be a positive int or None, got {redraw_interval!r}")

    def _new_projection(self, shape, factory_kwargs) -> nn.Parameter:
        # Linformer: E ~ N(0, 1/k), so a projected key has the scale of a key summed over seq_len/k positions.
        return nn.Parameter(torch.randn(shape, **factory_kwargs) / math.sqrt(self.proj_k))

    def _build_mode_state(self, shared_projection, num_features, factory_kwargs):
        if self.mode == "linformer":
            shape = (self.proj_k, self.seq_len)
            if self.param_sharing == "none":
                self.e_proj = self._new_projection((self.num_heads,) + shape, factory_kwargs)
                self.f_proj = self._new_projection((self.num_heads,) + shape, factory_kwargs)
                self._extra_state_names = ["e_proj", "f_proj"]
            elif self.param_sharing == "headwise":
                self.e_proj = self._new_projection(shape, factory_kwargs)
                self.f_proj = self._new_projection(shape, factory_kwargs)
                self._extra_state_names = ["e_proj", "f_proj"]
            else:  # "kv" and "layerwise": E = F
                self.e_proj = shared_projection if shared_projection is not None else self._new_projection(
                    shape, factory_kwargs)
                self.register_parameter("f_proj", None)
                self._extra_state_names = ["e_proj"]
        elif self.feature_map == "favor":
            self.num_features = num_features or LF.default_num_favor_features(self.head_dim)
            self.register_buffer("favor_projection", LF.orthogonal_random_features(
                self.num_features, self.head_dim, device=factory_kwargs["device"]))
            self._extra_state_names = ["favor_projection"]

    @torch.no_grad()
    def redraw_features(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new FAVOR+ random projection (kernel mode with feature_map='favor')."""
        if self.feature_map != "favor":
            raise RuntimeError("redraw_features() applies only to mode='kernel' with feature_map='favor'")
        self.favor_projection.copy_(LF.orthogonal_random_features(
            self.num_features, self.head_dim, generator=generator, device=self.favor_projection.device))
        self._forwards_since_redraw = 0

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        extra = [prefix + name for name in self._extra_state_names]
        if extra and not any(key in state_dict for key in extra):
            # A checkpoint of the original model (nn.MultiheadAttention, timm): the extra tensors keep
            # their initialisation.
            missing_keys[:] = [key for key in missing_keys if key not in extra]

    def _attend(self, q, k, v, kpm, mask, is_causal, n_extra, need_weights, dropout_p):
        """q (B, H, L, d), k/v (B, H, S + n_extra, .): the last n_extra keys are visible to every query."""
        L, S = q.shape[2], k.shape[2] - n_extra
        if self.mode == "softmax":
            return self._attend_softmax(q, k, v, kpm, mask, is_causal, n_extra, need_weights, dropout_p)
        if kpm is not None:
            kpm = M.to_forbidden(kpm, "key_padding_mask", self.mode)
            kpm = F.pad(kpm, (0, n_extra), value=False)
        causal = M.classify_attn_mask_for_linear(mask, is_causal, self.mode)
        if causal and self.mode not in CAUSAL_MODES:
            raise ValueError(f"mode={self.mode!r} has no causal form (its keys are mixed across the sequence); "
                             f"causal attention is supported by modes {CAUSAL_MODES}")
        if causal and L != S:
            raise ValueError(f"causal attention needs as many queries as keys, got L={L}, S={S}")
        if self.mode == "linformer":
            if S > self.seq_len:
                raise ValueError(f"sequence length S={S} exceeds seq_len={self.seq_len} of this Linformer attention; "
                                 f"build it (or patch the model) with seq_len >= {S}")
            # Extra keys (add_bias_kv / add_zero_attn) join after the projection: projected with the sequence,
            # their column of E / F would move with S and with the amount of padding.
            extras = dict(extra_k=k[:, :, S:], extra_v=v[:, :, S:]) if n_extra else {}
            out, _ = LF.linformer(q, k[:, :, :S], v[:, :, :S], self.e_proj, self.f_proj,
                                  key_padding_mask=None if kpm is None else kpm[:, :S], dropout_p=dropout_p, **extras)
            return out, None
        if self.mode == "efficient":
            return LF.efficient(q, k, v, key_padding_mask=kpm, dropout_p=dropout_p), None
        fmap = "taylor" if self.mode == "taylor" else self.feature_map
        projection = self.favor_projection if fmap == "favor" else None
        initial_state = None
        if causal and n_extra:
            # Extra keys are visible to every query: their state seeds the causal scan.
            initial_state = LF.kernel_state(k[:, :, S:], v[:, :, S:], fmap, projection=projection)
            k, v, kpm = k[:, :, :S], v[:, :, :S], (kpm[:, :S] if kpm is not None else None)
        out = LF.kernel(q, k, v, fmap, causal=causal, key_padding_mask=kpm, dropout_p=dropout_p,
                        projection=projection, initial_state=initial_state, chunk_size=self.chunk_size)
        return out, None

    def _attend_softmax(self, q, k, v, kpm, mask, is_causal, n_extra, need_weights, dropout_p):
        L, S = q.shape[2], k.shape[2] - n_extra
        bias = None
        if kpm is not None:
            bias = F.pad(M.to_additive(kpm, q.dtype), (0, n_extra))[:, None, None, :]
        if mask is None and is_causal:
            mask = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
        if mask is not None:
            mask = F.pad(M.to_additive(mask, q.dtype), (0, n_extra))
            mask = mask[None, None] if mask.dim() == 2 else mask
            bias = mask if bias is None else bias + mask
        return LF.softmax(q, k, v, attn_bias=bias, dropout_p=dropout_p, need_weights=need_weights)
