"""Synthetic set, COCO loading errors, DETR transforms and their size bound, COCO evaluation of ground truth."""
import json
import random
from pathlib import Path

import pytest
import torch

from linear_mha.integrations.detr.coco_eval import CocoEvaluator
from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.datasets import CocoDetection, build_dataset, load_coco
from linear_mha.integrations.detr.synthetic import make_synthetic_coco
from linear_mha.integrations.detr.transforms import feature_tokens, hflip, max_padded_hw, resized_hw


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return make_synthetic_coco(tmp_path_factory.mktemp("syn"), num_train=12, num_val=6, seed=3)


def _args(paths, *extra):
    return parse_args(["--train-images", paths["train"]["images"], "--train-ann", paths["train"]["annotations"],
                       "--val-images", paths["val"]["images"], "--val-ann", paths["val"]["annotations"],
                       "--scales", "96,112,128", "--max-size", "160", "--crop-sizes", "96,112", "--crop-min", "64",
                       "--crop-max", "96", "--val-size", "112", *extra])


def test_synthetic_set_is_seeded_varied_and_consistent(synthetic, tmp_path):
    data = json.loads(open(synthetic["train"]["annotations"]).read())
    again = make_synthetic_coco(tmp_path / "again", num_train=12, num_val=6, seed=3)
    assert json.loads(open(again["train"]["annotations"]).read()) == data
    other = make_synthetic_coco(tmp_path / "other", num_train=12, num_val=6, seed=4)
    assert json.loads(open(other["train"]["annotations"]).read()) != data
    assert len({(i["width"], i["height"]) for i in data["images"]}) > 3
    assert len({a["category_id"] for a in data["annotations"]}) >= 3
    sizes = {i["id"]: (i["width"], i["height"]) for i in data["images"]}
    for a in data["annotations"]:
        x, y, w, h = a["bbox"]
        assert w > 0 and h > 0 and x >= 0 and y >= 0
        assert x + w <= sizes[a["image_id"]][0] and y + h <= sizes[a["image_id"]][1]
    with pytest.raises(ValueError, match="min_size"):
        make_synthetic_coco(tmp_path / "bad", min_size=50, max_size=20)


def test_missing_and_corrupt_annotation_files_raise_naming_the_path(tmp_path, synthetic):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_coco(missing)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"images": [')
    with pytest.raises(ValueError, match=f"{corrupt}.*not valid JSON"):
        load_coco(corrupt)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"images": []}))
    with pytest.raises(ValueError, match=r"lacks the COCO keys \['annotations', 'categories'\]"):
        load_coco(wrong)
    with pytest.raises(FileNotFoundError, match="images directory"):
        CocoDetection(tmp_path / "no_images", synthetic["train"]["annotations"])
    args = _args(synthetic, "--val-ann", str(corrupt))
    with pytest.raises(ValueError, match=str(corrupt)):
        build_dataset("val", args)
    with pytest.raises(FileNotFoundError, match="--coco-path"):
        build_dataset("train", parse_args(["--coco-path", str(tmp_path / "coco")]))


def official_size(hw, size, max_size):
    """The official DETR's get_size_with_aspect_ratio (datasets/transforms.py), restated: (h, w) in, (h, w) out."""
    h, w = hw
    small, large = float(min(w, h)), float(max(w, h))
    if large / small * size > max_size:
        size = int(round(max_size * small / large))
    if (w <= h and w == size) or (h <= w and h == size):
        return h, w
    return (int(size * h / w), size) if w < h else (size, int(size * w / h))


def test_resize_is_the_official_pixel_for_pixel_and_over_max_size_by_half_the_aspect_ratio():
    assert resized_hw((300, 1001), 800, 1333) == (400, 1334)  # the official result, one pixel over max_size
    for h in range(20, 1200, 37):
        for w in range(20, 1200, 41):
            for size, max_size in ((32, 333), (100, 333), (300, 333), (800, 1333)):
                oh, ow = resized_hw((h, w), size, max_size=max_size)
                assert (oh, ow) == official_size((h, w), size, max_size)
                # the capped short side is rounded, by up to half a pixel, which the aspect ratio scales up
                assert max(oh, ow) <= max_size + 0.5 * max(h, w) / min(h, w) and min(oh, ow) <= size


