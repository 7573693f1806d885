"""The attention methods, by name: the one list every entry point reads.

An attention method is a class derived from :class:`AttentionMethod` and registered under its ``name``. It declares
its options (defaults and checks), the tensors it owns (Linformer's E/F, FAVOR+'s projection, learnable feature
maps), whether it has a causal form, which masks it honours exactly, and how it attends ``(B, H, L, d)`` heads.
``LinearMultiheadAttention(..., mode=name)``, ``patch(model, mode=name)``, the timm adapter, the DETR trainer's
``--attention`` and the benchmarks all look methods up here, so a method registered from a user's own file works in
all of them::

    import linear_mha
    from linear_mha import AttentionMethod, Option, register_method

    @register_method
    class Cosine(AttentionMethod):
        name = "cosine"
        options = {"eps": Option(1e-6, linear_mha.registry.positive_float, "normaliser floor")}

        def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0):
            ...                                            # (B, H, L, d) heads in, (B, H, L, d_v) out

    linear_mha.LinearMultiheadAttention(64, 4, mode="cosine", eps=1e-5)

One instance is made per module: it holds the module's validated options as attributes (``module.method.eps``).
"""
import difflib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple, Type

import torch
from torch import Tensor, nn


# ----------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Option:
    """A keyword option of a method: its default, a check ``check(value, name) -> value`` that raises ValueError or
    TypeError naming the option (and may normalise the value), and one line of help."""
    default: Any
    check: Optional[Callable[[Any, str], Any]] = None
    help: str = ""


def positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def boolean(value, name):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def positive_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def optional(check):
    """None, or a value ``check`` accepts."""
    def check_optional(value, name):
        return None if value is None else check(value, name)
    return check_optional


def one_of(*choices):
    def check_choice(value, name):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value
    return check_choice


