"""AutoregressiveWrapper: next-token loss and fast sampling.

``generate`` decodes with the model's ``step``: global heads carry a recurrent state, local heads a rolling
window of 2 * window keys, token shift and the causal conv a few previous inputs. The work per new token is
therefore constant, instead of re-running the whole window per token as the original did. Every step's logits
equal those of a full forward pass over the same tokens. The prompt itself is run in one parallel pass
(the model's ``prefill``) that returns its logits and builds that same state, instead of P sequential steps.
"""
import math
import numbers
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _check_top_k(k) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k must be a positive int, got {k!r}")


def _check_top_p(p) -> None:
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits per row; the rest become -inf."""
    _check_top_k(k)
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability sums to >= p
    (the top token is always kept). The original removed tokens once the mass passed 1 - p: inverted."""
    _check_top_p(p)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove_sorted = mass_before >= p
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


class AutoregressiveWrapper(nn.Module):
    """ignore_index: target token left out of the loss (-100, cross_entropy's default and the original's: every
    token counts). pad_value: what ``generate`` writes after a row's ``eos_token``."""

    def __init__(self, net: nn.Module, ignore_index: int = -100, pad_value: int = 0):
        super().__init__()
        if not hasattr(net, "step") or not getattr(net, "causal", False):
            raise ValueError("AutoregressiveWrapper needs a causal model with a step() method, e.g. "
                             "LinearAttentionTransformerLM(..., causal=True)")
        self.net, self.pad_value, self.ignore_index = net, pad_value, ignore_index
        self.max_seq_len = net.max_seq_len

    def forward(self, x: Tensor, return_loss: bool = False, **kwargs):
        """With return_loss: mean cross-entropy of predicting x[:, 1:] from x[:, :-1]. Targets equal to
        ``ignore_index``, and with ``input_mask`` (B, N) the targets it marks False (padding), are left out; a
        mask of length N - 1 is taken as the inputs' mask only (it cannot say whether the last target is
        padding), so it hides padded inputs from attention but leaves the targets in the loss."""
        if not return_loss:
            return self.net(x, **kwargs)
        mask = kwargs.pop("input_mask", None)
        targets = x[:, 1:]
        if mask is not None and mask.shape[1] == x.shape[1]:
            targets = targets.masked_fill(~mask[:, 1:].bool(), self.ignore_index)
            mask = mask[:, :-1]
        logits = self.net(x[:, :-1], input_mask=mask, **kwargs)
        return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=self.ignore_index)

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        length: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        eos_token: Optional[int] = None,
        input_mask: Optional[Tensor] = None,
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        generator: Optional[torch.Generator] = None,
        prefill: bool = True,
    ) -> Tensor:
        """prompt (B, P) or (P,) -> the ``length`` new tokens (B, length). temperature 0 = greedy.
        ``prefill``: run the prompt through the model in one parallel pass that builds the decoding state
        (when the model has ``prefill``); False feeds it token by token (same result, P sequential steps).
        After a row emits ``eos_token`` its later tokens are ``pad_value``; decoding stops when all rows have."""
        squeeze = prompt.dim() == 1
        prompt = prompt[None] if squeeze else prompt
        if prompt.shape[1] < 1:
            raise ValueError("prompt must hold at least one token")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length (the number of tokens to generate) must be a positive int, got {length!r}")
        if prompt.shape[1] + length > self.max_seq_len + 1:
            raise ValueError(f"prompt ({prompt.shape[1]}) + length ({length}) - 1 exceeds max_seq_len={self.max_seq_len}")
        if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        if top_k is not None:  # checked up front, greedy decoding included
            _check_top_k(top_k)
        if top_p is not None:
            _check_top_p(top_p)
        was_training = self.net.training
        self.net.eval()
        try:
            result = self._decode(prompt, length, temperature, top_k, top_p, eos_token, input_mask,
                                  dict(context=context, context_mask=context_mask), generator, prefill)
        finally:  # an error while sampling must not leave a training model in eval mode (dropout off)
            self.net.train(was_training)
        return result[0] if squeeze else result

    def _decode(self, prompt, length, temperature, top_k, top_p, eos_token, input_mask, kw, generator, prefill):
        cache: dict = {}
        if prefill and hasattr(self.net, "prefill"):
            logits = self.net.prefill(prompt, cache, input_mask, **kw)[:, -1]
        else:
            for t in range(prompt.shape[1]):
                logits = self.net.step(prompt[:, t], cache, None if input_mask is None else input_mask[:, t], **kw)
        out = []
        done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for i in range(length):
            sample = self._sample(logits, temperature, top_k, top_p, generator)
            sample = torch.where(done, torch.full_like(sample, self.pad_value), sample)
            out.append(sample)
            if eos_token is not None:
                done = done | (sample == eos_token)
                if bool(done.all()):
                    break
            if i + 1 < length:
                logits = self.net.step(sample, cache, None, **kw)
        return torch.stack(out, dim=1)

    @staticmethod
    def _sample(logits, temperature, top_k, top_p, generator):
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None:
            logits = top_k_filter(logits, top_k)
        if top_p is not None:
            logits = top_p_filter(logits, top_p)
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]
