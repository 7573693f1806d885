"""What the causal-only methods share: a (d_k, d_v) state per head, read and rewritten position by position in
sequence order (retention, gla, deltanet, gated_deltanet). They have no non-causal form: ``bidirectional = False``.

A method of this family says how it prepares its queries and keys and computes its gates from the key heads (the
gates read the keys' projection of the input, so the module keeps nn.MultiheadAttention's parameters and adds only
the gates' own), and which recurrence of ``functional`` runs. Training runs the chunked form; decoding keeps the
state (O(1) per token); the naive reference forms the implied (L, L) weights from the definition in closed form.
Their output is the state read by the query, not normalised: the papers follow it with a per-head norm and an output
gate (the modules' ``output_gate``).
"""
import torch

from ..functional._common import drop_keys
from ..registry import AttentionMethod, Option, causal_only_message, optional, positive_int

CHUNK_OPTION = Option(None, optional(positive_int), "chunk length of the training form (default: the function's)")


class StateRecurrenceMethod(AttentionMethod):
    options = {"chunk_size": CHUNK_OPTION}
    causal = True
    bidirectional = False
    recurrent = True

    @property
    def self_attention_only(self):
        return True  # the state runs along one sequence: queries and keys are its positions

    # ------------------------------------------------------------------ what a method of the family says
    def prepare(self, q, k, state):
        """(queries, keys) as the recurrence reads them, from the heads (B, H, L, d)."""
        raise NotImplementedError

    def gates(self, k, state):
        """The recurrence's per-position parameters from the raw key heads k (B, H, L, d): a dict of the keyword
        arguments of ``run`` and ``step_once`` (e.g. log_gate, beta, log_decay)."""
        raise NotImplementedError

    def run(self, q, k, v, gates, *, key_padding_mask, initial_state=None, output_final_state=False):
        """The chunked recurrence over (B, H, L, ·)."""
        raise NotImplementedError

    def step_once(self, q, k, v, gates, previous):
        """One position (B, H, ·): (out, new state)."""
        raise NotImplementedError

    def implied_weights(self, q, k, gates, present):
        """The (B, H, L, L) weights of the outputs over the values, naively in closed form; ``present`` (B, 1, L)
        bool, False at masked positions (identity steps)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ attention
    def _dropped(self, v, gates, dropout_p):
        """Attention dropout: a dropped position writes nothing (its value is dropped, the rest scaled)."""
        return drop_keys(v, dropout_p), gates

    def attend(self, q, k, v, state, *, key_padding_mask=None, causal=False, dropout_p=0.0):
        if not causal:
            raise ValueError(causal_only_message(self.name))
        gates = self.gates(k, state)
        v, gates = self._dropped(v, gates, dropout_p)
        q, k = self.prepare(q, k, state)
        return self.run(q, k, v, gates, key_padding_mask=key_padding_mask)

    # ------------------------------------------------------------------ decoding: the (B, H, d_k, d_v) state
    def prefill(self, q, k, v, state, cache, *, key_padding_mask=None):
        gates = self.gates(k, state)
        q, k = self.prepare(q, k, state)
        out, cache["state"] = self.run(q, k, v, gates, key_padding_mask=key_padding_mask, output_final_state=True)
        return out

    def step(self, q, k, v, state, cache, *, padding=None):
        gates = self.gates(k[:, :, None], state)
        q, k = self.prepare(q[:, :, None], k[:, :, None], state)
        if padding is not None:  # a padded position is an identity step, as in the chunked form
            gates = identity_steps(gates, padding[:, None, None])
            k, v = k.masked_fill(padding[:, None, None, None], 0.0), v.masked_fill(padding[:, None, None], 0.0)
        previous = cache.get("state")
        out, cache["state"] = self.step_once(q[:, :, 0], k[:, :, 0], v, {key: g[:, :, 0] for key, g in gates.items()},
                                             previous)
        return out

    # ------------------------------------------------------------------ facts
    def reference_weights(self, q, k, state, *, key_padding_mask=None, causal=False, token_grid=None):
        if not causal:
            raise ValueError(causal_only_message(self.name))
        gates = self.gates(k, state)
        q, k = self.prepare(q, k, state)
        present = torch.ones(k.shape[0], 1, k.shape[2], dtype=torch.bool, device=k.device)
        if key_padding_mask is not None:
            present = present & ~key_padding_mask[:, None, :]
            gates = identity_steps(gates, ~present)
            k = k.masked_fill(~present[..., None], 0.0)
        return self.implied_weights(q, k, gates, present)


def identity_steps(gates, masked):
    """The gates with the ``masked`` positions (bool, broadcastable to (B, H, L)) made identity steps: no decay
    (log gates 0) and no write strength (beta 0): every gate of the family is neutral at 0."""
    return {key: g.masked_fill(masked[..., None] if g.dim() == 4 else masked, 0.0) for key, g in gates.items()}


def factory_kwargs_with_dtype(factory_kwargs):
    """The module's factory kwargs with its dtype made explicit: tensors computed in float64 (the decay rates) are
    then stored in the dtype of the module's other parameters, not left in float64."""
    return {**factory_kwargs, "dtype": factory_kwargs.get("dtype") or torch.get_default_dtype()}


def pairwise_log_decay(cumulative):
    """b_t - b_j for key j <= query t, -inf above the diagonal: (B, H, L, G) cumulative log decays -> (B, H, L, L, G)
    (exp of it: the decay from j to t, <= 1)."""
    length = cumulative.shape[-2]
    pair = cumulative[..., :, None, :] - cumulative[..., None, :, :]
    later = torch.ones(length, length, dtype=torch.bool, device=cumulative.device).triu(1)
    return pair.masked_fill(later[..., None], float("-inf"))
