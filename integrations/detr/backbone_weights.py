"""Where a DETR backbone's weights come from (--backbone-weights): `imagenet`, torchvision's ImageNet-1k weights of
a ResNet fetched by name (IMAGENET1K_V1, those the official DETR starts from); a local file; or `none`, random
initialisation.

The trainer starts a ResNet from `imagenet` unless told otherwise (or --pretrained / --resume gives the whole model):
DETR learns little from a ResNet trained from scratch, so a run must never start from one without being asked to.
torchvision downloads the file once into $TORCH_HOME/hub/checkpoints (by default ~/.cache/torch/hub/checkpoints) and
reads it from there afterwards; where it cannot be downloaded the error names the file to fetch elsewhere and both
ways on. The small backbones have no ImageNet weights: they are pretrained on the run's own images (backbone_cache).
"""
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision

from ..checkpoint_io import safe_load
from .. import distributed as dist_utils

IMAGENET = "imagenet"
RANDOM = "none"
# A DETR checkpoint's backbone keys, in the official release and in this trainer's checkpoints.
DETR_BODY_PREFIX = "backbone.0.body."


class WeightsUnavailable(RuntimeError):
    """torchvision's ImageNet weights could not be downloaded (offline, blocked, interrupted)."""


def has_imagenet_weights(name) -> bool:
    try:
        imagenet_weights(name)
    except ValueError:
        return False
    return True


def imagenet_weights(name):
    """torchvision's IMAGENET1K_V1 weights entry for backbone ``name`` (a ResNet)."""
    try:
        return torchvision.models.get_model_weights(name).IMAGENET1K_V1
    except (ValueError, AttributeError):  # not a torchvision model (tiny, small), or one without these weights
        raise ValueError(f"--backbone-weights {IMAGENET}: backbone {name!r} has no ImageNet weights (the ResNets "
                         f"have); pretrain it on your images with --pretrain-backbone ITERS, or pass a file with "
                         f"--backbone-weights PATH") from None


def cached_path(weights) -> Path:
    """Where torch.hub keeps (and first looks for) the file of a torchvision weights entry."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name


def imagenet_state_dict(name, progress=True):
    """The ImageNet state_dict of ResNet ``name`` through torchvision's weights API: downloaded on first use (the
    file's SHA-256 checked against its name), read from torch.hub's cache afterwards, with weights_only=True."""
    weights = imagenet_weights(name)
    cached = cached_path(weights)
    was_cached = cached.exists()
    try:
        return weights.get_state_dict(progress=progress, check_hash=True, map_location="cpu", weights_only=True)
    except Exception as exc:  # URLError, timeouts, SSL, a hash mismatch: whatever stopped the download, say so
        if was_cached:
            raise ValueError(f"torchvision's ImageNet weights of {name}, cached at {cached}, could not be read "
                             f"({exc}); delete the file so that the next run downloads it again") from None
        raise WeightsUnavailable(
            f"backbone {name} starts from torchvision's ImageNet weights ({type(weights).__name__}.IMAGENET1K_V1, as "
            f"the official DETR does), but {weights.url} could not be downloaded ({exc}). Either fetch that file "
            f"where there is a network and pass it with --backbone-weights PATH (or put it at {cached}, where it is "
            f"looked for first), or train the backbone from random initialisation with --backbone-weights {RANDOM} "
            f"(DETR learns far less from it)") from None


def fetch_on_main_first(name, progress=True):
    """Downloads ResNet ``name``'s ImageNet weights on the main process while the others wait, so that they read
    its cached file instead of downloading too; when it fails, every process raises its error (none hangs)."""
    error = None
    if dist_utils.is_main_process():
        try:
            imagenet_state_dict(name, progress)
        except WeightsUnavailable as exc:
            error = str(exc)
    error = dist_utils.all_gather_json(error)[0]  # also the barrier: nobody reads the cache before it is there
    if error:
        raise WeightsUnavailable(error)


def local_state_dict(path, name):
    """A backbone state_dict from a file: a plain state_dict (torchvision's resnet50-0676ba61.pth, the pretrainer's
    backbone.pth) or a DETR checkpoint (the official release or this trainer's: its 'model' entry's backbone)."""
    state = safe_load(path, "--backbone-weights")
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = {k[len(DETR_BODY_PREFIX):]: v for k, v in state["model"].items() if k.startswith(DETR_BODY_PREFIX)}
        if not state:
            raise ValueError(f"--backbone-weights {path} is a checkpoint whose 'model' holds no backbone "
                             f"({DETR_BODY_PREFIX}*) weights")
    if not isinstance(state, dict) or not state or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"--backbone-weights {path} is not a state_dict (names -> tensors) for backbone {name!r}")
    return state


def initial_state(weights, name):
    """The state_dict a backbone starts from for a --backbone-weights value, or None for random initialisation
    (None: what a model built outside the trainer gets when nothing is asked for)."""
    if weights in (None, RANDOM):
        return None
    if weights == IMAGENET:
        return imagenet_state_dict(name)
    return local_state_dict(weights, name)


def resolve_backbone_weights(args):
    """The trainer's --backbone-weights when none is given: `imagenet` for a ResNet, unless --pretrained or --resume
    gives the whole model, or --pretrain-backbone asks for pretraining (backbone_cache's, which refuses a ResNet).
    For `imagenet` the file is fetched now, the main process first, so that an offline run stops before any data or
    model is built."""
    given_elsewhere = args.pretrained or args.resume or args.pretrain_backbone
    if args.backbone_weights is None and not given_elsewhere and has_imagenet_weights(args.backbone):
        args.backbone_weights = IMAGENET
    if args.backbone_weights == IMAGENET:
        fetch_on_main_first(args.backbone, progress=args.progress)


def describe(args) -> str:
    """What the backbone starts from, for the banner."""
    if args.backbone_weights == IMAGENET:
        return f"ImageNet: torchvision's {type(imagenet_weights(args.backbone)).__name__}.IMAGENET1K_V1"
    if args.backbone_weights == RANDOM:
        return f"random init: --backbone-weights {RANDOM}"
    if args.backbone_weights:
        return str(args.backbone_weights)
    if args.resume or args.pretrained:
        return f"from {'--resume' if args.resume else '--pretrained'}"
    return "random init"
