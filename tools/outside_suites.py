"""Run other projects' own tests against linear_mha: PyTorch's MultiheadAttention tests and the official DETR's
test_all.py with every nn.MultiheadAttention built as a LinearMultiheadAttention, and transformers' model tests with
every model they build patched. Each suite runs twice (as it is, then with linear_mha) and a table says what changed.

    # a PyTorch checkout of the installed release (git clone --depth 1 -b v2.14.1 https://github.com/pytorch/pytorch)
    python -m linear_mha.tools.outside_suites torch --checkout ~/src/pytorch --json runs/outside/torch_mha.json
    python -m linear_mha.tools.outside_suites torch --checkout ~/src/pytorch --mode kernel     # an approximation's differences
    # the official DETR (git clone https://github.com/facebookresearch/detr); --offline: no ImageNet download
    python -m linear_mha.tools.outside_suites detr --checkout ~/src/detr --offline
    # transformers at the installed release (its tests/ folder and test dependencies: pip install parameterized)
    python -m linear_mha.tools.outside_suites transformers --checkout ~/src/transformers --families llama gpt2 vit bert

The suites are not shipped with linear_mha (nor fetched by it): point --checkout at a clone. Each run is a pytest
process of its own with this module as a plugin (``-p tools.outside_suites``): it rebinds nn.MultiheadAttention for
the whole session to build LinearMultiheadAttention(mode=$LINEAR_MHA_OUTSIDE_MODE) (``linear_mha.patched``) before
the suite's modules import it, and patches each transformers model once it is built or loaded. The tests that cannot
pass by design, and what the linear methods change, are in docs/conformance.md.
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import xml.etree.ElementTree as ElementTree
from pathlib import Path

FAMILIES = ("llama", "gpt2", "vit", "bert", "deit", "detr")
SUITES = {  # test files, relative to the checkout
    # PyTorch's file imports torch.testing._internal, which ships with torch (and needs `pip install expecttest`).
    "torch": ["test/nn/test_multihead_attention.py"],
    "detr": ["test_all.py"],  # run from the checkout's root, which it imports (models, util, hubconf)
    "transformers": [f"tests/models/{family}/test_modeling_{family}.py" for family in FAMILIES],
}
BY_DESIGN = {  # tests that cannot pass with linear_mha in softmax mode, and why (docs/conformance.md)
    "torch": {"test_multihead_self_attn_two_masks_fast_path_mock": "mocks torch's private fused kernel"},
    # torch.jit.script compiles Python source, which LinearMultiheadAttention's forward is not written for: it refuses
    # with what to use instead (torch.export or torch.jit.trace)
    "detr": {"test_model_script_detection": "torch.jit.script", "test_model_script_panoptic": "torch.jit.script",
             "test_warpped_model_script_detection": "torch.jit.script"},
    "transformers": {
        "test_attention_outputs": "asks for attention weights", "test_assisted_decoding_sample": "asks for "
        "attention weights", "test_retain_grad_hidden_states_attentions": "asks for attention weights",
        # the harness patches each model as it is built, over the implementation the test has just asked for
        "test_can_set_attention_dynamically": "checks the implementation it built with (the harness patched it)",
        "test_sdpa_can_dispatch_non_composite_models": "checks the implementation it loaded with (the harness "
                                                       "patched it)"},
}
MODE_VARIABLE = "LINEAR_MHA_OUTSIDE_MODE"
OFFLINE_VARIABLE = "LINEAR_MHA_OUTSIDE_OFFLINE"
MODELS_VARIABLE = "LINEAR_MHA_OUTSIDE_PATCH_MODELS"  # set for the transformers suite
_active = None


def pytest_configure(config):
    """As a pytest plugin: every nn.MultiheadAttention built in this session is a LinearMultiheadAttention, and every
    transformers model is patched; offline, the weights a suite would download are a seeded random initialisation."""
    global _active
    if os.environ.get(OFFLINE_VARIABLE):
        import torch
        torch.hub.load_state_dict_from_url = _random_torchvision_weights
    mode = os.environ.get(MODE_VARIABLE)
    if mode:
        import linear_mha
        _active = linear_mha.patched(mode=mode)
        _active.__enter__()
        if os.environ.get(MODELS_VARIABLE):
            _patch_transformers_models(mode)


def pytest_unconfigure(config):
    if _active is not None:
        _active.__exit__(None, None, None)


def _random_torchvision_weights(url, *args, **kwargs):
    """What torch.hub would download for a torchvision classifier's URL (".../resnet50-0676ba61.pth"), as a seeded
    random initialisation of that architecture: the suites compare code paths, not accuracy."""
    import torch
    import torchvision
    name = url.rsplit("/", 1)[-1].split("-")[0]
    if not hasattr(torchvision.models, name):
        raise RuntimeError(f"--offline: no torchvision architecture named {name!r} for {url}; run with the network")
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None).state_dict()


def _patch_transformers_models(mode: str) -> None:
    """Patch every transformers model once the outermost one is built or loaded (the models built inside it, as
    parts, go with it): the __init__ of every PreTrainedModel class, own or inherited, and from_pretrained count how
    deep construction is, and patch when it returns to the top."""
    import linear_mha
    from transformers.modeling_utils import PreTrainedModel
    depth = threading.local()

    def built(model):
        if model is not None and not model.__dict__.get("_linear_mha_outside_patched"):
            linear_mha.patch(model, mode)
            model.__dict__["_linear_mha_outside_patched"] = True

    def counted(function, result_model):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            depth.n = getattr(depth, "n", 0) + 1
            try:
                result = function(*args, **kwargs)
            finally:
                depth.n -= 1
            if depth.n == 0:
                built(result_model(args, result))
            return result
        wrapper._linear_mha_counted = True
        return wrapper

    def wrap_init(cls):
        if not getattr(cls.__init__, "_linear_mha_counted", False):
            cls.__init__ = counted(cls.__init__, lambda args, result: args[0])

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in [PreTrainedModel, *subclasses(PreTrainedModel)]:
        wrap_init(cls)
    hook = PreTrainedModel.__dict__["__init_subclass__"].__func__

    def init_subclass(cls, **kwargs):
        hook(cls, **kwargs)
        wrap_init(cls)
    PreTrainedModel.__init_subclass__ = classmethod(init_subclass)
    loader = PreTrainedModel.__dict__["from_pretrained"].__func__
    PreTrainedModel.from_pretrained = classmethod(counted(
        loader, lambda args, result: result[0] if isinstance(result, tuple) else result))


def run_suite(checkout: Path, files, mode, report: Path, offline=False, extra=()) -> dict:
    """One pytest process over ``files``, with linear_mha when ``mode`` is given: {test id: outcome}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    for variable in (MODE_VARIABLE, OFFLINE_VARIABLE, MODELS_VARIABLE):
        env.pop(variable, None)
    if mode:
        env[MODE_VARIABLE] = mode
        if any(f.startswith("tests/models/") for f in files):
            env[MODELS_VARIABLE] = "1"
    if offline:
        env[OFFLINE_VARIABLE] = "1"
    cwd = checkout / Path(files[0]).parent if len(files) == 1 and files[0].startswith("test/") else checkout
    command = [sys.executable, "-m", "pytest", *(str(checkout / f) for f in files), "-q", "-p", "no:cacheprovider",
               "-p", "linear_mha.tools.outside_suites", f"--junitxml={report}", "-o", "junit_family=xunit2", *extra]
    subprocess.run(command, env=env, cwd=cwd, check=False)
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                          else "passed")
    return outcomes


