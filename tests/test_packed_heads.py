"""q, k, v split from one projection (functional/packed_heads.py): the same views and gradients as torch's chunk,
and, through the compiled backward, gradients written side by side and handed to the projection without a copy."""
import pytest
import torch

import linear_mha.functional as LF
import modes
from linear_mha import LinearMultiheadAttention
from linear_mha.functional import native, packed_heads

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def chunked(packed, parts, heads):
    b, n, width = packed.shape
    return tuple(t.reshape(b, n, heads, width // (parts * heads)).transpose(1, 2) for t in packed.chunk(parts, -1))


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("missing", [None, 1])
def test_split_and_its_gradient_match_torch_chunk(parts, missing):
    """Separate gradients (any backward but the compiled one), one of them missing (a tensor that reached no
    output): gathered into the projection's layout as chunk's backward does, the missing one as zeros."""
    g = torch.Generator().manual_seed(parts)
    packed = torch.randn(2, 7, parts * 3 * 4, generator=g, dtype=torch.float64)
    grads = [torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64) for _ in range(parts)]
    if missing is not None:
        grads[missing] = None
    results = []
    for split in (packed_heads.split_heads, chunked):
        leaf = packed.clone().requires_grad_()
        views = split(leaf, parts, 3)
        used = [(v, gr) for v, gr in zip(views, grads) if gr is not None]
        torch.autograd.backward([v for v, _ in used], [gr for _, gr in used])
        results.append(([v.detach() for v in views], leaf.grad))
    (views, grad), (want_views, want_grad) = results
    assert all(torch.equal(a, b) for a, b in zip(views, want_views))
    assert torch.equal(grad, want_grad)


def test_gathered_takes_only_views_of_one_tensor_side_by_side():
    whole = torch.randn(2, 5, 3, 4, 6)
    grads = [whole.select(2, i).transpose(1, 2) for i in range(3)]
    found = packed_heads.gathered(grads)
    assert found is not None and found.data_ptr() == whole.data_ptr() and torch.equal(found, whole.reshape(2, 5, 72))
    assert packed_heads.gathered(grads[::-1]) is None  # out of order
    assert packed_heads.gathered([grads[0], grads[1].clone(), grads[2]]) is None  # other memory
    assert packed_heads.gathered([grads[0], None, grads[2]]) is None
    wider = torch.randn(2, 5, 4, 4, 6)  # rows wider than the parts: a strided view of the first three is right
    parts = [wider.select(2, i).transpose(1, 2) for i in range(3)]
    assert torch.equal(packed_heads.gathered(parts), wider[:, :, :3].reshape(2, 5, 72))
    assert packed_heads.gathered([wider.select(2, i).transpose(1, 2) for i in (0, 1, 3)]) is None  # a gap


def _handed_block(batch_major):
    """A split's parts and the block a compiled backward would make for their gradients, handed to that split."""
    packed = torch.zeros(2, 5, 72, requires_grad=True) if batch_major else \
        torch.zeros(5, 2, 72).transpose(0, 1).requires_grad_()
    q, k, v = packed_heads.split_heads(packed, 3, 4)
    slots = packed_heads.packed_outputs(q, 3, 2, 4, 5, 6, lambda t, *shape: torch.randn(shape), (q, k, v))
    return q.grad_fn.packed_blocks, slots


@pytest.mark.parametrize("batch_major", [True, False])
def test_a_part_summed_apart_is_written_into_the_block_the_others_lie_in(batch_major):
    """Autograd sums two consumers' gradients of v (the local term's and attention's) into a new tensor: copied into
    the block the other parts lie in, not every part gathered again; nothing else is written."""
    handed, (q, k, v) = _handed_block(batch_major)
    summed = torch.randn(2, 4, 5, 6)
    assert packed_heads.filled_block([q, k, summed], 4, []) is None  # not a block handed to this split
    assert packed_heads.filled_block([q, k, summed], 4, handed) is None  # its slot still seen (v): never written
    del v  # as autograd drops the backward's own term once it has summed it
    whole = packed_heads.filled_block([q, k, summed], 4, handed)
    assert whole is not None and whole.data_ptr() == q.data_ptr()
    assert torch.equal(whole, torch.cat([t.transpose(1, 2).reshape(2, 5, 24) for t in (q, k, summed)], -1))
    handed_again, (q_again, k_again, v_again) = _handed_block(batch_major)
    del q_again, v_again  # nothing sees those slots: only the part left out refuses the block
    assert packed_heads.filled_block([None, k_again, summed], 4, handed_again) is None
    assert packed_heads.filled_block([q, summed, k], 4, handed) is None  # a part lying elsewhere in the block
    inside = torch.randn(2, 5, 3, 4, 6 + 1)[..., :6]  # a block inside a larger tensor: not one a backward made
    parts = [inside.select(2, i).transpose(1, 2) for i in range(3)]
    before = inside.clone()
    entry = packed_heads.HandedBlock(parts[:2] + [torch.empty(0)])  # the third slot's view gone
    assert packed_heads.filled_block([parts[0], parts[1], summed], 4, [entry]) is None and torch.equal(inside, before)
    longer = torch.randn(2 * 5 * 72 + 8)  # the block's layout, but its memory holds more than the block
    block = longer[:720].view(2, 5, 3, 4, 6)
    parts = [block.select(2, i).transpose(1, 2) for i in range(3)]
    before = longer.clone()
    entry = packed_heads.HandedBlock(parts[:2] + [torch.empty(0)])
    assert packed_heads.filled_block([parts[0], parts[1], summed], 4, [entry]) is None and torch.equal(longer, before)


def test_a_split_keeps_no_block_alive_and_hands_blocks_only_for_its_own_parts():
    """Blocks are held weakly (a graph kept with retain_graph, whose split's backward never runs, holds no memory),
    and a block whose parts mix two splits is handed to neither: a slot may hold another split's gradient."""
    handed, slots = _handed_block(True)
    assert len(handed) == 1 and handed[0].alive()
    del slots
    assert not handed[0].alive()
    packed = torch.zeros(2, 5, 72, requires_grad=True)
    q1, k1, v1 = packed_heads.split_heads(packed, 3, 4)
    q2, k2, v2 = packed_heads.split_heads(packed, 3, 4)
    kept = packed_heads.packed_outputs(q2, 3, 2, 4, 5, 6, lambda t, *shape: torch.randn(shape), (q2, k1, v2))
    assert kept and q2.grad_fn.packed_blocks == [] and k1.grad_fn.packed_blocks == []
    # k and v of a q, k, v split: their block of two is not the split's block of three
    kv = packed_heads.packed_outputs(k1, 2, 2, 4, 5, 6, lambda t, *shape: torch.randn(shape), (k1, v1))
    assert kv and k1.grad_fn.packed_blocks == []
    k1.grad_fn.packed_blocks.append(packed_heads.HandedBlock(kv))  # and one listed anyway is passed over
    assert packed_heads.filled_block([None, kv[0], kv[1]], 4, k1.grad_fn.packed_blocks) is None


@needs_native
def test_key_and_value_of_a_three_part_split_through_the_compiled_backward():
    """Attention on k and v of one q, k, v split whose q reaches it otherwise (key re-weighting's path): the
    gradients match torch's chunk."""
    torch.manual_seed(0)
    runs = []
    packed = torch.randn(1, 40, 3 * 2 * 8)
    for split in (packed_heads.split_heads, chunked):
        leaf = packed.clone().requires_grad_()
        q, k, v = split(leaf, 3, 2)
        out = LF.kernel(q.detach() * 1.0, k, v, feature_map="elu") + q  # q's gradient from elsewhere
        out.square().sum().backward()
        runs.append(leaf.grad)
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


def test_a_callers_gradient_laid_out_as_a_block_is_never_written():
    """An upstream gradient that happens to be a (B, N, 3, H, d) block, stacked from the split's parts, with one
    part summed apart: the caller's tensor must stay as it was, and the gradient must be right."""
    packed = torch.randn(2, 5, 3 * 2 * 4, requires_grad=True)
    q, k, v = packed_heads.split_heads(packed, 3, 2)
    stacked = torch.stack([t.transpose(1, 2) for t in (q, k, v)], 2)  # (B, N, 3, H, d)
    upstream = torch.randn(stacked.shape)
    kept = upstream.clone()
    (grad,) = torch.autograd.grad([stacked, (v * 2).sum()], [packed], [upstream, torch.tensor(1.0)])
    assert torch.equal(upstream, kept)
    want = kept.clone()
    want[:, :, 2] += 2
    torch.testing.assert_close(grad, want.reshape(2, 5, 24))


@needs_native
@pytest.mark.parametrize("option", ["dwc_kernel", "output_gate"])
def test_a_module_option_reading_a_part_again_adds_its_gradient_into_the_block(option):
    """The local term reads v and the gate q besides attention: the split hands that part out again, and its
    backward adds the option's gradient into the compiled backward's block in place (no new sum, no part copied
    back), with the numbers of the float64 module."""
    from linear_mha import TokenGrid
    torch.manual_seed(0)
    options = {option: 3 if option == "dwc_kernel" else True}
    m = LinearMultiheadAttention(32, 2, mode="kernel", batch_first=True, **options)
    with torch.no_grad():
        for name in ("dwc_weight", "gate_weight"):
            if getattr(m, name, None) is not None:
                getattr(m, name).normal_(0, 0.3)
    x = torch.randn(2, 20, 32)
    in_place = []
    real = packed_heads._second_gradients_added

    def spy(ctx, grads, *rest):
        firsts = list(grads[:ctx.parts])
        parts = real(ctx, grads, *rest)
        in_place.append(all(a is b for a, b in zip(firsts, parts)) and packed_heads.gathered(parts) is not None)
        return parts
    packed_heads._second_gradients_added = spy
    grads = []
    try:
        for dtype in (torch.float32, torch.float64):
            mm = m.to(dtype)
            leaf = x.to(dtype).detach().requires_grad_()
            mm(leaf, leaf, leaf, token_grid=TokenGrid(4, 5))[0].square().sum().backward()
            grads.append((leaf.grad, mm.in_proj_weight.grad.clone()))
            mm.zero_grad()
    finally:
        packed_heads._second_gradients_added = real
    assert in_place[0], "the option's gradient was summed apart, or the parts no longer lie in the block"
    for a, b in zip(*grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("own", [True, False])
def test_parts_handed_out_again_get_both_gradients(compiled, own):
    """q and v handed out a second time (split_heads' again), each read by a second consumer: the projection's
    gradient is the sum of both consumers' as through torch's chunk, whether the first gradients lie in a compiled
    backward's block (summed in place) or not (summed apart); a second gradient alone, with the part's first
    consumer unused, is the part's gradient."""
    if compiled and not native.available():
        pytest.skip(f"kernels not built: {native.build_error()}")
    g = torch.Generator().manual_seed(1)
    packed = torch.randn(1, 30, 3 * 2 * 8, generator=g)
    w = torch.randn(3, 1, 30, 8, generator=g)
    runs = []
    for split in ("again", "chunk"):
        leaf = packed.clone().requires_grad_()
        if split == "again":
            q, k, v, q2, v2 = packed_heads.split_heads(leaf, 3, 2, again=(0, 2), own_gradients=own)
        else:
            q, k, v = chunked(leaf, 3, 2)
            q2, v2 = q, v
        attention = LF.kernel(q, k, v, feature_map="elu") if compiled else (q * k).sum(-1, keepdim=True) * v
        (attention * w[0] + (q2.square() * w[1]) + (v2.sin() * w[2])).sum().backward()
        runs.append(leaf.grad)
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)
    leaf = packed.clone().requires_grad_()
    q, k, v, v2 = packed_heads.split_heads(leaf, 3, 2, again=(2,))
    (q.sum() + v2.sum() * 3).backward()
    want = torch.zeros_like(packed).view(1, 30, 3, 16)
    want[:, :, 0], want[:, :, 2] = 1, 3
    assert torch.equal(leaf.grad, want.view(1, 30, 48))
    with pytest.raises(ValueError, match="again must list parts"):
        packed_heads.split_heads(leaf, 3, 2, again=(3,))


@needs_native
@pytest.mark.parametrize("own, kept", [(True, "the gradient"), (False, "the gradient"), (False, "a view of it")])
def test_what_a_hook_kept_of_the_first_gradient_is_not_written_by_the_second(own, kept):
    """A hook that keeps attention's q gradient, or a view of it (returning nothing): the gate's gradient is not
    added into it, and the projection's gradient is still the sum. A caller that owns its parts' gradients
    (own_gradients, as the modules do) has no hooks on them; the gradient itself kept is still seen there (it has one
    reference more than a gradient nothing else holds), a view of it only without own_gradients."""
    from linear_mha.functional import native_maps
    g = torch.Generator().manual_seed(2)
    packed = torch.randn(1, 40, 3 * 2 * 8, generator=g)
    weight, bias = torch.randn(2, 8, 8, generator=g) * 0.3, torch.zeros(2, 1, 8)
    runs = []
    for again in ((0,), ()):
        leaf = packed.clone().requires_grad_()
        q, k, v, *second = packed_heads.split_heads(leaf, 3, 2, again=again, own_gradients=own)
        saved = []
        keep = (lambda grad: grad) if kept == "the gradient" else (lambda grad: grad.detach()[:, :1])
        q.register_hook(lambda grad: saved.append((keep(grad), keep(grad).clone())) and None)
        native_maps.output_gate(LF.kernel(q, k, v, feature_map="elu"), second[0] if second else q, weight,
                                bias).square().sum().backward()
        if again:
            assert torch.equal(saved[0][0], saved[0][1])
        runs.append(leaf.grad)
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)
@needs_native
@pytest.mark.parametrize("split_of,name", [("qkv", "kernel_elu"), ("kv", "kernel_elu"), ("qk", "kernel_elu"),
                                           ("qkv", "efficient")])
