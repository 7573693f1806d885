"""The causal Triton kernels (linear_mha/functional/triton_causal.py), run on CPU tensors by Triton's interpreter:
the product, its final state and every gradient (the initial state's and through the final state's included)
against float64, no position seeing a later key, key padding exact through causal kernel attention, half inputs
accumulated in float32 with a normaliser that stays finite past float16's largest value, and the choosers sending
causal calls there only when the path is switched on."""
import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import backend, triton_causal
from linear_mha.functional.kernel.chunked import causal_linear_product
from triton_checks import inside, relative_error


@pytest.fixture
def switched_on():
    previous = triton_causal.set_enabled(True)
    yield
    triton_causal.set_enabled(previous)


def _features(b, h, n, f, dv, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:  # (B, H, N, F) views of (B, N, H, F) tensors, as a module's projections give them
        phi_q, phi_k = (torch.rand(b, n, h, f, generator=g).transpose(1, 2) for _ in "qk")
        v = torch.randn(b, n, h, dv, generator=g).transpose(1, 2)
    else:
        phi_q, phi_k, v = torch.rand(b, h, n, f, generator=g), torch.rand(b, h, n, f, generator=g), \
            torch.randn(b, h, n, dv, generator=g)
    return phi_q, phi_k, v, torch.randn(b, h, f, dv, generator=g), g


@inside
@pytest.mark.parametrize("shape", [(2, 3, 37, 8, 5), (1, 1, 16, 16, 16), (1, 2, 70, 80, 65), (1, 1, 1, 3, 2)],
                         ids=str)
@pytest.mark.parametrize("with_state", [False, True])
def test_the_product_its_final_state_and_every_gradient_match_float64(shape, with_state, switched_on):
    """Shapes: chunks that do not divide N, one position, features and values split over several programs (80 and
    65 are each two 64-wide parts), F != Dv."""
    phi_q, phi_k, v, s0, g = _features(*shape, seed=sum(shape), strided=shape[0] == 2)
    grad_out = torch.randn(*shape[:3], shape[4], generator=g)
    grad_state = torch.randn_like(s0)
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (phi_q, phi_k, v, s0)]
        state0 = leaves[3] if with_state else None
        if dtype == torch.float32:
            out, final = triton_causal.causal_product(*leaves[:3], state0, output_final_state=True)
            assert "CausalProduct" in type(out.grad_fn).__name__ and final.dtype == torch.float32
        else:  # the reference: the chunked product, and the state as the sum it is
            out = causal_linear_product(*leaves[:3], state0, chunk_size=8)
            final = (0 if state0 is None else state0) + leaves[1].transpose(-1, -2) @ leaves[2]
        ((out * grad_out.to(dtype)).sum() + (final * grad_state.to(dtype)).sum()).backward()
        runs.append([out, final] + [t.grad for t in leaves[:3]] + ([leaves[3].grad] if with_state else []))
    for name, got, want in zip(["out", "final state", "d phi_q", "d phi_k", "d v", "d initial state"], *runs):
        assert relative_error(got, want) < 2e-6, name


@inside
def test_no_position_sees_a_later_key(switched_on):
    phi_q, phi_k, v, _, _ = _features(1, 2, 50, 8, 4, seed=1)
    out = triton_causal.causal_product(phi_q, phi_k, v)
    later_k, later_v = phi_k.clone(), v.clone()
    later_k[:, :, 30:], later_v[:, :, 30:] = 7.0, -3.0
    again = triton_causal.causal_product(phi_q, later_k, later_v)
    assert torch.equal(again[:, :, :30], out[:, :, :30]) and not torch.equal(again[:, :, 30:], out[:, :, 30:])
    leaves = [t.clone().requires_grad_() for t in (phi_q, phi_k, v)]
    triton_causal.causal_product(*leaves)[:, :, 29].sum().backward()
    assert (leaves[1].grad[:, :, 30:] == 0).all() and (leaves[2].grad[:, :, 30:] == 0).all()
    assert (leaves[0].grad[:, :, 30:] == 0).all() and leaves[1].grad[:, :, :30].abs().sum() > 0


@inside
@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor"])
def test_causal_kernel_attention_through_the_chooser_with_key_padding(feature_map, switched_on):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 41, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 41, generator=g) < 0.3
    mask[1, :5] = True  # the first queries of batch element 1 see only padding: their output is 0
    assert backend.kernel_backend(q, k, v, feature_map, causal=True).backend == backend.TRITON
    grad = torch.randn(2, 3, 41, 8, generator=g)
    runs = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = LF.kernel(*leaves, feature_map, causal=True, key_padding_mask=mask)
        out.backward(grad.to(dtype))
        runs.append((out, [t.grad for t in leaves]))
    (out, got), (ref, want) = runs
    assert relative_error(out, ref) < 2e-6 and (out[1, :, :5] == 0).all()
    for name, a, r in zip("qkv", got, want):
        assert relative_error(a, r) < 1e-5, name
    gone = mask[:, None, :, None]
    assert (got[1].masked_select(gone) == 0).all() and (got[2].masked_select(gone) == 0).all()
    junk_k, junk_v = k.clone(), v.clone()
    junk_k.masked_fill_(gone, 1e4)
    junk_v.masked_fill_(gone, float("nan"))
    torch.testing.assert_close(LF.kernel(q, junk_k, junk_v, feature_map, causal=True, key_padding_mask=mask),
                               out.detach())


