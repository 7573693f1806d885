"""A user's elementwise feature map read as a program of steps (functional/elementwise_program.py) and run inside the
compiled kernels (map 7, csrc/program.h): every step against float64, causal and not, with masks and an initial
state; maps that are not chains of known steps keep their PyTorch path and say why; a program that would not
reproduce its callable, or could go stale, is not used."""
import pytest
import torch
import torch.nn.functional as F

import linear_mha.functional as LF
from linear_mha.functional import backend, native
from linear_mha.functional.elementwise_program import (MAX_STEPS, ProgramMap, program_map, read_program,
                                                       why_not_program)

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def relative_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# Each step of csrc/program.h at least once, and each way Python spells it.
MAPS = {
    "relu ** 2": lambda x: torch.relu(x) ** 2,
    "elu + 1": lambda x: F.elu(x) + 1,
    "exp(x / 4)": lambda x: torch.exp(x / 4.0),
    "abs ** 1.5": lambda x: x.abs() ** 1.5,
    "softplus": F.softplus,
    "2 sigmoid": lambda x: 2 * torch.sigmoid(x),
    "square + 0.1": lambda x: torch.square(x) + 0.1,
    "relu(1 - x)": lambda x: F.relu(1 - x),
    "(-x - 0.5).exp": lambda x: (-x - 0.5).exp() * 0.5,
    "x ** 3 + 40": lambda x: x ** 3 + 40.0,  # a whole power of negative values
    "relu ** 0.5": lambda x: torch.relu(x).pow(0.5) + 0.01,
}


