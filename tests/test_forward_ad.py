"""Forward-mode derivatives (torch.autograd.forward_ad's dual tensors) through every method's module, causal and not,
with the output gate and the local term, against central differences of the float64 module. Paths with a backward of
their own (the compiled kernels, the chunked causal product, the gate's Function) have no forward-mode formula, so
a dual tensor must take plain tensor ops there, and not lose its tangent or raise."""
import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import linear_mha
import modes

N, E, H = 36, 32, 4
EXTRAS = {"plain": {}, "gate": dict(output_gate=True), "local": dict(dwc_kernel=3)}
WITH_EXTRAS = ("kernel", "softmax", "hedgehog", "linformer")  # the gate and the local term are one code for all
CASES = [(name, causal, extra) for name in modes.ALL_VARIANTS for causal in (False, True) for extra in EXTRAS
         if (not causal or name in modes.ALL_CAUSAL) and not (causal and extra == "local")
         and (extra == "plain" or name in WITH_EXTRAS)]


def _attend(module, x, causal, grid):
    mask = torch.nn.Transformer.generate_square_subsequent_mask(N, dtype=x.dtype) if causal else None
    return module(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal, token_grid=grid)[0]


@pytest.mark.parametrize("name,causal,extra", CASES,
                         ids=[f"{n}-{'causal' if c else 'full'}-{e}" for n, c, e in CASES])
def test_tangents_match_central_differences(name, causal, extra):
    torch.manual_seed(0)
    module = linear_mha.LinearMultiheadAttention(E, H, **modes.sized_variant(modes.ALL_VARIANTS[name], N),
                                                 **EXTRAS[extra]).eval()
    grid = modes.grid_for(module, N) or (linear_mha.TokenGrid(6, 6) if extra == "local" else None)
    if extra != "plain":
        with torch.no_grad():  # a gate and a local term that start as no-ops would hide their own derivatives
            for p in (module.gate_weight, module.dwc_weight):
                if p is not None:
                    p.normal_(std=0.3)
    x, tangent = torch.randn(N, 2, E, dtype=torch.float64), torch.randn(N, 2, E, dtype=torch.float64)
    reference = copy.deepcopy(module).double()
    eps = 1e-6
    with torch.no_grad():
        want = (_attend(reference, x + eps * tangent, causal, grid)
                - _attend(reference, x - eps * tangent, causal, grid)) / (2 * eps)
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 1e-3)):  # float32: the compiled CPU paths' inputs
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.to(dtype), tangent.to(dtype))
            got = fwAD.unpack_dual(_attend(copy.deepcopy(module).to(dtype), dual, causal, grid)).tangent
        assert got is not None, dtype
        error = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert error < tol, (dtype, error)


@pytest.mark.parametrize("options,causal", [(dict(mode="kernel"), True), (dict(mode="softmax"), False),
                                            (dict(mode="linformer", seq_len=N), False),
                                            (dict(mode="hedgehog", output_gate=True), True),
                                            (dict(mode="taylor", dwc_kernel=3), False)],
                         ids=["kernel_causal", "softmax", "linformer", "hedgehog_gate_causal", "taylor_local"])
def test_second_derivatives_through_torch_func(options, causal):
    # grad of grad (a gradient penalty, a Hessian-vector product): torch.func's transforms take plain ops, which
    # have every derivative; torch's fused softmax kernel has no second one, so softmax takes its explicit products.
    torch.manual_seed(0)
    module = linear_mha.LinearMultiheadAttention(E, H, **options).double().eval()
    grid = linear_mha.TokenGrid(6, 6) if "dwc_kernel" in options else None
    x, direction = torch.randn(N, 2, E, dtype=torch.float64), torch.randn(N, 2, E, dtype=torch.float64)

    def loss(a):
        return _attend(module, a, causal, grid).square().sum()

    hvp = torch.func.grad(lambda a: (torch.func.grad(loss)(a) * direction).sum())(x)
    eps = 1e-6
    want = (torch.func.grad(loss)(x + eps * direction) - torch.func.grad(loss)(x - eps * direction)) / (2 * eps)
    torch.testing.assert_close(hvp, want, rtol=1e-5, atol=1e-6)
