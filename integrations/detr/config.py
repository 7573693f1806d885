"""Command-line options of `python -m linear_mha.integrations.detr.train`, with two presets of defaults.

`coco` (any dataset given: --coco-path, --train-ann, ...): the official DETR-R50 recipe (ResNet-50 from torchvision's
ImageNet weights, 6 + 6 layers, 300 epochs). `synthetic` (no dataset given): a small DETR on generated images, its
backbone pretrained on them first (cached), so a fresh machine trains a detector that learns in about ten minutes on
2 CPU cores. Both use the recommended linear attention in the encoder (taylor + a 3x3 depthwise-convolution local
term + rope); `--attention softmax` trains DETR as released. Any option given explicitly overrides the preset.
"""
import argparse

from linear_mha import available_methods

from ..console import HelpFormatter
from .backbone import SMALL_BODIES
from .backbone_weights import IMAGENET, RANDOM

# Both presets' linear attention, its local term and its options: the most accurate Linear-DETR within the elu
# kernel's cost in docs/detr.md (taylor + DWC 3x3 + 2-D RoPE: 105% of the AP of softmax given the same RoPE and local
# term, 3 seeds at 48 epochs, 1.04x the elu kernel's time per iteration). They go together: an explicit --attention
# without --dwc-kernel gets no local term and none of these options, so `--attention efficient` stays plain;
# --attention-option without --attention adds to them.
RECOMMENDED = "taylor"
RECOMMENDED_DWC_KERNEL = 3
RECOMMENDED_OPTIONS = ("rope=True",)
RECOMMENDED_OUTPUT_GATE = False
RECOMMENDED_ATTENTION = dict(attention=RECOMMENDED, dwc_kernel=RECOMMENDED_DWC_KERNEL,
                             output_gate=RECOMMENDED_OUTPUT_GATE, attention_option=list(RECOMMENDED_OPTIONS))

PRESETS = {
    "coco": dict(backbone="resnet50", hidden_dim=256, enc_layers=6, dec_layers=6, dim_feedforward=2048, nheads=8,
                 num_queries=100, epochs=300, lr_drop=200, lr=1e-4, lr_backbone=1e-5, batch_size=2,
                 scales=list(range(480, 801, 32)), max_size=1333, crop_sizes=[400, 500, 600], crop_min=384,
                 crop_max=600, val_size=800, dropout=0.1, crop=True, pretrain_backbone=0, num_workers=2,
                 **RECOMMENDED_ATTENTION),
    "synthetic": dict(backbone="small", hidden_dim=64, enc_layers=2, dec_layers=2, dim_feedforward=128, nheads=4,
                      num_queries=12, epochs=12, lr_drop=9, lr=5e-4, lr_backbone=5e-5, batch_size=8,
                      scales=[96, 112, 128, 144, 160], max_size=192, crop_sizes=[96, 112, 128], crop_min=64,
                      crop_max=128, val_size=128, dropout=0.0, crop=False, pretrain_backbone=1000, num_workers=0,
                      **RECOMMENDED_ATTENTION),
}


def _int_list(text):
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 480,512,544; got {text!r}")


def _preset_help(dest, extra=""):
    """The help of an option a preset fills: both presets' values, so --help shows what a run will use."""
    show = lambda v: (",".join(map(str, v)) or "none") if isinstance(v, list) else v  # noqa: E731
    synthetic, coco = show(PRESETS["synthetic"][dest]), show(PRESETS["coco"][dest])
    values = f"default {synthetic} (synthetic data and COCO)" if synthetic == coco else \
        f"default {synthetic} (synthetic data) / {coco} (COCO)"
    return f"{extra}; {values}" if extra else values


class _Preset(str):
    """Marks a help text to be replaced by the option's preset values (see get_args_parser)."""


