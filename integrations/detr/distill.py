"""--distill: train against a softmax DETR's predictions instead of the labels (the fine-tune of a conversion).

A DETR converted to linear attention keeps the original's queries, decoder and heads, so query i of the student
and query i of the teacher answer the same question: the loss compares them query by query, with no matching.
Per query: the KL divergence from the teacher's class distribution (no-object included) to the student's, and the
L1 and generalized-IoU distances between their boxes, weighted as DETR weights its own loss (class 1, L1 5, GIoU 2
by default), for the last decoder layer and, with --aux-loss, every earlier one. Every query counts, including
those the teacher calls no-object: their boxes are what later fine-tuning would have to unlearn otherwise.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import box_ops
from .checkpoint import load_pretrained
from .criterion import _full_precision
from .detr import build_model


def _giou_distance(student_boxes, teacher_boxes):
    """1 - GIoU of each query's pair of (cx, cy, w, h) boxes: (B, Q, 4) x 2 -> (B, Q)."""
    rows = [torch.diag(box_ops.generalized_box_iou(box_ops.box_cxcywh_to_xyxy(s), box_ops.box_cxcywh_to_xyxy(t)))
            for s, t in zip(student_boxes, teacher_boxes)]
    return 1 - torch.stack(rows)


class DistillationCriterion(nn.Module):
    """``criterion(outputs, teacher_outputs)`` -> unweighted losses ``loss_kd_ce``, ``loss_kd_bbox``,
    ``loss_kd_giou`` (``_i`` for auxiliary decoder layer i); ``weight_dict`` weights them."""

    def __init__(self, weight_dict: dict):
        super().__init__()
        self.weight_dict = {k.replace("loss_", "loss_kd_", 1): v for k, v in weight_dict.items()}

    @staticmethod
    def _losses(student, teacher):
        logits = _full_precision(student["pred_logits"])
        target = F.softmax(_full_precision(teacher["pred_logits"]), -1)
        ce = F.kl_div(F.log_softmax(logits, -1), target, reduction="none").sum(-1).mean()
        boxes, target_boxes = _full_precision(student["pred_boxes"]), _full_precision(teacher["pred_boxes"])
        return {"loss_kd_ce": ce, "loss_kd_bbox": (boxes - target_boxes).abs().sum(-1).mean(),
                "loss_kd_giou": _giou_distance(boxes, target_boxes).mean()}

    def forward(self, outputs, teacher_outputs):
        losses = self._losses(outputs, teacher_outputs)
        aux, teacher_aux = outputs.get("aux_outputs", []), teacher_outputs.get("aux_outputs", [])
        if len(aux) != len(teacher_aux):
            raise ValueError(f"--distill: the student has {len(aux)} auxiliary outputs and the teacher "
                             f"{len(teacher_aux)}; both must be built with the same --aux-loss and --dec-layers")
        for i, (s, t) in enumerate(zip(aux, teacher_aux)):
            losses.update({f"{k}_{i}": v for k, v in self._losses(s, t).items()})
        return losses


def build_teacher(args, device):
    """The --pretrained DETR as it was released: softmax attention (``apply_attention`` is what patches a model),
    frozen, in eval mode (no dropout: its predictions are exact targets)."""
    teacher, _, _ = build_model(args)
    load_pretrained(teacher, args.pretrained)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.to(device).eval()
