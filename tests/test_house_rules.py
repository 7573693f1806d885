"""House rules of CONTRIBUTING.md a reader would otherwise check by hand: every Python file stays short, and the
tests, tools and integrations read facts about methods from the registry (linear_mha/registry.py and the method
classes of linear_mha/methods/) instead of branching on method names."""
import ast
from pathlib import Path

import modes

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450


def python_files(*folders):
    """The .py files below these folders of the repository, each once (linear_mha/integrations and
    linear_mha/tools are links to integrations/ and tools/)."""
    found = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                found.setdefault(path.resolve(), path)
    return sorted(found.values())


def test_every_python_file_stays_short():
    """One idea per file, files under ~400 lines (CONTRIBUTING.md): a file past 450 is split along its seams."""
    lengths = {path: len(path.read_text().splitlines())
               for path in python_files("linear_mha", "integrations", "tools", "tests")}
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path, n in lengths.items() if n > MAX_LINES]
    assert not long, long


def _named_methods(node, names):
    """The method names a comparison in a branch's condition tests against: ``x == "taylor"``, ``x != "taylor"``,
    ``x in ("elu", "taylor")``, ``x.startswith("taylor")`` (a string searched for in another, ``"taylor" in s``,
    names none)."""
    found = set()
    for part in ast.walk(node):
        if isinstance(part, ast.Compare):
            for op, left, right in zip(part.ops, [part.left, *part.comparators], part.comparators):
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    found |= {side.value for side in (left, right) if isinstance(side, ast.Constant)} & names
                elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                    found |= {item.value for item in right.elts if isinstance(item, ast.Constant)} & names
        elif isinstance(part, ast.Call) and isinstance(part.func, ast.Attribute) \
                and part.func.attr in ("startswith", "endswith"):
            found |= {arg.value for arg in part.args if isinstance(arg, ast.Constant)} & names
    return found


def test_tests_tools_and_integrations_branch_on_no_method_name():
    """An ``if`` (or a conditional expression) on a method's name encodes a fact about that method where the next
    method will not find it: the method says it instead (a class attribute or property of registry.AttentionMethod,
    e.g. causal, exact, any_mask, needs_grid, triton_map, exports_dynamic_length), and code reads it from the
    configured method. Choosing which rows to run or to look at by name (a parametrize list, a comprehension's
    filter) and asserting what one named method does are not branches and stay allowed."""
    names = set(modes.BUILT_IN)
    branches = []
    for path in python_files("tests", "tools", "integrations"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                for name in sorted(_named_methods(node.test, names)):
                    branches.append(f"{path.relative_to(ROOT)}:{node.lineno} branches on {name!r}: "
                                    f"{ast.unparse(node.test)}")
    assert not branches, "\n".join(branches)


def test_the_branch_check_sees_a_chain():
    """The check above, on code that has each kind of branch it forbids and each kind of use it allows."""
    chain = ast.parse('if mode == "taylor":\n    x = 1\nelif mode in ("kernel", "elu"):\n    x = 2\n'
                      'y = 1 if name.startswith("hedgehog") else 2\n'
                      'if "hedgehog" in key or feature_map == "elu":\n    pass\n'
                      'rows = [r for r in rows if r["method"] == "taylor"]\nassert mode == "softmax"\n')
    branches = sorted((node for node in ast.walk(chain) if isinstance(node, (ast.If, ast.IfExp))),
                      key=lambda node: node.lineno)
    found = [_named_methods(node.test, set(modes.BUILT_IN)) for node in branches]
    assert found == [{"taylor"}, {"kernel"}, {"hedgehog"}, set()], found  # "elu" is a map, not a method