# ----------------------------------------------------------------------------------------------- methods
class AttentionMethod:
    """Base class of attention methods. A subclass sets the class attributes below and implements :meth:`attend`;
    it may implement :meth:`init_state` (tensors it owns), :meth:`check_options` (checks across options) and
    :meth:`attend_with_weights` (methods that form the weights).

    Masks. Every method must honour key padding exactly: a masked key adds nothing to any output or gradient.
    ``causal = True`` declares a causal form (``attend(..., causal=True)``: query i sees keys j <= i, never later
    ones); ``bidirectional = False`` declares that it has no other (a state run along the sequence in order: the
    non-causal call is refused). ``any_mask = True`` declares that the method applies any ``attn_mask`` exactly,
    additive float biases included: such a method receives the masks combined into ``attn_bias`` and never
    ``key_padding_mask`` or ``causal``. Anything a method does not declare is refused before it is called, with an
    error naming the methods that support it.
    """

    name: ClassVar[str] = ""
    options: ClassVar[Mapping[str, Option]] = {}
    causal: ClassVar[bool] = False           # has a causal form
    bidirectional: ClassVar[bool] = True     # has a non-causal form (False: causal only, a state run in order)
    any_mask: ClassVar[bool] = False         # applies any attn_mask / additive bias exactly (exact softmax)
    returns_weights: ClassVar[bool] = False  # can return the (B, H, L, S) weights: implements attend_with_weights
    extra_keys: ClassVar[bool] = False       # handles add_bias_kv / add_zero_attn keys (``extra_keys=(k, v)``)
    exact: ClassVar[bool] = False            # computes exact softmax attention: the reference, not a linear method
    needs_grid: ClassVar[bool] = False       # attends over the image's token grid: receives ``token_grid=``
    sequence_length_option: ClassVar[Optional[str]] = None  # option bounding the key length (Linformer's seq_len)
    exports_dynamic_length: ClassVar[bool] = True  # torch.export may leave the sequence length dynamic
    presets: ClassVar[Mapping[Optional[str], dict]] = {}  # named option sets worth comparing (benchmarks and tests
    # run each); the key None names the defaults' row "<method>" itself (a method without presets has only that row)
    variants: ClassVar[Mapping[str, dict]] = {}  # option sets that take other code paths (the tests run each too)
    cost: ClassVar[str] = ""                 # for the modes table, e.g. "O(N·d²)"
    summary: ClassVar[str] = ""              # one line: what it computes

    def __init__(self, **options):
        for key, value in self.validate(options).items():
            setattr(self, key, value)
        self.state_names: Tuple[str, ...] = ()

    # ------------------------------------------------------------------ options
    @classmethod
    def validate(cls, options: Mapping[str, Any]) -> Dict[str, Any]:
        """The options completed with their defaults and checked; unknown names raise ValueError naming the method
        and its options."""
        unknown = [key for key in options if key not in cls.options]
        if unknown:
            raise ValueError(_unknown_options_message(cls, unknown))
        values = {}
        for key, option in cls.options.items():
            value = options.get(key, option.default)
            if key in options and option.check is not None:
                value = option.check(value, key)
            values[key] = value
        cls.check_options(values)
        return values

    @classmethod
    def check_options(cls, options: Dict[str, Any]) -> None:
        """Checks across options (override); raise ValueError/TypeError naming them."""

    @property
    def option_values(self) -> Dict[str, Any]:
        return {key: getattr(self, key) for key in self.options}

    def describe(self) -> str:
        """The method and its options, for a module's repr."""
        shown = ", ".join(f"{key}={value!r}" for key, value in self.option_values.items()
                          if not isinstance(value, Tensor) and value is not None)
        return f"mode={self.name!r}" + (f", {shown}" if shown else "")

    # ------------------------------------------------------------------ state
    def init_state(self, num_heads: int, head_dim: int, factory_kwargs: dict) -> Dict[str, Optional[Tensor]]:
        """The tensors this method owns, by attribute name: an nn.Parameter becomes a parameter of the module, any
        other tensor a buffer, None a registered empty slot. An original checkpoint lacks them; they then keep this
        initialisation."""
        return {}

    def install(self, module: nn.Module, num_heads: int, head_dim: int, factory_kwargs: dict) -> None:
        """Register :meth:`init_state`'s tensors on ``module`` (so state-dict keys are ``<module>.<name>``)."""
        state = self.init_state(num_heads, head_dim, factory_kwargs)
        for key, tensor in state.items():
            if hasattr(module, key) and key not in module._parameters and key not in module._buffers:
                raise ValueError(f"method {self.name!r} names its state {key!r}, which {type(module).__name__} "
                                 f"already uses; choose another name")
            if tensor is None or isinstance(tensor, nn.Parameter):
                module.register_parameter(key, tensor)
            else:
                module.register_buffer(key, tensor)
        self.state_names = tuple(state)

    def state(self, module: nn.Module) -> Dict[str, Optional[Tensor]]:
        """The current tensors of this method on ``module`` (after ``.to()``, loading, training)."""
        return {key: getattr(module, key) for key in self.state_names}

    def before_forward(self, module: nn.Module) -> None:
        """Called at the start of every forward (override: e.g. FAVOR+'s periodic redraw)."""

    def redraw(self, module: nn.Module, generator: Optional[torch.Generator] = None) -> None:
        raise RuntimeError(f"redraw_features() applies only to mode='kernel' with feature_map='favor' "
                           f"(this module has mode={self.name!r})")

    @classmethod
    def layer_shared(cls, options: Mapping[str, Any]) -> Optional[Tuple[str, str]]:
        """(state name, option name) when ``options`` ask for one tensor shared by every patched layer (Linformer's
        param_sharing='layerwise'): ``patch`` builds the first module, then hands its tensor to the others through
        the option."""
        return None

    # ------------------------------------------------------------------ attention
    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Mapping[str, Optional[Tensor]], *,
               key_padding_mask: Optional[Tensor] = None, causal: bool = False, dropout_p: float = 0.0,
               **kwargs) -> Tensor:
        """q (B, H, L, d), k (B, H, S, d), v (B, H, S, d_v) -> (B, H, L, d_v).

        key_padding_mask: bool (B, S), True = ignore that key. causal: query i sees keys j <= i (L == S).
        dropout_p: attention dropout (0 in eval). state: :meth:`state`. Methods that declare ``extra_keys`` also get
        ``extra_keys=(k_extra (B, H, n, d), v_extra (B, H, n, d_v))``: keys every query sees, after the sequence,
        never masked. Methods that declare ``any_mask`` get ``attn_bias`` (additive, broadcastable to
        (B, H, L, S + n)) instead of ``key_padding_mask`` and ``causal``; methods that declare ``needs_grid`` get
        ``token_grid`` (a ``TokenGrid``: the sequence is its prefix tokens, then a row-major height x width grid)."""
        raise NotImplementedError(f"method {self.name!r} does not implement attend()")

    # ------------------------------------------------------------------ decoding (``attend.prefill_heads``)
    recurrent: ClassVar[bool] = False  # decodes with a state of its own whose size does not grow with the context

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, state: Mapping[str, Optional[Tensor]], cache: dict, *,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Methods that declare ``recurrent``: causal attention over positions 0..N-1 of q, k (B, H, N, d),
        v (B, H, N, d_v), exactly as ``attend(..., causal=True)`` gives it, leaving in the empty dict ``cache`` what
        :meth:`step` continues from. Other causal methods decode through ``attend.step_heads``' generic cache.
        Every tensor a method keeps in ``cache`` has the batch as its first dimension (a beam search reorders them)."""
        raise NotImplementedError(f"method {self.name!r} declares recurrent but has no prefill()")

    def step(self, q: Tensor, k: Tensor, v: Tensor, state: Mapping[str, Optional[Tensor]], cache: dict, *,
             padding: Optional[Tensor] = None) -> Tensor:
        """Methods that declare ``recurrent``: the next position, q, k (B, H, d), v (B, H, d_v) -> (B, H, d_v),
        exactly what ``attend(..., causal=True)`` gives it after the positions ``cache`` has seen (none, for an empty
        cache); ``cache`` is updated in place. padding (B,) bool: this position is padding, so its key reaches no
        later output."""
        raise NotImplementedError(f"method {self.name!r} declares recurrent but has no step()")

    def attend_with_weights(self, q, k, v, state, **kwargs) -> Tuple[Tensor, Tensor]:
        """(out, weights (B, H, L, S + n)) for methods that declare ``returns_weights``."""
        raise NotImplementedError(f"method {self.name!r} does not return attention weights")

    @property
    def computes_torch_attention(self) -> bool:
        """Whether this configured method computes what nn.MultiheadAttention computes (exact softmax without an
        option that changes the scores): the tests then hold it to torch's own module."""
        return self.exact

    @property
    def reads_grid(self) -> bool:
        """Whether the method uses the token grid when the module knows one (``token_grid=`` is then passed, None
        where there is none); ``needs_grid`` methods cannot run without it."""
        return self.needs_grid

    @property
    def self_attention_only(self) -> bool:
        """Whether queries and keys must be the same positions (a grid of tokens, a window of neighbours):
        cross-attention is then refused before the method runs."""
        return self.needs_grid

    @property
    def triton_map(self) -> Optional[str]:
        """The map of the fused Triton kernels (``functional.triton_kernel.MAPS``) that this configured method's
        non-causal attention runs in on CUDA, or None where they do not take it: the kernels' tests and
        ``tools/triton_bench`` run every method that names one."""
        return None

    # ------------------------------------------------------------------ facts (tests, benchmarks, docs)
    def reference_weights(self, q: Tensor, k: Tensor, state: Mapping[str, Optional[Tensor]], *,
                          key_padding_mask: Optional[Tensor] = None, causal: bool = False,
                          token_grid=None) -> Tensor:
        """The (B, H, L, S) weights this method implies (its output is ``weights @ v``), formed naively from its
        definition in O(L S) memory: the reference every implementation is tested against in float64. Masks as
        in :meth:`attend`; masked keys get weight 0, a query that sees no key a zero row. Optional for a user's
        method; every built-in one has it."""
        raise NotImplementedError(f"method {self.name!r} has no naive reference (reference_weights)")

    def reference(self, q, k, v, state, **masks) -> Tensor:
        """The naive output ``reference_weights(q, k, state, **masks) @ v``: (B, H, L, d_v)."""
        return self.reference_weights(q, k, state, **masks) @ v.to(q.dtype)

    def flops(self, batch_heads: int, tokens: int, head_dim: int, causal: bool) -> Optional[float]:
        """Floating-point operations (a multiply-add counts 2) of one self-attention call over ``tokens`` positions
        of ``batch_heads`` heads of ``head_dim``: what the benchmarks divide by time. None: not stated (no rate is
        reported, none is made up)."""
        return None


