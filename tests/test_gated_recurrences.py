"""The decaying and delta-rule recurrences (functional.gated_linear, functional.delta_rule): the chunked training
forms against the recurrence written out with explicit matrices in float64, their gradients, initial and final
states, masks as identity steps, causality, and strong decays in float32."""
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from linear_mha.functional.delta_rule import delta_rule_attention, delta_rule_recurrent, delta_rule_step
from linear_mha.functional.gated_linear import (gated_linear_attention, gated_linear_recurrent,
                                                gated_linear_step)

B, H, L, DK, DV = 2, 3, 37, 8, 5
F64 = torch.float64
CHUNKS = [1, 5, 16, 64]  # one position, neither dividing L nor a power of two, shorter than L, longer than L


def _inputs(seed=0, dtype=F64, length=L):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, DK, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, H, length, DK, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, length, DV, generator=g, dtype=dtype)
    return q, k, v, g


def _explicit_gated(q, k, v, log_gate, state):
    """S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ q_t with the diagonal matrix formed."""
    log_gate, outs = log_gate.expand(*q.shape[:3], log_gate.shape[-1]), []
    for t in range(q.shape[2]):
        gate = torch.diag_embed(torch.exp(log_gate[:, :, t]).expand(*q.shape[:2], q.shape[-1]))
        state = gate @ state + k[:, :, t, :, None] @ v[:, :, t, None, :]
        outs.append((state.transpose(-1, -2) @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, 2), state


def _explicit_delta(q, k, v, beta, log_decay, state):
    """S_t = a_t (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ with the matrices formed."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[2]):
        kt, b = k[:, :, t, :, None], beta[:, :, t, None, None]
        a = torch.exp(log_decay[:, :, t])[..., None, None]
        state = a * (eye - b * kt @ kt.transpose(-1, -2)) @ state + b * kt @ v[:, :, t, None, :]
        outs.append((state.transpose(-1, -2) @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, 2), state


def _gates(kind, g, dtype=F64, length=L):
    if kind == "per_dimension":  # GLA
        return F.logsigmoid(torch.randn(B, H, length, DK, generator=g, dtype=dtype) + 2)
    if kind == "scalar":  # Mamba-2's decay
        return F.logsigmoid(torch.randn(B, H, length, 1, generator=g, dtype=dtype) + 2)
    return torch.log1p(-2.0 ** (-5.0 - torch.arange(H, dtype=dtype)))[None, :, None, None]  # RetNet's retention


GATES = ["per_dimension", "scalar", "fixed_per_head"]


@pytest.mark.parametrize("kind", GATES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_gated_chunks_match_the_recurrence(kind, chunk):
    q, k, v, g = _inputs()
    log_gate = _gates(kind, g)
    s0 = torch.randn(B, H, DK, DV, generator=g, dtype=F64)
    want, want_state = _explicit_gated(q, k, v, log_gate, s0)
    out, state = gated_linear_attention(q, k, v, log_gate, initial_state=s0, chunk_size=chunk,
                                        output_final_state=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, want_state, rtol=1e-10, atol=1e-10)
    rec, rec_state = gated_linear_recurrent(q, k, v, log_gate, initial_state=s0)
    torch.testing.assert_close(rec, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rec_state, want_state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_delta_rule_chunks_match_the_recurrence(gated, chunk):
    q, k, v, g = _inputs(1)
    beta = torch.rand(B, H, L, generator=g, dtype=F64)
    log_decay = F.logsigmoid(torch.randn(B, H, L, generator=g, dtype=F64) + 2) if gated else None
    s0 = torch.randn(B, H, DK, DV, generator=g, dtype=F64)
    want, want_state = _explicit_delta(q, k, v, beta, log_decay if gated else torch.zeros_like(beta), s0)
    out, state = delta_rule_attention(q, k, v, beta, log_decay, initial_state=s0, chunk_size=chunk,
                                      output_final_state=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, want_state, rtol=1e-10, atol=1e-10)
    rec, rec_state = delta_rule_recurrent(q, k, v, beta, log_decay, initial_state=s0)
    torch.testing.assert_close(rec, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rec_state, want_state, rtol=1e-10, atol=1e-10)


def test_the_delta_rule_recalls_the_latest_value_of_a_key():
    """The property it exists for: writing a key twice with beta = 1 leaves only the second value under it."""
    k = F.normalize(torch.randn(1, 1, 1, DK, dtype=F64), dim=-1).expand(1, 1, 2, DK)
    v = torch.randn(1, 1, 2, DV, dtype=F64)
    out = delta_rule_attention(k, k, v, torch.ones(1, 1, 2, dtype=F64))
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 1])


class Recurrence(NamedTuple):
    chunked: Callable    # the training form: (q, k, v, *per_position, **options) -> out [, state]
    recurrent: Callable  # the reference: (q, k, v, *per_position, **masks) -> (out, state)
    step: Callable       # one position: (q_t, k_t, v_t, *per_position_t, state) -> (o_t, state)
    draw: Callable       # (generator, length) -> its per-position tensors, (B, H, L, ...) each


RECURRENCES = {
    "gated": Recurrence(gated_linear_attention, gated_linear_recurrent, gated_linear_step,
                        lambda g, length: (_gates("per_dimension", g, length=length),)),
    "delta": Recurrence(delta_rule_attention, delta_rule_recurrent, delta_rule_step,
                        lambda g, length: (torch.rand(B, H, length, generator=g, dtype=F64),
                                           -torch.rand(B, H, length, generator=g, dtype=F64))),
}


def _positions(params, which):
    """The per-position tensors at ``which`` (a slice or an index of the sequence)."""
    return tuple(p[:, :, which] for p in params)


@pytest.mark.parametrize("name", RECURRENCES)
def test_a_final_state_continues_exactly(name):
    """Prefill hands decoding its state: the sequence in two calls equals one call, and steps equal the chunks."""
    recurrence = RECURRENCES[name]
    q, k, v, g = _inputs(2)
    params = recurrence.draw(g, L)
    whole = recurrence.chunked(q, k, v, *params, chunk_size=16)
    cut = 21
    first, state = recurrence.chunked(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], *_positions(params, slice(0, cut)),
                                      chunk_size=16, output_final_state=True)
    second = recurrence.chunked(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], *_positions(params, slice(cut, None)),
                                initial_state=state, chunk_size=16)
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole, rtol=1e-10, atol=1e-10)
    state, outs = None, []
    for t in range(L):
        out, state = recurrence.step(q[:, :, t], k[:, :, t], v[:, :, t], *_positions(params, t), state)
        outs.append(out)
    torch.testing.assert_close(torch.stack(outs, 2), whole, rtol=1e-10, atol=1e-10)


def _run(name, q, k, v, params, **kwargs):
    return RECURRENCES[name].chunked(q, k, v, *params, chunk_size=8, **kwargs)


@pytest.mark.parametrize("name", RECURRENCES)
def test_gradients_match_finite_differences(name):
    q, k, v, g = _inputs(3, length=11)
    params = [p[:1, :2].detach().requires_grad_() for p in RECURRENCES[name].draw(g, 11)]  # one sequence, two heads
    inputs = [x[:1, :2].detach().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda q, k, v, *params: _run(name, q, k, v, params), (*inputs, *params),
                                    eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", RECURRENCES)
def test_masked_positions_reach_no_output_and_no_gradient(name):
    q, k, v, g = _inputs(4)
    params = RECURRENCES[name].draw(g, L)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, :5], mask[1, [9, 20]] = True, True  # left padding and holes
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = _run(name, q, k, v, params, key_padding_mask=mask)
    garbage_k, garbage_v = k.detach().clone(), v.detach().clone()
    garbage_k[mask[:, None].expand(B, H, L)], garbage_v[mask[:, None].expand(B, H, L)] = 1e4, float("nan")
    again = _run(name, q, garbage_k, garbage_v, params, key_padding_mask=mask)
    kept = ~mask[:, None, :, None].expand(B, H, L, DV)
    torch.testing.assert_close(again[kept], out[kept].detach(), rtol=1e-10, atol=1e-10)
    out.masked_fill(~kept, 0).sum().backward()
    pad = mask[:, None].expand(B, H, L)
    assert k.grad[pad].abs().max() == 0 and v.grad[pad].abs().max() == 0
    removed = ~mask[1]  # the holes of sequence 1 are identity steps: the sequence without them gives the same
    shorter = _run(name, q[1:, :, removed], k[1:, :, removed].detach(), v[1:, :, removed].detach(),
                   [p[1:, :, removed] for p in params])
    torch.testing.assert_close(shorter[0], out[1, :, removed].detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", RECURRENCES)
def test_no_position_sees_the_future(name):
    q, k, v, g = _inputs(5)
    params = RECURRENCES[name].draw(g, L)
    out = _run(name, q, k, v, params)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:], v2[:, :, 20:] = torch.randn_like(k2[:, :, 20:]), torch.randn_like(v2[:, :, 20:])
    torch.testing.assert_close(_run(name, q, k2, v2, params)[:, :, :20], out[:, :, :20], rtol=0, atol=0)


def test_strong_decays_stay_finite_in_low_precision():
    """Gates near zero over long chunks: the cumulative decay reaches exp(-3000); formed as exp(b_i - b_j) <= 1
    nothing overflows, where a form that divides by the cumulative decay would give inf and NaN."""
    q, k, v, g = _inputs(6, dtype=torch.float32, length=200)
    log_gate = torch.full((B, H, 200, DK), -15.0)
    strong = {"gated": (log_gate,), "delta": (torch.ones(B, H, 200), log_gate[..., 0])}
    for name, extra in strong.items():
        recurrence = RECURRENCES[name]
        for dtype in (torch.float32, torch.bfloat16):
            out = recurrence.chunked(q.to(dtype), k.to(dtype), v.to(dtype), *(x.to(dtype) for x in extra),
                                     chunk_size=64)
            assert out.dtype == dtype and torch.isfinite(out).all()
            reference = recurrence.recurrent(q.double(), k.double(), v.double(), *(x.double() for x in extra))[0]
            torch.testing.assert_close(out.double(), reference, rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_refused_naming_the_argument():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="log_gate must be"):
        gated_linear_attention(q, k, v, torch.zeros(B, H, L, 3, dtype=F64))
    with pytest.raises(ValueError, match="beta must be"):
        delta_rule_attention(q, k, v, torch.zeros(B, H, L, 1, dtype=F64))
    with pytest.raises(ValueError, match="initial_state must be"):
        delta_rule_attention(q, k, v, torch.zeros(B, H, L, dtype=F64), initial_state=torch.zeros(B, H, DV, DK))
