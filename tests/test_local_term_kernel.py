"""The compiled local term (csrc/grid_conv.c): out + the depthwise convolution of the values over the token grid in
one pass, and its backward. Checked against torch's convolution in float64 (itself checked against a naive loop in
test_local_term.py) over kernel sizes, prefix tokens, padding, head widths that are not whole vectors and both
layouts; masked and prefix positions get no local term and no gradient; the module takes it for float32 CPU."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha import LinearMultiheadAttention, TokenGrid
from linear_mha.functional import backend, native, native_maps

pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled CPU code could not be built")


def case(b=2, h=3, height=5, width=7, prefix=2, d=20, k=3, module_layout=True, masked=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = prefix + height * width
    if module_layout:  # v a view of one (B, S, 3 H d) projection, out (B, S, H, d) in memory
        v = torch.randn(b, s, 3 * h * d, generator=g)[..., 2 * h * d:].view(b, s, h, d).transpose(1, 2)
        out = torch.randn(b, s, h, d, generator=g).transpose(1, 2)
    else:
        v, out = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    weight, bias = torch.randn(h * d, 1, k, k, generator=g), torch.randn(h * d, generator=g)
    mask = None
    if masked:
        mask = torch.zeros(b, s, dtype=torch.bool)
        mask[0, -4:] = True  # trailing padding
        mask[-1, prefix + width + 1] = True  # a position inside the grid
        v = v.masked_fill(mask[:, None, :, None], 1e4)  # garbage where masked: must reach nothing
    return out, v, weight, bias, (height, width, prefix), mask


def reference(out, v, weight, bias, grid, mask):
    return out + LF.token_grid_conv(v, weight, bias, *grid, mask)


def assert_gradients_match(inputs, wide, got, want, grad):
    """Backward through got and its float64 reference want with the same grad; every input's gradient agrees."""
    got.backward(grad)
    want.backward(grad.double())
    for name, a, b in zip(("out", "v", "weight", "bias"), inputs, wide):
        scale = b.grad.abs().max().item()
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prefix", [0, 2])
@pytest.mark.parametrize("d", [20, 64])
@pytest.mark.parametrize("module_layout", [True, False])
def test_output_and_gradients_match_the_float64_convolution(k, prefix, d, module_layout):
    out, v, weight, bias, grid, mask = case(prefix=prefix, d=d, k=k, module_layout=module_layout)
    inputs = [t.detach().requires_grad_() for t in (out, v, weight, bias)]
    wide = [t.detach().double().requires_grad_() for t in (out, v, weight, bias)]
    got = native_maps.local_term(*inputs, *grid, mask)
    want = reference(*wide, grid, mask)
    assert got.stride() == out.stride()  # laid out as attention's output, so merging the heads stays a view
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert_gradients_match(inputs, wide, got, want, torch.randn(got.shape, generator=torch.Generator().manual_seed(5)))
    if mask is not None:  # padded keys: no gradient, and their garbage (1e4) reached no output above
        assert inputs[1].grad.transpose(1, 2)[mask].abs().max() == 0
    assert torch.all(inputs[1].grad[:, :, :prefix] == 0)  # prefix tokens: no local term


