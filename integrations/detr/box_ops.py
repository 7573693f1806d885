"""Box format conversions and (generalized) IoU on (N, 4) tensors."""
import torch


def box_cxcywh_to_xyxy(boxes):
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def box_xyxy_to_cxcywh(boxes):
    x0, y0, x1, y1 = boxes.unbind(-1)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def box_area(boxes):
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def box_iou(boxes1, boxes2):
    """Pairwise IoU of xyxy boxes: (N, 4), (M, 4) -> iou (N, M), union (N, M)."""
    area1, area2 = box_area(boxes1), box_area(boxes2)
    lt = torch.max(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area1[:, None] + area2[None, :] - inter
    return inter / union, union


def generalized_box_iou(boxes1, boxes2):
    """Pairwise GIoU (https://giou.stanford.edu/) of xyxy boxes: (N, 4), (M, 4) -> (N, M).

    Degenerate boxes (x1 < x0) would make the enclosing-area term meaningless and yield silent
    garbage losses, so they are rejected.
    """
    if not (boxes1[:, 2:] >= boxes1[:, :2]).all():
        raise ValueError("generalized_box_iou: boxes1 has x1 < x0 or y1 < y0 (degenerate or NaN boxes)")
    if not (boxes2[:, 2:] >= boxes2[:, :2]).all():
        raise ValueError("generalized_box_iou: boxes2 has x1 < x0 or y1 < y0 (degenerate or NaN boxes)")
    iou, union = box_iou(boxes1, boxes2)
    lt = torch.min(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.max(boxes1[:, None, 2:], boxes2[None, :, 2:])
    enclosing = (rb - lt).clamp(min=0).prod(-1)
    return iou - (enclosing - union) / enclosing
