"""Patch a timm or torchvision model (random init, nothing downloaded) with linear attention and compare it with
the original: the patch report, then per input size the output deviation, forward time and peak memory before
and after, as a table (optionally JSON and a PNG).

    python -m linear_mha.tools.patch_model vit_tiny_patch16_224 --mode linformer --option proj_k=64 --batch-sizes 1 8
    python -m linear_mha.tools.patch_model vit_small_patch16_224 --model-arg dynamic_img_size=True --img-sizes 224 448 \\
        --mode kernel --option feature_map='"favor"' --png vit_favor.png --json vit_favor.json
    python -m linear_mha.tools.patch_model torchvision:vit_b_16 --mode efficient

Names: a timm model name, or a torchvision one (prefix ``torchvision:`` when both libraries know the name).
Deviation: max |patched - original| / max |original| and the mean cosine similarity, on the model output (logits)
and on the head's input (the input of the classifier's final Linear: a ViT's pooled features; n/a without one).
Random weights make the linear approximation look worse than after fine-tuning, and torchvision zero-initialises
its ViT head, so there the logits are all zero and only the head's input says anything ("n/a" for the logits).
Time: the original's and the patched model's forwards interleaved (tools/measure.py's round_robin), median.
Peak memory: the extra memory of one forward, measured by tools/measure.py (CPU: in a fresh process that builds
the same model from the same seed; CUDA: torch's peak counters).
"""
import argparse
import ast
import copy
import json
from pathlib import Path

import torch

from linear_mha.integrations.console import HelpFormatter
from linear_mha import available_methods, method_class
from linear_mha.patching import calibrate, patch
from linear_mha.registry import DEFAULT_MODE, resolve_mode

from . import measure as M


def _literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word such as relu


def _key_values(items, flag):
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} expects key=value, got {item!r}")
        out[key] = _literal(value)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.patch_model", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", help="timm model name, or torchvision:<name>")
    p.add_argument("--mode", default=DEFAULT_MODE, choices=available_methods(),
                   help="the attention method (linear_mha.available_methods(); default: taylor, or linformer when "
                        "its options are given)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="LinearMultiheadAttention option, repeatable (e.g. proj_k=64, feature_map=favor)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="keyword for timm.create_model / torchvision.models.get_model (e.g. depth=4)")
    p.add_argument("--img-sizes", type=int, nargs="+", default=None,
                   help="square input sizes (default: the model's own; more than one needs a model that accepts "
                        "them, e.g. timm with dynamic_img_size=True)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per point; the median is reported")
    p.add_argument("--calibrate-steps", type=int, default=0,
                   help="also report the deviation after linear_mha.calibrate for this many steps (a learnable "
                        "--mode such as hedgehog), on random images")
    p.add_argument("--calibrate-lr", type=float, default=1e-2)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement (a fresh process per "
                                                            "point on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the report and measurements here")
    p.add_argument("--png", type=Path, default=None, help="plot time and memory vs tokens here (matplotlib)")
    return p.parse_args(argv)


def build_model(name: str, kwargs: dict):
    """Random init only: pretrained=False / weights=None, so nothing is downloaded."""
    if name.startswith("torchvision:"):
        import torchvision
        return torchvision.models.get_model(name.split(":", 1)[1], weights=None, **kwargs), "torchvision"
    try:
        import timm
    except ImportError:
        timm = None
    if timm is not None and timm.is_model(name):
        return timm.create_model(name, pretrained=False, **kwargs), "timm"
    import torchvision
    if name in torchvision.models.list_models():
        return torchvision.models.get_model(name, weights=None, **kwargs), "torchvision"
    raise SystemExit(f"unknown model {name!r}: not a timm model{'' if timm else ' (timm not installed)'} and not "
                     f"in torchvision.models.list_models()")


def native_img_size(model) -> int:
    size = getattr(getattr(model, "patch_embed", None), "img_size", None) or getattr(model, "image_size", None)
    if isinstance(size, (tuple, list)):
        size = size[0]
    return int(size or 224)


