"""The variant names the comparison tools take on their command lines (detr_compare's --variants, mqar's --methods):

    <method>[-dwc<K>][:<option>=<value>,...]      e.g. kernel, focused-dwc3:focusing_factor=2, softmax:rope=True

<method> is a method of linear_mha's registry (or a name the tool itself defines), ``-dwc<K>`` adds the local term (a
depthwise convolution of the values, kernel K) and the options after ``:`` go to the method, their values read as
Python literals where they parse as one (``integrations.detr.attention.parse_attention_options``). Kept apart from
the tools so that one parser serves all of them and a tool need not import another's dependencies.
"""
import re
from typing import NamedTuple, Optional, Tuple


class VariantName(NamedTuple):
    base: str                  # a registry method, or a name the tool defines
    dwc_kernel: Optional[int]  # the local term's kernel size; None without "-dwc<K>"
    options: Tuple[str, ...]   # "option=value" items as written


def split_variant(name: str) -> VariantName:
    """'focused-dwc5:focusing_factor=2,learnable_scale=False' -> ('focused', 5, ('focusing_factor=2',
    'learnable_scale=False'))."""
    base, _, options = name.partition(":")
    local = re.fullmatch(r"(.+)-dwc(\d+)", base)
    if local:
        base = local.group(1)
    return VariantName(base, int(local.group(2)) if local else None, tuple(filter(None, options.split(","))))
