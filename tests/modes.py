"""The built-in attention methods as the tests enumerate them: read from linear_mha's registry, so a method added
to the library is tested by every parametrized check without editing a list here."""
import torch
from torch import nn

import linear_mha
from linear_mha import TokenGrid
from linear_mha.attend import attend_heads

BUILT_IN = linear_mha.available_methods()  # at collection, before any test registers a method of its own
# Methods that attend over an image's token grid (agent) need one in every call: the generic checks below run on
# plain sequences, and the checks that take VARIANTS give them a grid (``grid_for``).
GRID = [m for m in BUILT_IN if linear_mha.method_class(m).needs_grid]
# Causal-only methods (a state run along the sequence in order) refuse non-causal calls: the generic checks over
# SEQUENCE run non-causal, so they join only the causal lists below.
CAUSAL_ONLY = [m for m in BUILT_IN if not linear_mha.method_class(m).bidirectional]
SEQUENCE = [m for m in BUILT_IN if m not in GRID and m not in CAUSAL_ONLY]
LINEAR = [m for m in SEQUENCE if not linear_mha.method_class(m).exact]
LINEAR_CAUSAL = [m for m in LINEAR if linear_mha.method_class(m).causal] + CAUSAL_ONLY
LINEAR_NON_CAUSAL = [m for m in LINEAR if not linear_mha.method_class(m).causal]


def sized(mode, length, **options):
    """Options for ``mode`` with its sequence-length option (Linformer's seq_len) set to ``length``; options the
    method does not have are dropped, so one call site serves every method."""
    cls = linear_mha.method_class(mode)
    kept = {k: v for k, v in options.items() if k in cls.options}
    if cls.sequence_length_option is not None:
        kept[cls.sequence_length_option] = length
    return kept


def sized_variant(options, length, **extra):
    """A variant's options (``mode`` and the method's options) with its sequence-length option set to ``length``
    and the ``extra`` options the method has (variants' own values win)."""
    mode = options["mode"]
    own = {k: v for k, v in options.items() if k != "mode"}
    return {"mode": mode, **sized(mode, length, **{**extra, **own})}


def _variants(methods, variants):
    presets = linear_mha.registry.method_presets(linear_only=False, variants=variants)
    return {name: options for name, options in presets.items() if options["mode"] in methods}


def method_of(options):
    """The configured method of a variant's options (``mode`` and the method's options)."""
    return linear_mha.registry.create_method(options["mode"], {k: v for k, v in options.items() if k != "mode"})


def drawn_state(method, heads, head_dim, seed=0, noise=0.0):
    """(state, learnable): the tensors ``method`` owns for these heads (FAVOR+'s projection, Linformer's E and F,
    learnable maps), drawn from ``seed`` in float64 and detached, and the names of the learnable ones
    (nn.Parameters), each moved off its start by ``noise`` times Gaussian noise so that gradients through it say
    something (through an identity map, or a zero bias, they may not)."""
    with torch.random.fork_rng(devices=[]):  # what a method draws for itself comes from the global generator
        torch.manual_seed(seed)
        drawn = method.init_state(heads, head_dim, {"device": None, "dtype": torch.float64})
    g = torch.Generator().manual_seed(seed)
    state, learnable = {}, []
    for key, t in drawn.items():
        if isinstance(t, nn.Parameter):
            learnable.append(key)
            t = t + noise * torch.randn(t.shape, generator=g, dtype=t.dtype)
        state[key] = None if t is None else t.detach()
    return state, learnable


def attend_with(method, state, q, k, v, **call):
    """``method``'s attention of (B, H, N, d) heads as every module runs it (``attend.attend_heads``: masks, is_causal,
    token_grid), its state in q's dtype and on q's device (through ``.to``, so gradients reach the tensors given)."""
    own = {key: None if t is None else t.to(q) for key, t in state.items()}
    return attend_heads(method, own, q, k, v, **call)[0]


# The presets of the sequence methods that attend any sequence, cross-attention included: an option that asks for a
# grid or for self-attention (rope, key_reweight) leaves its preset to ALL_VARIANTS' checks, which give both.
VARIANTS = {name: options for name, options in _variants(SEQUENCE, False).items()  # "kernel_favor" -> {"mode": ...}
            if method_of(options).self_attention_only == method_of({"mode": options["mode"]}).self_attention_only}
# Every preset and variant of every built-in method, grid methods included: the checks against each method's own
# float64 reference run all of them.
ALL_VARIANTS = _variants(BUILT_IN, True)
CAUSAL_VARIANTS = ([name for name, options in VARIANTS.items() if method_of(options).causal]
                   + [name for name, options in _variants(CAUSAL_ONLY, False).items()])
BIDIRECTIONAL = [name for name, options in ALL_VARIANTS.items() if method_of(options).bidirectional]


def needs_grid(options):
    """Whether a variant attends over a token grid: its method's (agent) or its options' (rope) doing."""
    return method_of(options).needs_grid


# An option may take the causal form away (key_reweight, rope) or ask for a grid (rope).
ALL_CAUSAL = [name for name, options in ALL_VARIANTS.items() if method_of(options).causal]
GRID_VARIANTS = [name for name, options in ALL_VARIANTS.items() if needs_grid(options)]


def grid_for(mode, tokens):
    """The most nearly square grid of ``tokens`` tokens for methods that need one, else None. ``mode``: a method's
    name, or a module (whose options may ask for a grid, as ``rope`` does)."""
    method = getattr(mode, "method", None)
    if not (method.needs_grid if method is not None else linear_mha.method_class(mode).needs_grid):
        return None
    height = max(f for f in range(1, int(tokens ** 0.5) + 1) if tokens % f == 0)
    return TokenGrid(height, tokens // height)


def causal_if_required(module_or_method):
    """The call's ``is_causal`` for a generic check that runs non-causal: True for a causal-only method (which
    refuses anything else), nothing for the others. Takes a module or a configured method."""
    method = getattr(module_or_method, "method", module_or_method)
    return {} if method.bidirectional else {"is_causal": True}
