"""Loading checkpoints without running anything from the file, for both trainers (DETR and the LM tool).

``torch.load`` unpickles: with ``weights_only=False`` a crafted file runs code as it loads. Every load here uses
``weights_only=True``, which admits tensors and plain Python values (dicts, lists, tuples, numbers, strings, None)
and, by name, the few classes a checkpoint may legitimately hold (``argparse.Namespace``, as an ``args`` entry). A
file that needs anything else is refused with the file, the flag and the class it asked for; nothing in it runs.
Our own checkpoints store only such values (``plain_rng_state``), so they always load.
"""
import argparse
import os
import pickle
import re
from contextlib import nullcontext
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

SAFE_CLASSES = (argparse.Namespace,)  # official DETR checkpoints keep their training args as a Namespace


def _allowing(classes):
    if hasattr(torch.serialization, "safe_globals"):  # torch >= 2.5
        return torch.serialization.safe_globals(list(classes))
    if hasattr(torch.serialization, "add_safe_globals"):  # torch 2.4: process-wide
        torch.serialization.add_safe_globals(list(classes))
    return nullcontext()


def safe_load(path, flag: str, *, map_location="cpu", extra_classes: Iterable[type] = ()):
    """``torch.load(path, weights_only=True)`` with SAFE_CLASSES (and ``extra_classes``) allowed. Errors name
    ``flag`` and the file: missing, unreadable (empty, truncated, not a checkpoint) or refused (it needs a class
    that could run code); ``convert_hint`` is added to the refusal when our own older checkpoints may cause it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path} does not exist")
    try:
        with _allowing(SAFE_CLASSES + tuple(extra_classes)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        wanted = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if wanted:
            raise ValueError(
                f"{flag} {path} was refused: loading it would need the class or function {wanted.group(1)}, and a "
                f"checkpoint may only hold tensors and plain values (the file could run code as it loads; nothing in "
                f"it was run). If it is a checkpoint this project wrote before version 0.2 and you trust it, convert "
                f"it once with: python -m linear_mha.integrations.checkpoint_io {path} converted.pth --trust") from None
        raise ValueError(f"{flag} {path} is not a readable checkpoint ({_reason(exc)})") from None
    except Exception as exc:  # torn, empty or foreign files: the unpickler fails in many ways (IndexError, ...)
        raise ValueError(f"{flag} {path} is not a readable checkpoint ({_reason(exc)})") from None


def _reason(exc: Exception) -> str:
    """Why torch could not read a file, in one line, without torch's advice to retry with ``weights_only=False``:
    for a damaged or foreign file that advice means running whatever code it holds."""
    text = str(exc)
    detail = re.search(r"WeightsUnpickler error: (.+)", text)
    if detail:
        return detail.group(1).strip()
    if "weights_only" in text:
        return f"{type(exc).__name__}: it is damaged or not a torch checkpoint"
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no detail'}"


def check_same_args(saved: dict, current: dict, keys: Iterable[str], flag: str, path) -> None:
    """Refuse to continue a checkpoint with options that change what it holds (the model's shape or method): a
    silent mix, or a raw size-mismatch error, otherwise. Keys the checkpoint did not record are not compared."""
    if not isinstance(saved, dict):
        return
    changed = [key for key in keys if key in saved and saved[key] != current.get(key)]
    if changed:
        was = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r}" for k in changed)
        now = ", ".join(f"--{k.replace('_', '-')} {current.get(k)!r}" for k in changed)
        raise ValueError(f"{flag} {path} was written with {was}; this run has {now}. Pass the same options to "
                         f"continue it, or start a new run in another output directory")


def plain_rng_state(state: dict) -> dict:
    """An RNG state dict (python, numpy, torch, cuda) with numpy's array made a list: loadable as plain data."""
    state = dict(state)
    if "numpy" in state and isinstance(state["numpy"][1], np.ndarray):
        kind, keys, pos, has_gauss, cached = state["numpy"]
        state["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return state


def numpy_rng_state(plain) -> tuple:
    kind, keys, pos, has_gauss, cached = plain
    return kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached


def _make_plain(obj):
    """Recursively: numpy arrays and scalars to lists and numbers, argparse namespaces kept, the rest as it is."""
    if isinstance(obj, dict):
        if "numpy" in obj and "torch" in obj and "python" in obj:  # an RNG state
            obj = plain_rng_state(obj)
        return {k: _make_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_make_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def main(argv=None):
    p = argparse.ArgumentParser(description="Convert a checkpoint written by an earlier version of this project's "
                                            "trainers (numpy objects in its RNG state) to plain data, which every "
                                            "version loads safely. This one load runs the file's pickle code: use "
                                            "it only on a file you trust.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("source")
    p.add_argument("target")
    p.add_argument("--trust", action="store_true", help="required: you trust SOURCE (it is loaded unsafely once)")
    a = p.parse_args(argv)
    if not a.trust:
        p.error("converting loads SOURCE with full unpickling; pass --trust if you wrote it or trust who did")
    ckpt = torch.load(a.source, map_location="cpu", weights_only=False)
    torch.save(_make_plain(ckpt), a.target)
    safe_load(a.target, "converted file")  # what was written loads safely
    print(f"wrote {a.target}; it loads with weights_only=True")


if __name__ == "__main__":
    main()


def write_text_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a run killed mid-write leaves the old
    file or the new one, never a torn file to resume from."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_atomic(obj, path) -> None:
    """``torch.save`` through a temporary file in the same folder and a rename: a crash never leaves a torn
    checkpoint."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
