"""mode='retention' (RetNet, Sun et al. 2023) and mode='gla' (gated linear attention, Yang et al. 2024): causal
linear attention whose state decays before every write, S_t = diag(a_t) S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ q_t / sqrt(d).
Retention's decay is a constant per head, 1 - 2^(-5 - h); GLA's is a gate per key dimension read from the key:
a_t = sigmoid(k_t W + b)^(1/16) (``functional.gated_linear``)."""
import math

import torch
from torch import nn

from ..functional.gated_linear import gated_linear_attention, gated_linear_step, log_sigmoid_gate
from ..registry import Option, positive_float, register_method
from .state_recurrence import CHUNK_OPTION, StateRecurrenceMethod, factory_kwargs_with_dtype, pairwise_log_decay


class GatedStateMethod(StateRecurrenceMethod):
    """The decaying state: ``gates`` give ``log_gate`` (B or 1, H, L or 1, d or 1)."""

    def prepare(self, q, k, state):
        return q * q.shape[-1] ** -0.5, k

    def run(self, q, k, v, gates, *, key_padding_mask, initial_state=None, output_final_state=False):
        return gated_linear_attention(q, k, v, gates["log_gate"], key_padding_mask=key_padding_mask,
                                      initial_state=initial_state, chunk_size=self.chunk_size,
                                      output_final_state=output_final_state)

    def step_once(self, q, k, v, gates, previous):
        return gated_linear_step(q, k, v, gates["log_gate"], previous)

    def implied_weights(self, q, k, gates, present):
        # weight of value j at query t: sum_d q_td k_jd prod_{j < s <= t} a_sd
        log_gate = gates["log_gate"].expand(*k.shape[:3], gates["log_gate"].shape[-1])
        decay = torch.exp(pairwise_log_decay(log_gate.cumsum(-2)))  # (B, H, L, L, G)
        return torch.einsum("...td,...jd,...tjd->...tj", q, k, decay.expand(*decay.shape[:-1], q.shape[-1]))

    def flops(self, batch_heads, tokens, head_dim, causal):
        # over the tokens padded to whole chunks of C: each chunk's writes k_to_endᵀ V and its queries against the
        # state entering it (d x d_v per token each); inside a chunk, one gate per position: the decayed scores
        # q.k and their product with the values (C per token, d each); a gate per key dimension: the halving
        # form's matmuls, C (C - 1) / 2 query-key pairs per chunk (C rounded up to a power of two), each d for the
        # score and d_v for the value; plus the gates' own projection of the keys
        chunk = self.chunk_size or 64
        if not self.scalar_gate:
            chunk = 1 << (chunk - 1).bit_length()
        padded = -(-tokens // chunk) * chunk
        within = 4.0 * chunk * head_dim if self.scalar_gate else 2.0 * (chunk - 1) * head_dim
        return batch_heads * (padded * within + 4.0 * padded * head_dim * head_dim
                              + self.gate_flops(tokens, head_dim))

    def gate_flops(self, tokens, head_dim):
        return 0.0


@register_method
class Retention(GatedStateMethod):
    name = "retention"
    scalar_gate = True
    cost = "O(N·d²)"
    summary = "causal: a state that decays by a fixed rate per head before each write (RetNet's retention)"

    def init_state(self, num_heads, head_dim, factory_kwargs):
        # RetNet's rates: head h keeps 1 - 2^(-5 - h) of its state per position (memories of ~32 to ~2^(4+H))
        rates = 1.0 - 2.0 ** (-5.0 - torch.arange(num_heads, dtype=torch.float64))
        return {"retention_log_decay": torch.log(rates).to(**factory_kwargs_with_dtype(factory_kwargs))}

    def gates(self, k, state):
        return {"log_gate": state["retention_log_decay"].to(k.dtype)[None, :, None, None]}  # (1, H, 1, 1)


@register_method
class GatedLinearAttention(GatedStateMethod):
    name = "gla"
    options = {"chunk_size": CHUNK_OPTION,
               "gate_temperature": Option(16.0, positive_float, "the gates are sigmoid(k W + b)^(1/temperature): a "
                                                                "larger value keeps more of the state")}
    scalar_gate = False
    cost = "O(N·d²)"
    summary = "causal: a state that decays by a data-dependent gate per key dimension before each write (GLA)"

    def init_state(self, num_heads, head_dim, factory_kwargs):
        weight = torch.randn(num_heads, head_dim, head_dim, **factory_kwargs) / math.sqrt(head_dim)
        return {"gla_gate_weight": nn.Parameter(weight),
                "gla_gate_bias": nn.Parameter(torch.zeros(num_heads, head_dim, **factory_kwargs))}

    def gate_flops(self, tokens, head_dim):
        return 2.0 * tokens * head_dim * head_dim  # k W per head

    def gates(self, k, state):
        logits = k @ state["gla_gate_weight"].to(k.dtype)
        return {"log_gate": log_sigmoid_gate(logits, state["gla_gate_bias"].to(k.dtype), self.gate_temperature)}
