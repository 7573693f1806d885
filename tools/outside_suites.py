"""Run another project's own tests against linear_mha, with every nn.MultiheadAttention built as a
LinearMultiheadAttention: PyTorch's MultiheadAttention tests and the official DETR's test_all.py. Each suite runs
twice (the original class, then ours) and a table says what changed.

    # a PyTorch checkout of the installed release (git clone --depth 1 -b v2.14.1 https://github.com/pytorch/pytorch)
    python -m tools.outside_suites torch --checkout ~/src/pytorch --json runs/outside/torch_mha.json
    python -m tools.outside_suites torch --checkout ~/src/pytorch --mode kernel     # an approximation's differences
    # the official DETR (git clone https://github.com/facebookresearch/detr); --offline: no ImageNet download
    python -m tools.outside_suites detr --checkout ~/src/detr --offline

The suites are not shipped with linear_mha (nor fetched by it): point --checkout at a clone. Each run is a pytest
process of its own; as a pytest plugin (``-p tools.outside_suites``) this module rebinds nn.MultiheadAttention for
the whole session to build LinearMultiheadAttention(mode=$LINEAR_MHA_OUTSIDE_MODE) (``linear_mha.patched``), before
the suite's modules import it. The expected differences of an approximation and the tests that cannot pass by
design are listed in docs/conformance.md.
"""
import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

SUITES = {
    # PyTorch's file imports torch.testing._internal, which ships with torch (and needs `pip install expecttest`).
    "torch": "test/nn/test_multihead_attention.py",
    "detr": "test_all.py",  # run from the checkout's root, which it imports (models, util, hubconf)
}
BY_DESIGN = {  # tests that cannot pass with a stand-in, and why (docs/conformance.md)
    # mocks torch's private fused kernel (torch._native_multi_head_attention) to see torch's own fast path taken
    "torch": {"test_multihead_self_attn_two_masks_fast_path_mock": "mocks torch's private fused kernel"},
    # torch.jit.script compiles Python source, which LinearMultiheadAttention's forward is not written for: it
    # refuses with what to use instead (torch.export or torch.jit.trace)
    "detr": {"test_model_script_detection": "torch.jit.script", "test_model_script_panoptic": "torch.jit.script",
             "test_warpped_model_script_detection": "torch.jit.script"},
}
MODE_VARIABLE = "LINEAR_MHA_OUTSIDE_MODE"
OFFLINE_VARIABLE = "LINEAR_MHA_OUTSIDE_OFFLINE"
_active = None


def pytest_configure(config):
    """As a pytest plugin: every nn.MultiheadAttention built in this session is a LinearMultiheadAttention; offline,
    the weights a suite would download are a seeded random initialisation."""
    global _active
    if os.environ.get(OFFLINE_VARIABLE):
        import torch
        torch.hub.load_state_dict_from_url = _random_torchvision_weights
    mode = os.environ.get(MODE_VARIABLE)
    if mode:
        import linear_mha
        _active = linear_mha.patched(mode=mode)
        _active.__enter__()


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


def pytest_unconfigure(config):
    if _active is not None:
        _active.__exit__(None, None, None)


def run_suite(test_file: Path, mode, report: Path, offline=False, extra=()) -> dict:
    """One pytest process over test_file, with linear_mha's stand-in when ``mode`` is given: {test id: outcome}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop(MODE_VARIABLE, None)
    env.pop(OFFLINE_VARIABLE, None)
    if mode:
        env[MODE_VARIABLE] = mode
    if offline:
        env[OFFLINE_VARIABLE] = "1"
    command = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", "-p",
               "tools.outside_suites", f"--junitxml={report}", "-o", "junit_family=xunit2", *extra]
    subprocess.run(command, env=env, cwd=test_file.parent, check=False)
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                          else "passed")
    return outcomes


def compare(suite: str, test_file: Path, mode: str, out_dir: Path, offline=False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    original = run_suite(test_file, None, out_dir / f"{suite}_original.xml", offline)
    ours = run_suite(test_file, mode, out_dir / f"{suite}_{mode}.xml", offline)
    if not original or not ours:
        raise SystemExit(f"{test_file}: pytest collected no test (see its output above: a missing package?)")
    rows = []
    for name in sorted(set(original) | set(ours)):
        why = next((why for test, why in BY_DESIGN.get(suite, {}).items() if test in name), None)
        rows.append({"test": name, "original": original.get(name, "absent"), "linear_mha": ours.get(name, "absent"),
                     "by_design": why})
    count = {side: sum(r[side] == "passed" for r in rows) for side in ("original", "linear_mha")}
    regressions = [r["test"] for r in rows if r["original"] == "passed" and r["linear_mha"] != "passed"
                   and not r["by_design"]]
    import torch
    return {"suite": suite, "file": SUITES[suite], "mode": mode, "torch": torch.__version__, "offline": offline,
            "passed": count, "regressions": regressions, "tests": rows}


def print_table(result: dict) -> None:
    print(f"\n{result['suite']} ({result['file']}), linear_mha mode={result['mode']!r}")
    print("| test | original | linear_mha |\n|---|---|---|")
    for r in result["tests"]:
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
    parser.add_argument("--out", type=Path, default=Path("runs/outside"), help="pytest reports (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--offline", action="store_true",
                        help="weights a suite downloads (DETR's ImageNet ResNet) become a seeded random initialisation")
    args = parser.parse_args(argv)
    test_file = args.checkout / SUITES[args.suite]
    if not test_file.is_file():
        parser.error(f"--checkout: {test_file} does not exist; clone the project (see --help) and pass its root")
    result = compare(args.suite, test_file.resolve(), args.mode, args.out, args.offline)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if result["regressions"] and args.mode == "softmax" else 0


if __name__ == "__main__":
    sys.exit(main())
