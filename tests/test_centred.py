"""inline and mala (functional.centred_kernel) against a per-query loop written from their definitions: the keys a
query sees (extra keys first, then its causal prefix, minus padding), the weights of each form over exactly those."""
import math

import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import centred, native


def loop_reference(q, k, v, phi, form, key_padding_mask=None, causal=False, extra_keys=None):
    B, H, L, _ = q.shape
    out = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                keys = [j for j in range(k.shape[2]) if (not causal or j <= i)
                        and (key_padding_mask is None or not key_padding_mask[b, j])]
                ks, vs = k[b, h, keys], v[b, h, keys]
                if extra_keys is not None:
                    ks, vs = torch.cat([extra_keys[0][b, h], ks]), torch.cat([extra_keys[1][b, h], vs])
                if len(ks) == 0:
                    continue
                s = phi(q[b, h, i]) @ phi(ks).T  # (n,)
                n = len(ks)
                if form == "magnitude":  # MALA divides its similarities by N sqrt(d)
                    s = s / (n * math.sqrt(q.shape[-1]))
                    total = s.sum()
                    w = (1 + 1 / total) * s - total / n
                else:
                    total = s.sum()
                    w = 1 / n + (s - total / n) / n
                out[b, h, i] = w @ vs
    return out


def identity(x):
    return x * x.shape[-1] ** -0.25


def elu(x):
    return torch.nn.functional.elu(x) + 1


@pytest.mark.parametrize("form, feature_map, phi", [("inline", "identity", identity), ("magnitude", "elu", elu),
                                                    ("inline", "taylor", LF.taylor_feature_map)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("extras", [False, True])
def test_matches_the_definition_with_padding_causality_and_extra_keys(form, feature_map, phi, causal, extras):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=torch.float64) * 2 for _ in range(3))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, [0, 3]] = True     # the first key masked: causal query 0 of batch 0 sees no key but the extra ones
    mask[1, 4:] = True
    extra = (torch.randn(2, 2, 2, 4, dtype=torch.float64), torch.randn(2, 2, 2, 4, dtype=torch.float64)) if extras \
        else None
    got = LF.centred_kernel(q, k, v, feature_map, form=form, causal=causal, key_padding_mask=mask, extra_keys=extra)
    want = loop_reference(q, k, v, phi, form, mask, causal, extra)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if not extras and causal:
        assert got[0, :, 0].abs().max() == 0  # sees no key: zero, not NaN


def test_inline_with_the_identity_map_is_softmax_to_first_order():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    errors = []
    for eps in (1e-2, 1e-3):  # logits of size eps: the gap to softmax shrinks as eps^2
        got = LF.centred_kernel(q * eps ** 0.5, k * eps ** 0.5, v, "identity", form="inline")
        want = torch.softmax(q @ k.transpose(-1, -2) * eps / math.sqrt(8), -1) @ v
        errors.append((got - want).abs().max().item())
    assert errors[1] < errors[0] / 50


def test_weights_keep_the_query_magnitude_that_division_discards():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 1, 8, 4, dtype=torch.float64) for _ in range(3))
    for form, fmap in (("inline", "identity"), ("magnitude", "relu")):
        a = LF.centred_kernel(q, k, v, fmap, form=form)
        b = LF.centred_kernel(3 * q, k, v, fmap, form=form)
        assert (a - b).abs().max() > 1e-3, form
    divided = LF.kernel(q, k, v, "relu"), LF.kernel(3 * q, k, v, "relu")
    torch.testing.assert_close(*divided)  # what the divided kernel does


@pytest.mark.parametrize("call, message", [
    (lambda q: LF.centred_kernel(q, q, q, form="softmax"), "form must be one of"),
    (lambda q: LF.centred_kernel(q, q, q, "identity", form="magnitude"), "non-negative feature_map"),
    (lambda q: LF.centred_kernel(q, q, q, "favor"), "elementwise feature map"),
    (lambda q: LF.centred_kernel(q, q[:, :, :3], q[:, :, :3], causal=True), "as many queries as keys"),
])
def test_bad_arguments_say_what_to_do(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 1, 4, 4))


def test_mala_refuses_a_signed_map_by_name():
    import linear_mha
    with pytest.raises(ValueError, match="feature_map must be a non-negative"):
        linear_mha.LinearMultiheadAttention(8, 2, mode="mala", feature_map="identity")


@pytest.mark.parametrize("form, feature_map, phi", [("inline", "identity", identity), ("magnitude", "elu", elu)])
def test_causal_chunks_carry_the_sums_across_chunk_boundaries(form, feature_map, phi):
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 1, 37, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(1, 37, dtype=torch.bool)
    mask[:, [3, 17, 30]] = True
    got = LF.centred_kernel(q, k, v, feature_map, form=form, causal=True, key_padding_mask=mask, chunk_size=8)
    torch.testing.assert_close(got, loop_reference(q, k, v, phi, form, mask, True), rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")
@pytest.mark.parametrize("form", ["magnitude", "inline"])
@pytest.mark.parametrize("feature_map", ["elu", "taylor2"])
def test_the_grid_branch_on_the_compiled_rope_kernel_matches_float64(form, feature_map, monkeypatch):
    """With a map whose similarities are all positive, float32 CPU calls take A_i = S_i (A_i / S_i) from the
    compiled rope kernel: outputs and gradients equal the float64 rotated product, padded keys (NaN) reach nothing."""
    calls = []
    compiled = centred.grid_rope_kernel
    monkeypatch.setattr(centred, "grid_rope_kernel", lambda *a, **kw: calls.append(a[0].dtype) or compiled(*a, **kw))
    g = torch.Generator().manual_seed(5)
    height, width, prefix = 4, 5, 1
    n = prefix + height * width
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, n, generator=g) < 0.3
    k[mask[:, None, :, None].expand_as(k)] = float("nan")
    v[mask[:, None, :, None].expand_as(v)] = float("nan")
    grad_out = torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64)
    results = []
    for dtype in (torch.float64, torch.float32):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = LF.centred_kernel(*leaves, feature_map, form=form, key_padding_mask=mask, grid=(height, width, prefix))
        (out * grad_out.to(dtype)).sum().backward()
        results.append([out] + [t.grad for t in leaves])
    assert calls == [torch.float32]  # the float64 call ran the PyTorch rotation, the float32 one the compiled kernel
    for name, ref, got in zip(["out", "q", "k", "v"], *results):
        if name in ("k", "v"):
            assert torch.all(got.transpose(1, 2)[mask] == 0), name
            ref, got = (t.transpose(1, 2).masked_fill(mask[..., None, None], 0) for t in (ref, got))
        torch.testing.assert_close(got.double(), ref, rtol=5e-4, atol=5e-5, msg=name)
