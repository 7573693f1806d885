"""The registry's methods through the fused Triton kernels, as modules run them, on CPU tensors under Triton's
interpreter (run by test_triton_kernels.py's test_the_kernels_under_the_interpreter): which methods the registry says
the kernels run (``triton_map``) against what the choosers do, then each of those against float64, with their maps'
parameters, rotary position, an initial state, junk in masked keys and forward-mode tangents."""
import pytest
import torch

import linear_mha
import linear_mha.functional as LF
import modes
from linear_mha import TokenGrid
from linear_mha.functional import triton_kernel
from linear_mha.functional.hedgehog import hedgehog_state
from linear_mha.tools.triton_bench import ran_in_the_kernels
from triton_checks import compare, inputs, inside, learned_maps, relative_error


# The registry's rows whose method runs in the kernels (its triton_map, which the next test holds to what the
# choosers do); those that attend any sequence (rotary position needs a grid, key reweighting self-attention); the
# first of those for each map of the kernels; and each row with a rope option run with it on, where the kernels
# still take it.
TRITON = {name: options for name, options in modes.ALL_VARIANTS.items() if modes.method_of(options).triton_map}
SEQUENCE = [name for name, options in TRITON.items() if not modes.method_of(options).self_attention_only]


def _first_per_map(names):
    found = {}
    for name in names:
        found.setdefault(modes.method_of(TRITON[name]).triton_map, name)
    return list(found.values())


def _with_rope(rows):
    found = {}
    for name, options in rows.items():
        roped = {**options, "rope": True}
        if "rope" in linear_mha.method_class(options["mode"]).options and modes.method_of(roped).triton_map \
                and roped not in found.values():
            found[name if options.get("rope") else f"{name}+rope"] = roped
    return found


ONE_PER_MAP = _first_per_map(SEQUENCE)
ROPE = _with_rope(TRITON)


def method_call(options, h, d, seed, **call):
    """(fn(q, k, v, *learnable) -> out, learnable): a registry row's method as modules run it (``attend_heads``;
    ``call``: masks, grid) and its learnable tensors by name (focused's scale, hedgehog's maps), moved off their
    start so that their gradients say something; fn takes them, in any dtype, after q, k, v."""
    method = modes.method_of(options)
    state, names = modes.drawn_state(method, h, d, seed=seed, noise=0.3)

    def fn(q, k, v, *tensors):
        return modes.attend_with(method, {**state, **dict(zip(names, tensors))}, q, k, v, **call)
    return fn, {key: state[key] for key in names}


@inside
def test_the_registry_names_the_methods_the_kernels_run():
    """triton_map, which these tests and tools/triton_bench read, says what the choosers do: every row of the
    registry that names a map runs in the kernels, no other row does, and every map of the kernels has a row."""
    assert {modes.method_of(options).triton_map for options in TRITON.values()} == set(triton_kernel.MAPS)
    q, k, v, _ = inputs(s=37, seed=21)  # self-attention, for the rows that need it
    grid = TokenGrid(1, 36, 1)
    with triton_kernel.switched(True, all_maps=True):
        for name, options in modes.ALL_VARIANTS.items():
            method = modes.method_of(modes.sized_variant(options, 37))
            out = modes.attend_with(method, modes.drawn_state(method, 3, 8)[0], q.requires_grad_(), k, v,
                                    token_grid=grid, **modes.causal_if_required(method))
            assert ran_in_the_kernels(out) == bool(method.triton_map), name


@inside
@pytest.mark.parametrize("name", SEQUENCE)
@pytest.mark.parametrize("shape", [(2, 3, 37, 45, 8, 5), (1, 1, 3, 70, 20, 33)], ids=str)
def test_every_method_the_kernels_run_matches_float64(name, shape):
    """Each row of the registry whose method runs in the kernels, as modules run it, the maps' parameters computed
    inside the kernels (focused's power and scale, hedgehog's learned projections and softmaxes): outputs, q / k / v
    gradients and the parameters' gradients (summed over programs and the batch) against float64; masked keys get
    no gradient."""
    q, k, v, g = inputs(*shape, seed=sum(shape) + len(name))
    b, h, l, s, d, dv = shape
    mask = torch.rand(b, s, generator=g) < 0.3
    grad = torch.randn(b, h, l, dv, generator=g)
    fn, params = method_call(TRITON[name], h, d, seed=b + s, key_padding_mask=mask)
    got = compare(fn, [q, k, v, *params.values()], grad)
    gone = mask[:, None, :, None]
    assert (got[1].masked_select(gone) == 0).all() and (got[2].masked_select(gone) == 0).all()


