"""hedgehog's learned maps inside the compiled kernels (map 8, csrc/hedgehog.h): the queries' and keys' projections
and double softmaxes computed in the row loaders, forward and backward, causal and not, against float64; and when
``hedgehog`` takes that path and why not otherwise."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import backend, native
from linear_mha.functional.hedgehog import HedgehogMap

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def relative_error(got, ref):
    return ((got.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max().clamp_min(1e-30)).item()


def inputs(seed, b=2, h=3, n=41, d=37, dv=16, m=20, bias_k=False):
    """d = 37 and m = 20: the projections' and softmaxes' vector loops and their tails; masked keys hold NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
    k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, dv, generator=g)
    maps = [0.3 * torch.randn(h, d, m, generator=g), torch.randn(h, m, generator=g), 0.3 * torch.randn(h, d, m, generator=g),
            torch.randn(h, m, generator=g) if bias_k else None]
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[1, -6:] = True
    state = torch.rand(b, h, 2 * m, dv + 1, generator=g)
    return q, k, v, maps, mask, state, torch.randn(b, h, n, dv, generator=g)


@needs_native
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_k", [False, True])
@pytest.mark.parametrize("n,threads", [(41, 2), (130, 1), (130, 3)])
def test_outputs_and_every_gradient_match_float64(causal, bias_k, n, threads):
    """Through native.kernel_attention with a HedgehogMap, the compiled backward included: q, k, v, the initial
    state, both maps' W and b, causal and not, with masked keys (NaN in the compiled run). n = 130: the rows a
    thread holds back for d W fill their block of 48 (csrc ROWS) and are flushed when full, when the head changes
    and at the end; on one thread and on more than the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_against_float64(causal, bias_k, n)
    finally:
        torch.set_num_threads(previous)


def check_against_float64(causal, bias_k, n):
    q, k, v, maps, mask, state, grad = inputs(seed=1 + causal + 2 * bias_k, n=n, bias_k=bias_k)
    options = dict(causal=causal, key_padding_mask=mask)
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, state)]
        params = [None if t is None else t.detach().to(dtype).requires_grad_() for t in maps]
        q_map, k_map = (params[0], params[1]), (params[2], params[3])
        if dtype == torch.float32:
            with torch.no_grad():  # masked keys are never read: NaN there would reach the output or d W
                leaves[1][1, :, -6:], leaves[2][1, :, -6:] = float("nan"), float("nan")
            out = native.kernel_attention(*leaves[:3], HedgehogMap(q_map, k_map), options["key_padding_mask"],
                                          leaves[3], causal)
            assert type(out.grad_fn).__name__ == "_KernelAttentionBackward"
        else:
            out = LF.hedgehog(*leaves[:3], q_map, k_map, initial_state=leaves[3], **options)
        out.backward(grad.to(dtype))
        runs.append((out, [t.grad for t in leaves + [p for p in params if p is not None]]))
    (out, got), (ref, expected) = runs
    assert relative_error(out, ref) < 2e-6
    for i, (a, r) in enumerate(zip(got, expected)):
        assert relative_error(a, r) < 2e-5, i
    assert (got[1][1, :, -6:] == 0).all() and (got[2][1, :, -6:] == 0).all()


@needs_native
@pytest.mark.parametrize("causal", [False, True])
def test_hedgehog_takes_the_maps_inside_the_kernels_for_inference(causal):
    q, k, v, maps, mask, state, _ = inputs(seed=5)
    k[1, :, -6:], v[1, :, -6:] = float("nan"), float("nan")  # masked keys reach nothing
    q_map, k_map = (maps[0], maps[1]), (maps[2], maps[3])
    mask = None if causal else mask
    if causal:
        k, v = k.nan_to_num(), v.nan_to_num()
    with torch.no_grad():
        assert backend.hedgehog_backend(q, k, v, q_map, k_map, causal=causal).backend == backend.NATIVE
        out = LF.hedgehog(q, k, v, q_map, k_map, causal=causal, key_padding_mask=mask, initial_state=state)
    ref = LF.hedgehog(q.double(), k.double(), v.double(), tuple(t.double() for t in q_map), (k_map[0].double(), None),
                      causal=causal, key_padding_mask=mask, initial_state=state.double())
    assert relative_error(out, ref) < 2e-6


@needs_native
def test_gradients_take_the_compiled_backward_a_window_makes_the_features_first_and_the_chooser_says_why():
    q, k, v, maps, _, _, _ = inputs(seed=6, n=9)
    q_map, k_map = (maps[0].requires_grad_(), maps[1]), (maps[2], maps[3])
    for causal in (False, True):
        choice = backend.hedgehog_backend(q, k, v, q_map, k_map, causal=causal)
        assert choice.backend == backend.NATIVE and "backward" in choice.reason
    out = LF.hedgehog(q, k, v, q_map, k_map)
    assert type(out.grad_fn).__name__ == "_KernelAttentionBackward"
    with torch.no_grad():
        windowed = backend.hedgehog_backend(q, k, v, q_map, k_map, causal=False, window=True)
        assert windowed.backend != backend.NATIVE and "window" in windowed.reason
        wide = backend.hedgehog_backend(q, k, v, q_map, (maps[2], torch.zeros(1, 20)), causal=False)
        assert "bias of shape" in wide.reason


@needs_native
@pytest.mark.parametrize("d,m,why", [(native.HEDGEHOG_MAX_D + 1, 4, "inputs per row"),
                                     (4, native.HEDGEHOG_MAX_M + 1, "features per softmax")])
def test_maps_too_wide_for_the_kernels_stacks_take_the_composed_path_and_say_why(d, m, why):
    """The row loaders keep a group of rows' inputs and projections on the stack (csrc/hedgehog.h), sized by
    HEDGEHOG_MAX_D and HEDGEHOG_MAX_M: wider maps must not reach them. They still give the right answer."""
    q, k, v, maps, _, _, _ = inputs(seed=9, b=2, h=1, n=8, d=d, dv=3, m=m)
    q_map, k_map = (maps[0], maps[1]), (maps[2], None)
    choice = backend.hedgehog_backend(q, k, v, q_map, k_map, causal=False)
    assert choice.backend != backend.NATIVE and why in choice.reason
    with torch.no_grad():
        out = LF.hedgehog(q, k, v, q_map, k_map)
    ref = LF.hedgehog(q.double(), k.double(), v.double(), tuple(t.double() for t in q_map), (k_map[0].double(), None))
    assert relative_error(out, ref) < 1e-5


@needs_native
@pytest.mark.parametrize("causal", [False, True])
def test_parameter_gradients_are_the_same_run_after_run(causal):
    """hedgehog's d W, d b and focused's d scale are summed per thread in the compiled backward; the threads take
    their rows in a fixed order, so training runs repeat bit for bit (calibrate's reproducibility rests on it).
    With a thread taking whichever head (or part of one) was free, the split of the rows between the threads' sums,
    and so the rounding, changed from call to call."""
    q, k, v, maps, _, _, grad = inputs(seed=7, n=700, d=16, m=16)
    scale = torch.rand(3, 1, 16) + 0.5
    runs = []
    for _ in range(6):
        params = [t.detach().clone().requires_grad_() for t in (maps[0], maps[1], maps[2], scale)]
        out = LF.hedgehog(q, k, v, (params[0], params[1]), (params[2], None), causal=causal)
        focused = LF.focused(q, k, v, scale=params[3], causal=causal)
        torch.autograd.backward([out, focused], [grad, grad])
        runs.append([p.grad for p in params])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


@needs_native
def test_the_maps_settings_are_float32_whatever_the_default_dtype():
    """HedgehogMap packs d, m and a missing bias with factory functions: under torch.set_default_dtype(float64)
    they came out float64, the packed settings with them, and the kernels read float64 bytes as float32 (NaN)."""
    q, k, v, maps, _, _, _ = inputs(seed=8)
    q_map, k_map = (maps[0], None), (maps[2], None)
    ref = LF.hedgehog(q.double(), k.double(), v.double(), (q_map[0].double(), None), (k_map[0].double(), None))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            assert backend.hedgehog_backend(q, k, v, q_map, k_map, causal=False).backend == backend.NATIVE
            out = LF.hedgehog(q, k, v, q_map, k_map)
    finally:
        torch.set_default_dtype(previous)
    assert relative_error(out, ref) < 2e-6