def append_extra_keys(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], extra_keys) -> Tuple:
    """k, v, key_padding_mask with ``extra_keys = (k_extra, v_extra)`` appended after the sequence, never masked:
    what a method whose keys play interchangeable roles (no position along the sequence) does with them."""
    k, v = torch.cat([k, extra_keys[0]], dim=2), torch.cat([v, extra_keys[1]], dim=2)
    if key_padding_mask is not None:
        key_padding_mask = torch.nn.functional.pad(key_padding_mask, (0, extra_keys[0].shape[2]), value=False)
    return k, v, key_padding_mask


# ---------------------------------------------------------------------------------------------- registry
_METHODS: Dict[str, Type[AttentionMethod]] = {}
DEFAULT_MODE = None  # LinearMultiheadAttention's, patch's and patched's default: chosen by default_mode
SEQUENCE_DEFAULT = "taylor"  # what a module built with no mode runs: any length, causal or not


def default_mode(options: Mapping[str, Any]) -> str:
    """The method of a module built without ``mode=``: Linformer when given one of its options (``seq_len``,
    ``proj_k``, ``param_sharing``: the call of the linear-attention-transformer / linformer packages this descends
    from), else ``taylor``, which takes any sequence length, causal or not."""
    linformer = _METHODS.get("linformer")
    if linformer is not None and any(key in linformer.options for key in options):
        return "linformer"
    return SEQUENCE_DEFAULT


def resolve_mode(mode: Optional[str], options: Mapping[str, Any]) -> str:
    """``mode``, or the default for these options when it is None."""
    return default_mode(options) if mode is None else mode


