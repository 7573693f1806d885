"""COCO-format detection datasets through pycocotools, with clear errors for missing or corrupt files."""
import contextlib
import io
import json
import math
from pathlib import Path

import torch
from PIL import Image
from pycocotools.coco import COCO

from .transforms import make_coco_transforms


def load_coco(ann_file, flag="--train-ann/--val-ann"):
    """Validated pycocotools COCO object for an instances json; errors name the file and the fix."""
    path = Path(ann_file)
    if not path.is_file():
        raise FileNotFoundError(f"annotation file {path} does not exist; pass an existing COCO instances json "
                                f"with {flag} (or a --coco-path containing annotations/instances_*2017.json)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"annotation file {path} is not valid JSON ({exc}); regenerate or re-download it") from None
    if not isinstance(data, dict):
        raise ValueError(f"annotation file {path} must hold a JSON object with images/annotations/categories")
    missing = [k for k in ("images", "annotations", "categories") if k not in data]
    if missing:
        raise ValueError(f"annotation file {path} lacks the COCO keys {missing}; it must be a COCO 'instances' file")
    _check_entries(path, data)
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
        coco.createIndex()
    return coco


def _check_entries(path, data):
    """Every field the loader, the transforms and COCOeval read, checked up front: a damaged or foreign file fails
    here with the entry at fault, not later with a raw KeyError or TypeError in a data-loader worker."""
    def refuse(what):
        raise ValueError(f"annotation file {path}: {what}; it must be a COCO 'instances' file (regenerate or "
                         f"re-download it)")

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    for key in ("images", "annotations", "categories"):
        if not isinstance(data[key], list) or not all(isinstance(entry, dict) for entry in data[key]):
            refuse(f"'{key}' must be a list of objects")
    for n, img in enumerate(data["images"]):
        if not isinstance(img.get("id"), int) or not isinstance(img.get("file_name"), str):
            refuse(f"image #{n} needs an integer id and a file_name string; got {img}")
        if any(k in img and not (isinstance(img[k], int) and img[k] > 0) for k in ("width", "height")):
            refuse(f"image #{n} has a width/height that is not a positive integer; got {img}")
    for n, cat in enumerate(data["categories"]):
        if not isinstance(cat.get("id"), int):
            refuse(f"category #{n} needs an integer id; got {cat}")
    image_ids, category_ids = {img["id"] for img in data["images"]}, {cat["id"] for cat in data["categories"]}
    for n, ann in enumerate(data["annotations"]):
        bbox = ann.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(number(x) for x in bbox)) or \
                not _listed(ann.get("image_id"), image_ids) or not isinstance(ann.get("category_id"), int):
            refuse(f"annotation #{n} needs image_id of a listed image, an integer category_id and bbox "
                   f"[x, y, w, h] of four numbers; got {ann}")
        # COCOeval reads these; many COCO-format exports omit them.
        ann.setdefault("id", n + 1)
        ann.setdefault("iscrowd", 0)
        if not number(ann.setdefault("area", float(bbox[2] * bbox[3]))):
            refuse(f"annotation #{n} has an area that is not a number; got {ann}")
        if not isinstance(ann["id"], int) or ann["iscrowd"] not in (0, 1):
            refuse(f"annotation #{n} needs an integer id and iscrowd 0 or 1; got {ann}")
    unlisted = {ann["category_id"] for ann in data["annotations"]} - category_ids
    if unlisted:  # else the matcher fails deep inside with an index error naming neither
        raise ValueError(f"annotation file {path}: the annotations use category ids {sorted(unlisted)[:10]} that their "
                         f"file's 'categories' does not list; add them to 'categories'")
    # pycocotools indexes by id: a repeated id would silently hide an entry from training or evaluation.
    for key in ("images", "annotations", "categories"):
        ids = [entry["id"] for entry in data[key]]
        if len(set(ids)) != len(ids):
            refuse(f"'{key}' repeats the id {next(i for i in ids if ids.count(i) > 1)}; ids must be unique")


def _listed(x, ids):
    return isinstance(x, int) and x in ids


