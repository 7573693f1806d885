"""patched(): while active, code that constructs torch.nn.MultiheadAttention gets a LinearMultiheadAttention,
for model code you cannot edit. Not thread-safe: it rebinds module attributes process-wide."""
import contextlib
import sys

from ..attention import LinearMultiheadAttention
from ..attend import validate_options
from ..registry import DEFAULT_MODE, resolve_mode
from ..torch_models import TORCH_MHA as _TORCH_MHA


class _ActsAsTorchMHA(type):
    # isinstance/issubclass against the stand-in keep meaning "is an nn.MultiheadAttention", so torch code that
    # checks types while the context is active is not fooled.
    def __instancecheck__(cls, obj):
        return isinstance(obj, _TORCH_MHA)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _TORCH_MHA)


def _stand_in(options: dict):
    class MultiheadAttention(metaclass=_ActsAsTorchMHA):
        """Stand-in for torch.nn.MultiheadAttention inside linear_mha.patched(): builds LinearMultiheadAttention."""
        _linear_mha_stand_in = True

        def __new__(cls, *args, **kwargs):
            return LinearMultiheadAttention(*args, **{**options, **kwargs})

    return MultiheadAttention


@contextlib.contextmanager
def patched(mode: str = DEFAULT_MODE, **options):
    """Inside ``with linear_mha.patched(mode=...):`` every ``nn.MultiheadAttention(...)`` (also spelled
    ``torch.nn.modules.activation.MultiheadAttention``, inside nn.TransformerEncoderLayer / DecoderLayer /
    nn.Transformer, or imported earlier as ``from torch.nn import MultiheadAttention`` by a loaded module) builds a
    ``LinearMultiheadAttention(..., mode=mode, **options)``. Restored on exit, also when the block raises.
    Modules built inside keep being linear after the block. Only the name ``MultiheadAttention`` is rebound: a
    module that imported it under another name (``import ... as MHA``) keeps torch's class."""
    mode = resolve_mode(mode, options)
    validate_options(mode, options)  # fail before anything is rebound
    stand_in = _stand_in({"mode": mode, **options})
    # Every loaded module that bound the name to torch's class at import time (torch.nn, torch.nn.modules.
    # activation, torch.nn.modules.transformer, user code doing `from torch.nn import MultiheadAttention`), or to
    # the stand-in of an enclosing patched() block.
    previous = {}
    for module in list(sys.modules.values()):
        bound = getattr(module, "__dict__", {}).get("MultiheadAttention")
        if bound is _TORCH_MHA or getattr(bound, "_linear_mha_stand_in", False):
            previous[module] = bound
    for module in previous:
        module.MultiheadAttention = stand_in
    try:
        yield
    finally:
        for module, bound in previous.items():
            module.MultiheadAttention = bound
