"""The compiled kernels' large outputs are kept between calls (csrc/output_cache.c, output_cache.py): a block comes
back only when torch frees its last view, what is kept stays under the limit (the longest unused given back
first), and the kernels' results do not depend on what a reused block held before."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import linear_mha.functional as LF
import modes
from linear_mha.functional import native, output_cache
from linear_mha.functional.packed_heads import split_heads

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")
MIB = 1 << 20


@pytest.fixture
def cache():
    """An empty cache with room for 64 MiB, the setting restored afterwards."""
    previous = output_cache.set_limit(64 * MIB)
    output_cache.empty()
    yield output_cache
    output_cache.set_limit(previous)


def block(mib: float) -> torch.Tensor:
    out = output_cache.take(torch.float32, (int(mib * MIB) // 4,))
    assert out is not None, "the cache handed out nothing"
    return out


@needs_native
def test_a_freed_block_is_served_again(cache):
    first = block(2)
    address = first.data_ptr()
    before = cache.stats()
    del first
    assert cache.stats()["kept_bytes"] == 2 * MIB
    again = block(2)
    assert again.data_ptr() == address
    assert cache.stats()["hits"] == before["hits"] + 1 and cache.stats()["kept_bytes"] == 0


@needs_native
def test_a_block_still_seen_through_a_view_is_not_reused(cache):
    """The block must wait for its storage to die, not for the tensor that was handed out."""
    out = block(2)
    out.fill_(7.0)
    view = out[:10]
    address = out.data_ptr()
    del out
    assert cache.stats()["kept_bytes"] == 0
    other = block(2)
    assert other.data_ptr() != address
    other.fill_(-1.0)
    assert torch.equal(view, torch.full((10,), 7.0))
    del view
    assert cache.stats()["kept_bytes"] == 2 * MIB


@needs_native
def test_the_limit_gives_back_the_longest_unused_first(cache):
    cache.set_limit(5 * MIB)
    blocks = [block(2) for _ in range(3)]
    addresses = [b.data_ptr() for b in blocks]
    for _ in range(3):
        blocks.pop(0)  # freed oldest first: the first one freed is the one given back
    assert cache.stats()["kept_bytes"] == 4 * MIB
    hits = cache.stats()["hits"]
    held = [block(2), block(2)]
    assert {t.data_ptr() for t in held} == set(addresses[1:])
    assert cache.stats()["hits"] == hits + 2
    del held
    big = block(6)  # larger than the limit: given back to the system when freed, and it pushes nothing out
    del big
    assert cache.stats()["kept_bytes"] == 4 * MIB


@needs_native
def test_a_block_serves_requests_up_to_an_eighth_smaller(cache):
    address = block(8).data_ptr()  # freed at once
    misses = cache.stats()["misses"]
    too_small = block(4)  # would pin twice its size
    too_big = block(9)
    assert cache.stats()["misses"] == misses + 2
    del too_small, too_big
    near = block(7.5)
    assert near.data_ptr() == address and near.numel() * 4 == int(7.5 * MIB)


@needs_native
def test_a_limit_of_zero_turns_the_cache_off_and_empties_it(cache):
    kept = block(2)
    del kept
    assert cache.stats()["kept_bytes"] == 2 * MIB
    cache.set_limit(0)
    assert cache.stats()["kept_bytes"] == 0
    assert cache.take(torch.float32, (MIB,)) is None
    out = native.output(torch.empty(1), 1, MIB)  # the compiled code's outputs are then allocated as usual
    assert out.shape == (1, MIB) and out.untyped_storage().resizable()


@needs_native
def test_small_outputs_are_not_cached(cache):
    assert output_cache.take(torch.float32, (output_cache.MIN_BYTES // 4 - 1,)) is None


def test_a_bad_limit_names_the_setting(monkeypatch):
    monkeypatch.setenv("LINEAR_MHA_OUTPUT_CACHE_MIB", "lots")
    with pytest.raises(ValueError, match="LINEAR_MHA_OUTPUT_CACHE_MIB='lots'"):
        output_cache._default_limit()
    monkeypatch.setenv("LINEAR_MHA_OUTPUT_CACHE_MIB", "-1")
    with pytest.raises(ValueError, match="negative"):
        output_cache._default_limit()
    monkeypatch.setenv("LINEAR_MHA_OUTPUT_CACHE_MIB", "1.5")
    assert output_cache._default_limit() == int(1.5 * MIB)
    with pytest.raises(ValueError, match="nbytes"):
        output_cache.set_limit(-5)


def _run_fresh(code: str, **env) -> subprocess.CompletedProcess:
    """code in a new Python whose environment has these settings (None: left out)."""
    merged = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={key: value for key, value in merged.items() if value is not None})


@needs_native
def test_a_fresh_process_keeps_freed_outputs_under_the_default_limit():
    """The limit reaches the C side on the first request, even when it was read before (here by stats())."""
    proc = _run_fresh("""
        import torch
        import linear_mha.functional as LF
        from linear_mha.functional import output_cache
        assert 0 < output_cache.stats()["limit_bytes"] <= output_cache.DEFAULT_LIMIT
        q = torch.randn(1, 2, 4100, 64)
        out = LF.kernel(q, q, q, feature_map="elu")
        size = out.numel() * 4
        del out
        print(output_cache.stats()["kept_bytes"] == size)
    """, LINEAR_MHA_OUTPUT_CACHE_MIB=None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


@needs_native
def test_a_bad_limit_is_an_error_of_the_call_not_of_the_build():
    proc = _run_fresh("""
        import torch
        import linear_mha.functional as LF
        from linear_mha.functional import native
        assert native.available(), native.build_error()
        q = torch.randn(1, 2, 4100, 64)
        try:
            LF.kernel(q, q, q, feature_map="elu")
        except ValueError as exc:
            print(exc)
    """, LINEAR_MHA_OUTPUT_CACHE_MIB="lots")
    assert proc.returncode == 0, proc.stderr
    assert "LINEAR_MHA_OUTPUT_CACHE_MIB='lots'" in proc.stdout


def _poison(cache, shapes):
    """Fill blocks of these shapes with NaN and hand them back, so the next outputs of those sizes reuse them."""
    held = [cache.take(torch.float32, shape) for shape in shapes]
    for t in held:
        t.fill_(float("nan"))
    return len(held)


LINEAR = {name: options for name, options in modes.VARIANTS.items() if not modes.method_of(options).exact}


@needs_native
@pytest.mark.parametrize("call", ["full", "causal", "masked", "split"])
def test_results_do_not_depend_on_what_a_reused_block_held(cache, call):
    """A kernel that leaves part of its output or gradients unwritten reads as zeros on fresh pages and would pass
    every other test; here, for every linear method of the registry whose outputs come from the cache, every output
    and gradient block was full of NaN before. "split": one projection's q, k, v, whose gradients are written side
    by side (packed_heads)."""
    g = torch.Generator().manual_seed(0)
    shape = (1, 2, 2100, 64)  # 1.03 MiB per tensor: above output_cache.MIN_BYTES
    q, k, v, grad = (torch.randn(*shape, generator=g) for _ in range(4))
    packed = torch.cat([t.transpose(1, 2).reshape(1, shape[2], -1) for t in (q, k, v)], -1)
    mask = torch.zeros(1, shape[2], dtype=torch.bool)
    mask[0, -300:] = True
    checked = []
    for name, options in LINEAR.items():
        method = modes.method_of(modes.sized_variant(options, shape[2]))
        if call == "causal" and not method.causal:
            continue
        state = modes.drawn_state(method, 2, 64)[0]
        masks = {"is_causal": call == "causal", "key_padding_mask": mask if call == "masked" else None}

        def run():
            leaves = [t.clone().requires_grad_() for t in ((packed,) if call == "split" else (q, k, v))]
            heads = split_heads(leaves[0], 3, 2) if call == "split" else leaves
            out = modes.attend_with(method, state, *heads, **masks)
            return [out.detach().clone(), *(t.clone() for t in torch.autograd.grad(out, leaves, grad))]

        cache.empty()
        before = cache.stats()
        reference = run()
        taken = sum(cache.stats()[key] - before[key] for key in ("hits", "misses"))  # its output and gradients
        if not taken:
            continue  # its outputs are PyTorch's
        _poison(cache, [shape] * 8 + [(1, shape[2], 3, 2, 64)] * 2)  # and the blocks of gradients side by side
        hits = cache.stats()["hits"]
        again = run()
        assert cache.stats()["hits"] >= hits + taken, f"{name}: the second run did not reuse the poisoned blocks"
        for a, b in zip(reference, again):
            assert torch.isfinite(b).all(), name
            assert torch.equal(a, b), name
        checked.append(name)
    assert len(checked) >= 4, checked


@needs_native
def test_cached_outputs_behave_as_tensors(cache, tmp_path):
    """What users do with an attention output or gradient: autograd, saving, numpy, in-place arithmetic."""
    q, k, v = (torch.randn(1, 2, 2100, 64, requires_grad=True) for _ in range(3))
    out = LF.kernel(q, k, v, feature_map="elu")
    assert cache.stats()["misses"] >= 1
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    q.grad.mul_(0.5)
    torch.save(out.detach(), tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt"), out.detach())
    assert out.detach().numpy().shape == (1, 2, 2100, 64)
