"""tools/benchmark.py and tools/measure.py: a --quick run end to end (JSON keys, PNG, extrapolation, errors
against float64), FLOP formulas against torch's FLOP counter, the slope fit, --resume, optional peers through
fake modules, and the fresh-process memory measurement on a known allocation."""
import json
import math
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import linear_mha.functional as LF
from linear_mha.functional import native, native_library

from linear_mha.tools import benchmark
from linear_mha.tools import benchmark_cases, benchmark_flops
from linear_mha.tools import cpu_allocator
from linear_mha.tools import measure

QUICK = ["--quick", "--threads", "1"]


@pytest.fixture(scope="module", autouse=True)
def keep_global_torch_state():
    """The benchmark pins threads and seeds torch's RNG in-process; other test modules must not inherit that."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng():
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = QUICK + ["--json", str(out / "r.json"), "--png", str(out / "r.png")]
    return argv, benchmark.main(argv), out


def _by_key(result):
    return {r["key"]: r for r in result["records"]}


def test_quick_run_writes_json_and_png(quick_run):
    argv, result, out = quick_run
    saved = json.loads((out / "r.json").read_text())
    assert (out / "r.png").stat().st_size > 10_000
    meta = saved["meta"]
    assert meta["threads"] == 1 and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert meta["matmul_peak_gflops"] > 0 and set(meta["peers"]) == {"linear_attention_transformer", "linformer",
                                                                     "performer_pytorch", "fla"}
    recs = _by_key(saved)
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


@pytest.mark.parametrize("key,causal", [(k, causal) for k, m in benchmark_cases.methods().items()
                                         if not m.peer and "cpu" in m.devices
                                         for causal in ((False, True) if m.causal else (False,))])
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
            display=False, custom_mapping={torch.ops.aten.baddbmm_: _raw_baddbmm_}) as counter:
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
    before, after = _by_key(first), _by_key(resumed)
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


def _fake_peers(monkeypatch):
    lat = types.ModuleType("linear_attention_transformer")
    sub = types.ModuleType("linear_attention_transformer.linear_attention_transformer")
    sub.linear_attn = lambda q, k, v: torch.softmax(q, -1) @ (torch.softmax(k, -2).transpose(-2, -1) @ v)
    sub.causal_linear_attn = lambda q, k, v: torch.cumsum(v, dim=-2) * torch.sigmoid(q)
    lat.linear_attention_transformer = sub
    performer = types.ModuleType("performer_pytorch")

    class BrokenFastAttention:  # a peer whose API changed: cannot even be built
        def __init__(self, **kwargs):
            raise TypeError("unexpected keyword argument 'dim_heads'")
    performer.FastAttention = BrokenFastAttention
    linformer = types.ModuleType("linformer")

    class FailingLinformer(nn.Module):  # builds, then fails when called
        def __init__(self, dim, seq_len, heads, k):
            super().__init__()
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            raise RuntimeError("fake peer failure")
    linformer.LinformerSelfAttention = FailingLinformer
    for name, module in ((lat.__name__, lat), (sub.__name__, sub), ("performer_pytorch", performer),
                         ("linformer", linformer)):
        monkeypatch.setitem(sys.modules, name, module)
    _fake_fla(monkeypatch, "current")


def _fake_fla(monkeypatch, version: str):
    """fla.ops.linear_attn with one of flash-linear-attention's calling conventions and its normalised causal
    linear attention in plain ops (the real one is Triton, CUDA only). "current": (B, T, H, K) with cu_seqlens;
    "switch": versions with head_first, False by default (True raises in some); "oldest": (B, H, T, K) only."""
    def attend(q, k, v, scale):  # (B, H, T, K)
        q = q * scale
        out = torch.matmul(torch.matmul(q, k.transpose(-2, -1)).tril(), v)
        return out / ((q * k.cumsum(-2)).sum(-1, keepdim=True) + 1e-10)

    def time_major(q, k, v, scale):
        return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)

    if version == "current":
        def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                              cu_seqlens=None):
            return time_major(q, k, v, scale), None
    elif version == "switch":
        def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                              head_first=False):
            if head_first:
                raise DeprecationWarning("head_first is deprecated")
            return time_major(q, k, v, scale), None
    else:
        def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True):
            return attend(q, k, v, scale), None
    fla, ops, linear_attn = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.linear_attn"))
    linear_attn.chunk_linear_attn = chunk_linear_attn
    fla.ops, ops.linear_attn = ops, linear_attn
    for module in (fla, ops, linear_attn):
        monkeypatch.setitem(sys.modules, module.__name__, module)


FLA_CASE = dict(level="core", method="peer_fla", B=2, H=3, d=8, N=70, causal=True, proj_k=4, seed=0,
                **{"pass": "fwd"})


@pytest.mark.parametrize("version", ["current", "switch"])
def test_the_fla_peer_computes_kernel_elu(version, monkeypatch):
    _fake_fla(monkeypatch, version)
    q, k, v = benchmark_cases.make_inputs(FLA_CASE, torch.float64, "cpu")
    fn, _ = benchmark_cases.build_method(FLA_CASE, torch.float64, "cpu")
    torch.testing.assert_close(fn(q, k, v), LF.kernel(q, k, v, "elu", causal=True), rtol=1e-9, atol=1e-9)
    assert benchmark_cases.reference_error(dict(FLA_CASE, N=16), "cpu", torch.float32) < 1e-5


def test_the_fla_peer_refuses_an_fla_without_its_current_layout(monkeypatch):
    _fake_fla(monkeypatch, "oldest")
    with pytest.raises(RuntimeError, match="too old"):
        benchmark_cases.build_method(FLA_CASE, torch.float64, "cpu")


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


def test_the_fla_peer_runs_only_causal_and_only_on_cuda(monkeypatch):
    _fake_fla(monkeypatch, "current")
    assert benchmark_cases.available_peers("cpu")["fla"] == "not for cpu"  # not even imported
    assert benchmark_cases.available_peers("cuda")["fla"] == "available"
    a = benchmark.parse_args(QUICK + ["--methods", "peer_fla", "kernel_elu"])
    peers = {"fla": "available"}

    def planned():
        return {(c["method"], c["causal"]) for group in benchmark.plan(a, peers)[0] for c in group}
    assert planned() == {("kernel_elu", False), ("kernel_elu", True)}
    a.device = "cuda"
    assert planned() == {("kernel_elu", False), ("kernel_elu", True), ("peer_fla", True)}


def test_optional_peers_are_benchmarked_and_their_failures_reported(monkeypatch, tmp_path):
    _fake_peers(monkeypatch)
    result = benchmark.main(QUICK + ["--n", "64", "128", "--passes", "fwd", "--no-memory", "--decode-contexts", "16",
                                     "--methods", "peer_lat", "peer_performer", "peer_linformer", "sdpa",
                                     "mha_sdpa", "--json", str(tmp_path / "p.json")])
    assert result["meta"]["peers"] == {"fla": "not for cpu", "linear_attention_transformer": "available",
                                       "linformer": "available", "performer_pytorch": "available"}
    recs = _by_key(result)
    lat = [r for r in recs.values() if r["method"] == "peer_lat"]
    assert len(lat) == 4 and all(r["median_ms"] > 0 and r["ratio_vs_sdpa"] > 0 for r in lat)
    assert all(r["rel_err"] < 1e-4 for r in lat)  # against the same (fake) peer in float64
    assert all("build failed" in r["error"] for r in recs.values() if r["method"] == "peer_performer")
    assert all("fake peer failure" in r["error"] for r in recs.values() if r["method"] == "peer_linformer")
    assert recs["core/sdpa/B1/H2/d16/N64/full/fwd"]["median_ms"] > 0


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
    recs = _by_key(result)
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
