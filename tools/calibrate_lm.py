"""The causal-LM case of tools.calibrate_bench: a byte-level language model trained here on the Python standard
library's sources (the corpus of tools/train_lm.py), then patched with a linear method and calibrated. Two models
(--lm): ``torch``, built the way users build one on ``torch.nn.TransformerEncoder`` with a causal mask, and
``stack``, this library's own exact-softmax LM (tools.train_lm's --variant softmax: every head local with a window
as long as the sequence), whose SelfAttention patch() converts through linear_mha.lm.PatchedSelfAttention.

The metric is bits per byte on held-out text (lower is better); ``kept`` is the original model's bits per byte
over the patched model's, so 1.0 means as good as softmax and 0.9 means 11% more bits per byte.
"""
import argparse
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from linear_mha import calibrate, patch

from .calibrate_stages import calibration_stages, train_one_cycle
from .hf_models import byte_llama
from .train_lm import build_model, stdlib_corpus

SEQ_LEN, BATCH, CORPUS_BYTES = 128, 32, 2_000_000


class TorchCausalLM(nn.Module):
    """Bytes (B, N <= seq_len) -> next-byte logits (B, N, 256); pre-norm nn.TransformerEncoder, causal mask."""

    def __init__(self, dim: int = 128, depth: int = 2, heads: int = 4, seq_len: int = SEQ_LEN):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.encoder(self.embed(tokens) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build_lm(kind: str) -> nn.Module:
    """The softmax LM to convert, both of the same size (dim 128, 2 layers, 4 heads, 128-byte context)."""
    if kind == "torch":
        return TorchCausalLM()
    if kind == "stack":
        return build_model(argparse.Namespace(variant="softmax", dim=128, depth=2, heads=4, seq_len=SEQ_LEN,
                                              global_mode=None, global_option=None, shift_tokens=False))
    if kind == "hf":
        return byte_llama(SEQ_LEN)
    raise ValueError(f"--lm must be 'torch', 'stack' or 'hf', got {kind!r}")


def text_splits():
    """(train, validation) byte tensors: the first 90% and the last 10% of the corpus, the same for every seed."""
    data = torch.frombuffer(bytearray(stdlib_corpus(CORPUS_BYTES)), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def windows(data, count, seed):
    """``count`` batches of BATCH windows of SEQ_LEN + 1 bytes (inputs and next-byte targets) at seeded offsets."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - SEQ_LEN - 1, (count, BATCH), generator=g)
    return [torch.stack([data[s:s + SEQ_LEN + 1] for s in row.tolist()]) for row in starts]


def next_byte_loss(model, window):
    logits = model(window[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def bits_per_byte(model, batches):
    model.eval()
    return sum(float(next_byte_loss(model, w)) for w in batches) / len(batches) / math.log(2)


def lm_records(a, seed):
    """Records (bits per byte) of one seed: the softmax LM, plain patch, calibration steps, calibration +
    fine-tuning, and fine-tuning alone for the same total steps."""
    train_data, val_data = text_splits()
    torch.manual_seed(seed)
    original = train_one_cycle(build_lm(a.lm), windows(train_data, a.train_steps, seed), next_byte_loss,
                               a.train_steps, 2e-3, 0.01, desc=f"softmax LM ({a.lm}), seed {seed}")
    held_out = windows(val_data, 16, 10_000 + seed)
    base = bits_per_byte(original, held_out)
    records = [dict(seed=seed, stage="softmax (original)", calibration_steps=0, finetune_steps=0, bpb=base)]
    inputs = [w[:, :-1] for w in windows(train_data, 64, 20_000 + seed)]
    pairs = windows(train_data, max(a.finetune_after + a.finetune_steps, 1), 30_000 + seed)

    def finetune(model, steps):
        calibrate(model, pairs, steps=0, eval_batches=0, finetune_steps=steps, finetune_lr=a.finetune_lr,
                  forward=lambda m, b: m(b[:, :-1]), loss_fn=next_byte_loss, seed=seed, progress=False)

    records += calibration_stages(a, seed, original, inputs, finetune, "bpb",
                                  lambda model: bits_per_byte(model, held_out))
    model = copy.deepcopy(original)
    patch(model, a.mode, **a.options)
    finetune(model, a.finetune_after + a.finetune_steps)
    records.append(dict(seed=seed, stage="fine-tuned without calibration", calibration_steps=0,
                        finetune_steps=a.finetune_after + a.finetune_steps, bpb=bits_per_byte(model, held_out)))
    for r in records:
        r["kept"] = base / r["bpb"]
        r["fraction_of_training_steps"] = (r["calibration_steps"] + r["finetune_steps"]) / a.train_steps
    return records
