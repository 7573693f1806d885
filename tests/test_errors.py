"""Every bad input the docs list raises an error that names the argument (and, where there is one, the fix)."""
import pytest
import torch

import linear_mha
import linear_mha.functional as LF
from linear_mha import LinearMultiheadAttention
import modes

E, H = 8, 2


def x(n=5, b=2, e=E):
    return torch.randn(n, b, e)


def linear(mode):
    return LinearMultiheadAttention(E, H, mode=mode, **modes.sized(mode, 8))


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="performer"), "mode must be one of"),
    (dict(param_sharing="global"), "param_sharing must be one of"),
    (dict(mode="kernel", param_sharing="kv"), r"mode='kernel' has no option 'param_sharing' \(an option of 'linformer'\)"),
    (dict(mode="softmax", feature_map="elu"), r"mode='softmax' has no option 'feature_map' \(an option of 'kernel', 'inline', 'mala'\)"),
    (dict(mode="kernel", proj_k=64), r"mode='kernel' has no option 'proj_k'.*its options are: feature_map, "),
    (dict(mode="linformer", chunk_size=64), r"mode='linformer' has no option 'chunk_size' \(an option of 'kernel', "
                                            r"'taylor'.*\); its options are: seq_len, proj_k"),
    (dict(mode="kernel", feature_map="softplus"), "feature_map must be one of"),
    (dict(mode="kernel", num_features=8), "num_features only applies"),
    (dict(mode="kernel", feature_map="favor", num_features=0), "num_features must be a positive int"),
    (dict(mode="kernel", redraw_interval=3), "redraw_interval only applies"),
    (dict(seq_len=0), "seq_len must be a positive int"),
    (dict(proj_k=-1), "proj_k must be a positive int"),
    (dict(shared_projection=torch.nn.Parameter(torch.zeros(128, 100))), "only used with param_sharing='layerwise'"),
    (dict(param_sharing="layerwise", shared_projection=torch.nn.Parameter(torch.zeros(3, 4))), "shape"),
    (dict(seqlen=10), "did you mean 'seq_len'"),
])
def test_constructor_rejects_unknown_and_contradictory_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinearMultiheadAttention(E, H, **kwargs)


def test_a_shared_projection_must_be_a_parameter():
    with pytest.raises(TypeError, match=r"nn.Parameter .*neither trained nor saved.*got Tensor"):
        LinearMultiheadAttention(E, H, param_sharing="layerwise", shared_projection=torch.zeros(128, 100))


def test_constructor_rejects_bad_dimensions():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        LinearMultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="dropout must be in"):
        LinearMultiheadAttention(E, H, dropout=1.5)


@pytest.mark.parametrize("mode", ["softmax", "kernel", "linformer"])
def test_uint8_masks_are_rejected_as_torch_does(mode):
    m = linear(mode)
    q = x()
    with pytest.raises(TypeError, match=r"key_padding_mask must be a bool.*\.bool\(\)"):
        m(q, q, q, key_padding_mask=torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="attn_mask must be a bool"):
        m(q, q, q, attn_mask=torch.zeros(5, 5, dtype=torch.uint8))


def test_mask_shapes_are_checked():
    m = LinearMultiheadAttention(E, H, mode="kernel")
    q = x()
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(2, 5\)"):
        m(q, q, q, key_padding_mask=torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(5, 5\) or \(4, 5, 5\)"):
        m(q, q, q, attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool))


def test_inputs_are_checked():
    m = LinearMultiheadAttention(E, H, mode="kernel")
    with pytest.raises(ValueError, match="expected `key` and `value` to be 3-D but found 2-D and 3-D tensors"):
        m(x(), x()[:, 0], x())
    with pytest.raises(ValueError, match="key has feature size 6, expected 8"):
        m(x(), x(e=6), x())
    with pytest.raises(ValueError, match="same batch and sequence"):
        m(x(), x(n=5), x(n=4))


@pytest.mark.parametrize("mode", modes.LINEAR)
def test_masks_a_linear_mode_cannot_apply_are_refused_naming_the_modes(mode):
    m = linear(mode)
    q = x()
    arbitrary = torch.zeros(5, 5, dtype=torch.bool)
    arbitrary[0, 3] = True
    with pytest.raises(ValueError, match=r"cannot apply.*mode='softmax'"):
        m(q, q, q, attn_mask=arbitrary)
    with pytest.raises(ValueError, match="additive float values other than 0 and -inf"):
        m(q, q, q, attn_mask=torch.randn(5, 5))
    with pytest.raises(ValueError, match="additive float values other than 0 and -inf"):
        m(q, q, q, key_padding_mask=torch.randn(2, 5))


@pytest.mark.parametrize("mode", modes.LINEAR_NON_CAUSAL)
def test_causal_is_refused_by_modes_without_a_causal_form(mode):
    m = linear(mode)
    q = x()
    with pytest.raises(ValueError, match=r"has no causal form.*supported by modes"):
        m(q, q, q, is_causal=True)
    with pytest.raises(ValueError, match="has no causal form"):
        m(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool).triu(1))


