"""ResNet backbones (torchvision) with frozen BatchNorm, two small CNNs, and the backbone+position Joiner.

Their weights come from --backbone-weights (backbone_weights: ImageNet by name, a file, or none).

The module tree mirrors the official DETR (`backbone.0.body.layer4...`, `backbone.1` = position
encoding) so released checkpoints load with strict=True.
"""
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops.misc import FrozenBatchNorm2d

from .backbone_weights import IMAGENET, initial_state
from .misc import NestedTensor
from .position_encoding import build_position_encoding

RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101")


class _ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(8, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(8, channels)

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)), inplace=True)
        return F.relu(x + self.norm2(self.conv2(y)), inplace=True)


class TinyBody(nn.Module):
    """Stride-2 3x3 convs, each optionally followed by residual blocks, for fast tests and CPU runs.

    `tiny`: five plain stages (total stride 32, like ResNet's layer4): the cheapest, for tests.
    `small`: three stages and two residual blocks at the end (stride 8), so a 128-pixel image gives 256
    encoder tokens: enough for Linformer's projection and the encoder's cost to matter, at about the
    cost of `tiny` on 2 CPU cores.
    GroupNorm is per-sample, so multi-process training stays equal to single-process training.
    """

    def __init__(self, widths=(16, 32, 64, 64, 128), blocks=(0, 0, 0, 0, 0)):
        super().__init__()
        if len(blocks) != len(widths):
            raise ValueError(f"blocks {blocks} needs one entry per stage of widths {widths}")
        layers, c_in = [], 3
        for c_out, n_blocks in zip(widths, blocks):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                       nn.GroupNorm(8, c_out), nn.ReLU(inplace=True)]
            layers += [_ResidualBlock(c_out) for _ in range(n_blocks)]
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.num_channels = c_in

    def forward(self, x):
        return {"0": self.layers(x)}


SMALL_BODIES = {"tiny": dict(widths=(16, 32, 64, 64, 128), blocks=(0, 0, 0, 0, 0)),
                "small": dict(widths=(16, 32, 64), blocks=(0, 0, 2))}
BACKBONES = RESNETS + tuple(SMALL_BODIES)


def _source(weights):
    """How an error names where the weights came from."""
    return "torchvision's ImageNet weights" if weights == IMAGENET else f"--backbone-weights {weights}"


def _load_resnet(net, state, weights, name):
    """Loads a ResNet state_dict, refusing one of another depth: a deeper ResNet's file fits every layer of a
    shallower one's, and only its keys left over tell them apart."""
    try:
        missing, unexpected = net.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes differ: another architecture's file
        raise ValueError(f"{_source(weights)} does not fit backbone {name!r} ({exc}); pass a torchvision {name} "
                         "state_dict") from None
    missing = [k for k in missing if not k.startswith("fc.")]  # DETR drops the classifier; its checkpoints lack it
    if missing or unexpected:
        raise ValueError(f"{_source(weights)} does not fit backbone {name!r}: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]} (of {len(missing)} and {len(unexpected)}); pass a torchvision {name} "
                         "state_dict")


class Backbone(nn.Module):
    def __init__(self, name, train_backbone, dilation, weights=None):
        """weights: a --backbone-weights value (`imagenet`, a path, `none`), or None for random initialisation."""
        super().__init__()
        if name not in BACKBONES:
            raise ValueError(f"backbone={name!r} is not supported; choose one of {BACKBONES}")
        if name in SMALL_BODIES:
            if dilation:
                raise ValueError(f"dilation=True (DC5) needs a ResNet backbone, not backbone={name!r}")
            self.body = TinyBody(**SMALL_BODIES[name])
            state = initial_state(weights, name)
            if state is not None:  # from linear_mha.integrations.detr.pretrain
                try:
                    self.body.load_state_dict(state)
                except RuntimeError as exc:
                    raise ValueError(f"--backbone-weights {weights} does not fit backbone {name!r} ({exc}); "
                                     f"make it with python -m linear_mha.integrations.detr.pretrain --backbone {name}") from None
            self.num_channels = self.body.num_channels
            for p in self.body.parameters():
                p.requires_grad_(train_backbone)
            return
        if dilation and name in ("resnet18", "resnet34"):
            raise ValueError(f"dilation=True (DC5) needs a bottleneck ResNet (resnet50/resnet101), not {name!r}")
        # Built empty, then loaded: ImageNet by name and a local file take the same checks (_load_resnet).
        net = getattr(torchvision.models, name)(
            weights=None, replace_stride_with_dilation=[False, False, dilation], norm_layer=FrozenBatchNorm2d)
        state = initial_state(weights, name)
        if state is not None:
            _load_resnet(net, state, weights, name)
        # As in DETR: the stem and layer1 stay frozen even when the backbone trains.
        for pname, p in net.named_parameters():
            if not train_backbone or not any(f"layer{i}" in pname for i in (2, 3, 4)):
                p.requires_grad_(False)
        self.body = IntermediateLayerGetter(net, return_layers={"layer4": "0"})
        self.num_channels = 512 if name in ("resnet18", "resnet34") else 2048

    def forward(self, tensor_list: NestedTensor):
        xs = self.body(tensor_list.tensors)
        out = {}
        for key, x in xs.items():
            mask = F.interpolate(tensor_list.mask[None].float(), size=x.shape[-2:]).to(torch.bool)[0]
            out[key] = NestedTensor(x, mask)
        return out


class Joiner(nn.Sequential):
    """Index 0: backbone, index 1: position encoding (nn.Sequential only for DETR's key names)."""

    def __init__(self, backbone, position_embedding):
        super().__init__(backbone, position_embedding)
        self.num_channels = backbone.num_channels

    def forward(self, tensor_list: NestedTensor):
        features, pos = [], []
        for _, x in sorted(self[0](tensor_list).items()):
            features.append(x)
            pos.append(self[1](x).to(x.tensors.dtype))
        return features, pos


def build_backbone(args):
    train_backbone = args.lr_backbone > 0
    backbone = Backbone(args.backbone, train_backbone, args.dilation,
                        getattr(args, "backbone_weights", None))
    return Joiner(backbone, build_position_encoding(args))


def backbone_stride(name, dilation):
    """Total stride of the feature map fed to the transformer (DC5 halves a ResNet's)."""
    if name in SMALL_BODIES:
        return 2 ** len(SMALL_BODIES[name]["widths"])
    return 16 if dilation else 32
