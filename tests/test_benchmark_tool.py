"""tools/benchmark.py and tools/measure.py: a --quick run end to end (JSON keys, PNG, extrapolation, errors
against float64), FLOP formulas against torch's FLOP counter, the slope fit, --resume, rows that cannot run and rows
with options, and the peak GEMM timed in a case's rounds. Beside this file: the optional peers
(test_benchmark_peers.py), the fresh-process memory measurement (test_benchmark_memory.py) and the A/B and profile
tools (test_ab_and_profile_tools.py)."""
import json
import math
import statistics
import types
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from linear_mha.tools import benchmark
from linear_mha.tools import benchmark_cases, benchmark_flops
from linear_mha.tools import measure
from benchmark_checks import QUICK, by_key, keep_global_torch_state  # noqa: F401  (a module fixture)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = QUICK + ["--json", str(out / "r.json"), "--png", str(out / "r.png")]
    return argv, benchmark.main(argv), out


def test_quick_run_writes_json_and_png(quick_run):
    argv, result, out = quick_run
    saved = json.loads((out / "r.json").read_text())
    assert (out / "r.png").stat().st_size > 10_000
    meta = saved["meta"]
    assert meta["threads"] == 1 and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert meta["matmul_peak_gflops"] > 0 and set(meta["peers"]) == {"linear_attention_transformer", "linformer",
                                                                     "performer_pytorch", "fla"}
    recs = by_key(saved)
    levels_methods = {(r["level"], r["method"]) for r in recs.values()}
    assert {("core", m) for m in ("kernel_elu", "kernel_favor", "taylor", "efficient", "linformer", "sdpa",
                                  "softmax_weights")} <= levels_methods
    assert {("module", m) for m in ("kernel_elu", "mha_sdpa", "mha_weights")} <= levels_methods
    assert not any("error" in r for r in recs.values())
    forms = benchmark_cases.methods()  # no causal row for a method without a causal form
    assert not any(r["causal"] and not forms[(r["level"], r["method"])].causal for r in recs.values())
    assert any(r["method"] == "efficient" for r in recs.values())
    for r in recs.values():
        for field in ("median_ms", "min_ms", "flops", "gflops", "pct_peak", "pct_peak_best", "bytes", "gbps",
                      "ratio_vs_sdpa"):
            assert r[field] > 0 and math.isfinite(r[field]), (r["key"], field)
        # the best run's share of the (best-run) peak: the median's share scaled by median / min, never below it
        assert r["pct_peak_best"] == pytest.approx(r["pct_peak"] * r["median_ms"] / r["min_ms"])
        assert r["pct_peak_best"] >= r["pct_peak"]
    # SDPA is capped at 128 in --quick: N=256 is the N=128 time x4, marked, and so is every ratio against it.
    sdpa128, sdpa256 = recs["core/sdpa/B1/H2/d16/N128/full/fwd"], recs["core/sdpa/B1/H2/d16/N256/full/fwd"]
    assert sdpa256["extrapolated"] and not sdpa128.get("extrapolated")
    assert sdpa256["median_ms"] == pytest.approx(4 * sdpa128["median_ms"])
    assert recs["core/kernel_elu/B1/H2/d16/N256/full/fwd"]["ratio_extrapolated"]
    assert sdpa128["ratio_vs_sdpa"] == 1.0 and "mem_extra_mib" not in sdpa256
    # float64 errors: forward only, every measured case up to --err-max-n; float32 is ~1e-7 off.
    fwd = [r for r in recs.values() if r["pass"] == "fwd" and not r.get("extrapolated")]
    assert fwd and all(0 <= r["rel_err"] < 1e-4 for r in fwd)
    assert all("rel_err" not in r for r in recs.values() if r["pass"] == "fwdbwd")
    # memory only where asked (--quick: kernel_elu, core, fwd, N=64): small inputs, small extra memory.
    mem = [r for r in recs.values() if "mem_extra_mib" in r]
    assert {(r["method"], r["N"], r["pass"], r["level"]) for r in mem} == {("kernel_elu", 64, "fwd", "core")}
    assert len(mem) == 2 and all(0 <= r["mem_extra_mib"] < 50 for r in mem)
    slope_keys = {(s["level"], s["method"], s["causal"], s["pass"]) for s in saved["slopes"]}
    assert ("core", "kernel_elu", True, "fwdbwd") in slope_keys
    assert all(s["time_slope"] is not None for s in saved["slopes"])
    assert [d["context"] for d in saved["decode"]] == [16, 256] and all(d["us_median"] > 0 for d in saved["decode"])
    assert saved["records"] == json.loads(json.dumps(result["records"]))


