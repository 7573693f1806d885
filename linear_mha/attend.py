"""The attention step every linear_mha module shares: (q, k, v) heads and nn.MultiheadAttention's masks in, the
method's output out. Masks are turned here, once, into what the method declares it honours (``registry``), and
anything it cannot honour exactly is refused before it runs. The options every module takes on top of its method's
(the local term, ``local_term.py``) are checked here too."""
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from . import masks
from .functional.packed_heads import split_heads
from .local_term import check_dwc_kernel
from .output_gate import check_output_gate
from .registry import AttentionMethod, causal_methods, causal_only_message, method_class
from .token_grid import NO_GRID, TokenGrid, check_traced_grid

MODULE_OPTIONS = ("dwc_kernel", "output_gate")  # options of the attention modules themselves, for every method


def needs_token_grid(module: nn.Module) -> bool:
    """Whether ``module`` (an attention module holding a method) cannot run without the token grid of its input."""
    return getattr(module, "dwc_weight", None) is not None or module.method.needs_grid


def reads_token_grid(module: nn.Module) -> bool:
    """Whether ``module`` uses the token grid of its input where one is known (softmax's rope: 2-D on a grid, 1-D
    on a sequence), needing it or not."""
    return needs_token_grid(module) or module.method.reads_grid


def split_for_options(module: nn.Module, projected: Tensor, parts: int, q_at: Optional[int] = None,
                      v_at: Optional[int] = None, gate_reads_q: bool = True):
    """split_heads of a module's projection into ``parts`` (B, H, N, d) heads, with the queries (part ``q_at``)
    and the values (part ``v_at``) handed out again where the module's output gate or local term reads them:
    returns (parts, the gate's q or None, the local term's v or None). Their two gradients then meet in the split,
    which adds the option's into the compiled backward's block in place (split_heads), instead of autograd making
    the sum a new tensor: the caller must keep the parts to itself (no hooks on them), as a module's forward does.
    ``gate_reads_q`` False: the gate reads the queries after something else (a norm)."""
    gated = gate_reads_q and getattr(module, "gate_weight", None) is not None
    local = getattr(module, "dwc_weight", None) is not None
    again = tuple(i for i, wanted in ((q_at, gated), (v_at, local)) if i is not None and wanted)
    views = split_heads(projected, parts, module.num_heads, again, own_gradients=True)  # the parts stay in here
    seconds = dict(zip(again, views[parts:]))
    return views[:parts], seconds.get(q_at), seconds.get(v_at)


def validate_options(mode: str, options: Mapping[str, Any]) -> Dict[str, Any]:
    """The options of a module running ``mode``, completed and checked without building anything (patch and patched
    check early): the method's own, and the modules' (``MODULE_OPTIONS``), returned as given."""
    check_dwc_kernel(options.get("dwc_kernel"))
    check_output_gate(options.get("output_gate", False))
    module_options = {key: options[key] for key in MODULE_OPTIONS if key in options}
    return {**method_class(mode).validate({k: v for k, v in options.items() if k not in MODULE_OPTIONS}),
            **module_options}


