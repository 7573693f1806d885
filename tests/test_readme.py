"""Every Python snippet in the README and in docs/ runs as written (they are a promise to a newcomer), and every
link between them points at a file that exists."""
import re
from pathlib import Path

import pytest

import linear_mha

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [(page.relative_to(ROOT).as_posix(), index, code) for page in PAGES
            for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]


def test_the_readme_has_snippets():
    assert sum(name == "README.md" for name, _, _ in SNIPPETS) >= 4 and len(SNIPPETS) >= 10


def test_the_readme_stays_a_readme():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("name,index,code", SNIPPETS, ids=[f"{n}:{i}" for n, i, _ in SNIPPETS])
def test_snippet_runs(name, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    methods = linear_mha.available_methods()
    try:
        exec(compile(code, f"{name} snippet {index}", "exec"), {"__name__": "__readme__"})
    finally:  # a snippet that registers a method must not leave it to the other tests
        for extra in set(linear_mha.available_methods()) - set(methods):
            linear_mha.unregister_method(extra)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_between_pages_resolve(page):
    for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
