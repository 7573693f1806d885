"""The fast kernel paths (the fused causal Function of functional/kernel/fused.py, the in-place inference
path of the non-causal kernel) against the same attention composed from autograd ops, and what they keep."""
import sys

import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import backend
from linear_mha.functional._common import append_ones, split_normalise
from linear_mha.functional.kernel.fused import causal_kernel
from linear_mha.functional.feature_maps import apply_feature_map


def composed(q, k, v, feature_map, key_padding_mask=None, initial_state=None, chunk_size=3):
    """Causal kernel attention from autograd ops (the path every other feature map takes)."""
    phi_q, phi_k = apply_feature_map(feature_map, q, k, key_padding_mask=key_padding_mask, causal=True)
    if key_padding_mask is not None:
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    num_den = LF.causal_linear_product(phi_q, phi_k, append_ones(v), initial_state=initial_state,
                                       chunk_size=chunk_size)
    return split_normalise(num_den)


def inputs(n=11, d=4, dv=5, seed=0, state=True, mask=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, n, dv, generator=g, dtype=torch.float64, requires_grad=True)
    init = None
    if state:
        init = torch.rand(2, 3, d, dv + 1, generator=g, dtype=torch.float64).requires_grad_()
    kpm = None
    if mask:
        kpm = torch.zeros(2, n, dtype=torch.bool)
        kpm[0, :2] = True  # with no state, query 0 of batch 0 sees only a masked key: output 0
        kpm[1, -3:] = True
    return q, k, v, init, kpm


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("state", [False, True])
def test_equals_composed_ops_values_and_grads(feature_map, state):
    q, k, v, init, kpm = inputs(state=state)
    grad = torch.randn(2, 3, 11, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tensors = [t for t in (q, k, v, init) if t is not None]
    out = causal_kernel(q, k, v.masked_fill(kpm[:, None, :, None], 0.0), feature_map, key_padding_mask=kpm,
                        initial_state=init, chunk_size=3)
    fused_grads = torch.autograd.grad(out, tensors, grad)
    ref = composed(q, k, v, feature_map, kpm, init)
    ref_grads = torch.autograd.grad(ref, tensors, grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkvs", fused_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"grad of {name}")
        assert torch.isfinite(a).all()
    if not state:
        assert out[0, :, :2].abs().max() == 0  # queries that see only masked keys return 0, not NaN


@pytest.mark.parametrize("block_positions", [3, 6, 9, 12, 10_000])  # chunk segments, whole groups, one block
def test_every_blocking_of_the_forward_gives_the_same_values(block_positions, backends):
    q, k, v, init, kpm = inputs(n=13)
    v = v.masked_fill(kpm[:, None, :, None], 0.0)
    ref = composed(q, k, v, "elu", kpm, init)
    backends(block_positions=block_positions)
    with torch.no_grad():
        out = causal_kernel(q, k, v, "elu", key_padding_mask=kpm, initial_state=init, chunk_size=3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_gradcheck(feature_map):
    q, k, v, init, kpm = inputs(n=7, d=3, dv=2)
    kpm[0, :2] = False  # gradcheck's finite differences need every output differentiable
    fn = lambda q, k, v, s: LF.kernel(q, k, v, feature_map, causal=True, key_padding_mask=kpm,  # noqa: E731
                                      initial_state=s, chunk_size=2)
    assert torch.autograd.gradcheck(fn, (q, k, v, init))


def test_kernel_dispatches_elementwise_maps_to_the_fused_function(monkeypatch):
    kernel_module = sys.modules["linear_mha.functional.kernel"]  # the package attribute is the function
    calls = []
    monkeypatch.setattr(kernel_module, "causal_kernel", lambda *a, **kw: calls.append(a[3]) or a[2])
    q, k, v, _, _ = inputs()
    for fm in ("elu", "relu", "taylor"):
        LF.kernel(q, k, v, fm, causal=True)
    LF.kernel(q, k, v, "elu")
    assert calls == ["elu", "relu"]
    # ... exactly where the one function that chooses says so, and it says why
    chosen = {fm: backend.kernel_backend(q, k, v, fm, causal=True) for fm in ("elu", "relu", "taylor")}
    assert [c.backend for c in chosen.values()] == [backend.FUSED_CAUSAL, backend.FUSED_CAUSAL, backend.COMPOSED]
    assert "taylor" in chosen["taylor"].reason and "float64" in chosen["elu"].reason


def test_keeps_only_inputs_output_and_normaliser_for_backward():
    """The memory claim: nothing of size (B, H, N, D) is saved besides q, k, v and the output."""
    q, k, v, _, _ = inputs(n=64, d=8, dv=8, state=False, mask=False)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = LF.kernel(q, k, v, "elu", causal=True)
    inputs_and_out = {t.data_ptr() for t in (q, k, v, out)}
    extra = [t for t in saved if t is not None and t.data_ptr() not in inputs_and_out]
    assert sum(t.numel() for t in extra) == 2 * 3 * 64  # the normaliser, one value per position


def test_initial_state_shape_error():
    q, k, v, _, _ = inputs()
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, F, Dv \+ 1\)"):
        LF.kernel(q, k, v, "elu", causal=True, initial_state=torch.zeros(2, 3, 4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="chunk_size"):
        LF.kernel(q, k, v, "elu", causal=True, chunk_size=0)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor", lambda x: x.abs()])
def test_inference_path_leaves_inputs_untouched_and_equals_the_autograd_path(feature_map):
    """Non-causal inference writes its output over phi(k): the caller's tensors must not be touched."""
    q, k, v, _, _ = inputs(state=False, mask=False)
    v = v[..., :4]  # Dv == D, the shape where the output can reuse phi(k)'s buffer
    with_grad = LF.kernel(q, k, v, feature_map)
    copies = [t.detach().clone() for t in (q, k, v)]
    with torch.no_grad():
        out = LF.kernel(q, k, v, feature_map)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)
    torch.testing.assert_close(out, with_grad.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block_positions", [6, 12, 30, 10_000])  # 1, 2 or 5 positions per head, one block
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_blocked_non_causal_inference_equals_the_autograd_path(block_positions, feature_map):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 9, 5, generator=g,
                                                                                   dtype=torch.float64)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 4:] = True
    state = torch.rand(2, 3, 4, 6, generator=g, dtype=torch.float64)
    for kw in ({}, {"key_padding_mask": kpm}, {"initial_state": state}):
        ref = LF.kernel(q.requires_grad_(), k, v, feature_map, **kw).detach()  # the composed autograd path
        with backend.override(block_positions=block_positions), torch.no_grad():
            out = LF.kernel(q, k, v, feature_map, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_blocked_non_causal_inference_takes_strided_inputs(backends):
    """A module's q, k, v are transposed views of its projections: (B, N, H, D) memory seen as (B, H, N, D)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, n, 3, 4, generator=g, dtype=torch.float64).transpose(1, 2) for n in (7, 9, 9))
    ref = LF.kernel(q.contiguous().requires_grad_(), k, v, "elu").detach()
    backends(block_positions=6)
    with torch.no_grad():
        out = LF.kernel(q, k, v, "elu")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_every_call_asks_the_chooser_once_and_runs_what_it_names(monkeypatch):
    """kernel() and kernel_step() ask backend.py once per call (kernel() once asked twice for half inputs), and the
    path that runs is the one the answer names."""
    kernel_module = sys.modules["linear_mha.functional.kernel"]
    asked, ran = [], []
    for name in ("kernel_backend", "step_backend"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, real=real, **kw: asked.append(real(*a, **kw)) or asked[-1])
    paths = {"causal_kernel": backend.FUSED_CAUSAL, "kernel_inference_blocks": backend.BLOCKED,
             "composed_attention": backend.COMPOSED}
    for name in paths:
        real = getattr(kernel_module, name)
        monkeypatch.setattr(kernel_module, name, lambda *a, real=real, name=name, **kw: ran.append(name) or real(*a, **kw))
    q, k, v, _, _ = inputs()
    half = [t.bfloat16() for t in (q, k, v)]
    cases = [((q, k, v, "elu"), dict(causal=True), "causal_kernel"), ((*half, "elu"), dict(causal=True), "causal_kernel"),
             ((q, k, v, "elu"), dict(), "kernel_inference_blocks"),
             ((q, k, v, "taylor"), dict(causal=True), "composed_attention")]
    for args, options, path in cases:
        asked.clear(), ran.clear()
        with torch.no_grad(), backend.override(native_kernels=False, block_positions=6):
            LF.kernel(*args, **options)
        assert len(asked) == 1 and ran == [path] and asked[0].backend == paths[path], (path, asked, ran)
    asked.clear()
    LF.kernel_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, "elu")
    assert len(asked) == 1
