"""Fresh outputs of the compiled code get their pages faulted in at once (csrc/prefault.c, native_library.output): the
memory's contents never change, memory in use already is left alone, and the kernels' results do not depend on
it."""
import mmap

import pytest
import torch

import linear_mha.functional as LF
from linear_mha.functional import native, native_library

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


@needs_native
def test_populating_a_half_written_buffer_keeps_what_it_holds():
    """A fresh 8 MiB mapping whose first half was written: its last page is not resident, so the pages are faulted
    in, and the written half must come through unchanged and the rest read as the zeros fresh pages hold."""
    size = 8 * 1024 * 1024
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fresh, as torch's big outputs are
    buffer = torch.frombuffer(memory, dtype=torch.float32)
    half = buffer.numel() // 2
    buffer[:half] = torch.arange(half, dtype=torch.float32)
    if not native_library._lib().lm_prefault(buffer.data_ptr(), size, 2):
        pytest.skip("this OS refuses MADV_POPULATE_WRITE (before Linux 5.14, or a sandbox): nothing is populated")
    assert torch.equal(buffer[:half], torch.arange(half, dtype=torch.float32))
    assert not buffer[half:].any()
    del buffer
    memory.close()


@needs_native
def test_memory_in_use_is_left_alone():
    buffer = torch.ones(1024 * 1024)
    assert native_library._lib().lm_prefault(buffer.data_ptr(), buffer.numel() * 4, 2) == 0
    assert native_library._lib().lm_prefault(buffer.data_ptr(), 100, 2) == 0  # less than a whole page: nothing to do


@needs_native
@pytest.mark.parametrize("causal", [False, True])
def test_results_are_the_same_with_and_without_prefaulting(causal, monkeypatch):
    """Outputs above native.PREFAULT_BYTES (the output and the three input gradients) with and without it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4100, 64, generator=g) for _ in range(3))
    grad = torch.randn(1, 2, 4100, 64, generator=g)
    assert q.numel() * 4 >= native.PREFAULT_BYTES
    runs = []
    for prefault in (True, False):
        monkeypatch.setattr(native_library, "prefault_outputs", prefault)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = LF.kernel(*leaves, feature_map="elu", causal=causal)
        runs.append([out, *torch.autograd.grad(out, leaves, grad)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert "Kernel" in type(out.grad_fn).__name__
