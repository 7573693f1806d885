"""What a patch() or unpatch() call did: modules replaced, modules left alone and why, parameters added."""
from dataclasses import dataclass, field
from typing import List, Tuple


def _class_name(cls) -> str:
    module = cls.__module__
    if module.startswith("torch.nn.modules."):
        return f"nn.{cls.__qualname__}"
    if module.startswith("linear_mha.") or module == "builtins":
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


@dataclass
class PatchReport:
    """``replaced``: (qualified name, old class, new class); ``skipped``: (qualified name, class, reason);
    ``parameters_added``: scalars in parameters the mode introduced (a projection shared by several modules
    counts once); ``buffers_added``: scalars in new buffers (FAVOR+ projections); ``notes``: other changes made
    to the model (e.g. an nn.TransformerEncoder's nested-tensor path switched off)."""

    mode: str = ""
    replaced: List[Tuple[str, type, type]] = field(default_factory=list)
    skipped: List[Tuple[str, type, str]] = field(default_factory=list)
    parameters_added: int = 0
    buffers_added: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def num_replaced(self) -> int:
        return len(self.replaced)

    def table(self) -> str:
        rows = [(name or "<root>", _class_name(old), _class_name(new), "replaced") for name, old, new in self.replaced]
        rows += [(name or "<root>", _class_name(cls), "-", f"skipped: {reason}") for name, cls, reason in self.skipped]
        header = ("module", "class", "now", "status")
        widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(3)]

        def line(r):
            return "  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3]

        out = [f"mode={self.mode!r}: {len(self.replaced)} replaced, {len(self.skipped)} skipped, "
               f"{self.parameters_added:,} parameters added"
               + (f", {self.buffers_added:,} buffer elements added" if self.buffers_added else ""),
               line(header), line(tuple("-" * w for w in widths) + ("-" * 6,))]
        out += [line(r) for r in rows]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()
