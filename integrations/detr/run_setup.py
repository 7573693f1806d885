"""What the trainer and the backbone pretrainer both do before building a model: seed every generator, and point the
data options at the (cached) synthetic set when no data set is given. Apart from both entry points so neither
imports the other."""
import random
from pathlib import Path

import numpy as np
import torch

from .. import distributed as dist_utils
from .synthetic import make_synthetic_coco


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_data_args(args):
    """With no dataset given, points --{train,val}-{images,ann} at a (cached) generated synthetic set."""
    if args.coco_path or args.train_ann or args.val_ann:
        return
    root = Path(args.output_dir) / "synthetic-coco"
    if dist_utils.is_main_process():
        make_synthetic_coco(root, args.synthetic_train, args.synthetic_val, seed=args.seed)
    if dist_utils.is_dist_avail_and_initialized():
        torch.distributed.barrier()
    paths = make_synthetic_coco(root, args.synthetic_train, args.synthetic_val, seed=args.seed)  # cached: no rewrite
    args.train_images, args.train_ann = paths["train"]["images"], paths["train"]["annotations"]
    args.val_images, args.val_ann = paths["val"]["images"], paths["val"]["annotations"]
