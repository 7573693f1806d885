"""Every registered method, under inputs drawn at random (hypothesis): causal or not, key padding as bool, as float
0/-inf or with a batch element whose keys are all masked, float64/float32/bfloat16/float16, odd shapes (L != S,
N = 1, head dim 1, non-contiguous inputs). For each draw either

* the call is refused with a ValueError or TypeError (the library's clear errors; a raw RuntimeError, IndexError or
  NaN is the bug this finds), the same way in every dtype, or
* it succeeds, and then: the output is finite, in float64 it equals the method's own naive reference
  (``reference_weights``, explicit L x S weights), masked keys change nothing (values and gradients) however large
  they are, and lower precisions agree with float64 within their rounding.

A fixed example budget keeps the default run short; the `slow` run draws many more."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import modes
from linear_mha import LinearMultiheadAttention, method_class

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# Worst error against float64 in units of the output's scale: bfloat16 keeps 8 bits of mantissa, float16 11.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
MASKS = ["none", "bool", "float", "all masked"]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(modes.ALL_VARIANTS)))
    options = dict(modes.ALL_VARIANTS[name])
    cls = method_class(options["mode"])
    L = draw(st.integers(1, 9))
    S = L if draw(st.booleans()) else draw(st.integers(1, 9))  # L != S often: refused where unsupported
    causal = cls.causal and (not cls.bidirectional or draw(st.booleans()))  # causal-only methods: always
    return dict(name=name, options=options, causal=causal, L=L, S=S,
                batch=draw(st.integers(1, 3)), heads=draw(st.integers(1, 2)), head_dim=draw(st.integers(1, 4)),
                mask=draw(st.sampled_from(MASKS)), dtype=draw(st.sampled_from(DTYPES[1:])),
                contiguous=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


def build(c):
    torch.manual_seed(c["seed"])
    options = modes.sized_variant(c["options"], max(c["L"], c["S"]), proj_k=3)
    m = LinearMultiheadAttention(c["heads"] * c["head_dim"], c["heads"], **options).double()
    with torch.no_grad():  # learnable maps and scales as after training, not the identity or zero they start as
        for key in m.method.state_names:
            tensor = getattr(m, key)
            if isinstance(tensor, torch.nn.Parameter):
                tensor.normal_(generator=torch.Generator().manual_seed(len(key)))
    return m.eval()


def inputs(c, E, g):
    def sequence(length):
        x = torch.randn(c["batch"], length, E, generator=g, dtype=torch.float64)
        return x.transpose(0, 1) if not c["contiguous"] else x.transpose(0, 1).contiguous()  # (length, N, E)
    q, k, v = sequence(c["L"]), sequence(c["S"]), sequence(c["S"])
    kpm = None
    if c["mask"] != "none":
        kpm = torch.zeros(c["batch"], c["S"], dtype=torch.bool)
        for b in range(c["batch"]):
            kpm[b, int(torch.randint(1, c["S"] + 1, (1,), generator=g)):] = True  # the last keys are padding
        if c["mask"] == "all masked":
            kpm[0] = True
        if c["mask"] == "float":
            kpm = torch.zeros(kpm.shape, dtype=torch.float64).masked_fill(kpm, float("-inf"))
    return q, k, v, kpm


def masked(kpm):
    return None if kpm is None else (kpm if kpm.dtype == torch.bool else torch.isinf(kpm))


def project(m, x, which):
    E = m.embed_dim
    y = F.linear(x, m.in_proj_weight[which * E:(which + 1) * E], m.in_proj_bias[which * E:(which + 1) * E])
    return y.reshape(y.shape[0], y.shape[1], m.num_heads, m.head_dim).permute(1, 2, 0, 3)  # (N, H, length, d)


def check(c):
    m = build(c)
    g = torch.Generator().manual_seed(c["seed"])
    q, k, v, kpm = inputs(c, m.embed_dim, g)
    grid = modes.grid_for(m, c["S"])
    kwargs = dict(key_padding_mask=kpm, is_causal=c["causal"], token_grid=grid, need_weights=False)
    try:
        out, _ = m(q, k, v, **kwargs)
    except (ValueError, TypeError) as exc:  # refused: clearly, and the same in the other dtype
        assert str(exc)
        low = copy.deepcopy(m).to(c["dtype"])
        cast = {**kwargs, "key_padding_mask": None if kpm is None else kpm.to(c["dtype"]) if kpm.is_floating_point()
                else kpm}
        with pytest.raises(type(exc)):
            low(q.to(c["dtype"]), k.to(c["dtype"]), v.to(c["dtype"]), **cast)
        return f"refused: {type(exc).__name__}"
    assert torch.isfinite(out).all(), "non-finite output"

    # the method's own float64 reference: explicit weights over the keys each query may see
    pk, pv = project(m, k, 1), project(m, v, 2)
    weights = m.method.reference_weights(project(m, q, 0), pk, m.method.state(m), key_padding_mask=masked(kpm),
                                         causal=c["causal"], token_grid=grid)
    expected = m.out_proj((weights @ pv).permute(2, 0, 1, 3).reshape(c["L"], c["batch"], m.embed_dim))
    # methods whose keys are the queries' own positions (a window, a token grid) read the mask as padding of the
    # queries too: those rows are padding's own output, which nothing defines
    rows = torch.ones(c["L"], c["batch"], dtype=torch.bool)
    if kpm is not None and (m.method.self_attention_only or m.method.needs_grid):
        rows = ~masked(kpm).T
    torch.testing.assert_close(out[rows], expected[rows], rtol=1e-9, atol=1e-9)

    # masked keys reach nothing, whatever they hold: not the output, not the gradients
    if kpm is not None:
        gone = masked(kpm).T[:, :, None]  # (S, N, 1)
        junk_k = k.masked_fill(gone, 0) + gone * 1e4 * torch.randn(k.shape, generator=g, dtype=torch.float64)
        junk_v = v.masked_fill(gone, 0) + gone * 1e4 * torch.randn(v.shape, generator=g, dtype=torch.float64)
        junk_k.requires_grad_(True)
        junk_v.requires_grad_(True)
        out2, _ = m(q, junk_k, junk_v, **kwargs)
        torch.testing.assert_close(out2, out, rtol=1e-9, atol=1e-9)
        out2.square().sum().backward()
        for grad in (junk_k.grad, junk_v.grad):
            assert (grad.masked_select(gone) == 0).all(), "a masked key received gradient"

    # lower precisions: finite and within rounding of float64 run on the same (rounded) weights and inputs. Against
    # the unrounded float64 run the difference would also hold the inputs' rounding, which some maps amplify (focused:
    # a feature near relu's kink), and measure the method's conditioning rather than its low-precision arithmetic.
    low = copy.deepcopy(m).to(c["dtype"])
    cast = {**kwargs, "key_padding_mask": None if kpm is None else kpm.to(c["dtype"]) if kpm.is_floating_point()
            else kpm}
    q, k, v = (t.to(c["dtype"]) for t in (q, k, v))
    got, _ = low(q, k, v, **cast)
    assert got.dtype == c["dtype"] and torch.isfinite(got).all(), "non-finite output in low precision"
    with torch.no_grad():
        out, _ = copy.deepcopy(low).double()(q.double(), k.double(), v.double(), **kwargs)
    scale = max(1.0, float(out.abs().max()))
    error = float((got.detach().double() - out).abs().max()) / scale
    assert error <= TOLERANCE[c["dtype"]], f"{c['dtype']} is {error:.2e} from float64 (scale {scale:.2f})"
    return "ran"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases())
def test_every_method_gives_a_right_answer_or_a_clear_error(c):
    event(check(c))  # --hypothesis-show-statistics: how many draws ran and how many were refused


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases())
def test_every_method_gives_a_right_answer_or_a_clear_error_large_sweep(c):
    event(check(c))
