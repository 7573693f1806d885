"""COCO bbox evaluation (pycocotools COCOeval, all 12 numbers), with predictions merged across processes."""
import contextlib
import copy
import io

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from ..distributed import all_gather_json

STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
# What each of the 12 numbers averages over, as COCOeval.summarize() labels them.
STAT_LABELS = ("IoU 0.50:0.95, all areas, 100 detections", "IoU 0.50", "IoU 0.75", "small objects", "medium objects",
               "large objects", "1 detection per image", "10 detections", "100 detections", "small objects",
               "medium objects", "large objects")


def format_stats(coco: dict) -> str:
    """The 12 COCOeval numbers of ``coco`` (a dict by STAT_NAMES) as a table; -1 (no such objects) shows as n/a."""
    lines = []
    for name, label in zip(STAT_NAMES, STAT_LABELS):
        value = coco[name]
        lines.append(f"  {name:<6} {'n/a' if value < 0 else f'{value:.3f}':>6}  {label}")
    return "\n".join(lines)


class CocoEvaluator:
    def __init__(self, coco_gt):
        self.coco_gt = copy.deepcopy(coco_gt)
        self.predictions = {}  # image_id -> list of COCO result dicts
        self.summary = ""

    def update(self, results):
        """results: {image_id: {scores, labels, boxes (xyxy pixels of the original image)}}."""
        for image_id, res in results.items():
            boxes = res["boxes"].detach().cpu().double()
            xywh = boxes.clone()
            xywh[:, 2:] -= xywh[:, :2]
            self.predictions[int(image_id)] = [
                {"image_id": int(image_id), "category_id": int(label), "bbox": [float(v) for v in box],
                 "score": float(score)}
                for box, label, score in zip(xywh.tolist(), res["labels"].tolist(), res["scores"].tolist())]

    def summarize(self):
        """Merges every process's predictions (a dict, so samples a sampler duplicated count once) and
        returns the 12 COCOeval bbox stats; every process gets the same numbers."""
        merged = {}
        for part in all_gather_json(self.predictions):
            merged.update(part)
        image_ids = sorted(merged)
        detections = [d for i in image_ids for d in merged[i]]
        if not image_ids:
            raise ValueError("CocoEvaluator.summarize: no images were evaluated (empty validation loader?)")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            # loadRes refuses an empty list; an empty COCO scores as pycocotools and the official evaluator do:
            # 0 where there is ground truth, -1 for area ranges without any.
            coco_dt = self.coco_gt.loadRes(detections) if detections else COCO()
            coco_eval = COCOeval(self.coco_gt, coco_dt, iouType="bbox")
            coco_eval.params.imgIds = image_ids
            coco_eval.evaluate()
            coco_eval.accumulate()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            coco_eval.summarize()
        self.summary = out.getvalue()
        return [float(v) for v in np.asarray(coco_eval.stats)]
