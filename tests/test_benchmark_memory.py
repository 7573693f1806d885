"""tools/measure.py's fresh-process memory measurement (a known allocation, an output the compiled code's cache
keeps, a child environment that keeps no freed memory) and tools/cpu_allocator.py's name for the allocator."""
import json

import pytest

from linear_mha.functional import native
from linear_mha.tools import cpu_allocator
from linear_mha.tools import measure


def test_allocator_is_named_from_the_mapped_libraries_and_the_environment(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n7f02-7f03 rw-p 00000000 00:00 0\n")
    glibc = cpu_allocator.describe({}, str(maps))
    assert glibc in ("glibc malloc (defaults)", "platform malloc")
    env = {"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.trim_threshold=9:glibc.malloc.mmap_max=0",
           "MALLOC_ARENA_MAX": "2", "THP_MEM_ALLOC_ENABLE": "1"}
    if glibc.startswith("glibc"):  # sorted, so the same settings in another order compare equal
        assert cpu_allocator.describe(env, str(maps)) == (
            "glibc malloc (glibc.malloc.mmap_max=0, glibc.malloc.trim_threshold=9, MALLOC_ARENA_MAX=2), "
            "THP_MEM_ALLOC_ENABLE=1")
    # A path with spaces, a library replaced on disk while mapped, and the library's own settings.
    maps.write_text(maps.read_text() + "7f04-7f05 r-xp 00000000 08:01 13 /opt/my libs/libtcmalloc_minimal.so.4 "
                                       "(deleted)\n")
    assert cpu_allocator.describe({"TCMALLOC_RELEASE_RATE": "0", "MALLOC_ARENA_MAX": "2"}, str(maps)) == (
        "libtcmalloc_minimal.so.4, TCMALLOC_RELEASE_RATE=0")
    # No maps to read: LD_PRELOAD names the library; MALLOC_CONF is jemalloc's, not glibc's.
    missing = str(tmp_path / "no_maps")
    assert cpu_allocator.describe({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2", "MALLOC_CONF": "retain:true"},
                                  missing) == "libjemalloc.so.2, MALLOC_CONF=retain:true"


def test_memory_child_drops_settings_that_keep_freed_memory():
    env = measure.memory_child_environment({
        "PATH": "/bin", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2:/opt/libiomp5.so", "MALLOC_CONF": "retain:true",
        "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.rtld.nns=2", "THP_MEM_ALLOC_ENABLE": "1",
        "TCMALLOC_RELEASE_RATE": "0", "MALLOC_ARENA_MAX": "1"})
    assert env == {"PATH": "/bin", "LD_PRELOAD": "/opt/libiomp5.so", "GLIBC_TUNABLES": "glibc.rtld.nns=2",
                   "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
                   "PYTHONPATH": str(measure.REPO_ROOT)}  # the child runs `python -m linear_mha.tools.measure`
    assert "LD_PRELOAD" not in measure.memory_child_environment({"LD_PRELOAD": "libtcmalloc.so"})


def test_a_memory_child_that_keeps_a_malloc_library_reports_an_error(monkeypatch):
    """A library the environment cannot remove (/etc/ld.so.preload, linked in) must not yield a number."""
    real_run = measure.subprocess.run

    def run_reporting_tcmalloc(cmd, **kwargs):
        proc = real_run(cmd, **kwargs)
        measured = dict(json.loads(proc.stdout.strip().splitlines()[-1]), allocator="libtcmalloc.so.4")
        proc.stdout = json.dumps(measured) + "\n"
        return proc
    monkeypatch.setattr(measure.subprocess, "run", run_reporting_tcmalloc)
    mem = measure.peak_extra_memory({"builder": "linear_mha.tools.measure:allocation_case", "kwargs": {"mib": 8}})
    assert "libtcmalloc.so.4" in mem["error"] and "extra_bytes" not in mem


@pytest.mark.parametrize("keep_freed", [False, True])
def test_fresh_process_memory_sees_a_known_allocation(keep_freed, monkeypatch):
    if keep_freed:  # the README's faster glibc setting keeps freed blocks; the child must not inherit it
        monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295")
    mem = measure.peak_extra_memory({"builder": "linear_mha.tools.measure:allocation_case", "kwargs": {"mib": 200}})
    assert "error" not in mem, mem
    assert 150 * measure.MIB <= mem["extra_bytes"] <= 260 * measure.MIB, mem
    assert measure.peak_extra_memory({"builder": "measure:no_such_case"})["error"].startswith("memory child failed")


def test_fresh_process_memory_sees_an_output_the_kernels_cache_keeps():
    """The warm-up's freed output stays in the compiled code's cache: unless the child empties it, the measured
    call reuses it and the block's memory is counted in the baseline, not as the call's."""
    if not native.available():
        pytest.skip(f"kernels not built: {native.build_error()}")
    mem = measure.peak_extra_memory({"builder": "linear_mha.tools.measure:allocation_case", "kwargs": {"mib": 64, "cached": True}})
    assert "error" not in mem, mem
    assert 48 * measure.MIB <= mem["extra_bytes"] <= 100 * measure.MIB, mem