def inputs(seed, n=41, d=37, dv=16):
    """d = 37: the steps' vector loops (16- or 8-float) and a scalar tail; masked keys hold NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, 3, d, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 3, n, d, generator=g), torch.randn(2, 3, n, dv, generator=g)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, -6:] = True
    k[1, :, -6:], v[1, :, -6:] = float("nan"), float("nan")
    return q, k, v, mask, torch.randn(2, 3, n, dv, generator=g)


@needs_native
@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("causal", [False, True])
def test_each_step_runs_inside_the_kernels_and_matches_float64(name, causal):
    fn = MAPS[name]
    assert isinstance(program_map(fn), ProgramMap), why_not_program(fn)
    q, k, v, mask, grad = inputs(seed=len(name) + causal)
    if causal:  # no mask: causal padding is tested with the named maps; here NaN would reach later queries' keys
        k, v = k.nan_to_num(), v.nan_to_num()
    options = dict(causal=causal, key_padding_mask=None if causal else mask)
    assert backend.kernel_backend(q, k, v, program_map(fn), causal=causal).backend == backend.NATIVE
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = LF.kernel(*leaves, fn, **options)
        out.backward(grad.to(dtype))
        runs.append((out, [t.grad for t in leaves]))
    (out, got), (ref, expected) = runs
    assert "KernelAttention" in type(out.grad_fn).__name__  # the compiled Function, not PyTorch's features
    assert relative_error(out, ref) < 2e-6
    for label, a, r in zip("qkv", got, expected):
        assert relative_error(a, r) < 2e-5, label
    if not causal:
        assert (got[1][1, :, -6:] == 0).all() and (got[2][1, :, -6:] == 0).all()


@needs_native
def test_an_initial_state_and_the_first_call_in_inference_mode():
    """The program's data is made at the map's first call, here under inference_mode, then saved by a backward."""
    fn = lambda x: F.softplus(x) * 0.5  # noqa: E731
    q, k, v, _, grad = inputs(seed=3)
    k, v = k.nan_to_num(), v.nan_to_num()  # no mask here
    with torch.inference_mode():
        LF.kernel(q, k, v, fn)
    state = LF.kernel_state(k[:, :, :9], v[:, :, :9], fn)
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, state)]
        out = LF.kernel(*leaves[:3], fn, initial_state=leaves[3])
        out.backward(grad.to(dtype))
        runs.append((out, [t.grad for t in leaves]))
    (out, got), (ref, expected) = runs
    assert "KernelAttention" in type(out.grad_fn).__name__
    assert relative_error(out, ref) < 2e-6
    assert all(relative_error(a, r) < 2e-5 for a, r in zip(got, expected))


class Scale(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


def branching(x):
    if x.sum() > 0:
        return torch.relu(x)
    return torch.exp(x)


NOT_STEPS = {
    "a row norm": (lambda x: torch.relu(x) / x.norm(dim=-1, keepdim=True), "norm"),
    "a value used twice": (lambda x: torch.relu(x) + x, "one number"),
    "elu with alpha 2": (lambda x: F.elu(x, alpha=2.0) + 2, "alpha"),
    "a branch on the data": (branching, "torch.fx cannot trace"),
    "too many steps": (lambda x: ((((((((x + 1) * 2) + 1) * 2) + 1) * 2) + 1) * 2).relu(), f"more than the "
                                                                                            f"kernels take ({MAX_STEPS})"),
    "a whole power above 8": (lambda x: x ** 10 + 1.0, "whole powers go to 8"),
    "a power of the value": (lambda x: 2.0 ** x, "exponent"),
    "a module": (Scale(), "module"),
}


@pytest.mark.parametrize("name", list(NOT_STEPS))
def test_maps_that_are_not_chains_of_steps_keep_their_path_and_say_why(name):
    fn, reason = NOT_STEPS[name]
    assert program_map(fn) is fn
    assert reason in why_not_program(fn)
    q, k, v, mask, _ = inputs(seed=5, n=19, d=8, dv=5)
    if name != "elu with alpha 2":
        return
    out = LF.kernel(q, k, v, fn, key_padding_mask=mask)  # still right, through PyTorch's features
    ref = LF.kernel(q.double(), k.double(), v.double(), fn, key_padding_mask=mask)
    assert relative_error(out, ref) < 2e-6


FACTOR = 2.0


def scaled_relu(x):
    return torch.relu(x) * FACTOR


def test_a_program_follows_the_globals_it_read_and_must_reproduce_its_callable(monkeypatch):
    assert program_map(scaled_relu).steps[-1][1] == 2.0
    monkeypatch.setattr(f"{__name__}.FACTOR", 3.0)
    assert program_map(scaled_relu).steps[-1][1] == 3.0  # not the program read while FACTOR was 2

    calls = []

    def drifting(x):  # the trace reads one factor, the probe sees another: its program would be wrong
        calls.append(1)
        return torch.relu(x) * float(len(calls))
    assert program_map(drifting) is drifting and "closure" in why_not_program(drifting)
    assert read_program(drifting)[1] == "its program does not reproduce it on a probe"
    settings = type("Settings", (), {"factor": 2.0})()
    reads_an_object = lambda x: torch.relu(x) * settings.factor  # noqa: E731
    assert program_map(reads_an_object) is reads_an_object  # settings.factor could change unseen


def test_a_lambda_made_per_call_is_read_once(monkeypatch):
    from linear_mha.functional import elementwise_program
    reads = []
    real = elementwise_program.read_program
    monkeypatch.setattr(elementwise_program, "read_program", lambda fn: reads.append(fn) or real(fn))
    for _ in range(3):
        fn = lambda x: torch.relu(x) ** 2 + 0.123  # noqa: E731
        assert isinstance(program_map(fn), ProgramMap) and program_map(fn).fn is fn
    assert len(reads) == 1


@needs_native
def test_a_user_registered_method_with_an_elementwise_map_runs_inside_the_kernels():
    """A method a user registers with ``features`` made of steps: read once, through the module a user holds."""
    import linear_mha
    from linear_mha.methods.kernel import FeatureMapMethod

    class ReluSquared(FeatureMapMethod):
        name = "test_relu_squared"
        summary = "phi(x) = relu(x) ** 2 + 0.01"

        def features(self, x, state):
            return torch.relu(x) ** 2 + 0.01

    linear_mha.register_method(ReluSquared)
    try:
        torch.manual_seed(0)
        module = linear_mha.LinearMultiheadAttention(48, 3, mode="test_relu_squared", batch_first=True)
        x = torch.randn(2, 37, 48)
        phi = module.method.kernel_map({})
        assert isinstance(phi, ProgramMap) and phi.steps == [(0, 0.0), (9, 2.0), (5, 0.01)]
        out = module(x, x, x, need_weights=False)[0]
        ref = module.double()(*[x.double()] * 3, need_weights=False)[0]
        assert relative_error(out, ref) < 2e-6
    finally:
        linear_mha.unregister_method("test_relu_squared")


@needs_native
@pytest.mark.parametrize("name, fn", [("x ** 2.00000001 + 1", lambda x: x ** 2.00000001 + 1.0),
                                      ("softplus far below 0", lambda x: F.softplus(x - 20.0) * 1e8)])
def test_powers_and_softplus_at_their_edges(name, fn):
    """A power that is whole only once rounded to float32 stays NaN below 0, as in PyTorch; softplus of v < -17
    keeps its e^v (ln(1 + e) taken as log1p), in the vector loops as in the tail."""
    q, k, v, mask, _ = inputs(seed=7)
    assert isinstance(program_map(fn), ProgramMap)
    out = LF.kernel(q, k, v, fn, key_padding_mask=mask)
    ref = LF.kernel(q.double(), k.double(), v.double(), fn, key_padding_mask=mask)
    assert torch.equal(out.isnan(), ref.isnan())
    if not ref.isnan().any():
        assert relative_error(out, ref) < 2e-6


def test_a_kept_program_is_checked_again_on_every_call():
    """What a trace read through a module's attribute, or a method's map through its state, may change later."""
    import types

    from linear_mha.functional.elementwise_program import MUL, POW_WHOLE, program_for
    settings = types.ModuleType("settings")
    settings.power = 2
    fn = lambda x: torch.relu(x) ** settings.power + 0.1  # noqa: E731
    assert program_map(fn).steps[1] == (POW_WHOLE, 2.0)
    settings.power = 3
    assert program_map(fn).steps[1] == (POW_WHOLE, 3.0)
    owner, factor = types.SimpleNamespace(), [2.0]
    scaled = lambda x: torch.relu(x) * factor[0] + 0.01  # noqa: E731
    assert program_for(owner, scaled).steps[1] == (MUL, 2.0)
    factor[0] = 5.0
    assert program_for(owner, scaled).steps[1] == (MUL, 5.0)
