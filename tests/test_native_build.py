"""Building and loading the compiled CPU code (functional/native_build.py, native_library.py): in use wherever a
compiler exists, a failed build warns once and falls back to PyTorch ops, an unwritable home builds in the temporary
folder, the wheel ships every source, a build without OpenMP leaves threaded sequences to torch, and a cache folder
or library others could have written is never loaded from."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from linear_mha.functional import native, native_build, native_library

needs_native = pytest.mark.skipif(not native.available(), reason=f"kernels not built: {native.build_error()}")


def test_kernels_build_where_a_compiler_exists():
    # Guards the skips below: with a C compiler on the machine (as on CI) the compiled code must be in use.
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    assert native.available(), native.build_error()

def test_a_failed_build_warns_once_and_falls_back(tmp_path):
    script = textwrap.dedent("""
        import warnings, torch
        import linear_mha.functional as LF
        from linear_mha.functional import backend, native, native_build
        q = torch.randn(1, 2, 16, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.inference_mode():
                out = LF.kernel(q, q, q, "elu")
                LF.kernel(q, q, q, "elu")
        assert not native.available() and "no C compiler could build" in native.build_error()
        assert [str(w.message).count("compiled CPU code unavailable") for w in caught] == [1], caught
        assert torch.isfinite(out).all()
    """)
    env = dict(os.environ, CC="/bin/false", LINEAR_MHA_CACHE=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("*.so"))

def test_an_unwritable_home_builds_in_the_temporary_directory(tmp_path):
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    script = textwrap.dedent("""
        import tempfile
        from linear_mha.functional import backend, native, native_build
        assert native.available(), native.build_error()
        assert native.library_path().startswith(tempfile.gettempdir()), native.library_path()
    """)
    env = {key: value for key, value in os.environ.items() if key != "LINEAR_MHA_CACHE"}
    env.update(HOME="/dev/null", TMPDIR=str(tmp_path))  # ~/.cache cannot be created under a file
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr

def test_package_data_ships_every_kernel_source():
    # A wheel carries only what setup.cfg's package_data names; a missing header would fail every build.
    import configparser
    import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    patterns = [p.strip() for p in config["options.package_data"]["linear_mha.functional"].split(",")]
    csrc = root / "linear_mha" / "functional" / "csrc"
    for path in csrc.iterdir():
        assert any(fnmatch.fnmatch(f"csrc/{path.name}", p) for p in patterns), path.name
    assert set(native_build.SOURCES) <= {p.name for p in csrc.iterdir()}


@needs_native
def test_a_build_without_openmp_leaves_threaded_sequences_to_torch(monkeypatch):
    q = torch.randn(1, 2, 32, 8)
    assert native.why_not_kernel("elu", q) is None
    monkeypatch.setattr(native_library, "_threaded", False)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert "without OpenMP" in native.why_not_kernel("elu", q)
        torch.set_num_threads(1)
        assert native.why_not_kernel("elu", q) is None
    finally:
        torch.set_num_threads(previous)
    with torch.inference_mode():  # the one-thread decoding step is worth it whatever the thread count
        token = q[:, :, 0].contiguous()
        assert native.step_ready("elu", token, token, token, None)


PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
"""

LOADS_THE_KERNELS = textwrap.dedent("""
    import warnings
    from linear_mha.functional import native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.available(), native.build_error()
    print(native.library_path())
    print(" | ".join(str(w.message) for w in caught))
""")


# A stand-in for the C compiler in the cache-trust tests below, which are about which folder and which file the
# build trusts, not about compiling (a real build from scratch is test_an_unwritable_home_...'s, ~15 s on two
# cores): its objects are empty files and its link copies the library this process loaded.
STAND_IN_COMPILER = """#!/bin/sh
out=""; shared=0
while [ $# -gt 0 ]; do
    case "$1" in -o) out="$2"; shift ;; -shared) shared=1 ;; esac
    shift
done
if [ "$shared" = 1 ]; then cp "$LINEAR_MHA_TEST_LIBRARY" "$out"; else : > "$out"; fi
"""


@pytest.fixture
def stand_in_compiler(tmp_path):
    """The stand-in compiler's path; the children that _run_with_cache starts build with it."""
    if not native.available():
        pytest.skip(f"kernels not built: {native.build_error()}")
    path = tmp_path / "stand-in-cc"
    path.write_text(STAND_IN_COMPILER)
    path.chmod(0o755)
    if subprocess.run([str(path), "-c", "x.c", "-o", str(tmp_path / "x.o")], capture_output=True).returncode != 0:
        pytest.skip(f"a script in {tmp_path} cannot be run (a noexec temporary folder?)")
    return str(path)


def _plant(folder, marker, compiler):
    """A library that writes ``marker`` when loaded, under every name a build with ``compiler`` looks for in
    ``folder``."""
    real = next((c for c in native_build.compilers() if c != compiler), None)
    if real is None:
        pytest.skip("no C compiler on this machine")
    source = folder / "planted.c"
    source.write_text(PLANTED)
    planted = folder / "planted.so"
    subprocess.run([real, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(planted), str(source)], check=True)
    for flags in native_build.FLAG_SETS:
        shutil.copy(planted, folder / native_build.library_name(compiler, flags))


def _run_with_cache(folder, compiler, check=True):
    env = dict(os.environ, LINEAR_MHA_CACHE=str(folder), CC=compiler, LINEAR_MHA_TEST_LIBRARY=native.library_path())
    result = subprocess.run([sys.executable, "-c", LOADS_THE_KERNELS], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 or not check, result.stderr
    return result.stdout.splitlines()


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="user ids are POSIX")
def test_a_cache_folder_others_can_write_is_never_loaded_from(tmp_path, stand_in_compiler):
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "planted-ran"
    _plant(shared, marker, stand_in_compiler)
    os.chmod(shared, 0o777)  # a folder another local user created first, or anyone can write to
    for library in shared.glob("kernel_attention-*.so"):
        os.chmod(library, 0o755)
    path, warning = _run_with_cache(shared, stand_in_compiler)
    assert not marker.exists(), "a library from a folder others can write was loaded"
    assert not path.startswith(str(shared)) and "writable by other users" in warning
    # The control: the same planted folder, made private, is trusted; so the refusal above was the rule at work.
    os.chmod(shared, 0o700)
    # it lacks the compiled code's symbols: the child fails after loading it
    _run_with_cache(shared, stand_in_compiler, check=False)
    assert marker.exists()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="giving a folder away needs root")