def test_is_causal_must_agree_with_the_mask():
    m = LinearMultiheadAttention(E, H, mode="kernel")
    q = x()
    wrong = torch.ones(5, 5, dtype=torch.bool).triu(2)
    with pytest.raises(ValueError, match="is_causal=True, but attn_mask is not the causal"):
        m(q, q, q, attn_mask=wrong, is_causal=True)


def test_causal_cross_attention_with_different_lengths_is_refused():
    m = LinearMultiheadAttention(E, H, mode="kernel")
    with pytest.raises(ValueError, match="as many queries as keys"):
        m(x(4), x(5), x(5), is_causal=True)


def test_linformer_length_error_names_seq_len_and_s():
    m = LinearMultiheadAttention(E, H, seq_len=4, proj_k=2)
    with pytest.raises(ValueError, match=r"S=5.*seq_len=4.*seq_len >= 5"):
        m(x(), x(), x())
    m = LinearMultiheadAttention(E, H, seq_len=5, proj_k=2, add_bias_kv=True, add_zero_attn=True)
    assert m(x(), x(), x())[0].shape == x().shape  # extra keys join after the projection: seq_len covers S only


def test_redraw_features_only_for_favor():
    with pytest.raises(RuntimeError, match="feature_map='favor'"):
        LinearMultiheadAttention(E, H, mode="kernel").redraw_features()


def test_from_torch_needs_an_mha():
    with pytest.raises(TypeError, match="nn.MultiheadAttention"):
        LinearMultiheadAttention.from_torch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("mode", linear_mha.available_methods())
def test_every_option_default_passes_its_own_check(mode):
    """A default that its check would refuse means the method cannot be built with that option given explicitly
    as its documented default."""
    cls = linear_mha.method_class(mode)
    defaults = {key: option.default for key, option in cls.options.items() if option.default is not None}
    assert cls.validate(defaults) == cls.validate({})


def test_query_of_the_wrong_rank_is_named_with_its_shape():
    m = LinearMultiheadAttention(E, H)
    q = torch.randn(1, 4, 2, E)
    with pytest.raises(ValueError, match=r"received 4-D query tensor \(shape \(1, 4, 2, 8\)\); query, key and value "
                                         r"are all batched"):
        m(q, q, q)
    with pytest.raises(ValueError, match="expected `key` and `value` to be 3-D but found 2-D and 2-D tensors"):
        m(x(), x()[0], x()[0])


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(embed_dim=32.0), TypeError, "embed_dim must be an int, got float 32.0"),
    (dict(embed_dim=-8), ValueError, "embed_dim must be >= 1, got -8"),
    (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
    (dict(kdim=0), ValueError, "kdim must be >= 1, got 0"),
    (dict(vdim=0), ValueError, "vdim must be >= 1, got 0"),
    (dict(dropout="0.1"), TypeError, "dropout must be a number in \\[0, 1\\], got str '0.1'"),
    (dict(dtype=torch.int64), TypeError, "dtype must be a floating-point torch.dtype"),
])
def test_nn_multihead_attention_arguments_are_named_in_their_errors(kwargs, error, match):
    arguments = {"embed_dim": E, "num_heads": H, **kwargs}
    with pytest.raises(error, match=match):
        LinearMultiheadAttention(**arguments)


def test_functional_arguments_are_blamed_by_name():
    import linear_mha.functional as LF
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"attn_bias of shape \(5, 5\) does not broadcast to \(B, H, L, S\)"):
        LF.softmax(q, q, q, attn_bias=torch.zeros(5, 5))
    with pytest.raises(ValueError, match=r"e_proj must be \(k, seq_len\) .* got a 1-D tensor"):
        LF.linformer(q, q, q, torch.zeros(4))


def test_patch_checks_a_misspelt_mode_or_option_even_where_nothing_is_patched():
    from linear_mha import patch
    empty = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="did you mean 'kernel'"):
        patch(empty, "kernal")
    with pytest.raises(ValueError, match="feature_map must be one of"):
        patch(empty, "kernel", feature_map="gelu")


