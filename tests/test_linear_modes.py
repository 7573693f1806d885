"""The linear modes inside LinearMultiheadAttention: float64 references through the module, masks exact in every
mode, causality, dropout semantics, no L x S matrix on the default need_weights path, and every documented error."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import modes
from linear_mha import LinearMultiheadAttention, method_class
from reference import hedgehog_features, softmax_weights, two_map_weights

E, HEADS, B = 8, 2, 3
SEQ_LEN, PROJ_K = 16, 5  # Linformer's sizes in these tests
# Every preset and variant of every method, from the registry (a new method is tested here without an edit).
MODES = {name: modes.sized_variant(options, SEQ_LEN, proj_k=PROJ_K) for name, options in modes.ALL_VARIANTS.items()
         if name not in modes.GRID_VARIANTS}
CAUSAL = [name for name in MODES if name in modes.ALL_CAUSAL]


def module(name, dtype=torch.float64, options=None, **kw):
    """The module of variant ``name``, its method's learnable state drawn at random (trained maps and scales, not the
    identity or zero they start as)."""
    torch.manual_seed(0)
    options = MODES[name] if options is None else options
    m = LinearMultiheadAttention(E, HEADS, **options, **kw).to(dtype)
    with torch.no_grad():
        for key in m.method.state_names:
            tensor = getattr(m, key)
            if isinstance(tensor, nn.Parameter):
                tensor.normal_(generator=torch.Generator().manual_seed(len(key)))
    return m


def project(m, x, which):
    E_ = m.embed_dim
    w = m.in_proj_weight[which * E_:(which + 1) * E_]
    b = m.in_proj_bias[which * E_:(which + 1) * E_]
    y = F.linear(x, w, b)  # (L, B, E) -> (B, H, L, d)
    return y.reshape(y.shape[0], y.shape[1], m.num_heads, m.head_dim).permute(1, 2, 0, 3)


REFERENCE_CASES = [(n, False) for n in modes.BIDIRECTIONAL] + [(n, True) for n in modes.ALL_CAUSAL]


@pytest.mark.parametrize("name,causal", REFERENCE_CASES, ids=[f"{n}-{'causal' if c else 'full'}"
                                                             for n, c in REFERENCE_CASES])
def test_module_matches_its_method_s_float64_reference(name, causal):
    """Every implementation (the compiled code, the fused and chunked causal paths, composed ops) behind the
    module against the method's own naive reference: explicit L x S weights (``reference_weights``)."""
    m = module(name, options=modes.sized_variant(modes.ALL_VARIANTS[name], SEQ_LEN, proj_k=PROJ_K))
    g = torch.Generator().manual_seed(1)
    L = S = 8
    grid = modes.grid_for(m, L)
    x = torch.randn(L, B, E, generator=g, dtype=torch.float64)
    self_attention = causal or m.method.self_attention_only
    mem = x if self_attention else torch.randn(S, B, E, generator=g, dtype=torch.float64)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 5:] = True
    out, w = m(x, mem, mem, key_padding_mask=kpm, is_causal=causal, token_grid=grid)
    if mem is x and not m.method.any_mask:  # self-attention: the linear methods zero padded positions, queries too
        x = mem = x.masked_fill(kpm.T[:, :, None], 0.0)
    q, k, v = project(m, x, 0), project(m, mem, 1), project(m, mem, 2)
    ref_w = m.method.reference_weights(q, k, m.method.state(m), key_padding_mask=kpm, causal=causal,
                                       token_grid=grid)
    attn = (ref_w @ v).permute(2, 0, 1, 3).reshape(L, B, E)
    rows = ~kpm.T if mem is x else torch.ones(L, B, dtype=torch.bool)  # padding's own rows are its own
    torch.testing.assert_close(out[rows], m.out_proj(attn)[rows], rtol=1e-9, atol=1e-9)
    implied = m.attention_matrix(x, mem, key_padding_mask=kpm, is_causal=causal, average_attn_weights=False,
                                 token_grid=grid)
    torch.testing.assert_close(implied.permute(2, 0, 1, 3)[rows], ref_w.permute(2, 0, 1, 3)[rows], rtol=1e-9,
                               atol=1e-9)
    assert (w is None) == (not m.method.returns_weights)


EXTRA_KEYS = {"none": {}, "bias_kv": dict(add_bias_kv=True), "zero_attn": dict(add_zero_attn=True),
              "both": dict(add_bias_kv=True, add_zero_attn=True)}


