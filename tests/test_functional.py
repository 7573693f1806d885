"""Every attention function against an independent float64 reference (explicit L x S weights)."""
import pytest
import torch

import linear_mha.functional as LF
from reference import (efficient_weights, elu1, focused_features, kernel_weights, linformer_weights, softmax_weights,
                       taylor2_weights, taylor_weights)

B, H, L, S, D = 2, 3, 5, 7, 4


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (L, S, S))
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 4:] = True
    return q, k, v, kpm


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("masked", [False, True])
def test_softmax_matches_reference_both_paths(qkv, masked):
    q, k, v, kpm = qkv
    kpm = kpm if masked else None
    w_ref = softmax_weights(q, k, kpm)
    out_w, w = LF.softmax(q, k, v, key_padding_mask=kpm, need_weights=True)
    out_fast, none = LF.softmax(q, k, v, key_padding_mask=kpm)
    assert none is None
    close(w, w_ref)
    close(out_w, w_ref @ v)
    close(out_fast, w_ref @ v)


def test_softmax_causal_and_bias(qkv):
    q, k, v, kpm = qkv
    q = q[:, :, :S] if L >= S else torch.cat([q, q], 2)[:, :, :S]
    w_ref = softmax_weights(q, k, kpm, causal=True)
    close(LF.softmax(q, k, v, key_padding_mask=kpm, causal=True)[0], w_ref @ v)
    bias = torch.randn(S, S, dtype=torch.float64)
    out, w = LF.softmax(q, k, v, attn_bias=bias, need_weights=True)
    close(w, torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5 + bias, -1))


