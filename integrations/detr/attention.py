"""The attention choice of DETR (`--attention ...`), applied through the linear_mha patcher.

`softmax` leaves nn.MultiheadAttention untouched. Other modes replace the selected modules via
`linear_mha.patch(model, mode=..., include=[fnmatch pattern], **options)`. Linformer projects the key
axis of a fixed length, so its `seq_len` is the largest number of keys the module can ever see:
memory tokens of the largest padded feature map for encoder self-attention and cross-attention,
the number of object queries for decoder self-attention.
"""
from types import SimpleNamespace

from linear_mha import patch

TARGETS = {"encoder": "transformer.encoder.layers.*.self_attn",
           "decoder": "transformer.decoder.layers.*.self_attn",
           "cross": "transformer.decoder.layers.*.multihead_attn"}
MODES = ("softmax", "linformer", "kernel", "efficient", "taylor")


def parse_targets(text):
    """'encoder,cross' or 'all' -> ordered list of target names; unknown names raise naming the option."""
    names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if "all" in names:
        return list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(f"--attention-on {text!r}: choose a comma list of {list(TARGETS)} or 'all'")
    return [n for n in TARGETS if n in names]


def _options(mode, target, cfg, max_tokens, num_queries):
    if mode == "linformer":
        seq_len = num_queries if target == "decoder" else max_tokens
        if seq_len is None:
            raise ValueError("linformer needs max_tokens (the largest feature-map token count the data can produce)")
        return {"seq_len": int(seq_len), "proj_k": min(cfg.proj_k, int(seq_len)), "param_sharing": cfg.param_sharing}
    if mode == "kernel":
        return {"feature_map": cfg.feature_map}
    return {}


def apply_attention(model, args_or_kwargs=None, max_tokens=None, **kwargs):
    """Patches model's attention per `attention`, `attention_on`, `proj_k`, `param_sharing`, `feature_map`.

    args_or_kwargs: an argparse namespace or a dict (keyword arguments override it). max_tokens: the
    largest encoder sequence (see transforms.max_padded_hw / feature_tokens); needed for linformer.
    Returns a report: a list of {target, include, mode, options, patch_report}.
    """
    values = dict(vars(args_or_kwargs)) if args_or_kwargs is not None and not isinstance(args_or_kwargs, dict) \
        else dict(args_or_kwargs or {})
    values.update(kwargs)
    cfg = SimpleNamespace(**{"attention": "softmax", "attention_on": "encoder", "proj_k": 256,
                             "param_sharing": "layerwise", "feature_map": "elu", **values})
    if cfg.attention not in MODES:
        raise ValueError(f"--attention {cfg.attention!r}: choose one of {MODES}")
    targets = parse_targets(cfg.attention_on)
    if cfg.attention == "softmax":
        return [{"target": t, "include": [TARGETS[t]], "mode": "softmax", "options": {}, "patch_report": None}
                for t in targets]
    inner = getattr(model, "module", model)  # DDP-wrapped or not
    num_queries = getattr(inner, "num_queries", None)
    report = []
    for target in targets:
        options = _options(cfg.attention, target, cfg, max_tokens, num_queries)
        result = patch(inner, mode=cfg.attention, include=[TARGETS[target]], **options)
        report.append({"target": target, "include": [TARGETS[target]], "mode": cfg.attention, "options": options,
                       "patch_report": result})
    return report
