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
         if (name in modes.ALL_CAUSAL if causal else name in modes.BIDIRECTIONAL) and not (causal and extra == "local")
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


def _map_with_parameters(case, params):
    """(attention of q, k, v, causal) for a method whose map has tensors of its own, given as ``params``."""
    import linear_mha.functional as LF
    from linear_mha.functional.grid_rope import grid_rope_kernel
    if case == "focused scale":
        return lambda q, k, v, causal: LF.focused(q, k, v, scale=params[0], causal=causal)
    if case == "hedgehog weights":
        return lambda q, k, v, causal: LF.hedgehog(q, k, v, tuple(params[:2]), tuple(params[2:]), causal=causal)
    def user_map(x):  # an elementwise map of a learnable per-channel scale, read from the closure
        return torch.relu(x) * params[0] + 0.1
    if case == "user map":
        return lambda q, k, v, causal: LF.kernel(q, k, v, user_map, causal=causal)
    return lambda q, k, v, causal: grid_rope_kernel(q, k, v, user_map, (2, 3, 0))  # rope over a 2 x 3 grid


PARAMETER_CASES = [(case, causal) for case in ("focused scale", "hedgehog weights", "user map", "rope, user map")
                   for causal in (False, True) if not (causal and case.startswith("rope"))]


@pytest.mark.parametrize("case,causal", PARAMETER_CASES, ids=[f"{c}-{'causal' if k else 'full'}"
                                                              for c, k in PARAMETER_CASES])
def test_tangents_of_a_maps_own_parameters_are_carried(case, causal):
    # Tangents on q, k and v send a call to PyTorch ops; tangents on the map's own tensors alone must too. The
    # compiled kernels read those tensors' values (focused's scale, hedgehog's weights) or the features a map made
    # from them (a user's closure), and the output then came out with no tangent at all.
    torch.manual_seed(0)
    h, n, d = 2, 6, 8
    q, k, v = (torch.randn(1, h, n, d, dtype=torch.float64) for _ in range(3))
    if case == "focused scale":
        params = [torch.rand(h, 1, d, dtype=torch.float64) + 0.5]
    elif case == "hedgehog weights":
        params = [torch.randn(h, d, 4, dtype=torch.float64) * 0.3 if i % 2 == 0 else
                  torch.randn(h, 4, dtype=torch.float64) * 0.3 for i in range(4)]
    else:
        params = [torch.rand(d, dtype=torch.float64) + 0.5]
    tangents = [torch.randn_like(p) for p in params]
    eps = 1e-6
    with torch.no_grad():
        ahead = _map_with_parameters(case, [p + eps * t for p, t in zip(params, tangents)])(q, k, v, causal)
        behind = _map_with_parameters(case, [p - eps * t for p, t in zip(params, tangents)])(q, k, v, causal)
    want = (ahead - behind) / (2 * eps)
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 1e-4)):  # float32: the compiled CPU paths' inputs
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p.to(dtype), t.to(dtype)) for p, t in zip(params, tangents)]
            out = _map_with_parameters(case, duals)(q.to(dtype), k.to(dtype), v.to(dtype), causal)
            got = fwAD.unpack_dual(out).tangent
        assert got is not None, dtype
        error = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert error < tol, (dtype, error)
