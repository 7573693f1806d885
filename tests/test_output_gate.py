"""output_gate: every head's output times 2·sigmoid(q W + b) from its own queries. Checked against that formula in
float64 for every method, identity at first (a patched pretrained model is unchanged; an original checkpoint loads),
causal outputs blind to the future, padding garbage reaching nothing, gradients, and the adapters that take it."""
import pytest
import torch
from torch import nn

import linear_mha
import modes
from linear_mha import LinearMultiheadAttention, patch
from linear_mha.functional import backend, native, native_maps

E, H = 8, 2


def gated_module(mode, seed=0, **options):
    torch.manual_seed(seed)
    m = LinearMultiheadAttention(E, H, mode=mode, batch_first=True, output_gate=True,
                                 **modes.sized(mode, 16, **options)).double()
    with torch.no_grad():
        m.gate_weight.normal_(0, 0.5)
        m.gate_bias.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("mode", modes.BUILT_IN)
def test_the_gate_multiplies_every_methods_heads_by_two_sigmoid_of_the_queries(mode):
    m = gated_module(mode)
    x = torch.randn(2, 12, E, dtype=torch.float64)
    grid = modes.grid_for(m, 12)
    causal = modes.causal_if_required(m)
    gated, _ = m(x, x, x, need_weights=False, token_grid=grid, **causal)
    weight, bias = m.gate_weight, m.gate_bias
    m.gate_weight, m.gate_bias = None, None
    plain_heads = []
    m.out_proj.register_forward_pre_hook(lambda mod, args: plain_heads.append(args[0]))
    m(x, x, x, need_weights=False, token_grid=grid, **causal)
    q = nn.functional.linear(x, m.in_proj_weight[:E], m.in_proj_bias[:E]).view(2, 12, H, E // H).transpose(1, 2)
    gate = 2 * torch.sigmoid(torch.einsum("bhld,hde->bhle", q, weight) + bias)
    heads = plain_heads[0].view(2, 12, H, E // H).transpose(1, 2) * gate
    want = m.out_proj(heads.transpose(1, 2).reshape(2, 12, E))
    torch.testing.assert_close(gated, want, rtol=1e-10, atol=1e-10)


def test_a_fresh_gate_is_the_identity_and_an_original_checkpoint_loads():
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    gated = LinearMultiheadAttention(E, H, mode="taylor", batch_first=True, output_gate=True)
    plain = LinearMultiheadAttention(E, H, mode="taylor", batch_first=True)
    gated.load_state_dict(mha.state_dict(), strict=True)  # no gate keys in it: the gate keeps its zeros
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, 12, E)
    torch.testing.assert_close(gated(x, x, x)[0], plain(x, x, x)[0], rtol=0, atol=0)
    assert "output_gate=True" in repr(gated)
    assert set(gated.state_dict()) - set(plain.state_dict()) == {"gate_weight", "gate_bias"}


@pytest.mark.parametrize("mode", modes.LINEAR_CAUSAL)
def test_causal_outputs_do_not_see_the_future_through_the_gate(mode):
    m = gated_module(mode)
    x = torch.randn(1, 10, E, dtype=torch.float64)
    y = x.clone()
    y[:, 6:] = 100 * torch.randn(1, 4, E, dtype=torch.float64)
    a, _ = m(x, x, x, is_causal=True, attn_mask=nn.Transformer.generate_square_subsequent_mask(10).double())
    b, _ = m(y, y, y, is_causal=True, attn_mask=nn.Transformer.generate_square_subsequent_mask(10).double())
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["taylor", "kernel", "inline", "mala"])
def test_padding_garbage_reaches_no_output_and_no_gradient(mode):
    m = gated_module(mode)
    valid = torch.randn(1, 9, E, dtype=torch.float64)
    small, _ = m(valid, valid, valid)
    padded = torch.cat([valid, torch.full((1, 3, E), float("nan"), dtype=torch.float64)], 1).requires_grad_()
    kpm = torch.zeros(1, 12, dtype=torch.bool)
    kpm[:, 9:] = True
    out, _ = m(padded, padded, padded, key_padding_mask=kpm)
    torch.testing.assert_close(out[:, :9], small, rtol=1e-10, atol=1e-10)
    out[:, :9].sum().backward()
    assert torch.all(padded.grad[:, 9:] == 0) and torch.isfinite(padded.grad).all()
    assert torch.isfinite(m.gate_weight.grad).all() and m.gate_weight.grad.abs().sum() > 0


def test_gradcheck_through_the_gate():
    m = gated_module("taylor")
    x = torch.randn(1, 5, E, dtype=torch.float64, requires_grad=True)
    params = (m.gate_weight, m.gate_bias)
    assert torch.autograd.gradcheck(lambda x, *p: m(x, x, x)[0], (x, *params))