def test_hflip_twice_is_identity_and_moves_boxes():
    from PIL import Image

    img = Image.new("RGB", (50, 30))
    target = {"boxes": torch.tensor([[5.0, 2.0, 20.0, 12.0]])}
    _, flipped = hflip(img, target)
    torch.testing.assert_close(flipped["boxes"], torch.tensor([[30.0, 2.0, 45.0, 12.0]]))
    _, back = hflip(img, flipped)
    torch.testing.assert_close(back["boxes"], target["boxes"])


def test_transformed_samples_stay_within_the_linformer_size_bound(synthetic):
    args = _args(synthetic)
    for split in ("train", "val"):
        ds = build_dataset(split, args)
        bound = max_padded_hw(ds.image_sizes(), args, split)
        random.seed(0)
        torch.manual_seed(0)
        for _ in range(3):
            for i in range(len(ds)):
                image, target = ds[i]
                assert image.shape[1] <= bound[0] and image.shape[2] <= bound[1]
                assert tuple(target["size"].tolist()) == tuple(image.shape[1:])
                boxes = target["boxes"]
                assert ((boxes >= 0) & (boxes <= 1)).all() and (boxes[:, 2:] > 0).all()
    assert feature_tokens((160, 97), 32) == 5 * 4
    assert feature_tokens((160, 97), 16) == 10 * 7


def _gt_results(coco, image_ids, jitter=0.0):
    results = {}
    for image_id in image_ids:
        anns = coco.imgToAnns[image_id]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float64).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] += jitter * (boxes[:, 2:3] - boxes[:, 0:1])
        results[image_id] = {"boxes": boxes, "labels": torch.tensor([a["category_id"] for a in anns]),
                             "scores": torch.ones(len(anns))}
    return results


def test_no_detections_score_as_pycocotools_scores_them(synthetic):
    """0 where there is ground truth, -1 for the area ranges without any (the synthetic set has no large objects
    at its sizes only if none were drawn: the check follows the ground truth)."""
    coco = load_coco(synthetic["val"]["annotations"])
    evaluator = CocoEvaluator(coco)
    evaluator.update({image_id: {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long),
                                 "scores": torch.zeros(0)} for image_id in coco.getImgIds()})
    stats = evaluator.summarize()
    areas = [a["area"] for a in coco.dataset["annotations"]]
    present = [any(a < 32 ** 2 for a in areas), any(32 ** 2 <= a < 96 ** 2 for a in areas), any(a >= 96 ** 2 for a in areas)]
    assert stats[0] == stats[1] == stats[2] == 0.0
    for index, has in zip((3, 4, 5), present):  # APs, APm, APl
        assert stats[index] == (0.0 if has else -1.0)


def test_ground_truth_as_predictions_scores_ap_one(synthetic):
    coco = load_coco(synthetic["val"]["annotations"])
    evaluator = CocoEvaluator(coco)
    evaluator.update(_gt_results(coco, coco.getImgIds()))
    stats = evaluator.summarize()
    assert len(stats) == 12
    assert stats[0] == pytest.approx(1.0) and stats[1] == pytest.approx(1.0) and stats[8] == pytest.approx(1.0)
    shifted = CocoEvaluator(coco)
    shifted.update(_gt_results(coco, coco.getImgIds(), jitter=0.3))  # IoU ~0.54: counts at 0.5, not at 0.75
    moved = shifted.summarize()
    assert moved[1] == pytest.approx(1.0) and moved[2] < 0.5 and moved[0] < 0.5


def test_an_image_whose_size_disagrees_with_its_annotation_is_named(synthetic, tmp_path):
    """Padded batch sizes (and Linformer's seq_len) are planned from the annotation file: a mismatch must be named
    where it is, not surface as an attention module's internal bound."""
    import shutil
    from PIL import Image
    images = tmp_path / "images"
    shutil.copytree(synthetic["val"]["images"], images)
    coco = json.loads(Path(synthetic["val"]["annotations"]).read_text())
    first = coco["images"][0]
    Image.new("RGB", (first["width"] + 40, first["height"])).save(images / first["file_name"])
    dataset = CocoDetection(images, synthetic["val"]["annotations"])
    with pytest.raises(ValueError, match=rf"is {first['width'] + 40} x {first['height']} .* says "
                                         rf"{first['width']} x {first['height']}"):
        dataset[dataset.ids.index(first["id"])]