def sdpa_math_backend():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.MATH)
    except ImportError:  # torch < 2.3
        return torch.backends.cuda.sdp_kernel(enable_flash=False, enable_mem_efficient=False, enable_math=True)


def _raw_baddbmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    # torch's counter has no entry for the in-place baddbmm_ the causal kernel uses.
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


def _unit_triangular_solve(a_shape, b_shape, *args, out_shape=None, **kwargs):
    # nor for triangular solves (the delta rule's): forward substitution on a unit triangular n x n system takes
    # n (n - 1) / 2 multiply-adds per right-hand column
    n, columns = a_shape[-1], b_shape[-1]
    return math.prod(b_shape[:-2]) * n * (n - 1) * columns


@pytest.mark.parametrize("key,causal", [(k, causal) for k, m in benchmark_cases.methods().items()
                                         if not m.peer and "cpu" in m.devices
                                         for causal in (False, True) if (m.causal if causal else m.full)])
def test_flop_formulas_match_torch_flop_counter(key, causal, backends):
    # The counter sees torch ops only: the compiled CPU code (functional/native.py) is switched off.
    backends(native_kernels=False)
    method = benchmark_cases.methods()[key]
    case = dict(level=key[0], method=key[1], B=2, H=2, d=8, N=128, proj_k=16, seed=0, causal=causal)
    fn, modules = benchmark_cases.build_method(case, torch.float32, "cpu")
    for m in modules:
        m.train()  # nn.MultiheadAttention's eval fast path is one fused op the counter cannot see into
    inputs = benchmark_cases.make_inputs(case, torch.float32, "cpu")
    # SDPA through its math backend, whose matmuls every torch's counter sees: the fused CPU kernel is counted by
    # some releases and reported as 0 FLOPs by others (2.14.1).
    with torch.no_grad(), sdpa_math_backend(), FlopCounterMode(
            display=False, custom_mapping={torch.ops.aten.baddbmm_: _raw_baddbmm_,
                                           torch.ops.aten.linalg_solve_triangular: _unit_triangular_solve}) as counter:
        fn(*inputs)
    counted = counter.get_total_flops()
    if counted == 0:
        pytest.skip("torch's FLOP counter saw no operation of this method")
    if causal and method.kind != "linear":
        # The softmax kernels compute (or mask) the whole N x N square; the useful count is half of its products.
        counted -= 4 * 2 * 2 * 128 ** 2 * 8 // 2
    assert method.flops(case) == counted


