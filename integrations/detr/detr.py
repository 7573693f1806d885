"""The DETR model (backbone -> transformer -> class/box heads), post-processing, and the builder."""
import torch
import torch.nn.functional as F
from torch import nn

from . import box_ops
from .backbone import build_backbone
from .misc import NestedTensor, nested_tensor_from_tensor_list
from .transformer import build_transformer


class MLP(nn.Module):
    """Feed-forward head: num_layers linear layers with ReLU between them."""

    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        dims_in = [input_dim] + [hidden_dim] * (num_layers - 1)
        dims_out = [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims_in, dims_out))
        self.num_layers = num_layers

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class DETR(nn.Module):
    def __init__(self, backbone, transformer, num_classes, num_queries, aux_loss=False):
        """num_classes is the largest category id + 1 (COCO: 91); one extra logit is "no object"."""
        super().__init__()
        self.num_queries = num_queries
        self.transformer = transformer
        hidden_dim = transformer.d_model
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.bbox_embed = MLP(hidden_dim, hidden_dim, 4, 3)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.input_proj = nn.Conv2d(backbone.num_channels, hidden_dim, kernel_size=1)
        self.backbone = backbone
        self.aux_loss = aux_loss

    def forward(self, samples):
        """samples: NestedTensor (B, 3, H, W) + mask, a (B, 3, H, W) batch of images of one size (nothing padded:
        the form torch.jit.trace and the exporters take), or a list of (3, H, W) images.

        Returns pred_logits (B, Q, num_classes + 1), pred_boxes (B, Q, 4) as normalised cxcywh,
        and, with aux_loss, aux_outputs: the same for every decoder layer but the last.
        """
        if isinstance(samples, torch.Tensor) and samples.dim() == 4:
            samples = NestedTensor(samples, torch.zeros_like(samples[:, 0], dtype=torch.bool))
        elif not isinstance(samples, NestedTensor):
            samples = nested_tensor_from_tensor_list(list(samples))
        features, pos = self.backbone(samples)
        src, mask = features[-1].decompose()
        hs = self.transformer(self.input_proj(src), mask, self.query_embed.weight, pos[-1])[0]
        outputs_class = self.class_embed(hs)
        outputs_coord = self.bbox_embed(hs).sigmoid()
        out = {"pred_logits": outputs_class[-1], "pred_boxes": outputs_coord[-1]}
        if self.aux_loss and len(hs) > 1:  # one decoder layer has no intermediate outputs (trace takes no [])
            out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b}
                                  for a, b in zip(outputs_class[:-1], outputs_coord[:-1])]
        return out


class PostProcess(nn.Module):
    """Model outputs -> COCO-style {scores, labels, boxes (xyxy, pixels of the original image)}."""

    @torch.no_grad()
    def forward(self, outputs, target_sizes):
        """target_sizes: (B, 2) tensor of (height, width) of each original image."""
        logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
        if len(logits) != len(target_sizes) or target_sizes.shape[1] != 2:
            raise ValueError(f"target_sizes must be (batch={len(logits)}, 2) as (h, w); got {tuple(target_sizes.shape)}")
        prob = F.softmax(logits.float(), -1)
        scores, labels = prob[..., :-1].max(-1)
        xyxy = box_ops.box_cxcywh_to_xyxy(boxes.float())
        img_h, img_w = target_sizes.unbind(1)
        scale = torch.stack([img_w, img_h, img_w, img_h], dim=1).to(xyxy)
        xyxy = xyxy * scale[:, None, :]
        return [{"scores": s, "labels": l, "boxes": b} for s, l, b in zip(scores, labels, xyxy)]


def build_model(args):
    """Returns (model, criterion, postprocessors) for an argparse-like namespace (see train.get_args_parser)."""
    from .criterion import build_criterion  # criterion imports the matcher; keep model-only users light

    model = DETR(build_backbone(args), build_transformer(args), num_classes=args.num_classes,
                 num_queries=args.num_queries, aux_loss=args.aux_loss)
    return model, build_criterion(args), {"bbox": PostProcess()}
