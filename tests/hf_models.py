"""Tiny randomly initialised transformers models built from configs (nothing is downloaded), and inputs for them,
for the Hugging Face tests. Importing this needs transformers: the tests importorskip it first."""
import torch
from transformers import (BertConfig, BertModel, DeiTConfig, DeiTModel, DetrConfig, DetrForObjectDetection,
                          GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ResNetConfig, ViTConfig,
                          ViTModel)

FAMILIES = ("vit", "deit", "bert", "gpt2", "llama", "detr")
CAUSAL = ("gpt2", "llama")
VOCAB = 64


def build(family, seed=0, **overrides):
    """A two-layer model of ``family`` in float64, eval mode, seeded."""
    torch.manual_seed(seed)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "vit":
        model = ViTModel(ViTConfig(**small, image_size=32, patch_size=8, **overrides))
    elif family == "deit":
        model = DeiTModel(DeiTConfig(**small, image_size=32, patch_size=8, **overrides))
    elif family == "bert":
        model = BertModel(BertConfig(**small, vocab_size=VOCAB, max_position_embeddings=64, **overrides))
    elif family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                           bos_token_id=0, eos_token_id=0, **overrides))
    elif family == "llama":  # grouped-query attention: 4 query heads share 2 key/value heads
        model = LlamaForCausalLM(LlamaConfig(**small, vocab_size=VOCAB, num_key_value_heads=2,
                                             max_position_embeddings=128, **overrides))
    elif family == "detr":
        backbone = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                layer_type="basic", out_features=["stage2"])
        model = DetrForObjectDetection(DetrConfig(
            use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32,
            encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5, num_labels=3, **overrides))
    else:
        raise ValueError(family)
    return model.double().eval()


def inputs(family, padded=False, seed=1, batch=2, length=8):
    """Model inputs; ``padded``: text models pad sample 1 (right for BERT, left for the causal LMs, as generation
    batches are), DETR pads the right half of image 1."""
    g = torch.Generator().manual_seed(seed)
    if family in ("vit", "deit"):
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g, dtype=torch.float64)}
    if family == "detr":
        x = {"pixel_values": torch.randn(batch, 3, 64, 64, generator=g, dtype=torch.float64)}
        if padded:
            mask = torch.ones(batch, 64, 64, dtype=torch.long)
            mask[1, :, 32:] = 0
            x["pixel_mask"] = mask
        return x
    x = {"input_ids": torch.randint(1, VOCAB, (batch, length), generator=g)}
    if padded:
        mask = torch.ones(batch, length, dtype=torch.long)
        if family in CAUSAL:
            mask[1, :3] = 0
        else:
            mask[1, -3:] = 0
        x["attention_mask"] = mask
    return x


def output(model_output):
    """The tensor a family's output is judged by."""
    for name in ("logits", "last_hidden_state"):
        value = getattr(model_output, name, None)
        if value is not None:
            return value
    raise ValueError(type(model_output).__name__)
