"""Run another project's own tests against linear_mha: PyTorch's MultiheadAttention tests with every
nn.MultiheadAttention built as a LinearMultiheadAttention, each test run twice (the original class, then ours), and
a table of what changed.

    # a PyTorch checkout of the installed release (git clone --depth 1 -b v2.14.1 https://github.com/pytorch/pytorch)
    python -m tools.outside_suites torch --checkout ~/src/pytorch --json runs/outside/torch_mha.json
    python -m tools.outside_suites torch --checkout ~/src/pytorch --mode kernel     # an approximation's differences

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
    # PyTorch's file imports torch.testing._internal, which ships with torch: the checkout gives the file only.
    "torch": "test/nn/test_multihead_attention.py",
}
# Tests that mock torch's private fused kernel (torch._native_multi_head_attention) to see that torch's own fast
# path was taken: a stand-in never calls it, by design.
BY_DESIGN = {"torch": ["test_multihead_self_attn_two_masks_fast_path_mock"]}
MODE_VARIABLE = "LINEAR_MHA_OUTSIDE_MODE"
_active = None


def pytest_configure(config):
    """As a pytest plugin: every nn.MultiheadAttention built in this session is a LinearMultiheadAttention."""
    global _active
    mode = os.environ.get(MODE_VARIABLE)
    if mode:
        import linear_mha
        _active = linear_mha.patched(mode=mode)
        _active.__enter__()


def pytest_unconfigure(config):
    if _active is not None:
        _active.__exit__(None, None, None)


def run_suite(test_file: Path, mode, report: Path, extra=()) -> dict:
    """One pytest process over test_file, with linear_mha's stand-in when ``mode`` is given: {test id: outcome}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop(MODE_VARIABLE, None)
    if mode:
        env[MODE_VARIABLE] = mode
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


def compare(suite: str, test_file: Path, mode: str, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    original = run_suite(test_file, None, out_dir / f"{suite}_original.xml")
    ours = run_suite(test_file, mode, out_dir / f"{suite}_{mode}.xml")
    rows = []
    for name in sorted(set(original) | set(ours)):
        by_design = any(name.endswith(test) or f"::{test}" in name for test in BY_DESIGN.get(suite, ()))
        rows.append({"test": name, "original": original.get(name, "absent"), "linear_mha": ours.get(name, "absent"),
                     "by_design": by_design})
    count = {side: sum(r[side] == "passed" for r in rows) for side in ("original", "linear_mha")}
    regressions = [r["test"] for r in rows if r["original"] == "passed" and r["linear_mha"] != "passed"
                   and not r["by_design"]]
    return {"suite": suite, "file": str(test_file), "mode": mode, "passed": count, "regressions": regressions,
            "tests": rows}


def print_table(result: dict) -> None:
    print(f"\n{result['suite']} ({result['file']}), linear_mha mode={result['mode']!r}")
    print(f"| test | torch's class | linear_mha |\n|---|---|---|")
    for r in result["tests"]:
        note = " (by design: mocks torch's fused kernel)" if r["by_design"] else ""
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
    args = parser.parse_args(argv)
    test_file = args.checkout / SUITES[args.suite]
    if not test_file.is_file():
        parser.error(f"--checkout: {test_file} does not exist; clone the project (see --help) and pass its root")
    result = compare(args.suite, test_file.resolve(), args.mode, args.out)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if result["regressions"] and args.mode == "softmax" else 0


if __name__ == "__main__":
    sys.exit(main())