def test_flop_formula_values_on_a_tiny_case():
    c = dict(B=1, H=2, N=8, d=4, proj_k=3, causal=False)
    kernel, softmax = benchmark_flops.method_flops("kernel"), benchmark_flops.method_flops("softmax")
    # phi(K)^T V and phi(Q) S: 2 x (2 N F d); the normaliser phi(Q) sum phi(K): 2 N F
    assert kernel(c) == 2 * 2 * 8 * 4 * (2 * 4 + 1)
    assert softmax(c) == 4 * 2 * 64 * 4 and softmax(dict(c, causal=True)) == 2 * 2 * 64 * 4
    chunk = min(benchmark_flops.chunk_size(), 8)
    padded = -(-8 // chunk) * chunk
    assert kernel(dict(c, causal=True)) == 4 * 2 * padded * 4 * 5 + 2 * 2 * padded * chunk * 9
    assert benchmark_flops.method_flops("linformer")(c) == 8 * 2 * 8 * 3 * 4  # the case's --proj-k


def test_the_garbage_collector_never_runs_inside_a_timed_call():
    """A collection set off inside a call would be timed as that callable's own work."""
    import gc
    inside, started_inside = [False], []

    def watch(phase, info):
        if phase == "start" and inside[0]:
            started_inside.append(info["generation"])

    def make_cycles():
        inside[0] = True
        for _ in range(5000):  # far past the first generation's threshold (700 by default)
            cycle = []
            cycle.append(cycle)
        inside[0] = False

    was_enabled = gc.isenabled()
    gc.enable()
    gc.callbacks.append(watch)
    try:
        result = measure.round_robin({"cycles": make_cycles}, repeats=3, warmup=0)
    finally:
        gc.callbacks.remove(watch)
        assert gc.isenabled()  # the collector is handed back as it was found
        if not was_enabled:
            gc.disable()
    assert result["cycles"]["runs"] == 3
    assert started_inside == []


def test_round_robin_keeps_each_rounds_time_and_paired_ratio_sets_rounds_against_each_other(monkeypatch):
    """A machine whose speed moves between rounds: each callable's runs come back in round order, not sorted, and the
    paired ratio sets the two calls of each round against each other, not the sorted runs (which would pair a fast
    round's call with a slow round's). The clock is a stand-in that each call moves on by its round's time, so the
    check does not depend on how busy the machine is (a sleep of a few ms came back late under two test processes)."""
    clock, durations = [0.0], iter([3.0, 1.0, 4.0, 2.0])

    def call_of_its_round():
        clock[0] += next(durations) / 1e3
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    timed = measure.round_robin({"drifting": call_of_its_round}, repeats=4, warmup=0)
    monkeypatch.undo()
    assert timed["drifting"]["runs"] == 4 and timed["drifting"]["round_ms"] == pytest.approx([3.0, 1.0, 4.0, 2.0])
    rounds = {"base": {"round_ms": [10.0, 30.0, 20.0]}, "option": {"round_ms": [33.0, 22.0, 11.0]}}
    paired = measure.paired_ratio(rounds, "option", "base")  # per round: 3.3, 0.733, 0.55
    assert paired["median"] == pytest.approx(22.0 / 30.0) and paired["rounds"] == 3
    assert paired["q1"] == pytest.approx((0.55 + 22.0 / 30.0) / 2)
    assert paired["q3"] == pytest.approx((22.0 / 30.0 + 3.3) / 2)
    with pytest.raises(ValueError, match="no round timed both"):
        measure.paired_ratio({"a": {"round_ms": []}, "b": {"round_ms": [1.0]}}, "a", "b")
    with pytest.raises(ValueError, match="'a' has no timed rounds: RuntimeError: boom"):
        measure.paired_ratio({"a": {"error": "RuntimeError: boom"}, "b": {"round_ms": [1.0]}}, "a", "b")


def test_loglog_slope():
    xs = [256, 1024, 4096, 16384]
    assert measure.loglog_slope(xs, [3 * x ** 1.5 for x in xs]) == pytest.approx(1.5, abs=1e-12)
    assert measure.loglog_slope(xs, [7.0] * 4) == pytest.approx(0.0, abs=1e-12)
    noisy = [x * (1.1 if i % 2 else 0.9) for i, x in enumerate(xs)]
    assert measure.loglog_slope(xs, noisy) == pytest.approx(1, abs=0.1)
    assert measure.loglog_slope([5, 5], [1, 2]) is None and measure.loglog_slope([1, 2], [0, 3]) is None


def test_each_method_is_set_against_the_fast_path_in_its_own_rounds(quick_run, capsys):
    # The bounds are ratios to kernel_elu's time in one run; a ratio of medians taken in different stretches
    # of a drifting machine, or of rounds that ran in different groups (a resumed file), would not be one.
    _, result, _ = quick_run
    assert result["meta"]["against"] == "kernel_elu"
    recs = result["records"]
    elu = {(r["level"], r["N"], r["causal"], r["pass"]): r for r in recs if r["method"] == "kernel_elu"}
    compared = [r for r in recs if "vs_against" in r]
    assert {r["method"] for r in compared} >= {"taylor", "efficient", "linformer", "sdpa"}
    assert not any(r["method"] == "kernel_elu" for r in compared) and not any(r.get("extrapolated") for r in compared)
    for r in compared:
        base = elu[(r["level"], r["N"], r["causal"], r["pass"])]
        assert r["round_group"] == base["round_group"]
        ratios = [a / b for a, b in zip(r["round_ms"], base["round_ms"])]
        assert r["vs_against"]["method"] == "kernel_elu"
        assert r["vs_against"]["median"] == pytest.approx(statistics.median(ratios))
        assert r["vs_against"]["q1"] <= r["vs_against"]["median"] <= r["vs_against"]["q3"]
        assert r["flop_ratio"] == pytest.approx(r["flops"] / base["flops"])
    taylor = next(r for r in compared if r["method"] == "taylor" and r["level"] == "core")
    assert taylor["flop_ratio"] > 1.0  # d + 1 features where elu has d
    from linear_mha.tools import benchmark_report
    benchmark_report.print_against(result)
    assert "time x kernel_elu, per round" in capsys.readouterr().out


def test_resume_skips_finished_cases(quick_run, monkeypatch):
    argv, first, out = quick_run
    path = out / "r.json"
    saved = json.loads(path.read_text())
    dropped = ["core/taylor/B1/H2/d16/N128/full/fwd", "module/kernel_elu/B1/H2/d16/N64/causal/fwdbwd"]
    saved["records"] = [r for r in saved["records"] if r["key"] not in dropped]
    path.write_text(json.dumps(saved))
    timed = []
    real_time_group = benchmark.time_group

    def spy(group, *args):
        timed.extend(benchmark.case_key(c) for c in group)
        return real_time_group(group, *args)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished case was measured again")
    monkeypatch.setattr(benchmark, "time_group", spy)
    monkeypatch.setattr(benchmark.M, "peak_extra_memory", must_not_run)
    monkeypatch.setattr(benchmark, "time_decode", must_not_run)
    resumed = benchmark.main([a for a in argv if a not in ("--png", str(out / "r.png"))] + ["--resume"])
    assert sorted(timed) == sorted(dropped)
    before, after = by_key(first), by_key(resumed)
    assert set(before) == set(after)
    kept = [k for k in before if k not in dropped and not before[k].get("extrapolated")]
    assert all(after[k]["median_ms"] == before[k]["median_ms"] for k in kept)
    assert "rel_err" in after[dropped[0]]
    # timed again apart from its group's kernel_elu, whose rounds are the first run's: nothing to set it against
    assert after[dropped[0]]["round_group"] != after["core/kernel_elu/B1/H2/d16/N128/full/fwd"]["round_group"]
    assert "vs_against" not in after[dropped[0]] and "vs_against" in after["core/efficient/B1/H2/d16/N128/full/fwd"]
    with pytest.raises(SystemExit, match="threads"):
        benchmark.main(["--quick", "--threads", "2", "--json", str(path), "--resume"])
    saved = json.loads(path.read_text())
    kept = saved["meta"]["output_cache_mib"]
    saved["meta"]["output_cache_mib"] = kept + 1.0  # nor times with another output cache (its faults differ)
    path.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="LINEAR_MHA_OUTPUT_CACHE_MIB"):
        benchmark.main([a for a in argv if a not in ("--png", str(out / "r.png"))] + ["--resume"])
    saved["meta"]["output_cache_mib"] = kept
    saved["meta"]["allocator"] = "libtcmalloc_minimal.so.4"  # times under another allocator must not mix in
    path.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="allocator"):
        benchmark.main([a for a in argv if a not in ("--png", str(out / "r.png"))] + ["--resume"])
    del saved["meta"]["allocator"]  # a file from before allocators were recorded: resumable, and labelled so
    path.write_text(json.dumps(saved))
    resumed = benchmark.main([a for a in argv if a not in ("--png", str(out / "r.png"))] + ["--resume"])
    assert resumed["meta"]["allocator"] == "not recorded"


