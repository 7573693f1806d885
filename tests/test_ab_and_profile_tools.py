"""The development tools beside the benchmark: tools/module_profile.py (a module's ops per variant),
tools/ab_builds.py (two checkouts' compiled code timed in one process) and tools/module_options_ab.py (each module
option timed beside the plain module)."""
import json

import pytest
import torch

from linear_mha.functional import native, native_library
from linear_mha.tools import benchmark_cases
from benchmark_checks import keep_global_torch_state  # noqa: F401  (a module fixture)


def test_module_profile_gives_each_variant_its_own_ops(tmp_path, capsys):
    """linear_mha.tools.module_profile: one column per variant, the gate's own ops only in the gated one, the dwc variant's
    convolution only in its own, a table and a JSON file; an unknown option is refused by name."""
    from linear_mha.tools import module_profile
    out = tmp_path / "profile.json"
    columns = module_profile.main(["--n", "64", "--variants", "kernel", "kernel+gate", "taylor+dwc3", "--steps", "1",
                                   "--json", str(out)])
    gate_ops = [k for k in columns["kernel+gate"] if "OutputGate" in k and columns["kernel+gate"][k] > 0]
    assert gate_ops and not any(columns["kernel"].get(k, 0) for k in gate_ops)
    # the local term: the compiled Function on float32 CPU tensors, torch's convolution elsewhere
    local_ops = [k for k in columns["taylor+dwc3"] if ("LocalTerm" in k or "convolution" in k)
                 and columns["taylor+dwc3"][k] > 0]
    assert local_ops and not any(columns["kernel"].get(k, 0) for k in local_ops)
    assert json.loads(out.read_text())["ms_per_step"].keys() == columns.keys()
    assert "| op | kernel | kernel+gate | taylor+dwc3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown option 'fast'"):
        module_profile.main(["--n", "64", "--variants", "kernel+fast"])


