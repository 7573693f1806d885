"""Causal kernel attention through flash-linear-attention's Triton kernel: chosen only where it is exact enough
(bfloat16 CUDA inputs, elu/relu, no initial state), and there it matches float64, keeps padding exact, never
sees the future and has the right gradients. The CUDA cases need a GPU and `pip install fla-core`; the choice
logic is checked everywhere."""
import importlib.util

import pytest
import torch

import linear_mha.functional as LF
from linear_mha import LinearMultiheadAttention
from linear_mha.functional import backend, fla_causal, native
from reference import elu1, kernel_weights, relative_error

needs_fla = pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("fla") is not None),
                               reason="needs a CUDA device and fla-core")
TOLERANCE = 1e-2  # a few units of bfloat16's rounding (2^-8)
B, H, N, D = 2, 3, 200, 32  # N crosses fla's 64-position chunks; not a multiple of them


@pytest.fixture(autouse=True)
def fla_on():
    with backend.override(fla=True):  # opt-in (LINEAR_MHA_FLA=1); off by default
        yield


def qkv(dtype, device, n=N, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, d, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(3)]


def padding(n=N):
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[0, -37:] = True  # right padding
    mask[1, 5:9] = True   # holes inside the sequence
    return mask


def reference(q, k, v, feature_map, mask):
    phi = elu1 if feature_map == "elu" else torch.relu
    q, k, v = (t.double().cpu() for t in (q, k, v))
    return kernel_weights(phi, q, k, mask, causal=True) @ v


def test_fla_is_off_unless_asked_for():
    with backend.override(fla=False):
        reason = fla_causal.why_not(*qkv(torch.bfloat16, "cpu"), "elu", None)
    assert "LINEAR_MHA_FLA=1" in reason


def test_the_choice_names_why_fla_is_not_used():
    q, k, v = qkv(torch.float32, "cpu")
    reason = fla_causal.why_not(q, k, v, "elu", None)
    assert reason is not None and "CUDA" in reason
    with backend.override(fla=False):
        assert "the default" in fla_causal.why_not(q, k, v, "elu", None)
    with backend.override(native_kernels=False):  # the path CUDA float32 inputs take
        choice = backend.kernel_backend(q, k, v, "elu", causal=True)
    assert choice.backend == backend.FUSED_CAUSAL and "not fla because" in str(choice)
    # bfloat16 CPU inputs still reach the compiled code, which kernel() runs on float32 copies
    chosen = backend.kernel_backend(*[t.bfloat16() for t in (q, k, v)], "elu", causal=True)
    if native.available():
        assert chosen.backend == backend.NATIVE


def test_only_bfloat16_cuda_inputs_without_a_state_take_fla(monkeypatch):
    # Pretend to be on CUDA with fla installed: what remains is the dtype / map / state / head-dim rule.
    monkeypatch.setattr(fla_causal, "_chunk_linear_attn", lambda: (object(), None))

    def on_cuda(dtype, d=D):
        return type("OnCuda", (), {"device": torch.device("cuda"), "dtype": dtype, "shape": (B, H, N, d)})()
    half = on_cuda(torch.bfloat16)
    assert fla_causal.why_not(half, half, half, "elu", None) is None
    assert fla_causal.why_not(half, half, half, "relu", None) is None
    assert "TF32" in fla_causal.why_not(*[on_cuda(torch.float32)] * 3, "elu", None)
    assert "overflows" in fla_causal.why_not(*[on_cuda(torch.float16)] * 3, "elu", None)
    assert "taylor" in fla_causal.why_not(half, half, half, "taylor", None)
    assert "initial_state" in fla_causal.why_not(half, half, half, "elu", torch.zeros(1))
    assert "odd head dims" in fla_causal.why_not(*[on_cuda(torch.bfloat16, 33)] * 3, "elu", None)


@needs_fla
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_matches_float64_under_padding(feature_map):
    dtype = torch.bfloat16
    q, k, v = qkv(dtype, "cuda")
    mask = padding()
    assert backend.kernel_backend(q, k, v, feature_map, causal=True).backend == backend.FLA
    out = LF.kernel(q, k, v, feature_map, causal=True, key_padding_mask=mask.cuda())
    assert out.dtype == dtype and out.shape == v.shape
    assert relative_error(out, reference(q, k, v, feature_map, mask)) < TOLERANCE


@needs_fla
def test_masked_garbage_reaches_no_output_and_no_gradient():
    q, k, v = (t.requires_grad_() for t in qkv(torch.bfloat16, "cuda"))
    mask = padding().cuda()
    clean = LF.kernel(q, k, v, "elu", causal=True, key_padding_mask=mask)
    poisoned = [t.detach().masked_fill(mask[:, None, :, None], float("nan")).requires_grad_() for t in (k, v)]
    out = LF.kernel(q, *poisoned, "elu", causal=True, key_padding_mask=mask)
    assert torch.equal(out, clean)
    out.float().square().sum().backward()
    for t in poisoned:
        assert torch.isfinite(t.grad).all()
        assert (t.grad.masked_select(mask[:, None, :, None]) == 0).all()


@needs_fla
def test_outputs_never_depend_on_the_future():
    q, k, v = qkv(torch.bfloat16, "cuda")
    out = LF.kernel(q, k, v, "elu", causal=True)
    t = 130
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[:, :, t + 1:] = torch.randn_like(x[:, :, t + 1:]) * 10
    out2 = LF.kernel(*changed, "elu", causal=True)
    assert torch.equal(out[:, :, :t + 1], out2[:, :, :t + 1])
    assert not torch.equal(out[:, :, t + 1:], out2[:, :, t + 1:])


@needs_fla
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_gradients_match_float64(feature_map):
    q, k, v = (t.requires_grad_() for t in qkv(torch.bfloat16, "cuda"))
    mask = padding()
    grad = torch.randn(v.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    LF.kernel(q, k, v, feature_map, causal=True, key_padding_mask=mask.cuda()).backward(grad.cuda().bfloat16())
    ref_inputs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    reference(*ref_inputs, feature_map, mask).backward(grad)
    for got, ref in zip((q, k, v), ref_inputs):
        assert relative_error(got.grad, ref.grad) < 2e-2


@needs_fla
def test_module_in_bfloat16_matches_its_float32_self():
    torch.manual_seed(0)
    m = LinearMultiheadAttention(64, 4, batch_first=True, mode="kernel").cuda()
    x = torch.randn(2, 300, 64, device="cuda")
    mask = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    mask[1, 250:] = True
    ref, _ = m(x, x, x, is_causal=True, key_padding_mask=mask)
    with backend.override(fla=False):  # our own causal path
        own, _ = m.bfloat16()(x.bfloat16(), x.bfloat16(), x.bfloat16(), is_causal=True, key_padding_mask=mask)
    out, _ = m(x.bfloat16(), x.bfloat16(), x.bfloat16(), is_causal=True, key_padding_mask=mask)
    assert relative_error(out, ref) < 2e-2
    assert relative_error(out, ref) < 2 * relative_error(own, ref) + 5e-3  # about as good as our own bf16 path
