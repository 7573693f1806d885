"""Cases of tools/benchmark.py: the methods compared, their inputs, runners (one call of a case, used for timing
and for the fresh-process memory measurement) and float64 references; FLOP counts are in benchmark_flops.py.

GB/s counts the bytes of q, k, v and out (x2 for fwdbwd: their gradients too).
Relative error (fwd output, N <= --err-max-n): exact attention in float64 for the core softmax methods, the same
method (same weights, projections) in float64 otherwise, and for flash-linear-attention (no float64 kernels) our
kernel_elu in float64: the check that the peer computes the same function.
"""
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import linear_mha.functional as LF
from linear_mha.integrations.detr.attention import parse_attention_options
from linear_mha import LinearMultiheadAttention, TokenGrid, method_class
from linear_mha.attend import attend_heads, needs_token_grid
from linear_mha.registry import create_method, method_presets

from . import measure as M
from .benchmark_flops import case_options, method_flops, plus_projections


# ------------------------------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class Method:
    build: Callable          # (case, dtype, device) -> (fn(*inputs) -> out, [modules])
    flops: Callable          # (case) -> FLOPs of one forward of the attention (module level adds projections), or None
    causal: bool = True      # has a causal form
    full: bool = True        # has a non-causal form
    kind: str = "linear"     # "sdpa" / "weights": quadratic, timed up to a cap and extrapolated beyond
    peer: Optional[str] = None  # import name of an optional third-party package
    devices: Tuple[str, ...] = ("cpu", "cuda")
    reference: Optional[str] = None  # float64 reference: this method of ours (same level), not the method itself


def _core(make):
    """make(case, dtype, device) -> fn(q, k, v); core functions own no modules."""
    return lambda c, dtype, device: (make(c, dtype, device), [])


def _method_core(mode, **options):
    """A registered method on (B, H, N, d) heads through ``attend_heads``, as every module runs it, with the state
    the method draws for itself (FAVOR+'s projection, Linformer's E and F, learnable maps at their start)."""
    cls = method_class(mode)

    def build(c, dtype, device):
        method = cls(**options, **case_options(mode, c))
        state = {key: None if t is None else t.detach().to(device=device, dtype=dtype)
                 for key, t in method.init_state(c["H"], c["d"], {"device": None, "dtype": None}).items()}
        grid = {"token_grid": square_grid(c["N"])} if method.needs_grid else {}  # its class's or its options' need
        return lambda q, k, v: attend_heads(method, state, q, k, v, is_causal=c["causal"], **grid)[0]
    return _core(build)


def _module(mode, **options):
    def build(c, dtype, device):
        m = LinearMultiheadAttention(c["H"] * c["d"], c["H"], batch_first=True, mode=mode, **options,
                                     **case_options(mode, c))
        m = m.to(device=device, dtype=dtype)
        grid = {"token_grid": square_grid(c["N"])} if needs_token_grid(m) else {}  # image methods, the local term
        return (lambda x: m(x, x, x, is_causal=c["causal"], **grid)[0]), [m]
    return build


