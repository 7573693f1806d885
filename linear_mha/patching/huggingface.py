"""Hugging Face transformers models, through transformers' own attention interface.

A transformers attention module keeps its projections (RoPE, grouped-query heads, the KV cache's update) and calls
one attention function looked up by name, ``config._attn_implementation``. ``patch`` registers linear_mha's function
and a mask function under the name ``"linear_mha"``, attaches to each selected attention module a
``LinearHFAttention`` (``module.linear_mha``: the method, its state, the local term), and points the configs of those
modules at the name; a module the selection left out runs its original implementation through the same name.
``unpatch`` takes the adapters out and gives every config its implementation back. So any model whose attention
uses the interface converts, including ones never tested here.

What reaches the method: q (B, H, L, d) with RoPE applied, k and v with as many heads (grouped-query heads are
repeated), the padding as a (B, S) mask (the mask function hands over the 2-D mask transformers made, never an
L x S one), causality from the mask's pattern or the module's ``is_causal``, and the query scaled by the model's
``scaling``. A feature the method cannot honour is refused, naming it: a sliding window, logit softcapping,
attention sinks, a position bias, a mask pattern other than causal or bidirectional. Decoding with linear_mha's
cache (``hf_generation.py``, which ``generate`` uses once patched) keeps each method's fixed-size state.
"""
import functools
import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters import ATTACHED, AttentionAdapter, UnknownLength, register_adapter
from ..attend import attend_heads, prefill_heads, step_heads
from ..functional._common import compiling
from ..local_term import add_local_term
from ..output_gate import apply_output_gate
from ..registry import DEFAULT_MODE, create_method
from ..token_grid import feature_map_grid, resolve_token_grid
from . import hf_generation

NAME = "linear_mha"
_SAVED = "_linear_mha_saved_implementation"  # on the modules a config runs: what it ran before patch
REFUSED = {"sliding_window": "a sliding attention window", "softcap": "logit softcapping", "s_aux": "attention sinks",
           "sinks": "attention sinks", "position_bias": "a position bias added to the scores"}


def _transformers_loaded() -> bool:
    """A transformers model implies transformers is imported; linear_mha never imports it for anything else."""
    return "transformers" in sys.modules


@functools.lru_cache(maxsize=None)
def uses_attention_interface(cls: type) -> bool:
    """Whether the forward of attention class ``cls`` calls transformers' attention-function interface."""
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def geometry(module: nn.Module):
    """(heads, head_dim) of a transformers attention module's queries, or (None, None) if it does not say."""
    head_dim = getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)
    heads = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
    if heads is None and isinstance(head_dim, int):
        for name in ("q_proj", "query", "q", "to_q", "wq"):
            width = getattr(getattr(module, name, None), "out_features", None)
            if isinstance(width, int) and width % head_dim == 0:
                heads = width // head_dim
                break
    ok = isinstance(heads, int) and isinstance(head_dim, int)
    return (heads, head_dim) if ok else (None, None)


# --------------------------------------------------------------------------------------------------------- masks
@dataclass
class HFMask:
    """What linear_mha's mask function gives the attention function: the padding of the keys of this call (B, S) bool,
    True = a real token (None: no padding), whether the model asked for a causal (True) or bidirectional (False)
    pattern (None: another one), where the first query sits among the keys (``query_offset``, an int or a 0-d
    tensor; None: the queries are the last keys), and, made on demand, the mask the original implementation would
    have had, for the attention modules patch left alone.

    ``ndim`` is 4 so that transformers takes it as a mask made already when generate hands it back to the model
    (generate makes the mask once per step for compilable caches such as StaticCache); the mask function then
    reads the 2-D mask it was made from (``linear_mha_mask``)."""
    padding: Optional[Tensor]
    causal: Optional[bool]
    pattern: str
    arguments: dict = field(repr=False)
    query_offset: Any = None
    window: Any = None  # (kv_offset, kv_length): the keys ``padding`` covers
    _original: dict = field(default_factory=dict, repr=False)
    ndim = 4

    def original(self, implementation: str):
        """The mask ``implementation``'s own mask function makes of the same arguments."""
        if implementation not in self._original:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
            build = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(implementation)
            arguments = dict(self.arguments)
            while isinstance(arguments.get("attention_mask"), HFMask):  # a mask generate made, handed back
                arguments["attention_mask"] = arguments["attention_mask"].arguments.get("attention_mask")
            self._original[implementation] = build(**arguments) if build is not None else None
        return self._original[implementation]