def test_the_compiled_backward_writes_the_split_gradients_side_by_side(split_of, name):
    """The gradients reaching the split must be views of one tensor (else the projection gets a copy), with the
    same numbers as through torch's chunk. "qk": DETR's encoder, whose queries and keys share their input. The
    registry's rows run as modules run them."""
    method = modes.method_of(modes.ALL_VARIANTS[name])
    g = torch.Generator().manual_seed(4)
    parts = len(split_of)
    packed = torch.randn(1, 300, parts * 4 * 16, generator=g)
    other = torch.randn(1, 4, 300, 16, generator=g)
    grad = torch.randn(1, 4, 300, 16, generator=g)
    runs = []
    for split in (packed_heads.split_heads, chunked):
        leaf = packed.clone().requires_grad_()
        views = list(split(leaf, parts, 4))
        seen = []
        for v in views:
            v.register_hook(seen.append)
        named = dict(zip(split_of, views))
        out = modes.attend_with(method, {}, named.get("q", other), named["k"], named.get("v", other))
        assert type(out.grad_fn)._forward_cls.__module__ == native.__name__  # made by the compiled backward's Function
        out.backward(grad)
        runs.append((leaf.grad, seen))
    (got, seen), (want, _) = runs
    by_pointer = sorted(seen, key=lambda t: t.data_ptr())
    assert packed_heads.gathered(by_pointer) is not None, "the compiled backward wrote the gradients apart"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("inputs", ["x, x, x", "x, x, y", "x, y, y"])
