"""The variants detr_compare and detr_step train and time, as trainer options: a method of the registry, the local term,
method options, or a named variant (VARIANTS); and which of them compute exact softmax (a table's baselines)."""
from linear_mha import method_class
from linear_mha.integrations.detr.attention import parse_attention_options
from linear_mha.integrations.detr.config import RECOMMENDED, RECOMMENDED_DWC_KERNEL, RECOMMENDED_OPTIONS

from .variant_names import split_variant

VARIANTS = {"linformer-shared": ["--attention", "linformer", "--param-sharing", "layerwise", "--proj-k", "64"]}
# DETR and the trainer's default Linear-DETR, spelled as variant names
DEFAULT_VARIANTS = ["softmax", f"{RECOMMENDED}-dwc{RECOMMENDED_DWC_KERNEL}:{','.join(RECOMMENDED_OPTIONS)}"]


def variant_args(name: str) -> list:
    """Trainer options of a variant: '<method or named variant>[-dwc<K>][:<option>=<value>,...]'."""
    base, dwc_kernel, options = split_variant(name)
    if base in VARIANTS:
        args = list(VARIANTS[base])
    else:
        method_class(base)  # an unknown method raises, listing the registered ones
        args = ["--attention", base]
    if dwc_kernel is not None:
        args += ["--dwc-kernel", str(dwc_kernel)]
    for option in options:
        args += ["--attention-option", option]
    return args


def check_options_reached(name: str, report) -> None:
    """Refuse a row whose model did not get what its variant name asks for (``apply_attention``'s report): an option
    dropped on the way would make the row another variant under this one's name (it happened: softmax's rope)."""
    _, dwc_kernel, items = split_variant(name)
    wanted = parse_attention_options(items, flag=f"--variants {name!r}:")
    for entry in report:
        asked = {**wanted, **({"dwc_kernel": dwc_kernel} if dwc_kernel and entry["target"] == "encoder" else {})}
        lost = {key: value for key, value in asked.items() if entry["options"].get(key) != value}
        if lost or (asked and entry["patch_report"] is None):
            raise RuntimeError(f"--variants {name!r}: the trainer's {entry['target']} attention did not get "
                               f"{lost or asked} (its options: {entry['options']}); the row would not be this "
                               f"variant")


def check_variants(parser, names) -> None:
    """Exit through ``parser`` naming the first variant name that does not resolve (an unknown method, say)."""
    for name in names:
        try:
            variant_args(name)
        except ValueError as err:
            parser.error(f"--variants {name!r}: {err}")


def computes_softmax(name: str) -> bool:
    """Whether a variant's encoder attention is exact softmax (with or without options), as the registry says."""
    args = variant_args(name)
    return method_class(args[args.index("--attention") + 1]).exact
