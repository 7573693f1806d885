"""Configuration records of the original API: ``LinformerSettings(k)`` switches the main self-attention of a
non-causal ``LinearAttentionTransformer`` to Linformer; ``LinformerContextSettings(seq_len, k)`` does the same for
the attention to an encoder's context (``seq_len`` = the longest context it will see)."""
from collections import namedtuple

LinformerSettings = namedtuple("LinformerSettings", ["k"])
LinformerContextSettings = namedtuple("LinformerContextSettings", ["seq_len", "k"])
