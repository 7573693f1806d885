"""patched(): nn.MultiheadAttention construction yields LinearMultiheadAttention while active; the one-line import
replacement."""
import pytest
import torch
import torch.nn.modules.activation
import torch.nn.modules.transformer
from torch import nn
from torch.nn import MultiheadAttention  # bound at import time, as user model code does
from torchvision.models.vision_transformer import VisionTransformer

from linear_mha.attention import LinearMultiheadAttention
from linear_mha.patching import patched

TORCH_MHA = nn.MultiheadAttention


def _all_restored():
    return (nn.MultiheadAttention is TORCH_MHA and torch.nn.modules.activation.MultiheadAttention is TORCH_MHA
            and torch.nn.modules.transformer.MultiheadAttention is TORCH_MHA
            and globals()["MultiheadAttention"] is TORCH_MHA)


def test_every_spelling_builds_linear_and_is_restored():
    with patched(mode="kernel", feature_map="relu"):
        direct = nn.MultiheadAttention(8, 2, batch_first=True)
        spelled = torch.nn.modules.activation.MultiheadAttention(8, 2)
        imported = MultiheadAttention(8, 2)
        enc = nn.TransformerEncoderLayer(8, 2, 16)
        dec = nn.TransformerDecoderLayer(8, 2, 16)
        assert isinstance(TORCH_MHA(8, 2), TORCH_MHA)  # a reference to the real class is untouched
        assert not isinstance(direct, nn.MultiheadAttention)  # isinstance keeps meaning "a torch MHA"
    built = [direct, spelled, imported, enc.self_attn, dec.self_attn, dec.multihead_attn]
    assert all(type(m) is LinearMultiheadAttention and m.mode == "kernel" for m in built)
    assert direct.batch_first and _all_restored()
    assert type(nn.MultiheadAttention(8, 2)) is TORCH_MHA


def test_restored_when_the_block_raises_and_when_nested():
    with pytest.raises(RuntimeError, match="boom"):
        with patched(mode="taylor"):
            raise RuntimeError("boom")
    assert _all_restored()
    with patched(mode="taylor"):
        with patched(mode="efficient"):
            inner = nn.MultiheadAttention(8, 2)
        outer = nn.MultiheadAttention(8, 2)
    assert (inner.mode, outer.mode) == ("efficient", "taylor") and _all_restored()


def test_bad_options_raise_before_anything_is_rebound():
    with pytest.raises(ValueError, match="did you mean 'seq_len'"):
        with patched(mode="linformer", seqlen=10):
            pass
    with pytest.raises(ValueError, match="mode must be one of"):
        with patched(mode="fast"):
            pass
    assert _all_restored()


def _vit():
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32)


def test_model_built_inside_softmax_context_matches_the_original():
    # LinearMultiheadAttention creates and initialises its weights in nn.MultiheadAttention's order, so the same
    # seed gives the same model.
    torch.manual_seed(0)
    ref = _vit().eval()
    torch.manual_seed(0)
    with patched(mode="softmax"):
        lin = _vit().eval()
    assert sum(type(m) is LinearMultiheadAttention for m in lin.modules()) == 2
    ref_sd, lin_sd = ref.state_dict(), lin.state_dict()
    assert list(ref_sd) == list(lin_sd) and all(torch.equal(ref_sd[k], lin_sd[k]) for k in ref_sd)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-6)


def test_one_line_import_replacement():
    from linear_mha.attention import LinearMultiheadAttention as MultiheadAttention

    class Block(nn.Module):  # user code, unchanged but for the import
        def __init__(self):
            super().__init__()
            self.attn = MultiheadAttention(16, 2, batch_first=True, mode="linformer", seq_len=12, proj_k=4)

        def forward(self, x, pad):
            return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]

    block = Block()
    block.attn.load_state_dict(nn.MultiheadAttention(16, 2, batch_first=True).state_dict(), strict=True)
    x, pad = torch.randn(3, 12, 16), torch.zeros(3, 12, dtype=torch.bool)
    pad[:, 9:] = True
    out = block(x, pad)
    assert out.shape == (3, 12, 16) and torch.isfinite(out).all()
    torch.testing.assert_close(block(x.masked_fill(pad[..., None], 3.0), pad)[~pad], out[~pad])