@inside
def test_an_initial_state_from_kernel_state_continues_a_sequence(switched_on):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    whole = LF.kernel(q, k, v, "elu", causal=True)
    state = LF.kernel_state(k[:, :, :25], v[:, :, :25], "elu")
    rest = LF.kernel(q[:, :, 25:], k[:, :, 25:], v[:, :, 25:], "elu", causal=True, initial_state=state)
    torch.testing.assert_close(rest, whole[:, :, 25:], rtol=1e-5, atol=1e-6)


@inside
def test_half_inputs_accumulate_in_float32_and_the_normaliser_passes_float16s_largest_value(switched_on):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 2100, 32, generator=g) for _ in range(3))
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in (q, k, v)]
        out = LF.kernel(*low, "elu", causal=True)
        ref = LF.kernel(*(t.double() for t in low), "elu", causal=True)
        assert out.dtype == dtype and torch.isfinite(out).all() and relative_error(out, ref) < 2e-2
    phi_q, phi_k = LF.apply_feature_map("elu", q.double(), k.double(), causal=True)
    assert float((phi_q[0, 0, -1] * phi_k[0, 0].sum(0)).sum()) > 65504  # the last normaliser: past float16's range


@inside
def test_the_choosers_take_the_kernels_only_when_switched_on():
    phi_q, phi_k, v, s0, _ = _features(1, 2, 20, 8, 5, seed=6)
    previous = triton_causal.set_enabled(False)
    try:
        assert "LINEAR_MHA_TRITON_CAUSAL=1" in backend.product_backend(phi_q, phi_k, v).reason
        assert backend.kernel_backend(phi_q, phi_k, v, "elu", causal=True).backend != backend.TRITON
        triton_causal.set_enabled(True)
        assert backend.product_backend(phi_q, phi_k, v, s0).backend == backend.TRITON
        assert backend.kernel_backend(phi_q, phi_k, v, "elu", causal=True).backend == backend.TRITON
        assert "dtypes" in triton_causal.why_not(phi_q, phi_k, v.double())
        assert backend.product_backend(phi_q.double(), phi_k.double(), v.double()).backend != backend.TRITON
    finally:
        triton_causal.set_enabled(previous)


@inside
def test_the_gpu_benchmark_checks_exactness_and_writes_its_table(tmp_path):
    """tools.triton_causal_bench at a tiny size on CPU (the interpreter): our path taken and within float32 rounding
    for every map, float16 finite, a timing row per chunk size and for the PyTorch path, fla's absence said; the
    decayed product's kernel and PyTorch path both exact and timed."""
    import json

    from linear_mha.tools import triton_causal_bench
    triton_causal_bench.main(["--device", "cpu", "--dtypes", "float32", "--n", "40", "--batch", "1", "--heads", "2",
                              "--dim", "16", "--chunks", "16", "--repeats", "1", "--exact-shape", "1", "2", "37", "16",
                              "--long-n", "300", "--json", str(tmp_path / "r.json")])
    record = json.loads((tmp_path / "r.json").read_text())
    ours = [row for row in record["exactness"] if row["path"] == "ours"]
    assert len(ours) == len(triton_causal_bench.MAPS) and all(row["taken"] for row in ours)
    assert all(max(row[key] for key in ("out", "dq", "dk", "dv")) < 1e-5 for row in ours)
    assert record["float16_finite_at_long_n"] == {"N": 300, "finite": True}
    timed = {row["variant"]: row for row in record["timings"]}
    assert timed["ours, 16-row chunks"]["fwd_ms"] > 0 and timed["pytorch path"]["fwdbwd_ms"] > 0
    assert "fla" in timed and "error" in timed["fla"]  # CPU tensors: fla's kernels run on CUDA only
    decayed = [row for row in record["decayed"] if row["kind"] == "exactness"]
    assert [row["path"] for row in decayed] == ["ours", "pytorch"] and all(row["taken"] for row in decayed)
    assert all(max(row[key] for key in ("out", "dq", "dk", "dv", "dg")) < 1e-5 for row in decayed)
    assert {row["path"] for row in record["decayed"] if row.get("fwdbwd_ms", 0) > 0} == {"ours", "pytorch"}