@pytest.mark.parametrize("k", [3, 5])
def test_grid_rows_of_many_blocks(k):
    """The walks take a grid row in blocks of 4 columns (WALK_COLUMNS): rows of 37 take nine whole blocks
    and a part, a masked position sits in the sixth, and each block's taps reach into its neighbours."""
    out, v, weight, bias, grid, mask = case(height=4, width=37, prefix=1, d=20, k=k)
    mask[0, 1 + 37 + 20] = True
    v = v.masked_fill(mask[:, None, :, None], 1e4)
    inputs = [t.detach().requires_grad_() for t in (out, v, weight, bias)]
    wide = [t.detach().double().requires_grad_() for t in (out, v, weight, bias)]
    assert_gradients_match(inputs, wide, native_maps.local_term(*inputs, *grid, mask), reference(*wide, grid, mask),
                           torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    assert inputs[1].grad.transpose(1, 2)[mask].abs().max() == 0


@pytest.mark.parametrize("k, d, height, width", [(7, 24, 5, 9), (9, 8, 4, 11), (5, 24, 3, 2), (3, 40, 2, 13),
                                                  (1, 8, 2, 5), (3, 9, 3, 5)])
def test_the_forwards_walk_at_its_edges(k, d, height, width):
    """The forward walks grid rows in blocks of 4 columns (WALK_COLUMNS), sums carried from block to block, over
    lines of 16 channels, then one vector of 8 (d = 24, 40 on AVX2), then single channels; kernels wider than 7
    (k = 9) take the tap-by-tap path. Rows narrower than the kernel's radius (width 2 at k = 5) flush outputs
    from columns past the row's end."""
    out, v, weight, bias, grid, mask = case(height=height, width=width, prefix=1, d=d, k=k)
    inputs = [t.detach().requires_grad_() for t in (out, v, weight, bias)]
    wide = [t.detach().double().requires_grad_() for t in (out, v, weight, bias)]
    got = native_maps.local_term(*inputs, *grid, mask)
    want = reference(*wide, grid, mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert_gradients_match(inputs, wide, got, want, torch.randn(got.shape, generator=torch.Generator().manual_seed(4)))
    with torch.no_grad():  # in place, as the modules run it without a gradient
        target = out.clone()
        native_maps.local_term(target, v, weight, bias, *grid, mask, inplace=True)
        torch.testing.assert_close(target.double(), want.detach(), rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_prefix_rows_keep_the_output_and_inplace_writes_over_it():
    out, v, weight, bias, grid, mask = case()
    with torch.no_grad():
        fresh = native_maps.local_term(out, v, weight, bias, *grid, mask)
        torch.testing.assert_close(fresh[:, :, :2], out[:, :, :2], rtol=0, atol=0)
        target = out.clone()
        same = native_maps.local_term(target, v, weight, bias, *grid, mask, inplace=True)
        assert same.data_ptr() == target.data_ptr()
        torch.testing.assert_close(same, fresh, rtol=0, atol=0)
        shared = out[:1].expand(2, -1, -1, -1)  # its rows share memory: never written over
        before = shared.clone()
        res = native_maps.local_term(shared, v, weight, bias, *grid, mask, inplace=True)
        assert res.data_ptr() != shared.data_ptr() and torch.equal(shared, before)
        one_mask = mask[:1]  # broadcast over the batch, as torch's masked_fill takes it
        want = reference(out, v, weight, bias, grid, one_mask.expand_as(mask))
        got = native_maps.local_term(out, v, weight, bias, *grid, one_mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        values = v.clone()  # out is v itself: written over, it would feed later rows their own results
        res = native_maps.local_term(values, values, weight, bias, *grid, None, inplace=True)
        assert res.data_ptr() != values.data_ptr()
        # unmasked, the 1e4 garbage rows count: float32 sums of such terms are off by ~5e-3 (torch's too)
        want = reference(*(t.double() for t in (v, v, weight, bias)), grid, None)
        torch.testing.assert_close(res, want.float(), rtol=1e-5, atol=2e-2)


def test_gradients_repeat_bit_for_bit_and_do_not_depend_on_which_are_wanted():
    out, v, weight, bias, grid, mask = case(d=64)
    runs = []
    for _ in range(2):
        w = weight.detach().requires_grad_()
        native_maps.local_term(out, v, w, bias, *grid, mask).sum().backward()
        runs.append(w.grad)
    assert torch.equal(runs[0], runs[1])  # per-task partial sums: no race between threads
    grads_v = []
    for wanted in (True, False):  # d v alone (the compiled backward then sums no d w) must not change
        vv, w = v.detach().requires_grad_(), weight.detach().requires_grad_(wanted)
        native_maps.local_term(out, vv, w, bias, *grid, mask).sum().backward()
        assert (w.grad is not None) == wanted
        grads_v.append(vv.grad)
        if wanted:  # d w beside d v equals d w alone (runs[0], where the backward skips d v's arithmetic)
            assert w.grad.abs().sum() > 0 and torch.equal(w.grad, runs[0])
    assert torch.equal(grads_v[0], grads_v[1])


def test_the_module_takes_the_compiled_term_for_float32_and_matches_torchs():
    torch.manual_seed(0)
    m = LinearMultiheadAttention(48, 3, mode="kernel", dwc_kernel=3, batch_first=True)
    with torch.no_grad():
        m.dwc_weight.normal_()
        m.dwc_bias.normal_()
    x = torch.randn(2, 1 + 4 * 5, 48, requires_grad=True)
    kpm = torch.zeros(2, 21, dtype=torch.bool)
    kpm[1, -5:] = True
    grid = TokenGrid(4, 5, prefix=1)
    assert backend.local_term_backend(x.new_zeros(2, 3, 21, 16), x.new_zeros(2, 3, 21, 16), m.dwc_weight,
                                      m.dwc_bias).backend == backend.NATIVE
    calls = []
    compiled = native_maps.local_term
    native_maps.local_term = lambda *a, **kw: calls.append(1) or compiled(*a, **kw)
    try:
        got, _ = m(x, x, x, key_padding_mask=kpm, token_grid=grid)
    finally:
        native_maps.local_term = compiled
    assert calls
    got.sum().backward()
    grads = [t.grad.clone() for t in (x, m.dwc_weight, m.dwc_bias, m.in_proj_weight)]
    for t in (x, m.dwc_weight, m.dwc_bias, m.in_proj_weight):
        t.grad = None
    with backend.override(native_kernels=False):
        want, _ = m(x, x, x, key_padding_mask=kpm, token_grid=grid)
        want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, (x.grad, m.dwc_weight.grad, m.dwc_bias.grad, m.in_proj_weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_what_the_compiled_term_does_not_take_goes_to_torch_with_a_reason():
    out, v, weight, bias, _, _ = case()
    assert backend.local_term_backend(out, v, weight, bias).backend == backend.NATIVE
    wide = torch.zeros(v.shape[1] * v.shape[3], 1, 17, 17)
    assert "17" in backend.local_term_backend(out, v, wide, None).reason
    assert "float64" in backend.local_term_backend(out.double(), v.double(), weight, bias).reason
    assert "differ" in backend.local_term_backend(out[:, :, 1:], v, weight, bias).reason


def test_sizes_the_compiled_code_cannot_take_are_refused_before_it_runs():
    """Called directly, the compiled term refuses what the modules refuse (an even k, a grid that is not the
    sequence, an empty grid): the C code trusts the sizes it is given, and over an empty grid it would leave the
    output unwritten."""
    out, v, weight, bias, grid, mask = case()
    with pytest.raises(ValueError, match="odd k"):
        native_maps.local_term(out, v, torch.zeros(weight.shape[0], 1, 4, 4), bias, *grid, mask)
    with pytest.raises(ValueError, match="the grid must describe"):
        native_maps.local_term(out, v, weight, bias, grid[0], grid[1] + 1, grid[2], mask)
    s = v.shape[2]
    with pytest.raises(ValueError, match="at least one grid token"):
        native_maps.local_term(out, v, weight, bias, 0, 7, s, mask)


def test_outputs_and_d_v_do_not_depend_on_the_thread_count():
    """Each output row and each d v row is one task's, summed in one order however the rows are split over tasks
    (d w and d b are summed per task, so their last bits follow the task count, as the kernel's comment says)."""
    out, v, weight, bias, grid, mask = case(d=64, height=6, width=9)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            leaf = v.detach().requires_grad_()
            got = native_maps.local_term(out, leaf, weight, bias, *grid, mask)
            got.backward(grad)
            results.append((got.detach(), leaf.grad))
    finally:
        torch.set_num_threads(threads)
    for got, grad_v in results[1:]:
        assert torch.equal(got, results[0][0]) and torch.equal(grad_v, results[0][1])


@pytest.mark.parametrize("mode", ["kernel", "softmax"])
def test_forward_mode_tangents_take_the_path_that_carries_them(mode):
    """torch.autograd.forward_ad through a frozen float32 module with the local term and the gate: the compiled code
    reads raw memory and would drop the tangents (or keep the attention's alone), so those calls take PyTorch ops;
    the tangent matches the float64 module's."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    m = LinearMultiheadAttention(16, 2, mode=mode, dwc_kernel=3, output_gate=True, batch_first=True)
    with torch.no_grad():
        for p in (m.dwc_weight, m.dwc_bias, m.gate_weight):
            p.normal_(0, 0.5)
    m.requires_grad_(False)
    x, tangent = torch.randn(2, 12, 16), torch.randn(2, 12, 16)
    tangents = []
    for dtype in (torch.float32, torch.float64):
        mm = m.to(dtype)
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.to(dtype), tangent.to(dtype))
            out = mm(dual, dual, dual, token_grid=TokenGrid(3, 4))[0]
            tangents.append(fwAD.unpack_dual(out).tangent)
    assert tangents[0] is not None
    torch.testing.assert_close(tangents[0].double(), tangents[1], rtol=1e-4, atol=1e-4)


def test_tangents_on_the_parameters_and_vmap_inside_a_dual_level():
    """A dual weight sends the local term and the gate to PyTorch ops; torch.func.vmap inside a dual level (whose
    batched tensors cannot be asked for a tangent) still runs."""
    import torch.autograd.forward_ad as fwAD
    out, v, weight, bias, _, _ = case()
    q = torch.randn(out.shape)
    gate_w = torch.zeros(out.shape[1], out.shape[-1], out.shape[-1])
    with fwAD.dual_level():
        dual = fwAD.make_dual(weight, torch.ones_like(weight))
        assert "tangent" in backend.local_term_backend(out, v, dual, bias).reason
        dual_gate = fwAD.make_dual(gate_w, torch.ones_like(gate_w))
        assert "tangent" in backend.output_gate_backend(out, q, dual_gate, None).reason
        assert backend.local_term_backend(out, v, weight, bias).backend == backend.NATIVE
        m = LinearMultiheadAttention(16, 2, mode="kernel", dwc_kernel=3, batch_first=True).requires_grad_(False)
        xs = torch.randn(3, 1, 12, 16)
        got = torch.func.vmap(lambda x: m(x, x, x, token_grid=TokenGrid(3, 4))[0])(xs)
    want = torch.stack([m(x, x, x, token_grid=TokenGrid(3, 4))[0] for x in xs])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
