"""dwc_kernel: a depthwise convolution of the values over the token grid, added to any method's output. Checked
against a naive float64 convolution; padding stays exact (masked garbage reaches no output and no gradient); the
grid reaches the modules from DETR's transformer, timm and torchvision ViTs (prefix tokens left out), or directly."""
import copy
import io

import pytest
import torch
from torch import nn

import linear_mha
import linear_mha.functional as LF
from linear_mha.functional import native_maps
import modes
from linear_mha import LinearMultiheadAttention, TokenGrid, patch, unpatch

E, H = 8, 2


def naive_grid_conv(v, weight, bias, height, width, prefix, kpm=None):
    """Loop over positions and offsets: out[b, h, prefix + y*W + x, j] = bias + sum w * v at the neighbours."""
    b, heads, s, d = v.shape
    k = weight.shape[-1]
    out = torch.zeros_like(v)
    for y in range(height):
        for x in range(width):
            pos = prefix + y * width + x
            acc = bias.view(heads, d).expand(b, heads, d).clone()
            for dy in range(-(k // 2), k // 2 + 1):
                for dx in range(-(k // 2), k // 2 + 1):
                    yy, xx = y + dy, x + dx
                    if not (0 <= yy < height and 0 <= xx < width):
                        continue
                    src = prefix + yy * width + xx
                    val = v[:, :, src]
                    if kpm is not None:
                        val = val.masked_fill(kpm[:, src, None, None], 0.0)
                    w = weight[:, 0, dy + k // 2, dx + k // 2].view(heads, d)
                    acc = acc + w * val
            out[:, :, pos] = acc
    return out


def random_conv(k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 1, k, k, generator=g, dtype=torch.float64),
            torch.randn(E, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("prefix", [0, 2])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_convolution_matches_a_naive_loop(prefix, k):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(2, H, prefix + 12, E // H, generator=g, dtype=torch.float64)
    kpm = torch.zeros(2, prefix + 12, dtype=torch.bool)
    kpm[1, prefix + 8:] = True
    weight, bias = random_conv(k)
    got = LF.token_grid_conv(v, weight, bias, 3, 4, prefix, kpm)
    torch.testing.assert_close(got, naive_grid_conv(v, weight, bias, 3, 4, prefix, kpm), rtol=1e-12, atol=1e-12)
    assert got[:, :, :prefix].abs().sum() == 0  # class / register tokens get no local term
    v.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: LF.token_grid_conv(a, w, bias, 3, 4, prefix, kpm), (v, weight))


def module(mode, k=3, **kw):
    torch.manual_seed(0)
    m = LinearMultiheadAttention(E, H, mode=mode, dwc_kernel=k, batch_first=True, **modes.sized(mode, 40), **kw)
    m = m.double()
    with torch.no_grad():  # a trained local term, not its zero initialisation
        m.dwc_weight.copy_(random_conv(k)[0])
        m.dwc_bias.copy_(random_conv(k)[1])
    return m


def test_a_causal_only_method_refuses_the_local_term_when_built():
    for mode in modes.CAUSAL_ONLY:
        with pytest.raises(ValueError, match="dwc_kernel .* causal only"):
            LinearMultiheadAttention(E, H, mode=mode, dwc_kernel=3)


@pytest.mark.parametrize("mode", [m for m in modes.BUILT_IN if m not in modes.CAUSAL_ONLY])
def test_the_local_term_is_added_to_every_methods_output(mode):  # grid methods too: the grid below serves both
    m = module(mode)
    x = torch.randn(2, 13, E, dtype=torch.float64)
    grid = TokenGrid(3, 4, prefix=1)
    with_term, _ = m(x, x, x, token_grid=grid, need_weights=False)
    weight, bias = m.dwc_weight, m.dwc_bias
    m.dwc_weight, m.dwc_bias = None, None
    without, _ = m(x, x, x, need_weights=False, token_grid=grid)
    v = nn.functional.linear(x, m.in_proj_weight[2 * E:], m.in_proj_bias[2 * E:]).view(2, 13, H, E // H)
    local = naive_grid_conv(v.transpose(1, 2), weight, bias, 3, 4, 1).transpose(1, 2).reshape(2, 13, E)
    torch.testing.assert_close(with_term, without + m.out_proj(local) - m.out_proj.bias, rtol=1e-10, atol=1e-10)
    m.dwc_weight, m.dwc_bias = weight, bias
    with torch.no_grad():  # the sum then goes into the convolution's own output: the same numbers
        inference, _ = m(x, x, x, token_grid=grid, need_weights=False)
    torch.testing.assert_close(inference, with_term, rtol=1e-12, atol=1e-12)


# Linformer's projection weighs keys by their position in the sequence, and padding a 3 x 3 image to 4 x 5 moves
# every row: its outputs depend on the padded layout by construction (trailing padding is tested in
# test_linear_modes). Every method whose keys are interchangeable is checked.
@pytest.mark.parametrize("mode", [m for m in modes.LINEAR if linear_mha.method_class(m).sequence_length_option is None])
def test_padding_garbage_reaches_no_output_and_no_gradient(mode):
    """A padded batch: the valid outputs do not depend on what the padding holds nor on how much of it there is;
    padded inputs get zero gradient. (Self-attention: the padded positions are queries too, so NaN there would make
    their own outputs NaN, as in nn.MultiheadAttention; large garbage stands in for it.)"""
    m = module(mode)
    g = torch.Generator().manual_seed(3)
    valid = torch.randn(1, 3, 3, E, generator=g, dtype=torch.float64)  # a 3 x 3 image
    out_small, _ = m(valid.view(1, 9, E), valid.view(1, 9, E), valid.view(1, 9, E), token_grid=TokenGrid(3, 3))
    padded = 1e3 * torch.randn(1, 4, 5, E, generator=g, dtype=torch.float64)  # padded to 4 x 5 with garbage
    padded[:, :3, :3] = valid
    padded = padded.view(1, 20, E).requires_grad_()
    kpm = torch.ones(1, 4, 5, dtype=torch.bool)
    kpm[:, :3, :3] = False
    out, _ = m(padded, padded, padded, key_padding_mask=kpm.view(1, 20), token_grid=TokenGrid(4, 5))
    torch.testing.assert_close(out.view(1, 4, 5, E)[:, :3, :3], out_small.view(1, 3, 3, E), rtol=1e-10, atol=1e-10)
    out.view(1, 4, 5, E)[:, :3, :3].sum().backward()
    assert torch.all(padded.grad.view(1, 4, 5, E)[~(~kpm)] == 0) and torch.isfinite(padded.grad).all()
    assert m.dwc_weight.grad is not None and torch.isfinite(m.dwc_weight.grad).all()


def test_what_the_local_term_cannot_do_is_refused():
    m = module("kernel")
    x = torch.randn(2, 12, E, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs the token grid"):
        m(x, x, x)
    with pytest.raises(ValueError, match="no causal form"):
        m(x, x, x, is_causal=True, token_grid=TokenGrid(3, 4))
    with pytest.raises(ValueError, match="needs self-attention"):
        m(x[:, :5], x, x, token_grid=TokenGrid(3, 4))
    with pytest.raises(ValueError, match=r"grid is 3 x 3 with 0 prefix token\(s\), 9 tokens, but the values have 12"):
        m(x, x, x, token_grid=TokenGrid(3, 3))
    for bad in (2, 0, -1, 3.0, True):
        with pytest.raises(ValueError, match="dwc_kernel must be None or an odd positive int"):
            LinearMultiheadAttention(E, H, dwc_kernel=bad)
    with pytest.raises(ValueError, match="dwc_kernel must be"):
        patch(nn.Sequential(nn.Linear(2, 2)), "kernel", dwc_kernel=4)


def test_an_original_checkpoint_loads_and_the_term_starts_at_zero():
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    m = LinearMultiheadAttention(E, H, mode="kernel", dwc_kernel=3, batch_first=True)
    m.load_state_dict(mha.state_dict(), strict=True)
    x = torch.randn(1, 12, E)
    plain = LinearMultiheadAttention(E, H, mode="kernel", batch_first=True)
    plain.load_state_dict(mha.state_dict())
    torch.testing.assert_close(m(x, x, x, token_grid=TokenGrid(3, 4))[0], plain(x, x, x)[0])


def test_detr_transformer_feeds_its_grid_and_variable_image_sizes_stay_exact():
    """Our DETR (official-code layout) patched with a local term: a batch padded to its largest image gives each
    image the outputs it gets alone."""
    from linear_mha.integrations.detr.misc import NestedTensor
    from linear_mha.integrations.detr.position_encoding import PositionEmbeddingSine
    from linear_mha.integrations.detr.transformer import Transformer
    torch.manual_seed(0)
    model = Transformer(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=32,
                        dropout=0.0, return_intermediate_dec=True)
    wrapper = nn.Module()
    wrapper.transformer = model
    report = patch(wrapper, "focused", include=["transformer.encoder.layers.*.self_attn"], dwc_kernel=3)
    assert any("token grid" in note and "'transformer'" in note for note in report.notes)
    model = model.double().eval()
    for layer in model.encoder.layers:
        with torch.no_grad():
            layer.self_attn.dwc_weight.normal_(generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(1)
    query = torch.randn(3, 16, generator=g, dtype=torch.float64)
    pos_enc = PositionEmbeddingSine(8, normalize=True)
    alone = []
    for h, w in ((4, 6), (5, 3)):
        src = torch.randn(1, 16, h, w, generator=g, dtype=torch.float64)
        mask = torch.zeros(1, h, w, dtype=torch.bool)
        alone.append((src, model(src, mask, query, pos_enc(NestedTensor(src, mask)).double())[0]))
    batch = torch.full((2, 16, 5, 6), 7.0, dtype=torch.float64)
    mask = torch.ones(2, 5, 6, dtype=torch.bool)
    for i, (src, _) in enumerate(alone):
        batch[i, :, :src.shape[2], :src.shape[3]] = src[0]
        mask[i, :src.shape[2], :src.shape[3]] = False
    pos = pos_enc(NestedTensor(batch, mask)).double()
    hs, _ = model(batch, mask, query, pos)
    for i, (_, ref) in enumerate(alone):
        torch.testing.assert_close(hs[:, i], ref[:, 0], rtol=1e-9, atol=1e-9)
    unpatch(wrapper)
    assert not model._forward_pre_hooks  # the grid hook went with the linear modules


def test_timm_vit_leaves_class_and_register_tokens_out():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, reg_tokens=2, num_classes=3)
    report = patch(vit, "kernel", dwc_kernel=3)
    assert report.num_replaced == len(vit.blocks)
    attn = vit.blocks[0].attn
    seen = []
    composed, compiled = LF.token_grid_conv, native_maps.local_term

    def spy(v, weight, bias, height, width, prefix, kpm=None):  # torch's convolution
        seen.append((height, width, prefix, v.shape[2]))
        return composed(v, weight, bias, height, width, prefix, kpm)

    def compiled_spy(out, v, weight, bias, height, width, prefix, kpm, **kw):  # the compiled one (float32 CPU)
        seen.append((height, width, prefix, v.shape[2]))
        return compiled(out, v, weight, bias, height, width, prefix, kpm, **kw)
    linear_mha.local_term.token_grid_conv, native_maps.local_term = spy, compiled_spy
    try:
        vit(torch.randn(2, 3, 64, 64))
    finally:
        linear_mha.local_term.token_grid_conv, native_maps.local_term = composed, compiled
    assert seen and all(s == (4, 4, 3, 19) for s in seen)  # 4 x 4 patches after the class + 2 register tokens
    assert attn.dwc_weight.shape == (192, 1, 3, 3)


def test_torchvision_vit_reads_its_patch_grid():
    from torchvision.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    vit = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                            num_classes=3)
    patch(vit, "efficient", dwc_kernel=3)
    tracker = vit.encoder.layers[0].self_attention.__dict__["token_grid_source"]
    vit(torch.randn(2, 3, 32, 32))
    assert tracker.grid == TokenGrid(4, 4, prefix=1)


def test_a_copied_or_pickled_model_reads_its_own_images_grid():
    # The tracker is the hook itself, not a closure over it: a deepcopy (an EMA model) gives the copy's patch
    # convolution a hook into the copy's tracker; a closure would keep feeding the original's, so the copy had no
    # grid, or kept the one it was copied with (3 x 4 and 4 x 3 patches are both 12 tokens). torch.save of the
    # whole model pickles the trackers and their readers.
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                            embed_dim=32, num_heads=2, num_classes=0, dynamic_img_size=True).eval()
    patch(vit, "kernel", dwc_kernel=3)
    with torch.no_grad():
        vit.blocks[0].attn.dwc_weight.normal_()  # a term that starts at zero would hide a wrong grid
    wide, tall = torch.randn(1, 3, 24, 32), torch.randn(1, 3, 32, 24)
    vit.forward_features(wide)
    buffer = io.BytesIO()
    torch.save(vit, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(vit), torch.load(buffer, weights_only=False)):
        for x in (tall, wide):
            torch.testing.assert_close(copied.forward_features(x), vit.forward_features(x))
            assert copied.blocks[0].attn.__dict__["token_grid_source"].grid == TokenGrid(*(x.shape[-2] // 8,
                                                                                          x.shape[-1] // 8), 1)
    copy.deepcopy(vit).blocks[0].attn.__dict__["token_grid_source"].remove()  # the copy's hook, not the original's
    vit.forward_features(tall)
    assert vit.blocks[0].attn.__dict__["token_grid_source"].grid == TokenGrid(4, 3, 1)

def test_timm_set_input_size_swaps_the_patch_convolution_and_the_grid_follows():
    # set_input_size(patch_size=...) puts a new convolution in the patch embedding: the tracker moves its hook there
    # rather than keep the grid of the last image (4 x 4 patches of 8 px and 8 x 2 of 4 px are both 16 tokens).
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              embed_dim=32, num_heads=2, num_classes=0, dynamic_img_size=True).eval()
    vit = copy.deepcopy(plain)
    patch(vit, "kernel", dwc_kernel=3)
    with torch.no_grad():
        vit.blocks[0].attn.dwc_weight.normal_()
    vit.forward_features(torch.randn(1, 3, 32, 32))
    vit.set_input_size(patch_size=(4, 4))
    plain.set_input_size(patch_size=(4, 4))
    fresh = patch(plain, "kernel", dwc_kernel=3) and plain
    fresh.load_state_dict(vit.state_dict())
    x = torch.randn(1, 3, 32, 8)
    torch.testing.assert_close(vit.forward_features(x), fresh.forward_features(x))
    assert vit.blocks[0].attn.__dict__["token_grid_source"].grid == TokenGrid(8, 2, 1)
    buffer = io.BytesIO()  # the replaced convolution's hook is let go of, so no dead handle is copied or pickled
    torch.save(vit, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(vit), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(copied.forward_features(x), fresh.forward_features(x))

def test_a_model_without_a_known_grid_names_grid_source():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 16, batch_first=True), 1,
                                  enable_nested_tensor=False)
    with pytest.raises(ValueError, match="grid_source="):
        patch(model, "kernel", dwc_kernel=3)

    class ConvThenEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, E, 4, stride=4)
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 16, batch_first=True), 1,
                                                 enable_nested_tensor=False)

        def forward(self, image):
            return self.encoder(self.stem(image).flatten(2).transpose(1, 2))

    model = ConvThenEncoder()
    patch(model, "kernel", dwc_kernel=3, grid_source="stem", grid_stride=4)  # the image, 4 px per token
    assert model(torch.randn(1, 3, 16, 20)).shape == (1, 20, E)
    assert model.encoder.layers[0].self_attn.__dict__["token_grid_source"].grid == TokenGrid(4, 5)
    unpatch(model)
    patch(model, "kernel", dwc_kernel=3, grid_source="stem")  # a wrong stride gives a clear error, not garbage
    with pytest.raises(ValueError, match="grid is 16 x 20 with 0 prefix token"):
        model(torch.randn(1, 3, 16, 20))
    # Modules built directly: track_token_grid attaches a grid to every module with a local term.
    direct = nn.ModuleDict({"stem": nn.Conv2d(3, E, 4, stride=4), "attn": LinearMultiheadAttention(
        E, H, mode="kernel", dwc_kernel=3, batch_first=True)})
    tracker = linear_mha.track_token_grid(direct, "stem", stride=4)
    tokens = direct["stem"](torch.randn(1, 3, 8, 12)).flatten(2).transpose(1, 2)
    assert direct["attn"](tokens, tokens, tokens)[0].shape == (1, 6, E) and tracker.grid == TokenGrid(2, 3)


def test_vmap_over_the_queries_alone_gives_each_samples_output():
    """torch.func.vmap batching only the queries: attention's output is batched and the local term (from the keys'
    values) is not, so the sum cannot go into the local term's tensor in place."""
    torch.manual_seed(0)
    m = LinearMultiheadAttention(E, H, mode="kernel", dwc_kernel=3, batch_first=True).requires_grad_(False)
    with torch.no_grad():
        m.dwc_weight.normal_()
    kv, queries = torch.randn(2, 12, E), torch.randn(5, 2, 12, E)
    got = torch.func.vmap(lambda q: m(q, kv, kv, token_grid=TokenGrid(3, 4))[0])(queries)
    want = torch.stack([m(q, kv, kv, token_grid=TokenGrid(3, 4))[0] for q in queries])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
