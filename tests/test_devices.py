"""The same checks on every device: the CPU through the code CUDA runs (compiled code off, one block of
work instead of the CPU's cache-sized blocks), and CUDA when there is one. float32 on the device against float64
on the CPU, gradients included; causality; the decode step; the softmax mode against nn.MultiheadAttention; a
tiny LM's decoding and a tiny DETR. CI has no GPU, so its CUDA cases skip; a machine with one runs them with
`pytest tests/test_devices.py` (the DETR case also needs the detr extra)."""
import pytest
import torch
from torch import nn

import linear_mha.functional as LF
from linear_mha import LinearMultiheadAttention
from lm_checks import DECODING_CONFIGS, assert_causal, assert_steps_equal_full, tiny_lm
import modes
from reference import relative_error

B, H, N, D = 2, 3, 70, 16  # N crosses a causal chunk boundary (64)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def device(request, backends):
    if request.param == "cuda":
        # cuDNN convolutions run in TF32 by default (a 10-bit mantissa): the DETR backbone's error would then swamp
        # the float32 attention these tests check. Restored after the test.
        saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        yield torch.device("cuda")
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
        return
    backends(native_kernels=False, block_positions=None)  # PyTorch ops in one block of work, as on CUDA
    yield torch.device("cpu")


def _projection():
    return LF.orthogonal_random_features(32, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _linformer_e():
    return torch.randn(12, N, generator=torch.Generator().manual_seed(4), dtype=torch.float64) / N ** 0.5


# A registry row's name -> fn(q, k, v, key_padding_mask, causal, dtype/device-converted extras): its functional call.
FUNCTIONS = {
    "kernel_elu": lambda q, k, v, m, c, x: LF.kernel(q, k, v, "elu", causal=c, key_padding_mask=m),
    "kernel_relu": lambda q, k, v, m, c, x: LF.kernel(q, k, v, "relu", causal=c, key_padding_mask=m),
    "kernel_favor": lambda q, k, v, m, c, x: LF.kernel(q, k, v, "favor", causal=c, key_padding_mask=m,
                                                       projection=x["projection"]),
    "taylor": lambda q, k, v, m, c, x: LF.taylor(q, k, v, causal=c, key_padding_mask=m),
    "softmax": lambda q, k, v, m, c, x: LF.softmax(q, k, v, causal=c, key_padding_mask=m)[0],
    "efficient": lambda q, k, v, m, c, x: LF.efficient_attention(q, k, v, key_padding_mask=m),
    "linformer": lambda q, k, v, m, c, x: LF.linformer(q, k, v, x["e"], key_padding_mask=m)[0],
}
CAUSAL = [name for name in FUNCTIONS if modes.method_of(modes.ALL_VARIANTS[name]).causal]  # has a causal form
CASES = [(name, causal) for name in FUNCTIONS for causal in (False, True) if name in CAUSAL or not causal]


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "key_padding"])
@pytest.mark.parametrize("name,causal", CASES, ids=[f"{n}-{'causal' if c else 'full'}" for n, c in CASES])
def test_float32_on_the_device_matches_float64_on_the_cpu(device, name, causal, masked):
    fn = FUNCTIONS[name]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3)]
    grad_out = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[1, -9:] = True
    extras = {"projection": _projection(), "e": _linformer_e()}

    def run(dev, dtype):
        xs = [t.to(dev, dtype, copy=True).requires_grad_() for t in inputs]
        out = fn(*xs, mask.to(dev) if masked else None, causal, {k: t.to(dev, dtype) for k, t in extras.items()})
        out.backward(grad_out.to(dev, dtype))
        return out, [t.grad for t in xs]
    ref, ref_grads = run("cpu", torch.float64)
    out, grads = run(device, torch.float32)
    assert out.device.type == device.type and out.dtype == torch.float32
    assert relative_error(out, ref) < 2e-5
    for grad, ref_grad in zip(grads, ref_grads):
        assert relative_error(grad, ref_grad) < 1e-4


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_outputs_never_see_later_positions(device, name):
    fn = FUNCTIONS[name]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(device) for _ in range(3))
    extras = {"projection": _projection().to(device)}
    base = fn(q, k, v, None, True, extras)
    for t in (0, 40, 63, 64, N - 1):  # first, inside a chunk, either side of a chunk boundary, last
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t] += 3.0
        v2[:, :, t] -= 3.0
        out = fn(q, k2, v2, None, True, extras)
        torch.testing.assert_close(out[:, :, :t], base[:, :, :t], rtol=0, atol=1e-12)
        assert (out[:, :, t:] - base[:, :, t:]).abs().max() > 1e-6


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_decode_steps_equal_causal_attention(device, feature_map, inplace):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(device) for _ in range(3))
    full = LF.kernel(q, k, v, feature_map, causal=True)
    state, outs = None, []
    with torch.inference_mode():
        for t in range(N):
            out, state = LF.kernel_step(q[:, :, t], k[:, :, t], v[:, :, t], state, feature_map, inplace=inplace)
            outs.append(out)
    assert state.device.type == device.type
    assert relative_error(torch.stack(outs, 2), full.double()) < 1e-5


