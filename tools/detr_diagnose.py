"""Why linear attention loses AP in DETR's encoder: each method's attention on the exact inputs a trained DETR's
encoder sees (positions added to queries and keys, image padding masked), against that DETR's own softmax attention.

    python -m linear_mha.tools.detr_diagnose runs/detr_cmp/softmax/seed42/checkpoint.pth --images 32 --json diag.json

For every encoder layer of the (softmax-trained) checkpoint, on validation images: the norms of q and k per head and
the spread of the softmax scores (how peaked trained attention is), then for every linear method of the registry
(each preset; learnable state at its initialisation) the weights it would use on the same q, k (its L x S matrix:
its own attention on an identity value matrix) compared with softmax's: the mean total-variation distance per query
row (0 = the same weights, 1 = disjoint), the rows' entropy against softmax's, the largest weight per row (how far a
method can focus), the error of its output on the layer's values, and the same output in float32 against float64
(accumulation error).
"""
import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from linear_mha.integrations.console import HelpFormatter
from linear_mha import TokenGrid, method_class
from linear_mha.registry import method_presets
from linear_mha.attend import attend_heads
from linear_mha.integrations.detr.checkpoint import load_checkpoint
from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.datasets import build_dataset
from linear_mha.integrations.detr.detr import build_model
from linear_mha.integrations.detr.misc import collate_fn


def registry_variants(names=None) -> dict:
    """name -> (method, options): every preset of every linear method in the registry (or those ``names``) with a
    non-causal form, as DETR's encoder attends."""
    found = {name: (options.pop("mode"), options) for name, options in method_presets().items()
             if method_class(options["mode"]).bidirectional}
    if names:
        unknown = sorted(set(names) - set(found))
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; choose from {sorted(found)}")
        found = {name: found[name] for name in names}
    return found


def method_output(mode, options, q, k, v, kpm, grid):
    """The method's attention of v on these q, k, with whatever state it owns at its initialisation (learnable maps
    untrained, Linformer's E and F drawn; the same draw in every call). On an identity v it gives the (B, H, L, S)
    weights the method uses."""
    cls = method_class(mode)
    sized = {cls.sequence_length_option: k.shape[2]} if cls.sequence_length_option else {}
    method = cls(**options, **sized)
    torch.manual_seed(0)
    state = {key: None if t is None else t.detach().to(q) for key, t in
             method.init_state(q.shape[1], q.shape[-1], {"device": q.device, "dtype": torch.float64}).items()}
    return attend_heads(method, state, q, k, v, key_padding_mask=kpm, token_grid=grid)[0]


def capture_encoder_inputs(model, samples):
    """(q, k, v, key_padding_mask) as each encoder layer's self-attention receives them, and the token grid (the
    feature map's height x width) they come from."""
    captured, grids = [], []

    def hook(module, args, kwargs):
        q, k, v = args[:3] if len(args) >= 3 else (args[0], args[1], kwargs["value"])
        captured.append((q.detach(), k.detach(), v.detach(), kwargs.get("key_padding_mask")))
    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in model.transformer.encoder.layers]
    handles.append(model.transformer.register_forward_pre_hook(
        lambda module, args: grids.append(TokenGrid(*args[0].shape[-2:]))))
    with torch.no_grad():
        model(samples)
    for h in handles:
        h.remove()
    return captured, grids[0]


