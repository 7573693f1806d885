"""Names that moved keep working, with a warning that says the new one (deprecated, never broken)."""
import pytest
import torch

import linear_mha
import linear_mha.functional as LF


def test_functional_efficient_is_efficient_attention_with_a_warning():
    q, k, v = (torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    with pytest.warns(DeprecationWarning, match="efficient_attention"):
        old = LF.efficient(q, k, v, key_padding_mask=kpm)
    assert torch.equal(old, LF.efficient_attention(q, k, v, key_padding_mask=kpm))


def test_modes_is_available_methods_with_a_warning():
    with pytest.warns(DeprecationWarning, match="available_methods"):
        assert linear_mha.MODES == linear_mha.available_methods()


def test_keep_freed_memory_says_where_it_went():
    with pytest.raises(AttributeError, match="tools.cpu_allocator"):
        linear_mha.keep_freed_memory
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        linear_mha.nothing_here
