"""CLI: generate the synthetic COCO-format shapes detection set (see integrations/detr/synthetic.py).

    python -m linear_mha.tools.make_synthetic_coco --out data/synthetic --num-train 240 --num-val 48 --seed 0
"""
import argparse
import json

from linear_mha.integrations.console import HelpFormatter
from linear_mha.integrations.detr.synthetic import make_synthetic_coco


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m linear_mha.tools.make_synthetic_coco", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="output root directory")
    p.add_argument("--num-train", type=int, default=240)
    p.add_argument("--num-val", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-size", type=int, default=96, help="smallest image side in pixels")
    p.add_argument("--max-size", type=int, default=160, help="largest image side in pixels")
    p.add_argument("--max-objects", type=int, default=4)
    p.add_argument("--format", default="png", choices=("png", "jpg"))
    a = p.parse_args(argv)
    paths = make_synthetic_coco(a.out, a.num_train, a.num_val, a.seed, a.min_size, a.max_size, a.max_objects, a.format)
    print(json.dumps(paths, indent=2))


if __name__ == "__main__":
    main()
