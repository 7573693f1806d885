"""Atomic checkpoints holding everything `--resume` needs to continue a run bit-for-bit."""
import os
import random
from pathlib import Path

import numpy as np
import torch

from ..checkpoint_io import numpy_rng_state, plain_rng_state, safe_load


def rng_state():
    """Every RNG's state as plain data (lists, numbers, tensors), which a weights_only load accepts."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return plain_rng_state(state)


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(numpy_rng_state(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(obj, path):
    """Writes to a temporary file in the same directory, then renames: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, flag="--resume"):
    """A checkpoint with a 'model' entry, loaded without running anything from the file (checkpoint_io)."""
    ckpt = safe_load(path, flag)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ValueError(f"{flag} {path} has no 'model' entry; pass a checkpoint.pth written by this trainer or an "
                         f"official DETR release")
    return ckpt


def load_pretrained(model, path):
    """Loads a DETR checkpoint's weights (official release or ours) strictly."""
    ckpt = load_checkpoint(path, "--pretrained")
    model.load_state_dict(ckpt["model"], strict=True)
