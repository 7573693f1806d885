"""Helpers of the torch.compile tests: graph breaks counted, compiled against eager."""
import warnings

import pytest
import torch

# The dynamo of torch < 2.6 breaks graphs elsewhere in the attention path (dict updates, vars()).
needs_recent_dynamo = pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"),
                                         reason="one graph of the attention path needs the dynamo of torch >= 2.6")


def graph_breaks(fn, *args, **kwargs):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
    return explained.graph_break_count, [str(r.reason).split("\n")[0] for r in explained.break_reasons]


def assert_compiled_matches_eager(fn, inputs, dynamic=False, backend="aot_eager", **kwargs):
    """fullgraph compile of fn(*inputs, **kwargs): outputs, and gradients of the floating inputs, equal eager's."""
    torch._dynamo.reset()
    leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    eager = fn(*leaves, **kwargs)
    eager_grads = torch.autograd.grad(eager.square().sum(), [x for x in leaves if x.requires_grad])
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)(*leaves, **kwargs)
    grads = torch.autograd.grad(compiled.square().sum(), [x for x in leaves if x.requires_grad])
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
