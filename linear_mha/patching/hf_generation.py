"""Generation with a fixed-size state: linear_mha's cache for transformers' ``generate()``.

transformers updates a layer's cache before it calls the attention function, and the function receives what the
update returned. ``LinearStateCache``'s layers keep no keys or values: an update counts the new positions and hands
the new keys back marked with the layer, where the patched attention (``LinearHFAttention``) finds the method's own
decoding state (``attend.prefill_heads`` / ``step_heads``: a feature-map method's (B, H, F, d + 1) sums, a window's
last keys) and advances it. So memory does not grow with the number of tokens generated, and each token costs the
same whatever the context. ``patch`` makes the model's ``generate`` use this cache when none is given (``install``);
``unpatch`` removes that. A recurrent state cannot be rolled back: assisted decoding, which crops the cache, is
refused with that reason (generate without ``assistant_model`` keeps transformers' own cache for it).
"""
import functools
import inspect
from typing import Callable, Optional

from torch import Tensor

_TAG = "_linear_mha_layer"  # the attribute that marks the new keys with the cache layer that handed them out
_WRAPPED = "_linear_mha_generate"


def decoding_layer(key: Tensor):
    """The linear_mha cache layer that handed out ``key`` (this call's new keys), or None."""
    return getattr(key, _TAG, None)


@functools.lru_cache(maxsize=None)
def cache_classes():
    """(LinearStateLayer, LinearStateCache), defined on first use: transformers is an optional dependency."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class LinearStateLayer(CacheLayerMixin):
        """One model layer's decoding state: ``cache``, the dict the layer's method keeps (every tensor in it has the
        batch first), and the number of positions seen (transformers derives position ids and mask offsets from it)."""
        is_compileable = False  # generate must not compile around a state that is reassigned every step
        is_croppable = False
        is_sliding = False

        def __init__(self, **kwargs):
            super().__init__()
            self.cache, self.seen, self.pending = {}, 0, False

        def lazy_initialization(self, key_states, value_states):
            self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.pending:
                raise RuntimeError("linear_mha's cache handed keys to an attention call that did not take them: the "
                                   "model changes its keys between the cache and the attention function, or runs "
                                   "this layer's attention outside linear_mha (unpatched or excluded); give generate "
                                   "transformers' own cache (DynamicCache())")
            self.pending = True
            self.seen += key_states.shape[-2]
            marked = key_states.view_as(key_states)  # a new tensor object carrying the mark; the data is shared
            setattr(marked, _TAG, self)
            return marked, value_states

        def consumed(self):
            self.pending = False

        def get_seq_length(self):
            return self.seen

        def get_mask_sizes(self, query):  # the query length (5.2x) or the query positions (earlier 5.x)
            length = query.shape[-1] if isinstance(query, Tensor) else query
            return length, self.seen  # masks cover this call's new keys only: they never grow

        def get_max_length(self):  # no limit (5.2x)
            return -1

        def get_max_cache_shape(self):  # no limit (earlier 5.x)
            return -1

        def _map(self, fn):
            self.cache = _map_tensors(self.cache, fn)

        def reorder_cache(self, beam_idx):
            self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

        def batch_repeat_interleave(self, repeats):
            self._map(lambda t: t.repeat_interleave(repeats, dim=0))

        def batch_select_indices(self, indices):
            self._map(lambda t: t[indices])

        def crop(self, max_length):
            if max_length not in (0, self.seen):
                raise ValueError("linear attention's recurrent state cannot be cropped (rolled back), which assisted "
                                 "decoding needs; generate without assistant_model, or give generate transformers' "
                                 "own cache (DynamicCache())")

        def reset(self):
            self.cache, self.seen, self.pending, self.is_initialized = {}, 0, False, False

        def offload(self):
            self._map(lambda t: t.to("cpu", non_blocking=True))

        def prefetch(self):
            self._map(lambda t: t.to(self.device, non_blocking=True))

        def nbytes(self) -> int:
            total = []
            _map_tensors(self.cache, lambda t: total.append(t.numel() * t.element_size()) or t)
            return sum(total)

    class LinearStateCache(Cache):
        """A cache of ``LinearStateLayer``s, one per model layer, made as the layers first update it."""

        def __init__(self, **kwargs):
            super().__init__(layer_class_to_replicate=LinearStateLayer)

        def nbytes(self) -> int:
            """Bytes of decoding state held: the same after 10 tokens as after 10,000 for a recurrent method."""
            return sum(layer.nbytes() for layer in self.layers)

    return LinearStateLayer, LinearStateCache


def _map_tensors(value, fn):
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def LinearStateCache():  # noqa: N802 - a class to its users, made lazily
    """A new linear_mha cache for ``model.generate(..., past_key_values=...)`` or a manual decoding loop."""
    return cache_classes()[1]()


def cache_keyword(model) -> Optional[str]:
    """The name under which this transformers version's generate takes a cache: ``cache`` (5.x) or
    ``past_key_values`` (earlier)."""
    parameters = inspect.signature(type(model).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def install(model, runs_linear: Callable[[], bool]) -> bool:
    """Make ``model.generate`` decode with a new LinearStateCache when the caller asks for no cache of its own (none
    given, no ``cache_implementation``, no assistant, whose drafts need a cache that can be cropped) and
    ``runs_linear()`` says the model's attention still goes through linear_mha (a user can switch a config back to
    sdpa or eager, as assisted decoding does to its assistant: generate is then transformers' own). Returns whether
    generate was wrapped."""
    generate = getattr(model, "generate", None)
    keyword = cache_keyword(model)
    if generate is None or keyword is None or _WRAPPED in model.__dict__:
        return False

    @functools.wraps(generate)
    def generate_with_linear_state(*args, **kwargs):
        if _wants_linear_state(model, kwargs) and runs_linear():
            kwargs[keyword] = LinearStateCache()
        return generate(*args, **kwargs)

    model.__dict__["generate"] = generate_with_linear_state  # the instance's own: unpatch removes it
    model.__dict__[_WRAPPED] = True
    return True


def _wants_linear_state(model, kwargs) -> bool:
    """Whether this generate call leaves the choice of cache to us."""
    own = {"cache", "past_key_values", "assistant_model", "prompt_lookup_num_tokens", "cache_implementation"}
    if own & {key for key, value in kwargs.items() if value is not None} or kwargs.get("use_cache", True) is False:
        return False
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, "cache_implementation", None) is None and getattr(config, "use_cache", True) is not False


def uninstall(model) -> None:
    if model.__dict__.pop(_WRAPPED, None):
        model.__dict__.pop("generate", None)
