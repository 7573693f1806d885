"""The Triton kernel of causal linear attention with one decay per position (functional/triton_decayed.py), run on
CPU tensors by Triton's interpreter: outputs and the gradients of q, k, v and the gate against the float64
recurrence (forward and reversed walks, chunks that do not divide the length, value columns over several programs,
strong decays), initial and final states, no position seeing a later key, the delta rule through it, and the
chooser sending calls there only when the path is switched on."""
import pytest
import torch
import torch.nn.functional as F

from linear_mha.functional import backend, triton_causal, triton_kernel
from linear_mha.functional.delta_rule import delta_rule_attention, delta_rule_recurrent
from linear_mha.functional.gated_linear import gated_linear_attention, gated_linear_recurrent
from triton_checks import inside, relative_error


@pytest.fixture
def triton_path():
    """The Triton causal path on, the compiled CPU code off (CPU tensors would go there first)."""
    previous = triton_causal.set_enabled(True)
    with backend.override(native_kernels=False):
        yield
    triton_causal.set_enabled(previous)


def _inputs(b, h, length, d_k, d_v, seed, strength=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, h, d_k, generator=g).transpose(1, 2)  # the strided heads of a module's projection
    k = F.normalize(torch.randn(b, h, length, d_k, generator=g), dim=-1)
    v = torch.randn(b, h, length, d_v, generator=g)
    log_gate = F.logsigmoid(torch.randn(b, h, length, 1, generator=g) * strength + 2)  # data-dependent, <= 0
    return q, k, v, log_gate, g


@inside
@pytest.mark.parametrize("shape", [(2, 3, 37, 8, 5), (1, 2, 70, 24, 80), (1, 1, 1, 3, 2), (1, 2, 33, 16, 16)],
                         ids=str)
@pytest.mark.parametrize("strength", [2.0, 30.0], ids=["mild", "strong decays"])
def test_outputs_and_all_four_gradients_match_the_float64_recurrence(shape, strength, triton_path):
    """Strong decays: gates down to exp(-60), whose masked half of the chunk's exponents is far past float32's
    largest value, and whose running sums inside a chunk reach ~-1000, where float32's rounding of a difference of
    two of them is ~1e-5 of the exponent."""
    q, k, v, log_gate, g = _inputs(*shape, seed=sum(shape), strength=strength)
    assert backend.decay_backend(q, k, v, log_gate).backend == backend.TRITON
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, log_gate)]
    out = gated_linear_attention(*leaves)
    assert "DecayedCausal" in type(out.grad_fn).__name__
    references = [x.detach().double().requires_grad_() for x in (q, k, v, log_gate)]
    want, _ = gated_linear_recurrent(*references)
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    (want * weights.double()).sum().backward()
    tolerance = 2e-6 if strength < 10 else 2e-5
    assert torch.isfinite(out).all() and relative_error(out, want) < tolerance
    for name, got, ref in zip("q k v log_gate".split(), leaves, references):
        assert relative_error(got.grad, ref.grad) < 10 * tolerance, name


@inside
def test_initial_and_final_states_and_a_fixed_decay_per_head(triton_path):
    q, k, v, _, g = _inputs(2, 3, 40, 8, 6, seed=4)
    retention = torch.log1p(-2.0 ** (-1.0 - torch.arange(3.0)))[None, :, None, None]  # RetNet's fixed decays
    state = torch.randn(2, 3, 8, 6, generator=g)
    out, final = gated_linear_attention(q, k, v, retention, initial_state=state, output_final_state=True)
    want, want_final = gated_linear_recurrent(q.double(), k.double(), v.double(), retention.double(),
                                              initial_state=state.double())
    assert relative_error(out, want) < 2e-6 and relative_error(final, want_final) < 2e-6


@inside
def test_no_position_sees_a_later_key(triton_path):
    q, k, v, log_gate, _ = _inputs(1, 2, 50, 8, 4, seed=1)
    out = gated_linear_attention(q, k, v, log_gate)
    later_k, later_v, later_gate = k.clone(), v.clone(), log_gate.clone()
    later_k[:, :, 30:], later_v[:, :, 30:], later_gate[:, :, 30:] = 7.0, -3.0, -5.0
    again = gated_linear_attention(q, later_k, later_v, later_gate)
    assert torch.equal(again[:, :, :30], out[:, :, :30]) and not torch.equal(again[:, :, 30:], out[:, :, 30:])
    leaves = [x.clone().requires_grad_() for x in (q, k, v, log_gate)]
    gated_linear_attention(*leaves)[:, :, 29].sum().backward()
    assert all((leaf.grad[:, :, 30:] == 0).all() for leaf in leaves[1:])
    assert leaves[1].grad[:, :, :30].abs().sum() > 0 and leaves[3].grad[:, :, 1:30].abs().sum() > 0


@inside
def test_the_gated_delta_rule_runs_its_outputs_through_the_kernel(triton_path):
    q, k, v, log_decay, g = _inputs(2, 2, 45, 8, 8, seed=6)
    beta = torch.rand(2, 2, 45, generator=g)
    decay = log_decay[..., 0]
    out = delta_rule_attention(q, k, v, beta, decay, chunk_size=16)
    want, _ = delta_rule_recurrent(q.double(), k.double(), v.double(), beta.double(), decay.double())
    assert relative_error(out, want) < 1e-5


def test_the_chooser_sends_calls_there_only_when_it_can():
    """In the suite's process (no interpreter), CPU tensors never go to the kernel, and the reason says why."""
    q, k, v, log_gate, _ = _inputs(1, 2, 20, 8, 4, seed=2)
    with backend.override(native_kernels=False):
        choice = backend.decay_backend(q, k, v, log_gate)
        assert choice.backend == backend.COMPOSED and "LINEAR_MHA_TRITON_CAUSAL" in choice.reason
        previous = triton_causal.set_enabled(True)
        try:
            if not triton_kernel.interpreted():
                assert "CUDA" in backend.decay_backend(q, k, v, log_gate).reason
            gla = backend.decay_backend(q, k, v, log_gate.expand(-1, -1, -1, 8))
            assert gla.backend == backend.COMPOSED and "per key dimension" in gla.reason
            assert backend.decay_backend(q, k, v, -log_gate).backend == backend.COMPOSED
        finally:
            triton_causal.set_enabled(previous)