@pytest.mark.parametrize("queries", [S - 3, S, S + 3])
def test_softmax_with_only_a_causal_mask_is_top_left_aligned(qkv, queries):
    _, k, v, _ = qkv  # no padding: SDPA's own causal mask does the masking
    q = torch.randn(B, H, queries, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scores = (q @ k.transpose(-1, -2) / D ** 0.5).masked_fill(torch.ones(queries, S).triu(1).bool(), float("-inf"))
    close(LF.softmax(q, k, v, causal=True)[0], torch.softmax(scores, -1) @ v)


def test_softmax_fully_masked_rows_are_zero_without_nan_gradients(qkv):
    q, k, v, kpm = qkv
    kpm = torch.ones(B, S, dtype=torch.bool)
    kpm[0, 0] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    for need_weights in (True, False):
        out, weights = LF.softmax(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
        assert torch.all(out[1] == 0) and torch.isfinite(out).all()
        if need_weights:  # zeroed in the weights handed back too, not only in the output
            assert torch.all(weights[1] == 0)
            torch.testing.assert_close(weights[0].sum(-1), torch.ones_like(weights[0, ..., 0]))
        out.sum().backward()
        for t in (q, k, v):  # the sample whose queries see nothing sends no gradient anywhere
            assert torch.isfinite(t.grad).all() and torch.all(t.grad[1] == 0)
            t.grad = None


@pytest.mark.parametrize("how", ["forward_ad", "func.jvp"])
def test_softmax_without_weights_has_forward_mode_derivatives(qkv, how):
    # torch's fused kernel behind scaled_dot_product_attention has no forward-mode formula (nn.MultiheadAttention
    # raises); the softmax reference, and Linformer on top of it, take the explicit products instead. Sample 1 sees
    # no key at all: its rows stay zero, tangent included.
    import torch.autograd.forward_ad as fwAD
    q, k, v, kpm = qkv
    kpm = kpm.clone()
    kpm[1] = True
    tangents = [torch.randn_like(t) for t in (q, k, v)]

    def attend(q, k, v):
        return LF.softmax(q, k, v, key_padding_mask=kpm, causal=False)[0]

    if how == "forward_ad":
        with fwAD.dual_level():
            dual = attend(*(fwAD.make_dual(t, d) for t, d in zip((q, k, v), tangents)))
            out, got = fwAD.unpack_dual(dual)
    else:
        out, got = torch.func.jvp(attend, (q, k, v), tuple(tangents))
    eps = 1e-6
    plus = attend(*(t + eps * d for t, d in zip((q, k, v), tangents)))
    minus = attend(*(t - eps * d for t, d in zip((q, k, v), tangents)))
    close(out, attend(q, k, v))
    close(got, (plus - minus) / (2 * eps), tol=1e-7)
    assert torch.all(out[1] == 0) and torch.all(got[1] == 0)
    e = torch.randn(3, S, dtype=torch.float64)
    with fwAD.dual_level():
        projected = LF.linformer(fwAD.make_dual(q, tangents[0]), k, v, e)[0]
        assert fwAD.unpack_dual(projected).tangent is not None

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,phi", [("elu", elu1), ("relu", torch.relu), ("callable", lambda x: x * x)])
def test_kernel_matches_reference(qkv, causal, name, phi):
    q, k, v, kpm = qkv
    if causal:
        q = torch.cat([q, q], 2)[:, :, :S]
    fmap = phi if name == "callable" else name
    out = LF.kernel(q, k, v, fmap, causal=causal, key_padding_mask=kpm, chunk_size=3)
    close(out, kernel_weights(phi, q, k, kpm, causal) @ v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("attention,weights", [(LF.taylor, taylor_weights), (LF.taylor2, taylor2_weights)],
                         ids=["taylor", "taylor2"])
def test_taylor_maps_match_reference(qkv, causal, attention, weights):
    q, k, v, kpm = qkv
    if causal:
        q = torch.cat([q, q], 2)[:, :, :S]
    close(attention(q, k, v, causal=causal, key_padding_mask=kpm), weights(q, k, kpm, causal) @ v)


def test_taylor_is_the_documented_formula(qkv):
    """(sum v + q'(K'^T V)) / (N + q'(K'^T 1)) with N the number of valid keys."""
    q, k, v, kpm = qkv
    qn, kn = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    keep = (~kpm)[:, None, :, None].double()
    kn, vm = kn * keep, v * keep
    num = vm.sum(2, keepdim=True) + qn @ (kn.transpose(-1, -2) @ vm)
    den = keep.sum(2, keepdim=True) + qn @ kn.sum(2, keepdim=True).transpose(-1, -2)
    close(LF.taylor(q, k, v, key_padding_mask=kpm), num / den)


def test_taylor2_features_give_the_second_order_expansion_of_exp_and_stay_positive():
    """phi(q).phi(k) = 1 + s + s^2/2 with s = q.k / sqrt(d), also where s is large and negative (the weight
    stays >= 1/2) and where q and k are far larger than DETR's (q + pos): a missing 1/sqrt(2) on the squares or
    a scale of 1/sqrt(d) on x instead of 1/d^(1/4) changes every weight."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64) * 6 for _ in range(2))
    k[..., 0, :] = -q[..., 0, :]  # s very negative for the first pair
    s = q @ k.transpose(-1, -2) / 8 ** 0.5
    w = LF.taylor2_feature_map(q) @ LF.taylor2_feature_map(k).transpose(-1, -2)
    close(w, 1 + s + s * s / 2)
    assert w.min() >= 0.5 - 1e-9 and s.min() < -20
    assert LF.taylor2_feature_map(q).shape[-1] == 1 + 8 + 8 * 9 // 2


def test_efficient_matches_reference(qkv):
    q, k, v, kpm = qkv
    close(LF.efficient_attention(q, k, v, key_padding_mask=kpm), efficient_weights(q, k, kpm) @ v)
    # The implied rows sum to one: it is a proper averaging of values.
    close(efficient_weights(q, k, kpm).sum(-1), torch.ones(B, H, L, dtype=torch.float64))


@pytest.mark.parametrize("per_head", [False, True])
def test_linformer_matches_reference(qkv, per_head):
    q, k, v, kpm = qkv
    g = torch.Generator().manual_seed(1)
    shape = (H, 3, 10) if per_head else (3, 10)
    e, f = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    out, w = LF.linformer(q, k, v, e, f, key_padding_mask=kpm, need_weights=True)
    close(out, linformer_weights(q, k, e, f, kpm) @ v)
    assert w.shape == (B, H, L, 3)


def test_linformer_extra_keys_join_after_the_projection(qkv):
    q, k, v, kpm = qkv
    g = torch.Generator().manual_seed(1)
    e, f = torch.randn(3, 10, generator=g, dtype=torch.float64), torch.randn(3, 10, generator=g, dtype=torch.float64)
    extra_k, extra_v = torch.randn(B, H, 2, D, generator=g, dtype=torch.float64), torch.randn(B, H, 2, D, generator=g,
                                                                                             dtype=torch.float64)
    out, w = LF.linformer(q, k, v, e, f, key_padding_mask=kpm, need_weights=True, extra_k=extra_k, extra_v=extra_v)
    keep = (~kpm)[:, None, :, None].to(k.dtype)
    keys = torch.cat([(e[:, :S] @ (k * keep)), extra_k], 2)
    values = torch.cat([(f[:, :S] @ (v * keep)), extra_v], 2)
    ref = torch.softmax(q @ keys.transpose(-1, -2) / D ** 0.5, -1)
    close(w, ref)
    close(out, ref @ values)
    with pytest.raises(ValueError, match="extra_k and extra_v"):
        LF.linformer(q, k, v, e, extra_k=extra_k)


def test_favor_estimates_softmax_attention(qkv):
    """FAVOR+ is a Monte-Carlo estimate: with many features it must approach exact softmax attention."""
    q, k, v, kpm = qkv
    proj = LF.orthogonal_random_features(4096, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = LF.kernel(q * 0.5, k * 0.5, v, "favor", projection=proj, key_padding_mask=kpm)
    ref = softmax_weights(q * 0.5, k * 0.5, kpm) @ v
    assert (out - ref).abs().max() < 0.05
    # and it is exactly kernel attention with its own (positive) features
    phi_q, phi_k = LF.apply_feature_map("favor", q, k, key_padding_mask=kpm, projection=proj)
    assert (phi_q > 0).all() and (phi_k[1, :, 4:] == 0).all()


def test_kernel_step_in_bfloat16_keeps_a_float32_state(qkv):
    _, k, v, _ = (t.to(torch.bfloat16) for t in qkv)
    q = k.flip(-1)
    full = LF.kernel(q.double(), k.double(), v.double(), "elu", causal=True)
    state = None
    for t in range(S):
        out, state = LF.kernel_step(q[:, :, t], k[:, :, t], v[:, :, t], state, "elu")
        assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
        torch.testing.assert_close(out.double(), full[:, :, t], rtol=2e-2, atol=2e-2)


def test_kernel_step_errors(qkv):
    q, k, v, _ = qkv
    with pytest.raises(ValueError, match=r"one position per call: q must be a floating-point \(B, H, D\)"):
        LF.kernel_step(q, k[:, :, 0], v[:, :, 0], None)
    with pytest.raises(ValueError, match="must share their"):
        LF.kernel_step(q[:, :, 0], k[:, :, 0], v[:1, :, 0], None)
    with pytest.raises(ValueError, match=r"state must have shape \(B, H, F, Dv \+ 1\)"):
        LF.kernel_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], torch.zeros(*q.shape[:2], D, v.shape[-1]))


def test_orthogonal_random_features_rows_are_orthogonal_within_a_block():
    w = LF.orthogonal_random_features(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    unit = w / w.norm(dim=1, keepdim=True)
    close(unit @ unit.T, torch.eye(8, dtype=torch.float64))


def test_kernel_step_equals_causal_kernel_token_by_token(qkv):
    q, k, v, _ = qkv
    q = torch.cat([q, q], 2)[:, :, :S]
    for fmap, proj in (("elu", None), ("relu", None), ("taylor", None), ("taylor2", None),
                       ("favor", LF.orthogonal_random_features(16, D, dtype=torch.float64))):
        full = LF.kernel(q, k, v, fmap, causal=True, projection=proj)
        state, outs = None, []
        for t in range(S):
            o, state = LF.kernel_step(q[:, :, t], k[:, :, t], v[:, :, t], state, fmap, projection=proj)
            outs.append(o)
        close(torch.stack(outs, 2), full)
        close(state, LF.kernel_state(k, v, fmap, projection=proj))


def test_initial_state_equals_prepending_keys(qkv):
    q, k, v, _ = qkv
    q = torch.cat([q, q], 2)[:, :, :S]
    extra_k, extra_v = k[:, :, :2], v[:, :, :2]
    state = LF.kernel_state(extra_k, extra_v, "elu")
    out = LF.kernel(q, k, v, "elu", causal=True, initial_state=state)
    w = kernel_weights(elu1, q, torch.cat([k, extra_k], 2), causal=False)
    vis = torch.cat([torch.ones(S, S).tril(), torch.ones(S, 2)], 1).bool()
    from reference import normalised
    w = normalised(elu1(q) @ elu1(torch.cat([k, extra_k], 2)).transpose(-1, -2), vis[None, None])
    close(out, w @ torch.cat([v, extra_v], 2))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fmap", ["elu", "favor"])
def test_an_initial_state_equals_the_same_keys_passed_along(qkv, fmap, causal):
    """Non-causal FAVOR+ keys take a data-dependent stabiliser; with a state from kernel_state both sums must be
    on kernel_state's scale, or the constant stops cancelling."""
    q, k, v, _ = qkv
    if causal:
        k, v = k[:, :, :L], v[:, :, :L]
    proj = LF.orthogonal_random_features(16, D, generator=torch.Generator().manual_seed(3)).double()
    kw = dict(projection=proj) if fmap == "favor" else {}
    extra_k, extra_v = k[:, :, :2] * 3, v[:, :, :2]  # larger keys: a different data-dependent maximum
    out = LF.kernel(q, k, v, fmap, causal=causal, initial_state=LF.kernel_state(extra_k, extra_v, fmap, **kw), **kw)
    if causal:  # the state's keys come before every position
        prefix_q = torch.cat([q[:, :, :2], q], 2)
        ref = LF.kernel(prefix_q, torch.cat([extra_k, k], 2), torch.cat([extra_v, v], 2), fmap, causal=True,
                        **kw)[:, :, 2:]
    else:
        ref = LF.kernel(q, torch.cat([k, extra_k], 2), torch.cat([v, extra_v], 2), fmap, **kw)
    close(out, ref, 1e-9)


@pytest.mark.parametrize("fn", [
    lambda q, k, v, m: LF.kernel(q, k, v, "elu", key_padding_mask=m),
    lambda q, k, v, m: LF.kernel(q, k, v, "elu", causal=True, key_padding_mask=m, chunk_size=2),
    lambda q, k, v, m: LF.taylor(q, k, v, key_padding_mask=m),
    lambda q, k, v, m: LF.taylor2(q, k, v, key_padding_mask=m, causal=True, chunk_size=2),
    lambda q, k, v, m: LF.efficient_attention(q, k, v, key_padding_mask=m),
    lambda q, k, v, m: LF.linformer(q, k, v, torch.randn(3, 6, dtype=torch.float64,
                                                          generator=torch.Generator().manual_seed(0)),
                                    key_padding_mask=m)[0],
    lambda q, k, v, m: LF.softmax(q, k, v, key_padding_mask=m, causal=True)[0],
    lambda q, k, v, m: LF.focused(q, k, v, key_padding_mask=m, scale=torch.tensor([0.5, 1.0, 2.0]).double()),
    lambda q, k, v, m: LF.focused(q, k, v, key_padding_mask=m, causal=True, chunk_size=2, focusing_factor=2.5),
    lambda q, k, v, m: LF.hedgehog(q, k, v, (torch.eye(3, dtype=torch.float64).expand(2, 3, 3) * 0.7, None),
                                   (torch.eye(3, dtype=torch.float64).expand(2, 3, 3), torch.ones(2, 3).double()),
                                   key_padding_mask=m, causal=True, chunk_size=2),
    lambda q, k, v, m: LF.hedgehog(q, k, v, (torch.eye(3, dtype=torch.float64).expand(2, 3, 3) * 0.7, None),
                                   (torch.eye(3, dtype=torch.float64).expand(2, 3, 3), None), key_padding_mask=m,
                                   window=(1, torch.tensor([0.3, 0.8]).double())),
    lambda q, k, v, m: LF.hedgehog(q, k, v, (torch.eye(3, dtype=torch.float64).expand(2, 3, 3) * 0.7, None),
                                   (torch.eye(3, dtype=torch.float64).expand(2, 3, 3), None), key_padding_mask=m,
                                   causal=True, chunk_size=2, window=(2, torch.tensor([0.3, 0.8]).double())),
], ids=["kernel", "kernel_causal", "taylor", "taylor2_causal", "efficient", "linformer", "softmax_causal", "focused",
        "focused_causal", "hedgehog_causal", "hedgehog_window", "hedgehog_window_causal"])
def test_gradcheck(fn):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    m = torch.zeros(1, 6, dtype=torch.bool)
    m[0, 5] = True
    assert torch.autograd.gradcheck(lambda q, k, v: fn(q, k, v, m), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [1.0, 3.0, 5.5])
def test_focused_matches_the_published_formula(qkv, causal, p):
    q, k, v, kpm = qkv
    if causal:
        k, v, kpm = q, q.flip(-1), kpm[:, :q.shape[2]]
    scale = torch.rand(q.shape[1], 1, q.shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    scale = scale + 0.5
    weights = kernel_weights(lambda x: focused_features(x, p, scale), q, k, kpm, causal)
    close(LF.focused(q, k, v, focusing_factor=p, scale=scale, key_padding_mask=kpm, causal=causal), weights @ v, 1e-9)


def test_focused_map_keeps_the_norm_sharpens_and_never_overflows():
    x = torch.tensor([[3.0, 1.0, -2.0, 0.5]], dtype=torch.float64)
    phi = LF.focused_feature_map(x, 3.0)
    relu = torch.relu(x) + 1e-6
    torch.testing.assert_close(phi.norm(dim=-1), relu.norm(dim=-1))  # the norm is relu(x)'s
    assert phi[0, 0] / phi[0, 1] > relu[0, 0] / relu[0, 1]  # the direction moves toward the largest feature
    big = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1e20
    out32 = LF.focused_feature_map(big.float(), 3.0)  # (1e20)**2 and **3 overflow float32 without the rescaling
    assert torch.isfinite(out32).all()
    ref = focused_features(big, 3.0)
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_hedgehog_gradients_reach_its_feature_maps():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    maps = [torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    biases = [torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    m = torch.tensor([[False, False, False, True, True]])
    assert torch.autograd.gradcheck(
        lambda wq, wk, bq, bk: LF.hedgehog(q, k, v, (wq, bq), (wk, bk), key_padding_mask=m), (*maps, *biases))
    mix = torch.tensor([0.2, 0.7], dtype=torch.float64, requires_grad=True)  # the window's mix trains too
    assert torch.autograd.gradcheck(
        lambda wq, wk, f: LF.hedgehog(q, k, v, (wq, None), (wk, None), key_padding_mask=m, window=(1, f)),
        (*maps, mix))


@pytest.mark.parametrize("causal", [False, True])
def test_hedgehog_window_with_all_weight_on_it_is_softmax_over_the_window(qkv, causal):
    """Mix 1: exact softmax over the keys at most w positions away and nothing else; w >= N: softmax itself (fails
    if the band is off by one, misses a key, or lets a far key in)."""
    q, k, v, kpm = qkv
    n = q.shape[2]
    k, v, kpm = (q, q.flip(-1), kpm[:, :n]) if causal else (k[:, :, :n], v[:, :, :n], kpm[:, :n])
    heads, d = q.shape[1], q.shape[-1]
    eye = (torch.eye(d, dtype=torch.float64).expand(heads, d, d), None)
    ones = torch.ones(heads, dtype=torch.float64)
    for w in (1, 2, n):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        band = torch.zeros(n, n, dtype=torch.float64).masked_fill((i - j).abs() > w, float("-inf"))
        exact = LF.softmax(q, k, v, attn_bias=band, key_padding_mask=kpm, causal=causal)[0]
        close(LF.hedgehog(q, k, v, eye, eye, key_padding_mask=kpm, causal=causal, window=(w, ones)), exact, 1e-9)


def test_hedgehog_window_needs_self_attention(qkv):
    q, k, v, _ = qkv
    eye = (torch.eye(q.shape[-1], dtype=torch.float64).expand(q.shape[1], -1, -1), None)
    with pytest.raises(ValueError, match="self-attention"):
        LF.hedgehog(q, k[:, :, :-1], v[:, :, :-1], eye, eye, window=(2, torch.ones(q.shape[1]).double()))


def test_functional_errors(qkv):
    q, k, v, kpm = qkv
    with pytest.raises(ValueError, match="seq_len"):
        LF.linformer(q, k, v, torch.randn(3, S - 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="feature_map"):
        LF.kernel(q, k, v, "softplus")
    with pytest.raises(ValueError, match="projection"):
        LF.kernel(q, k, v, "favor")
    with pytest.raises(ValueError, match="causal"):
        LF.kernel(q, k, v, causal=True)
    with pytest.raises(TypeError, match="key_padding_mask"):
        LF.kernel(q, k, v, key_padding_mask=kpm.to(torch.uint8))
    with pytest.raises(ValueError, match="4-D"):
        LF.efficient_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="focusing_factor must be a positive number"):
        LF.focused(q, k, v, focusing_factor=0)


def test_gradcheck_linformer_projections():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    e, f = (torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    m = torch.tensor([[False, False, False, False, True]])
    assert torch.autograd.gradcheck(lambda e, f: LF.linformer(q, k, v, e, f, key_padding_mask=m)[0], (e, f))


@pytest.mark.parametrize("pieces", [1, 2, 7, 64])
def test_key_value_sums_in_pieces_equal_one_product(pieces):
    # CUDA splits the sum over positions into pieces (kernel.key_value_sums); 7 leaves a remainder of 4 positions.
    from linear_mha.functional.kernel import key_value_sums
    g = torch.Generator().manual_seed(0)
    phi_k = torch.rand(2, 3, 445, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 445, 3, 4, generator=g, dtype=torch.float64).transpose(1, 2)  # a strided view, as MHA gives
    kv, k_sum = key_value_sums(phi_k, v, pieces=pieces)
    torch.testing.assert_close(kv, phi_k.transpose(-2, -1) @ v)
    torch.testing.assert_close(k_sum, phi_k.sum(dim=-2, keepdim=True).transpose(-2, -1))


def test_attention_functions_take_keyword_arguments():
    # the autocast guard around kernel / efficient_attention must not change how they can be called
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g) for _ in range(3))
    torch.testing.assert_close(LF.kernel(q=q, k=k, v=v, causal=True), LF.kernel(q, k, v, causal=True))
    torch.testing.assert_close(LF.efficient_attention(q=q, k=k, v=v), LF.efficient_attention(q, k, v))
    torch.testing.assert_close(LF.kernel_state(k=k, v=v), LF.kernel_state(k, v))


def test_the_elu_map_is_elu_plus_one_at_every_input_with_its_gradient():
    """The CPU form relu(x) + exp(x - relu(x)) (torch's CPU elu is slow) against elu(x) + 1: values at the extremes
    (-inf, 0, tiny, huge), the gradient everywhere finite (elu's slope 1 at 0 included), and the in-place form of
    the fast paths."""
    from linear_mha.functional.feature_maps import IN_PLACE_FEATURE_MAPS, elu_feature_map
    x = torch.tensor([-float("inf"), -1e30, -3.0, -1e-8, 0.0, 1e-8, 2.0, 1e30], dtype=torch.float64)
    want = torch.nn.functional.elu(x) + 1
    close(elu_feature_map(x), want, 1e-15)
    close(IN_PLACE_FEATURE_MAPS["elu"](x.clone()), want, 1e-15)
    finite = x[1:].clone().requires_grad_()
    got, = torch.autograd.grad(elu_feature_map(finite).sum(), finite)
    ref = finite.detach().clone().requires_grad_()
    expected, = torch.autograd.grad((torch.nn.functional.elu(ref) + 1).sum(), ref)
    close(got, expected, 1e-15)


@pytest.mark.parametrize("bias_shape", [(S,), (B, 1, 1, S), (L, S), (H, L, S), (B, H, L, S)],
                         ids=["per-key", "per-sample-key", "2-D", "per-head", "full"])
def test_softmax_with_weights_takes_every_bias_shape_with_its_gradient(qkv, bias_shape):
    """A bias per key enters the scores through baddbmm, any other is added in place: both must give softmax's
    weights and pass the gradient to q, k, v and the bias (a learnt additive mask)."""
    q, k, v, _ = qkv
    bias = torch.randn(*bias_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, w = LF.softmax(q, k, v, attn_bias=bias, need_weights=True)
    ref = torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5 + bias, -1)
    close(w, ref)
    close(out, ref @ v)
    inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v, bias))
    assert torch.autograd.gradcheck(lambda q, k, v, b: LF.softmax(q, k, v, attn_bias=b, need_weights=True)[0], inputs)
