"""DETR's joint image+target transforms: flip, multi-scale resize with max size, random size crop, normalize.

Targets carry absolute xyxy `boxes`, `labels`, `area`, `iscrowd` and `size` (h, w); Normalize turns
boxes into cxcywh relative to the final image size, which is what the model predicts.
"""
import math
import random

import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F

from .box_ops import box_xyxy_to_cxcywh

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def resized_hw(hw, size, max_size=None):
    """(h, w) after resizing the shorter side to `size` while keeping the longer side about <= max_size, exactly
    as the official DETR does: the capped short side is rounded (Python's round), so the longer side can exceed
    max_size by up to half the aspect ratio (a pixel for COCO's images; max_padded_hw accounts for it)."""
    h, w = hw
    if max_size is not None:
        short, long_ = float(min(h, w)), float(max(h, w))
        if long_ / short * size > max_size:
            size = max(1, int(round(max_size * short / long_)))
    if (w <= h and w == size) or (h <= w and h == size):
        return h, w
    if w < h:
        return int(size * h / w), size
    return size, int(size * w / h)


def crop(image, target, region):
    top, left, h, w = region
    image = F.crop(image, top, left, h, w)
    target = dict(target)
    target["size"] = torch.tensor([h, w])
    if "boxes" in target:
        boxes = target["boxes"] - torch.as_tensor([left, top, left, top], dtype=torch.float32)
        boxes = torch.min(boxes.reshape(-1, 2, 2), torch.as_tensor([w, h], dtype=torch.float32)).clamp(min=0)
        target["area"] = (boxes[:, 1, :] - boxes[:, 0, :]).prod(dim=1)
        target["boxes"] = boxes.reshape(-1, 4)
        keep = torch.all(boxes[:, 1, :] > boxes[:, 0, :], dim=1)  # drop boxes cropped away entirely
        for field in ("boxes", "labels", "area", "iscrowd"):
            target[field] = target[field][keep]
    return image, target


def hflip(image, target):
    image = F.hflip(image)
    w, _ = image.size
    target = dict(target)
    if "boxes" in target:
        target["boxes"] = target["boxes"][:, [2, 1, 0, 3]] * torch.as_tensor([-1, 1, -1, 1]) + torch.as_tensor(
            [w, 0, w, 0])
    return image, target


def resize(image, target, size, max_size=None):
    w, h = image.size
    new_h, new_w = resized_hw((h, w), size, max_size)
    image = F.resize(image, [new_h, new_w])
    target = dict(target)
    ratio_w, ratio_h = new_w / w, new_h / h
    if "boxes" in target:
        target["boxes"] = target["boxes"] * torch.as_tensor([ratio_w, ratio_h, ratio_w, ratio_h])
    if "area" in target:
        target["area"] = target["area"] * (ratio_w * ratio_h)
    target["size"] = torch.tensor([new_h, new_w])
    return image, target


class RandomSizeCrop:
    def __init__(self, min_size, max_size):
        if min_size > max_size:
            raise ValueError(f"crop_min={min_size} must be <= crop_max={max_size}")
        self.min_size, self.max_size = min_size, max_size

    def __call__(self, img, target):
        # Images smaller than min_size are cropped to their own size instead of failing.
        w = random.randint(min(self.min_size, img.width), min(img.width, self.max_size))
        h = random.randint(min(self.min_size, img.height), min(img.height, self.max_size))
        return crop(img, target, T.RandomCrop.get_params(img, [h, w]))


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img, target):
        return hflip(img, target) if random.random() < self.p else (img, target)


class RandomResize:
    def __init__(self, sizes, max_size=None):
        if not sizes:
            raise ValueError("RandomResize needs at least one size (check --scales / --crop-sizes)")
        self.sizes, self.max_size = list(sizes), max_size

    def __call__(self, img, target):
        return resize(img, target, random.choice(self.sizes), self.max_size)


class RandomSelect:
    def __init__(self, first, second, p=0.5):
        self.first, self.second, self.p = first, second, p

    def __call__(self, img, target):
        return self.first(img, target) if random.random() < self.p else self.second(img, target)


class ToTensor:
    def __call__(self, img, target):
        return F.to_tensor(img), target


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, image, target):
        image = F.normalize(image, mean=self.mean, std=self.std)
        target = dict(target)
        h, w = image.shape[-2:]
        if "boxes" in target:
            target["boxes"] = box_xyxy_to_cxcywh(target["boxes"]) / torch.tensor([w, h, w, h], dtype=torch.float32)
        return image, target


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, image, target):
        for t in self.transforms:
            image, target = t(image, target)
        return image, target


def make_coco_transforms(image_set, args):
    """DETR's recipe, with sizes taken from args (scales, max_size, crop_*, val_size)."""
    normalize = Compose([ToTensor(), Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    if image_set == "train":
        scale = RandomResize(args.scales, max_size=args.max_size)
        if args.crop:
            if min(args.crop_sizes) < args.crop_min:
                raise ValueError(f"--crop-sizes {args.crop_sizes} must all be >= --crop-min {args.crop_min}, so every "
                                 "crop is at least crop_min (the Linformer length bound relies on it)")
            crop_branch = Compose([RandomResize(args.crop_sizes), RandomSizeCrop(args.crop_min, args.crop_max),
                                   RandomResize(args.scales, max_size=args.max_size)])
            scale = RandomSelect(scale, crop_branch)
        return Compose([RandomHorizontalFlip(), scale, normalize])
    if image_set == "val":
        return Compose([RandomResize([args.val_size], max_size=args.max_size), normalize])
    raise ValueError(f"image_set={image_set!r}; choose 'train' or 'val'")


def max_padded_hw(image_sizes, args, image_set):
    """Largest (H, W) a padded batch of this split can have after its transforms.

    image_sizes: original (h, w) of every image of the split. Resizing is monotone in the requested
    size, so the largest scale bounds the plain branch; a random crop can have any aspect ratio
    between crop_min and crop_max whatever the image, so its bound comes from those extremes.
    """
    if not image_sizes:
        raise ValueError(f"max_padded_hw: no image sizes for split {image_set!r}")
    size = args.val_size if image_set == "val" else max(args.scales)
    outs = [resized_hw(hw, size, args.max_size) for hw in image_sizes]
    if image_set == "train" and args.crop:
        # Either side of a crop can be the long one, and flooring under the max_size cap makes the
        # extreme aspect ratio not always the largest output, so bound by the cap when it can bind.
        long_side = int(size * args.crop_max / args.crop_min)
        if args.max_size is not None:  # rounding the capped short side (by <= 1/2) can take the long side over
            long_side = min(long_side, args.max_size + int(0.5 * args.crop_max / args.crop_min))
        outs.append((long_side, long_side))
    return max(h for h, _ in outs), max(w for _, w in outs)


def feature_tokens(padded_hw, stride):
    """Tokens of the backbone feature map for a padded (H, W): every stride-2 stage rounds up."""
    return math.ceil(padded_hw[0] / stride) * math.ceil(padded_hw[1] / stride)