def attend_heads(method: AttentionMethod, state: Mapping[str, Optional[Tensor]], q: Tensor, k: Tensor, v: Tensor, *,
                 key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                 is_causal: bool = False, extra_keys: Optional[Tuple[Tensor, Tensor]] = None,
                 need_weights: bool = False, dropout_p: float = 0.0,
                 token_grid: Optional[TokenGrid] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """q (B, H, L, d), k (B, H, S, d), v (B, H, S, d_v) -> (out (B, H, L, d_v), weights (B, H, L, S + n) or None).

    key_padding_mask (B, S) and attn_mask (L, S) or (B, H, L, S) as ``masks.check_*`` return them (bool, True =
    forbidden, or float, additive). extra_keys: (k, v) of n keys every query sees (add_bias_kv / add_zero_attn).
    Weights come back only from methods that form them, and only when asked. token_grid: for methods that declare
    ``needs_grid`` (None: refused with how to give it).
    """
    L, S = q.shape[2], k.shape[2]
    if method.self_attention_only and L != S:
        raise ValueError(f"mode={method.name!r} with these options needs self-attention (queries and keys at the "
                         f"same positions), got L={L} queries and S={S} keys; patch cross-attention with another "
                         f"method or options (e.g. exclude= it)")
    kwargs = {}
    if method.needs_grid:
        if token_grid is None:
            who = f"mode={method.name!r}" if type(method).needs_grid else method.describe()  # or an option's need
            raise ValueError(f"{who} {NO_GRID}")
        kwargs["token_grid"] = token_grid
    elif method.reads_grid:
        kwargs["token_grid"] = token_grid
    if kwargs.get("token_grid") is not None:
        k = check_traced_grid(k, token_grid)
    if extra_keys is not None:
        if not method.extra_keys:
            raise ValueError(f"mode={method.name!r} does not handle the extra keys of add_bias_kv / add_zero_attn")
        kwargs["extra_keys"] = extra_keys
    if method.any_mask:
        n_extra = 0 if extra_keys is None else extra_keys[0].shape[2]
        kwargs["attn_bias"] = masks.additive_bias(key_padding_mask, attn_mask, is_causal, L, S, n_extra, q.dtype,
                                                  q.device)
    else:
        if key_padding_mask is not None:
            key_padding_mask = masks.to_forbidden(key_padding_mask, "key_padding_mask", method.name)
        causal = masks.classify_attn_mask_for_linear(attn_mask, is_causal, method.name, causal_methods())
        if causal and not method.causal:
            if type(method).causal:  # an option took the method's causal form away (key_reweight, rope)
                raise ValueError(f"mode={method.name!r} has no causal form with these options ({method.describe()}): "
                                 f"build the module without the option that needs the whole sequence")
            raise ValueError(f"mode={method.name!r} has no causal form (its keys are mixed across the sequence); "
                             f"causal attention is supported by modes {causal_methods()}")
        if not causal and not method.bidirectional:
            raise ValueError(causal_only_message(method.name))
        if causal and L != S:
            raise ValueError(f"causal attention needs as many queries as keys, got L={L}, S={S}")
        kwargs.update(key_padding_mask=key_padding_mask, causal=causal)
    if need_weights and method.returns_weights:
        return method.attend_with_weights(q, k, v, state, dropout_p=dropout_p, **kwargs)
    return method.attend(q, k, v, state, dropout_p=dropout_p, **kwargs), None


# --------------------------------------------------------------------------------------------------- decoding
def prefill_heads(method: AttentionMethod, state: Mapping[str, Optional[Tensor]], q: Tensor, k: Tensor, v: Tensor,
                  cache: dict, *, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Causal attention over a prompt, q, k (B, H, N, d), v (B, H, N, d_v) -> (B, H, N, d_v), that leaves in the empty
    dict ``cache`` what ``step_heads`` needs to decode the next position. key_padding_mask (B, N): True = padding.
    A ``recurrent`` method keeps a state of fixed size (kernel methods: the (B, H, F, d_v + 1) sums; a window: its
    last keys); any other causal method keeps every key and value (O(t) memory and work per token, as a KV cache)."""
    _check_decodes(method)
    if key_padding_mask is not None:
        key_padding_mask = masks.to_forbidden(key_padding_mask, "key_padding_mask", method.name)
    if method.recurrent:
        return method.prefill(q, k, v, state, cache, key_padding_mask=key_padding_mask)
    padding = key_padding_mask if key_padding_mask is not None else q.new_zeros(q.shape[0], q.shape[2], dtype=bool)
    cache.update(k=k, v=v, padding=padding, **({"q": q} if method.self_attention_only else {}))
    return attend_heads(method, state, q, k, v, key_padding_mask=key_padding_mask, is_causal=True)[0]


def step_heads(method: AttentionMethod, state: Mapping[str, Optional[Tensor]], q: Tensor, k: Tensor, v: Tensor,
               cache: dict, *, padding: Optional[Tensor] = None) -> Tensor:
    """The next position after what ``cache`` holds (an empty dict: the first): q, k (B, H, d), v (B, H, d_v) ->
    (B, H, d_v), exactly what causal attention over the whole sequence gives it. padding (B,) bool: True = this
    position is padding. ``cache`` is updated in place."""
    _check_decodes(method)
    if method.recurrent:
        return method.step(q, k, v, state, cache, padding=padding)
    if padding is None:
        padding = q.new_zeros(q.shape[0], dtype=torch.bool)
    new = {"k": k[:, :, None], "v": v[:, :, None], "padding": padding[:, None]}
    if method.self_attention_only:  # queries pair with positions: attend the whole sequence again
        new["q"] = q[:, :, None]
    for key, value in new.items():
        cache[key] = value if key not in cache else torch.cat([cache[key], value], dim=-1 if key == "padding" else 2)
    if method.self_attention_only:
        out, _ = attend_heads(method, state, cache["q"], cache["k"], cache["v"], key_padding_mask=cache["padding"],
                              is_causal=True)
        return out[:, :, -1]
    # the newest query sees every key so far: the last row of causal attention, for one query's work
    out, _ = attend_heads(method, state, q[:, :, None], cache["k"], cache["v"], key_padding_mask=cache["padding"])
    return out[:, :, 0]


def _check_decodes(method: AttentionMethod) -> None:
    if not method.causal:
        raise ValueError(f"mode={method.name!r} has no causal form, so it cannot decode token by token; causal "
                         f"methods: {causal_methods()}")
