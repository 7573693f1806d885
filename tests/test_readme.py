"""Every Python snippet in the README runs as written (the README is a promise to a newcomer)."""
import re
from pathlib import Path

import pytest

import linear_mha

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    methods = linear_mha.available_methods()
    try:
        exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
    finally:  # a snippet that registers a method must not leave it to the other tests
        for name in set(linear_mha.available_methods()) - set(methods):
            linear_mha.unregister_method(name)
