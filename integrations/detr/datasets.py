"""COCO-format detection datasets through pycocotools, with clear errors for missing or corrupt files."""
import contextlib
import io
import json
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
    image_ids = {img.get("id") for img in data["images"]}
    for n, ann in enumerate(data["annotations"]):
        bbox = ann.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4) or ann.get("image_id") not in image_ids or \
                "category_id" not in ann:
            raise ValueError(f"annotation file {path}: annotation #{n} needs image_id of a listed image, "
                             f"category_id and bbox [x, y, w, h]; got {ann}")
        # COCOeval reads these; many COCO-format exports omit them.
        ann.setdefault("id", n + 1)
        ann.setdefault("iscrowd", 0)
        ann.setdefault("area", float(bbox[2] * bbox[3]))
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
        coco.createIndex()
    return coco


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
        self.flag = flag
        self.ids = sorted(self.coco.imgs.keys())
        self.transforms = transforms

    def __len__(self):
        return len(self.ids)

    def image_sizes(self):
        """Original (h, w) of every image, from the annotation file (no image is opened)."""
        return [(self.coco.imgs[i]["height"], self.coco.imgs[i]["width"]) for i in self.ids]

    def __getitem__(self, index):
        image_id = self.ids[index]
        info = self.coco.imgs[image_id]
        path = self.img_folder / info["file_name"]
        if not path.is_file():
            raise FileNotFoundError(f"image {path} (id {image_id}) listed in the annotations is missing")
        image = Image.open(path).convert("RGB")
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
