"""The built-in attention methods as the tests enumerate them: read from linear_mha's registry, so a method added
to the library is tested by every parametrized check without editing a list here."""
import linear_mha

BUILT_IN = linear_mha.available_methods()  # at collection, before any test registers a method of its own
# Methods that attend over an image's token grid (agent) need one in every call: the generic checks below run on
# plain sequences, and tests/test_agent.py checks those methods on grids.
GRID = [m for m in BUILT_IN if linear_mha.method_class(m).needs_grid]
SEQUENCE = [m for m in BUILT_IN if m not in GRID]
LINEAR = [m for m in SEQUENCE if not linear_mha.method_class(m).exact]
LINEAR_CAUSAL = [m for m in LINEAR if linear_mha.method_class(m).causal]
LINEAR_NON_CAUSAL = [m for m in LINEAR if not linear_mha.method_class(m).causal]


def sized(mode, length, **options):
    """Options for ``mode`` with its sequence-length option (Linformer's seq_len) set to ``length``; options the
    method does not have are dropped, so one call site serves every method."""
    cls = linear_mha.method_class(mode)
    kept = {k: v for k, v in options.items() if k in cls.options}
    if cls.sequence_length_option is not None:
        kept[cls.sequence_length_option] = length
    return kept


def _variants():
    found = {}
    for mode in SEQUENCE:
        cls = linear_mha.method_class(mode)
        for preset, options in (cls.presets or {None: {}}).items():
            found[mode if preset is None else f"{mode}_{preset}"] = dict(mode=mode, **options)
    return found


VARIANTS = _variants()  # "kernel_favor" -> {"mode": "kernel", "feature_map": "favor"}: each sequence method and preset
CAUSAL_VARIANTS = [name for name, options in VARIANTS.items() if linear_mha.method_class(options["mode"]).causal]
