"""mode='softmax' is nn.MultiheadAttention, to float precision, for every layout and mask; parameters, state
dicts and attributes are nn.MultiheadAttention's in all three layouts."""
import itertools
import warnings

import pytest
import torch
from torch import nn

import modes
from linear_mha import LinearMultiheadAttention

E, HEADS, L, S, B = 8, 2, 4, 6, 3
LAYOUTS = {
    "packed": dict(),
    "batch_first": dict(batch_first=True),
    "kdim_vdim": dict(kdim=6, vdim=5),
    "bias_kv_zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
    "no_bias": dict(bias=False),
}


def make_inputs(kw, unbatched=False, self_attn=False, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    bf = kw.get("batch_first", False)

    def t(n, e):
        shape = (n, e) if unbatched else ((B, n, e) if bf else (n, B, e))
        return torch.randn(*shape, generator=g, dtype=dtype)

    q = t(L, E)
    if self_attn:
        return q, q, q
    return q, t(S, kw.get("kdim", E)), t(S, kw.get("vdim", E))


def masks(kind, unbatched=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    kpm = torch.zeros((S,) if unbatched else (B, S), dtype=torch.bool)
    kpm[..., 4:] = True
    if kind == "none":
        return {}
    if kind == "kpm_bool":
        return {"key_padding_mask": kpm}
    if kind == "kpm_float":
        return {"key_padding_mask": torch.zeros(kpm.shape, dtype=dtype).masked_fill(kpm, float("-inf"))}
    if kind == "kpm_float_bias":
        return {"key_padding_mask": torch.randn(kpm.shape, generator=g, dtype=dtype)}
    if kind == "attn_bool":
        m = torch.zeros(L, S, dtype=torch.bool)
        m[1, 2] = m[3, 0] = True
        return {"attn_mask": m}
    if kind == "attn_float":
        return {"attn_mask": torch.randn(L, S, generator=g, dtype=dtype)}
    if kind == "attn_3d":
        n = HEADS if unbatched else B * HEADS
        return {"attn_mask": torch.randn(n, L, S, generator=g, dtype=dtype)}
    if kind == "both":
        return {"key_padding_mask": kpm, "attn_mask": torch.rand(L, S, generator=g) > 0.7}
    raise KeyError(kind)


def pair(kw, dtype=torch.float64, **options):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, HEADS, **kw).to(dtype)
    ours = LinearMultiheadAttention.from_torch(ref, mode="softmax", **options)
    return ref, ours


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mask", ["none", "kpm_bool", "kpm_float", "kpm_float_bias", "attn_bool", "attn_float",
                                  "attn_3d", "both"])
@pytest.mark.parametrize("unbatched", [False, True])
def test_softmax_mode_equals_nn_mha(layout, mask, unbatched):
    kw = LAYOUTS[layout]
    ref, ours = pair(kw)
    q, k, v = make_inputs(kw, unbatched)
    mk = masks(mask, unbatched)
    for need_weights, average in itertools.product([True, False], [True, False]):
        with warnings.catch_warnings():  # torch warns about mixed bool/float masks
            warnings.simplefilter("ignore")
            expected = ref(q, k, v, need_weights=need_weights, average_attn_weights=average, **mk)
        got = ours(q, k, v, need_weights=need_weights, average_attn_weights=average, **mk)
        assert isinstance(got, tuple) and len(got) == 2
        torch.testing.assert_close(got[0], expected[0], rtol=1e-10, atol=1e-10)
        if expected[1] is None:
            assert got[1] is None
        else:
            torch.testing.assert_close(got[1], expected[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["packed", "batch_first", "kdim_vdim"])
def test_float32_self_attention_and_causal(layout):
    kw = LAYOUTS[layout]
    ref, ours = pair(kw, dtype=torch.float32)
    if layout == "kdim_vdim":
        q, k, v = make_inputs(kw, dtype=torch.float32)
    else:
        q, k, v = make_inputs(kw, self_attn=True, dtype=torch.float32)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1) if k.shape[-2 if kw.get("batch_first") else 0] == L else None
    for extra in ({}, {"attn_mask": causal, "is_causal": True} if causal is not None else {}):
        a = ref(q, k, v, **extra)
        b = ours(q, k, v, **extra)
        torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)