@inside
@pytest.mark.parametrize("d", [7, 13, 16])
@pytest.mark.parametrize("name", ROPE)
def test_rotary_position_matches_float64(name, d):
    """Rotary position through the kernels: the last 4 floor(F / 4) features turned in the numerator only, the
    normaliser plain; d = 13 leaves a feature or two as they are and reads the partner features by a second load;
    d = 16 turns every column of its 16-wide tiles, which swap their halves in registers instead (a swap that
    misplaces a column fails here); a prefix token at no position; masked keys. Where
    every feature turns, taylor's constant one too (d = 7, F = 8), the kernels, which keep that feature out of their
    tiles, refuse the call by name and PyTorch ops run it."""
    g = torch.Generator().manual_seed(d)
    n, b, h, dv = 19, 2, 3, 5
    q, k, v = (torch.randn(b, n, h, w, generator=g).transpose(1, 2) for w in (d, d, dv))
    mask = torch.rand(b, n, generator=g) < 0.3
    grad = torch.randn(b, h, n, dv, generator=g)
    fn, params = method_call(ROPE[name], h, d, seed=d, key_padding_mask=mask, token_grid=TokenGrid(3, 6, 1))
    why_not = triton_kernel.why_not(q, k, v, modes.method_of(ROPE[name]).kernel_map({}), rope=True)
    if why_not is not None:
        assert "constant" in why_not
        out, ref = (fn(*(t.to(dtype) for t in [q, k, v, *params.values()])) for dtype in (torch.float32, torch.float64))
        assert not ran_in_the_kernels(out) and relative_error(out, ref) < 2e-6
        return
    got = compare(fn, [q, k, v, *params.values()], grad)
    assert (got[1].masked_select(mask[:, None, :, None]) == 0).all()


def _check_initial_state(attend, key_state):
    """attend(q, k, v, initial_state) against float64, its gradient too, with the key_state(k, v) of extra keys; a
    state of the wrong shape is refused."""
    q, k, v, g = inputs(seed=11)
    extra_k, extra_v = torch.randn(2, 3, 9, 8, generator=g), torch.randn(2, 3, 9, 5, generator=g)
    state = key_state(extra_k, extra_v)
    compare(attend, [q, k, v, state], torch.randn(2, 3, 37, 5, generator=g))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        attend(q, k, v, state[:, :, 1:])


@inside
@pytest.mark.parametrize("name", [name for name in ONE_PER_MAP
                                  if triton_kernel.map_name(modes.method_of(TRITON[name]).kernel_map({}))])
def test_an_initial_state_is_added_to_the_keys_sums(name):
    """initial_state (the method's key_state: kernel_state's layout, taylor's constant feature first) enters the
    sums every query sees, for each map functional.kernel hands the kernels."""
    method = modes.method_of(TRITON[name])
    state = modes.drawn_state(method, 3, 8, seed=12, noise=0.3)[0]

    def attend(q, k, v, initial_state):
        return LF.kernel(q, k, v, method.kernel_map({key: t.to(q) for key, t in state.items()}),
                         initial_state=initial_state)
    _check_initial_state(attend, lambda k, v: method.key_state(k, v, {key: t.to(k) for key, t in state.items()}))


@inside
def test_an_initial_state_is_added_to_hedgehogs_sums():
    """hedgehog_state's layout, softmax(z) features before softmax(-z), through LF.hedgehog."""
    maps = learned_maps(3, 8, 8, True, seed=12)
    _check_initial_state(lambda q, k, v, st: LF.hedgehog(q, k, v, tuple(t.to(q) for t in maps[:2]),
                                                         tuple(t.to(q) for t in maps[2:]), initial_state=st),
                         lambda k, v: hedgehog_state(k, v, tuple(maps[2:])))