# softmax mode is nn.MultiheadAttention's computation, which needs finite padding (README, "Masks").
EXACT = [name for name in MODES if method_class(MODES[name]["mode"]).exact]
GARBAGE_CASES = [(n, kind, extras) for n in MODES for kind in ("large", "nonfinite")
                 for extras in EXTRA_KEYS if not (n in EXACT and kind == "nonfinite")
                 and (extras == "none" or method_class(MODES[n]["mode"]).extra_keys)]


@pytest.mark.parametrize("name,garbage_kind,extras", GARBAGE_CASES)
def test_padding_with_masked_garbage_changes_nothing_and_gets_no_gradient(name, extras, garbage_kind):
    m = module(name, **EXTRA_KEYS[extras])
    if m.bias_k is not None:
        with torch.no_grad():  # nn.MultiheadAttention starts them at zero; padding must not move a real bias either
            m.bias_k.normal_(generator=torch.Generator().manual_seed(5))
            m.bias_v.normal_(generator=torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, B, E, generator=g, dtype=torch.float64)
    mem = torch.randn(6, B, E, generator=g, dtype=torch.float64)
    kpm = torch.zeros(B, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    windowed = m.method.self_attention_only  # a sliding window needs self-attention
    causal = modes.causal_if_required(m)
    base, _ = m(mem if windowed else x, mem, mem, key_padding_mask=kpm, need_weights=False, **causal)
    garbage = torch.randn(3, B, E, generator=g, dtype=torch.float64) * 1e3
    if garbage_kind == "nonfinite":  # uninitialised padding: a masked key must contribute nothing, NaN included
        garbage[0], garbage[1, :, ::2], garbage[2] = float("nan"), float("inf"), float("-inf")
    padded = torch.cat([mem, garbage]).requires_grad_(True)
    kpm_padded = torch.cat([kpm, torch.ones(B, 3, dtype=torch.bool)], dim=1)
    out, _ = m(padded if windowed else x, padded, padded, key_padding_mask=kpm_padded, need_weights=False, **causal)
    if windowed:  # the padded queries' own rows are padding's (softmax computes them as torch does): left out
        out, base = (t.masked_fill(kpm.t()[:, :, None], 0.0) for t in (out[:6], base))
    torch.testing.assert_close(out, base, rtol=1e-9, atol=1e-9)
    out.sum().backward()
    assert torch.all(padded.grad[6:] == 0)
    assert torch.all(padded.grad[4:6, 0] == 0)
    assert padded.grad[:4].abs().sum() > 0


@pytest.mark.parametrize("name", list(MODES))
def test_samples_in_a_batch_do_not_mix(name):
    m = module(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, B, E, generator=g, dtype=torch.float64)
    out, _ = m(x, x, x, **modes.causal_if_required(m))
    x2 = x.clone()
    x2[:, 2] += torch.randn(6, E, generator=g, dtype=torch.float64)
    out2, _ = m(x2, x2, x2, **modes.causal_if_required(m))
    torch.testing.assert_close(out2[:, :2], out[:, :2], rtol=0, atol=0)
    assert not torch.allclose(out2[:, 2], out[:, 2])


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("how", ["is_causal", "bool_mask", "float_mask"])
def test_causal_paths_never_see_the_future(name, how):
    m = module(name)
    N = 9
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, B, E, generator=g, dtype=torch.float64)
    future = torch.ones(N, N, dtype=torch.bool).triu(1)
    kwargs = {"is_causal": {"is_causal": True}, "bool_mask": {"attn_mask": future},
              "float_mask": {"attn_mask": torch.zeros(N, N, dtype=torch.float64).masked_fill(future, float("-inf"))}}[how]
    out, _ = m(x, x, x, need_weights=False, **kwargs)
    for t in (0, 4, 8):
        x2 = x.clone()
        x2[t] += 10 * torch.randn(B, E, generator=g, dtype=torch.float64)
        out2, _ = m(x2, x2, x2, need_weights=False, **kwargs)
        torch.testing.assert_close(out2[:t], out[:t], rtol=0, atol=1e-12)
        assert not torch.allclose(out2[t], out[t])