def register_method(cls: Type[AttentionMethod] = None, *, replace: bool = False):
    """Register an :class:`AttentionMethod` subclass under its ``name`` (usable as a class decorator). A name taken
    by another class raises unless ``replace=True`` (a class redefined under its own module and name, as a re-run
    notebook cell does, replaces itself). Returns the class."""
    if cls is None:
        return lambda c: register_method(c, replace=replace)
    if not (isinstance(cls, type) and issubclass(cls, AttentionMethod)):
        raise TypeError(f"register_method expects an AttentionMethod subclass, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{cls.__name__}.name must be a non-empty identifier-like string, got {name!r}")
    if cls.attend is AttentionMethod.attend:
        raise TypeError(f"{cls.__name__} must implement attend()")
    if cls.returns_weights and cls.attend_with_weights is AttentionMethod.attend_with_weights:
        raise TypeError(f"{cls.__name__} declares returns_weights but does not implement attend_with_weights()")
    for key, option in cls.options.items():
        if not isinstance(option, Option):
            raise TypeError(f"{cls.__name__}.options[{key!r}] must be an Option(default, check, help), "
                            f"got {type(option).__name__}")
    previous = _METHODS.get(name)
    redefined = previous is not None and (previous.__module__, previous.__qualname__) == (cls.__module__,
                                                                                          cls.__qualname__)
    if previous is not None and previous is not cls and not (replace or redefined):  # a re-run cell may redefine
        raise ValueError(f"an attention method named {name!r} is already registered ({_METHODS[name].__name__}); "
                         f"pick another name or pass replace=True")
    _METHODS[name] = cls
    return cls


def unregister_method(name: str) -> None:
    """Remove a registered method (e.g. a test's)."""
    method_class(name)
    del _METHODS[name]


def available_methods() -> Tuple[str, ...]:
    """Names of the registered methods, built-ins first, in registration order."""
    return tuple(_METHODS)


def method_class(name: str) -> Type[AttentionMethod]:
    """The class registered under ``name``; an unknown name raises ValueError listing the choices."""
    try:
        return _METHODS[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(name, _METHODS, n=1) if isinstance(name, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"mode must be one of {available_methods()} or a method added with "
                         f"linear_mha.register_method; got {name!r}{hint}") from None


def create_method(mode: Optional[str], options: Mapping[str, Any]) -> AttentionMethod:
    """A configured instance of method ``mode`` (None: ``default_mode(options)``); its options are checked against
    that method's."""
    return method_class(resolve_mode(mode, options))(**options)


def method_presets(linear_only: bool = True, variants: bool = False) -> Dict[str, Dict[str, Any]]:
    """"<method>_<preset>" (or "<method>" for a method without presets) -> {"mode": method, **options}: every preset
    of every registered method, read when called (the rows a benchmark or a diagnosis compares). ``linear_only``
    leaves exact methods out; ``variants`` adds the option sets that take other code paths (what the tests run)."""
    found = {}
    for name, cls in _METHODS.items():
        if linear_only and cls.exact:
            continue
        named = {**cls.presets, **(cls.variants if variants else {})}
        if not cls.presets:
            named = {None: {}, **named}  # the defaults, unless a preset names them
        for preset, options in named.items():
            found[name if preset is None else f"{name}_{preset}"] = {"mode": name, **options}
    return found


def causal_methods() -> Tuple[str, ...]:
    return tuple(name for name, cls in _METHODS.items() if cls.causal)


def bidirectional_methods() -> Tuple[str, ...]:
    """The methods with a non-causal form: every query sees every key."""
    return tuple(name for name, cls in _METHODS.items() if cls.bidirectional)


def causal_only_message(name: str) -> str:
    """Why a causal-only method refuses a non-causal call, and what to do instead."""
    return (f"mode={name!r} is causal only (its state runs along the sequence in order): call it with "
            f"is_causal=True (or a causal attn_mask); for attention over the whole sequence use one of "
            f"{bidirectional_methods()}")


def _unknown_options_message(cls, unknown) -> str:
    parts = []
    for key in unknown:
        owners = [name for name, other in _METHODS.items() if key in other.options]
        close = difflib.get_close_matches(key, list(cls.options), n=1)
        elsewhere = {option: name for name, other in _METHODS.items() if other is not cls for option in other.options}
        near = difflib.get_close_matches(key, list(elsewhere), n=1)
        hint = (f" (did you mean {close[0]!r}?)" if close else
                f" (an option of {', '.join(map(repr, owners))})" if owners else
                f" (did you mean {near[0]!r}, an option of mode={elsewhere[near[0]]!r}?)" if near else "")
        parts.append(f"{key!r}{hint}")
    known = ", ".join(cls.options) or "none"
    return f"mode={cls.name!r} has no option {', '.join(parts)}; its options are: {known}"