def linear_mha_mask(**arguments) -> HFMask:
    """transformers' mask function for the name: the 2-D padding of the keys of this call, not an L x S mask. It takes
    what transformers passes by keyword (the arguments changed across 5.x: q_length / cache_position) and keeps all
    of it for the original implementation's mask function."""
    from transformers import masking_utils
    causal = {masking_utils.causal_mask_function: True, masking_utils.bidirectional_mask_function: False}
    mask_function, attention_mask = arguments.get("mask_function"), arguments.get("attention_mask")
    pattern = getattr(mask_function, "__qualname__", str(mask_function))
    kv_offset, kv_length = arguments.get("kv_offset", 0), arguments["kv_length"]
    if isinstance(attention_mask, HFMask):  # made by generate for this step and handed back to the model
        handed = attention_mask
        if handed.window == (kv_offset, kv_length):  # its padding covers these keys: reused, and the 2-D mask it
            # was made from, which grows every step (a StaticCache's window does not), is not read, so that a
            # compiled forward does not guard on its size (the original's mask function reads it, if ever asked)
            return HFMask(handed.padding, causal.get(mask_function), pattern, arguments, _query_offset(arguments),
                          handed.window)
        attention_mask = handed.arguments.get("attention_mask")
        arguments = {**arguments, "attention_mask": attention_mask}
    padding = None
    if attention_mask is not None:
        kept = attention_mask.to(torch.bool)
        end = kv_offset + kv_length
        if kept.shape[-1] < end:  # the 2-D mask may stop at the last real token: what follows is not padding
            kept = F.pad(kept, (0, end - kept.shape[-1]), value=True)
        kept = kept[:, kv_offset:end]
        # "no padding" is a shortcut eager takes; a graph keeps the mask, exact for every batch (and for none)
        padding = kept if compiling() or not bool(kept.all()) else None
    return HFMask(padding, causal.get(mask_function), pattern, arguments, _query_offset(arguments),
                  (kv_offset, kv_length))


def _query_offset(arguments: dict):
    """Where the first query of this call sits among its keys: q_offset (transformers 5.2x) or the first cache position
    (earlier 5.x), less kv_offset; None where neither is given (the queries are then the last keys)."""
    offset = arguments.get("q_offset")
    if offset is None and isinstance(arguments.get("cache_position"), Tensor) and arguments["cache_position"].numel():
        offset = arguments["cache_position"][0]
    if offset is None:
        return None
    return offset - arguments.get("kv_offset", 0)


def _padding_and_causality(mask, queries: int, keys: int, causal: bool):
    """(padding (B, S) True = real token, or None; causal) from a mask a caller passed in its own form: 2-D padding,
    or transformers' 4-D bool (True = attend) or additive float mask; refused when it is neither padding nor a causal
    mask with padding."""
    if mask is None:
        return None, causal
    if mask.dim() == 2:
        return mask.to(torch.bool), causal
    if mask.dim() != 4:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)}: expected (B, S) padding or (B, 1, L, S)")
    forbidden = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min / 2
    if mask.dtype != torch.bool and bool(((mask != 0) & ~forbidden).any()):
        raise ValueError("attention_mask adds a bias to the scores; linear attention applies padding and causal masks "
                         "only (keep this module on softmax: exclude= it in patch)")
    forbidden = forbidden[:, 0]  # (B, L, S)
    padding = ~forbidden[:, -1]  # the last query sees every real key, causal or not
    future = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).triu(keys - queries + 1)
    real_rows = padding[:, keys - queries:, None]  # a padded query's own row is padding's
    for candidate in (causal, not causal):
        expected = ~padding[:, None, :] | (future if candidate else False)
        if bool(((forbidden == expected) | ~real_rows).all()):
            return (None if bool(padding.all()) else padding), candidate
    raise ValueError("attention_mask has a pattern other than causal or bidirectional attention with padding, which "
                     "linear attention cannot apply; keep this module on softmax (exclude= it in patch)")


