"""Causal LMs never see the future (float64): perturbing token t leaves every logit before t unchanged, for every
head type and option; and the perturbation does reach positions >= t (so the check is not vacuous)."""
import pytest
import torch

from linear_mha.lm import LinearAttentionTransformerLM
from lm_checks import assert_causal

N, V = 32, 16

CONFIGS = {
    "global": dict(),
    "local": dict(n_local_attn_heads=4, local_attn_window_size=8),
    "mixed_per_layer": dict(n_local_attn_heads=(2, 1), local_attn_window_size=8),
    "blindspot": dict(blindspot_size=4),
    "gate": dict(attn_gate=True),
    "conv": dict(local_conv=True),
    "short_conv": dict(short_conv=4),
    "head_norm": dict(head_norm=True),
    "shift": dict(shift_tokens=True),
    "axial": dict(attend_axially=True, local_attn_window_size=8),
    "reversible": dict(reversible=True),
    "rotary": dict(use_rotary_emb=True),
    "one_kv_head": dict(one_kv_head=True, n_local_attn_heads=1, local_attn_window_size=8),
    "all": dict(n_local_attn_heads=2, local_attn_window_size=8, blindspot_size=2, attn_gate=True, local_conv=True,
                short_conv=2, head_norm=True, shift_tokens=True, attend_axially=True, reversible=True,
                use_rotary_emb=True, ff_glu=True, ff_chunks=3, emb_dim=16),
}


def tiny_lm(**kwargs):
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, causal=True, **kwargs).double().eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("masked", [False, True])
def test_perturbing_a_token_changes_no_earlier_logit(name, masked):
    model = tiny_lm(**CONFIGS[name])
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, N), generator=g)
    mask = None
    if masked:
        mask = torch.rand(2, N, generator=g) > 0.3
    assert_causal(model, x, V, (0, 13, N - 1), name, input_mask=mask)
