"""Small transformers models the tools train here (nothing is downloaded), wrapped to take and give plain tensors as
the tools' other models do: a ViT classifier of the digits and a Llama-style byte LM, the sizes of the timm ViT and
the byte LMs of tools.calibrate_bench, so the conversions compare."""
import torch
from torch import nn


class LogitsOnly(nn.Module):
    """A transformers model called with one tensor (``pixel_values`` or ``input_ids``), returning its logits."""

    def __init__(self, model: nn.Module, input_name: str):
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, x):
        return self.model(**{self.input_name: x}).logits


def vit_classifier(seed: int, image_size: int = 32, channels: int = 1, classes: int = 10) -> nn.Module:
    """transformers' ViTForImageClassification: 4 layers of 96 (4 heads of 24), 4 x 4 patches, no dropout."""
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=96, num_hidden_layers=4, num_attention_heads=4, intermediate_size=192,
                       image_size=image_size, patch_size=4, num_channels=channels, num_labels=classes,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return LogitsOnly(ViTForImageClassification(config), "pixel_values")


def byte_llama(seq_len: int, dim: int = 128, depth: int = 2, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """transformers' LlamaForCausalLM on bytes: RoPE, grouped-query attention (4 query heads, 2 key/value heads),
    SwiGLU; the dim, depth and heads of the other byte LMs."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=depth,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return LogitsOnly(LlamaForCausalLM(config), "input_ids")