def square_grid(n: int) -> TokenGrid:
    """The most nearly square h x w = n grid (n tokens of an image), h <= w."""
    h = max(f for f in range(1, int(n ** 0.5) + 1) if n % f == 0)
    return TokenGrid(h, n // h)


def _torch_mha(need_weights: bool):
    def build(c, dtype, device):
        m = nn.MultiheadAttention(c["H"] * c["d"], c["H"], batch_first=True).to(device=device, dtype=dtype)
        mask = torch.ones(c["N"], c["N"], dtype=torch.bool, device=device).triu(1) if c["causal"] else None
        return (lambda x: m(x, x, x, need_weights=need_weights, attn_mask=mask, is_causal=c["causal"])[0]), [m]
    return build


def _sdpa_backend(backend: str):
    """SDPA held to one of its CUDA kernels (FLASH_ATTENTION: fp16/bf16 only; EFFICIENT_ATTENTION: any float), so
    the table says which one a linear method is compared with instead of whichever SDPA picks."""
    def build(c, dtype, device):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kernel = getattr(SDPBackend, backend)

        def run(q, k, v):
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"])
        return run, []
    return build


def _peer_lat(c, dtype, device):
    lat = importlib.import_module("linear_attention_transformer.linear_attention_transformer")
    fn = lat.causal_linear_attn if c["causal"] else lat.linear_attn
    return (lambda q, k, v: fn(q, k, v)), []


def _peer_performer(c, dtype, device):
    performer = importlib.import_module("performer_pytorch")
    m = performer.FastAttention(dim_heads=c["d"], nb_features=LF.default_num_favor_features(c["d"]),
                                causal=c["causal"])
    m = m.to(device=device, dtype=dtype)
    return (lambda q, k, v: m(q, k, v)), [m]


def _peer_linformer(c, dtype, device):
    linformer = importlib.import_module("linformer")
    m = linformer.LinformerSelfAttention(dim=c["H"] * c["d"], seq_len=c["N"], heads=c["H"], k=c["proj_k"])
    return (lambda x: m(x)), [m.to(device=device, dtype=dtype)]


def _peer_fla(c, dtype, device):
    """flash-linear-attention's chunked causal linear attention (Triton, CUDA only) on elu + 1 features,
    normalised: the function kernel_elu computes (fla adds 1e-10 or 1e-5 to the denominator). Timed with the
    feature map and the change to fla's (B, T, H, K) layout, whose transposed views fla copies: a caller holding
    (B, H, N, d) tensors pays both. In float32, fla's Triton products run in TF32 unless told otherwise."""
    op = importlib.import_module("fla.ops.linear_attn").chunk_linear_attn
    params = inspect.signature(op).parameters
    if "cu_seqlens" not in params and "head_first" not in params:
        raise RuntimeError("this fla is too old for the benchmark: its chunk_linear_attn takes (B, H, T, K) only; "
                           "install a current fla-core")
    layout = {"head_first": False} if "head_first" in params else {}  # versions that still had the switch

    def run(q, k, v):
        fq, fk = F.elu(q) + 1, F.elu(k) + 1
        out = op(fq.transpose(1, 2), fk.transpose(1, 2), v.transpose(1, 2), scale=1.0, normalize=True, **layout)[0]
        return out.transpose(1, 2)
    return run, []


def _registered(level: str, mode: str, options: dict) -> Method:
    method = create_method(mode, options)
    flops, causal, full = method_flops(mode, options), method.causal, method.bidirectional  # options may change them
    if level == "core":
        return Method(_method_core(mode, **options), flops, causal=causal, full=full)
    return Method(_module(mode, **options), plus_projections(flops), causal=causal, full=full)


def registry_methods() -> dict:
    """(level, name) -> Method for every registered linear method (exact ones are SDPA's and nn.MultiheadAttention's
    rows), at both levels, one per preset, named "<method>_<preset>", read when called: methods registered before the
    benchmark runs are measured too."""
    methods = {}
    for name, options in method_presets().items():
        mode = options.pop("mode")
        for level in ("core", "module"):
            methods[(level, name)] = _registered(level, mode, options)
    return methods


# The accuracy work's module options on the fast path, each on top of the kernels' methods (issue 33: they must
# add no more than a few percent): suffix -> (module options, has a causal form, FLOPs per token and channel). The
# 3 x 3 local term convolves each channel over 9 neighbours; the output gate is a (d x d) product per head.
MODULE_OPTION_ROWS = {"dwc3": ({"dwc_kernel": 3}, False, lambda c: 2 * 9),
                      "gate": ({"output_gate": True}, True, lambda c: 2 * c["d"])}


def module_option_methods() -> dict:
    """("module", "<method>+<option>") -> Method for kernel_elu and taylor with each of MODULE_OPTION_ROWS."""
    rows, presets = {}, method_presets()
    for base in ("kernel_elu", "taylor"):
        options = dict(presets[base])
        mode = options.pop("mode")
        module_flops = plus_projections(method_flops(mode, options))
        for suffix, (extra, causal, per_channel) in MODULE_OPTION_ROWS.items():
            def flops(c, module_flops=module_flops, per_channel=per_channel):
                return module_flops(c) + c["B"] * c["N"] * c["H"] * c["d"] * per_channel(c)
            rows[("module", f"{base}+{suffix}")] = Method(_module(mode, **options, **extra), flops, causal=causal)
    return rows


def methods() -> dict:
    """Every method of the benchmark: the softmax and peer rows, and the registry's methods at both levels."""
    return {**METHODS, **registry_methods(), **module_option_methods()}


def method_row(level: str, name: str, known: Optional[dict] = None) -> Method:
    """The Method named ``name`` at ``level``: a row of ``methods()`` (``known``: a copy already made), or a
    registered method's row with options changed, written "row:key=value[,key=value]" (hedgehog:feature_dim=32,
    kernel_elu:chunk_size=32), the values as Python literals or bare words. Raises KeyError, or the registry's
    ValueError for an option the method does not take."""
    known = methods() if known is None else known
    if (level, name) in known:
        return known[(level, name)]
    row, sep, text = name.partition(":")
    presets = method_presets()
    if not sep or row not in presets:
        raise KeyError(f"{name!r} is no {level}-level method of the benchmark, nor 'row:key=value' with row one of "
                       f"the registered methods' rows ({', '.join(sorted(presets))})")
    options = {**presets[row], **parse_attention_options(filter(None, text.split(",")))}
    return _registered(level, options.pop("mode"), options)


def relu_squared(x):
    """A user's own elementwise feature map, as one would write it."""
    return torch.relu(x) ** 2


class Opaque:
    """A callable torch.fx cannot trace: the same map, kept on the path a user's map took before the kernels read
    maps as programs (PyTorch makes the features, the compiled products use them)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)


def _user_map(fn):
    return _core(lambda c, t, d: lambda q, k, v: LF.kernel(q, k, v, fn, causal=c["causal"]))


SOFTMAX_FLOPS = method_flops("softmax")
KERNEL_ELU_FLOPS = method_flops("kernel", {"feature_map": "elu"})
METHODS = {
    ("core", "sdpa"): Method(_core(lambda c, t, d: lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=c["causal"])), SOFTMAX_FLOPS, kind="sdpa"),
    ("core", "sdpa_flash"): Method(_sdpa_backend("FLASH_ATTENTION"), SOFTMAX_FLOPS, kind="sdpa", devices=("cuda",)),
    ("core", "sdpa_efficient"): Method(_sdpa_backend("EFFICIENT_ATTENTION"), SOFTMAX_FLOPS, kind="sdpa",
                                       devices=("cuda",)),
    ("core", "softmax_weights"): Method(_core(lambda c, t, d: lambda q, k, v: LF.softmax(
        q, k, v, causal=c["causal"], need_weights=True)[0]), SOFTMAX_FLOPS, kind="weights"),
    # Peers compute the function of one of our methods, and take its count.
    ("core", "peer_lat"): Method(_peer_lat, method_flops("efficient"), peer="linear_attention_transformer"),
    ("core", "peer_performer"): Method(_peer_performer, method_flops("kernel", {"feature_map": "favor"}, causal=False),
                                       peer="performer_pytorch"),
    ("core", "peer_fla"): Method(_peer_fla, KERNEL_ELU_FLOPS, peer="fla", full=False, devices=("cuda",),
                                 reference="kernel_elu"),
    # A user's elementwise map given as a callable: read as a program and run inside the kernels, and the same map
    # hidden from the reader (its features made by PyTorch ops first).
    ("core", "user_relu2"): Method(_user_map(relu_squared), KERNEL_ELU_FLOPS),
    ("core", "user_relu2_opaque"): Method(_user_map(Opaque(relu_squared)), KERNEL_ELU_FLOPS),
    ("module", "mha_sdpa"): Method(_torch_mha(False), plus_projections(SOFTMAX_FLOPS), kind="sdpa"),
    ("module", "mha_weights"): Method(_torch_mha(True), plus_projections(SOFTMAX_FLOPS), kind="weights"),
    ("module", "peer_linformer"): Method(_peer_linformer, plus_projections(method_flops("linformer")), causal=False,
                                         peer="linformer"),
}
BASELINE = {"core": "sdpa", "module": "mha_sdpa"}


def available_peers(device: str = "cpu") -> dict:
    """Peer import name -> "available" or why not; a missing peer only removes its rows. Peers that cannot run
    on ``device`` are not imported."""
    status = {}
    for peer in sorted({m.peer for m in METHODS.values() if m.peer}):
        if not any(m.peer == peer and device in m.devices for m in METHODS.values()):
            status[peer] = f"not for {device}"
            continue
        try:
            importlib.import_module(peer)
            status[peer] = "available"
        except Exception as exc:  # noqa: BLE001 - a broken install is reported, never fatal
            status[peer] = f"not importable ({type(exc).__name__})"
    return status


# --------------------------------------------------------------------------------------------------- cases
def case_key(c) -> str:
    return (f"{c['level']}/{c['method']}/B{c['B']}/H{c['H']}/d{c['d']}/N{c['N']}/"
            f"{'causal' if c['causal'] else 'full'}/{c['pass']}")


def make_inputs(c, dtype, device):
    # Drawn where they are used: on CUDA a CPU generator would spend seconds per gigabyte-sized group.
    g = torch.Generator(device).manual_seed(c["seed"] * 1_000_003 + c["N"])
    shape = (c["B"], c["H"], c["N"], c["d"]) if c["level"] == "core" else (c["B"], c["N"], c["H"] * c["d"])
    return [torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(3 if c["level"] == "core" else 1)]


def build_method(c, dtype, device):
    torch.manual_seed(c["seed"])  # the same module weights / random features in every dtype
    return method_row(c["level"], c["method"]).build(c, dtype, device)


def make_data(c, dtype, device):
    """(inputs, output gradient or None) of a case. Every method of a timing group shares one set: at
    B=4, N=65536 one q, k, v set is 1.6 GB in float32, and a copy per method would not fit in memory."""
    inputs = make_inputs(c, dtype, device)
    if c["pass"] == "fwd":
        return inputs, None
    g = torch.Generator(device).manual_seed(c["seed"] + 7)
    grad = torch.randn(inputs[0].shape, generator=g, device=device).to(dtype)
    return [t.requires_grad_() for t in inputs], grad


def build_runner(c, device, dtype, data=None, leaves=None):
    """A zero-argument callable that runs the case once; its inputs (``make_data``) are built outside it. With
    ``leaves``, the inputs in ``data`` are a callable that makes them from those leaves on each call (as a module
    splits its projection), and the leaves' gradients are the ones freed."""
    fn, modules = build_method(c, dtype, device)
    inputs, grad = make_data(c, dtype, device) if data is None else data
    inputs_now = inputs if leaves is not None else lambda: inputs
    if c["pass"] == "fwd":
        for m in modules:
            m.eval()

        def run_forward():
            with torch.inference_mode():
                fn(*inputs_now())
        return run_forward
    for m in modules:
        m.train()

    def run_forward_backward():
        fn(*inputs_now()).backward(grad)
        # Freed at the end, not the start, of a call: a memory baseline taken between calls then excludes the
        # gradients, so the measured extra memory of a call includes them.
        for t in inputs if leaves is None else leaves:
            t.grad = None
        for m in modules:
            m.zero_grad(set_to_none=True)
    return run_forward_backward


def memory_case(case: dict, device: str, dtype: str, threads: int):
    """Builder for tools/measure.py's fresh-process memory measurement (see measure.peak_extra_memory)."""
    M.pin_threads(threads)
    return build_runner(case, torch.device(device), getattr(torch, dtype))


def exact_softmax64(q, k, v, causal: bool, block: int = 256):
    """Exact softmax attention in float64, a block of queries at a time so memory stays O(block N)."""
    n, scale = q.shape[-2], q.shape[-1] ** -0.5
    cols = torch.arange(n, device=q.device)
    outs = []
    for s in range(0, n, block):
        scores = torch.matmul(q[..., s:s + block, :], k.transpose(-2, -1)) * scale
        if causal:
            rows = torch.arange(s, min(s + block, n), device=q.device)[:, None]
            scores = scores.masked_fill(cols[None] > rows, float("-inf"))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), v))
    return torch.cat(outs, dim=-2)


