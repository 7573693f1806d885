"""The compiled causal product with one decay per position (csrc/decayed_attention.c, functional.native_decayed):
float32 outputs and the gradients of q, k, v and the gate against the recurrence in float64, across the C code's
48-row chunks, in the heads' strided layouts, with initial and final states, masks, strong decays, and which
calls the backend sends there."""
import pytest
import torch
import torch.nn.functional as F

from linear_mha.functional import backend, native
from linear_mha.functional.delta_rule import delta_rule_attention, delta_rule_recurrent
from linear_mha.functional.gated_linear import gated_linear_attention, gated_linear_recurrent

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no compiled code: {native.build_error()}")

B, H, DK, DV = 2, 3, 12, 7
LENGTHS = [1, 48, 113]  # one position, one whole chunk of the C code, two chunks and a part


def _inputs(length, seed=0, gate="scalar"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, DK, generator=g)
    k = F.normalize(torch.randn(B, H, length, DK, generator=g), dim=-1)
    v = torch.randn(B, H, length, DV, generator=g)
    if gate == "scalar":  # data-dependent, one per head and position (Mamba-2's decay)
        log_gate = F.logsigmoid(torch.randn(B, H, length, 1, generator=g) + 2)
    else:  # fixed per head (RetNet's retention), broadcast over batch and positions
        log_gate = torch.log1p(-2.0 ** (-1.0 - torch.arange(H, dtype=torch.float32)))[None, :, None, None]
    return q, k, v, log_gate


def _reference(q, k, v, log_gate, **kwargs):
    return gated_linear_recurrent(q.double(), k.double(), v.double(), log_gate.double(), **kwargs)


def test_the_backend_sends_scalar_gates_in_float32_to_the_compiled_code_and_says_why_not_otherwise():
    q, k, v, log_gate = _inputs(20)
    assert backend.decay_backend(q, k, v, log_gate).backend == backend.NATIVE
    per_dimension = backend.decay_backend(q, k, v, log_gate.expand(B, H, 20, DK))
    assert per_dimension.backend == backend.NATIVE and "per key dimension" in per_dimension.reason
    assert backend.decay_backend(q.double(), k.double(), v.double(), log_gate).backend == backend.COMPOSED
    growing = backend.decay_backend(q, k, v, -log_gate)
    assert growing.backend == backend.COMPOSED and "positive" in growing.reason
    with backend.override(native_kernels=False):
        assert backend.decay_backend(q, k, v, log_gate).backend == backend.COMPOSED


@pytest.mark.parametrize("gate", ["scalar", "fixed_per_head"])
@pytest.mark.parametrize("length", LENGTHS)
def test_outputs_and_all_four_gradients_match_the_float64_recurrence(length, gate):
    q, k, v, log_gate = _inputs(length, gate=gate)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, log_gate)]
    out = gated_linear_attention(*inputs)
    want, _ = _reference(*[x.detach().requires_grad_() for x in (q, k, v, log_gate)])
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    references = [x.double().requires_grad_() for x in (q, k, v, log_gate)]
    (_reference(*references)[0] * weights.double()).sum().backward()
    for name, got, ref in zip("q k v log_gate".split(), inputs, references):  # a fixed gate's sums many terms
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-5 * ref.grad.abs().max(),
                                   msg=f"gradient of {name}")


def test_the_heads_strided_layout_of_a_projection_gives_the_same_as_contiguous_heads():
    """A module splits its heads from one (B, L, H * d) projection: (B, H, L, d) views whose positions are H * d
    apart. The C code reads those strides; a mistake there mixes heads or positions."""
    q, k, v, log_gate = _inputs(113, seed=1)
    laid_out = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert laid_out[0].stride(2) == H * DK
    torch.testing.assert_close(gated_linear_attention(*laid_out, log_gate), gated_linear_attention(q, k, v, log_gate),
                               rtol=0, atol=0)


