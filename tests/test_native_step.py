"""The compiled decoding step (native.kernel_step, csrc's lm_kernel_step_f32) against the composed step and causal
attention, the inputs it leaves to the PyTorch step, and its in-place state update."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import native

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def relative_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("d,dv", [(64, 64), (13, 40), (8, 3)])
def test_step_matches_the_composed_step_and_causal_attention(feature_map, d, dv):
    g = torch.Generator().manual_seed(d + dv)
    q, k = (torch.randn(2, 3, 5, d, generator=g) for _ in range(2))
    v = torch.randn(2, 3, 5, dv, generator=g)
    outs, state = [], None
    with torch.inference_mode():
        for i in range(5):
            out, new_state = LF.kernel_step(q[:, :, i], k[:, :, i], v[:, :, i], state, feature_map)
            previous = native.set_enabled(False)
            try:
                out_ref, state_ref = LF.kernel_step(q[:, :, i], k[:, :, i], v[:, :, i], state, feature_map)
            finally:
                native.set_enabled(previous)
            assert torch.allclose(new_state, state_ref, rtol=1e-5, atol=1e-6)
            assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-6)
            outs.append(out)
            state = new_state
    causal = LF.kernel(q.double(), k.double(), v.double(), feature_map, causal=True)
    assert relative_error(torch.stack(outs, 2), causal) < 2e-6


@needs_native
def test_step_rejects_a_state_of_the_wrong_shape():
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=r"state must have shape \(B, H, F, Dv \+ 1\) = \(1, 2, 8, 9\)"):
        LF.kernel_step(q, q, q, torch.zeros(1, 2, 8, 8), "elu")


@needs_native
def test_step_takes_the_compiled_path_for_valid_inputs_only(monkeypatch):
    calls = []
    real = native.kernel_step
    monkeypatch.setattr(native, "kernel_step", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    state = torch.rand(2, 3, 8, 9, generator=g)
    with torch.inference_mode():
        out, new_state = LF.kernel_step(q, k, v, state, "elu")
        assert calls == [1]
        # Strided, double or grad-requiring inputs take the PyTorch step, with the same result.
        strided = torch.randn(3, 2, 8, generator=g).transpose(0, 1).copy_(q)
        assert torch.allclose(LF.kernel_step(strided, k, v, state, "elu")[0], out, rtol=1e-5, atol=1e-6)
        double = LF.kernel_step(q.double(), k.double(), v.double(), state.double(), "elu")[0]
        assert torch.allclose(double.float(), out, rtol=1e-5, atol=1e-6)
    assert calls == [1]
    LF.kernel_step(q.clone().requires_grad_(), k, v, state, "elu")
    assert calls == [1]
    with pytest.raises(ValueError, match="kernel_step takes one position per call"):
        LF.kernel_step(q[:, :, None], k, v, state, "elu")


@pytest.mark.parametrize("use_native", [True, False])
def test_step_in_place_updates_the_given_state(use_native):
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    state = torch.rand(2, 3, 8, 9, generator=g)
    previous = native.set_enabled(use_native)
    try:
        with torch.inference_mode():
            out, new_state = LF.kernel_step(q, k, v, state, "elu")
            out_inplace, same = LF.kernel_step(q, k, v, state.clone(), "elu", inplace=True)
            first_out, first_state = LF.kernel_step(q, k, v, None, "elu", inplace=True)  # no state yet: a new one
    finally:
        native.set_enabled(previous)
    assert torch.allclose(out_inplace, out, rtol=1e-6, atol=1e-7) and torch.allclose(same, new_state, rtol=1e-6)
    assert first_state.shape == state.shape
    trained = state.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"inplace=True\) overwrites the state"):
        LF.kernel_step(q, k, v, trained, "elu", inplace=True)


def test_step_in_place_returns_the_same_tensor():
    state = torch.rand(1, 2, 4, 5)
    with torch.inference_mode():
        _, new_state = LF.kernel_step(torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 4), state, "elu",
                                      inplace=True)
    assert new_state.data_ptr() == state.data_ptr()
