"""Patched transformers models with any cache a user passes or asks for, a save / reload round trip, and a switch
back to transformers' own attention: the cases transformers' own model tests found (issue 58)."""
import json

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

from hf_models import build, inputs  # noqa: E402
from linear_mha import method_class, patch  # noqa: E402
from linear_mha.patching.hf_generation import cache_keyword  # noqa: E402

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=4)
MODES = ["softmax", "kernel", "taylor"]


def patched(mode, family="llama"):
    model = build(family)
    patch(model, mode)
    return model


def ids(padded=False):
    return inputs("llama", padded=padded, length=6)


@pytest.mark.parametrize("mode", MODES)
def test_a_static_cache_gives_the_logits_of_a_full_forward(mode):
    """Its empty slots are not keys, and its queries sit at the cache position, not at the end of the slots (the
    positions of a StaticCache's keys did not say so: up to 0.13 off in logits, softmax mode too)."""
    model, x = patched(mode), ids()["input_ids"]
    with torch.no_grad():
        full = model(x).logits
        for cache in (StaticCache(config=model.config, max_cache_len=16), DynamicCache()):
            kwargs = {cache_keyword(model): cache, "use_cache": True}
            parts = [model(x[:, :4], **kwargs).logits, model(x[:, 4:5], **kwargs).logits,
                     model(x[:, 5:], **kwargs).logits]
            torch.testing.assert_close(torch.cat(parts, dim=1), full)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_any_cache_gives_the_tokens_of_transformers_dynamic_cache(mode, padded):
    """A StaticCache passed in, cache_implementation='static' asked for (once refused: the linear cache was given too),
    and no cache (linear_mha's own state) all decode what a DynamicCache decodes."""
    model, x = patched(mode), ids(padded)
    key = cache_keyword(model)
    with torch.no_grad():
        expected = model.generate(**x, **GREEDY, **{key: DynamicCache()})
        static = model.generate(**x, **GREEDY, **{key: StaticCache(config=model.config, max_cache_len=16)})
        asked = model.generate(**x, **GREEDY, cache_implementation="static")
        own = model.generate(**x, **GREEDY)
    for got in (static, asked, own):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", ["softmax", "kernel"])
def test_a_saved_and_reloaded_model_patched_again_runs_the_linear_method(mode, tmp_path):
    """The documented reload (from_pretrained, patch, load_state_dict): patch once left a private marker in
    config.json, after which the reloaded model silently kept running sdpa."""
    model, x = patched(mode), ids()["input_ids"]
    model.save_pretrained(tmp_path)
    assert not [key for key in json.loads((tmp_path / "config.json").read_text()) if "linear_mha" in key]
    reloaded = type(model).from_pretrained(tmp_path).double().eval()
    patch(reloaded, mode)
    reloaded.load_state_dict(model.state_dict())
    assert reloaded.config._attn_implementation == "linear_mha"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits)
    if not method_class(mode).exact:  # and it is the linear model, not the original one
        original = build("llama")
        assert not torch.allclose(reloaded(x).logits, original(x).logits)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_switching_a_patched_model_back_to_transformers_attention_gives_generate_back(implementation):
    """set_attn_implementation (or config._attn_implementation, as assisted decoding sets its assistant's) after
    patch: generate raised as linear_mha's cache handed keys to an attention call that did not take them."""
    model, original, x = patched("kernel"), build("llama"), ids()  # (transformers' eager gives NaN on left padding)
    model.set_attn_implementation(implementation)
    original.set_attn_implementation(implementation)
    with torch.no_grad():
        assert torch.equal(model.generate(**x, **GREEDY), original.generate(**x, **GREEDY))
    model.config._attn_implementation = "linear_mha"  # and back: the linear method and its state again
    with torch.no_grad():
        linear = model.generate(**x, **GREEDY)
        assert torch.equal(linear, model.generate(**x, **GREEDY, **{cache_keyword(model): DynamicCache()}))


def test_softmax_keeps_transformers_cache_and_a_recurrent_method_its_state():
    """linear_mha's cache is for methods with a state of their own; softmax keeps every key anyway, so generate keeps
    transformers' cache (what it returns has the keys tests and users read: past_key_values.layers[i].keys)."""
    x = ids()
    with torch.no_grad():
        softmax = patched("softmax").generate(**x, **GREEDY, return_dict_in_generate=True)
        kernel = patched("kernel").generate(**x, **GREEDY, return_dict_in_generate=True)
    assert isinstance(softmax.past_key_values, DynamicCache) and softmax.past_key_values.layers[0].keys is not None
    assert type(kernel.past_key_values).__name__ == "LinearStateCache"


def test_packed_sequences_run_in_softmax_mode_and_are_refused_by_name_in_a_linear_one():
    """position_ids restarting inside a row (padding-free batches): transformers masks each sequence from the
    others, a pattern softmax applies as the original does and a linear method refuses."""
    a, b = torch.randint(1, 64, (1, 5)), torch.randint(1, 64, (1, 4))
    packed, positions = torch.cat([a, b], 1), torch.cat([torch.arange(5), torch.arange(4)])[None]
    model = patched("softmax")
    with torch.no_grad():
        separate = torch.cat([model(a).logits, model(b).logits], dim=1)
        torch.testing.assert_close(model(packed, position_ids=positions, use_cache=False).logits, separate)
        with pytest.raises(ValueError, match="other than causal or bidirectional"):
            patched("kernel")(packed, position_ids=positions, use_cache=False)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"), reason="needs the dynamo of torch >= 2.6")
@pytest.mark.parametrize("mode", ["softmax", "kernel"])
def test_compiled_generate_with_a_static_cache_compiles_once(mode):
    """generate() makes the mask once per step for a static cache and hands it back to the compiled forward: the
    2-D mask inside grew every step, and torch.compile recompiled the forward at each token."""
    from transformers.generation import CompileConfig
    model, x = patched(mode), ids(padded=True)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    config._compile_all_devices = True  # generate compiles on CUDA only, unless told
    with torch.no_grad():
        expected = model.generate(**x, **GREEDY, cache_implementation="static")
        torch._dynamo.reset()
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = model.generate(**x, **GREEDY, cache_implementation="static", compile_config=config)
    assert hasattr(model, "_compiled_call") and torch.equal(got, expected)
