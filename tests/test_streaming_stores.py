"""Outputs far larger than the caches are written by the compiled kernels with streaming stores (csrc/simd.h
store_stream, above `lm_stream_bytes`, 16 MiB). They must give the same bits as plain stores, wherever the rows
lie: here the threshold is lowered to 0 so that small tensors take those stores, in every layout and every path
that writes rows (the fused normalised product, the divided rows of rope and of value widths that are no whole
number of vectors, causal chunks, the local term, the output gate, and the gradients)."""
import ctypes

import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import native, native_library, native_maps

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def _stream_bytes() -> ctypes.c_long:
    return ctypes.c_long.in_dll(native_library._lib(), "lm_stream_bytes")


def _run(fn, stream: bool):
    setting = _stream_bytes()
    kept = setting.value
    setting.value = 0 if stream else 1 << 62
    try:
        return fn()
    finally:
        setting.value = kept


def _heads(b, n, h, d, dv, layout, g):
    """q, k, v as (B, H, N, d) tensors: contiguous, or views of one (B, N, H (2 d + dv)) projection as a module's."""
    if layout == "contiguous":
        return (torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g),
                torch.randn(b, h, n, dv, generator=g))
    projection = torch.randn(b, n, h * (2 * d + dv), generator=g)
    q, k, v = projection.split([h * d, h * d, h * dv], dim=-1)
    return tuple(t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))


CASES = {
    "elu": lambda q, k, v: LF.kernel(q, k, v, feature_map="elu"),
    "elu_causal": lambda q, k, v: LF.kernel(q, k, v, feature_map="elu", causal=True),
    "taylor_padding": lambda q, k, v: LF.kernel(
        q, k, v, feature_map="taylor", key_padding_mask=torch.arange(q.shape[2]).expand(q.shape[0], -1) >= 50),
    "focused": lambda q, k, v: LF.focused(q, k, v, scale=torch.linspace(0.5, 2, 3 * q.shape[-1]).reshape(3, 1, -1)),
    "efficient": lambda q, k, v: LF.efficient_attention(q, k, v),
    "rope": lambda q, k, v: LF.grid_rope.grid_rope_kernel(q, k, v, "taylor", (6, 10, 3)),
    # the modules' local term after attention (csrc/grid_conv.c)
    "local_term": lambda q, k, v: native_maps.local_term(
        LF.kernel(q, k, v, feature_map="elu"), v, torch.linspace(-0.5, 0.5, 3 * v.shape[-1] * 9).reshape(-1, 1, 3, 3),
        torch.linspace(-1, 1, 3 * v.shape[-1]), 6, 10, 3, None),
    # the modules' output gate (csrc/output_gate.c): its output, and d out and d q in the backward
    "output_gate": lambda q, k, v: native_maps.output_gate(
        LF.kernel(q, k, v, feature_map="elu"), q, torch.linspace(-0.3, 0.3, 3 * q.shape[-1] * v.shape[-1]).reshape(
            3, q.shape[-1], v.shape[-1]), torch.linspace(-1, 1, 3 * v.shape[-1]).reshape(3, 1, -1)),
}


@needs_native
@pytest.mark.parametrize("layout", ["contiguous", "module"])
@pytest.mark.parametrize("dv", [64, 20])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_outputs_and_gradients_equal_plainly_stored_ones(case, dv, layout):
    """dv = 64 rows start on whole vectors; dv = 20 rows mostly do not and must fall back to plain stores (a
    streaming store to an unaligned address faults). A wrong row or column in the streamed branch changes bits."""
    g = torch.Generator().manual_seed(5)
    q, k, v = _heads(2, 63, 3, 16, dv, layout, g)
    grad = torch.randn(2, 3, 63, dv, generator=g)

    def step():
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = CASES[case](*inputs)
        return (out.detach(), *torch.autograd.grad(out, inputs, grad))

    plain, streamed = _run(step, stream=False), _run(step, stream=True)
    for got, want in zip(streamed, plain):
        assert torch.equal(got, want)
