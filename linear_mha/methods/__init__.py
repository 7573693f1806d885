"""The built-in attention methods, one file each; importing this package registers them (see ``registry``)."""
from . import linformer, kernel, efficient, taylor, taylor2, focused, hedgehog, agent, softmax  # noqa: F401  (registration order = listing order)
from . import feature_softmax, block_local, inline, mala  # noqa: F401
from . import gated, delta_rule  # noqa: F401  (causal only)