@torch.no_grad()
def reference_error(c, device, dtype) -> float:
    inputs = make_inputs(c, dtype, device)
    fn, modules = build_method(c, dtype, device)
    for m in modules:
        m.eval()
    out = fn(*inputs)
    x64 = M.to_float64(inputs)
    method = method_row(c["level"], c["method"])
    if c["level"] == "core" and method.kind != "linear":
        ref = exact_softmax64(*x64, causal=c["causal"])
    else:
        reference = method.reference
        fn64, modules64 = build_method(c if reference is None else dict(c, method=reference), torch.float64, device)
        for m in modules64:
            m.eval()
        ref = fn64(*x64)
    return M.relative_error(out, ref)


def decode_step_times(heads, dim, contexts, steps, repeats, seed, device, dtype):
    """us per recurrent decode step (kernel_step, elu, B=1) from the states of several context lengths, timed
    round-robin, as a new state per step (us_median, us_min) and updated in place (..._inplace); the step
    costs O(F Dv) whatever the context, so the times should not grow with it."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, dim, generator=g).to(device, dtype) for _ in range(3))
    runners = {}
    for ctx in contexts:
        keys, values = (torch.randn(1, heads, ctx, dim, generator=g).to(device, dtype) for _ in range(2))
        state = LF.kernel_state(keys, values, "elu")

        def run(state=state, inplace=False):
            with torch.inference_mode():
                for _ in range(steps):
                    LF.kernel_step(q, k, v, state, "elu", inplace=inplace)
        runners[str(ctx)] = run
        runners[f"{ctx}/inplace"] = functools.partial(run, state.clone(), True)
    timed = M.round_robin(runners, repeats=repeats, warmup=2, device=device)
    return [dict(context=ctx, B=1, H=heads, d=dim, us_median=timed[str(ctx)]["median_ms"] * 1e3 / steps,
                 us_min=timed[str(ctx)]["min_ms"] * 1e3 / steps,
                 us_median_inplace=timed[f"{ctx}/inplace"]["median_ms"] * 1e3 / steps,
                 us_min_inplace=timed[f"{ctx}/inplace"]["min_ms"] * 1e3 / steps) for ctx in contexts]


def main(argv=None):
    """``python -m linear_mha.tools.benchmark_cases``: list the methods tools.benchmark can time (--methods) and the peers."""
    import argparse
    from linear_mha.integrations.console import HelpFormatter
    argparse.ArgumentParser(prog="python -m linear_mha.tools.benchmark_cases", formatter_class=HelpFormatter,
                            description=__doc__ + "\nRun as a command, it lists the methods and peers; "
                                                  "python -m linear_mha.tools.benchmark times them.").parse_args(argv)
    rows = sorted(methods().items())
    for (level, name), method in rows:
        forms = {(True, True): "causal and not", (True, False): "causal only", (False, True): "non-causal only"}
        causal = forms[(method.causal, method.full)]
        extra = (f", peer package {method.peer}" if method.peer else "") + \
            (f", {'/'.join(method.devices)} only" if method.devices != ("cpu", "cuda") else "")
        print(f"  {level:<7} {name:<24} {causal}{extra}")
    for peer, status in available_peers().items():
        print(f"peer {peer}: {status}")


if __name__ == "__main__":
    main()