@pytest.mark.skipif(not native.available(), reason="needs the compiled CPU code")
def test_ab_builds_times_both_builds_and_hands_this_ones_back(tmp_path, capsys, monkeypatch):
    """The 'before' checkout here is a stand-in whose build module loads a copy of this build's library from
    another path: a second, separate library, as another checkout's would be, without compiling anything."""
    import shutil
    from linear_mha.functional import output_cache
    from linear_mha.tools import ab_builds
    mine, threads = native_library._library, torch.get_num_threads()
    before = tmp_path / "before"
    (before / "linear_mha" / "functional").mkdir(parents=True)
    copy = shutil.copy(native.library_path(), tmp_path / "copy.so")
    (before / "linear_mha" / "functional" / "native_build.py").write_text(
        f"import ctypes\ndef build():\n    return ctypes.CDLL({str(copy)!r}), True\n")
    seen = []  # the library each timed call ran

    def runner_of(build):
        def runner(c, device, dtype, **kwargs):
            run = build(c, device, dtype, **kwargs)

            def call():
                seen.append(native_library._library._name)
                run()
            return call
        return runner
    monkeypatch.setattr(ab_builds, "build_runner", runner_of(benchmark_cases.build_runner))
    out = tmp_path / "ab.json"
    ab_builds.main(["--before", str(before), "--methods", "kernel_elu", "efficient", "--n", "96", "--heads", "2",
                    "--dim", "8", "--repeats", "2", "--threads", "1", "--cases", "fwd", "causal_fwd",
                    "--json", str(out)])
    assert {str(copy), mine._name} == set(seen)  # both builds were timed
    # and afterwards this process runs this checkout's code, with its output cache and its thread count
    assert native_library._library is mine and output_cache._library is mine
    assert torch.get_num_threads() == threads
    result = json.loads(out.read_text())
    assert result["meta"]["before_library"] == str(copy)
    rows = result["rows"]
    assert [(r["method"], r["case"]) for r in rows] == [("kernel_elu", "fwd"), ("kernel_elu", "causal_fwd"),
                                                         ("efficient", "fwd")]
    assert all(r[f"{s}_median_ms"] > 0 for r in rows for s in ("before", "after"))
    assert "| efficient | causal_fwd | - | - | no causal form |" in capsys.readouterr().out
    # q, k, v as a module's projection views, both builds timed on them, and the rows say so
    seen.clear()
    monkeypatch.setattr(ab_builds, "module_runner", runner_of(ab_builds.module_runner))
    views = ab_builds.main(["--before", str(before), "--methods", "kernel_elu", "--n", "96", "--heads", "2",
                            "--dim", "8", "--repeats", "2", "--threads", "1", "--cases", "fwdbwd",
                            "--layout", "module"])
    assert {str(copy), mine._name} == set(seen) and [r["layout"] for r in views] == ["module"]
    # the compiled output gate and local term alone (on a square grid), which have no causal form
    for method, runner, n in (("output_gate", "gate_runner", "96"), ("local_term", "local_term_runner", "100")):
        seen.clear()
        monkeypatch.setattr(ab_builds, runner, runner_of(getattr(ab_builds, runner)))
        rows = ab_builds.main(["--before", str(before), "--methods", method, "--n", n, "--heads", "2", "--dim", "8",
                               "--repeats", "2", "--threads", "1", "--cases", "fwd", "fwdbwd", "causal_fwd"])
        assert {str(copy), mine._name} == set(seen) and native_library._library is mine
        assert [(r["method"], r["case"]) for r in rows] == [(method, "fwd"), (method, "fwdbwd")]
    # the benchmark's module rows, projections included; the local term's has no causal form
    seen.clear()
    rows = ab_builds.main(["--before", str(before), "--methods", "taylor+dwc3", "--level", "module", "--n", "16",
                           "--heads", "2", "--dim", "8", "--repeats", "2", "--threads", "1", "--cases", "fwdbwd",
                           "causal_fwd"])
    assert {str(copy), mine._name} == set(seen) and [(r["level"], r["case"]) for r in rows] == [("module", "fwdbwd")]
    with pytest.raises(SystemExit, match="not a module-level method"):
        ab_builds.main(["--before", str(before), "--methods", "local_term", "--level", "module"])
    with pytest.raises(SystemExit):  # a module makes its own q, k, v: --layout is the core level's
        ab_builds.main(["--before", str(before), "--methods", "taylor", "--level", "module", "--layout", "module"])
    with pytest.raises(SystemExit, match="square token grid"):
        ab_builds.main(["--before", str(before), "--methods", "local_term", "--n", "96", "--cases", "fwd"])
    with pytest.raises(SystemExit, match="no linear_mha/functional/native_build.py"):
        ab_builds.main(["--before", str(tmp_path)])
    with pytest.raises(SystemExit, match="--methods kernal_elu: not a core-level method"):
        ab_builds.main(["--before", str(before), "--methods", "kernal_elu"])


def test_module_options_ab_times_each_option_beside_the_plain_module(tmp_path):
    from linear_mha.tools import module_options_ab
    rows = module_options_ab.main(["--methods", "taylor", "--n", "64", "--heads", "2", "--dim", "8", "--repeats", "1",
                                   "--threads", "1", "--json", str(tmp_path / "ab.json")])
    full_fwd = [r["method"] for r in rows if not r["causal"] and r["pass_"] == "fwd"]
    assert full_fwd == ["taylor", "taylor+dwc3", "taylor+gate"]
    plain = next(r for r in rows if r["method"] == "taylor")
    assert plain["vs_plain_paired"] == 1.0 and len(plain["round_ms"]) == 1
    # the local term has no causal form
    assert [r["method"] for r in rows if r["causal"] and r["pass_"] == "fwd"] == ["taylor", "taylor+gate"]
    assert all(r["vs_plain"] == 1.0 for r in rows if r["method"] == "taylor")
    assert all(r["median_ms"] > 0 and r["vs_plain"] > 0 for r in rows)
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert saved["rows"] == rows and saved["meta"]["n"] == 64
    with pytest.raises(SystemExit):
        module_options_ab.main(["--methods", "softmax"])
