"""Every registered method on the models users patch, under torch.compile: graph breaks counted with
torch._dynamo.explain, then compiled with fullgraph=True (static shapes, and dynamic=True at a second size) and held
to eager. The tests run a representative part of this matrix; this runs all of it and writes the table.

    python -m linear_mha.tools.compile_matrix --json docs/results/compile_matrix.json
    python -m linear_mha.tools.compile_matrix --models vit detr --methods kernel taylor

Models: a patched nn.TransformerEncoder (a bool src_key_padding_mask, which it turns into a float one; causal too
for causal methods), a patched timm ViT, our DETR over a padded batch of images, Hugging Face BERT (padded) and Llama
(left padded, causal methods). A method a model cannot take (a sequence-only method on an image grid, say) is
listed as not applicable with the reason patch or the model gives.
"""
import argparse
import json
import platform
import sys
import time
import warnings

import torch
from torch import nn

import linear_mha
from linear_mha.integrations.console import HelpFormatter

MODELS = ("encoder", "vit", "detr", "bert", "llama")
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def _sized(method: str, tokens: int) -> dict:
    option = linear_mha.method_class(method).sequence_length_option
    return {option: tokens} if option else {}


def _encoder(method, causal):
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                    enable_nested_tensor=False).eval()
    linear_mha.patch(encoder, method, **_sized(method, 24))

    def inputs(tokens):
        x = torch.randn(2, tokens, 32)
        if causal:
            return (x,), {"mask": nn.Transformer.generate_square_subsequent_mask(tokens), "is_causal": True}
        padding = torch.zeros(2, tokens, dtype=torch.bool)
        padding[1, tokens * 2 // 3:] = True
        return (x,), {"src_key_padding_mask": padding}
    return encoder, inputs


def _vit(method, causal):
    import timm
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                            embed_dim=32, num_heads=2, num_classes=0, dynamic_img_size=True).eval()
    linear_mha.patch(vit, method, **_sized(method, 1 + 8 * 8))
    return vit, lambda size: ((torch.randn(2, 3, size, size),), {})


def _detr(method, causal):
    from linear_mha.integrations.detr.attention import apply_attention
    from linear_mha.integrations.detr.config import parse_args
    from linear_mha.integrations.detr.detr import build_model
    from linear_mha.integrations.detr.misc import NestedTensor
    base = ["--backbone", "tiny", "--hidden-dim", "32", "--nheads", "4", "--enc-layers", "2", "--dec-layers", "1",
            "--dim-feedforward", "64", "--num-queries", "5", "--num-classes", "4"]
    torch.manual_seed(0)
    detr = build_model(parse_args(base))[0].eval()
    apply_attention(detr, parse_args(base + ["--attention", method]), max_tokens=300)

    class Boxes(nn.Module):
        def __init__(self):
            super().__init__()
            self.detr = detr

        def forward(self, images, padding):
            return self.detr(NestedTensor(images, padding))["pred_boxes"]

    def inputs(size):
        padding = torch.zeros(2, size, size, dtype=torch.bool)
        padding[1, :, size // 2:] = True
        return (torch.randn(2, 3, size, size), padding), {}
    return Boxes(), inputs


def _hf(family):
    def build(method, causal):
        from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
        if family == "bert":
            model = BertModel(BertConfig(**small, vocab_size=64, max_position_embeddings=64))
        else:
            model = LlamaForCausalLM(LlamaConfig(**small, vocab_size=64, num_key_value_heads=2,
                                                 max_position_embeddings=64))
        model.eval()
        linear_mha.patch(model, method, **_sized(method, 64))

        class First(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, ids, mask):
                return self.model(input_ids=ids, attention_mask=mask)[0]

        def inputs(tokens):
            mask = torch.ones(2, tokens, dtype=torch.long)
            mask[1, :3] = 0 if family == "llama" else 1  # left padding for the causal LM
            if family == "bert":
                mask[1, -3:] = 0
            return (torch.randint(1, 64, (2, tokens)), mask), {}
        return First(), inputs
    return build


BUILDERS = {"encoder": _encoder, "vit": _vit, "detr": _detr, "bert": _hf("bert"), "llama": _hf("llama")}
SIZES = {"encoder": (12, 20), "vit": (32, 40), "detr": (64, 96), "bert": (10, 16), "llama": (10, 16)}


def check(model_name: str, method: str) -> dict:
    """One cell: graph breaks, fullgraph (static, then dynamic at another size) against eager."""
    cls = linear_mha.method_class(method)
    causal = model_name == "llama" or (model_name == "encoder" and cls.causal)
    row = {"model": model_name, "method": method, "causal": causal}
    if model_name == "llama" and not cls.causal:
        return {**row, "status": "not applicable", "why": f"{method} has no causal form"}
    try:
        model, inputs = BUILDERS[model_name](method, causal)
    except (ValueError, TypeError) as err:  # patch or the model refuses the method, saying why
        return {**row, "status": "not applicable", "why": str(err).split("\n")[0][:200]}
    first, second = SIZES[model_name]
    args, kwargs = inputs(first)
    started = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            eager = model(*args, **kwargs)
        except (ValueError, TypeError) as err:
            return {**row, "status": "not applicable", "why": str(err).split("\n")[0][:200]}
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(*args, **kwargs)
        row["graph_breaks"] = explained.graph_break_count
        row["break_reasons"] = [str(r.reason).split("\n")[0][:200] for r in explained.break_reasons]
        try:
            torch._dynamo.reset()
            got = torch.compile(model, fullgraph=True, backend="aot_eager")(*args, **kwargs)
            row["static_max_error"] = float((got - eager).abs().max())
            torch.testing.assert_close(got, eager, **TOLERANCE)
            torch._dynamo.reset()
            dynamic = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
            for size in (first, second):
                args2, kwargs2 = inputs(size)
                torch.testing.assert_close(dynamic(*args2, **kwargs2), model(*args2, **kwargs2), **TOLERANCE)
            row["status"] = "ok" if row["graph_breaks"] == 0 else "graph breaks"
        except Exception as err:  # reported in the table, the matrix goes on
            row["status"], row["why"] = "failed", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.compile_matrix", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--methods", nargs="+", default=None, help="registry methods (default: every one)")
    p.add_argument("--json", help="write every cell here, with the machine and torch version")
    a = p.parse_args(argv)
    methods = a.methods or list(linear_mha.available_methods())
    rows = []
    print("model | method | status | graph breaks | max |compiled - eager| (static) | s")
    for model_name in a.models:
        for method in methods:
            row = check(model_name, method)
            rows.append(row)
            print(f"{row['model']} | {row['method']} | {row['status']} | {row.get('graph_breaks', '-')} | "
                  f"{row.get('static_max_error', '-')} | {row.get('seconds', '-')}"
                  + (f"  ({row['why']})" if row.get("why") else ""), flush=True)
    failed = [r for r in rows if r["status"] not in ("ok", "not applicable")]
    print(f"{sum(r['status'] == 'ok' for r in rows)} ok, {len(failed)} not, "
          f"{sum(r['status'] == 'not applicable' for r in rows)} not applicable")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "machine": platform.machine(), "command": "python -m "
                       "linear_mha.tools.compile_matrix " + " ".join(sys.argv[1:] if argv is None else argv),
                       "rows": rows}, f, indent=1)
        print(f"wrote {a.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