# ------------------------------------------------------------------------------------------------ the adapter
@register_adapter
class LinearHFAttention(AttentionAdapter, nn.Module):
    """The method a transformers attention module runs once patched, attached to it as ``module.linear_mha``: the
    module keeps its projections and calls this through the attention interface. Options: ``mode`` and that method's
    options, and ``dwc_kernel``."""

    kind, attaches = "hf", True

    def __init__(self, attention: nn.Module, mode: str = DEFAULT_MODE, dwc_kernel=None, output_gate=False,
                 **options):
        method = create_method(mode, options)
        super().__init__()
        reason = self.unsupported_reason(attention)
        if reason:
            raise ValueError(f"cannot patch {type(attention).__name__}: {reason}")
        self.num_heads, self.head_dim = geometry(attention)
        weight = next(attention.parameters())
        self.init_method(method, self.num_heads, self.head_dim, {"device": weight.device, "dtype": weight.dtype},
                         dwc_kernel, output_gate)
        self.keep_original(attention)
        self.train(attention.training)

    @classmethod
    def matches(cls, module):
        return _transformers_loaded() and uses_attention_interface(type(module))

    @classmethod
    def unsupported_reason(cls, module):
        if geometry(module) == (None, None):
            return ("it names neither its number of heads nor its head size (num_heads / head_dim), which the "
                    "method's state needs")
        return None

    @classmethod
    def from_original(cls, attention, **options):
        return cls(attention, **options)

    def extra_repr(self) -> str:
        s = f"num_heads={self.num_heads}, head_dim={self.head_dim}, {self.method.describe()}"
        return s + self.extras_repr()

    # ------------------------------------------------------------------ attention
    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None, *, dropout: float = 0.0,
                scaling: Optional[float] = None, **kwargs) -> Tensor:
        """q (B, H, L, d), k, v (B, H_kv, S, d) as the module hands them to its attention function -> (B, L, H, d)."""
        module = self.original
        for name, what in REFUSED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{type(module).__name__} asks for {what} ({name}=...), which linear attention cannot "
                                 f"apply; keep these modules on softmax (patch(..., exclude=[...]))")
        default_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
        query_offset = None
        if isinstance(attention_mask, HFMask):
            if attention_mask.causal is None and self.computes_original():  # any pattern: as the original does
                return run_original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    **kwargs)[0]
            if attention_mask.causal is None:
                raise ValueError(f"the model builds an attention pattern other than causal or bidirectional "
                                 f"({attention_mask.pattern}), which linear attention cannot apply; keep these modules "
                                 f"on softmax (patch(..., exclude=[...]))")
            padding, causal, query_offset = attention_mask.padding, attention_mask.causal, attention_mask.query_offset
        else:
            padding, causal = _padding_and_causality(attention_mask, query.shape[2], key.shape[2], default_causal)
        layer = hf_generation.decoding_layer(key)  # before anything makes a new tensor of the marked keys
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
        if scaling is not None and abs(scaling * math.sqrt(query.shape[-1]) - 1.0) > 1e-12:
            query = query * (scaling * math.sqrt(query.shape[-1]))  # the methods' 1/sqrt(d) becomes the model's scale
        masked = None if padding is None else ~padding
        self.method.before_forward(self)
        if layer is not None:
            out = self._decode(layer, query, key, value, masked, causal)
        elif causal and query.shape[2] != key.shape[2]:
            out = self._attend_cached(query, key, value, masked, dropout, query_offset)
        else:
            out = self._attend(query, key, value, masked, causal, dropout)
        return out.transpose(1, 2).contiguous()

    def computes_original(self) -> bool:
        """Whether this adapter computes what the module's original implementation does (exact softmax, nothing
        added): where the method cannot take a mask's pattern (packed sequences), the original then runs."""
        return (self.method.computes_torch_attention and getattr(self, "dwc_weight", None) is None
                and getattr(self, "gate_weight", None) is None)

    def _attend(self, q, k, v, masked, causal, dropout):
        grid = resolve_token_grid(self, None)
        out, _ = attend_heads(self.method, self.method.state(self), q, k, v, key_padding_mask=masked, is_causal=causal,
                              dropout_p=dropout, token_grid=grid)
        return apply_output_gate(self, add_local_term(self, out, v, masked, None, causal, grid), q, inplace=True)

    def _attend_cached(self, q, k, v, masked, dropout, query_offset):
        """Causal attention of L queries over S > L keys that a transformers cache holds: query i sits at key position
        query_offset + i (the last L positions where the mask does not say: a DynamicCache), and sees the keys up to
        it; a StaticCache's empty slots lie after the last query, where no query looks."""
        L, S = q.shape[2], k.shape[2]
        offset = S - L if query_offset is None else query_offset
        positions = torch.arange(L, device=q.device) + (offset.to(q.device) if isinstance(offset, Tensor) else offset)
        if self.method.any_mask:  # every query's row of keys at once: an L x S mask
            future = torch.arange(S, device=q.device)[None, :] > positions[:, None]
            out, _ = attend_heads(self.method, self.method.state(self), q, k, v, key_padding_mask=masked,
                                  attn_mask=future, dropout_p=dropout)
            return apply_output_gate(self, out, q, inplace=True)
        # The queries at their positions among S (zeros elsewhere, whose rows are dropped): causal over the keys
        spread = q.new_zeros(*q.shape[:2], S, q.shape[-1]).index_copy(2, positions, q)
        return self._attend(spread, k, v, masked, True, dropout).index_select(2, positions)

    def _decode(self, layer, q, k, v, masked, causal):
        """Positions after those ``layer`` (linear_mha's cache layer) has seen: the method's own decoding."""
        if not causal:
            raise ValueError("linear_mha's cache decodes causal attention; this module is not causal")
        state = self.method.state(self)
        if not layer.cache:
            out = prefill_heads(self.method, state, q, k, v, layer.cache, key_padding_mask=masked)
        else:
            out = torch.stack([step_heads(self.method, state, q[:, :, t], k[:, :, t], v[:, :, t], layer.cache,
                                          padding=None if masked is None else masked[:, t])
                               for t in range(q.shape[2])], dim=2)
        layer.consumed()
        return apply_output_gate(self, out, q)

    # ------------------------------------------------------------------ calibrate
    def original_output(self, args, kwargs):
        """The original implementation's output on this call (the module's own attention), in this mode."""
        self.original.train(self.training)
        return run_original(self.original, *args, **kwargs)[0]

    def output_padding(self, query, key, value, attention_mask=None, **kwargs):
        """(B, L, 1, 1) True on padding's own rows in self-attention (no later layer reads them), or None."""
        padding = attention_mask.padding if isinstance(attention_mask, HFMask) else None
        if padding is None or query.shape[2] != key.shape[2]:
            return None
        return ~padding[:, :, None, None]

    # ------------------------------------------------------------------ what patch asks
    @classmethod
    def sequence_length(cls, owner):
        patches = getattr(getattr(owner, "embeddings", None), "patch_embeddings", None)
        if isinstance(getattr(patches, "num_patches", None), int):  # ViT, DeiT: the patches and the prefix tokens
            return patches.num_patches + _prefix_tokens(owner.embeddings)
        if isinstance(getattr(owner, "input_projection", None), nn.Conv2d):
            raise UnknownLength("a DETR-style model, whose token count follows the image size")
        limit = getattr(getattr(owner, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and type(owner).__module__.startswith("transformers."):
            return limit
        return None

    @classmethod
    def grid_source(cls, owner_name, owner, name):
        dot = f"{owner_name}." if owner_name else ""
        embeddings = getattr(owner, "embeddings", None)
        patches = getattr(embeddings, "patch_embeddings", None)
        size = getattr(patches, "patch_size", None)
        if size is not None:  # ViT, DeiT: the image the patch embedding takes
            stride = size[0] if isinstance(size, (tuple, list)) else size
            return f"{dot}embeddings.patch_embeddings", feature_map_grid(_prefix_tokens(embeddings), stride)
        if isinstance(getattr(owner, "input_projection", None), nn.Conv2d) and name.startswith(f"{dot}encoder."):
            return f"{dot}input_projection", feature_map_grid(0)  # DETR: the projected feature map
        return None

    @classmethod
    def prepare_model(cls, model, modules):
        _register()
        notes = []
        for config in {id(m.config): m.config for m in modules}.values():  # configs do not hash
            config.__dict__.pop(_SAVED, None)  # where releases before 0.2 kept it (saved into config.json with it)
            runs = [m for m in model.modules() if getattr(m, "config", None) is config and cls.matches(m)]
            if config._attn_implementation != NAME:
                saved = config._attn_implementation
                _set_implementation(config, NAME)
                notes.append(f"{type(config).__name__}: attention implementation {saved!r} -> {NAME!r} (modules "
                             f"left out of the selection run {saved!r})")
            else:  # patched before: what its modules remember
                saved = next((m.__dict__[_SAVED] for m in runs if _SAVED in m.__dict__), "sdpa")
            for module in runs:  # on the modules, not the config, which save_pretrained writes out
                module.__dict__[_SAVED] = saved
        causal = [m for m in model.modules() if cls.matches(m) and getattr(m, "is_causal", False)]
        # Every layer that caches keys runs a method with a state of its own (softmax keeps every key, as
        # transformers' own caches do, and so keeps them, with what generate returns made of them).
        if causal and all(isinstance(m._modules.get(ATTACHED), cls) and m._modules[ATTACHED].method.recurrent
                          for m in causal):
            if hf_generation.install(model, lambda: all(m.config._attn_implementation == NAME for m in causal)):
                notes.append("generate() decodes with linear_mha's cache: a fixed-size state per layer")
        return notes

    @classmethod
    def restore_model(cls, model):
        notes = []
        for module in model.modules():
            config = getattr(module, "config", None)
            if _SAVED not in module.__dict__ or config is None or _still_patched(model, config):
                continue
            saved = module.__dict__.pop(_SAVED)
            if config._attn_implementation == NAME:  # not switched by the user since
                _set_implementation(config, saved)
                notes.append(f"{type(config).__name__}: attention implementation {saved!r} restored")
        if not any(isinstance(m, cls) for m in model.modules()):
            hf_generation.uninstall(model)
        return notes


def _prefix_tokens(embeddings) -> int:
    """Tokens a ViT-style embedding puts before its patches: the class token, DeiT's distillation token, registers."""
    registers = getattr(embeddings, "register_tokens", None)
    return (int(getattr(embeddings, "cls_token", None) is not None)
            + int(getattr(embeddings, "distillation_token", None) is not None)
            + (registers.shape[1] if isinstance(registers, Tensor) and registers.dim() == 3 else 0))


def _still_patched(model, config) -> bool:
    return any(getattr(m, "config", None) is config and isinstance(m._modules.get(ATTACHED), LinearHFAttention)
               for m in model.modules())


def _saved_implementation(module) -> str:
    """What ``module``'s config ran before patch pointed it at linear_mha's function."""
    return module.__dict__.get(_SAVED, "sdpa")


def _set_implementation(config, name: str) -> None:
    """This config's implementation only (the property setter would also rewrite its sub-configs, e.g. DETR's
    backbone, which then cannot switch back)."""
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name
    else:
        config._attn_implementation = name


def run_original(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """The module's original implementation (what its config ran before patch), with the mask in its own form."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    implementation = _saved_implementation(module)
    function: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
    if isinstance(attention_mask, HFMask):
        attention_mask = attention_mask.original(implementation)
    return function(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def linear_mha_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function registered as ``"linear_mha"``: the module's adapter, or its original implementation
    for a module patch left alone."""
    adapter = module._modules.get(ATTACHED)
    if adapter is None:
        return run_original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return adapter(query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs), None


def _register() -> None:
    """Register the function and its mask function under NAME (transformers' class-level registries; once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, linear_mha_attention)
    AttentionMaskInterface.register(NAME, linear_mha_mask)