def token_count(model, img: int):
    """Tokens the attention sees at this image size, for ViT-style models (None when unknown)."""
    pe = getattr(model, "patch_embed", None)
    if pe is not None and hasattr(pe, "patch_size") and hasattr(model, "num_prefix_tokens"):
        ps = pe.patch_size[0] if isinstance(pe.patch_size, (tuple, list)) else pe.patch_size
        if type(pe).__name__ == "PatchEmbed":
            grid = -(-img // ps) if getattr(pe, "dynamic_img_pad", False) else img // ps  # padding rounds up
            return grid ** 2 + model.num_prefix_tokens
    if hasattr(model, "patch_size") and hasattr(model, "seq_length"):  # torchvision VisionTransformer
        return (img // model.patch_size) ** 2 + 1
    return None


def _classifier(model):
    """The classifier's final Linear (timm's get_classifier(), torchvision's ViT heads), or None (num_classes=0)."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else getattr(model, "heads", None)
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)] if isinstance(head, torch.nn.Module) else []
    return linears[-1] if linears else None


def outputs(model, x):
    """(output, input of the classifier's final Linear or None), in float32."""
    head, seen = _classifier(model), {}
    hook = None if head is None else head.register_forward_pre_hook(
        lambda module, args: seen.setdefault("features", args[0].detach().float()))
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        if hook is not None:
            hook.remove()
    out = out[0] if isinstance(out, tuple) else out
    return out.float(), seen.get("features")


def forward_case(model, model_args, mode, options, img, batch, dtype, seed, patched):
    """Builder for tools/measure.py's memory measurement: the model (patched or not), built as compare() builds it,
    and one forward of a (batch, 3, img, img) input."""
    torch.manual_seed(seed)
    net, _ = build_model(model, model_args)
    net = net.to(dtype=getattr(torch, dtype)).eval()
    if patched:
        patch(net, mode, **options)
    x = torch.randn(batch, 3, img, img, dtype=getattr(torch, dtype))

    def run():
        with torch.no_grad():
            net(x)
    return run


def peak_mib(args, model_args, options, img, batch, patched, device, model):
    if device.type == "cuda":
        x = torch.randn(batch, 3, img, img, device=device, dtype=getattr(torch, args.dtype))
        mem = M.cuda_peak_extra(lambda: model(x), device)
    else:
        mem = M.peak_extra_memory({"builder": "linear_mha.tools.patch_model:forward_case", "kwargs": dict(
            model=args.model, model_args=model_args, mode=args.mode, options=options, img=img, batch=batch,
            dtype=args.dtype, seed=args.seed, patched=patched)})
    return None if "error" in mem else mem["extra_bytes"] / M.MIB


def deviation(out, ref):
    """(max |out - ref| / max |ref|, mean cosine over the batch), or (None, None) when ref is all zero."""
    if ref is None or out is None or not bool(ref.abs().max() > 0):
        return None, None
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), ref.flatten(1), dim=1).mean()
    return float((out - ref).abs().max() / ref.abs().max()), float(cos)


def compare(args):
    torch.manual_seed(args.seed)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = _key_values(args.option, "--option")
    args.mode = resolve_mode(args.mode, options)
    model_args = _key_values(args.model_arg, "--model-arg")
    original, library = build_model(args.model, model_args)
    original = original.to(device=device, dtype=dtype).eval()
    img_sizes = args.img_sizes or [native_img_size(original)]
    length_option = method_class(args.mode).sequence_length_option  # Linformer's seq_len
    if length_option is not None and length_option not in options:
        longest = token_count(original, max(img_sizes))
        if longest is not None:  # the largest input this run feeds, native size or not
            options[length_option] = longest
    patched = copy.deepcopy(original)
    report = patch(patched, args.mode, **options)
    calibration = None
    if args.calibrate_steps:  # on random images of the first size, as the rest of the report uses
        g = torch.Generator().manual_seed(args.seed + 1)
        images = [torch.randn(max(args.batch_sizes), 3, img_sizes[0], img_sizes[0], generator=g).to(device, dtype)
                  for _ in range(8)]
        calibrated = copy.deepcopy(patched)
        calibration = calibrate(calibrated, images, steps=args.calibrate_steps, lr=args.calibrate_lr, seed=args.seed,
                                progress=False)
    rows = []
    for img in img_sizes:
        for batch in args.batch_sizes:
            x = torch.randn(batch, 3, img, img, device=device, dtype=dtype)
            ref, ref_features = outputs(original, x)
            out, features = outputs(patched, x)
            with torch.no_grad():
                timed = M.round_robin({"before": lambda: original(x), "after": lambda: patched(x)},
                                      repeats=args.repeats, device=device)
            t0, t1 = (timed[k].get("median_ms") for k in ("before", "after"))
            m0, m1 = (None, None) if args.no_memory else (
                peak_mib(args, model_args, options, img, batch, p, device, m) for p, m in ((False, original),
                                                                                          (True, patched)))
            dev, cos = deviation(out, ref)
            head_dev, head_cos = deviation(features, ref_features)
            row = {"img_size": img, "batch": batch, "tokens": token_count(original, img),
                   "max_rel_dev": dev, "cosine": cos, "head_input_max_rel_dev": head_dev,
                   "head_input_cosine": head_cos, "finite": bool(torch.isfinite(out).all()),
                   "ms_before": t0, "ms_after": t1, "peak_mib_before": m0, "peak_mib_after": m1}
            if calibration is not None:  # the same deviations after linear_mha.calibrate
                cal_out, cal_features = outputs(calibrated, x)
                row["calibrated_max_rel_dev"], row["calibrated_cosine"] = deviation(cal_out, ref)
                row["calibrated_head_input_max_rel_dev"], row["calibrated_head_input_cosine"] = deviation(
                    cal_features, ref_features)
            rows.append(row)
    return {"model": args.model, "library": library, "mode": args.mode, "options": options,
            "device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(),
            "memory": "not measured" if args.no_memory else (
                "cuda max_memory_allocated" if device.type == "cuda" else "cpu peak RSS, fresh process"),
            "report": report, "rows": rows,
            "calibration": None if calibration is None else {"steps": calibration.steps,
                                                             "layers": calibration.layers}}


def _fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def table(result) -> str:
    head = ("img", "batch", "tokens", "max rel dev", "cosine", "head in dev", "head in cos", "ms before",
            "ms after", "MiB before", "MiB after")
    lines = [f"{result['model']} ({result['library']}), mode={result['mode']!r} {result['options']}, "
             f"{result['device']} {result['dtype']}, {result['threads']} threads, memory: {result['memory']}",
             "  ".join(f"{h:>11}" for h in head)]
    for r in result["rows"]:
        cells = (r["img_size"], r["batch"], _fmt(r["tokens"], "d"), _fmt(r["max_rel_dev"], ".3e"),
                 _fmt(r["cosine"], ".4f"), _fmt(r["head_input_max_rel_dev"], ".3e"),
                 _fmt(r["head_input_cosine"], ".4f"), _fmt(r["ms_before"], ".2f"), _fmt(r["ms_after"], ".2f"),
                 _fmt(r["peak_mib_before"], ".1f"), _fmt(r["peak_mib_after"], ".1f"))
        lines.append("  ".join(f"{str(c):>11}" for c in cells) + ("" if r["finite"] else "  NON-FINITE OUTPUT"))
    if result.get("calibration"):
        lines.append(f"after calibrate({result['calibration']['steps']} steps on random images): max rel dev / "
                     f"cosine / head in dev / head in cos per row")
        for r in result["rows"]:
            lines.append(f"{r['img_size']:>11}  {r['batch']:>11}  " + "  ".join(f"{_fmt(r[k], spec):>11}" for k, spec in (
                ("calibrated_max_rel_dev", ".3e"), ("calibrated_cosine", ".4f"),
                ("calibrated_head_input_max_rel_dev", ".3e"), ("calibrated_head_input_cosine", ".4f"))))
    return "\n".join(lines)


def to_json(result) -> dict:
    report = result["report"]
    return {**{k: v for k, v in result.items() if k != "report"},
            "options": {k: repr(v) for k, v in result["options"].items()},
            "report": {"replaced": [n for n, _, _ in report.replaced],
                       "skipped": [{"name": n, "class": c.__name__, "reason": r} for n, c, r in report.skipped],
                       "parameters_added": report.parameters_added, "buffers_added": report.buffers_added,
                       "notes": report.notes}}


def plot(result, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["rows"], key=lambda r: r["batch"] * (r["tokens"] or 1))
    x = [r["batch"] * (r["tokens"] or 1) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ms", "forward time (ms)"), (axes[1], "peak_mib", "peak memory (MiB)")):
        for when, style in (("before", "o-"), ("after", "s--")):
            ys = [r[f"{key}_{when}"] for r in rows]
            if all(y is not None for y in ys):
                ax.plot(x, ys, style, label=f"{when} ({'softmax' if when == 'before' else result['mode']})")
        ax.set_xlabel("batch x tokens" if rows and rows[0]["tokens"] else "batch")
        ax.set_ylabel(label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend()
    fig.suptitle(f"{result['model']}: patched with mode={result['mode']!r} on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    result = compare(args)
    print(result["report"].table())
    print()
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(to_json(result), indent=2))
    if args.png:
        plot(result, args.png)
    return result


if __name__ == "__main__":
    main()