def test_a_cache_folder_owned_by_another_user_is_never_loaded_from(tmp_path, stand_in_compiler):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    marker = tmp_path / "planted-ran"
    _plant(foreign, marker, stand_in_compiler)
    os.chmod(foreign, 0o755)
    os.chown(foreign, 65534, 65534)  # nobody
    path, warning = _run_with_cache(foreign, stand_in_compiler)
    assert not marker.exists() and not path.startswith(str(foreign)) and "owned by user id 65534" in warning


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="user ids are POSIX")
def test_a_library_someone_else_wrote_into_our_cache_is_replaced_not_loaded(tmp_path, stand_in_compiler):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    marker = tmp_path / "planted-ran"
    _plant(ours, marker, stand_in_compiler)
    for library in ours.glob("kernel_attention-*.so"):
        os.chmod(library, 0o777)
    path, _ = _run_with_cache(ours, stand_in_compiler)
    assert not marker.exists() and path.startswith(str(ours))  # rebuilt in place, then loaded
    # The control: planted again and made private, the same files are loaded; so the rebuild above was the rule at
    # work (made private whatever the umask: a copy takes planted.so's mode, group-writable under umask 002).
    _plant(ours, marker, stand_in_compiler)
    for library in ours.glob("kernel_attention-*.so"):
        os.chmod(library, 0o700)
    _run_with_cache(ours, stand_in_compiler, check=False)
    assert marker.exists()