@inside
def test_junk_in_masked_keys_reaches_nothing_with_every_map():
    q, k, v, g = inputs(seed=13)
    q = q.detach().requires_grad_()  # so that the output says which Function made it
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[0, 30:] = True
    mask[1] = True
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[0, :, 30:], junk_v[0, :, 30:] = 1e4, float("nan")
    junk_k[1], junk_v[1] = 1e4, float("nan")
    for name in ONE_PER_MAP:
        fn, params = method_call(TRITON[name], 3, 8, seed=14, key_padding_mask=mask)
        clean, dirty = fn(q, k, v, *params.values()), fn(q, junk_k, junk_v, *params.values())
        assert ran_in_the_kernels(clean), name
        torch.testing.assert_close(dirty, clean, msg=name)
        assert (clean[1] == 0).all(), name


@inside
@pytest.mark.parametrize("name", ONE_PER_MAP)
def test_nan_and_inf_in_masked_keys_reach_no_gradient(name):
    """The backward reloads the keys: masked rows holding NaN or inf must be zeroed there too (hedgehog's d W_k is
    x^T d z, taylor's unit vector inf / inf), as the forward and the reference do."""
    q, k, v, g = inputs(seed=19)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[0, 30:], mask[1, :5] = True, True
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[0, :, 30:35], dirty_k[0, :, 35:], dirty_v[0, :, 30:] = float("nan"), float("inf"), float("nan")
    dirty_k[1, :, :5] = -float("inf")
    grad = torch.randn(2, 3, 37, 5, generator=g)
    fn, params = method_call(TRITON[name], 3, 8, seed=20, key_padding_mask=mask)

    def run(k, v):
        leaves = [t.detach().to(torch.float32).requires_grad_() for t in (q, k, v, *params.values())]
        out = fn(*leaves)
        assert ran_in_the_kernels(out)
        out.backward(grad)
        return [t.grad for t in leaves]

    clean, dirty = run(k, v), run(dirty_k, dirty_v)
    for a, b in zip(clean, dirty):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a)


def _tangent_cases():
    """For each map, a tangent on the first learnable tensor of its row (on q where it has none); on k with rotary
    position."""
    cases = []
    for name in ONE_PER_MAP:
        learnable = modes.drawn_state(modes.method_of(TRITON[name]), 3, 8)[1]
        cases.append((name, learnable[0] if learnable else "q"))
    return cases + [(next(iter(ROPE)), "k")]


@inside
@pytest.mark.parametrize("name,primal", _tangent_cases())
def test_forward_mode_tangents_leave_the_kernels_and_are_carried(name, primal):
    """The kernels' Function has no forward-mode formula: a call whose inputs, or whose map's own tensors, carry
    tangents (torch.autograd.forward_ad) must take PyTorch ops, with the chooser saying so, rather than raise."""
    import torch.autograd.forward_ad as fwAD
    options = {**TRITON, **ROPE}[name]
    q, k, v, g = inputs(b=1, h=3, l=12, s=12, d=8, dv=8, seed=19)
    grid = {"token_grid": TokenGrid(3, 4)} if modes.method_of(options).needs_grid else {}
    fn, params = method_call(options, 3, 8, seed=20, **grid)
    tensors = {"q": q, "k": k, "v": v, **params}
    tangent = torch.randn(tensors[primal].shape, generator=g, dtype=tensors[primal].dtype)

    def attend(x, dtype=torch.float32):
        return fn(*(x if key == primal else t.to(dtype) for key, t in tensors.items()))

    eps = 1e-6
    ahead, behind = (tensors[primal].double() + sign * eps * tangent.double() for sign in (1, -1))
    want = (attend(ahead, torch.float64) - attend(behind, torch.float64)) / (2 * eps)
    with triton_kernel.switched(True):
        assert ran_in_the_kernels(attend(tensors[primal].clone().requires_grad_()))  # they run without one
        with fwAD.dual_level():
            got = fwAD.unpack_dual(attend(fwAD.make_dual(tensors[primal], tangent))).tangent
    assert got is not None
    assert relative_error(got, want) < 1e-4
