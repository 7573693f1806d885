"""Box ops, Hungarian matcher and SetCriterion units (float64 references where values are checked)."""
import math

import pytest
import torch
import torch.nn.functional as F

from linear_mha.integrations.detr import box_ops
from linear_mha.integrations.detr.criterion import SetCriterion
from linear_mha.integrations.detr.matcher import HungarianMatcher


def test_giou_hand_computed_values():
    a = torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([[0.0, 0.0, 1.0, 1.0], [2.0, 0.0, 3.0, 1.0], [0.5, 0.0, 1.5, 1.0]], dtype=torch.float64)
    # identical: 1; disjoint with enclosing area 3 and union 2: -1/3; half overlap: iou 1/3, enclosing = union.
    expected = torch.tensor([[1.0, -1.0 / 3.0, 1.0 / 3.0]], dtype=torch.float64)
    torch.testing.assert_close(box_ops.generalized_box_iou(a, b), expected)
    with pytest.raises(ValueError, match="boxes2"):
        box_ops.generalized_box_iou(a, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))


def test_box_conversions_round_trip():
    boxes = torch.rand(7, 4, dtype=torch.float64)
    torch.testing.assert_close(box_ops.box_xyxy_to_cxcywh(box_ops.box_cxcywh_to_xyxy(boxes)), boxes)


def _perfect_outputs(targets, num_queries, num_classes, perms):
    """Predictions that equal the targets at permuted query slots and predict no-object elsewhere."""
    bs = len(targets)
    logits = torch.full((bs, num_queries, num_classes + 1), -10.0, dtype=torch.float64)
    logits[:, :, num_classes] = 10.0
    boxes = torch.full((bs, num_queries, 4), 0.5, dtype=torch.float64)
    boxes[:, :, 2:] = 0.1
    for b, (t, perm) in enumerate(zip(targets, perms)):
        for j, q in enumerate(perm[: len(t["labels"])]):
            logits[b, q] = -10.0
            logits[b, q, t["labels"][j]] = 10.0
            boxes[b, q] = t["boxes"][j]
    return {"pred_logits": logits, "pred_boxes": boxes}


def _targets():
    t0 = {"labels": torch.tensor([1, 0, 2]),
          "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.3, 0.4], [0.5, 0.5, 0.9, 0.9]], dtype=torch.float64)}
    t1 = {"labels": torch.tensor([2]), "boxes": torch.tensor([[0.2, 0.8, 0.1, 0.2]], dtype=torch.float64)}
    return [t0, t1]


def test_matcher_recovers_the_identity_assignment_for_perfect_predictions():
    targets = _targets()
    perms = [[4, 0, 2], [3]]
    out = _perfect_outputs(targets, num_queries=6, num_classes=3, perms=perms)
    indices = HungarianMatcher(1, 5, 2)(out, targets)
    for (src, tgt), perm, t in zip(indices, perms, targets):
        assert dict(zip(tgt.tolist(), src.tolist())) == {j: perm[j] for j in range(len(t["labels"]))}


def test_matcher_handles_images_without_targets():
    targets = _targets() + [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}]
    out = _perfect_outputs(targets, 6, 3, [[0, 1, 2], [5], []])
    indices = HungarianMatcher(1, 5, 2)(out, targets)
    assert [len(s) for s, _ in indices] == [3, 1, 0]
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}] * 2
    assert all(len(s) == 0 for s, _ in HungarianMatcher()(_perfect_outputs(empty, 4, 3, [[], []]), empty))
    with pytest.raises(ValueError, match="set-cost"):
        HungarianMatcher(0, 0, 0)


def _criterion(num_classes=3, eos=0.1):
    weights = {"loss_ce": 1, "loss_bbox": 5, "loss_giou": 2}
    return SetCriterion(num_classes, HungarianMatcher(1, 5, 2), weights, eos, ["labels", "boxes", "cardinality"]).double()


def test_perfect_predictions_give_zero_box_losses_and_errors():
    targets = _targets()
    out = _perfect_outputs(targets, 6, 3, [[4, 0, 2], [3]])
    out["aux_outputs"] = [{k: v.clone() for k, v in out.items()}]
    losses = _criterion()(out, targets)
    for key in ("loss_bbox", "loss_giou", "loss_bbox_0", "loss_giou_0", "class_error", "cardinality_error"):
        assert abs(float(losses[key])) < 1e-9, key
    assert 0 < float(losses["loss_ce"]) < 1e-6


def test_cross_entropy_matches_float64_reference_with_no_object_weight():
    torch.manual_seed(0)
    targets = _targets()
    out = {"pred_logits": torch.randn(2, 6, 4, dtype=torch.float64),
           "pred_boxes": torch.rand(2, 6, 4, dtype=torch.float64) * 0.5 + 0.25}
    crit = _criterion(eos=0.25)
    indices = crit.matcher(out, targets)
    classes = torch.full((2, 6), 3)
    for b, (src, tgt) in enumerate(indices):
        classes[b, src] = targets[b]["labels"][tgt]
    logp = torch.log_softmax(out["pred_logits"], -1)
    w = torch.where(classes == 3, 0.25, 1.0).double()
    nll = -logp.gather(-1, classes[..., None])[..., 0]
    expected_ce = (w * nll).sum() / w.sum()
    src_boxes = torch.cat([out["pred_boxes"][b, s] for b, (s, _) in enumerate(indices)])
    tgt_boxes = torch.cat([targets[b]["boxes"][t] for b, (_, t) in enumerate(indices)])
    losses = crit(out, targets)
    torch.testing.assert_close(losses["loss_ce"], expected_ce)
    torch.testing.assert_close(losses["loss_bbox"], (src_boxes - tgt_boxes).abs().sum() / 4)


def test_images_without_targets_push_every_query_to_no_object():
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4, dtype=torch.float64)}]
    logits = torch.zeros(1, 5, 4, dtype=torch.float64, requires_grad=True)
    out = {"pred_logits": logits, "pred_boxes": torch.full((1, 5, 4), 0.5, dtype=torch.float64, requires_grad=True)}
    losses = _criterion()(out, empty)
    assert float(losses["loss_bbox"].detach()) == 0 and float(losses["loss_giou"].detach()) == 0
    torch.testing.assert_close(losses["loss_ce"], torch.tensor(math.log(4), dtype=torch.float64))
    losses["loss_ce"].backward()
    assert (logits.grad[..., -1] < 0).all()  # descending the loss raises the no-object logit
    assert float(losses["cardinality_error"]) == 5  # all-zero logits: argmax is class 0 for all 5 queries


def test_cardinality_counts_non_no_object_predictions():
    targets = _targets()
    out = _perfect_outputs(targets, 6, 3, [[4, 0, 2], [3]])
    out["pred_logits"][0, 1, :] = F.one_hot(torch.tensor(0), 4).double() * 20  # one extra detection in image 0
    losses = _criterion()(out, targets)
    assert float(losses["cardinality_error"]) == 0.5