def test_what_cannot_run_is_reported_not_dropped(tmp_path, capsys):
    # Asked for efficient (no causal form), sdpa at the module level (a core function) and a CUDA-only SDPA
    # backend on CPU: each is named with its reason in the JSON and the printed table, and the rest still runs.
    result = benchmark.main(QUICK + ["--rows", "core:1x8", "module:1x8", "--n", "16", "--passes", "fwd", "--no-memory",
                                     "--decode-contexts", "16", "--methods", "efficient", "sdpa", "sdpa_flash",
                                     "--json", str(tmp_path / "r.json")])
    why = {(r["level"], r["method"], r["mask"]): r["why"] for r in result["not_run"]}
    assert why == {("core", "efficient", "causal"): "has no causal form",
                   ("module", "efficient", "causal"): "has no causal form",
                   ("core", "sdpa_flash", "full"): "runs on cuda only",
                   ("core", "sdpa_flash", "causal"): "runs on cuda only",
                   ("module", "sdpa", "any"): "has no module-level form (it is a core-level method)",
                   ("module", "sdpa_flash", "any"): "has no module-level form (it is a core-level method)"}
    assert json.loads((tmp_path / "r.json").read_text())["not_run"] == result["not_run"]
    printed = capsys.readouterr().out
    assert "| module | sdpa | any | has no module-level form" in printed
    ran = {(r["level"], r["method"], r["causal"]) for r in result["records"]}
    assert {("core", "efficient", False), ("module", "efficient", False), ("core", "sdpa", True)} <= ran


