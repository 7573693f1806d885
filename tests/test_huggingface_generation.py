"""model.generate() on patched transformers causal LMs: linear_mha's cache keeps each method's fixed-size state, and
the tokens are those of transformers' own cache and of a full recompute, for left-padded batches and beam search."""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import modes  # noqa: E402
from hf_models import CAUSAL, build  # noqa: E402
from linear_mha import method_class, patch, unpatch  # noqa: E402
from linear_mha.patching import LinearStateCache  # noqa: E402
from linear_mha.patching.hf_generation import cache_keyword  # noqa: E402

CAUSAL_MODES = modes.CAUSAL_VARIANTS + [name for name in modes.ALL_CAUSAL if "window" in name]
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)  # no early stop: every row generates in full


def patched(family, name):
    options = dict(modes.ALL_VARIANTS[name])
    model = build(family)
    patch(model, options.pop("mode"), **options)
    return model


def cache(model, value):
    """generate's keyword for a cache in this transformers version (``cache`` in 5.2x, ``past_key_values`` before)."""
    return {cache_keyword(model): value}


def recompute(model, ids, steps):
    """Greedy decoding by a full forward per token, no cache at all."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("name", CAUSAL_MODES)
@pytest.mark.parametrize("family", CAUSAL)
def test_greedy_tokens_with_the_state_equal_a_kv_cache_and_a_full_recompute(family, name):
    model = patched(family, name)
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    tokens = model.generate(ids, max_new_tokens=10, **GREEDY)  # patch made linear_mha's cache the default
    assert torch.equal(tokens, model.generate(ids, max_new_tokens=10, **cache(model, DynamicCache()), **GREEDY))
    assert torch.equal(tokens, recompute(model, ids, 10))


def test_a_left_padded_batch_generates_what_each_row_generates_alone():
    model = patched("llama", "hedgehog_window")
    prompts = [torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([p.new_zeros(width - len(p)), p]) for p in prompts])
    mask = torch.stack([torch.cat([p.new_zeros(width - len(p)), torch.ones_like(p)]) for p in prompts])
    together = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)[:, -8:]
    for row, prompt in zip(together, prompts):
        assert torch.equal(row, model.generate(prompt[None], max_new_tokens=8, **GREEDY)[0, -8:])


def test_beam_search_reorders_the_state_as_transformers_reorders_its_cache():
    model = patched("gpt2", "hedgehog")
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, **GREEDY)
    assert torch.equal(model.generate(ids, **options), model.generate(ids, **cache(model, DynamicCache()), **options))


@pytest.mark.parametrize("name", [n for n in CAUSAL_MODES
                                  if method_class(modes.ALL_VARIANTS[n]["mode"]).recurrent])
def test_the_state_does_not_grow_with_the_tokens_generated(name):
    model = patched("llama", name)
    state = LinearStateCache()
    ids = model.generate(torch.randint(1, 64, (1, 4)), max_new_tokens=2, **cache(model, state), **GREEDY)
    first = state.nbytes()
    ids = model.generate(ids, max_new_tokens=40, **cache(model, state), **GREEDY)
    assert state.nbytes() == first > 0 and state.get_seq_length() == ids.shape[1] - 1
    kv_bytes = []  # transformers' own cache on the same tokens, for contrast: it grows with every one
    for steps in (2, 42):
        kv = DynamicCache()
        model.generate(ids[:, :4], max_new_tokens=steps, **cache(model, kv), **GREEDY)
        kv_bytes.append(sum(layer.keys.numel() + layer.values.numel() for layer in kv.layers))
    assert kv_bytes[1] > 5 * kv_bytes[0]


def test_assisted_decoding_keeps_transformers_cache_and_a_state_refuses_to_be_cropped():
    model, draft = patched("llama", "hedgehog"), build("llama", seed=1)
    ids = torch.randint(1, 64, (1, 5))
    assisted = model.generate(ids, max_new_tokens=6, assistant_model=draft, **GREEDY)
    assert torch.equal(assisted, model.generate(ids, max_new_tokens=6, **GREEDY))
    with pytest.raises(ValueError, match="cropped"):
        model.generate(ids, max_new_tokens=6, assistant_model=draft, **cache(model, LinearStateCache()), **GREEDY)


def test_unpatch_gives_generate_back():
    model = patched("llama", "hedgehog")
    assert "generate" in model.__dict__
    unpatch(model)
    assert "generate" not in model.__dict__
    ids = torch.randint(1, 64, (1, 5))
    assert torch.equal(model.generate(ids, max_new_tokens=4, **GREEDY), build("llama").generate(ids, max_new_tokens=4,
                                                                                              **GREEDY))


def test_a_model_converted_in_part_generates_with_transformers_cache():
    """Layers left on softmax need their keys back every step, which a state does not keep: generate then keeps
    transformers' own cache (and the tokens are those of a full recompute)."""
    model = build("llama")
    patch(model, "hedgehog", include=["model.layers.0.*"])
    assert "generate" not in model.__dict__
    ids = torch.randint(1, 64, (1, 5))
    assert torch.equal(model.generate(ids, max_new_tokens=6, **GREEDY), recompute(model, ids, 6))
