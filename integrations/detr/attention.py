"""The attention choice of DETR (`--attention ...`), applied through the linear_mha patcher.

`--attention` takes any method in linear_mha's registry (`linear_mha.available_methods()`), including one a user
script registered before calling the trainer's `main`. `softmax` leaves nn.MultiheadAttention untouched. Other
methods replace the selected modules via `linear_mha.patch(model, mode=..., include=[fnmatch pattern], **options)`.
A method whose keys are bounded by an option (Linformer's `seq_len`) gets the largest number of keys the module can
ever see: memory tokens of the largest padded feature map for encoder self-attention and cross-attention, the number
of object queries for decoder self-attention. `--proj-k`, `--param-sharing` and `--feature-map` reach the methods
that have those options; `--attention-option NAME=VALUE` sets any option of the chosen method. `--output-gate` adds
linear_mha's output gate (identity at first) to every patched module. `--dwc-kernel K`
adds the local term (a K x K depthwise convolution of the values over the feature map) to encoder self-attention;
the patcher reads the feature map's grid from the transformer's input.
"""
import ast
from types import SimpleNamespace

from linear_mha import method_class, patch

TARGETS = {"encoder": "transformer.encoder.layers.*.self_attn",
           "decoder": "transformer.decoder.layers.*.self_attn",
           "cross": "transformer.decoder.layers.*.multihead_attn"}
FLAG_OPTIONS = ("proj_k", "param_sharing", "feature_map")  # trainer flags passed to methods with these options


def parse_targets(text):
    """'encoder,cross' or 'all' -> ordered list of target names; unknown names raise naming the option."""
    names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if "all" in names:
        return list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(f"--attention-on {text!r}: choose a comma list of {list(TARGETS)} or 'all'")
    return [n for n in TARGETS if n in names]


def parse_attention_options(items, flag="--attention-option"):
    """['proj_k=64', 'feature_map=relu'] -> {'proj_k': 64, 'feature_map': 'relu'}: values are Python literals where
    they parse as one, else strings. ``flag`` names where the items came from in an error."""
    options = {}
    for item in items or ():
        name, sep, text = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"{flag} {item!r}: expected NAME=VALUE, e.g. proj_k=64")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            value = text.strip()
        options[name.strip()] = value
    return options


def _options(mode, target, cfg, max_tokens, num_queries):
    cls = method_class(mode)
    options = {name: getattr(cfg, name) for name in FLAG_OPTIONS if name in cls.options}
    length_option = cls.sequence_length_option
    if length_option is not None:
        seq_len = num_queries if target == "decoder" else max_tokens
        if seq_len is None:
            raise ValueError(f"{mode} needs max_tokens (the largest feature-map token count the data can produce)")
        options[length_option] = int(seq_len)
        if "proj_k" in options:
            options["proj_k"] = min(options["proj_k"], int(seq_len))
    options.update(parse_attention_options(cfg.attention_option))
    if cfg.dwc_kernel:
        if target != "encoder":
            raise ValueError(f"--dwc-kernel adds a convolution over the feature map to encoder self-attention; the "
                             f"{target} attention has no such grid: use --attention-on encoder")
        options["dwc_kernel"] = cfg.dwc_kernel
    if cfg.output_gate:
        options["output_gate"] = True
    return options


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
                             "param_sharing": "layerwise", "feature_map": "elu", "attention_option": None,
                             "dwc_kernel": 0, "output_gate": False, **values})
    try:
        method_class(cfg.attention)
    except ValueError as err:
        raise ValueError(f"--attention {cfg.attention!r}: {err}") from None
    targets = parse_targets(cfg.attention_on)
    inner = getattr(model, "module", model)  # DDP-wrapped or not
    num_queries = getattr(inner, "num_queries", None)
    report = []
    for target in targets:
        options = _options(cfg.attention, target, cfg, max_tokens, num_queries)
        # A method that computes what nn.MultiheadAttention computes, with no option, leaves DETR's own modules.
        plain = not options and method_class(cfg.attention)().computes_torch_attention
        result = None if plain else patch(inner, mode=cfg.attention, include=[TARGETS[target]], **options)
        report.append({"target": target, "include": [TARGETS[target]], "mode": cfg.attention, "options": options,
                       "patch_report": result})
    return report