def test_a_module_step_matches_float64_through_the_split(inputs):
    """Self-attention, DETR's encoder (query is key, the value apart) and k, v of one input."""
    torch.manual_seed(0)
    m = LinearMultiheadAttention(64, 4, mode="kernel")
    x, y = torch.randn(50, 2, 64), torch.randn(50, 2, 64)
    grads = []
    for dtype in (torch.float32, torch.float64):
        mm = m.to(dtype)
        leaves = {"x": x.to(dtype).detach().requires_grad_(), "y": y.to(dtype).detach().requires_grad_()}
        out, _ = mm(*(leaves[name] for name in inputs.split(", ")))
        out.square().sum().backward()
        grads.append((leaves["x"].grad.clone(), leaves["y"].grad, mm.in_proj_weight.grad.clone(),
                      mm.in_proj_bias.grad.clone()))
        mm.zero_grad()
    for a, b in zip(*grads):
        if a is not None or b is not None:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_second_order_gradients_through_the_split():
    """Gradients that are themselves differentiated (create_graph) and happen to lie side by side, as stacking
    the heads back makes them: every part's history must survive the split's backward."""
    packed = torch.randn(1, 4, 3 * 2 * 3, dtype=torch.float64, requires_grad=True)

    def stacked_squares(p):
        q, k, v = packed_heads.split_heads(p, 3, 2)
        return torch.stack([t.transpose(1, 2) for t in (q, k, v)], 2) ** 2
    assert torch.autograd.gradcheck(stacked_squares, (packed,))
    assert torch.autograd.gradgradcheck(stacked_squares, (packed,))


