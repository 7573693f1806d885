"""The compiled code's reads and writes in a module's layout: heads that are views of one projection get their
outputs and input gradients written in that layout, with the numbers of contiguous inputs, bit for bit, causal heads
walked in turn over many chunks included."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import native

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def _split_heads(projection, heads):
    """q, k, v as a module makes them: (B, H, N, d) views of one (B, N, 3 H d) projection."""
    b, n, _ = projection.shape
    return [t.reshape(b, n, heads, -1).transpose(1, 2) for t in projection.chunk(3, dim=-1)]


LAYOUT_CASES = {
    "elu": lambda q, k, v: LF.kernel(q, k, v, feature_map="elu"),
    # k in the projection's layout and v contiguous: each gradient in its own input's layout
    "elu_v_contiguous": lambda q, k, v: LF.kernel(q, k, v.contiguous(), feature_map="elu"),
    "relu_causal_v_contiguous": lambda q, k, v: LF.kernel(q, k, v.contiguous(), feature_map="relu", causal=True),
    "taylor_causal": lambda q, k, v: LF.kernel(q, k, v, feature_map="taylor", causal=True),
    "padding": lambda q, k, v: LF.kernel(q, k, v, feature_map="relu",
                                         key_padding_mask=torch.arange(q.shape[2]).expand(q.shape[0], -1) >= 37),
    "focused": lambda q, k, v: LF.focused(q, k, v, scale=torch.linspace(0.5, 2, 4 * 8).reshape(4, 1, 8)),
    "hedgehog": lambda q, k, v: LF.hedgehog(q, k, v, (torch.eye(8).expand(4, 8, 8), None),
                                            (0.5 * torch.eye(8).expand(4, 8, 8), None)),
    "rope": lambda q, k, v: LF.grid_rope.grid_rope_kernel(q, k, v, "taylor", (5, 8, 1)),
    "efficient": lambda q, k, v: LF.efficient_attention(q, k, v),
    "efficient_padding_v_contiguous": lambda q, k, v: LF.efficient_attention(
        q, k, v.contiguous(), key_padding_mask=torch.arange(q.shape[2]).expand(q.shape[0], -1) >= 37),
}


@needs_native
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_outputs_and_gradients_follow_the_inputs_layout_with_the_same_numbers(case):
    """Heads that are views of one projection (a module's) get their output and input gradients written in that
    layout, (B, N, H, d) in memory, so that merging the heads and reshaping the gradients back are views; the
    numbers are those of contiguous inputs, bit for bit. A wrong stride in any kernel's reads or writes breaks it."""
    _check_split_against_contiguous(LAYOUT_CASES[case], batch=2, n=41, heads=4)


def _check_split_against_contiguous(attention, batch, n, heads, dim=8):
    g = torch.Generator().manual_seed(3)
    projection = torch.randn(batch, n, 3 * heads * dim, generator=g).requires_grad_()
    grad = torch.randn(batch, heads, n, dim, generator=g)
    split = _split_heads(projection, heads)
    plain = [t.detach().contiguous().requires_grad_() for t in split]
    out_split, out_plain = attention(*split), attention(*plain)
    assert out_split.transpose(1, 2).is_contiguous() and out_plain.is_contiguous()
    assert torch.equal(out_split, out_plain)
    (grad_projection,) = torch.autograd.grad(out_split, projection, grad.transpose(1, 2).contiguous().transpose(1, 2))
    grads = torch.autograd.grad(out_plain, plain, grad)
    assert torch.equal(grad_projection,
                       torch.cat([t.transpose(1, 2).reshape(batch, n, heads * dim) for t in grads], dim=-1))


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["relu_causal_v_contiguous", "taylor_causal"])
def test_causal_heads_walked_in_turn_over_many_chunks_give_each_heads_own_numbers(case, threads):
    """In a module's layout a causal task walks a few heads in turn, chunk by chunk, each with its own carried
    state; over several chunks (130 positions) and 8 heads the numbers are still those of contiguous inputs, bit
    for bit. A state shared between the heads of a task, or a chunk given another head's rows, breaks it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_split_against_contiguous(LAYOUT_CASES[case], batch=1, n=130, heads=8)
        # two sequences with their own padding: a group's heads never read another sequence's rows or mask
        padding = torch.arange(100) >= torch.tensor([[63], [100]])
        _check_split_against_contiguous(
            lambda q, k, v: LF.kernel(q, k, v, feature_map="relu", causal=True, key_padding_mask=padding),
            batch=2, n=100, heads=6)
        # the carried states start from each head's own initial state, and each head's gradient reaches its own
        state = torch.rand(1, 8, 8, 9, generator=torch.Generator().manual_seed(5)).requires_grad_()
        projection = torch.randn(1, 130, 3 * 8 * 8, generator=torch.Generator().manual_seed(6))
        outs, grads = [], []
        for q, k, v in (_split_heads(projection, 8), [t.contiguous() for t in _split_heads(projection, 8)]):
            out = LF.kernel(q, k, v, feature_map="elu", causal=True, initial_state=state)
            outs.append(out)
            grads.append(torch.autograd.grad(out, state, torch.ones_like(out))[0])
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    finally:
        torch.set_num_threads(before)
