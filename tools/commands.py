"""The console commands a wheel installs: each runs its module as ``python -m <module>`` would (its ``__main__``
block included), so the command and the module form take the same arguments and behave the same.

    linear-mha-detr-train ...       python -m linear_mha.integrations.detr.train ...   (torchrun: the -m form)
"""
import runpy

COMMANDS = {  # command -> module (setup.cfg's console_scripts name these functions)
    "linear-mha-detr-train": "linear_mha.integrations.detr.train",
    "linear-mha-detr-pretrain": "linear_mha.integrations.detr.pretrain",
    "linear-mha-detr-compare": "linear_mha.tools.detr_compare",
    "linear-mha-synthetic-coco": "linear_mha.tools.make_synthetic_coco",
    "linear-mha-benchmark": "linear_mha.tools.benchmark",
    "linear-mha-patch-model": "linear_mha.tools.patch_model",
    "linear-mha-calibrate-bench": "linear_mha.tools.calibrate_bench",
    "linear-mha-train-lm": "linear_mha.tools.train_lm",
    "linear-mha-mqar": "linear_mha.tools.mqar",
}


def _command(module: str):
    def run():
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    run.__name__ = run.__qualname__ = module.rsplit(".", 1)[-1]
    run.__doc__ = f"python -m {module}"
    return run


detr_train = _command(COMMANDS["linear-mha-detr-train"])
detr_pretrain = _command(COMMANDS["linear-mha-detr-pretrain"])
detr_compare = _command(COMMANDS["linear-mha-detr-compare"])
synthetic_coco = _command(COMMANDS["linear-mha-synthetic-coco"])
benchmark = _command(COMMANDS["linear-mha-benchmark"])
patch_model = _command(COMMANDS["linear-mha-patch-model"])
calibrate_bench = _command(COMMANDS["linear-mha-calibrate-bench"])
train_lm = _command(COMMANDS["linear-mha-train-lm"])
mqar = _command(COMMANDS["linear-mha-mqar"])
