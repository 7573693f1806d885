"""Incremental decoding equals the full forward (float64), constant-size caches, sampling filters, the wrapper."""
import pytest
import torch
import torch.nn.functional as F

from linear_mha.lm import AutoregressiveWrapper, LinearAttentionTransformerLM, top_k_filter, top_p_filter
from lm_checks import DECODING_CONFIGS, tiny_lm, assert_steps_equal_full

V, N = 16, 20

CONFIGS = {**DECODING_CONFIGS, "emb_dim": dict(emb_dim=8, ff_chunks=2)}


def tokens(n=N, seed=1):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_step_logits_equal_full_forward(name):
    model = tiny_lm(**CONFIGS[name])
    x = tokens()
    mask = torch.rand(2, N, generator=torch.Generator().manual_seed(2)) > 0.25
    for m in (None, mask):
        assert_steps_equal_full(model, x, m)


@pytest.mark.parametrize("options", [dict(), dict(head_norm=True, short_conv=3)])
def test_decoder_with_context_steps_equal_full_forward(options):
    torch.manual_seed(0)
    dec = LinearAttentionTransformerLM(V, 32, 2, 64, heads=4, dim_head=8, causal=True, receives_context=True,
                                       n_local_attn_heads=1, local_attn_window_size=4, **options).double().eval()
    x, ctx = tokens(), torch.randn(2, 7, 32, dtype=torch.float64)
    cmask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    full = dec(x, context=ctx, context_mask=cmask)
    cache = {}
    steps = torch.stack([dec.step(x[:, t], cache, context=ctx, context_mask=cmask) for t in range(N)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)


def _cache_tensors(obj):
    """Every tensor the decoding cache holds, however nested in dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for value in values:
        yield from _cache_tensors(value)


def _cache_numel(cache):
    return sum(t.numel() for t in _cache_tensors(cache))


def test_decoding_state_does_not_grow_with_context():
    model = tiny_lm(**CONFIGS["everything"])
    x = tokens(n=30)
    cache, sizes = {}, {}
    for t in range(30):
        model.step(x[:, t], cache)
        sizes[t] = _cache_numel(cache)
    # Every piece of state exists after a few windows; from then on the cache holds a constant number of values.
    assert sizes[10] == sizes[29] > 0


def _cache_bytes(cache):
    """Bytes of the distinct storages the cache keeps alive: a slice kept as a view holds all of its base."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _cache_tensors(cache)}
    return sum(storages.values())


@pytest.mark.parametrize("name", ["everything", "delta_block"])
def test_a_long_prompt_leaves_a_decoding_state_of_the_same_size_as_a_short_one(name):
    model = tiny_lm(**CONFIGS[name])
    sizes = []
    for prompt_len in (12, 48):
        cache = {}
        model.prefill(tokens(n=prompt_len), cache)
        sizes.append(_cache_bytes(cache))
    assert sizes[0] == sizes[1] > 0


def test_greedy_generate_matches_rerunning_the_full_model():
    model = tiny_lm(n_local_attn_heads=2, local_attn_window_size=4, shift_tokens=True)
    wrapper = AutoregressiveWrapper(model)
    prompt = tokens(n=5)
    out = wrapper.generate(prompt, 20, temperature=0)
    seq = prompt
    for _ in range(20):
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq[:, 5:])


def test_generate_sampling_eos_and_limits():
    model = tiny_lm()
    wrapper = AutoregressiveWrapper(model, pad_value=0)
    g = torch.Generator().manual_seed(0)
    out = wrapper.generate(tokens(n=3)[0], 10, temperature=1.0, top_k=3, top_p=0.9, generator=g)
    assert out.shape == (10,)
    greedy = wrapper.generate(tokens(n=3), 10, temperature=0)
    eos = int(greedy[0, 2])
    stopped = wrapper.generate(tokens(n=3), 10, temperature=0, eos_token=eos)
    first = int((greedy[0] == eos).nonzero()[0])
    assert torch.equal(stopped[0, :first + 1], greedy[0, :first + 1])
    assert (stopped[0, first + 1:] == 0).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        wrapper.generate(tokens(n=60), 10)
    with pytest.raises(ValueError, match="causal"):
        AutoregressiveWrapper(LinearAttentionTransformerLM(V, 32, 1, 64, heads=4, dim_head=8))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()
    assert kept(0.7) == [True, True, False, False]
    assert kept(0.85) == [True, True, True, False]
    assert kept(0.4) == [True, False, False, False]
    assert kept(1.0) == [True] * 4
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(top_p_filter(shuffled, 0.7))[0].tolist() == [False, True, False, True]
    assert torch.isfinite(top_k_filter(shuffled, 2))[0].tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(logits, 0.0)


def test_wrapper_loss_is_shifted_cross_entropy_over_every_token():
    model = tiny_lm()
    wrapper = AutoregressiveWrapper(model)  # the original's default: token 0 is a token like any other
    x = tokens()
    x[:, 5] = 0
    expected = F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:])
    torch.testing.assert_close(wrapper(x, return_loss=True), expected)
    ignoring = AutoregressiveWrapper(model, ignore_index=0)
    expected = F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:], ignore_index=0)
    torch.testing.assert_close(ignoring(x, return_loss=True), expected)


def test_wrapper_loss_leaves_out_the_targets_input_mask_marks_as_padding():
    model = tiny_lm()
    wrapper = AutoregressiveWrapper(model)
    x = tokens()
    padded = torch.cat([x, torch.zeros(2, 6, dtype=x.dtype)], dim=1)
    mask = torch.cat([torch.ones(2, N, dtype=torch.bool), torch.zeros(2, 6, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(wrapper(padded, return_loss=True, input_mask=mask), wrapper(x, return_loss=True))


def test_generate_checks_its_arguments_and_restores_training_mode():
    model = tiny_lm().train()
    wrapper = AutoregressiveWrapper(model)
    prompt = tokens(n=3)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="length"):
            wrapper.generate(prompt, bad)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            wrapper.generate(prompt, 2, temperature=bad)
    with pytest.raises(ValueError, match="top_k"):
        wrapper.generate(prompt, 2, temperature=0, top_k=0)  # checked even where greedy decoding ignores it
    with pytest.raises(ValueError, match="top_p"):
        wrapper.generate(prompt, 2, temperature=0, top_p=1.5)
    assert model.training

    def failing_step(*args, **kwargs):
        raise RuntimeError("a step failed")
    model.step = failing_step
    with pytest.raises(RuntimeError, match="a step failed"):
        wrapper.generate(prompt, 3, temperature=0, prefill=False)
    assert model.training  # dropout must not stay off for the rest of training
