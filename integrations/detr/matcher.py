"""Hungarian matching of predictions to ground-truth boxes (scipy linear_sum_assignment)."""
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from .box_ops import box_cxcywh_to_xyxy, generalized_box_iou


class HungarianMatcher(nn.Module):
    """Cost = cost_class * (-p(class)) + cost_bbox * L1(cxcywh) + cost_giou * (-GIoU)."""

    def __init__(self, cost_class=1.0, cost_bbox=1.0, cost_giou=1.0):
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher: all costs are 0; set at least one of "
                             "--set-cost-class/--set-cost-bbox/--set-cost-giou > 0")
        self.cost_class = cost_class
        self.cost_bbox = cost_bbox
        self.cost_giou = cost_giou

    @torch.no_grad()
    def forward(self, outputs, targets):
        """outputs: pred_logits (B, Q, K+1), pred_boxes (B, Q, 4); targets: list of {labels (n,), boxes (n, 4)}.

        Returns a list of (pred_indices, target_indices) int64 tensors, one pair per image,
        each of length min(Q, n_i).
        """
        bs, nq = outputs["pred_logits"].shape[:2]
        sizes = [len(t["boxes"]) for t in targets]
        if sum(sizes) == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return [(empty, empty) for _ in targets]
        # float32 at least: half-precision costs would make near-ties resolve differently per process.
        out_prob = outputs["pred_logits"].flatten(0, 1).softmax(-1, dtype=torch.promote_types(
            outputs["pred_logits"].dtype, torch.float32))
        out_bbox = outputs["pred_boxes"].flatten(0, 1).to(out_prob.dtype)
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_bbox = torch.cat([t["boxes"] for t in targets]).to(out_bbox)
        cost_class = -out_prob[:, tgt_ids]
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
        cost = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        cost = cost.view(bs, nq, -1).cpu()
        if not torch.isfinite(cost).all():
            raise FloatingPointError("HungarianMatcher: non-finite matching cost (NaN/Inf in predictions); "
                                     "lower the learning rate or enable gradient clipping")
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(cost.split(sizes, -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


def build_matcher(args):
    return HungarianMatcher(cost_class=args.set_cost_class, cost_bbox=args.set_cost_bbox,
                            cost_giou=args.set_cost_giou)
