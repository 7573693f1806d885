"""Which attention modules a patch() call may touch: fnmatch patterns over qualified module names and/or a
callable, plus per-module options."""
import warnings
from fnmatch import fnmatchcase
from typing import Callable, List, Optional


def _as_patterns(value, name: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):  # a lone pattern, not a sequence of one-character patterns
        return [value]
    try:
        patterns = list(value)
    except TypeError:
        raise TypeError(f"{name} must be a list of fnmatch patterns (str), got {type(value).__name__}") from None
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{name} must contain only str patterns such as 'encoder.layers.*.self_attn', got {bad!r}")
    return patterns


class Selection:
    """``include``/``exclude``: fnmatch patterns over qualified names ('*' also crosses dots); ``filter(name,
    module) -> bool``. A module is selected when it matches include (or include is None), matches no exclude
    pattern, and filter (if any) returns True."""

    def __init__(self, include=None, exclude=None, filter: Optional[Callable] = None,
                 options_for: Optional[Callable] = None):
        self.include = _as_patterns(include, "include")
        self.exclude = _as_patterns(exclude, "exclude") or []
        if filter is not None and not callable(filter):
            raise TypeError(f"filter must be a callable filter(name, module) -> bool, got {type(filter).__name__}")
        if options_for is not None and not callable(options_for):
            raise TypeError(f"options_for must be a callable options_for(name, module) -> dict, "
                            f"got {type(options_for).__name__}")
        self.filter = filter
        self.options_for = options_for
        self._used = set()

    def why_not(self, name: str, module, use_filter: bool = True) -> Optional[str]:
        """None if the module is selected, else the reason it is not. use_filter=False only matches patterns
        (for modules the filter was not written for: already linear or unsupported)."""
        if self.include is not None:
            hits = [p for p in self.include if fnmatchcase(name, p)]
            if not hits:
                return "not matched by include"
            self._used.update(hits)
        hits = [p for p in self.exclude if fnmatchcase(name, p)]
        if hits:
            self._used.update(hits)
            return f"excluded by {hits[0]!r}"
        if use_filter and self.filter is not None and not self.filter(name, module):
            return "filter returned False"
        return None

    def options(self, name: str, module, base: dict) -> dict:
        if self.options_for is None:
            return dict(base)
        extra = self.options_for(name, module)
        if extra is None:
            return dict(base)
        if not isinstance(extra, dict):
            raise TypeError(f"options_for({name!r}, ...) must return a dict of options (or None), "
                            f"got {type(extra).__name__}")
        return {**base, **extra}

    def warn_unused(self) -> None:
        """A pattern that matched no attention module is most likely a typo: say so instead of patching less."""
        unused = [p for p in (self.include or []) + self.exclude if p not in self._used]
        if unused:
            warnings.warn(f"patch(): pattern(s) {unused} matched no attention module; module names look like "
                          f"'encoder.layers.0.self_attn' (see [n for n, _ in model.named_modules()])", stacklevel=3)
