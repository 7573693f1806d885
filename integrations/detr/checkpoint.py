"""Atomic checkpoints holding everything `--resume` needs to continue a run bit-for-bit, and --pretrained DETRs."""
import argparse
import random

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


# The options that make a model's attention; a checkpoint records them in its 'args' (this trainer's do).
ATTENTION_ARGS = ("attention", "attention_on", "dwc_kernel", "attention_option", "output_gate")


def check_pretrained_attention(args):
    """--pretrained without --attention: the checkpoint must hold the attention this run defaults to. The default
    linear attention would load into a softmax DETR (the official release) without a word, its added weights
    starting at zero, and score near zero."""
    if not args.pretrained or not args.attention_is_default:
        return
    saved = load_checkpoint(args.pretrained, "--pretrained").get("args")
    saved = vars(saved) if isinstance(saved, argparse.Namespace) else saved if isinstance(saved, dict) else {}
    # The official release predates --attention: its DETR is softmax.
    recorded = {"attention": "softmax", **{k: saved[k] for k in ATTENTION_ARGS if k in saved}}
    changed = {k: v for k, v in recorded.items() if v != getattr(args, k)}
    if changed:
        flags = lambda values: ", ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in values.items())  # noqa: E731
        now = flags({k: getattr(args, k) for k in changed})
        raise ValueError(f"--pretrained {args.pretrained} holds a DETR trained with {flags(changed)}; this run, "
                         f"without --attention, would give it {now} (the default attention). Pass --attention "
                         f"{recorded['attention']} (and its other options) to evaluate or fine-tune it as it is, or "
                         "another --attention to convert it")
