"""A seeded synthetic COCO-format detection set: coloured shapes on noisy backgrounds, varied image sizes.

Used as the default data for tests and demos (no download). `tools/make_synthetic_coco.py` is its CLI.
"""
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CATEGORIES = [{"id": 1, "name": "rectangle", "supercategory": "shape"},
              {"id": 2, "name": "ellipse", "supercategory": "shape"},
              {"id": 3, "name": "triangle", "supercategory": "shape"},
              {"id": 4, "name": "cross", "supercategory": "shape"}]


def _overlap(a, b):
    """IoU of two xywh boxes."""
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def _draw_shape(draw, cat_id, x, y, w, h, color):
    """Draws one shape filling the box (x, y, w, h) exactly; returns its pixel area."""
    x1, y1 = x + w - 1, y + h - 1
    if cat_id == 1:
        draw.rectangle([x, y, x1, y1], fill=color)
        return float(w * h)
    if cat_id == 2:
        draw.ellipse([x, y, x1, y1], fill=color)
        return math.pi * w * h / 4
    if cat_id == 3:
        draw.polygon([(x + (w - 1) / 2, y), (x, y1), (x1, y1)], fill=color)
        return w * h / 2
    bar_w, bar_h = max(1, w // 3), max(1, h // 3)
    draw.rectangle([x + (w - bar_w) // 2, y, x + (w - bar_w) // 2 + bar_w - 1, y1], fill=color)
    draw.rectangle([x, y + (h - bar_h) // 2, x1, y + (h - bar_h) // 2 + bar_h - 1], fill=color)
    return float(bar_w * h + bar_h * w - bar_w * bar_h)


def _make_split(rng, out_dir, prefix, count, sizes, max_objects, image_format, first_ann_id):
    images, annotations, ann_id = [], [], first_ann_id
    out_dir.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        width, height = (int(v) for v in rng.integers(sizes[0], sizes[1] + 1, size=2))
        background = rng.integers(0, 256, size=3)
        pixels = np.clip(background + rng.normal(0, 12, size=(height, width, 3)), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels)
        draw = ImageDraw.Draw(image)
        image_id = index + 1
        placed = []
        for _ in range(int(rng.integers(1, max_objects + 1))):
            for _attempt in range(20):  # rejection sampling keeps objects mostly visible
                side = min(width, height)
                w = int(rng.integers(max(6, side // 8), max(7, side // 2)))
                h = int(rng.integers(max(6, side // 8), max(7, side // 2)))
                x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
                if all(_overlap((x, y, w, h), other) < 0.2 for other in placed):
                    break
            else:
                continue
            placed.append((x, y, w, h))
            cat_id = int(rng.integers(1, len(CATEGORIES) + 1))
            color = tuple(int(c) for c in (background + rng.integers(80, 176, size=3)) % 256)
            area = _draw_shape(draw, cat_id, x, y, w, h, color)
            annotations.append({"id": ann_id, "image_id": image_id, "category_id": cat_id,
                                "bbox": [x, y, w, h], "area": area, "iscrowd": 0})
            ann_id += 1
        file_name = f"{prefix}_{image_id:06d}.{image_format}"
        image.save(out_dir / file_name, quality=95) if image_format == "jpg" else image.save(out_dir / file_name)
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
    return images, annotations


def make_synthetic_coco(root, num_train=240, num_val=48, seed=0, min_size=96, max_size=160, max_objects=4,
                        image_format="png"):
    """Writes root/{train,val}/ images and root/annotations/instances_{train,val}.json; returns their paths.

    A set already generated with the same parameters is reused (root/params.json records them).
    """
    if not (8 <= min_size <= max_size):
        raise ValueError(f"need 8 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")
    if image_format not in ("png", "jpg"):
        raise ValueError(f"image_format={image_format!r}; choose 'png' or 'jpg'")
    if num_train < 1 or num_val < 1 or max_objects < 1:
        raise ValueError("num_train, num_val and max_objects must be >= 1")
    root = Path(root)
    params = dict(num_train=num_train, num_val=num_val, seed=seed, min_size=min_size, max_size=max_size,
                  max_objects=max_objects, image_format=image_format, version=1)
    paths = {split: {"images": str(root / split), "annotations": str(root / "annotations" / f"instances_{split}.json")}
             for split in ("train", "val")}
    meta = root / "params.json"
    if meta.exists() and json.loads(meta.read_text()) == params and all(
            Path(p["annotations"]).exists() for p in paths.values()):
        return paths
    rng = np.random.default_rng(seed)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    next_ann = 1
    for split, count in (("train", num_train), ("val", num_val)):
        images, anns = _make_split(rng, root / split, split, count, (min_size, max_size), max_objects,
                                   image_format, next_ann)
        next_ann += len(anns)
        data = {"info": {"description": f"linear_mha synthetic shapes ({split})"}, "licenses": [],
                "images": images, "annotations": anns, "categories": CATEGORIES}
        Path(paths[split]["annotations"]).write_text(json.dumps(data))
    meta.write_text(json.dumps(params))
    return paths