def test_softmax_mode_is_nn_multihead_attention(device):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).to(device)
    ours = LinearMultiheadAttention(32, 4, batch_first=True, mode="softmax").to(device)
    ours.load_state_dict(mha.state_dict())
    x = torch.randn(2, 21, 32, device=device)
    mask = torch.zeros(2, 21, dtype=torch.bool, device=device)
    mask[0, 15:] = True
    expected, expected_weights = mha(x, x, x, key_padding_mask=mask)
    out, weights = ours(x, x, x, key_padding_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", modes.LINEAR)
def test_modules_agree_with_their_float64_copy_on_the_cpu(device, mode):
    torch.manual_seed(0)
    m = LinearMultiheadAttention(32, 4, batch_first=True, mode=mode, **modes.sized(mode, N, proj_k=12))
    x = torch.randn(2, N, 32, dtype=torch.float64)
    causal = mode in modes.LINEAR_CAUSAL

    def run(module, dev, dtype):
        module = module.to(dev, dtype)
        xs = x.to(dev, dtype, copy=True).requires_grad_()
        out, _ = module(xs, xs, xs, is_causal=causal, need_weights=False)
        out.square().sum().backward()
        return out, [xs.grad] + [p.grad for p in module.parameters()]
    ref, ref_grads = run(m.double(), "cpu", torch.float64)
    m.zero_grad(set_to_none=True)
    out, grads = run(m, device, torch.float32)
    assert relative_error(out, ref) < 2e-5
    for grad, ref_grad in zip(grads, ref_grads):
        assert relative_error(grad, ref_grad) < 1e-4


@pytest.mark.parametrize("config", ["global", "everything"])
def test_language_model_decodes_and_stays_causal(device, config):
    model = tiny_lm(**DECODING_CONFIGS[config]).to(device)
    x = torch.randint(0, 16, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    assert_steps_equal_full(model, x)
    assert_causal(model, x, 16, (0, 11, 23), config)


@pytest.mark.parametrize("attention", ["kernel", "linformer"])
def test_detr_in_float32_on_the_device_matches_float64_on_the_cpu(device, attention):
    pytest.importorskip("torchvision")
    pytest.importorskip("scipy")
    from linear_mha.integrations.detr.attention import apply_attention
    from linear_mha.integrations.detr.backbone import backbone_stride
    from linear_mha.integrations.detr.config import parse_args
    from linear_mha.integrations.detr.detr import build_model
    torch.manual_seed(0)
    args = parse_args([
        "--backbone", "tiny", "--hidden-dim", "32", "--nheads", "4", "--enc-layers", "1", "--dec-layers", "2",
        "--dim-feedforward", "64", "--num-queries", "5", "--num-classes", "4", "--attention", attention,
        "--attention-on", "all", "--proj-k", "8"])
    model, _, _ = build_model(args)
    stride = backbone_stride("tiny", False)
    report = apply_attention(model, args, max_tokens=-(-64 // stride) * -(-96 // stride))  # the padded batch
    assert [r["mode"] for r in report] == [attention] * 3
    assert type(model.transformer.encoder.layers[0].self_attn) is LinearMultiheadAttention
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 64, 80, generator=g), torch.rand(3, 48, 96, generator=g)]
    model.double().eval()
    with torch.no_grad():
        expected = model([im.double() for im in images])
        out = model.to(device, torch.float32)([im.to(device) for im in images])
    for key in ("pred_logits", "pred_boxes"):
        assert out[key].device.type == device.type and out[key].dtype == torch.float32
        assert relative_error(out[key], expected[key]) < 1e-4
