"""SetCriterion: DETR's loss over Hungarian-matched predictions (CE with no-object weight, L1, GIoU)."""
import torch
import torch.nn.functional as F
from torch import nn

from . import box_ops
from ..distributed import all_reduce_mean_
from .matcher import build_matcher


def _full_precision(t):
    """Half-precision (AMP) outputs are upcast for the loss; float64 stays float64 for reference tests."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


@torch.no_grad()
def accuracy(output, target, topk=(1,)):
    if target.numel() == 0:
        return [torch.zeros([], device=output.device)]
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
    return [correct[:k].reshape(-1).float().sum(0) * (100.0 / target.size(0)) for k in topk]


class SetCriterion(nn.Module):
    LOSSES = ("labels", "boxes", "cardinality")

    def __init__(self, num_classes, matcher, weight_dict, eos_coef, losses):
        super().__init__()
        unknown = set(losses) - set(self.LOSSES)
        if unknown:
            raise ValueError(f"SetCriterion: unknown losses {sorted(unknown)}; choose from {self.LOSSES}")
        self.num_classes = num_classes
        self.matcher = matcher
        self.weight_dict = weight_dict
        self.eos_coef = eos_coef
        self.losses = list(losses)
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    def loss_labels(self, outputs, targets, indices, num_boxes, log=True):
        logits = _full_precision(outputs["pred_logits"])
        idx = self._src_permutation_idx(indices)
        matched = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)]).to(logits.device)
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        target_classes[idx] = matched
        losses = {"loss_ce": F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight.to(logits.dtype))}
        if log:
            losses["class_error"] = 100 - accuracy(logits[idx], matched)[0]
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs, targets, indices, num_boxes):
        """Logged only: |#predictions that are not no-object - #targets| (no gradient)."""
        logits = outputs["pred_logits"]
        tgt_lengths = torch.as_tensor([len(t["labels"]) for t in targets], device=logits.device)
        card_pred = (logits.argmax(-1) != logits.shape[-1] - 1).sum(1)
        return {"cardinality_error": F.l1_loss(card_pred.float(), tgt_lengths.float())}

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        idx = self._src_permutation_idx(indices)
        src_boxes = _full_precision(outputs["pred_boxes"][idx])
        target_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)], dim=0).to(src_boxes)
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction="none")
        giou = torch.diag(box_ops.generalized_box_iou(box_ops.box_cxcywh_to_xyxy(src_boxes),
                                                      box_ops.box_cxcywh_to_xyxy(target_boxes)))
        return {"loss_bbox": loss_bbox.sum() / num_boxes, "loss_giou": (1 - giou).sum() / num_boxes}

    @staticmethod
    def _src_permutation_idx(indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])
        return batch_idx, src_idx

    def get_loss(self, loss, outputs, targets, indices, num_boxes, **kwargs):
        fn = {"labels": self.loss_labels, "cardinality": self.loss_cardinality, "boxes": self.loss_boxes}[loss]
        return fn(outputs, targets, indices, num_boxes, **kwargs)

    def forward(self, outputs, targets):
        """Returns a dict of unweighted losses (and logged errors); weight them with self.weight_dict."""
        outputs_main = {k: v for k, v in outputs.items() if k != "aux_outputs"}
        indices = self.matcher(outputs_main, targets)
        # Averaged over processes so every rank divides by the same global box count, which makes the
        # DDP gradient (a mean over ranks) equal to the single-process one.
        device = outputs["pred_logits"].device
        num_boxes = torch.as_tensor([float(sum(len(t["labels"]) for t in targets))], device=device)
        num_boxes = all_reduce_mean_(num_boxes).clamp(min=1).item()
        losses = {}
        for loss in self.losses:
            losses.update(self.get_loss(loss, outputs, targets, indices, num_boxes))
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            aux_indices = self.matcher(aux, targets)
            for loss in self.losses:
                kwargs = {"log": False} if loss == "labels" else {}
                part = self.get_loss(loss, aux, targets, aux_indices, num_boxes, **kwargs)
                losses.update({f"{k}_{i}": v for k, v in part.items()})
        return losses


def build_weight_dict(args):
    weight_dict = {"loss_ce": 1.0, "loss_bbox": args.bbox_loss_coef, "loss_giou": args.giou_loss_coef}
    if args.aux_loss:
        weight_dict.update({f"{k}_{i}": v for i in range(args.dec_layers - 1) for k, v in list(weight_dict.items())})
    return weight_dict


def build_criterion(args):
    return SetCriterion(args.num_classes, build_matcher(args), build_weight_dict(args), args.eos_coef,
                        ["labels", "boxes", "cardinality"])