@pytest.mark.parametrize("name", [n for n in CAUSAL if method_class(MODES[n]["mode"]).extra_keys])
def test_causal_with_bias_kv_and_zero_attn_sees_them_everywhere(name):
    m = module(name, add_bias_kv=True, add_zero_attn=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, B, E, generator=g, dtype=torch.float64)
    out, _ = m(x, x, x, is_causal=True)
    implied = m.attention_matrix(x, x, is_causal=True, average_attn_weights=False)
    assert implied.shape == (B, HEADS, 6, 8)
    assert torch.all(implied[..., :6].triu(1) == 0)
    assert (implied[..., 0, 6] > 0).any()  # the bias key is visible to the first query too
    if m.method.computes_torch_attention:
        ref = nn.MultiheadAttention(E, HEADS, add_bias_kv=True, add_zero_attn=True).double()
        ref.load_state_dict(m.state_dict())
        expected, _ = ref(x, x, x, attn_mask=torch.ones(6, 6, dtype=torch.bool).triu(1))
        torch.testing.assert_close(out, expected)


def test_key_dropout_keeps_the_expectation_and_is_off_in_eval():
    m = module("kernel_elu", dropout=0.5)
    x = torch.randn(4, 1, E, dtype=torch.float64)
    m.eval()
    eval_out, _ = m(x, x, x)
    assert torch.equal(m(x, x, x)[0], eval_out)
    m.train()
    torch.manual_seed(0)
    many = x.expand(4, 4000, E)  # masks are drawn per sample, so the batch gives independent draws
    out, _ = m(many, many, many)
    assert not torch.equal(out[:, 0], out[:, 1])
    torch.testing.assert_close(out.mean(1, keepdim=True), eval_out, rtol=0, atol=0.05)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


LINEAR = [name for name in MODES if name not in EXACT]


@pytest.mark.parametrize("name,causal", [(n, False) for n in LINEAR if n in modes.BIDIRECTIONAL]
                         + [(n, True) for n in LINEAR if n in CAUSAL])
def test_default_need_weights_never_forms_an_l_by_s_matrix(name, causal):
    N = 2048  # large against every window a method keeps (block_local: 3 x 128 keys per query)
    m = LinearMultiheadAttention(E, HEADS, **modes.sized_variant(MODES[name], N))
    x = torch.randn(N, 1, E)
    with _LargestTensor() as spy:
        out, w = m(x, x, x, is_causal=causal)  # need_weights defaults to True, as DETR calls it
    assert w is None
    assert spy.largest < N * N // 4, f"a tensor of {spy.largest} elements appeared (N^2 = {N * N})"


LINEAR_LAYOUTS = {
    "batch_first": dict(batch_first=True),
    "kdim_vdim": dict(kdim=6, vdim=5),
    "bias_kv_zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
    "no_bias": dict(bias=False),
}


@pytest.mark.parametrize("name", LINEAR)
@pytest.mark.parametrize("layout", list(LINEAR_LAYOUTS))
def test_layouts_and_unbatched_agree_with_the_batched_call(name, layout):
    kw = LINEAR_LAYOUTS[layout]
    m = module(name, **kw)
    if m.method.self_attention_only:
        pytest.skip("the layouts are checked on cross-attention, which this method refuses")
    bf = kw.get("batch_first", False)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, 5, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, 7, kw.get("kdim", E), generator=g, dtype=torch.float64)
    v = torch.randn(B, 7, kw.get("vdim", E), generator=g, dtype=torch.float64)
    args = (q, k, v) if bf else tuple(t.transpose(0, 1) for t in (q, k, v))
    out, _ = m(*args)
    assert out.shape == ((B, 5, E) if bf else (5, B, E))
    single, _ = m(q[1], k[1], v[1])
    torch.testing.assert_close(single, out[1] if bf else out[:, 1])


def test_linformer_accepts_any_length_up_to_seq_len():
    m = module("linformer")
    for n in (1, 9, 16):
        x = torch.randn(n, 2, E, dtype=torch.float64)
        assert m(x, x, x)[0].shape == (n, 2, E)
    x = torch.randn(17, 2, E, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"S=17.*seq_len=16"):
        m(x, x, x)