def test_an_initial_state_and_the_final_state_match_the_recurrence():
    q, k, v, log_gate = _inputs(113, seed=2)
    s0 = torch.randn(B, H, DK, DV, generator=torch.Generator().manual_seed(3))
    inputs = [x.clone().requires_grad_() for x in (q, k, v, log_gate, s0)]
    out, state = gated_linear_attention(*inputs[:4], initial_state=inputs[4], output_final_state=True)
    references = [x.double().requires_grad_() for x in (q, k, v, log_gate, s0)]
    want, want_state = _reference(*references[:4], initial_state=references[4])
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_state.detach(), rtol=1e-5, atol=1e-5)
    (out.sum() + state.sum()).backward()
    (want.sum() + want_state.sum()).backward()
    for got, ref in zip(inputs, references):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-5 * ref.grad.abs().max())


def test_masked_positions_reach_no_output_and_no_gradient():
    q, k, v, log_gate = _inputs(113, seed=4)
    mask = torch.zeros(B, 113, dtype=torch.bool)
    mask[0, :30], mask[1, [50, 97]] = True, True
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = gated_linear_attention(q, k, v, log_gate, key_padding_mask=mask)
    want, _ = _reference(q, k, v, log_gate, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    poisoned_k, poisoned_v = k.detach().clone(), v.detach().clone()
    poisoned_k[mask[:, None].expand(B, H, 113)], poisoned_v[mask[:, None].expand(B, H, 113)] = 1e4, float("nan")
    torch.testing.assert_close(gated_linear_attention(q, poisoned_k, poisoned_v, log_gate, key_padding_mask=mask),
                               out.detach(), rtol=0, atol=0)
    out.sum().backward()
    pad = mask[:, None].expand(B, H, 113)
    assert k.grad[pad].abs().max() == 0 and v.grad[pad].abs().max() == 0


def test_no_position_sees_the_future():
    q, k, v, log_gate = _inputs(113, seed=5)
    out = gated_linear_attention(q, k, v, log_gate)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 60:], v2[:, :, 60:] = 100.0, float("nan")
    torch.testing.assert_close(gated_linear_attention(q, k2, v2, log_gate)[:, :, :60], out[:, :, :60], rtol=0, atol=0)


def test_strong_decays_over_a_long_sequence_stay_finite_and_exact():
    """Gates of exp(-15) over 4,000 positions: the running log decay reaches -60,000, far past where a difference
    of running totals keeps its digits in float32; the C code sums gates within a chunk only."""
    q, k, v, _ = _inputs(4000, seed=6)
    log_gate = torch.full((B, H, 4000, 1), -15.0)
    log_gate[:, :, ::7] = -0.01  # some weak gates among them, whose short memory must come out exact
    out = gated_linear_attention(q, k, v, log_gate)
    assert torch.isfinite(out).all()
    want, _ = _reference(q[:, :1], k[:, :1], v[:, :1], log_gate[:, :1])
    torch.testing.assert_close(out[:, :1].double(), want, rtol=1e-4, atol=1e-4)  # 48 gates summed: ulps of 700


@pytest.mark.parametrize("gated", [False, True])
def test_the_delta_rule_in_the_compiled_code_matches_the_float64_recurrence(gated):
    """DeltaNet and Gated DeltaNet over three chunks of 64 (the last a part), an initial and the final state: the
    systems' inverses and the pass from chunk to chunk run compiled, the outputs through the decayed product."""
    length = 150
    q, k, v, _ = _inputs(length, seed=7)
    g = torch.Generator().manual_seed(8)
    beta = torch.rand(B, H, length, generator=g)
    log_decay = F.logsigmoid(torch.randn(B, H, length, generator=g) + 3) if gated else None
    s0 = torch.randn(B, H, DK, DV, generator=g)
    assert backend.delta_rule_backend(q, k, v, s0).backend == backend.NATIVE
    given = [q, k, v, beta, log_decay, s0]
    inputs = [None if x is None else x.clone().requires_grad_() for x in given]
    references = [None if x is None else x.double().requires_grad_() for x in given]
    out, state = delta_rule_attention(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    want, want_state = delta_rule_recurrent(*references[:5], initial_state=references[5])
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.double(), want_state.detach(), rtol=1e-4, atol=1e-4)
    weights = torch.randn(out.shape, generator=g)
    ((out * weights).sum() + state.sum()).backward()
    ((want * weights.double()).sum() + want_state.sum()).backward()
    for name, got, ref in zip("q k v beta log_decay initial_state".split(), inputs, references):
        if ref is not None:
            torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-5 * ref.grad.abs().max(),
                                       msg=f"gradient of {name}")