def test_a_row_with_options_changed_runs_with_them_at_both_levels(tmp_path, capsys):
    # hedgehog at m = 3 instead of d: the row is named as asked, its FLOPs are those of m = 3 (a row that dropped its
    # options would count m = d), and its error is against the same options in float64.
    spec = "hedgehog:feature_dim=3"
    result = benchmark.main(QUICK + ["--rows", "core:1x8", "module:1x8", "--n", "16", "--passes", "fwd", "--no-memory",
                                     "--decode-contexts", "16", "--methods", "hedgehog", spec,
                                     "--json", str(tmp_path / "r.json")])
    rows = {(r["level"], r["method"], r["causal"]): r for r in result["records"]}
    assert {(level, spec, causal) for level in ("core", "module") for causal in (False, True)} <= set(rows)
    for (level, method, causal), r in rows.items():
        core = benchmark_flops.method_flops("hedgehog", {"feature_dim": 3} if method == spec else {})(r)
        assert r["flops"] == (core if level == "core" else core + benchmark_flops.projection_flops(r))
        assert r["rel_err"] < 1e-5
    assert rows[("core", spec, False)]["flops"] < rows[("core", "hedgehog", False)]["flops"]
    assert f"| {spec} |" in capsys.readouterr().out
    for wrong, named in (("hedgehog:feture_dim=3", "feture_dim"), ("hedgehg:feature_dim=3", "hedgehg"),
                         ("hedgehog:feature_dim=-1", "feature_dim")):
        with pytest.raises(SystemExit, match=named):
            benchmark.main(QUICK + ["--methods", wrong, "--no-memory"])


def test_largest_output_counts_each_row_up_to_its_own_cap():
    a = benchmark.parse_args(["--rows", "core:1x64", "core:4x64:4096", "--n", "1024", "16384"])
    assert benchmark.largest_output_bytes(a, torch.float32) == 8 * 64 * 16384 * 4  # 32 MiB: row 1 at 16k
    a = benchmark.parse_args(["--rows", "core:4x64:4096", "--n", "1024", "16384"])
    assert benchmark.largest_output_bytes(a, torch.bfloat16) == 4 * 8 * 64 * 1024 * 2  # 16k is past the cap