def test_forward_mode_gradients_of_a_module_through_the_split():
    """torch.func.jvp / forward_ad on a module whose q, k, v come from one projection (PyTorch ops path)."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    m = LinearMultiheadAttention(16, 2, mode="taylor").double()
    x, tangent = torch.randn(5, 1, 16, dtype=torch.float64), torch.randn(5, 1, 16, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        got = fwAD.unpack_dual(m(dual, dual, dual)[0]).tangent
    eps = 1e-6
    with torch.no_grad():
        plus, minus = x + eps * tangent, x - eps * tangent
        want = (m(plus, plus, plus)[0] - m(minus, minus, minus)[0]) / (2 * eps)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@needs_native
def test_a_gradient_a_hook_kept_is_never_written_over():
    """A hook that keeps the compiled backward's q gradient and returns another: the kept tensor stays as it was (the
    block's slot is then still seen, so the parts are gathered), and the projection's gradient is right."""
    torch.manual_seed(0)
    packed = torch.randn(1, 30, 3 * 2 * 8, requires_grad=True)
    q, k, v = packed_heads.split_heads(packed, 3, 2)
    kept = []
    q.register_hook(lambda g: (kept.append((g, g.clone())), g * 2)[1])
    LF.kernel(q, k, v, feature_map="elu").square().sum().backward()
    assert kept and torch.equal(kept[0][0], kept[0][1])
    want = packed.detach().clone().requires_grad_()
    q2, k2, v2 = chunked(want, 3, 2)
    q2.register_hook(lambda g: g * 2)
    LF.kernel(q2, k2, v2, feature_map="elu").square().sum().backward()
    torch.testing.assert_close(packed.grad, want.grad, rtol=1e-5, atol=1e-6)
