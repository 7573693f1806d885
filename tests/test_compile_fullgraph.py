"""torch.compile records every method as one graph, masks included: fullgraph=True compiles, with dynamic shapes
too, and the compiled outputs and gradients are eager's. Checks on a mask's values run inside the graph there, and
still refuse bad masks. (test_compile_models.py: the models users patch.)"""
import pytest
import torch
from torch import nn

import linear_mha
import modes
from compile_checks import assert_compiled_matches_eager, needs_recent_dynamo

pytestmark = needs_recent_dynamo
L, B, E, H = 12, 2, 32, 4
MASKS = ["none", "bool padding", "float padding", "causal"]


def _attention_case(mode, mask, tokens=L):
    torch.manual_seed(0)
    module = linear_mha.LinearMultiheadAttention(E, H, mode=mode, **modes.sized(mode, tokens))
    x = torch.randn(tokens, B, E)
    kwargs = {}
    grid = modes.grid_for(mode, tokens)
    if grid is not None:
        kwargs["token_grid"] = grid
    if mask in ("bool padding", "float padding"):
        padding = torch.zeros(B, tokens, dtype=torch.bool)
        padding[1, tokens * 2 // 3:] = True
        kwargs["key_padding_mask"] = padding if mask == "bool padding" else torch.zeros(B, tokens).masked_fill(
            padding, float("-inf"))
    if mask == "causal" or not module.method.bidirectional:  # a causal-only method takes every mask causally
        kwargs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(tokens), is_causal=True)

    def attend(x):
        return module(x, x, x, need_weights=False, **kwargs)[0]
    return attend, x


CASES = [(mode, mask) for mode in modes.BUILT_IN for mask in MASKS
         if mask != "causal" or linear_mha.method_class(mode).causal]


@pytest.mark.parametrize("mode,mask", CASES)
def test_every_method_and_mask_compiles_as_one_graph_that_computes_what_eager_does(mode, mask):
    """fullgraph=True fails at the first graph break, naming it (the model tests count them with explain)."""
    attend, x = _attention_case(mode, mask)
    assert_compiled_matches_eager(attend, [x])


@pytest.mark.parametrize("mode", ["kernel", "taylor", "softmax"])
def test_a_float_padding_mask_compiles_once_with_dynamic_shapes_for_every_length(mode):
    """dynamic=True: one graph serves other lengths and batches (nn.TransformerEncoder hands its layers a float
    padding mask)."""
    torch.manual_seed(0)
    module = linear_mha.LinearMultiheadAttention(E, H, mode=mode)

    def attend(x, padding):
        return module(x, x, x, key_padding_mask=padding, need_weights=False)[0]
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for tokens, batch in ((L, B), (7, 3), (20, 1)):
            x = torch.randn(tokens, batch, E)
            padding = torch.zeros(batch, tokens).index_fill(1, torch.tensor([tokens - 1]), float("-inf"))
            torch.testing.assert_close(compiled(x, padding), attend(x, padding), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["kernel", "softmax"])
def test_the_mask_checks_run_inside_the_graph(mode):
    """A NaN in a float mask, or a non-causal mask with is_causal=True, still stops a compiled call, with the
    eager message, instead of a branch that would split the graph (or a wrong answer)."""
    x = torch.randn(L, B, E)
    module = linear_mha.LinearMultiheadAttention(E, H, mode=mode)
    any_mask = module.method.any_mask  # applies any mask as it is (softmax), is_causal being a hint (as torch's)
    nan_padding = torch.zeros(B, L).index_fill(1, torch.tensor([3]), float("nan"))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, m: module(x, x, x, key_padding_mask=m)[0], fullgraph=True, backend="aot_eager")
    compiled(x, torch.zeros(B, L))
    with pytest.raises(RuntimeError, match="NaN or \\+inf" if any_mask else "other than 0 and -inf"):
        compiled(x, nan_padding)
    torch._dynamo.reset()
    causal = torch.compile(lambda x, m: module(x, x, x, attn_mask=m, is_causal=True)[0], fullgraph=True,
                           backend="aot_eager")
    causal(x, nn.Transformer.generate_square_subsequent_mask(L))
    if not any_mask:
        with pytest.raises(RuntimeError, match="not the causal"):
            causal(x, torch.zeros(L, L))


@pytest.mark.slow
@pytest.mark.parametrize("mode,mask", [("kernel", "float padding"), ("softmax", "causal")])
def test_inductor_compiles_one_graph_that_computes_what_eager_does(mode, mask):
    attend, x = _attention_case(mode, mask)
    assert_compiled_matches_eager(attend, [x], backend="inductor")