def test_hedgehog_favor_init_starts_as_an_estimate_of_softmax_weights():
    """init='favor' draws one W for q and k with entries N(0, d^-1/2): with many features the implied weights are
    softmax's. Independent draws for q and k, or the scale d^-1/2 of the scores instead of d^-1/4, stay far off
    (0.46 and 0.32 in this setting), as does the identity start (0.36)."""
    d = 8
    torch.manual_seed(0)
    m = LinearMultiheadAttention(HEADS * d, HEADS, mode="hedgehog", init="favor", feature_dim=4096).double()
    assert torch.equal(m.hedgehog_q_weight, m.hedgehog_k_weight) and m.hedgehog_q_weight is not m.hedgehog_k_weight
    q = torch.randn(1, HEADS, 40, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.7
    k = torch.randn(1, HEADS, 40, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.7
    implied = two_map_weights(hedgehog_features(q, m.hedgehog_q_weight, m.hedgehog_q_bias),
                              hedgehog_features(k, m.hedgehog_k_weight, m.hedgehog_k_bias))
    exact = softmax_weights(q, k)
    assert (implied - exact).norm() / exact.norm() < 0.15
    identity = LinearMultiheadAttention(HEADS * d, HEADS, mode="hedgehog").double()
    start = two_map_weights(hedgehog_features(q, identity.hedgehog_q_weight, identity.hedgehog_q_bias),
                            hedgehog_features(k, identity.hedgehog_k_weight, identity.hedgehog_k_bias))
    assert (start - exact).norm() / exact.norm() > 0.3


def test_fully_masked_sample_gives_zero_attention_not_nan():
    for name in MODES:
        m = module(name)
        x = torch.randn(4, 2, E, dtype=torch.float64)
        kpm = torch.zeros(2, 4, dtype=torch.bool)
        kpm[1] = True
        out, _ = m(x, x, x, key_padding_mask=kpm, **modes.causal_if_required(m))
        torch.testing.assert_close(out[:, 1], m.out_proj.bias.expand(4, E).detach())


@pytest.mark.parametrize("name", list(MODES))
def test_gradcheck_through_the_module(name):
    m = LinearMultiheadAttention(4, 2, **modes.sized_variant({**MODES[name], "proj_k": 3}, 5)).double()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(5, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    causal = modes.causal_if_required(m)
    assert torch.autograd.gradcheck(lambda a, b: m(a, b, b, key_padding_mask=kpm, **causal)[0], (x, mem))


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("name", list(MODES))
def test_empty_batches_and_sequences_give_empty_or_zero_outputs(name, native_on, backends):
    """nn.MultiheadAttention takes B = 0, L = 0 and S = 0; so must every mode, on every path (the compiled
    kernels once divided by B * H = 0 and killed the process)."""
    if not native_on:
        backends(native_kernels=False)
    for dtype in (torch.float32, torch.float64):
        m = module(name, dtype=dtype, batch_first=True)
        for b, n_q, n_k in ((0, 5, 5), (2, 0, 5), (2, 5, 0), (2, 0, 0)):
            causal_options = [c for c in ((False, True) if name in CAUSAL and n_q == n_k else (False,))
                              if c or m.method.bidirectional] or [True]
            for causal, grad in ((c, g) for c in causal_options for g in (False, True)):
                q = torch.randn(b, n_q, E, dtype=dtype, requires_grad=grad)
                kv = torch.randn(b, n_k, E, dtype=dtype, requires_grad=grad)
                if m.method.self_attention_only and n_q != n_k:  # a sliding window pairs query i with key i
                    with pytest.raises(ValueError, match="self-attention"):
                        m(q, kv, kv, need_weights=False)
                    continue
                with torch.set_grad_enabled(grad):
                    out, _ = m(q, kv, kv, need_weights=False, is_causal=causal,
                               attn_mask=nn.Transformer.generate_square_subsequent_mask(n_q) if causal else None)
                assert out.shape == (b, n_q, E)
                if n_k == 0:  # no keys: the attention is zero and the output is out_proj's bias
                    torch.testing.assert_close(out, m.out_proj.bias.expand_as(out).detach())
                if grad:
                    out.sum().backward()
                    assert torch.isfinite(q.grad).all() and q.grad.shape == q.shape


@pytest.mark.parametrize("self_attention", [False, True])
@pytest.mark.parametrize("name", LINEAR)
def test_nonfinite_padding_reaches_no_parameter_gradient(name, self_attention):
    """NaN and inf in masked positions: one optimizer step must not ruin the model (the projections used to multiply
    the garbage rows before they were masked, giving in_proj_weight a NaN gradient)."""
    m = module(name)
    g = torch.Generator().manual_seed(8)
    mem = torch.randn(6, B, E, generator=g, dtype=torch.float64)
    mem[4:, 0] = float("nan")
    mem[5, 1] = float("inf")
    kpm = torch.zeros(B, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    kpm[1, 5] = True
    x = mem if self_attention else torch.randn(6, B, E, generator=g, dtype=torch.float64)
    out, _ = m(x, mem, mem, key_padding_mask=kpm, need_weights=False, **modes.causal_if_required(m))
    valid = ~kpm.T if self_attention else torch.ones(6, B, dtype=torch.bool)
    out[valid].sum().backward()  # a loss on the valid positions, as a model with padding has
    assert torch.isfinite(out[valid]).all()
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