def test_decode_samples_keep_each_sample_and_take_their_median(monkeypatch):
    medians = iter([30.0, 10.0, 20.0])  # a slow, a fast and a middling stretch of the machine

    def fake_decode(heads, dim, contexts, steps, repeats, seed, device, dtype):
        m = next(medians)
        return [dict(context=c, B=1, H=heads, d=dim, us_median=m + c, us_min=m - 1, us_median_inplace=m / 2,
                     us_min_inplace=m / 2 - 1) for c in contexts]
    monkeypatch.setattr(benchmark, "decode_step_times", fake_decode)
    monkeypatch.setattr(benchmark.time, "sleep", lambda s: None)
    a = benchmark.parse_args(QUICK + ["--decode-samples", "3"])
    rows = benchmark.time_decode(a, torch.device("cpu"), torch.float32)
    assert [r["context"] for r in rows] == [16, 256]
    assert rows[0]["us_median_samples"] == [46.0, 26.0, 36.0] and rows[0]["us_median"] == 36.0
    assert rows[1]["us_median_inplace_samples"] == [15.0, 5.0, 10.0] and rows[1]["us_median_inplace"] == 10.0
    assert rows[0]["us_min"] == 9.0 and rows[0]["us_min_inplace"] == 4.0
    with pytest.raises(SystemExit, match="--decode-samples"):
        benchmark.parse_args(QUICK + ["--decode-samples", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_cuda_run_says_it_needs_a_gpu_before_doing_anything(tmp_path):
    import subprocess
    script = Path(__file__).resolve().parents[1] / "tools" / "cuda_run.sh"
    import os
    import sys
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was run or written


def test_the_cuda_run_goes_on_where_it_stopped_and_keeps_to_its_budget(tmp_path):
    """With a stand-in interpreter that says a GPU is there and records every command: a step that fails is retried
    on the next run, a finished one is not run again, and no step starts once the budget is used."""
    import os
    import subprocess
    script = Path(__file__).resolve().parents[1] / "tools" / "cuda_run.sh"
    calls, fake = tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
[ "$1" = "-c" ] && exit 0
echo "$*" >> {calls}
case "$*" in *triton_bench*) [ -e {tmp_path}/fixed ] || exit 1;; esac
""")
    fake.chmod(0o755)

    def run(**env):
        out = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHON=str(fake), **env))
        lines = calls.read_text().splitlines() if calls.exists() else []
        calls.write_text("")
        return out.stdout, lines

    stdout, first = run()
    assert "== triton: FAILED" in stdout and len(first) == 8  # every step tried, one failed
    (tmp_path / "fixed").touch()
    stdout, second = run()
    assert len(second) == 1 and "triton_bench" in second[0] and "== tests: done before" in stdout
    (tmp_path / "out" / "tests.done").unlink()
    stdout, third = run(BUDGET="0")
    assert third == [] and "== tests: not started" in stdout


def test_the_peak_in_a_cases_rounds_is_the_gemm_timed_between_its_calls(tmp_path, monkeypatch):
    """From --peak-in-rounds-from on the GEMM runs in the group's own round robin, is no record, and each case's
    share of it is taken from that GEMM's timing, median to median and best to best; below it nothing changes."""
    seen = {}
    real = benchmark.M.round_robin

    def spy(runners, **kwargs):
        timed = real(runners, **kwargs)
        if any(name.startswith("core/") for name in runners):  # not the decode step's timing
            seen[tuple(sorted(runners))] = dict(timed.get(benchmark.ROUND_PEAK, {}))
        return timed
    monkeypatch.setattr(benchmark.M, "round_robin", spy)
    result = benchmark.main(QUICK + ["--n", "64", "256", "--rows", "core:1x16", "--methods", "kernel_elu", "taylor",
                                     "--masks", "full", "--passes", "fwd", "--no-memory", "--peak-in-rounds-from",
                                     "256", "--json", str(tmp_path / "r.json")])
    groups = {n: names for names in seen for n in (64, 256) if f"/N{n}/" in names[0]}
    assert len(seen) == 2 and benchmark.ROUND_PEAK in groups[256] and benchmark.ROUND_PEAK not in groups[64]
    gemm = seen[groups[256]]
    assert gemm["runs"] == 2  # one run per round of the group (--quick: 2 rounds)
    recs = by_key(result)
    assert set(recs) == {f"core/{m}/B1/H2/d16/N{n}/full/fwd" for m in ("kernel_elu", "taylor") for n in (64, 256)}
    for key, r in recs.items():
        if r["N"] < 256:
            assert "pct_round_peak" not in r and "round_peak_gflops" not in r
            continue
        flops = 2.0 * 256 ** 3  # --quick's --peak-size
        assert r["round_peak_gflops"] == pytest.approx(flops / gemm["median_ms"] / 1e6)
        assert r["round_peak_best_gflops"] == pytest.approx(flops / gemm["min_ms"] / 1e6)
        assert r["pct_round_peak"] == pytest.approx(100 * r["gflops"] / r["round_peak_gflops"])
        assert r["pct_round_peak_best"] == pytest.approx(
            100 * r["flops"] / r["min_ms"] / 1e6 / r["round_peak_best_gflops"])
        assert r["round_peak_size"] == 256


def test_a_gemm_that_fails_in_the_rounds_leaves_its_error_on_the_cases(tmp_path, monkeypatch, capsys):
    """The cases are still timed, and their records say why they have no share of the peak in their rounds."""
    real = benchmark.M.matmul_call
    calls = []

    def failing_after_the_first(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:  # the peak at the start
            return real(*args, **kwargs)

        def gemm():
            raise RuntimeError("no memory for the GEMM")
        return gemm, 1.0
    monkeypatch.setattr(benchmark.M, "matmul_call", failing_after_the_first)
    result = benchmark.main(QUICK + ["--n", "256", "--rows", "core:1x16", "--methods", "kernel_elu", "--masks", "full",
                                     "--passes", "fwd", "--no-memory", "--json", str(tmp_path / "r.json")])
    (r,) = result["records"]
    assert r["median_ms"] > 0 and "pct_round_peak" not in r
    assert r["round_peak_error"] == "RuntimeError: no memory for the GEMM"
    assert "| error |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="peak-in-rounds-from"):
        benchmark.main(QUICK + ["--peak-in-rounds-from", "-1"])
