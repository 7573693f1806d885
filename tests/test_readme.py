"""Every Python snippet in the README and in docs/ runs as written (they are a promise to a newcomer), and every
link between them points at a file that exists."""
import re
from pathlib import Path

import pytest
import torch

import linear_mha

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A ```python block, and the plain ``` block right after it when there is one: what the snippet prints.
BLOCK = re.compile(r"```python\n(.*?)```\n(?:```\n(.*?)```\n)?", flags=re.S)
SNIPPETS = [(page.relative_to(ROOT).as_posix(), index, match.group(1), match.group(2))
            for page in PAGES for index, match in enumerate(BLOCK.finditer(page.read_text()))]


def matches(printed: str, expected: str) -> bool:
    """Line by line; a line "..." in ``expected`` stands for any number of printed lines."""
    pattern = "\n".join(".*?" if line.strip() == "..." else re.escape(line.rstrip())
                        for line in expected.rstrip("\n").split("\n"))
    printed = "\n".join(line.rstrip() for line in printed.rstrip("\n").split("\n"))
    return re.fullmatch(pattern, printed, flags=re.S) is not None


def test_the_readme_has_snippets_and_shows_what_they_print():
    readme = [s for s in SNIPPETS if s[0] == "README.md"]
    assert len(readme) >= 4 and len(SNIPPETS) >= 10
    assert all(expected for _, _, code, expected in readme if "print(" in code)


def test_the_output_check_tells_a_changed_output_from_the_same():
    assert matches("a\nb\nc\nd\n", "a\n...\nd") and matches("x  \n", "x")
    assert not matches("a\nb\n", "a\nc") and not matches("a\nb\n", "a")


def test_the_readme_stays_a_readme():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("name,index,code,expected", SNIPPETS, ids=[f"{n}:{i}" for n, i, _, _ in SNIPPETS])
def test_snippet_runs_and_prints_what_the_page_shows(name, index, code, expected, tmp_path, monkeypatch, capsys):
    if "transformers" in code:  # an optional extra (.[hf]): its pages' snippets need it installed
        pytest.importorskip("transformers")
    if "onnxruntime" in code:  # the .[onnx] extra, and torch.export of masked attention (torch >= 2.6)
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
        if not hasattr(torch.compiler, "is_exporting"):
            pytest.skip("torch.export of masked attention needs torch >= 2.6")
    monkeypatch.chdir(tmp_path)
    methods = linear_mha.available_methods()
    try:
        capsys.readouterr()
        exec(compile(code, f"{name} snippet {index}", "exec"), {"__name__": "__readme__"})
    finally:  # a snippet that registers a method must not leave it to the other tests
        for extra in set(linear_mha.available_methods()) - set(methods):
            linear_mha.unregister_method(extra)
    printed = capsys.readouterr().out
    if expected is not None:
        assert matches(printed, expected), f"{name} snippet {index} printed:\n{printed}\nthe page shows:\n{expected}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_between_pages_resolve(page):
    for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