def test_an_input_in_another_dtype_than_the_module_names_both_fixes():
    m = LinearMultiheadAttention(8, 2, mode="kernel")
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"query is torch.float64 but this module's parameters are torch.float32.*"
                                        r"module.to\(torch.float64\)"):
        m(x, x, x)
    with pytest.raises(TypeError, match="key is torch.int64"):
        m(x.float(), torch.ones(3, 2, 8, dtype=torch.long), x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the inputs itself: no refusal there
        assert m(x.float(), x.float(), x.float())[0].shape == (3, 2, 8)


@pytest.mark.parametrize("fn", [LF.kernel, LF.efficient_attention, LF.taylor, LF.focused,
                                lambda q, k, v: LF.softmax(q, k, v)[0],
                                lambda q, k, v: LF.linformer(q, k, v, torch.randn(2, 3))[0]],
                         ids=["kernel", "efficient_attention", "taylor", "focused", "softmax", "linformer"])
def test_integer_tensors_to_the_functional_api_name_the_argument(fn):
    x = torch.ones(1, 1, 3, 2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"q must be a floating-point tensor, got torch.int64; convert it with q.float"):
        fn(x, x, x)


@pytest.mark.parametrize("fn", [LF.kernel, LF.efficient_attention, LF.taylor, LF.focused,
                                lambda q, k, v, **kw: LF.softmax(q, k, v, **kw)[0],
                                lambda q, k, v, **kw: LF.linformer(q, k, v, torch.randn(2, 6), **kw)[0]],
                         ids=["kernel", "efficient_attention", "taylor", "focused", "softmax", "linformer"])
def test_a_mask_on_another_device_than_the_keys_is_refused(fn):
    """The compiled code took the data pointer of a mask on another device: one on the meta device (pointer 0)
    was read as no mask at all, and a CUDA mask beside CPU keys would be read as host memory."""
    q = torch.randn(1, 2, 6, 4)
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[:, 3:] = True
    with pytest.raises(ValueError, match=r"key_padding_mask is on meta but k is on cpu; move it with "
                                         r"key_padding_mask.to\(k.device\)"):
        fn(q, q, q, key_padding_mask=mask.to("meta"))
    fn(q, q, q, key_padding_mask=mask)  # on the keys' device it runs


def test_a_module_given_a_mask_on_another_device_names_it():
    m = LinearMultiheadAttention(8, 2, mode="taylor")
    x = torch.randn(6, 1, 8)
    with pytest.raises(ValueError, match=r"key_padding_mask is on meta but the inputs are on cpu; move it with "
                                         r"key_padding_mask.to\('cpu'\)"):
        m(x, x, x, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match=r"attn_mask is on meta but the inputs are on cpu"):
        m(x, x, x, attn_mask=torch.zeros(6, 6, dtype=torch.bool, device="meta"))
    assert m(x, x, x, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool))[0].shape == (6, 1, 8)


def test_an_in_place_step_on_a_broadcast_state_is_refused():
    q = torch.randn(1, 1, 2)
    state = torch.zeros(1, 1, 1, 3).expand(1, 1, 2, 3)  # one row shared by both features
    with pytest.raises(ValueError, match=r"broadcast \(expanded\) state.*state.clone\(\)"):
        LF.kernel_step(q, q, q, state, inplace=True)
    out, new = LF.kernel_step(q, q, q, state.clone(), inplace=True)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["key_padding_mask", "attn_mask"])
def test_nan_or_inf_in_a_float_mask_is_refused_in_softmax_as_in_the_linear_methods(which, bad):
    m = LinearMultiheadAttention(8, 2, mode="softmax")
    x = torch.randn(3, 2, 8)
    mask = torch.zeros(2, 3) if which == "key_padding_mask" else torch.zeros(3, 3)
    mask[0, 1] = bad
    with pytest.raises(ValueError, match=f"{which} holds NaN or \\+inf"):
        m(x, x, x, **{which: mask})


BAD_CALLS = {  # (query, key, value, kwargs) that torch.nn.MultiheadAttention refuses with an AssertionError
    "embed_dim": (torch.randn(3, 2, 6), torch.randn(3, 2, 8), torch.randn(3, 2, 8), {}),
    "key_value_lengths": (torch.randn(3, 2, 8), torch.randn(4, 2, 8), torch.randn(5, 2, 8), {}),
    "key_padding_mask_shape": (torch.randn(3, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8),
                               {"key_padding_mask": torch.zeros(2, 5, dtype=torch.bool)}),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_malformed_inputs_raise_what_torch_raises_with_our_message(case):
    """Code written against nn.MultiheadAttention catches AssertionError; ours is that and a ValueError naming the
    argument."""
    q, k, v, kwargs = BAD_CALLS[case]
    with pytest.raises(AssertionError):
        torch.nn.MultiheadAttention(8, 2)(q, k, v, **kwargs)
    for mode in ("softmax", "kernel"):
        with pytest.raises(AssertionError) as caught:
            LinearMultiheadAttention(8, 2, mode=mode)(q, k, v, **kwargs)
        assert isinstance(caught.value, ValueError) and ("mask" in str(caught.value) or "query" in str(caught.value)
                                                         or "key" in str(caught.value))


def test_an_empty_nested_tensor_is_refused_as_torch_refuses_it():
    """torch.nested.nested_tensor([]) is 1-D: torch's MultiheadAttention raises AssertionError with this message."""
    m = LinearMultiheadAttention(8, 2, mode="kernel", batch_first=True).eval()
    empty = torch.nested.nested_tensor([], dtype=torch.float32)
    with pytest.raises(AssertionError, match="query should be unbatched 2D or batched 3D tensor but received 1-D"):
        m(empty, empty, empty)