def compare(suite: str, checkout: Path, files, mode: str, out_dir: Path, offline=False, extra=()) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    original = run_suite(checkout, files, None, out_dir / f"{suite}_original.xml", offline, extra)
    ours = run_suite(checkout, files, mode, out_dir / f"{suite}_{mode}.xml", offline, extra)
    if not original or not ours:
        raise SystemExit(f"{suite}: pytest collected no test (see its output above: a missing package?)")
    rows = []
    for name in sorted(set(original) | set(ours)):
        why = next((why for test, why in BY_DESIGN.get(suite, {}).items() if test in name), None)
        rows.append({"test": name, "original": original.get(name, "absent"), "linear_mha": ours.get(name, "absent"),
                     "by_design": why})
    count = {side: sum(r[side] == "passed" for r in rows) for side in ("original", "linear_mha")}
    regressions = [r["test"] for r in rows if r["original"] == "passed" and r["linear_mha"] != "passed"
                   and not r["by_design"]]
    import torch
    return {"suite": suite, "files": list(files), "mode": mode, "torch": torch.__version__, "offline": offline,
            "passed": count, "regressions": regressions, "tests": rows}


def print_table(result: dict) -> None:
    print(f"\n{result['suite']} ({', '.join(result['files'])}), linear_mha mode={result['mode']!r}")
    print("| test | original | linear_mha |\n|---|---|---|")
    for r in result["tests"]:
        if r["original"] == r["linear_mha"] == "skipped":
            continue
        note = f" (by design: {r['by_design']})" if r["by_design"] else ""
        print(f"| {r['test']} | {r['original']} | {r['linear_mha']}{note} |")
    print(f"passed: original {result['passed']['original']}, linear_mha {result['passed']['linear_mha']}; "
          f"regressions (not by design): {result['regressions'] or 'none'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--checkout", type=Path, required=True, help="a clone of the project whose tests to run")
    parser.add_argument("--mode", default="softmax", help="linear_mha's method (default: softmax, the exact one)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=["llama", "gpt2", "vit", "bert"],
                        help="transformers: the model families whose test files run (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("runs/outside"), help="pytest reports (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--offline", action="store_true",
                        help="weights a suite downloads (DETR's ImageNet ResNet) become a seeded random initialisation")
    parser.add_argument("-k", dest="select", help="only the tests pytest's -k expression selects")
    args = parser.parse_args(argv)
    files = SUITES[args.suite]
    if args.suite == "transformers":
        files = [f for f in files if f.split("/")[2] in args.families]
    missing = [f for f in files if not (args.checkout / f).is_file()]
    if missing:
        parser.error(f"--checkout: {args.checkout / missing[0]} does not exist; clone the project (see --help) and "
                     f"pass its root")
    extra = ["-k", args.select] if args.select else []
    result = compare(args.suite, args.checkout.resolve(), files, args.mode, args.out, args.offline, extra)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    from linear_mha import method_class  # imported late: this file is the suites' pytest plugin too
    exact = method_class(args.mode)().computes_torch_attention  # must pass all that torch's module passes
    return 1 if result["regressions"] and exact else 0


if __name__ == "__main__":
    sys.exit(main())
