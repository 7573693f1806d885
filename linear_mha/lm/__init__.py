"""The LM stack: linear-attention transformer LMs, Linformer models, linear self/image attention, generation."""
from .autoregressive import AutoregressiveWrapper, top_k_filter, top_p_filter
from .feedforward import Chunk, FeedForward
from .image_attention import ImageLinearAttention, LinearImageAttention
from .language_model import LinearAttentionTransformerLM
from .linear_self_attention import LinearSelfAttention
from .linformer_attention import LinformerSelfAttention
from .linformer_models import Linformer, LinformerLM
from .patched_attention import PatchedSelfAttention  # also lets linear_mha.patch swap SelfAttention
from .pkm import PKM
from .self_attention import SelfAttention
from .settings import LinformerContextSettings, LinformerSettings
from .transformer import LinearAttentionTransformer

__all__ = [
    "LinearAttentionTransformerLM", "LinearAttentionTransformer", "SelfAttention", "AutoregressiveWrapper",
    "top_k_filter", "top_p_filter", "LinformerSelfAttention", "Linformer", "LinformerLM", "LinformerSettings",
    "LinformerContextSettings", "LinearSelfAttention", "ImageLinearAttention", "LinearImageAttention",
    "FeedForward", "Chunk", "PKM", "PatchedSelfAttention",
]
