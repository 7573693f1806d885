"""LinearMultiheadAttention's out_proj is the user's nn.Linear: a plain one without hooks is applied as its function
(project, kept memory), and anything that relies on the module being called (its own or global hooks, backward
hooks, parametrizations, subclasses such as adapters) still sees it called."""
import copy

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

from linear_mha import LinearMultiheadAttention, plain_linear

E, H = 16, 4


@pytest.fixture
def projected(monkeypatch):
    """The inputs project() was called with from call_linear."""
    calls = []
    real = plain_linear.project

    def counting(x, weight, bias):
        calls.append((x, weight, bias))
        return real(x, weight, bias)
    monkeypatch.setattr(plain_linear, "project", counting)
    return calls


def _module(mode="kernel"):
    torch.manual_seed(0)
    return LinearMultiheadAttention(E, H, batch_first=True, mode=mode).double()


def _step(m, x):
    x = x.detach().clone().requires_grad_()
    out, _ = m(x, x, x, need_weights=False)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), x.grad, m.out_proj.weight.grad, m.out_proj.bias.grad


@pytest.mark.parametrize("mode", ["kernel", "softmax"])
def test_a_plain_out_proj_is_applied_as_its_function_with_the_same_numbers(projected, mode):
    m = _module(mode)
    hooked = copy.deepcopy(m)
    hooked.out_proj.register_forward_hook(lambda mod, args, out: None)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    got, want = _step(m, x), _step(hooked, x)
    assert len(projected) == 1 and projected[0][1] is m.out_proj.weight and projected[0][2] is m.out_proj.bias
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hooks_on_out_proj_fire_and_act(projected):
    m = _module()
    seen = {}
    m.out_proj.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
    m.out_proj.register_forward_hook(lambda mod, args, out: seen.__setitem__("forward", out))
    m.out_proj.register_full_backward_hook(lambda mod, gin, gout: seen.__setitem__("backward", gout[0]))
    x = torch.randn(2, 5, E, dtype=torch.float64, requires_grad=True)
    out, _ = m(x, x, x, need_weights=False)
    torch.testing.assert_close(out, m.out_proj.bias.expand_as(out).detach())  # the pre-hook zeroed the heads
    out.sum().backward()
    assert set(seen) == {"forward", "backward"} and not projected


def test_a_global_module_hook_sees_out_proj_called(projected):
    m = _module()
    called = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: called.append(mod) if mod is m.out_proj else None)
    try:
        m(*(torch.randn(1, 3, E, dtype=torch.float64),) * 3, need_weights=False)
    finally:
        handle.remove()
    assert called == [m.out_proj] and not projected


class _Adapter(nn.Linear):
    """A LoRA-like subclass: its forward adds a term of its own."""

    def forward(self, x):
        return super().forward(x) + 100.0


def test_a_subclass_or_a_parametrized_out_proj_runs_its_own_forward(projected):
    m = _module()
    x = torch.randn(1, 3, E, dtype=torch.float64)
    plain, _ = m(x, x, x, need_weights=False)
    adapter = _Adapter(E, E, dtype=torch.float64)
    adapter.load_state_dict(m.out_proj.state_dict())
    m.out_proj = adapter
    torch.testing.assert_close(m(x, x, x, need_weights=False)[0], plain + 100.0)
    m.out_proj = nn.Linear(E, E, dtype=torch.float64)
    m.out_proj.load_state_dict(adapter.state_dict())
    parametrize.register_parametrization(m.out_proj, "weight", _Doubled())
    doubled, _ = m(x, x, x, need_weights=False)
    torch.testing.assert_close(doubled - m.out_proj.bias.detach(), 2 * (plain - m.out_proj.bias.detach()))
    assert len(projected) == 1  # only the first, plain call


class _Doubled(nn.Module):
    def forward(self, weight):
        return 2 * weight


def test_a_forward_replaced_on_the_instance_is_called(projected):
    """accelerate's offloading sets forward on the module instance, not a torch hook."""
    m = _module()
    x = torch.randn(1, 3, E, dtype=torch.float64)
    plain, _ = m(x, x, x, need_weights=False)
    original = m.out_proj.forward
    m.out_proj.forward = lambda t: original(t) + 100.0
    torch.testing.assert_close(m(x, x, x, need_weights=False)[0], plain + 100.0)
    assert len(projected) == 1  # only the first, plain call