def test_is_causal_without_mask_is_causal():
    ref, ours = pair({})
    q, _, _ = make_inputs({}, self_attn=True)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    torch.testing.assert_close(ours(q, q, q, is_causal=True)[0], ref(q, q, q, attn_mask=causal)[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", list(modes.VARIANTS))
def test_state_dict_loads_strictly_and_names_match(layout, variant):
    """nn.MultiheadAttention's keys, in its order, then the method's own tensors; its checkpoint loads strictly."""
    kw = LAYOUTS[layout]
    options = dict(modes.VARIANTS[variant])
    mode = options.pop("mode")
    ref = nn.MultiheadAttention(E, HEADS, **kw)
    ours = LinearMultiheadAttention(E, HEADS, mode=mode, **options, **modes.sized(mode, S), **kw)
    keys = list(ours.state_dict())
    assert [k for k in keys if k not in ours.method.state_names] == list(ref.state_dict())
    shared = [(n, p) for n, p in ours.named_parameters() if n not in ours.method.state_names]
    assert [(n, p.shape) for n, p in ref.named_parameters()] == [(n, p.shape) for n, p in shared]
    ours.load_state_dict(ref.state_dict(), strict=True)
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
def test_linformer_loads_mha_state_dict_and_keeps_its_projections(sharing):
    ref = nn.MultiheadAttention(E, HEADS)
    ours = LinearMultiheadAttention(E, HEADS, mode="linformer", seq_len=S, proj_k=3, param_sharing=sharing)
    extra = set(ours.state_dict()) - set(ref.state_dict())
    assert extra == ({"e_proj", "f_proj"} if sharing in ("none", "headwise") else {"e_proj"})
    before = ours.e_proj.detach().clone()
    result = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(ours.e_proj, before)
    # a checkpoint of our own module must still restore its projections
    other = LinearMultiheadAttention(E, HEADS, mode="linformer", seq_len=S, proj_k=3, param_sharing=sharing)
    other.load_state_dict(ours.state_dict(), strict=True)
    assert torch.equal(other.e_proj, ours.e_proj)
    partial = {k: v for k, v in ours.state_dict().items() if k != "e_proj"}
    if "f_proj" in partial:  # half of the extra state present: a genuinely broken checkpoint is reported
        with pytest.raises(RuntimeError, match="e_proj"):
            other.load_state_dict(partial, strict=True)


def test_attributes_read_off_an_mha():
    for kw in LAYOUTS.values():
        ref = nn.MultiheadAttention(E, HEADS, dropout=0.1, **kw)
        ours = LinearMultiheadAttention(E, HEADS, 0.1, **kw)
        for name in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout", "batch_first",
                     "head_dim", "add_zero_attn"):
            assert getattr(ours, name) == getattr(ref, name), name
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k",
                     "bias_v"):
            a, b = getattr(ref, name), getattr(ours, name)
            assert (a is None) == (b is None), name
            assert a is None or a.shape == b.shape, name
        assert isinstance(ours.out_proj, nn.Linear)


def test_positional_arguments_follow_nn_mha_order():
    ours = LinearMultiheadAttention(E, HEADS, 0.25, False, True, True, 6, 5, True, None, torch.float64)
    assert (ours.dropout, ours.in_proj_bias, ours.add_zero_attn, ours.kdim, ours.vdim, ours.batch_first) == \
        (0.25, None, True, 6, 5, True)
    assert ours.bias_k is not None and ours.q_proj_weight.dtype == torch.float64
    assert LinearMultiheadAttention(E, HEADS).mode == "taylor"  # the default takes any length


def test_from_torch_copy_false_shares_parameters_and_keeps_train_state():
    ref = nn.MultiheadAttention(E, HEADS).eval()
    ours = LinearMultiheadAttention.from_torch(ref, copy=False, mode="kernel")
    assert ours.in_proj_weight is ref.in_proj_weight and ours.out_proj is ref.out_proj
    assert not ours.training
    copied = LinearMultiheadAttention.from_torch(ref, mode="kernel")
    assert copied.in_proj_weight is not ref.in_proj_weight
    assert torch.equal(copied.in_proj_weight, ref.in_proj_weight)


@pytest.mark.parametrize("options", [dict(mode="kernel", feature_map="favor"), dict(mode="linformer", seq_len=16),
                                     dict(mode="hedgehog", init="favor"), dict(mode="focused"),
                                     dict(mode="softmax", add_bias_kv=True, kdim=8, vdim=12),
                                     dict(mode="kernel", dwc_kernel=3, output_gate=True)],
                         ids=["favor", "linformer", "hedgehog", "focused", "softmax_kdim_bias_kv", "local_gate"])
def test_a_module_built_on_the_meta_device_is_initialised_by_reset_parameters(options):
    # torch's meta-device recipe and FSDP: build without memory, to_empty(), then reset_parameters() on each module.
    # Left as to_empty gives them, the projections and the method's state would be whatever the memory held.
    torch.manual_seed(0)
    fresh = LinearMultiheadAttention(32, 4, **options)
    empty = LinearMultiheadAttention(32, 4, device="meta", **options).to_empty(device="cpu")
    for tensor in empty.state_dict().values():
        tensor.fill_(float("nan"))
    torch.manual_seed(0)
    empty.reset_parameters()
    expected = fresh.state_dict()
    assert expected.keys() == empty.state_dict().keys()
    for name, tensor in empty.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_reset_parameters_of_an_adapter_leaves_the_modules_it_took_over():
    # timm's adapter runs timm's own qkv and proj: it re-initialises only what linear_mha added.
    timm = pytest.importorskip("timm")
    import linear_mha
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                            num_classes=0)
    linear_mha.patch(vit, mode="hedgehog", output_gate=True)
    attn = vit.blocks[0].attn
    before = {name: tensor.clone() for name, tensor in attn.state_dict().items()}
    added = {name for name, _ in attn.named_parameters() if name.startswith(("hedgehog", "gate_"))}
    assert added and "qkv.weight" in before
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name in added:
                p.fill_(float("nan"))
    attn.reset_parameters()
    for name, tensor in attn.state_dict().items():  # identity maps and a closed gate: no random draw to match
        assert torch.equal(tensor, before[name]), name
