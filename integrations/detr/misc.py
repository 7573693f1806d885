"""NestedTensor: a padded image batch together with its padding mask (True = padding)."""
import torch


class NestedTensor:
    def __init__(self, tensors, mask):
        self.tensors = tensors
        self.mask = mask

    def to(self, device, non_blocking=False):
        return NestedTensor(self.tensors.to(device, non_blocking=non_blocking),
                            None if self.mask is None else self.mask.to(device, non_blocking=non_blocking))

    def decompose(self):
        return self.tensors, self.mask


def nested_tensor_from_tensor_list(tensors, size_divisibility=1):
    """Pads (C, H, W) images to a common (bottom/right) size; mask marks the padded pixels."""
    if len(tensors) == 0:
        raise ValueError("nested_tensor_from_tensor_list: got an empty list of images")
    channels = {t.shape[0] for t in tensors}
    if len(channels) != 1 or any(t.dim() != 3 for t in tensors):
        raise ValueError("nested_tensor_from_tensor_list: expected (C, H, W) images with one C, got "
                         f"{[tuple(t.shape) for t in tensors]}")
    h = max(t.shape[1] for t in tensors)
    w = max(t.shape[2] for t in tensors)
    if size_divisibility > 1:
        h = -(-h // size_divisibility) * size_divisibility
        w = -(-w // size_divisibility) * size_divisibility
    batch = tensors[0].new_zeros((len(tensors), tensors[0].shape[0], h, w))
    mask = torch.ones((len(tensors), h, w), dtype=torch.bool, device=tensors[0].device)
    for img, pad_img, m in zip(tensors, batch, mask):
        pad_img[:, :img.shape[1], :img.shape[2]].copy_(img)
        m[:img.shape[1], :img.shape[2]] = False
    return NestedTensor(batch, mask)


def collate_fn(batch):
    images, targets = zip(*batch)
    return nested_tensor_from_tensor_list(list(images)), list(targets)