@torch.no_grad()
def heads(attn, q, k, v):
    """nn.MultiheadAttention's in-projection to (B, H, N, d) heads, in float64."""
    E, H = attn.embed_dim, attn.num_heads
    w, b = attn.in_proj_weight.double(), attn.in_proj_bias.double()
    out = []
    for i, x in enumerate((q, k, v)):
        y = F.linear(x.double(), w[i * E:(i + 1) * E], b[i * E:(i + 1) * E])  # (N, B, E)
        out.append(y.reshape(y.shape[0], y.shape[1], H, E // H).permute(1, 2, 0, 3))
    return out


def row_stats(weights, valid):
    """Mean over valid query rows of entropy and largest weight; weights (B, H, L, S), valid (B, L)."""
    entropy = -(weights.clamp_min(1e-300).log() * weights).sum(-1)
    mask = valid[:, None, :].expand_as(entropy)
    return float(entropy[mask].mean()), float(weights.amax(-1)[mask].mean())


@torch.no_grad()
def diagnose_layer(q, k, v, kpm, grid, variants):
    d = q.shape[-1]
    valid = ~kpm
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    ref_w = torch.softmax(scores.masked_fill(kpm[:, None, None, :], float("-inf")), -1)
    ref_out = ref_w @ v
    eye = torch.eye(k.shape[2], dtype=q.dtype).expand(*k.shape[:2], -1, -1)
    ent, peak = row_stats(ref_w, valid)
    score_valid = scores.masked_fill(~(valid[:, None, :, None] & valid[:, None, None, :]), float("nan"))
    layer = {"q_norm": float(q.norm(dim=-1)[valid[:, None].expand(q.shape[:3])].mean()),
             "k_norm": float(k.norm(dim=-1)[valid[:, None].expand(k.shape[:3])].mean()),
             "score_std": float(torch.nanmean((score_valid - torch.nanmean(score_valid, -1, keepdim=True)) ** 2) ** 0.5),
             "softmax": {"entropy": ent, "max_weight": peak}, "methods": {}}
    for name, (mode, options) in variants.items():
        w = method_output(mode, options, q, k, eye, kpm, grid)
        out = w @ v
        tv = 0.5 * (w - ref_w).abs().sum(-1)
        ent, peak = row_stats(w.clamp_min(0), valid)
        mask = valid[:, None, :].expand_as(tv)
        out32 = method_output(mode, options, q.float(), k.float(), v.float(), kpm, grid)
        negative = (-w).clamp_min(0).sum(-1)  # weight below zero (inline, mala): TV may then exceed 1 by as much
        layer["methods"][name] = {
            "tv_distance": float(tv[mask].mean()), "negative_mass": float(negative[mask].mean()), "entropy": ent,
            "max_weight": peak,
            "output_rel_err": float((out - ref_out)[mask].norm() / ref_out[mask].norm()),
            "float32_rel_err": float((out32.double() - out)[mask].norm() / out[mask].norm())}
    return layer


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.detr_diagnose", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("checkpoint", help="a softmax DETR checkpoint written by linear-mha-detr-train")
    p.add_argument("--images", type=int, default=32, help="validation images to run (one batch)")
    p.add_argument("--json", help="write the numbers here")
    p.add_argument("--methods", nargs="+", help="these registry methods / presets only (default: every linear one)")
    a = p.parse_args(argv)
    variants = registry_variants(a.methods)
    ckpt = load_checkpoint(a.checkpoint, "checkpoint")
    saved = ckpt["args"]
    args = parse_args(["--backbone", saved["backbone"]])
    vars(args).update({k: v for k, v in saved.items() if k in vars(args)})
    args.attention, args.dwc_kernel = "softmax", 0
    model, _, _ = build_model(args)
    model.load_state_dict(ckpt["model"])
    model.eval()
    dataset = build_dataset("val", args)
    samples, _ = collate_fn([dataset[i] for i in range(min(a.images, len(dataset)))])
    layers = []
    inputs, grid = capture_encoder_inputs(model, samples)
    for layer, (q, k, v, kpm) in zip(model.transformer.encoder.layers, inputs):
        qh, kh, vh = heads(layer.self_attn, q, k, v)
        layers.append(diagnose_layer(qh, kh, vh, kpm, grid, variants))
    for i, layer in enumerate(layers):
        print(f"\nencoder layer {i}: |q| {layer['q_norm']:.2f}, |k| {layer['k_norm']:.2f}, softmax score std "
              f"{layer['score_std']:.2f}, softmax row entropy {layer['softmax']['entropy']:.2f} (uniform: "
              f"{math.log(qh.shape[2]):.2f}), largest weight {layer['softmax']['max_weight']:.3f}")
        print("| method | TV distance to softmax | row entropy | largest weight | output error | float32 error |")
        print("|---|---|---|---|---|---|")
        for name, m in layer["methods"].items():
            print(f"| {name} | {m['tv_distance']:.3f} | {m['entropy']:.2f} | {m['max_weight']:.3f} | "
                  f"{m['output_rel_err']:.3f} | {m['float32_rel_err']:.1e} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"checkpoint": a.checkpoint, "images": a.images, "layers": layers},
                                           indent=1))
    return layers


if __name__ == "__main__":
    main()
