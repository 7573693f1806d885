"""JSON-lines run log and the PNG of loss and AP curves."""
import json
import warnings
from pathlib import Path


def read_log(path):
    """The entries of a JSON-lines log ([] when there is none). A last line cut short (the run was killed while
    writing it) is dropped with a warning: the epoch it described is run again on resume. Any other damage is a
    ValueError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except UnicodeDecodeError as exc:
        raise ValueError(f"log {path} is not text ({exc}); move it aside to start its log afresh") from None
    entries = []
    for n, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = None
        if not isinstance(entry, dict):
            if n == len(lines) and entry is None:
                warnings.warn(f"log {path}: its last line is cut short (the run stopped while writing it); "
                              f"dropped it", stacklevel=2)
                break
            raise ValueError(f"log {path}: line {n} is not a JSON object ({line[:80]!r}); fix or remove that line")
        entries.append(entry)
    return entries


def truncate_log(path, first_epoch):
    """Drops entries of epochs >= first_epoch, so a resumed run never logs an epoch twice."""
    kept = [e for e in read_log(path) if e.get("epoch", -1) < first_epoch]
    Path(path).write_text("".join(json.dumps(e) + "\n" for e in kept))


def append_log(path, entry):
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def plot_curves(log_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in read_log(log_path) if "epoch" in e]
    if not entries:
        return
    epochs = [e["epoch"] for e in entries]
    fig, (ax_loss, ax_ap) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train_loss", "train"), ("test_loss", "val")):
        if any(key in e for e in entries):
            ax_loss.plot(epochs, [e.get(key, float("nan")) for e in entries], marker="o", label=label)
    ax_loss.set(xlabel="epoch", ylabel="weighted loss", title="loss")
    ax_loss.legend()
    for key in ("AP", "AP50", "AP75"):
        if any(f"test_{key}" in e for e in entries):
            ax_ap.plot(epochs, [e.get(f"test_{key}", float("nan")) for e in entries], marker="o", label=key)
    ax_ap.set(xlabel="epoch", ylabel="COCO bbox", title="validation AP")
    ax_ap.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