def _target_from_annotations(image_id, anns, width, height):
    anns = [a for a in anns if not a.get("iscrowd", 0)]
    boxes = torch.as_tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
    boxes[:, 2:] += boxes[:, :2]
    boxes[:, 0::2].clamp_(min=0, max=width)
    boxes[:, 1::2].clamp_(min=0, max=height)
    keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
    return {"boxes": boxes[keep],
            "labels": torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)[keep],
            "area": torch.tensor([a["area"] for a in anns], dtype=torch.float32)[keep],
            "iscrowd": torch.zeros(int(keep.sum()), dtype=torch.int64),
            "image_id": torch.tensor(image_id), "orig_size": torch.tensor([height, width]),
            "size": torch.tensor([height, width])}


class CocoDetection(torch.utils.data.Dataset):
    def __init__(self, img_folder, ann_file, transforms=None, flag="--train-ann/--val-ann"):
        self.img_folder = Path(img_folder)
        if not self.img_folder.is_dir():
            raise FileNotFoundError(f"images directory {self.img_folder} does not exist; pass the folder holding "
                                    "the images listed in the annotation file")
        self.coco = load_coco(ann_file, flag)
        self.ann_file, self.flag = ann_file, flag
        self.ids = sorted(self.coco.imgs.keys())
        self.transforms = transforms

    def __len__(self):
        return len(self.ids)

    def image_sizes(self):
        """Original (h, w) of every image, from the annotation file (no image is opened)."""
        unsized = [i for i in self.ids if not {"height", "width"} <= self.coco.imgs[i].keys()]
        if unsized:
            raise ValueError(f"annotation file {self.ann_file}: image id {unsized[0]} (and {len(unsized) - 1} more) "
                             f"has no width/height, which plans the padded size; add them to its 'images' entries")
        return [(self.coco.imgs[i]["height"], self.coco.imgs[i]["width"]) for i in self.ids]

    def __getitem__(self, index):
        image_id = self.ids[index]
        info = self.coco.imgs[image_id]
        path = self.img_folder / info["file_name"]
        if not path.is_file():
            raise FileNotFoundError(f"image {path} (id {image_id}) listed in the annotations is missing")
        try:
            image = Image.open(path).convert("RGB")
        except (OSError, SyntaxError, ValueError) as exc:  # PIL: unidentified, truncated or damaged image data
            raise ValueError(f"image {path} (id {image_id}) cannot be read ({type(exc).__name__}: {exc}); "
                             f"replace it with the image the annotations describe") from None
        if "width" in info and "height" in info and image.size != (info["width"], info["height"]):
            # The padded batch sizes (and Linformer's seq_len) are planned from the annotation file's sizes.
            raise ValueError(f"image {path} is {image.size[0]} x {image.size[1]} (width x height) but the "
                             f"annotation file ({self.flag}) says {info['width']} x {info['height']}; fix the "
                             f"annotation's width/height or pass the images it describes")
        target = _target_from_annotations(image_id, self.coco.imgToAnns.get(image_id, []), *image.size)
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


def dataset_paths(image_set, args):
    """(images dir, annotation file, flag name) for a split from --coco-path or --{train,val}-{images,ann}."""
    if args.coco_path:
        root = Path(args.coco_path)
        if not root.is_dir():
            raise FileNotFoundError(f"--coco-path {root} is not a directory; it must contain train2017/, val2017/ "
                                    "and annotations/")
        return root / f"{image_set}2017", root / "annotations" / f"instances_{image_set}2017.json", "--coco-path"
    images, ann = getattr(args, f"{image_set}_images"), getattr(args, f"{image_set}_ann")
    if not images or not ann:
        raise ValueError(f"split {image_set!r} needs --{image_set}-images and --{image_set}-ann (or --coco-path)")
    return Path(images), Path(ann), f"--{image_set}-ann"


def build_dataset(image_set, args):
    images, ann, flag = dataset_paths(image_set, args)
    return CocoDetection(images, ann, transforms=make_coco_transforms(image_set, args), flag=flag)
