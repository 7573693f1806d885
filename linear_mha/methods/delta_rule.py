"""mode='deltanet' (Schlag et al. 2021; Yang et al. 2024) and mode='gated_deltanet' (Yang et al. 2025): causal
linear attention whose state overwrites what a key held, S_t = a_t (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ,
o_t = S_tᵀ q_t, on queries and keys through SiLU and unit-normalised. beta_t = sigmoid(k_t . w + b) is read from the
key; gated_deltanet adds a decay a_t = exp(-softplus(k_t . w_a + b_a)) (``functional.delta_rule``)."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..functional.delta_rule import delta_rule_attention, delta_rule_step, silu_unit
from ..registry import register_method
from .state_recurrence import StateRecurrenceMethod, factory_kwargs_with_dtype, pairwise_log_decay


@register_method
class DeltaNet(StateRecurrenceMethod):
    name = "deltanet"
    decays = False
    cost = "O(N·d²)"
    summary = "causal: a state that overwrites the value a key held (the delta rule), keys of unit norm"

    def init_state(self, num_heads, head_dim, factory_kwargs):
        # beta starts at 1/2 for every key; the weights let it learn which keys to write strongly
        state = {"delta_beta_weight": nn.Parameter(torch.zeros(num_heads, head_dim, **factory_kwargs)),
                 "delta_beta_bias": nn.Parameter(torch.zeros(num_heads, **factory_kwargs))}
        if self.decays:  # Mamba-2's spread of initial rates: per-position decays exp(-rate), rates 1e-3 .. 1e-1
            rates = torch.logspace(math.log10(1e-3), math.log10(1e-1), num_heads, dtype=torch.float64)
            state["delta_decay_weight"] = nn.Parameter(torch.zeros(num_heads, head_dim, **factory_kwargs))
            state["delta_decay_bias"] = nn.Parameter(
                torch.log(torch.expm1(rates)).to(**factory_kwargs_with_dtype(factory_kwargs)))
        return state

    def prepare(self, q, k, state):
        return silu_unit(q), silu_unit(k)

    def gates(self, k, state):
        def read(name):  # (B, H, L): the key's projection on a per-head vector, plus a per-head bias
            weight, bias = state[f"delta_{name}_weight"].to(k.dtype), state[f"delta_{name}_bias"].to(k.dtype)
            return (k @ weight[:, :, None])[..., 0] + bias[:, None]  # a product: no (B, H, L, d) temporary
        gates = {"beta": torch.sigmoid(read("beta"))}
        if self.decays:
            gates["log_decay"] = -F.softplus(read("decay"))
        return gates

    def _dropped(self, v, gates, dropout_p):
        # dropping a value would write "forget what this key held" instead; a dropped position writes nothing
        if dropout_p <= 0.0:
            return v, gates
        keep = torch.empty_like(gates["beta"]).bernoulli_(1.0 - dropout_p)
        return v, {**gates, "beta": gates["beta"] * keep}

    def run(self, q, k, v, gates, *, key_padding_mask, initial_state=None, output_final_state=False):
        return delta_rule_attention(q, k, v, gates["beta"], gates.get("log_decay"), key_padding_mask=key_padding_mask,
                                    initial_state=initial_state, chunk_size=self.chunk_size,
                                    output_final_state=output_final_state)

    def step_once(self, q, k, v, gates, previous):
        return delta_rule_step(q, k, v, gates["beta"], gates.get("log_decay"), previous)

    def implied_weights(self, q, k, gates, present):
        # O = (Q Kᵀ ∘ Γ) (I + A)^-1 diag(beta) V over the whole sequence: A_tj = beta_t Γ_tj k_t.k_j (j < t), Γ the
        # decay from j to t; the pseudo-values U = (I + A)^-1 diag(beta) V make the recurrence's writes
        beta = gates["beta"].expand(k.shape[:3])
        log_decay = gates.get("log_decay", torch.zeros_like(beta)).expand(k.shape[:3])
        decay = torch.exp(pairwise_log_decay(log_decay.cumsum(-1)[..., None]))[..., 0]  # (B, H, L, L)
        length = k.shape[2]
        strictly = torch.ones(length, length, dtype=torch.bool, device=k.device).tril(-1)
        system = torch.eye(length, dtype=k.dtype, device=k.device) + (
            beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strictly, 0.0)
        writes = torch.linalg.solve(system, torch.diag_embed(beta))  # (B, H, L, L)
        return ((q @ k.transpose(-1, -2)) * decay) @ writes

    def flops(self, batch_heads, tokens, head_dim, causal):
        # over the tokens padded to whole chunks of C: K Kᵀ, Q Kᵀ and the scores times U (C per token, d each), the
        # unit-triangular solve for W and U (C - 1 multiply-adds per token and right-hand column, d + d_v
        # columns), the pass over chunks W S and Kᵀ U, and the outputs' Q S and Kᵀ U again (the outputs are the
        # decayed product of Q, K and U, which carries its own state: d x d_v per token each), and the gates' reads of
        # the keys (a product of d per token for beta, and one for the decay)
        chunk = self.chunk_size or 64
        padded = -(-tokens // chunk) * chunk
        reads = 2.0 if self.decays else 1.0
        return batch_heads * (padded * (6.0 * chunk * head_dim + 2.0 * (chunk - 1) * head_dim
                                        + 8.0 * head_dim * head_dim) + reads * 2.0 * tokens * head_dim)


@register_method
class GatedDeltaNet(DeltaNet):
    name = "gated_deltanet"
    decays = True
    summary = "causal: the delta rule with a data-dependent decay of the state per position (Gated DeltaNet)"
