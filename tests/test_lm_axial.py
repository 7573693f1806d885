"""Axial positional embedding: used, small (O(sqrt(N) * dim)), causal, and incremental decoding still exact."""
import math

import pytest
import torch

from linear_mha.lm import LinearAttentionTransformerLM
from linear_mha.lm.axial import AxialPositionalEmbedding, near_square_shape
from lm_checks import assert_causal, assert_steps_equal_full

V, N, DIM = 16, 24, 32


def tiny_lm(max_seq_len=64, **kw):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(V, DIM, 2, max_seq_len, heads=4, dim_head=8, causal=True,
                                        **kw).double().eval()


def tokens(n=N, seed=1):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 7, 64, 97, 1000, 4096])
def test_default_shape_is_near_square_and_covers(n):
    rows, cols = near_square_shape(n)
    assert rows * cols >= n
    assert max(rows, cols) <= math.isqrt(n - 1) + 1 if n > 1 else rows == cols == 1


def test_axial_changes_output_and_is_the_sum_of_two_tables():
    x = tokens()
    absolute, axial = tiny_lm(), tiny_lm(use_axial_pos_emb=True)
    assert isinstance(axial.pos_emb, AxialPositionalEmbedding)
    out = axial(x)
    assert not torch.allclose(out, absolute(x))
    # Zeroing the axial tables must change the logits: the embedding is really added.
    with torch.no_grad():
        axial.pos_emb.rows.zero_()
        axial.pos_emb.cols.zero_()
    assert (axial(x) - out).abs().max() > 1e-6
    emb = AxialPositionalEmbedding(4, 12, (3, 4)).double()
    p = torch.arange(12)
    torch.testing.assert_close(emb(p), emb.rows[p // 4] + emb.cols[p % 4])


@pytest.mark.parametrize("max_seq_len", [256, 4096])
def test_parameter_count_is_sqrt_n_times_dim(max_seq_len):
    absolute = tiny_lm(max_seq_len)
    axial = tiny_lm(max_seq_len, use_axial_pos_emb=True)
    rows, cols = axial.pos_emb.shape
    assert sum(p.numel() for p in axial.pos_emb.parameters()) == (rows + cols) * DIM
    assert rows + cols <= 2 * (math.isqrt(max_seq_len) + 1)
    diff = sum(p.numel() for p in absolute.parameters()) - sum(p.numel() for p in axial.parameters())
    assert diff == (max_seq_len - rows - cols) * DIM


def test_explicit_shape_and_emb_dim():
    m = tiny_lm(use_axial_pos_emb=True, axial_position_shape=(4, 16), emb_dim=8)
    assert m.pos_emb.shape == (4, 16) and m.pos_emb.rows.shape == (4, 8) and m.pos_emb.cols.shape == (16, 8)
    assert m(tokens()).shape == (2, N, V)


def test_causality_holds():
    model = tiny_lm(use_axial_pos_emb=True, n_local_attn_heads=1, local_attn_window_size=4)
    assert_causal(model, tokens(), V, (0, 9, N - 1), "axial")


def test_incremental_decoding_equals_full_forward():
    model = tiny_lm(use_axial_pos_emb=True, axial_position_shape=(8, 8), n_local_attn_heads=2,
                    local_attn_window_size=4, shift_tokens=True)
    assert_steps_equal_full(model, tokens())


def test_bad_options_raise_clear_errors():
    with pytest.raises(ValueError, match="use_rotary_emb"):
        tiny_lm(use_axial_pos_emb=True, use_rotary_emb=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_lm(use_axial_pos_emb=True, axial_position_shape=(4, 4))
    with pytest.raises(ValueError, match="axial_position_shape"):
        tiny_lm(use_axial_pos_emb=True, axial_position_shape=(8, 0))
    with pytest.raises(ValueError, match="use_axial_pos_emb"):
        tiny_lm(axial_position_shape=(8, 8))
