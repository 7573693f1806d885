"""Per-token decoding cost of a transformers Llama-style model, patched with linear attention and decoding with its
fixed-size state, against the same model with SDPA and its KV cache, at growing contexts, on the CPU or a GPU.

    python -m linear_mha.tools.hf_generation_bench --contexts 1024 2048 4096 8192 16384 32768 --json r.json --png r.png
    python -m linear_mha.tools.hf_generation_bench --device cuda --dtype bfloat16 --dim 1024 --depth 8 --heads 16 \
        --kv-heads 4 --json runs/cuda/hf_generation.json

For each context c: a prompt of c random tokens is prefilled (not timed), then --steps tokens are decoded one forward
at a time, each timed (on a GPU, synchronised before the clock is read); the table gives the median ms per token, tokens per
second, and the cache's bytes after the steps (a KV cache's
keys and values, or linear_mha's state: exact counts, not process memory). Every method runs on a copy of the same
model; the softmax rows are the model as it was (``sdpa``). Linear attention's point is that both columns stay flat
while the KV cache's grow with c.
"""
import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter
from linear_mha import patch
from linear_mha.patching import LinearStateCache
from linear_mha.patching.hf_generation import cache_classes, cache_keyword

from . import measure as M

METHODS = {"sdpa + KV cache": None, "hedgehog": {"mode": "hedgehog"},
           "hedgehog, window 16": {"mode": "hedgehog", "window": 16}, "kernel (elu)": {"mode": "kernel"},
           "gated_deltanet": {"mode": "gated_deltanet"}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def llama(dim: int, depth: int, heads: int, kv_heads: int, max_len: int, seed: int = 0, device="cpu",
          dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=depth,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def cache_bytes(cache) -> int:
    if isinstance(cache, cache_classes()[1]):  # linear_mha's: the methods' states
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.inference_mode()
def per_token(model, context: int, steps: int, linear: bool, seed: int = 0):
    """(ms per decoded token for each step, cache bytes after them) after a prefilled prompt of ``context`` tokens."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt = torch.randint(0, 256, (1, context), generator=g).to(device)
    cache = LinearStateCache() if linear else DynamicCache()
    keyword = cache_keyword(model)
    logits = model(prompt, use_cache=True, **{keyword: cache}).logits
    token = logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        _synchronize(device)
        start = time.perf_counter()
        logits = model(token, use_cache=True, **{keyword: cache}).logits
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        token = logits[:, -1:].argmax(-1)
    return times, cache_bytes(cache)


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plot(records, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["method"] for r in records):
        rows = [r for r in records if r["method"] == name]
        left.plot([r["context"] for r in rows], [r["ms_per_token"] for r in rows], "o-", label=name)
        right.plot([r["context"] for r in rows], [r["cache_mib"] for r in rows], "o-", label=name)
    for ax, label in ((left, "ms per generated token (median)"), (right, "cache after decoding (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.hf_generation_bench", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--steps", type=int, default=16, help="tokens decoded (and timed) after each prompt")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="of the model's weights")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    a = p.parse_args(argv)
    M.pin_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    base = llama(a.dim, a.depth, a.heads, a.kv_heads, max(a.contexts) + a.steps + 1, device=device,
                 dtype=DTYPES[a.dtype])
    models = {}
    for name in a.methods:
        model = copy.deepcopy(base)
        if METHODS[name] is not None:
            options = dict(METHODS[name])
            patch(model, options.pop("mode"), **options)
        models[name] = model
    records = []
    print(f"{'context':>8} {'method':<22} {'ms/token':>9} {'tokens/s':>9} {'cache MiB':>10}")
    for context in a.contexts:
        for name, model in models.items():
            times, size = per_token(model, context, a.steps, METHODS[name] is not None)
            median = statistics.median(times)
            record = dict(context=context, method=name, ms_per_token=median, tokens_per_s=1e3 / median,
                          times_ms=times, cache_bytes=size, cache_mib=size / 2 ** 20)
            records.append(record)
            print(f"{context:>8} {name:<22} {median:>9.2f} {record['tokens_per_s']:>9.1f} {record['cache_mib']:>10.3f}",
                  flush=True)
    result = {"command": "python -m linear_mha.tools.hf_generation_bench " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": (torch.cuda.get_device_name(device) if device.type == "cuda"
                          else f"{M.cpu_name()} ({platform.machine()})"),
              "threads": torch.get_num_threads(), "dtype": a.dtype,
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "model": dict(dim=a.dim, depth=a.depth, heads=a.heads, kv_heads=a.kv_heads), "records": records}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    if a.png:
        plot(records, a.png)
    return result


if __name__ == "__main__":
    main()
