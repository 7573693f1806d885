"""2-D position encodings for the flattened feature map: fixed sine (default) and learned."""
import math

import torch
from torch import nn

from .misc import NestedTensor


class PositionEmbeddingSine(nn.Module):
    """Sine encoding over (y, x) counted inside the unpadded region only.

    Coordinates are cumulative sums of the not-padding mask, normalised by the image's own
    extent, so a valid pixel gets the same encoding however much padding the batch adds.
    """

    def __init__(self, num_pos_feats=64, temperature=10000, normalize=False, scale=None):
        super().__init__()
        if scale is not None and not normalize:
            raise ValueError("PositionEmbeddingSine: scale is only used with normalize=True")
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        self.scale = 2 * math.pi if scale is None else scale

    def forward(self, tensor_list: NestedTensor):
        mask = tensor_list.mask
        if mask is None:
            raise ValueError("PositionEmbeddingSine needs a padding mask (NestedTensor.mask is None)")
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        if self.normalize:
            eps = 1e-6
            y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class PositionEmbeddingLearned(nn.Module):
    """Learned row/column embeddings indexed from the top-left corner.

    Padding is at the bottom/right, so valid positions keep their indices whatever the padding.
    """

    def __init__(self, num_pos_feats=256, max_positions=50):
        super().__init__()
        self.row_embed = nn.Embedding(max_positions, num_pos_feats)
        self.col_embed = nn.Embedding(max_positions, num_pos_feats)
        nn.init.uniform_(self.row_embed.weight)
        nn.init.uniform_(self.col_embed.weight)

    def forward(self, tensor_list: NestedTensor):
        x = tensor_list.tensors
        h, w = x.shape[-2:]
        limit = self.row_embed.num_embeddings
        if h > limit or w > limit:
            raise ValueError(f"learned position embedding covers {limit}x{limit} feature cells but got {h}x{w}; "
                             "use --position-embedding sine or smaller images")
        x_emb = self.col_embed(torch.arange(w, device=x.device))
        y_emb = self.row_embed(torch.arange(h, device=x.device))
        pos = torch.cat([x_emb.unsqueeze(0).expand(h, w, -1), y_emb.unsqueeze(1).expand(h, w, -1)], dim=-1)
        return pos.permute(2, 0, 1).unsqueeze(0).expand(x.shape[0], -1, -1, -1)


def build_position_encoding(args):
    steps = args.hidden_dim // 2
    if args.position_embedding in ("v2", "sine"):
        return PositionEmbeddingSine(steps, normalize=True)
    if args.position_embedding in ("v3", "learned"):
        return PositionEmbeddingLearned(steps)
    raise ValueError(f"position_embedding={args.position_embedding!r}; choose 'sine' or 'learned'")
