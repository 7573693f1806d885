"""ResNet backbones (torchvision, never downloaded) with frozen BatchNorm, and the backbone+position Joiner.

The module tree mirrors the official DETR (`backbone.0.body.layer4...`, `backbone.1` = position
encoding) so released checkpoints load with strict=True.
"""
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops.misc import FrozenBatchNorm2d

from .misc import NestedTensor
from .position_encoding import build_position_encoding

RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101")
BACKBONES = RESNETS + ("tiny",)


class TinyBody(nn.Module):
    """Five stride-2 3x3 convs (total stride 32, like ResNet's layer4) for fast tests and CPU demos.

    GroupNorm is per-sample, so multi-process training stays equal to single-process training.
    """

    def __init__(self, widths=(16, 32, 64, 64, 128)):
        super().__init__()
        layers, c_in = [], 3
        for c_out in widths:
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                       nn.GroupNorm(8, c_out), nn.ReLU(inplace=True)]
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.num_channels = c_in

    def forward(self, x):
        return {"0": self.layers(x)}


class Backbone(nn.Module):
    def __init__(self, name, train_backbone, dilation, weights_path=None):
        super().__init__()
        if name not in BACKBONES:
            raise ValueError(f"backbone={name!r} is not supported; choose one of {BACKBONES}")
        if name == "tiny":
            if dilation:
                raise ValueError("dilation=True (DC5) needs a ResNet backbone, not backbone='tiny'")
            self.body = TinyBody()
            self.num_channels = self.body.num_channels
            for p in self.body.parameters():
                p.requires_grad_(train_backbone)
            return
        if dilation and name in ("resnet18", "resnet34"):
            raise ValueError(f"dilation=True (DC5) needs a bottleneck ResNet (resnet50/resnet101), not {name!r}")
        # weights=None: nothing is ever downloaded; pretrained weights come from --backbone-weights.
        net = getattr(torchvision.models, name)(
            weights=None, replace_stride_with_dilation=[False, False, dilation], norm_layer=FrozenBatchNorm2d)
        if weights_path:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
            missing, unexpected = net.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith("fc.")]
            if missing:
                raise ValueError(f"backbone weights {weights_path} lack keys {missing[:5]}...; "
                                 f"pass a torchvision {name} state_dict")
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


def backbone_stride(dilation):
    """Total stride of the feature map fed to the transformer (DC5 halves it)."""
    return 16 if dilation else 32