@pytest.mark.parametrize("length", [1, 16, 53])
def test_a_gate_per_key_dimension_in_the_compiled_code_matches_the_float64_recurrence(length):
    """GLA's gate per key dimension, position by position in C: outputs, final state and the gradients of all five
    inputs against the recurrence in float64, over stretches of 16 kept states (one, a whole one, several and a
    part), with strong and weak decays side by side, strided heads and a gate expanded over the batch."""
    g = torch.Generator().manual_seed(length)
    q, k, v, _ = _inputs(length, seed=length)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # positions H * d apart, as a projection lays them out
    log_gate = F.logsigmoid(torch.randn(1, H, length, DK, generator=g) * 3 + 1).expand(B, H, length, DK)
    s0 = torch.randn(B, H, DK, DV, generator=g)
    assert backend.decay_backend(q, k, v, log_gate).backend == backend.NATIVE
    given = [q, k, v, log_gate, s0]
    inputs = [x.detach().clone().requires_grad_() for x in given]
    references = [x.detach().double().requires_grad_() for x in given]
    out, state = gated_linear_attention(*inputs[:4], initial_state=inputs[4], output_final_state=True)
    want, want_state = gated_linear_recurrent(*references[:4], initial_state=references[4])
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_state.detach(), rtol=1e-5, atol=1e-5)
    weights = torch.randn(out.shape, generator=g)
    ((out * weights).sum() + (state * state).sum()).backward()
    ((want * weights.double()).sum() + (want_state * want_state).sum()).backward()
    for name, got, ref in zip("q k v log_gate initial_state".split(), inputs, references):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-5 * ref.grad.abs().max(),
                                   msg=f"gradient of {name}")


@pytest.mark.parametrize("which", ["scalar_gate", "gate_per_dimension", "delta_rule"])
def test_an_initial_state_broadcast_over_the_batch_or_in_float64_matches_the_pytorch_ops(which):
    """The compiled paths read the initial state as (B, H, d_k, d_v) float32: one shared by the batch (1, H, ...)
    or given in float64 must give what the PyTorch ops give (it once read past the end, or float64 bytes as
    float32), gradient included; a state of the wrong heads is refused, naming the argument."""
    g = torch.Generator().manual_seed(11)
    q, k, v, log_gate = _inputs(70, seed=11)
    if which == "gate_per_dimension":
        log_gate = F.logsigmoid(torch.randn(B, H, 70, DK, generator=g) + 2)
    beta = torch.rand(B, H, 70, generator=g)

    def run(initial_state):
        if which == "delta_rule":
            return delta_rule_attention(q, k, v, beta, initial_state=initial_state, output_final_state=True)
        return gated_linear_attention(q, k, v, log_gate, initial_state=initial_state, output_final_state=True)

    for s0 in (torch.randn(1, H, DK, DV, generator=g), torch.randn(B, H, DK, DV, generator=g).double()):
        compiled_leaf = s0.clone().requires_grad_()
        out, state = run(compiled_leaf)
        (out.sum() + state.sum()).backward()
        composed_leaf = s0.clone().requires_grad_()
        with backend.override(native_kernels=False):
            want, want_state = run(composed_leaf)
        (want.sum() + want_state.sum()).backward()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), want_state.double(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(compiled_leaf.grad, composed_leaf.grad, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="initial_state"):
        run(torch.randn(B, H + 1, DK, DV))
