"""tools/benchmark.py's optional peers (flash-linear-attention, linear-attention-transformer, performer-pytorch,
linformer) through fake modules: what each computes, which it refuses, where each runs, and a peer's failure
reported in its rows."""
import sys
import types

import pytest
import torch
from torch import nn

import linear_mha.functional as LF
from linear_mha.tools import benchmark
from linear_mha.tools import benchmark_cases
from benchmark_checks import QUICK, by_key, keep_global_torch_state  # noqa: F401  (a module fixture)


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
    recs = by_key(result)
    lat = [r for r in recs.values() if r["method"] == "peer_lat"]
    assert len(lat) == 4 and all(r["median_ms"] > 0 and r["ratio_vs_sdpa"] > 0 for r in lat)
    assert all(r["rel_err"] < 1e-4 for r in lat)  # against the same (fake) peer in float64
    assert all("build failed" in r["error"] for r in recs.values() if r["method"] == "peer_performer")
    assert all("fake peer failure" in r["error"] for r in recs.values() if r["method"] == "peer_linformer")
    assert recs["core/sdpa/B1/H2/d16/N64/full/fwd"]["median_ms"] > 0