def get_args_parser():
    p = argparse.ArgumentParser("python -m linear_mha.integrations.detr.train", description=__doc__, formatter_class=HelpFormatter)

    def a(*flags, **kw):
        action = p.add_argument(*flags, **kw)
        if isinstance(kw.get("help"), _Preset):
            action.help = _preset_help(action.dest, str(kw["help"]))
        return action
    g = _Preset("")
    # optimisation
    a("--lr", type=float, help=g)
    a("--lr-backbone", type=float, help=_Preset("0 freezes the backbone"))
    a("--batch-size", type=int, help=_Preset("per process"))
    a("--weight-decay", type=float, default=1e-4)
    a("--epochs", type=int, help=g)
    a("--lr-drop", type=int, help=_Preset("StepLR step in epochs"))
    a("--clip-max-norm", type=float, default=0.1, help="gradient clipping max norm (0 disables)")
    a("--max-iters", type=int, default=0, help="cap on iterations per epoch (0 = whole epoch), for quick runs")
    # model
    a("--backbone", help=_Preset("resnet18|resnet34|resnet50|resnet101|tiny|small"))
    a("--backbone-weights", metavar=f"{IMAGENET}|{RANDOM}|PATH",
      help=f"what the backbone starts from. {IMAGENET}: torchvision's ImageNet-1k weights of the ResNet "
           "(IMAGENET1K_V1, as the official DETR), downloaded once into $TORCH_HOME/hub/checkpoints (default "
           "~/.cache/torch); the default for a ResNet without --pretrained or --resume. PATH: a local state_dict: "
           "torchvision's file (without a network: e.g. resnet50-0676ba61.pth, fetched elsewhere from "
           "https://download.pytorch.org/models/), a DETR checkpoint's backbone, or tiny/small weights from "
           f"linear_mha.integrations.detr.pretrain. {RANDOM}: random initialisation. Default for tiny/small: "
           "--pretrain-backbone's")
    a("--pretrain-backbone", type=int, metavar="ITERS",
      help=_Preset("without --backbone-weights, first pretrain the tiny/small backbone on the training images for "
                   "ITERS iterations (cached under $LINEAR_MHA_CACHE/detr-backbones; 0 = start from random; a "
                   "ResNet takes ImageNet weights instead)"))
    a("--pretrained", help="DETR checkpoint (file with 'model') loaded strictly before training/eval")
    a("--dilation", action="store_true", help="DC5: dilate layer4 instead of striding (stride 16)")
    a("--position-embedding", default="sine", choices=("sine", "learned"))
    a("--enc-layers", type=int, help=g)
    a("--dec-layers", type=int, help=g)
    a("--dim-feedforward", type=int, help=g)
    a("--hidden-dim", type=int, help=g)
    a("--dropout", type=float, help=g)
    a("--nheads", type=int, help=g)
    a("--num-queries", type=int, help=g)
    a("--pre-norm", action="store_true")
    a("--no-aux-loss", dest="aux_loss", action="store_false")
    a("--num-classes", type=int, help="largest category id + 1 (default: from the training annotations)")
    # attention (applied through linear_mha.patch)
    a("--attention", choices=available_methods(),
      help=_Preset("attention method of the patched modules (linear_mha's registry, read when the parser is built); "
                   "softmax: DETR as released"))
    a("--attention-on", default="encoder", help="comma list of encoder,decoder,cross or all")
    a("--proj-k", type=int, default=256, help="linformer projected length")
    a("--param-sharing", default="layerwise", choices=("none", "headwise", "kv", "layerwise"),
      help="linformer projection sharing (layerwise = one projection for all layers)")
    a("--feature-map", default="elu", choices=("elu", "relu", "favor"), help="kernel attention feature map")
    a("--dwc-kernel", type=int, metavar="K",
      help=_Preset("add a K x K depthwise convolution of the values over the feature map to encoder self-attention "
                   "(FLatten's DWC / MLLA's LePE; odd K; 0 = none); with --attention given, 0 unless given too"))
    a("--output-gate", action=argparse.BooleanOptionalAction,
      help=_Preset("multiply each patched head's output by 2 sigmoid(q W + b), W and b zero at first (linear_mha's "
                   "output_gate); with --attention given, off unless given too"))
    a("--calibrate-steps", type=int, default=0, metavar="N",
      help="with --pretrained (a softmax DETR) and a learnable --attention such as hedgehog: first fit the linear "
           "attention to the softmax attention it replaces, N steps on training images (linear_mha.calibrate)")
    a("--calibrate-lr", type=float, default=1e-2, help="learning rate of --calibrate-steps")
    a("--distill", action="store_true",
      help="train against the --pretrained softmax DETR's predictions instead of the labels (query by query: class "
           "KL, box L1 and GIoU, weighted as DETR's loss): the fine-tune of a conversion, after --calibrate-steps")
    a("--attention-option", action="append", metavar="NAME=VALUE",
      help=_Preset("any option of the --attention method (repeatable; values are Python literals or strings); "
                   "without --attention, added to the preset's"))
    # matcher and loss
    a("--set-cost-class", type=float, default=1.0)
    a("--set-cost-bbox", type=float, default=5.0)
    a("--set-cost-giou", type=float, default=2.0)
    a("--bbox-loss-coef", type=float, default=5.0)
    a("--giou-loss-coef", type=float, default=2.0)
    a("--eos-coef", type=float, default=0.1, help="weight of the no-object class in the CE loss")
    # data
    a("--coco-path", help="COCO root with train2017/, val2017/, annotations/instances_{train,val}2017.json; any "
                          "data given selects the coco preset (the DETR-R50 recipe)")
    a("--train-images", help="images dir of any COCO-format training set (with --train-ann)")
    a("--train-ann", help="instances json of the training set")
    a("--val-images", help="images dir of the validation set (with --val-ann)")
    a("--val-ann", help="instances json of the validation set")
    a("--synthetic-train", type=int, default=2000, help="images in the generated synthetic training set")
    a("--synthetic-val", type=int, default=200, help="images in the generated synthetic validation set (1-4 objects "
                                                     "each)")
    a("--scales", type=_int_list, help=_Preset("training shorter-side sizes, comma list"))
    a("--max-size", type=int, help=_Preset("longest side after resizing"))
    a("--crop-sizes", type=_int_list, help=_Preset("pre-crop resize sizes of the random-crop branch"))
    a("--crop-min", type=int, help=g)
    a("--crop-max", type=int, help=g)
    a("--crop", dest="crop", action="store_true", default=None, help=_Preset("use the random-size-crop branch"))
    a("--no-crop", dest="crop", action="store_false", default=None, help="disable the random-size-crop branch")
    a("--val-size", type=int, help=_Preset("evaluation shorter-side size"))
    a("--num-workers", type=int, help=_Preset("data-loading processes (on a few CPU cores they slow training)"))
    # run
    a("--output-dir", default="runs/detr", help="checkpoints, log.jsonl and curves.png go here")
    a("--device", default=None, help="cuda or cpu (default: cuda when available)")
    a("--seed", type=int, default=42)
    a("--resume", help="checkpoint to continue from exactly (model, optimizer, scheduler, epoch, RNG)")
    a("--eval", action="store_true", help="only evaluate (with --resume or --pretrained)")
    a("--no-amp", dest="amp", action="store_false", help="disable mixed precision on CUDA")
    a("--no-progress", dest="progress", action="store_false", help="disable tqdm bars")
    a("--verbose", action="store_true", help="print COCOeval's 12-line table after every evaluation, not only at the end")
    a("--threads", type=int, help="torch CPU threads (default: torch's; set it to the free cores when the machine "
                                  "is shared)")
    a("--overwrite", action="store_true", help="replace a run already in --output-dir (else refused; --resume "
                                               "continues it)")
    return p


def resolve_preset(args):
    """Fills every option left unset from the preset matching the data source; returns args."""
    has_data = bool(args.coco_path or args.train_ann or args.val_ann)
    args.preset = "coco" if has_data else "synthetic"
    args.attention_is_default = args.attention is None  # the banner says so; --pretrained checks it
    backbone = args.backbone or PRESETS[args.preset]["backbone"]
    if args.pretrain_backbone is None and backbone not in SMALL_BODIES:
        args.pretrain_backbone = 0  # the preset's pretraining is its small backbone's; a ResNet has ImageNet's
    if args.attention is not None and args.dwc_kernel is None:
        args.dwc_kernel = 0  # the preset's kernel belongs to the preset's method
    if args.attention is not None and args.output_gate is None:
        args.output_gate = False  # and so does its gate
    if args.attention is not None and args.attention_option is None:
        args.attention_option = []  # and so do its options
    elif args.attention is None and args.attention_option is not None:
        # given options refine the preset's method; a later NAME=VALUE wins, so `rope=False` turns the preset's off
        args.attention_option = PRESETS[args.preset]["attention_option"] + args.attention_option
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)  # a run's lists are its own
    return args


def parse_args(argv=None):
    return resolve_preset(get_args_parser().parse_args(argv))
