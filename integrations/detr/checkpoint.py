"""Atomic checkpoints holding everything `--resume` needs to continue a run bit-for-bit."""
import os
import random
from pathlib import Path

import numpy as np
import torch


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(obj, path):
    """Writes to a temporary file in the same directory, then renames: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--resume {path} does not exist; pass a checkpoint.pth written by a previous run")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a torn or foreign file: say which and why
        raise ValueError(f"--resume {path} is not a readable checkpoint ({exc})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ValueError(f"checkpoint {path} has no 'model' entry; pass a checkpoint.pth written by this trainer")
    return ckpt


def load_pretrained(model, path):
    """Loads a DETR checkpoint's weights (official release or ours) strictly."""
    ckpt = load_checkpoint(path)
    model.load_state_dict(ckpt["model"], strict=True)
