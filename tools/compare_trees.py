"""Speed of two checkouts of linear_mha in ONE process: did a change make anything slower?

    git worktree add /tmp/before <commit>
    python -m linear_mha.tools.compare_trees /tmp/before --rounds 11 --json docs/results/compare_trees.json --png cmp.png

The older checkout's ``linear_mha`` is copied into a temporary folder as ``linear_mha_before`` and imported beside
the current one (the package imports itself relatively), so both sides run in the same process, on the same
inputs and threads, interleaved call by call (``measure.round_robin``): a slow phase of a shared machine hits both.
The cases cover the paths a refactor of the attention code can slow: kernel attention (compiled, fused causal and
composed paths), Efficient Attention, a module's call, a module's training step with the output gate and the local
term, the recurrent decoding step, and an LM's generation, plain and patched with a learnable method. ``--only``
keeps the cases whose names contain one of its words. Each row has the ratio of the medians and the median of the
per-round ratios (``measure.paired_ratio``); ratios after/before near 1 are noise; the JSON keeps every run.

    python -m linear_mha.tools.compare_trees /tmp/before --only "training step" --rounds 15
"""
import argparse
import atexit
import importlib
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter

from . import measure as M


def import_checkout(root: Path, alias: str = "linear_mha_before"):
    """The ``linear_mha`` package of the checkout at ``root``, imported under ``alias``."""
    source = Path(root) / "linear_mha"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"{root} holds no linear_mha package (expected {source}/__init__.py)")
    folder = Path(tempfile.mkdtemp(prefix="compare_trees."))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # kept while the process may import from it
    shutil.copytree(source, folder / alias, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(alias)
    finally:
        sys.path.remove(str(folder))


def training_steps(lib, n: int, seed: int = 0) -> dict:
    """A self-attention module's forward + backward (taylor, 8 heads of 64) on n tokens of a square grid, plain,
    with the output gate and with the 3 x 3 local term (their parameters made nonzero, as after training)."""
    side = math.isqrt(n)
    g = torch.Generator().manual_seed(seed)
    x, grad = torch.randn(1, side * side, 512, generator=g), torch.randn(1, side * side, 512, generator=g)
    steps = {}
    for label, options in (("", {}), (" + gate", {"output_gate": True}), (" + dwc3", {"dwc_kernel": 3})):
        name = f"module taylor{label}, training step, {side * side} x 512 (ms)"
        torch.manual_seed(seed)
        try:
            module = lib.LinearMultiheadAttention(512, 8, mode="taylor", batch_first=True, **options)
        except (TypeError, ValueError) as exc:  # an older checkout without the option: a row saying so
            steps[name] = (_raising(exc), 1e3)
            continue
        with torch.no_grad():
            for parameter in ("gate_weight", "dwc_weight"):
                if getattr(module, parameter, None) is not None:
                    getattr(module, parameter).normal_(0, 0.02)
        grid = {"token_grid": lib.TokenGrid(side, side)} if "dwc_kernel" in options else {}
        leaf = x.clone().requires_grad_()

        def step(module=module, leaf=leaf, grid=grid):
            module(leaf, leaf, leaf, need_weights=False, **grid)[0].backward(grad)
            leaf.grad = None
            module.zero_grad(set_to_none=True)
        steps[name] = (step, 1e3)
    return steps


def _raising(exc: Exception):
    def run():
        raise exc
    return run


def cases(lib, n: int, steps: int, prompt: int, seed: int = 0) -> dict:
    """name -> (zero-argument callable, scale from seconds to the unit in the name), built on package ``lib``."""
    F = lib.functional
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    x = torch.randn(2, n // 4, 256, generator=g)
    torch.manual_seed(seed)
    module = lib.LinearMultiheadAttention(256, 4, mode="kernel", batch_first=True).eval()
    q1, k1, v1 = (torch.randn(1, 8, 64, generator=g) for _ in range(3))
    state = F.kernel_state(torch.randn(1, 8, 100, 64, generator=g), torch.randn(1, 8, 100, 64, generator=g), "elu")
    tokens = torch.randint(0, 256, (1, prompt), generator=g)

    def lm(**options):
        torch.manual_seed(seed)
        return lib.LinearAttentionTransformerLM(256, 128, 2, prompt + 16, heads=4, dim_head=32, causal=True,
                                                **options).eval()
    plain = lib.AutoregressiveWrapper(lm())
    softmax_lm = lm(n_local_attn_heads=4, local_attn_window_size=prompt + 16)
    lib.patch(softmax_lm, "hedgehog")
    patched = lib.AutoregressiveWrapper(softmax_lm)

    def inference(fn):
        def run():
            with torch.inference_mode():
                fn()
        return run

    def backward(causal):
        def run():
            F.kernel(qg, kg, vg, "elu", causal=causal).sum().backward()
        return run

    def decode():
        s = state.clone()
        for _ in range(steps):
            F.kernel_step(q1, k1, v1, s, "elu", inplace=True)

    def generate(wrapper):
        return lambda: wrapper.generate(tokens, 16, generator=torch.Generator().manual_seed(seed))

    return {
        f"kernel elu, fwd, N={n} (ms)": (inference(lambda: F.kernel(q, k, v, "elu")), 1e3),
        f"kernel elu, causal fwd, N={n} (ms)": (inference(lambda: F.kernel(q, k, v, "elu", causal=True)), 1e3),
        f"kernel elu, fwd+bwd, N={n} (ms)": (backward(False), 1e3),
        f"kernel elu, causal fwd+bwd, N={n} (ms)": (backward(True), 1e3),
        f"taylor, fwd, N={n} (ms)": (inference(lambda: F.taylor(q, k, v)), 1e3),
        f"taylor, causal fwd, N={n} (ms)": (inference(lambda: F.taylor(q, k, v, causal=True)), 1e3),
        f"efficient, fwd, N={n} (ms)": (inference(lambda: F.efficient_attention(q, k, v)), 1e3),
        f"module kernel, 2 x {n // 4} x 256 (ms)": (inference(lambda: module(x, x, x)), 1e3),
        "kernel_step elu (us per step)": (inference(decode), 1e6 / steps),
        f"LM, 16 tokens after {prompt} (ms)": (inference(generate(plain)), 1e3),
        f"hedgehog-patched softmax LM, 16 tokens after {prompt} (ms)": (inference(generate(patched)), 1e3),
        **training_steps(lib, n, seed),
    }


def plot(rows: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(rows)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.2))
    ax.barh(names, [rows[n]["ratio"] for n in names], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("time after / before (median of interleaved runs)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.compare_trees", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("before", type=Path, help="root of the older checkout (e.g. a git worktree)")
    p.add_argument("--rounds", type=int, default=11, help="interleaved runs of every case on each side")
    p.add_argument("--n", type=int, default=16384, help="sequence length of the attention cases")
    p.add_argument("--steps", type=int, default=500, help="decoding steps per timed call")
    p.add_argument("--prompt", type=int, default=256, help="prompt length of the generation cases")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="+", metavar="WORD", help="only the cases whose names contain one of these")
    p.add_argument("--json", type=Path, help="write every run and the medians here")
    p.add_argument("--png", type=Path, help="draw the ratios here")
    a = p.parse_args(argv)
    M.pin_threads(a.threads)
    import linear_mha
    sides = {"before": import_checkout(a.before), "after": linear_mha}
    built = {side: cases(lib, a.n, a.steps, a.prompt) for side, lib in sides.items()}
    if a.only:
        built = {side: {name: case for name, case in named.items() if any(word in name for word in a.only)}
                 for side, named in built.items()}
        if not built["after"]:
            raise SystemExit(f"--only {' '.join(a.only)}: no case's name contains any of these; the cases: "
                             f"{', '.join(cases(linear_mha, 64, 1, 4))}")
    timed = M.round_robin({f"{side}|{name}": fn for side in built for name, (fn, _) in built[side].items()},
                          repeats=a.rounds, warmup=1)
    rows = {}
    print(f"{'case':<62} {'before':>9} {'after':>9} {'after/before':>12} {'per round (quartiles)':>24}")
    for name, (_, scale) in built["after"].items():
        before, after = (timed[f"{side}|{name}"] for side in ("before", "after"))
        if "error" in before or "error" in after:
            rows[name] = {"error": before.get("error") or after.get("error")}
            print(f"{name:<62} error: {rows[name]['error']}")
            continue
        b, t = before["median_ms"] * scale / 1e3, after["median_ms"] * scale / 1e3
        paired = M.paired_ratio(timed, f"after|{name}", f"before|{name}")
        rows[name] = {"before": b, "after": t, "ratio": t / b, "runs": after["runs"],
                      "ratio_paired": paired["median"], "ratio_q1": paired["q1"], "ratio_q3": paired["q3"],
                      "before_round_ms": before["round_ms"], "after_round_ms": after["round_ms"]}
        print(f"{name:<62} {b:>9.2f} {t:>9.2f} {t / b:>12.3f} {paired['median']:>9.3f} ({paired['q1']:.3f}-"
              f"{paired['q3']:.3f})")
    result = {"command": "python -m linear_mha.tools.compare_trees " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": f"{M.cpu_name()} ({platform.machine()})", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows,
              "geometric_mean_ratio": statistics.geometric_mean([r["ratio"] for r in rows.values() if "ratio" in r])}
    print(f"geometric mean of the ratios: {result['geometric_mean_ratio']:.3f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    if a.png:
        plot({n: r for n, r in rows.items() if "ratio" in r}, a.png)
    return result


if __name__ == "__main__":
    main()
