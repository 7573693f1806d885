"""tools.cpu_allocator.keep_freed_memory: in a fresh glibc process it stops large blocks from being mmapped and unmapped
(glibc's own counters show it), and where it cannot apply it says why instead of pretending."""
import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


from linear_mha.tools import cpu_allocator

ROOT = Path(__file__).resolve().parents[1]

# In a child: glibc's counters of mmapped bytes (hblkhd), heap bytes in use (uordblks) and free heap bytes (fordblks)
# around a 64 MiB tensor's life. Differences of the heap's size (arena) are not used: where the heap already had free
# room it grows by less than the block.
CHILD = textwrap.dedent("""
    import ctypes, json, sys, torch
    from linear_mha.tools import cpu_allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    kept = cpu_allocator.keep_freed_memory() if sys.argv[1] == "keep" else None
    before = libc.mallinfo2()
    x = torch.ones(16 * 2 ** 20)  # 64 MiB, twice glibc's largest mmap threshold
    held = libc.mallinfo2()
    del x
    freed = libc.mallinfo2()
    # The same size straight from malloc, touched: bytes in use rise by the block wherever the heap had room.
    block = libc.malloc(64 << 20)
    assert block, "malloc(64 MiB) failed"
    ctypes.memset(block, 1, 64 << 20)
    own_held = libc.mallinfo2()
    libc.free(block)
    huge = libc.malloc(3 << 30)  # never touched, so it costs address space only
    assert huge, "malloc(3 GiB) failed"
    libc.free(huge)
    huge_freed = libc.mallinfo2()
    print(json.dumps(dict(kept=kept, mmapped_while_held=held.hblkhd - before.hblkhd,
                          own_mmapped_while_held=own_held.hblkhd - before.hblkhd,
                          heap_in_use_grew=own_held.uordblks - freed.uordblks,
                          free_in_heap_after_free=freed.fordblks,
                          free_in_heap_after_3gib_free=huge_freed.fordblks)))
""")


def _run_child(mode):
    env = cpu_allocator.plain_glibc_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _has_mallinfo2():
    try:
        return cpu_allocator.uses_glibc() and hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_blocks_come_from_the_heap_and_stay_there():
    block = 64 * 2 ** 20
    default = _run_child("default")  # the control: glibc's defaults map the block and unmap it on free
    assert default["mmapped_while_held"] >= block and default["free_in_heap_after_free"] < block
    kept = _run_child("keep")
    assert kept["kept"] is True
    assert kept["mmapped_while_held"] == 0 and kept["own_mmapped_while_held"] == 0
    assert kept["heap_in_use_grew"] >= block and default["own_mmapped_while_held"] >= block
    assert kept["free_in_heap_after_free"] >= block  # freed, and kept for the next call instead of unmapped
    # Kept however large: a trim threshold capped at 2 GiB (mallopt's int range) would give this back.
    assert kept["free_in_heap_after_3gib_free"] >= 3 << 30 and default["free_in_heap_after_3gib_free"] < block


@pytest.fixture
def unkept(monkeypatch):
    """This test process's malloc must not change: the paths under test must never reach mallopt."""
    monkeypatch.setattr(cpu_allocator, "_setting_made", False)

    def no_mallopt(*args, **kwargs):
        raise AssertionError("mallopt was reached")
    monkeypatch.setattr(cpu_allocator.ctypes, "CDLL", no_mallopt)


def test_without_glibc_it_changes_nothing_and_says_why(unkept, monkeypatch):
    monkeypatch.setattr(cpu_allocator, "uses_glibc", lambda: False)
    with pytest.warns(RuntimeWarning, match="does not allocate with glibc's malloc"):
        assert cpu_allocator.keep_freed_memory() is False
    assert not cpu_allocator.freed_memory_kept()


def test_under_a_replacement_malloc_it_changes_nothing_and_names_it(unkept, monkeypatch):
    monkeypatch.setattr(cpu_allocator, "uses_glibc", lambda: True)
    monkeypatch.setattr(cpu_allocator, "replacement_mallocs", lambda: ["libtcmalloc_minimal.so.4"])
    with pytest.warns(RuntimeWarning, match="libtcmalloc_minimal.so.4, which keeps freed memory by itself"):
        assert cpu_allocator.keep_freed_memory() is False


def test_a_second_call_does_nothing_more(unkept, monkeypatch):
    monkeypatch.setattr(cpu_allocator, "_setting_made", True)
    assert cpu_allocator.keep_freed_memory() is True  # CDLL is booby-trapped: mallopt was not called again


def test_a_libc_that_cannot_be_loaded_changes_nothing_and_says_why(unkept, monkeypatch):
    monkeypatch.setattr(cpu_allocator, "uses_glibc", lambda: True)
    monkeypatch.setattr(cpu_allocator, "replacement_mallocs", lambda: [])

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(cpu_allocator.ctypes, "CDLL", missing)
    with pytest.warns(RuntimeWarning, match="could not be loaded .*GLIBC_TUNABLES"):
        assert cpu_allocator.keep_freed_memory() is False
    assert not cpu_allocator.freed_memory_kept()


def test_a_mallopt_that_refuses_is_an_error_naming_the_launch_time_setting(unkept, monkeypatch):
    monkeypatch.setattr(cpu_allocator, "uses_glibc", lambda: True)
    monkeypatch.setattr(cpu_allocator, "replacement_mallocs", lambda: [])

    class RefusingLibc:
        def mallopt(self, param, value):
            return 0
    monkeypatch.setattr(cpu_allocator.ctypes, "CDLL", lambda name: RefusingLibc())
    monkeypatch.setattr(cpu_allocator.ctypes.util, "find_library", lambda name: "libc.so.6")
    with pytest.raises(RuntimeError, match="GLIBC_TUNABLES=glibc.malloc.mmap_max=0"):
        cpu_allocator.keep_freed_memory()
    assert not cpu_allocator.freed_memory_kept()


def test_the_benchmark_names_the_setting_and_refuses_a_flag_it_cannot_honour(tmp_path, monkeypatch):
    from linear_mha.tools import benchmark
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n")
    monkeypatch.setattr(cpu_allocator, "_setting_made", True)
    if cpu_allocator.uses_glibc():
        assert cpu_allocator.describe({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, str(maps)) == (
            "glibc malloc (glibc.malloc.mmap_max=0, tools.cpu_allocator.keep_freed_memory())")
    monkeypatch.setattr(benchmark, "keep_freed_memory", lambda: False)
    with pytest.raises(SystemExit, match="--keep-freed-memory"):
        benchmark.main(["--quick", "--keep-freed-memory", "--json", str(tmp_path / "r.json")])