def test_bad_values_and_the_lm_stack_are_refused_by_name():
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="output_gate must be True or False"):
            LinearMultiheadAttention(E, H, mode="taylor", output_gate=bad)
    from linear_mha.lm import LinearAttentionTransformerLM
    lm = LinearAttentionTransformerLM(num_tokens=16, dim=16, depth=1, max_seq_len=8, heads=2, n_local_attn_heads=1)
    with pytest.raises(ValueError, match="output_gate is not available for the LM stack"):
        patch(lm, "taylor", output_gate=True)


def test_timm_vit_patched_with_a_gate_starts_unchanged_and_the_gate_trains():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=3).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=3).double()
    reference.load_state_dict(vit.state_dict())
    patch(vit, "taylor", output_gate=True)
    patch(reference.eval(), "taylor")
    torch.testing.assert_close(vit(x), reference(x), rtol=0, atol=0)
    vit(x).sum().backward()
    attn = vit.blocks[0].attn
    assert attn.gate_weight.grad.abs().sum() > 0 and "output_gate=True" in repr(attn)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_hugging_face_models_take_the_gate_causal_ones_blind_to_the_future(family):
    pytest.importorskip("transformers")
    import hf_models
    model, reference = hf_models.build(family), hf_models.build(family)
    patch(model, "taylor", output_gate=True)
    patch(reference, "taylor")
    ids = hf_models.inputs(family)
    torch.testing.assert_close(hf_models.output(model(**ids)), hf_models.output(reference(**ids)), rtol=0, atol=0)
    gates = [m for m in model.modules() if getattr(m, "gate_weight", None) is not None]
    assert gates
    with torch.no_grad():
        for g in gates:
            g.gate_weight.normal_(0, 0.5)
    changed = hf_models.output(model(**ids))
    assert (changed - hf_models.output(reference(**ids))).abs().max() > 1e-3
    if family == "gpt2":
        later = dict(ids, input_ids=ids["input_ids"].clone())
        later["input_ids"][:, 5:] = (later["input_ids"][:, 5:] + 7) % hf_models.VOCAB
        torch.testing.assert_close(hf_models.output(model(**later))[:, :5], changed[:, :5], rtol=1e-10, atol=1e-10)


def test_patched_and_patch_take_the_gate_as_a_module_option():
    with linear_mha.patched("taylor", output_gate=True):
        m = nn.MultiheadAttention(E, H, batch_first=True)
    assert m.gate_weight is not None
    with pytest.raises(ValueError, match="output_gate must be True or False"):
        patch(nn.Sequential(nn.MultiheadAttention(E, H)), "taylor", output_gate="yes")


@pytest.mark.parametrize("causal", [False, True])
def test_the_gate_without_autograd_gives_what_it_gives_with_it(causal):
    """Without gradients the gate is written over its own tensor; with them a Function of its own runs (both
    leave the plain formula, which graphs and torch.func transforms still see)."""
    m = gated_module("kernel")
    x = torch.randn(2, 12, E, dtype=torch.float64)
    with torch.no_grad():
        inference, _ = m(x, x, x, is_causal=causal)
    trained, _ = m(x, x, x, is_causal=causal)
    assert trained.grad_fn is not None
    torch.testing.assert_close(inference, trained, rtol=1e-12, atol=1e-12)


def test_the_gate_function_gives_each_input_its_gradient_alone():
    """_OutputGate's backward when only some inputs need a gradient (e.g. frozen gate parameters): each as the plain
    formula's autograd gives it, and None for the others."""
    from linear_mha.output_gate import _OutputGate
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64), torch.randn(2, 2, 5, 3, generator=g,
               dtype=torch.float64), torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
               torch.randn(2, 1, 4, generator=g, dtype=torch.float64)]
    grad = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64)
    for wanted in range(4):
        leaves = [t.clone().requires_grad_(i == wanted) for i, t in enumerate(tensors)]
        out, q, w, b = leaves
        got = torch.autograd.grad(_OutputGate.apply(out, q, w, b), leaves[wanted], grad)[0]
        want = torch.autograd.grad(out * 2 * torch.sigmoid(q @ w + b), leaves[wanted], grad)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


needs_native = pytest.mark.skipif(not native.available(), reason="the compiled CPU code is unavailable")


def module_like(b, h, n, width, g, scale=1.0):
    """(B, H, N, width) float32 heads laid out (B, N, H, width) in memory, as a module's projections give them."""
    return (torch.randn(b, n, h, width, generator=g) * scale).transpose(1, 2)


