"""The LM stack: linear-attention transformer LMs, Linformer models, linear self/image attention, generation."""
from .feedforward import Chunk, FeedForward
from .language_model import LinearAttentionTransformerLM
from .linformer_attention import LinformerSelfAttention
from .self_attention import SelfAttention
from .settings import LinformerContextSettings, LinformerSettings
from .transformer import LinearAttentionTransformer

__all__ = [
    "LinearAttentionTransformerLM", "LinearAttentionTransformer", "SelfAttention", "LinformerSelfAttention",
    "LinformerSettings", "LinformerContextSettings", "FeedForward", "Chunk",
]