def relative_error(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.fixture
def threads(request):
    """torch's thread count for the test (the compiled code splits its work by it), restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("sizes", [(2, 3, 37, 7, 5), (3, 6, 20, 16, 32), (2, 5, 150, 20, 33), (3, 1, 60, 9, 3)],
                         ids=str)
@pytest.mark.parametrize("wanted", ["all", "out", "q", "weight", "bias"])
def test_the_compiled_gate_matches_float64_with_each_gradient(sizes, wanted, threads):
    """float32 CPU tensors take the compiled gate (csrc/output_gate.c), the gate made a block of rows at a time:
    output and every wanted gradient within float32 rounding of the float64 formula, the others None, at sizes
    that are no whole number of vectors or blocks, and with tasks that span heads and batch entries (d W and d b
    are summed per head: 4 tasks per thread over B H blocks of 48 positions)."""
    b, h, n, d, dv = sizes
    g = torch.Generator().manual_seed(sum(sizes))
    tensors = [module_like(b, h, n, dv, g), module_like(b, h, n, d, g), torch.randn(h, d, dv, generator=g) * 0.4,
               torch.randn(h, 1, dv, generator=g) * 0.5]
    grad = torch.randn(b, h, n, dv, generator=g)
    names = ["out", "q", "weight", "bias"]
    assert backend.output_gate_backend(*tensors).backend == backend.NATIVE
    leaves = [t.detach().requires_grad_(wanted in ("all", name)) for t, name in zip(tensors, names)]
    res = native_maps.output_gate(*leaves)
    assert "CompiledOutputGate" in type(res.grad_fn).__name__
    assert [st for st, n in zip(res.stride(), res.shape) if n > 1] == \
        [st for st, n in zip(tensors[0].stride(), res.shape) if n > 1]  # laid out as out: the head merge is a view
    res.backward(grad)
    ref_leaves = [t.detach().double().requires_grad_() for t in tensors]
    out, q, w, bias = ref_leaves
    ref = out * 2 * torch.sigmoid(q @ w + bias)
    ref.backward(grad.double())
    assert relative_error(res, ref) < 1e-6
    for leaf, ref_leaf, name in zip(leaves, ref_leaves, names):
        if wanted in ("all", name):
            assert relative_error(leaf.grad, ref_leaf.grad) < 2e-6, name
        else:
            assert leaf.grad is None, name
    with torch.no_grad():
        assert torch.equal(native_maps.output_gate(*tensors), res.detach())
        own = tensors[0].clone()
        assert native_maps.output_gate(own, *tensors[1:], inplace=True) is own and torch.equal(own, res.detach())


@needs_native
def test_the_compiled_gate_saturates_to_zero_and_two_and_keeps_a_nan_in_its_row():
    g = torch.Generator().manual_seed(1)
    out, q = module_like(1, 2, 50, 16, g), module_like(1, 2, 50, 8, g, scale=100.0)  # |z| up to hundreds
    w, bias = torch.randn(2, 8, 16, generator=g), torch.zeros(2, 1, 16)
    q[0, 1, 7, 3] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (out, q, w, bias)]
    res = native_maps.output_gate(*leaves)
    res.backward(torch.ones_like(res))
    z = q.double() @ w.double()
    gate = 2 * torch.sigmoid(z)
    nan_row = torch.zeros(1, 2, 50, 1, dtype=torch.bool)
    nan_row[0, 1, 7] = True
    assert torch.isnan(res.detach()).eq(nan_row.expand_as(res)).all()  # NaN stays in its row, and only there
    # z of this size carries float32 rounding of ~1e-5 of |z|: a looser tolerance than the test above
    want = (out.double() * gate).float().masked_fill(nan_row, 0)
    torch.testing.assert_close(res.detach().masked_fill(nan_row, 0), want, rtol=1e-4, atol=1e-4)
    assert (z.abs() > 90).double().mean() > 0.5  # most logits beyond float32 exp's range, and no inf or NaN came
    assert torch.isfinite(leaves[0].grad.masked_fill(nan_row, 0)).all()


@needs_native
@pytest.mark.parametrize("threads", [3], indirect=True)
def test_the_compiled_gate_parameter_gradients_are_the_same_run_after_run(threads):
    """d W and d b are summed per task, not per thread: the same bits on every call whichever thread ran what (12
    tasks over 40 blocks, so tasks span heads)."""
    g = torch.Generator().manual_seed(2)
    tensors = [module_like(2, 5, 150, 16, g), module_like(2, 5, 150, 16, g), torch.randn(5, 16, 16, generator=g),
               torch.randn(5, 1, 16, generator=g)]
    grad = torch.randn(2, 5, 150, 16, generator=g)
    runs = []
    for _ in range(5):
        leaves = [t.detach().requires_grad_() for t in tensors]
        native_maps.output_gate(*leaves).backward(grad)
        runs.append([leaf.grad for leaf in leaves])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


@needs_native
@pytest.mark.parametrize("causal", [False, True])
def test_a_float32_module_takes_the_compiled_gate_and_agrees_with_float64(causal, monkeypatch):
    calls = []
    compiled = native_maps.output_gate
    monkeypatch.setattr(native_maps, "output_gate", lambda *a, **kw: calls.append(kw) or compiled(*a, **kw))
    m64 = gated_module("kernel")
    m32 = gated_module("kernel").float()
    x = torch.randn(2, 40, E, dtype=torch.float64)
    outputs = []
    for m, x_ in ((m64, x.requires_grad_()), (m32, x.detach().float().requires_grad_())):
        out, _ = m(x_, x_, x_, is_causal=causal)
        out.sum().backward()
        outputs.append(out.detach())
    assert len(calls) == 1  # float64 took the composed Function, float32 the compiled one
    with torch.no_grad():  # written over the module's own heads
        inference, _ = m32(x.float(), x.float(), x.float(), is_causal=causal)
    assert calls[-1] == {"inplace": True}
    assert relative_error(inference, outputs[0]) < 1e-6 and relative_error(outputs[1], outputs[0]) < 1e-6
    assert relative_error(m32.gate_weight.grad, m64.gate_weight.grad) < 1e-5
    assert relative_error(m32.in_proj_weight.grad, m64.in_proj_weight.grad) < 1e-5


@pytest.mark.parametrize("path", [pytest.param("compiled", marks=needs_native), "composed"])
def test_the_gate_gradient_keeps_its_precision_as_the_gate_saturates(path):
    """d s / d z at z around 12, where 2 sigmoid(z) is 2 - 1e-5: computed as s - s^2 / 2 in float32 it cancelled
    (9e-3 off at z = 12, 0 from z = 17); from exp(-|z|) it keeps float32's precision."""
    from linear_mha.output_gate import _OutputGate
    g = torch.Generator().manual_seed(3)
    tensors = [module_like(1, 2, 60, 8, g), module_like(1, 2, 60, 8, g), torch.randn(2, 8, 8, generator=g) * 0.05,
               torch.full((2, 1, 8), 12.0)]
    grad = torch.randn(1, 2, 60, 8, generator=g)
    fn = native_maps.output_gate if path == "compiled" else _OutputGate.apply
    leaves = [t.detach().requires_grad_() for t in tensors]
    fn(*leaves).backward(grad)
    ref_leaves = [t.detach().double().requires_grad_() for t in tensors]
    out, q, w, bias = ref_leaves
    (out * 2 * torch.sigmoid(q @ w + bias)).backward(grad.double())
    for leaf, ref_leaf, name in zip(leaves[1:], ref_leaves[1:], ["q", "weight", "bias"]):
        assert relative_error(leaf.grad, ref_leaf.grad) < 1e-4, name


@needs_native
def test_the_chooser_takes_the_compiled_gate_only_for_its_shapes_and_never_writes_through_shared_rows():
    g = torch.Generator().manual_seed(4)
    out, q = module_like(2, 3, 20, 6, g), module_like(2, 3, 20, 5, g)
    w, bias = torch.randn(3, 5, 6, generator=g), torch.randn(3, 1, 6, generator=g)
    choose = backend.output_gate_backend
    assert choose(out, q, w, bias).backend == backend.NATIVE
    assert choose(out, q, w.transpose(1, 2).contiguous().transpose(1, 2), None).backend == backend.NATIVE
    assert "not (B, H, L, Dv)" in choose(out, q[:, :1], w, bias).reason  # broadcast heads: the formula's job
    assert "not (3, 5, 6)" in choose(out, q, w[:, :4], bias).reason
    assert "float64" in choose(out, q, w.double(), bias).reason
    assert "float64" in choose(out.double(), q.double(), w, bias).reason
    want = out.double() * 2 * torch.sigmoid(q.double() @ w.double())
    assert relative_error(native_maps.output_gate(out, q, w.transpose(1, 2).contiguous().transpose(1, 2), None),
                          want) < 1e-6
    shared = out[:1].expand(2, -1, -1, -1)  # both batch entries read the same rows: written over, they would be
    kept = shared.clone()                     # gated twice (and by two threads at once)
    res = native_maps.output_gate(shared, q, w, bias, inplace=True)
    assert res is not shared and torch.equal(shared, kept)
    assert relative_error(res, kept.double() * 2 * torch.sigmoid(q.double() @ w.double() + bias.double())) < 1e-6
